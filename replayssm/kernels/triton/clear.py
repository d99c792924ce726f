"""Clear kernel: zero the x / dt / B rings and the positions of the given slots.

Grid (batch, chunks): program (i_b, i_c) zeroes elements [i_c * BLOCK, (i_c + 1) * BLOCK)
of each ring of row i_b's slot; chunk 0 also zeroes the slot's positions (one int32 in
separate mode, two in pending mode). Padding rows (slot <= 0 or >= num_slots) store
nothing. Rings are zeroed through integer views (bf16 -> int16, f32 -> int32): zero bits
are the value 0 in every dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import layout as L
from .launch import interpreting


@triton.jit
def zero_slot(
    slot, i_c, p_x, p_dt, p_b, p_pos, stride_x, stride_dt, stride_b, stride_pos,
    N_X: tl.constexpr, N_DT: tl.constexpr, N_B: tl.constexpr, POS_WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    """Zero elements [i_c * BLOCK, (i_c + 1) * BLOCK) of each ring of `slot` (int64), and
    its positions when i_c == 0 (the clear kernel's body; the initialize kernel's too)."""
    o = i_c * BLOCK + tl.arange(0, BLOCK)
    tl.store(p_x + slot * stride_x + o, tl.zeros([BLOCK], tl.int16), mask=o < N_X)
    tl.store(p_dt + slot * stride_dt + o, tl.zeros([BLOCK], tl.int32), mask=o < N_DT)
    tl.store(p_b + slot * stride_b + o, tl.zeros([BLOCK], tl.int16), mask=o < N_B)
    o_w = tl.arange(0, POS_WIDTH)
    tl.store(p_pos + slot * stride_pos + o_w, tl.zeros([POS_WIDTH], tl.int32), mask=o_w < tl.where(i_c == 0, POS_WIDTH, 0))


@triton.jit(do_not_specialize=["num_slots"])
def _clear_kernel(
    p_ids,
    p_x,
    p_dt,
    p_b,
    p_pos,
    stride_ids,
    stride_x,
    stride_dt,
    stride_b,
    stride_pos,
    num_slots,
    N_X: tl.constexpr,
    N_DT: tl.constexpr,
    N_B: tl.constexpr,
    POS_WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_c = tl.program_id(1)
    slot = tl.load(p_ids + i_b.to(tl.int64) * stride_ids)
    if (slot <= 0) | (slot >= num_slots):  # padding row
        return
    zero_slot(slot.to(tl.int64), i_c, p_x, p_dt, p_b, p_pos, stride_x, stride_dt, stride_b, stride_pos, N_X, N_DT, N_B, POS_WIDTH, BLOCK)


def ring_arguments(cache, programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """The clear kernel's arguments after the ids and their stride: (ring views and
    positions), (their strides, num_slots), constexprs. `programs`: the programs a slot's
    clear is split into (a caller with its own grid; BLOCK then covers the rings in that
    many), else BLOCK is the clear kernel's own."""
    x_ring, dt_ring, b_ring, pos = cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING], cache[L.POSITIONS]
    n_x, n_dt, n_b = (math.prod(t.shape[1:]) for t in (x_ring, dt_ring, b_ring))
    n_max = max(n_x, n_dt, n_b)
    if programs is not None:
        block = triton.next_power_of_2(triton.cdiv(n_max, programs))
    else:
        block = triton.next_power_of_2(n_max) if interpreting() else min(4096, triton.next_power_of_2(n_max))
    tensors = (x_ring.view(torch.int16), dt_ring.view(torch.int32), b_ring.view(torch.int16), pos)
    scalars = (x_ring.stride(0), dt_ring.stride(0), b_ring.stride(0), pos.stride(0), cache[L.CHECKPOINT].shape[0])
    constexprs = dict(N_X=n_x, N_DT=n_dt, N_B=n_b, POS_WIDTH=2 if pos.dim() == 2 else 1, BLOCK=block)
    return tensors, scalars, constexprs


def _chunks(constexprs: dict) -> int:
    """Programs a slot's clear takes at the clear kernel's BLOCK."""
    return triton.cdiv(max(constexprs["N_X"], constexprs["N_DT"], constexprs["N_B"]), constexprs["BLOCK"])


def clear(cache, ids: torch.Tensor) -> None:
    """Zero rings and positions of the valid slots in `ids` (int32/int64 [batch]). One
    launch."""
    ids = ids.reshape(-1)
    batch = ids.numel()
    if batch == 0:
        return
    tensors, scalars, constexprs = ring_arguments(cache)
    chunks = _chunks(constexprs)
    _clear_kernel[(batch, chunks)](ids, *tensors, ids.stride(0), *scalars, **constexprs, num_warps=4)
