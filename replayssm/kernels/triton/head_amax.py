"""Head-amax kernel: max |value| of each (row, head) of FP32 prefill states, as FP32 bits.

The first of the two NVFP4 initialize launches. The group amax that sets a group's
second-level scale spans 8 or 16 heads, i.e. many encode programs; reducing it in a
separate launch (ordered before the encode launch by the stream) lets every encode program
read the finished value, with no atomics and no race. The max is taken on the integer bits
of |value| (for non-negative FP32, integer order is value order), so it is exact and
independent of reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Relaunch, current_stream, interpreting, keep


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
    """(BLOCK_H, BLOCK_P): one program per batch row in the interpreter (H a multiple of
    8), one per head on the GPU."""
    return (min(16, heads & -heads), 64) if interpreting() else (1, 16)


def head_amax(states: torch.Tensor, ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int32 [batch, H]: FP32 bits of max |states[b, h]| for valid rows (other rows are
    left unwritten and must not be read)."""
    batch, heads = states.shape[:2]
    hmax = torch.empty(batch, heads, dtype=torch.int32, device=states.device)
    block_h, block_p = _blocks(heads)
    _HEAD_AMAX(
        (batch, heads // block_h),
        current_stream(states.device),
        (states, ids, hmax, ids.stride(0), *states.stride(), num_slots),
        dict(H=heads, BLOCK_H=block_h, BLOCK_P=block_p),
    )
    return hmax


class HeadAmax:
    """Repeated `head_amax` launches for one head count and slot count: the compiled
    kernel per dtype and 16-byte alignment of the ids and states and their strides;
    the first launch of each through Triton's launcher, later ones with addresses
    (`launch.Compiled`)."""

    def __init__(self, heads: int, num_slots: int) -> None:
        self.heads, self.num_slots = heads, num_slots
        block_h, block_p = _blocks(heads)
        self.constexprs = (heads, block_h, block_p)
        self.programs = heads // block_h
        self.compiled: dict[tuple, object] = {}

    def __call__(self, states: torch.Tensor, ids: torch.Tensor, stream: int | None) -> torch.Tensor:
        """The head amax of `states` for the valid rows of `ids` (1-D) on stream handle
        `stream` (None: Triton's launch path)."""
        batch = ids.shape[0]
        hmax = torch.empty(batch, self.heads, dtype=torch.int32, device=states.device)
        s_ptr, i_ptr = states.data_ptr(), ids.data_ptr()
        strides = states.stride()
        key = (ids.dtype, i_ptr % 16 == 0, ids.stride(0), s_ptr % 16 == 0, strides)
        kernel = self.compiled.get(key) if stream is not None else None
        if kernel is None:
            H, block_h, block_p = self.constexprs
            launched = _head_amax_kernel[(batch, self.programs)](
                states, ids, hmax, ids.stride(0), *strides, self.num_slots, H=H, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=4
            )
            keep(self.compiled, key, launched, stream)
        else:
            kernel((batch, self.programs, 1), stream, (s_ptr, i_ptr, hmax.data_ptr(), ids.stride(0), *strides, self.num_slots, *self.constexprs))
        return hmax


_HEAD_AMAX = Relaunch(_head_amax_kernel, num_warps=4)
