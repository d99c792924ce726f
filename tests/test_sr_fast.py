"""The sm_90a flush's stochastic rounding (kernels/cute/bits.fp16x2_sr_fast) against the
reference encoder, bit for bit, on the CPU.

The kernel builds an FP32 value from integer steps, one `add.rz.f32` and selects, then
truncates it with `cvt.rz.f16x2.f32`. Here each PTX instruction is emulated from its IEEE
definition (exact rational arithmetic, then rounding toward zero onto the FP32 or FP16
grid), independently of the integer encoder in quant/minifloat.py, and the result is
compared with `minifloat.encode(x, FP16, rbits)` over: every FP16 value with random low
bits below it (both signs), the FP16-subnormal range densely, FP32 subnormals, values
around 65504 and beyond, zeros, infinities and NaN, each with several random words.
(The GPU test checks the compiled kernel against the same encoder on real flushes.)
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from replayssm.quant.minifloat import (
    FP16,
    FP16_MAX_F32_BITS,
    FP16_MIN_NORMAL_F32_BITS,
    FP16_OVERFLOW_F32_BITS,
    encode,
)

F16_MAX = 65504


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _bits(x: float) -> int:
    return torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


def _rz(v: Fraction, man_bits: int, emin: int) -> Fraction:
    """Round v toward zero onto a binary grid with `man_bits` stored mantissa bits and
    smallest normal exponent `emin` (subnormals below)."""
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = math.floor(math.log2(a))
    # log2 of a rational can be off by one near powers of two: fix it exactly.
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (max(e, emin) - man_bits)
    q = (a / ulp).__floor__() * ulp
    return q if v > 0 else -q


def _cvt_rz_f16(bits: int) -> int:
    """`cvt.rz.f16.f32` of the FP32 pattern `bits`: NaN -> the canonical 0x7FFF, finite
    values truncated onto the FP16 grid, saturating at +-65504 (round toward zero never
    overflows), signed zeros kept."""
    if bits & 0x7FFFFFFF > 0x7F800000:
        return 0x7FFF
    assert bits & 0x7FFFFFFF != 0x7F800000, "the kernel never converts an infinity"
    negative = bool(bits >> 31)
    q = _rz(Fraction(_f32(bits)), 10, -14)
    if abs(q) > F16_MAX:
        q = Fraction(F16_MAX) * (-1 if negative else 1)
    code = torch.tensor([float(q)], dtype=torch.float16).view(torch.int16).item() & 0xFFFF
    return 0x8000 if q == 0 and negative else code


def sr_fast_emulated(bits: int, r: int) -> int:
    """bits._sr_pick then the truncating conversion, step by step, for one element:
    FP32 bits and 13 random bits -> FP16 code."""
    a = bits & 0x7FFFFFFF
    sign = bits & 0x80000000
    # Normal results: integer add of r to the FP32 bits.
    vn = (bits + r) & 0xFFFFFFFF
    v = vn
    if a < FP16_MIN_NORMAL_F32_BITS:
        # Subnormal results: mag = float(0x4B000000 | r) * 2**-37 - 2**-14 (each step
        # exact in FP32), given x's sign, then add.rz.f32(x, mag).
        mag = Fraction(_f32(0x4B000000 | r)) * Fraction(1, 2**37) - Fraction(1, 2**14)
        assert Fraction(float(mag)) == mag and _rz(mag, 23, -126) == mag
        s_mag = _bits(float(mag)) | sign
        vs = _rz(Fraction(_f32(bits)) + Fraction(_f32(s_mag)), 23, -126)
        v = _bits(float(vs)) | (sign if vs == 0 else 0)
    # |x| >= 65536 up to infinity: +-65504.
    if FP16_OVERFLOW_F32_BITS <= a <= 0x7F800000:
        v = sign | FP16_MAX_F32_BITS
    # NaN: unchanged.
    if a > 0x7F800000:
        v = bits
    return _cvt_rz_f16(v)


def _cases(gen: torch.Generator) -> list[int]:
    f16 = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    base = f16.view(torch.int32).long()
    low = torch.randint(0, 1 << 13, base.shape, generator=gen)
    normal = (base + low)[::5]
    # FP16-subnormal range densely: |x| < 2**-14, random FP32 bits.
    sub = torch.randint(0, FP16_MIN_NORMAL_F32_BITS, (3000,), generator=gen)
    tiny = torch.randint(0, 1 << 23, (200,), generator=gen)  # FP32 subnormals
    big = torch.tensor([FP16_MAX_F32_BITS - 1, FP16_MAX_F32_BITS, FP16_MAX_F32_BITS + 1, 0x477FEFFF, 0x477FF000,
                        0x47800000, 0x7F7FFFFF, 0x7F7FE001, 0x38800000, 0x387FFFFF, 0x38000000, 0, 0x7F800000,
                        # NaNs, large payloads included (r could carry them into the sign bit)
                        0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FFFF000, 0x7FFFE001])
    mags = torch.cat([normal, sub, tiny, big])
    signs = torch.randint(0, 2, mags.shape, generator=gen) << 31
    return (mags | signs).tolist() + big.tolist() + (big | (1 << 31)).tolist()


def _check_against_encoder(emulated, seed: int) -> None:
    """`emulated(bits, r)` (an FP16 code) equals `minifloat.encode` on every case of
    `_cases`, each with r = 0, 0x1FFF and three random words."""
    gen = torch.Generator().manual_seed(seed)
    cases = _cases(gen)
    words = torch.randint(0, 1 << 13, (len(cases), 3), generator=gen).tolist()
    xs, rs, got = [], [], []
    for bits, ws in zip(cases, words):
        for r in (0, 0x1FFF, *ws):
            xs.append(bits)
            rs.append(r)
            got.append(emulated(bits, r))
    x = torch.tensor(xs, dtype=torch.int64).to(torch.int32).view(torch.float32)
    expect = encode(x, FP16, torch.tensor(rs, dtype=torch.int64)).tolist()
    bad = [(hex(b), r, hex(g), hex(e)) for b, r, g, e in zip(xs, rs, got, expect) if g != e]
    assert not bad, f"{len(bad)} of {len(xs)} differ, e.g. {bad[:5]}"
    assert len(xs) > 40000


def test_fast_stochastic_rounding_matches_the_encoder_bit_for_bit():
    _check_against_encoder(sr_fast_emulated, 0)


def sr_normal_emulated(bits: int, r: int) -> int | None:
    """bits.fp16x2_sr_normal for one element, or None when bits.sr_normal_range says the
    kernel takes the general path for it (the warp vote then sends the warp there)."""
    a = bits & 0x7FFFFFFF
    if (a - FP16_MIN_NORMAL_F32_BITS) & 0xFFFFFFFF >= FP16_OVERFLOW_F32_BITS - FP16_MIN_NORMAL_F32_BITS:
        return None
    return _cvt_rz_f16((bits + r) & 0xFFFFFFFF)


def test_normal_range_path_matches_the_encoder_bit_for_bit():
    """The sm_90a flush's warp-voted fast path (bits.fp16x2_sr_voted): wherever its range
    test passes, the integer add and truncation alone give the encoder's code; and the
    test fails exactly for FP16-subnormal results, |x| >= 65536, infinities and NaN."""
    gen = torch.Generator().manual_seed(1)
    cases = _cases(gen)
    words = torch.randint(0, 1 << 13, (len(cases), 2), generator=gen).tolist()
    xs, rs, got = [], [], []
    general = 0
    for bits, ws in zip(cases, words):
        a = bits & 0x7FFFFFFF
        for r in (0, 0x1FFF, *ws):
            code = sr_normal_emulated(bits, r)
            in_range = FP16_MIN_NORMAL_F32_BITS <= a < FP16_OVERFLOW_F32_BITS
            assert (code is not None) == in_range, hex(bits)
            if code is None:
                general += 1
                continue
            xs.append(bits)
            rs.append(r)
            got.append(code)
    x = torch.tensor(xs, dtype=torch.int64).to(torch.int32).view(torch.float32)
    expect = encode(x, FP16, torch.tensor(rs, dtype=torch.int64)).tolist()
    bad = [(hex(b), r, hex(g), hex(e)) for b, r, g, e in zip(xs, rs, got, expect) if g != e]
    assert not bad, f"{len(bad)} of {len(xs)} differ, e.g. {bad[:5]}"
    assert len(xs) > 20000 and general > 10000


def sr_fma_emulated(bits: int, r: int) -> int:
    """bits._sr_fma_pick then the truncating conversion, step by step, for one element."""
    a = bits & 0x7FFFFFFF
    # min.NaN.xorsign.abs.f32 against FP32 max: NaN -> canonical NaN, +-inf -> +-max.
    if a > 0x7F800000:
        xc = 0x7FFFFFFF
    elif a == 0x7F800000:
        xc = (bits & 0x80000000) | 0x7F7FFFFF
    else:
        xc = bits
    em = max(xc & 0x7F800000, 113 << 23)
    s = em | (xc & 0x80000000)
    rf = Fraction(_f32(r | 0x3F800000)) - 1
    assert rf == Fraction(r, 2**23)  # the FP32 subtraction is exact
    if (xc & 0x7FFFFFFF) > 0x7F800000:
        return _cvt_rz_f16(0x7FFFFFFF)  # NaN in, NaN out
    assert em < 0x7F800000, "s is finite for every non-NaN input"
    exact = rf * Fraction(_f32(s)) + Fraction(_f32(xc))
    v = _rz(exact, 23, -126)
    fmax = Fraction(_f32(0x7F7FFFFF))
    if abs(v) > fmax:  # IEEE: an overflow rounded toward zero gives the largest finite value
        v = fmax if v > 0 else -fmax
    vb = _bits(float(v)) | ((xc & 0x80000000) if v == 0 else 0)
    return _cvt_rz_f16(vb)


def test_fma_stochastic_rounding_matches_the_encoder_bit_for_bit():
    """bits.fp16x2_sr_fma (one clamp, one fma.rz, a few integer steps a value; the sm_90a
    FP8 flush's rounding) against the encoder over the same cases as the fast path."""
    _check_against_encoder(sr_fma_emulated, 2)
