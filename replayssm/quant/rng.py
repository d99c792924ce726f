"""The random hash that feeds every stochastic rounding in replayssm.

A counter-based hash: the bits for one element depend only on (seed, slot, position,
logical element index), never on addresses or strides, so the PyTorch reference, the
Triton kernels and the CuTe kernels draw identical bits and can be compared bit for bit.

Definition (all arithmetic on unsigned 32-bit words, multiplication wraps mod 2**32):

    mix(x):   x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16
    key  = mix(seed_lo ^ 0x9E3779B9)
    key  = mix(key ^ seed_hi)            # seed taken mod 2**64, split in two words
    key  = mix(key ^ slot)
    key  = mix(key ^ (position mod 2**32))
    word(key, index) = mix(key ^ (index * 0x9E3779B9))

`key` is the per-row "stream tag" the prepare-decode step computes once per row; a kernel
then derives one 32-bit word per index with a single `mix`. `mix` is the "lowbias32"
integer finalizer (two multiplies, three xor-shifts), a bijection on 32-bit words.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
# Position used for the stochastic rounding done by `prefill_init` (positions restart at 0
# after it, so -1 mod 2**32 never collides with a decode flush of the same slot).
INIT_POSITION = MASK32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of uint32 values; returns int64 uint32 values."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_M2)
    x = x ^ (x >> 16)
    return x


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (scalar twin of `mix32`)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_M1) & MASK32
    x ^= x >> 15
    x = (x * MIX_M2) & MASK32
    x ^= x >> 16
    return x


def seed_words(seed: int) -> tuple[int, int]:
    """Split a Python int seed (taken mod 2**64) into (lo, hi) 32-bit words."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be a Python int; got {type(seed).__name__}")
    s = seed % (1 << 64)
    return s & MASK32, s >> 32


def seed_key(seed: int) -> int:
    """The part of the stream key that depends on the seed alone (a 32-bit int)."""
    lo, hi = seed_words(seed)
    return mix32_int(mix32_int(lo ^ GOLDEN) ^ hi)


def seed_key_i32(seed: int) -> int:
    """`seed_key(seed)` as the int32 with the same bits (the kernels' seed argument)."""
    key = seed_key(seed) & 0xFFFFFFFF
    return key - (1 << 32) if key >= (1 << 31) else key


def stream_key(seed: int, slot: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Per-row stream tag from the seed, slot ids and positions (int tensors, any shape).

    Returns int64 tensor of uint32 values, same shape as `slot`.
    """
    k = torch.full_like(slot, seed_key(seed), dtype=torch.int64)
    k = mix32(k ^ (slot.to(torch.int64) & MASK32))
    k = mix32(k ^ (position.to(torch.int64) & MASK32))
    return k


def random_words(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One 32-bit random word per (key, index): mix(key ^ index * GOLDEN).

    `key` and `index` broadcast; both int64 holding uint32 values. Returns int64.
    """
    return mix32(key ^ _mul32(index.to(torch.int64) & MASK32, GOLDEN))


def checkpoint_rbits(key: torch.Tensor, heads: int, head_offset: int = 0, head_dim: int = 64, state_dim: int = 128) -> torch.Tensor:
    """Random bits for the FP16 stochastic rounding of a whole checkpoint.

    `key`: [rows] stream tags. Returns int64 [rows, heads, P, N] (P = `head_dim`, N =
    `state_dim`): for element (h, p, n) the bits of word(key, (((h + head_offset) * P + p)
    * N + n) // 2), taking bits [12:0] for even n and bits [28:16] for odd n -- the split
    `cvt.rs.f16x2.f32 d, a, b, rbits` uses when a = element n+1 (upper half of d) and
    b = element n (lower half). `head_offset`: the model's head of the cache's head 0, so
    that tensor-parallel shards of a model draw the bits one unsharded cache would.
    """
    rows = key.shape[0]
    per_head = head_dim * state_dim // 2
    idx = torch.arange(heads * per_head, device=key.device, dtype=torch.int64) + head_offset * per_head
    words = random_words(key.reshape(rows, 1).to(torch.int64), idx.reshape(1, -1))
    pair = torch.stack((words & 0x1FFF, (words >> 16) & 0x1FFF), dim=-1)
    return pair.reshape(rows, heads, head_dim, state_dim)
