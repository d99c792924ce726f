"""FP32 -> e4m3fn / e2m1 / fp16 encoders on the IEEE bits with integer operations only, in
the kernels' order (the Triton interpreter gets float downcasts wrong), so kernels are tested
bit for bit. docs/format.md section 2 specifies the rounding, saturation and NaN codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class MiniFloat:
    """Parameters of one small floating-point target."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_code: int  # largest finite magnitude code
    nan_code: int  # code written for NaN inputs (positive; the sign is dropped)
    rand_bits: int  # random bits consumed per element by stochastic rounding


E4M3 = MiniFloat("e4m3", 4, 3, 7, 0x7E, 0x7F, rand_bits=8)
E2M1 = MiniFloat("e2m1", 2, 1, 1, 0x7, 0x7, rand_bits=8)
FP16 = MiniFloat("fp16", 5, 10, 15, 0x7BFF, 0x7FFF, rand_bits=13)

# FP16 thresholds as FP32 bits for the sm_90a flush's fast stochastic rounding (kernels/cute/
# bits.py): smallest normal 2**-14, largest finite 65504, 65536 (from which all saturate).
FP16_MIN_NORMAL_F32_BITS = 0x38800000
FP16_MAX_F32_BITS = 0x477FE000
FP16_OVERFLOW_F32_BITS = 0x47800000


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """IEEE bits of an FP32 tensor as int64 values in [0, 2**32)."""
    if x.dtype != torch.float32:
        raise TypeError(f"expected float32 tensor; got {x.dtype}")
    return x.contiguous().view(torch.int32).to(torch.int64) & MASK32


def encode(x: torch.Tensor, fmt: MiniFloat, rbits: torch.Tensor | None = None) -> torch.Tensor:
    """Encode FP32 `x` to `fmt` codes (int64, sign included), saturating: nearest-even when
    `rbits` is None, else stochastic with the low `fmt.rand_bits` bits of each element's
    entry in `rbits` (int64, broadcastable), added at the top of the discarded field."""
    bits = f32_bits(x)
    sign = bits >> 31
    a = bits & 0x7FFFFFFF
    ef = a >> 23
    # Target's smallest normal, as an FP32 biased exponent.
    emin_field = 127 + 1 - fmt.bias
    base_shift = 23 - fmt.man_bits
    normal = ef >= emin_field
    # Normal results: rebias the exponent field in place; carries roll into it.
    v_norm = a - ((127 - fmt.bias) << 23)
    # Subnormal results: explicit significand shifted further right.
    mant = (a & 0x7FFFFF) | torch.where(ef > 0, 0x800000, 0)
    extra = (emin_field - ef.clamp(min=1)).clamp(min=0)
    v = torch.where(normal, v_norm, mant)
    shift = torch.where(normal, torch.full_like(ef, base_shift), (base_shift + extra).clamp(max=40))
    if rbits is None:
        inc = (torch.ones_like(shift) << (shift - 1)) - 1 + ((v >> shift) & 1)
    else:
        k = fmt.rand_bits
        r = rbits.to(torch.int64) & ((1 << k) - 1)
        up, down = r << (shift - k).clamp(min=0, max=40), r >> (k - shift).clamp(min=0, max=40)
        inc = torch.where(shift >= k, up, down)
    code = (v + inc) >> shift
    code = code.clamp(max=fmt.max_code) | (sign << (fmt.exp_bits + fmt.man_bits))
    return torch.where(a > 0x7F800000, torch.full_like(code, fmt.nan_code), code)


# -- decoders (exact; floats accumulate only after decoding) ------------------------------

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = torch.tensor([*_E2M1, *(-v for v in _E2M1)], dtype=torch.float32)  # codes 8..15: -0.0 to -6


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of 4-bit e2m1 codes (any integer dtype, values 0..15)."""
    table = _E2M1_VALUES.to(codes.device)
    return table[codes.to(torch.int64) & 0xF]


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of 8-bit e4m3fn codes (any integer dtype, or float8_e4m3fn)."""
    if codes.dtype == torch.float8_e4m3fn:
        return codes.float()
    return (codes.to(torch.int64) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()


def decode_fp16(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int64) & 0xFFFF
    c = torch.where(c >= 0x8000, c - 0x10000, c)
    return c.to(torch.int16).view(torch.float16).float()


def to_e4m3(x: torch.Tensor, rbits: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 -> float8_e4m3fn tensor (nearest-even or stochastic), saturating."""
    return encode(x, E4M3, rbits).to(torch.uint8).view(torch.float8_e4m3fn)


def to_fp16(x: torch.Tensor, rbits: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 -> float16 tensor (nearest-even or stochastic), saturating to +-65504."""
    c = encode(x, FP16, rbits)
    c = torch.where(c >= 0x8000, c - 0x10000, c)
    return c.to(torch.int16).view(torch.float16)


def to_e2m1(x: torch.Tensor, rbits: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 -> e2m1 codes (uint8 tensor, one code per byte, values 0..15)."""
    return encode(x, E2M1, rbits).to(torch.uint8)
