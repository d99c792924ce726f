"""Head-amax kernel: max |value| of each (row, head) of FP32 prefill states, as FP32 bits.

The first of the two NVFP4 initialize launches. The group amax that sets a group's
second-level scale spans a whole group of heads, i.e. many encode programs; reducing it in a
separate launch (ordered before the encode launch by the stream) lets every encode program
read the finished value, with no atomics and no race. The max is taken on the integer bits
of |value| (for non-negative FP32, integer order is value order), so it is exact and
independent of reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting


@triton.jit(do_not_specialize=["num_slots"])
def _head_amax_kernel(
    p_states,
    p_ids,
    p_hmax,
    stride_ids,
    stride_sb,
    stride_sh,
    stride_sp,
    stride_sn,
    num_slots,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    slot = tl.load(p_ids + i_b.to(tl.int64) * stride_ids)
    if (slot <= 0) | (slot >= num_slots):  # padding row
        return
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_p = tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, 128)
    p_x = (
        p_states
        + i_b.to(tl.int64) * stride_sb
        + o_h[:, None, None].to(tl.int64) * stride_sh
        + o_n[None, None, :].to(tl.int64) * stride_sn
    )
    b_max = tl.zeros([BLOCK_H, BLOCK_P, 128], tl.int32)
    for i_p in range(0, 64 // BLOCK_P):
        o_row = (i_p * BLOCK_P + o_p).to(tl.int64)
        b_x = tl.load(p_x + o_row[None, :, None] * stride_sp)
        b_max = tl.maximum(b_max, b_x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    b_amax = tl.max(tl.max(b_max, axis=2), axis=1)
    tl.store(p_hmax + i_b.to(tl.int64) * H + o_h, b_amax)


def _blocks(heads: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_P): in the interpreter programs of the largest power of two up to
    16 that divides H heads (one per batch row for H = 16), one per head on the GPU."""
    return (min(16, heads & -heads), 64) if interpreting() else (1, 16)


def head_amax(states: torch.Tensor, ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int32 [batch, H]: FP32 bits of max |states[b, h]| for valid rows (other rows are
    left unwritten and must not be read)."""
    batch, heads = states.shape[:2]
    hmax = torch.empty(batch, heads, dtype=torch.int32, device=states.device)
    block_h, block_p = _blocks(heads)
    _head_amax_kernel[(batch, heads // block_h)](
        states, ids, hmax, ids.stride(0), *states.stride(), num_slots, H=heads, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=4
    )
    return hmax
