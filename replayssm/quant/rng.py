"""The counter-based random hash of every stochastic rounding (docs/format.md section 6):
bits depend only on (seed, slot, position, element index), never on addresses, so the
reference and the kernels draw identical bits. `mix32` is the lowbias32 finalizer."""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
INIT_POSITION = MASK32  # prefill init's position (-1; decode positions restart at 0 after it)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for uint32 values (int64 tensors: without overflow)."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & MASK32


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """lowbias32 on an int64 tensor of uint32 values, or on a Python int (`mix32_int`)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_M2)
    return x ^ (x >> 16)


mix32_int = mix32  # `_mul32`'s steps are exact on Python ints too


def seed_key(seed: int) -> int:
    """The seed's part of the stream key (32 bits; the seed is taken mod 2**64)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be a Python int; got {type(seed).__name__}")
    s = seed % (1 << 64)
    return mix32_int(mix32_int((s & MASK32) ^ GOLDEN) ^ (s >> 32))


def seed_key_i32(seed: int) -> int:
    """`seed_key(seed)` as the int32 with the same bits (the kernels' seed argument)."""
    key = seed_key(seed)
    return key - (1 << 32) if key >= (1 << 31) else key


def stream_key(seed: int, slot: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Per-row stream tag (int64 holding uint32, `slot`'s shape) from the seed, slot ids and
    positions (int tensors)."""
    k = torch.full_like(slot, seed_key(seed), dtype=torch.int64)
    k = mix32(k ^ (slot.to(torch.int64) & MASK32))
    return mix32(k ^ (position.to(torch.int64) & MASK32))


def random_words(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One 32-bit random word per (key, index): mix(key ^ index * GOLDEN); int64 holding
    uint32, broadcast."""
    return mix32(key ^ _mul32(index.to(torch.int64) & MASK32, GOLDEN))


def checkpoint_rbits(key: torch.Tensor, heads: int, head_offset: int = 0, head_dim: int = 64, state_dim: int = 128) -> torch.Tensor:
    """Random bits int64 [rows, heads, P, N] for the FP16 stochastic rounding of the
    checkpoints of `key` [rows] (docs/format.md section 6: one word per element pair);
    `head_offset`: the model's head of the cache's head 0 (tensor-parallel shards)."""
    rows = key.shape[0]
    per_head = head_dim * state_dim // 2
    idx = torch.arange(heads * per_head, device=key.device, dtype=torch.int64) + head_offset * per_head
    words = random_words(key.reshape(rows, 1).to(torch.int64), idx.reshape(1, -1))
    pair = torch.stack((words & 0x1FFF, (words >> 16) & 0x1FFF), dim=-1)
    return pair.reshape(rows, heads, head_dim, state_dim)
