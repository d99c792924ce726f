"""Materialize kernel: `reference.materialize`'s math on the device, capturable (no host
sync; no allocation when `out` is given). Grid (n, H, P // BLOCK_P): program (i_b, i_h,
i_p) computes BLOCK_P state rows of head i_h for batch row i_b:

    live   = positions[slot] mod 16, the entries from ring index start = 0 (separate mode);
             pending mode: c = positions[slot, 0], the checkpoint at f = grid * (c div grid),
             live = c - f committed entries from ring index start = f mod 16 (format.md 5b)
    e_j    = (start + j) mod 16, the ring index of the j-th live entry
    pre_j  = dt_e0 + .. + dt_ej             over j < live (zero beyond)
    S      = exp(A pre_live) S0 + sum_{j < live} dt_ej exp(A (pre_live - pre_j)) x_ej (x) B_ej

in plain FP32 (rank-1 updates in entry order: the reference's einsum up to FP32 summation
order). Entries at or beyond `live` are never loaded (masked: NaN poison there cannot reach
the state). Padding rows (slot <= 0 or >= num_slots) store zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import layout as L
from ...pending import grid as pending_grid
from . import interpreting


@triton.jit(do_not_specialize=["num_slots", "grid"])
def _materialize_kernel(
    p_ids, p_A, p_ckpt, p_x, p_dt, p_b, p_pos, p_out,
    stride_ids, stride_A, stride_ckpt, stride_x, stride_dt, stride_b, stride_pos, stride_out, num_slots, grid,
    H: tl.constexpr, HPG: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    PENDING: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, N)
    p_o = p_out + i_b.to(tl.int64) * stride_out + (i_h * P + o_p)[:, None].to(tl.int64) * N + o_n[None, :]
    raw = tl.load(p_ids + i_b.to(tl.int64) * stride_ids)
    if (raw <= 0) | (raw >= num_slots):  # padding row: a zero state
        tl.store(p_o, tl.zeros([BLOCK_P, N], tl.float32))
        return
    slot = raw.to(tl.int64)
    pos = tl.load(p_pos + slot * stride_pos)  # pending mode: column 0, c
    if PENDING:
        f = (pos // grid) * grid
        live = pos - f
        start = f & 15
    else:
        live = pos & 15  # == pos mod 16 for every int32
        start = pos & 0
    a = tl.load(p_A + i_h * stride_A)

    o_j = tl.arange(0, 16)
    b_dt = tl.load(p_dt + slot * stride_dt + i_h * 16 + ((start + o_j) & 15), mask=o_j < live, other=0.0)
    b_pre = tl.cumsum(b_dt, axis=0)
    pre_k = tl.sum(tl.where(o_j == 15, b_pre, 0.0), axis=0)  # the entries beyond live add 0
    b_w = b_dt * tl.exp(a * (pre_k - b_pre))  # 0 where the entry is not live (dt = 0)

    p_s0 = p_ckpt + slot * stride_ckpt + (i_h * P + o_p)[:, None].to(tl.int64) * N + o_n[None, :]
    acc = tl.exp(a * pre_k) * tl.load(p_s0).to(tl.float32)
    g = i_h // HPG
    for j in tl.static_range(16):
        on = j < live
        e_j = (start + j) & 15
        w_j = tl.sum(tl.where(o_j == j, b_w, 0.0), axis=0)
        # bf16 entries read as int16 and widened through their bits (exact; no float cast).
        # Vector masks (a scalar condition broadcast as a mask is int32 to Triton 3.9's interpreter).
        b_xj = tl.load(p_x + slot * stride_x + (i_h * 16 + e_j) * P + o_p, mask=o_p < tl.where(on, P, 0), other=0)
        b_bj = tl.load(p_b + slot * stride_b + (g * 16 + e_j) * N + o_n, mask=o_n < tl.where(on, N, 0), other=0)
        b_xj = (b_xj.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        b_bj = (b_bj.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        acc += (w_j * b_xj)[:, None] * b_bj[None, :]
    tl.store(p_o, acc)


def materialize(
    cache, ids: torch.Tensor, A: torch.Tensor, out: torch.Tensor | None = None, max_seqlen: int | None = None
) -> torch.Tensor:
    """FP32 states [n, H, P, N] of the slots in `ids` (int32/int64 [n]; padding rows read as
    zeros) into contiguous `out` (allocated when None). `A`: FP32 [H], any stride. A pending
    cache (positions [S, 2]) needs its `max_seqlen` and gives the state after the committed
    tokens."""
    ids = ids.reshape(-1)
    n = ids.numel()
    ckpt = cache[L.CHECKPOINT]
    num_slots, heads = ckpt.shape[:2]
    P, N = L.dims(cache)
    if out is None:
        out = torch.empty(n, heads, P, N, dtype=torch.float32, device=ckpt.device)
    if n == 0:
        return out
    x_ring, dt_ring, b_ring, pos = cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING], cache[L.POSITIONS]
    pending = pos.dim() == 2
    if pending and max_seqlen is None:
        raise ValueError("materialize of a pending cache (positions [S, 2]) needs its max_seqlen")
    grid = pending_grid(max_seqlen) if pending else 0
    # The interpreter pays per program: a whole head per program there; 16 rows on the GPU.
    # tl.arange takes powers of two: head dim 80 runs 16 rows a program on both.
    block_p = 64 if P == 64 and interpreting() else 16
    _materialize_kernel[(n, heads, P // block_p)](
        ids, A, ckpt, x_ring.view(torch.int16), dt_ring, b_ring.view(torch.int16), pos, out,
        ids.stride(0), A.stride(0), ckpt.stride(0), x_ring.stride(0), dt_ring.stride(0), b_ring.stride(0),
        pos.stride(0), out.stride(0), num_slots, grid,
        H=heads, HPG=heads // b_ring.shape[1], P=P, N=N, BLOCK_P=block_p, PENDING=pending, num_warps=4,
    )  # fmt: skip
    return out
