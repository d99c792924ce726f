"""CuTe DSL twins of `replayssm.quant`: the random hash, the bit-level encoders the flush
needs, and the few float helpers both decode kernels share. Device-side only: every
function here is traced inside a `cute.kernel`.

The sm_90a stochastic rounding gives quant/minifloat.py `encode`'s bits through FP32
additions rounded toward zero (fp16x2_sr_fast, fp16x2_sr_fma; tests/test_sr_fast.py
emulates them against the encoder). The hardware forms (sm_100a / sm_103a) are single PTX instructions fed the same inputs:
`cvt.rs.satfinite.f16x2.f32` consumes rbits[12:0] for the low half and rbits[28:16] for
the high half, exactly the split of the software path (docs/format.md section 6).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ...quant.minifloat import FP16_MAX_F32_BITS, FP16_MIN_NORMAL_F32_BITS, FP16_OVERFLOW_F32_BITS

# quant/rng.py constants.
GOLDEN = 0x9E3779B9
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
# Mask that keeps the 13 random bits of each half of a checkpoint word (format.md 6).
RBITS_F16X2 = 0x1FFF1FFF


# ---------------------------------------------------------------------------------------
# Inline PTX


def inline_ptx(text: str, constraints: str, args, results=(), *, side_effects: bool = False, loc=None, ip=None):
    """Emit `text` (PTX, operands $0.. outputs first) with LLVM `constraints` over the DSL
    scalars `args`. `results`: the DSL types of the outputs; returns None, one scalar or a
    list. `side_effects=True` keeps the statement where it stands (loads meant to be
    issued early, asynchronous copies, waits)."""
    types = [r.mlir_type for r in results]
    if not types:
        ret = None
    elif len(types) == 1:
        ret = types[0]
    else:
        ret = llvm.StructType.get_literal(types)
    res = llvm.inline_asm(
        ret,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    if not types:
        return None
    if len(types) == 1:
        return results[0](res)
    return [r(llvm.extractvalue(t, res, [i], loc=loc, ip=ip)) for i, (r, t) in enumerate(zip(results, types))]


# ---------------------------------------------------------------------------------------
# Views and warp reductions shared by the kernels


def vec(ptr, offset, n: int):
    """A rank-1 view of `n` contiguous elements at `ptr + offset`."""
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
# Random hash


def mix32(x: Uint32) -> Uint32:
    """lowbias32 on a uint32 (quant/rng.py `mix32`); multiplies wrap mod 2**32."""
    x = x ^ (x >> 16)
    x = x * Uint32(MIX_M1)
    x = x ^ (x >> 15)
    x = x * Uint32(MIX_M2)
    x = x ^ (x >> 16)
    return x


def random_word(key: Uint32, index: Uint32) -> Uint32:
    """mix(key ^ index * GOLDEN) (quant/rng.py `random_words`)."""
    return mix32(key ^ (index * Uint32(GOLDEN)))


# ---------------------------------------------------------------------------------------
# Floats shared by both kernels


def bf16x2_to_f32x2(w: Uint32) -> list:
    """The two bf16 halves of a word as FP32 (exact): [bits 15:0, bits 31:16]."""
    return [(w << 16).bitcast(Float32), (w & Uint32(0xFFFF0000)).bitcast(Float32)]


def sel(cond, a, b):
    """cond ? a : b for two DSL scalars of one type (a select, no branch)."""
    return type(a)(cutlass.select_(cond, a, b))


def softplus(v: Float32) -> Float32:
    """softplus(v) = log1p(exp(v)), v itself above 20: PyTorch's CUDA softplus with
    beta = 1 and threshold = 20 (libdevice expf / log1pf, so the processed dt written
    to the ring has the reference's bits when both run on the same GPU)."""
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
# FP16 stochastic rounding (sm_90a in integer and round-toward-zero steps)


@dsl_user_op
def add_rz(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b rounded toward zero (`add.rz.f32`)."""
    return inline_ptx("add.rz.f32 $0, $1, $2;", "=f,f,f", [Float32(a), Float32(b)], [Float32], loc=loc, ip=ip)


@dsl_user_op
def f16x2_rz(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """`cvt.rz.f16x2.f32`: hi -> bits [31:16], lo -> [15:0], rounded toward zero (a
    finite input never becomes infinite; NaN becomes the canonical 0x7FFF)."""
    return inline_ptx("cvt.rz.f16x2.f32 $0, $1, $2;", "=r,f,f", [Float32(hi), Float32(lo)], [Uint32], loc=loc, ip=ip)


F16_MIN_NORMAL_BITS = FP16_MIN_NORMAL_F32_BITS
F16_MAX_BITS = FP16_MAX_F32_BITS
F16_OVERFLOW_BITS = FP16_OVERFLOW_F32_BITS


def _sr_pick(x: Float32, r: Uint32) -> Float32:
    """An FP32 value whose FP16 truncation (toward zero) is the stochastic rounding of
    x with the 13 random bits r (the reference encoder's result, see fp16x2_sr_fast)."""
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
    v = sel(a >= Uint32(F16_MIN_NORMAL_BITS), vn, vs)
    # |x| >= 65536 up to infinity: the encoder's satfinite gives +-65504. Done here, not
    # left to the truncation, because r added to values near the FP32 maximum carries
    # into the all-ones exponent (an infinity or NaN pattern).
    big = (a - Uint32(F16_OVERFLOW_BITS)) <= Uint32(0x7F800000 - F16_OVERFLOW_BITS)
    v = sel(big, sign | Uint32(F16_MAX_BITS), v)
    # NaN passes through unchanged (adding r to a large payload could carry into the
    # sign bit and make it -0); the truncating conversion returns the canonical 0x7FFF.
    v = sel(a > Uint32(0x7F800000), b, v)
    return v.bitcast(Float32)


def fp16x2_sr_fast(lo: Float32, hi: Float32, word: Uint32) -> Uint32:
    """FP16 stochastic rounding of a pair in integer and round-toward-zero steps (sm_90a),
    bit for bit quant/minifloat.py `encode`.

    With u = |x| and r the 13 random bits, the encoder computes
    floor((floor(u 2**(37 - s)) + r) / 2**13) codes above the sign, i.e. FP16 truncation
    of u + r ulp16(u) 2**-13 with exact addition:
    - normal results (u >= 2**-14): ulp16(u) 2**-13 is the FP32 ulp of u and the sum is the
      integer add of r to the FP32 bits (a carry into the exponent moves to the next
      binade exactly as the value does);
    - subnormal results: ulp16 2**-13 = 2**-37; FP32 addition rounded toward zero
      truncates on a grid (<= 2**-37) finer than FP16's 2**-24, so the two truncations
      compose to the one the encoder makes.
    `cvt.rz.f16x2.f32` then truncates both, satfinite for free (rounding toward zero
    never overflows to infinity); |x| >= 65536 (infinities included) is mapped to +-65504
    first and NaN gives 0x7FFF, as in the encoder. tests/test_sr_fast.py emulates these
    instructions on the CPU against the encoder."""
    return f16x2_rz(_sr_pick(lo, word & Uint32(0x1FFF)), _sr_pick(hi, (word >> 16) & Uint32(0x1FFF)))


@dsl_user_op
def popc(v: Int32, *, loc=None, ip=None) -> Int32:
    """The number of set bits of v (`popc.b32`)."""
    return inline_ptx("popc.b32 $0, $1;", "=r,r", [Int32(v)], [Int32], loc=loc, ip=ip)


@dsl_user_op
def lowest_set_bit(v: Int32, *, loc=None, ip=None) -> Int32:
    """The index of v's lowest set bit (v != 0): `bfind` of v & -v."""
    return inline_ptx(
        "{\n\t.reg .b32 t;\n\tneg.s32 t, $1;\n\tand.b32 t, t, $1;\n\tbfind.u32 $0, t;\n\t}",
        "=r,r", [Int32(v)], [Int32], loc=loc, ip=ip,
    )


@dsl_user_op
def clamp_finite(x: Float32, *, loc=None, ip=None) -> Float32:
    """x with +-infinity replaced by +-FP32 max (`min.NaN.xorsign.abs.f32` against FP32
    max: min(|x|, max) with x's sign; NaN stays NaN, signed zeros keep their sign)."""
    return inline_ptx("min.NaN.xorsign.abs.f32 $0, $1, 0f7F7FFFFF;", "=f,f", [Float32(x)], [Float32], loc=loc, ip=ip)


@dsl_user_op
def fma_rz(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c rounded once, toward zero (`fma.rz.f32`)."""
    return inline_ptx("fma.rz.f32 $0, $1, $2, $3;", "=f,f,f,f", [Float32(a), Float32(b), Float32(c)], [Float32], loc=loc, ip=ip)


def _sr_fma_pick(x: Float32, r: Uint32) -> Float32:
    """_sr_pick's value (its FP16 truncation is the encoder's stochastic rounding of x
    with the 13 random bits r) in fewer steps: x + sign(x) r 2**(E - 23) rounded toward
    zero by one fma, E = max(exponent of x, -14).
    - Normal FP16 results (|x| >= 2**-14): r 2**(E - 23) is r FP32 ulps of x, the sum
      _sr_pick's integer add makes (where the add carries into the next binade, both
      truncate to that binade's first FP16 value, the encoder's result);
    - FP16-subnormal results: r 2**-37, _sr_pick's add.rz operand;
    - infinities are first clamped to +-FP32 max (the sum then truncates to +-65504, as
      the encoder saturates); NaN stays NaN (the conversion gives 0x7FFF).
    r 2**-23 is (r | 0x3F800000) as FP32 minus 1, exact (13 significant bits)."""
    xc = clamp_finite(x)
    b = xc.bitcast(Uint32)
    em = cutlass.max(b & Uint32(0x7F800000), Uint32(113 << 23))
    s = (em | (b & Uint32(0x80000000))).bitcast(Float32)
    rf = (r | Uint32(0x3F800000)).bitcast(Float32) - Float32(1.0)
    return fma_rz(rf, s, xc)


def fp16x2_sr_fma(lo: Float32, hi: Float32, word: Uint32) -> Uint32:
    """fp16x2_sr_fast's bits through _sr_fma_pick (about 8 instructions a value instead
    of 13; tests/test_sr_fast.py emulates it against the encoder)."""
    return f16x2_rz(_sr_fma_pick(lo, word & Uint32(0x1FFF)), _sr_fma_pick(hi, (word >> 16) & Uint32(0x1FFF)))


def sr_normal_range(x: Float32):
    """True when FP16 stochastic rounding of x has a normal, finite result for every
    random value: 2**-14 <= |x| < 65536 (one unsigned compare; NaN and infinities fail)."""
    a = x.bitcast(Uint32) & Uint32(0x7FFFFFFF)
    return (a - Uint32(F16_MIN_NORMAL_BITS)) < Uint32(F16_OVERFLOW_BITS - F16_MIN_NORMAL_BITS)


def fp16x2_sr_normal(lo: Float32, hi: Float32, word: Uint32) -> Uint32:
    """fp16x2_sr_fast for two values that pass `sr_normal_range`: its normal-result path
    alone, the random bits added to the FP32 bits, then the truncating conversion (a
    carry up to 65536 truncates to 65504, as the encoder saturates)."""
    vlo = (lo.bitcast(Uint32) + (word & Uint32(0x1FFF))).bitcast(Float32)
    vhi = (hi.bitcast(Uint32) + ((word >> 16) & Uint32(0x1FFF))).bitcast(Float32)
    return f16x2_rz(vlo, vhi)


@dsl_user_op
def opaque_u32(v: Int32, *, loc=None, ip=None) -> Int32:
    """v through an inline-PTX move: the compiler cannot reason about the result (a loop
    over it stays a loop)."""
    return inline_ptx("mov.b32 $0, $1;", "=r,r", [Int32(v)], [Int32], side_effects=True, loc=loc, ip=ip)


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
    """`cvt.rn.satfinite.e4m3x2.f32 d, a, b`: a (hi) -> d[15:8], b (lo) -> d[7:0]."""
    return inline_ptx(
        "{\n\t.reg .b16 q;\n\tcvt.rn.satfinite.e4m3x2.f32 q, $1, $2;\n\tcvt.u32.u16 $0, q;\n\t}",
        "=r,f,f", [Float32(hi), Float32(lo)], [Uint32], loc=loc, ip=ip,
    )


@dsl_user_op
def ld_global_u32_if(addr, pred, *, loc=None, ip=None) -> Uint32:
    """The 32-bit word at global address `addr` (Int64) if `pred` (Int32) is nonzero,
    else 0: a predicated load, so a run of them issues back to back instead of one
    branch (and one memory latency) after another. Marked as having side effects so
    the compiler keeps it where the kernel put it (before the waits that follow) rather
    than sinking it next to its first use."""
    return inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\tmov.b32 $0, 0;\n\t@p ld.global.b32 $0, [$1];\n\t}",
        "=r,l,r", [Int64(addr), Int32(pred)], [Uint32], side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ld_global_u16_if(addr, pred, *, loc=None, ip=None) -> Uint32:
    """The 16-bit word at global address `addr` (Int64), zero-extended, if `pred` (Int32)
    is nonzero, else 0 (as ld_global_u32_if)."""
    return inline_ptx(
        "{\n\t.reg .pred p;\n\t.reg .b16 h;\n\tsetp.ne.s32 p, $2, 0;\n\tmov.b16 h, 0;\n\t"
        "@p ld.global.b16 h, [$1];\n\tcvt.u32.u16 $0, h;\n\t}",
        "=r,l,r", [Int64(addr), Int32(pred)], [Uint32], side_effects=True, loc=loc, ip=ip,
    )


def ld_global_dt_if(ptr, offset, pred) -> Float32:
    """Element `offset` of the f32, bf16 or f16 tensor at `ptr` as FP32 (exact) if `pred`,
    else 0.0, by a predicated load of its width (the element type is static)."""
    addr = (ptr + offset).toint()
    if ptr.dtype.width == 32:
        return ld_global_u32_if(addr, pred).bitcast(Float32)
    half = ld_global_u16_if(addr, pred)
    if ptr.dtype is BFloat16:
        return (half << 16).bitcast(Float32)
    return f16x2_to_f32x2(half)[0]


@dsl_user_op
def ld_global_v4_u32(addr, hint: str = "", *, loc=None, ip=None) -> list:
    """The 16 bytes at global address `addr` (Int64, 16-byte aligned) as four words,
    issued where it stands (see ld_global_u32_if). `hint`: PTX qualifiers after
    `ld.global` (e.g. ".L2::256B")."""
    return ld_global_v4_u32_if(addr, Int32(1), hint, loc=loc, ip=ip)


@dsl_user_op
def ld_global_v4_u32_if(addr, pred, hint: str = "", *, loc=None, ip=None) -> list:
    """The 16 bytes at global address `addr` (Int64, 16-byte aligned) as four words if
    `pred` (Int32) is nonzero, else zeros (a predicated vector load; `hint` as in
    ld_global_v4_u32)."""
    return inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $5, 0;\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\t"
        f"mov.b32 $2, 0;\n\tmov.b32 $3, 0;\n\t@p ld.global{hint}.v4.b32 {{$0, $1, $2, $3}}, [$4];\n\t}}",
        "=r,=r,=r,=r,l,r", [Int64(addr), Int32(pred)], [Uint32] * 4, side_effects=True, loc=loc, ip=ip,
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
    """The four e4m3 codes of `word` as two f16 pairs (exact, `cvt.rn.f16x2.e4m3x2`,
    sm_89+): [codes 0, 1], [codes 2, 3], the lower code in the low half."""
    return inline_ptx(
        "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $2;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, l;\n\tcvt.rn.f16x2.e4m3x2 $1, h;\n\t}",
        "=r,=r,r", [Uint32(word)], [Uint32, Uint32], loc=loc, ip=ip,
    )


@dsl_user_op
def f32x2_to_f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """`cvt.rn.f16x2.f32`: f16(hi) -> bits [31:16], f16(lo) -> [15:0]."""
    return inline_ptx("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [Float32(hi), Float32(lo)], [Uint32], loc=loc, ip=ip)


@dsl_user_op
def f32x2_to_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """`cvt.rn.bf16x2.f32`: bf16(hi) -> bits [31:16], bf16(lo) -> [15:0]."""
    return inline_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [Float32(hi), Float32(lo)], [Uint32], loc=loc, ip=ip)


@dsl_user_op
def prmt(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """`prmt.b32`: byte i of the result is byte (selector >> 4 i) & 7 of b:a (a bytes 0-3,
    b bytes 4-7)."""
    return inline_ptx(
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", [Uint32(a), Uint32(b)], [Uint32], loc=loc, ip=ip,
    )


@dsl_user_op
def mul_f16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Halfwise f16 product of two words (`mul.rn.f16x2`)."""
    return inline_ptx("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [Uint32(a), Uint32(b)], [Uint32], loc=loc, ip=ip)


@dsl_user_op
def max_u16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Halfwise unsigned maximum of two words (`max.u16x2`, sm_90+)."""
    return inline_ptx("max.u16x2 $0, $1, $2;", "=r,r,r", [Uint32(a), Uint32(b)], [Uint32], loc=loc, ip=ip)


@dsl_user_op
def st_global_v4_u32(addr, words, *, loc=None, ip=None) -> None:
    """Store four words at global address `addr` (Int64, 16-byte aligned)."""
    inline_ptx(
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", [Int64(addr), *[Uint32(w) for w in words]],
        side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ld_global_v2_u32_if(addr, pred, *, loc=None, ip=None) -> list:
    """The 8 bytes at global address `addr` (Int64, 8-byte aligned) as two words if
    `pred` (Int32) is nonzero, else zeros."""
    return inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\t"
        "@p ld.global.v2.b32 {$0, $1}, [$2];\n\t}",
        "=r,=r,l,r", [Int64(addr), Int32(pred)], [Uint32] * 2, side_effects=True, loc=loc, ip=ip,
    )


__all__ = [
    "vec",
    "vec_aligned",
    "xor_reduce",
    "inline_ptx",
    "bf16x2_to_f32x2",
    "ld_global_u32_if",
    "ld_global_v4_u32_if",
    "ld_global_v4_u32",
    "f16x2_to_f32x2",
    "e4m3x4_to_f16x2x2",
    "f32x2_to_f16x2",
    "f32x2_to_bf16x2",
    "prmt",
    "max_u16x2",
    "mul_f16x2",
    "st_global_v4_u32",
    "ld_global_v2_u32_if",
    "GOLDEN",
    "mix32",
    "random_word",
    "sel",
    "softplus",
    "pow2_exponent_above",
    "exp2_int",
    "fp16x2_sr_fast",
    "add_rz",
    "f16x2_rz",
    "fp16x2_sr_hw",
    "e4m3x2_rn_hw",
]
