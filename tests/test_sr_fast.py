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

from replayssm.quant.minifloat import FP16, encode

F16_MIN_NORMAL_BITS = 0x38800000
F16_MAX_BITS = 0x477FE000
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


def _f16_code(v: Fraction, negative: bool) -> int:
    """`cvt.rz` of an (already representable or larger) value to an FP16 code."""
    q = _rz(v, 10, -14)
    if abs(q) > F16_MAX:  # round toward zero never overflows to infinity
        q = Fraction(F16_MAX) * (1 if q > 0 else -1)
    code = torch.tensor([float(q)], dtype=torch.float16).view(torch.int16).item() & 0xFFFF
    if q == 0 and negative:
        code = 0x8000
    return code


def sr_fast_emulated(bits: int, r: int) -> int:
    """fp16x2_sr_fast for one element: FP32 bits and 13 random bits -> FP16 code."""
    x = _f32(bits)
    a = bits & 0x7FFFFFFF
    sign = bits & 0x80000000
    if a > 0x7F800000:
        return 0x7FFF  # cvt of NaN: the canonical NaN
    vn = (bits + r) & 0xFFFFFFFF
    if 0x47800000 <= a <= 0x7F800000:  # |x| >= 65536 and infinities: +-65504
        v = Fraction(_f32(sign | F16_MAX_BITS))
        return _f16_code(v, bool(sign))
    if a >= F16_MIN_NORMAL_BITS:
        fv = _f32(vn)
        assert math.isfinite(fv)
        return _f16_code(Fraction(fv), bool(sign))
    # mag = (2**23 + r) * 2**-37 - 2**-14 (exact), sign of x; add.rz.f32(x, mag).
    mag = Fraction(r, 2**37)
    vs = _rz(Fraction(x) + (-mag if sign else mag), 23, -126)
    return _f16_code(vs, bool(sign))


def _cases(gen: torch.Generator) -> list[int]:
    f16 = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    base = f16.view(torch.int32).long()
    low = torch.randint(0, 1 << 13, base.shape, generator=gen)
    normal = (base + low)[::5]
    # FP16-subnormal range densely: |x| < 2**-14, random FP32 bits.
    sub = torch.randint(0, F16_MIN_NORMAL_BITS, (3000,), generator=gen)
    tiny = torch.randint(0, 1 << 23, (200,), generator=gen)  # FP32 subnormals
    big = torch.tensor([F16_MAX_BITS - 1, F16_MAX_BITS, F16_MAX_BITS + 1, 0x477FEFFF, 0x477FF000, 0x47800000,
                        0x7F7FFFFF, 0x38800000, 0x387FFFFF, 0x38000000, 0, 0x7F800000, 0x7FC00000, 0x7F800001])
    mags = torch.cat([normal, sub, tiny, big])
    signs = torch.randint(0, 2, mags.shape, generator=gen) << 31
    return (mags | signs).tolist() + big.tolist() + (big | (1 << 31)).tolist()


def test_fast_stochastic_rounding_matches_the_encoder_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    cases = _cases(gen)
    words = torch.randint(0, 1 << 13, (len(cases), 3), generator=gen).tolist()
    xs, rs, got = [], [], []
    for bits, ws in zip(cases, words):
        for r in (0, 0x1FFF, *ws):
            xs.append(bits)
            rs.append(r)
            got.append(sr_fast_emulated(bits, r))
    x = torch.tensor(xs, dtype=torch.int64).to(torch.int32).view(torch.float32)
    expect = encode(x, FP16, torch.tensor(rs, dtype=torch.int64)).tolist()
    bad = [(hex(b), r, hex(g), hex(e)) for b, r, g, e in zip(xs, rs, got, expect) if g != e]
    assert not bad, f"{len(bad)} of {len(xs)} differ, e.g. {bad[:5]}"
    assert len(xs) > 40000
