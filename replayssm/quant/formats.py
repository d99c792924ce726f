"""Read-copy formats: the FP8 (e4m3, one power-of-two scale per state row) and the NVFP4
(e2m1 codes, e4m3 block scales per 16 elements, power-of-two second-level scale per slot
and group) encodings of a state, in the arithmetic order the kernels use.

A "state row" is one head-dim row of a head's P x N state (64 or 80 x 128 or 256): the N
state-dim values S[h, p, :]. docs/format.md is the specification; this module is its executable form.
"""

from __future__ import annotations

import torch

from ..geometry import NVFP4_BLOCK
from .minifloat import E2M1, E4M3, MASK32, decode_e2m1, decode_e4m3, encode, f32_bits
# Headroom of the delayed second-level scale: the amax measured at one flush may grow by
# this factor before the next flush's largest block scale saturates at 448.
NVFP4_HEADROOM = 16
ONE_SIXTH = 1.0 / 6.0  # rounded once to FP32 where used


def _pow2_exponent_above(amax: torch.Tensor, mant_limit: int, e_off: int) -> torch.Tensor:
    """E = ceil(log2(amax / L)) for a limit L = (1 + mant_limit / 2**23) * 2**e_off,
    computed from the FP32 bits of amax (>= 0). amax == 0 (or FP32-subnormal) gives 0.
    Clamped to [-100, 100] so that 2**E and 2**-E are normal FP32 numbers."""
    b = f32_bits(amax)
    ef = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    e = ef - 127 - e_off + (mant > mant_limit).to(torch.int64)
    e = torch.where(ef == 0, torch.zeros_like(e), e)
    return e.clamp(-100, 100)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """2**e as FP32 for integer tensors in [-126, 127], built from bits."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------------------
# FP8


def fp8_row_scale(row_amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two s with row_amax / s <= 448 (448 = 1.75 * 2**8)."""
    return _exp2(_pow2_exponent_above(row_amax, 0x600000, 8))


def fp8_encode(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 state [..., P, N] -> (codes float8_e4m3fn [..., P, N], scales fp32 [..., P]).

    Nearest-even; value = code * scale. Multiplying by 1/scale (a power of two) is exact,
    so the encoded value is the correctly rounded e4m3 of state / scale.
    """
    amax = state.abs().amax(dim=-1)
    scale = fp8_row_scale(amax)
    inv = _exp2(-_pow2_exponent_above(amax, 0x600000, 8))
    codes = encode(state * inv.unsqueeze(-1), E4M3)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn), scale


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return decode_e4m3(codes) * scales.unsqueeze(-1)


# ---------------------------------------------------------------------------------------
# NVFP4


def nvfp4_global_scale(group_amax: torch.Tensor) -> torch.Tensor:
    """Second-level scale from a group amax: the smallest power of two g with
    amax / (6 * g) <= 448 / NVFP4_HEADROOM = 28, i.e. amax / g <= 168 = 1.3125 * 2**7.
    amax == 0 gives 1."""
    return _exp2(_pow2_exponent_above(group_amax, 0x280000, 7))


def nvfp4_inv_global_scale(group_amax: torch.Tensor) -> torch.Tensor:
    return _exp2(-_pow2_exponent_above(group_amax, 0x280000, 7))


def nvfp4_encode(
    state: torch.Tensor, group_amax_live: torch.Tensor, rbits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 state [..., P, N] -> (packed codes uint8 [..., P, N / 2], block scales
    float8_e4m3fn [..., P, N / 16]), given the live group amax (broadcast to [...]).

    Steps, each rounded to FP32 as written (the kernels do the same):
      g    = nvfp4_global_scale(amax_live); ig = 1 / g            (powers of two)
      t    = (block_amax * ig) * fp32(1/6)
      s    = e4m3_rn_satfinite(t)                                (block scale code)
      d    = e4m3_value(s) * g                                   (exact)
      r    = 1 / d, IEEE-rounded; r = 0 when d == 0
      code = e2m1_satfinite(v * r)       (nearest-even, or stochastic with `rbits`)
    Byte j of a row holds element 2j in its low nibble and element 2j+1 in its high one.
    """
    *lead, P, N = state.shape
    g = nvfp4_global_scale(group_amax_live)
    ig = nvfp4_inv_global_scale(group_amax_live)
    blocks = state.reshape(*lead, P, N // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = blocks.abs().amax(dim=-1)
    igb = ig.reshape(*lead, *([1] * 2))
    t = (bamax * igb) * torch.tensor(ONE_SIXTH, dtype=torch.float32)
    s_code = encode(t, E4M3)
    d = decode_e4m3(s_code) * g.reshape(*lead, 1, 1)
    one = torch.ones((), dtype=torch.float32, device=state.device)
    r = torch.where(d == 0, torch.zeros_like(d), one / d)
    scaled = blocks * r.unsqueeze(-1)
    codes = encode(scaled, E2M1, rbits)
    codes = codes.reshape(*lead, P, N)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, s_code.to(torch.uint8).view(torch.float8_e4m3fn)


def nvfp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N / 2] -> e2m1 codes [..., N] (low nibble first)."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def nvfp4_decode(
    packed: torch.Tensor, block_scales: torch.Tensor, group_amax_live: torch.Tensor
) -> torch.Tensor:
    """Inverse of `nvfp4_encode`: value = e2m1(code) * e4m3(block scale) * g."""
    *lead, P, half = packed.shape
    N = 2 * half
    vals = decode_e2m1(nvfp4_unpack(packed))
    vals = vals.reshape(*lead, P, N // NVFP4_BLOCK, NVFP4_BLOCK)
    d = decode_e4m3(block_scales) * nvfp4_global_scale(group_amax_live).reshape(*lead, 1, 1)
    return (vals * d.unsqueeze(-1)).reshape(*lead, P, N)


__all__ = [
    "MASK32",
    "fp8_row_scale",
    "fp8_encode",
    "fp8_decode",
    "nvfp4_global_scale",
    "nvfp4_inv_global_scale",
    "nvfp4_encode",
    "nvfp4_unpack",
    "nvfp4_decode",
]
