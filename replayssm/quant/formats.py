"""Read-copy encodings in the kernels' arithmetic order, the executable form of
docs/format.md section 3: FP8 (a power-of-two scale per state row) and NVFP4."""

from __future__ import annotations

import torch

from ..geometry import NVFP4_BLOCK
from .minifloat import E2M1, E4M3, MASK32, decode_e2m1, decode_e4m3, encode, f32_bits

# The delayed second-level scale's headroom: the amax measured at one flush may grow by
# this factor before the next flush's largest block scale saturates at 448.
NVFP4_HEADROOM = 16
ONE_SIXTH = 1.0 / 6.0  # rounded once to FP32 where used


def _pow2_exponent_above(amax: torch.Tensor, mant_limit: int, e_off: int) -> torch.Tensor:
    """E = ceil(log2(amax / L)) for L = (1 + mant_limit / 2**23) * 2**e_off, from the FP32
    bits of amax >= 0; 0 for amax 0 or FP32-subnormal; clamped to [-100, 100] so that 2**E
    and 2**-E are normal FP32 numbers."""
    b = f32_bits(amax)
    ef = (b >> 23) & 0xFF
    e = ef - 127 - e_off + ((b & 0x7FFFFF) > mant_limit).to(torch.int64)
    return torch.where(ef == 0, torch.zeros_like(e), e).clamp(-100, 100)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """2**e as FP32 for integer tensors in [-126, 127], built from bits."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def fp8_row_scale(row_amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two s with row_amax / s <= 448 (448 = 1.75 * 2**8)."""
    return _exp2(_pow2_exponent_above(row_amax, 0x600000, 8))


def fp8_encode(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 state [..., P, N] -> (codes float8_e4m3fn [..., P, N], scales fp32 [..., P]);
    nearest-even, value = code * scale (1/scale is a power of two: the product is exact)."""
    e = _pow2_exponent_above(state.abs().amax(dim=-1), 0x600000, 8)  # fp8_row_scale's
    codes = encode(state * _exp2(-e).unsqueeze(-1), E4M3)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn), _exp2(e)


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return decode_e4m3(codes) * scales.unsqueeze(-1)


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
    float8_e4m3fn [..., P, N / 16]), given the live group amax (broadcast to [...]). Each
    step below is rounded to FP32 as written, as in the kernels; the codes nearest-even, or
    stochastic with `rbits`; byte j of a row holds element 2j in its low nibble."""
    *lead, P, N = state.shape
    g, ig = nvfp4_global_scale(group_amax_live), nvfp4_inv_global_scale(group_amax_live)
    blocks = state.reshape(*lead, P, N // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = blocks.abs().amax(dim=-1)
    t = (bamax * ig.reshape(*lead, 1, 1)) * torch.tensor(ONE_SIXTH, dtype=torch.float32)
    s_code = encode(t, E4M3)  # the block scale
    d = decode_e4m3(s_code) * g.reshape(*lead, 1, 1)  # exact
    r = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)  # IEEE division
    codes = encode(blocks * r.unsqueeze(-1), E2M1, rbits).reshape(*lead, P, N)
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
    vals = decode_e2m1(nvfp4_unpack(packed)).reshape(*lead, P, half * 2 // NVFP4_BLOCK, NVFP4_BLOCK)
    d = decode_e4m3(block_scales) * nvfp4_global_scale(group_amax_live).reshape(*lead, 1, 1)
    return (vals * d.unsqueeze(-1)).reshape(*lead, P, 2 * half)


__all__ = [
    "MASK32", "fp8_row_scale", "fp8_encode", "fp8_decode", "nvfp4_global_scale", "nvfp4_inv_global_scale",
    "nvfp4_encode", "nvfp4_unpack", "nvfp4_decode",
]
