"""CuTe DSL twins of `replayssm.quant` (the random hash, the flush's encoders), inline-PTX
loads, stores and conversions, and the float helpers the kernels share; every function is
traced inside a `cute.kernel`. The sm_90a stochastic rounding and the sm_100a / sm_103a
`cvt.rs` give the same bits from the same random-bit split (docs/format.md section 6).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ...quant.minifloat import FP16_MAX_F32_BITS, FP16_MIN_NORMAL_F32_BITS, FP16_OVERFLOW_F32_BITS
from ...quant.rng import GOLDEN, MIX_M1, MIX_M2

# Mask that keeps the 13 random bits of each half of a checkpoint word (format.md 6).
RBITS_F16X2 = 0x1FFF1FFF


def inline_ptx(text: str, constraints: str, args, results=(), *, side_effects=False, loc=None, ip=None):
    """Emit `text` (PTX, operands $0.. outputs first) with LLVM `constraints` over the DSL
    scalars `args`. `results`: the DSL types of the outputs; returns None, one scalar or a
    list. `side_effects=True` keeps the statement where it stands (loads meant to be
    issued early, asynchronous copies, waits)."""
    types = [r.mlir_type for r in results]
    ret = (types[0] if len(types) == 1 else llvm.StructType.get_literal(types)) if types else None
    res = llvm.inline_asm(
        ret, [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints, has_side_effects=side_effects,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    if len(types) <= 1:
        return results[0](res) if types else None
    return [r(llvm.extractvalue(t, res, [i], loc=loc, ip=ip)) for i, (r, t) in enumerate(zip(results, types))]


def _ptx_op(text: str, constraints: str, arg_types, result, *, side_effects: bool = False):
    """A DSL op of one PTX statement `text`: its arguments converted to `arg_types`, one
    result of DSL type `result`."""

    @dsl_user_op
    def op(*args, loc=None, ip=None):
        conv = [t(a) for t, a in zip(arg_types, args, strict=True)]
        return inline_ptx(text, constraints, conv, [result], side_effects=side_effects, loc=loc, ip=ip)

    return op


add_rz = _ptx_op("add.rz.f32 $0, $1, $2;", "=f,f,f", [Float32] * 2, Float32)
fma_rz = _ptx_op("fma.rz.f32 $0, $1, $2, $3;", "=f,f,f,f", [Float32] * 3, Float32)
popc = _ptx_op("popc.b32 $0, $1;", "=r,r", [Int32], Int32)
mul_f16x2 = _ptx_op("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [Uint32] * 2, Uint32)
max_u16x2 = _ptx_op("max.u16x2 $0, $1, $2;", "=r,r,r", [Uint32] * 2, Uint32)  # sm_90+
# The index of the lowest set bit of v != 0: `bfind` of v & -v.
lowest_set_bit = _ptx_op(
    "{\n\t.reg .b32 t;\n\tneg.s32 t, $1;\n\tand.b32 t, t, $1;\n\tbfind.u32 $0, t;\n\t}", "=r,r",
    [Int32], Int32,
)
# min(|x|, FP32 max) with x's sign: +-infinity to +-FP32 max; NaN and signed zeros kept.
clamp_finite = _ptx_op("min.NaN.xorsign.abs.f32 $0, $1, 0f7F7FFFFF;", "=f,f", [Float32], Float32)
# A move the compiler cannot see through (a loop over its result stays a loop).
opaque_u32 = _ptx_op("mov.b32 $0, $1;", "=r,r", [Int32], Int32, side_effects=True)


def _f32x2_cvt(cvt: str):
    """`cvt` of an FP32 pair (lo, hi) to a 16-bit pair: hi -> bits [31:16], lo -> [15:0]."""

    @dsl_user_op
    def op(lo, hi, *, loc=None, ip=None) -> Uint32:
        args = [Float32(hi), Float32(lo)]
        return inline_ptx(f"{cvt} $0, $1, $2;", "=r,f,f", args, [Uint32], loc=loc, ip=ip)

    return op


f32x2_to_f16x2 = _f32x2_cvt("cvt.rn.f16x2.f32")
f32x2_to_bf16x2 = _f32x2_cvt("cvt.rn.bf16x2.f32")
# Toward zero: a finite input never becomes infinite; NaN becomes the canonical 0x7FFF.
f16x2_rz = _f32x2_cvt("cvt.rz.f16x2.f32")


def vec(ptr, offset, n: int):
    return cute.make_tensor(ptr + offset, cute.make_layout(n))


def vec_aligned(ptr, offset, n: int):
    """`vec` at an offset the caller guarantees to be a multiple of n elements (with an
    n-element-aligned base), so the access compiles to one vector instruction."""
    return cute.make_tensor(ptr + cute.assume(offset, divby=n), cute.make_layout(n))


def xor_reduce(v, width: int, op):
    """op over `width` adjacent lanes (a power of two) by xor shuffles, result in every
    lane; every lane of the warp must execute it."""
    off = 1
    while off < width:
        v = op(v, cute.arch.shuffle_sync_bfly(v, off))
        off *= 2
    return v


# ---------------------------------------------------------------------------------------
# Random hash and float helpers


def mix32(x: Uint32) -> Uint32:
    """lowbias32 on a uint32 (quant/rng.py `mix32`); multiplies wrap mod 2**32."""
    x = x ^ (x >> 16)
    x = x * Uint32(MIX_M1)
    x = x ^ (x >> 15)
    x = x * Uint32(MIX_M2)
    return x ^ (x >> 16)


def random_word(key: Uint32, index: Uint32) -> Uint32:
    """mix(key ^ index * GOLDEN) (quant/rng.py `random_words`)."""
    return mix32(key ^ (index * Uint32(GOLDEN)))


def bf16x2_to_f32x2(w: Uint32) -> list:
    """The two bf16 halves of a word as FP32 (exact): [bits 15:0, bits 31:16]."""
    return [(w << 16).bitcast(Float32), (w & Uint32(0xFFFF0000)).bitcast(Float32)]


def sel(cond, a, b):
    """cond ? a : b for two DSL scalars of one type (a select, no branch)."""
    return type(a)(cutlass.select_(cond, a, b))


def softplus(v: Float32) -> Float32:
    """PyTorch's CUDA softplus (beta 1, threshold 20) with libdevice expf / log1pf, so the
    processed dt written to the ring has the reference's bits on the same GPU."""
    return sel(v > Float32(20.0), v, cute.math.log1p(cute.math.exp(v)))


def pow2_exponent_above(abs_bits: Int32, mant_limit: int, e_off: int) -> Int32:
    """E = ceil(log2(amax / L)), L = (1 + mant_limit / 2**23) * 2**e_off, from the FP32
    bits of amax >= 0 (any NaN or Inf clamps to 100); 0 for zero or FP32-subnormal
    amax; clamped to [-100, 100] (quant/formats.py `_pow2_exponent_above`)."""
    ef = abs_bits >> 23
    e = ef - Int32(127 + e_off) + sel((abs_bits & Int32(0x7FFFFF)) > Int32(mant_limit), Int32(1), Int32(0))
    e = sel(ef == Int32(0), Int32(0), e)
    return cutlass.max(cutlass.min(e, Int32(100)), Int32(-100))


def exp2_int(e: Int32) -> Float32:
    """2**e as FP32 for e in [-126, 127], from bits (exact)."""
    return ((e + Int32(127)) << 23).bitcast(Float32)


# ---------------------------------------------------------------------------------------
# FP16 stochastic rounding, sm_90a: bit for bit quant/minifloat.py `encode`, derived in
# docs/format.md section 6 and emulated against the encoder by tests/test_sr_fast.py.


def _sr_pick(x: Float32, r: Uint32) -> Float32:
    """An FP32 value whose FP16 truncation is the stochastic rounding of x with the 13
    random bits r."""
    b = x.bitcast(Uint32)
    a = b & Uint32(0x7FFFFFFF)
    sign = b & Uint32(0x80000000)
    # Normal FP16 result: r added below the 10 kept mantissa bits (carries propagate
    # into the exponent exactly as the integer encoder's do).
    vn = b + r
    # FP16-subnormal result: x + sign(x) r 2**-37 rounded toward zero; (2**23 + r) is
    # exact in FP32 and the fma removes 2**23 * 2**-37 = 2**-14 exactly.
    mag = ((r | Uint32(0x4B000000)).bitcast(Float32) * Float32(2.0**-37) - Float32(2.0**-14)).bitcast(Uint32)
    vs = add_rz(x, (mag | sign).bitcast(Float32)).bitcast(Uint32)
    v = sel(a >= Uint32(FP16_MIN_NORMAL_F32_BITS), vn, vs)
    # |x| >= 65536 up to infinity: the encoder's satfinite gives +-65504. Done here, not
    # left to the truncation, because r added to values near the FP32 maximum carries
    # into the all-ones exponent (an infinity or NaN pattern).
    big = (a - Uint32(FP16_OVERFLOW_F32_BITS)) <= Uint32(0x7F800000 - FP16_OVERFLOW_F32_BITS)
    v = sel(big, sign | Uint32(FP16_MAX_F32_BITS), v)
    # NaN passes through unchanged (adding r to a large payload could carry into the
    # sign bit and make it -0); the truncating conversion returns the canonical 0x7FFF.
    v = sel(a > Uint32(0x7F800000), b, v)
    return v.bitcast(Float32)


def fp16x2_sr_fast(lo: Float32, hi: Float32, word: Uint32) -> Uint32:
    """FP16 stochastic rounding of a pair by integer and round-toward-zero steps, then one
    truncating conversion; lo takes word[12:0], hi word[28:16]."""
    return f16x2_rz(_sr_pick(lo, word & Uint32(0x1FFF)), _sr_pick(hi, (word >> 16) & Uint32(0x1FFF)))


def _sr_fma_pick(x: Float32, r: Uint32) -> Float32:
    """_sr_pick's value in fewer steps: x + sign(x) r 2**(E - 23) rounded toward zero by
    one fma, E = max(exponent of x, -14): r FP32 ulps of x for normal FP16 results, r
    2**-37 for subnormal ones. Infinities are clamped to +-FP32 max first (the sum then
    truncates to +-65504, as the encoder saturates). r 2**-23 is (r | 0x3F800000) as
    FP32 minus 1, exact."""
    xc = clamp_finite(x)
    b = xc.bitcast(Uint32)
    em = cutlass.max(b & Uint32(0x7F800000), Uint32(113 << 23))
    s = (em | (b & Uint32(0x80000000))).bitcast(Float32)
    rf = (r | Uint32(0x3F800000)).bitcast(Float32) - Float32(1.0)
    return fma_rz(rf, s, xc)


def fp16x2_sr_fma(lo: Float32, hi: Float32, word: Uint32) -> Uint32:
    """fp16x2_sr_fast's bits through _sr_fma_pick (about 8 instructions a value, not 13)."""
    return f16x2_rz(_sr_fma_pick(lo, word & Uint32(0x1FFF)), _sr_fma_pick(hi, (word >> 16) & Uint32(0x1FFF)))


def sr_normal_range(x: Float32):
    """True when FP16 stochastic rounding of x has a normal, finite result for every
    random value: 2**-14 <= |x| < 65536 (one unsigned compare; NaN and infinities fail)."""
    a = x.bitcast(Uint32) & Uint32(0x7FFFFFFF)
    return (a - Uint32(FP16_MIN_NORMAL_F32_BITS)) < Uint32(FP16_OVERFLOW_F32_BITS - FP16_MIN_NORMAL_F32_BITS)


def fp16x2_sr_normal(lo: Float32, hi: Float32, word: Uint32) -> Uint32:
    """fp16x2_sr_fast for two values that pass `sr_normal_range`: the random bits added
    to the FP32 bits, then the truncation (a carry up to 65536 truncates to 65504)."""
    vlo = (lo.bitcast(Uint32) + (word & Uint32(0x1FFF))).bitcast(Float32)
    vhi = (hi.bitcast(Uint32) + ((word >> 16) & Uint32(0x1FFF))).bitcast(Float32)
    return f16x2_rz(vlo, vhi)


@cute.jit
def fp16x2_sr_voted(pairs, words) -> list:
    """fp16x2_sr_fast of each (lo, hi) of `pairs` with its word, for a whole warp: when
    every value of every lane passes `sr_normal_range` (vote.all) only the normal path
    runs (about 4 instructions a value instead of 13); else the general one. The general
    path sits in a loop of 0 or 1 trips whose count the compilers cannot see (an if-else,
    or a visible 0-or-1-trip loop, was turned into predicated code, so both paths ran)."""
    ok = Int32(1)
    for lo, hi in pairs:
        ok = ok & Int32(sr_normal_range(lo)) & Int32(sr_normal_range(hi))
    out = [fp16x2_sr_normal(lo, hi, w) for (lo, hi), w in zip(pairs, words)]
    general = opaque_u32(Int32(1) - Int32(cute.arch.vote_all_sync(ok != Int32(0))))
    # Each trip reads the previous one's results through a mask the compilers cannot see
    # is 0: a body that only overwrites would be folded into one conditional pass.
    zero = Uint32(opaque_u32(Int32(0)))
    for _ in range(general):
        out = [fp16x2_sr_fast(lo, hi, w ^ (o & zero)) for (lo, hi), w, o in zip(pairs, words, out)]
    return out


# ---------------------------------------------------------------------------------------
# Hardware encoders (sm_100a / sm_103a)


@dsl_user_op
def fp16x2_sr_hw(lo: Float32, hi: Float32, word: Uint32, *, loc=None, ip=None) -> Uint32:
    """`cvt.rs.satfinite.f16x2.f32 d, a, b, rbits`: a (hi) -> d[31:16] with rbits[28:16],
    b (lo) -> d[15:0] with rbits[12:0]."""
    rbits = Uint32(word) & Uint32(RBITS_F16X2)
    return inline_ptx(
        "cvt.rs.satfinite.f16x2.f32 $0, $1, $2, $3;", "=r,f,f,r", [Float32(hi), Float32(lo), rbits], [Uint32],
        loc=loc, ip=ip,
    )


@dsl_user_op
def e4m3x2_rn_hw(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """hi -> d[15:8], lo -> d[7:0]."""
    return inline_ptx(
        "{\n\t.reg .b16 q;\n\tcvt.rn.satfinite.e4m3x2.f32 q, $1, $2;\n\tcvt.u32.u16 $0, q;\n\t}",
        "=r,f,f", [Float32(hi), Float32(lo)], [Uint32], loc=loc, ip=ip,
    )


# ---------------------------------------------------------------------------------------
# Loads, stores and conversions


def _ld_global_if(addr, pred, n: int, hint: str, loc, ip) -> list:
    """n words (1, 2 or 4) at global address `addr` (Int64, 4n-byte aligned) if `pred`
    (Int32) is nonzero, else zeros. A predicated load, so a run of them issues back to
    back rather than one branch (and one memory latency) after another; marked as having
    side effects so the compiler keeps it where the kernel put it (before the waits that
    follow) rather than sinking it next to its first use. `hint`: PTX qualifiers after
    `ld.global` (e.g. ".L2::256B")."""
    regs = ", ".join(f"${i}" for i in range(n))
    dst, vec_n = (regs, "") if n == 1 else (f"{{{regs}}}", f".v{n}")
    zeros = "".join(f"mov.b32 ${i}, 0;\n\t" for i in range(n))
    return inline_ptx(
        f"{{\n\t.reg .pred p;\n\tsetp.ne.s32 p, ${n + 1}, 0;\n\t{zeros}"
        f"@p ld.global{hint}{vec_n}.b32 {dst}, [${n}];\n\t}}",
        ",".join(["=r"] * n + ["l", "r"]), [Int64(addr), Int32(pred)], [Uint32] * n,
        side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ld_global_u32_if(addr, pred, *, loc=None, ip=None) -> Uint32:
    return _ld_global_if(addr, pred, 1, "", loc, ip)


@dsl_user_op
def ld_global_v2_u32_if(addr, pred, *, loc=None, ip=None) -> list:
    return _ld_global_if(addr, pred, 2, "", loc, ip)


@dsl_user_op
def ld_global_v4_u32_if(addr, pred, hint: str = "", *, loc=None, ip=None) -> list:
    return _ld_global_if(addr, pred, 4, hint, loc, ip)


@dsl_user_op
def ld_global_v4_u32(addr, hint: str = "", *, loc=None, ip=None) -> list:
    return _ld_global_if(addr, Int32(1), 4, hint, loc, ip)


def ld_global_dt_if(ptr, offset, pred) -> Float32:
    """Element `offset` of the f32, bf16 or f16 tensor at `ptr` as FP32 (exact) if `pred`,
    else 0.0, by a predicated load of its width (as _ld_global_if; the type is static)."""
    addr = (ptr + offset).toint()
    if ptr.dtype.width == 32:
        return ld_global_u32_if(addr, pred).bitcast(Float32)
    half = inline_ptx(  # zero-extended
        "{\n\t.reg .pred p;\n\t.reg .b16 h;\n\tsetp.ne.s32 p, $2, 0;\n\tmov.b16 h, 0;\n\t"
        "@p ld.global.b16 h, [$1];\n\tcvt.u32.u16 $0, h;\n\t}",
        "=r,l,r", [Int64(addr), Int32(pred)], [Uint32], side_effects=True,
    )
    if ptr.dtype is BFloat16:
        return (half << 16).bitcast(Float32)
    return f16x2_to_f32x2(half)[0]


@dsl_user_op
def st_global_v4_u32(addr, words, *, loc=None, ip=None) -> None:
    """Store four words at global address `addr` (Int64, 16-byte aligned)."""
    inline_ptx(
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", [Int64(addr), *[Uint32(w) for w in words]],
        side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def f16x2_to_f32x2(word: Uint32, *, loc=None, ip=None) -> list:
    """The FP16 halves [15:0], [31:16] of `word` as FP32 (exact)."""
    return inline_ptx(
        "{\n\t.reg .b16 h0, h1;\n\tmov.b32 {h0, h1}, $2;\n\tcvt.f32.f16 $0, h0;\n\tcvt.f32.f16 $1, h1;\n\t}",
        "=f,=f,r", [Uint32(word)], [Float32, Float32], loc=loc, ip=ip,
    )


@dsl_user_op
def e4m3x4_to_f16x2x2(word: Uint32, *, loc=None, ip=None) -> list:
    """The four e4m3 codes of `word` as two f16 pairs (exact, sm_89+): [codes 0, 1],
    [codes 2, 3], the lower code in the low half."""
    return inline_ptx(
        "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $2;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, l;\n\tcvt.rn.f16x2.e4m3x2 $1, h;\n\t}",
        "=r,=r,r", [Uint32(word)], [Uint32, Uint32], loc=loc, ip=ip,
    )


@dsl_user_op
def prmt(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """Byte i of the result is byte (selector >> 4 i) & 7 of b:a (a bytes 0-3, b 4-7)."""
    return inline_ptx(
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", [Uint32(a), Uint32(b)], [Uint32], loc=loc, ip=ip,
    )


__all__ = [
    "vec", "vec_aligned", "xor_reduce", "inline_ptx", "bf16x2_to_f32x2", "ld_global_u32_if",
    "ld_global_v4_u32_if", "ld_global_v4_u32", "ld_global_v2_u32_if", "ld_global_dt_if", "st_global_v4_u32",
    "f16x2_to_f32x2", "e4m3x4_to_f16x2x2", "f32x2_to_f16x2", "f32x2_to_bf16x2", "prmt", "max_u16x2",
    "mul_f16x2", "GOLDEN", "mix32", "random_word", "sel", "softplus", "pow2_exponent_above", "exp2_int",
    "popc", "lowest_set_bit", "add_rz", "f16x2_rz", "fp16x2_sr_fast", "fp16x2_sr_fma", "fp16x2_sr_voted",
    "fp16x2_sr_hw", "e4m3x2_rn_hw",
]
