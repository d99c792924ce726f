"""Triton twins of `replayssm.quant`: the random hash and the bit-level encoders.

Every function works on integer bits (float values enter and leave through bitcasts), in
the integer steps of quant/minifloat.py and quant/rng.py, because the Triton interpreter
does not round float downcasts to nearest and because the kernels must be bit-exact with
the reference on every backend. Hash arithmetic is uint32 (wrapping multiplies); encoder
arithmetic is int32 with every intermediate kept in [0, 2**31).
"""

from __future__ import annotations

import triton
import triton.language as tl

# quant/rng.py constants (GOLDEN, the two lowbias32 multipliers).
GOLDEN = 0x9E3779B9
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
ONE_SIXTH_BITS = tl.constexpr(0x3E2AAAAB)  # FP32(1/6), the constant quant/formats.py multiplies by


@triton.jit
def mix32(x):
    """lowbias32 on uint32 values (quant/rng.py `mix32`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def stream_key(seed_key, slot, position):
    """Per-row stream tag (quant/rng.py `stream_key`): `seed_key` the host-computed
    `seed_key(seed)` as an int32 bit pattern, `slot` and `position` any integer type
    (their low 32 bits are used, as the reference masks with 2**32 - 1). Returns uint32."""
    k = seed_key.to(tl.uint32, bitcast=True)
    k = mix32(k ^ slot.to(tl.int32).to(tl.uint32, bitcast=True))
    k = mix32(k ^ position.to(tl.int32).to(tl.uint32, bitcast=True))
    return k


@triton.jit
def random_word(key, index):
    """mix(key ^ index * GOLDEN) on uint32 (quant/rng.py `random_words`)."""
    return mix32(key ^ (index.to(tl.uint32, bitcast=True) * 0x9E3779B9))


@triton.jit
def f32_exp2(e):
    """2**e as FP32 for int32 e in [-126, 127], built from bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_exponent_above(amax_bits, MANT_LIMIT: tl.constexpr, E_OFF: tl.constexpr):
    """E = ceil(log2(amax / L)), L = (1 + MANT_LIMIT / 2**23) * 2**E_OFF, from the FP32
    bits of amax >= 0; 0 for zero / FP32-subnormal amax; clamped to [-100, 100]
    (quant/formats.py `_pow2_exponent_above`)."""
    ef = (amax_bits >> 23) & 0xFF
    mant = amax_bits & 0x7FFFFF
    e = ef - (127 + E_OFF) + (mant > MANT_LIMIT).to(tl.int32)
    e = tl.where(ef == 0, 0, e)
    return tl.minimum(tl.maximum(e, -100), 100)


@triton.jit
def encode_minifloat(
    x,
    rbits,
    EXP_BITS: tl.constexpr,
    MAN_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    NAN_CODE: tl.constexpr,
    RAND_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """FP32 `x` -> int32 codes (sign included), saturating; quant/minifloat.py `encode`.

    Nearest-even, or stochastic with the low RAND_BITS bits of int32/uint32 `rbits`.
    The reference works in int64 and clamps the shift at 40; here every intermediate stays
    below 2**31 with two exact rewrites, valid because a shift beyond the normal one
    happens only for subnormal results, whose significand v is below 2**24:
      nearest: (v + 2**(s-1) - 1 + bit) >> s is 0 for every s >= 25, so s is clamped at 30;
      stochastic, s >= k: (v + (r << (s-k))) >> s == ((v >> (s-k)) + r) >> k, and
      v >> t == 0 for t >= 31, so t = s - k is clamped at 31.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    ef = a >> 23
    EMIN_FIELD: tl.constexpr = 128 - BIAS
    BASE_SHIFT: tl.constexpr = 23 - MAN_BITS
    normal = ef >= EMIN_FIELD
    # Normal results: rebias the exponent field in place (carries roll into it).
    v_norm = a - ((127 - BIAS) << 23)
    # Subnormal results: explicit significand, shifted further right.
    mant = (a & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0)
    extra = tl.maximum(EMIN_FIELD - tl.maximum(ef, 1), 0)
    v = tl.where(normal, v_norm, mant)
    shift = tl.where(normal, BASE_SHIFT, tl.minimum(BASE_SHIFT + extra, 40))
    if STOCHASTIC:
        r = rbits.to(tl.int32, bitcast=True) & ((1 << RAND_BITS) - 1)
        t_up = tl.minimum(tl.maximum(shift - RAND_BITS, 0), 31)
        code_up = ((v >> t_up) + r) >> RAND_BITS
        t_dn = tl.maximum(RAND_BITS - shift, 0)
        code_dn = (v + (r >> t_dn)) >> tl.minimum(shift, 31)
        code = tl.where(shift >= RAND_BITS, code_up, code_dn)
    else:
        s = tl.minimum(shift, 30)
        code = (v + (1 << (s - 1)) - 1 + ((v >> s) & 1)) >> s
    code = tl.minimum(code, MAX_CODE) | (sign << (EXP_BITS + MAN_BITS))
    return tl.where(a > 0x7F800000, NAN_CODE, code)


@triton.jit
def encode_fp16_sr(x, rbits):
    """FP32 -> FP16 codes, stochastic rounding with 13 random bits (cvt.rs.satfinite.f16x2):
    `encode_minifloat(x, rbits, 5, 10, 15, 0x7BFF, 0x7FFF, 13, True)` with the FP16 constants
    folded in. Every FP16 shift is at least the 13 random bits, so only its rounding-up
    form remains: code = (v + r) >> 13 with v the rebiased bits of a normal result, or the
    explicit significand shifted right by the extra subnormal shift (clamped to [0, 31],
    where the generic form clamps at 31 too), saturated at 0x7BFF; NaN -> 0x7FFF."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    ef = a >> 23
    mant = (a & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0)
    sub = mant >> tl.minimum(tl.maximum(113 - tl.maximum(ef, 1), 0), 31)
    v = tl.where(ef >= 113, a - (112 << 23), sub)
    r = rbits.to(tl.int32, bitcast=True) & 0x1FFF
    code = tl.minimum((v + r) >> 13, 0x7BFF) | ((bits >> 16) & 0x8000)
    return tl.where(a > 0x7F800000, 0x7FFF, code)


@triton.jit
def encode_e4m3_rn(x):
    """FP32 -> e4m3fn codes, nearest-even, saturating to 448; NaN -> 0x7F."""
    return encode_minifloat(x, x, 4, 3, 7, 0x7E, 0x7F, 8, False)


@triton.jit
def encode_e2m1_rn(x):
    """FP32 -> e2m1 codes (4 bits, sign at bit 3), nearest-even, saturating to 6; NaN -> 0x7."""
    return encode_minifloat(x, x, 2, 1, 1, 0x7, 0x7, 8, False)


@triton.jit
def decode_e4m3_pos(code):
    """FP32 value of a non-negative e4m3fn code (int32, 0..0x7F; 0x7F is NaN), exact."""
    ex = code >> 3
    m = code & 7
    normal = ((ex + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9, exact
    val = tl.where(ex == 0, sub, normal)
    nan = tl.full(code.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(code == 0x7F, nan, val)
