"""Standard Mamba-2 decode (no ReplaySSM): the baseline every speedup is quoted against.

This is the step a serving engine runs when it keeps the full recurrent state: per batch
row and head, read the state S [P, N] (fp32, bf16 or fp16; head dim P 64 or 80, state dim
N 128 or 256) from a slot-indexed cache [num_slots, H, P, N], and

    dt' = softplus(dt + dt_bias)   (linear above 20)
    S   = exp(A dt') S + dt' x (x) B
    y   = S . C + D x               (bf16 out [batch, H, P])

then write S back in its storage dtype (round to nearest on the GPU). Rows whose slot is
<= 0 or >= num_slots are padding: zero output, nothing read or written in the cache.

Kernel shape: one program per (head-dim block of BLOCK_P rows, head, batch row); BLOCK_P
(a power of two) divides P, so 16 at most for P = 80. A
program streams its BLOCK_P x N tile of the state once (read, update in registers,
write), so the kernel is a pure stream over the state and its speed is judged against the
copy bandwidth. The tile is contiguous (N state values per row, rows adjacent), so the
loads and stores vectorize to 16-byte accesses (ld/st.global.v4.b32 in the sm_90a PTX,
checked by a compile-only test); axis 0 of the grid walks the tiles of one slot in
address order. At batch 32 with 16 heads and BLOCK_P = 16 that is 2,048 programs, about
15 per SM on an H200's 132 SMs. No tl.dot: the contraction with C is an N-wide
multiply and row sum, which is not compute-bound anywhere near the stream rate.

`standard_decode_ref` is the same computation in plain PyTorch (FP32 arithmetic in the
kernel's order); `replayssm.synthetic.ExactRecurrence` is the FP64 ground truth.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _softplus(v):
    # softplus(v) = log1p(exp(v)), linear above 20 (as the serving engine). log1p from
    # log(w) * u / (w - 1), w = 1 + u (Goldberg): a plain log(1 + u) loses ~1e-4 relative
    # accuracy at the typical dt' ~ 1e-3, where u = exp(v) is small.
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    den = tl.where(w == 1.0, 1.0, w - 1.0)
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / den))
    return tl.where(v > 20.0, v, lp)


@triton.jit
def _store_rn(p, v, mask, SOFT_BF16: tl.constexpr, EVICT: tl.constexpr):
    # Store FP32 `v` at `p` rounded to nearest-even in p's dtype. The Triton interpreter's
    # float32 -> bfloat16 cast truncates; SOFT_BF16 (set only there) rounds with integer
    # ops instead, which is what the GPU's cvt.rn.bf16 does, so CPU tests see the GPU's
    # bits. Finite values only.
    if SOFT_BF16:
        if p.dtype.element_ty == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            tl.store(p, b.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(p, v.to(p.dtype.element_ty), mask=mask)
    else:
        tl.store(p, v.to(p.dtype.element_ty), mask=mask, eviction_policy=EVICT)


@triton.jit
def _tile(slots, num_slots, HEADS_PER_GROUP: tl.constexpr, BLOCK_P: tl.constexpr, P: tl.constexpr, N: tl.constexpr):
    """This program's (row, head, group, slot, valid, P offsets, N offsets, P / N / tile masks):
    grid (heads * P // BLOCK_P, batch)."""
    NUM_PB: tl.constexpr = P // BLOCK_P
    i_hp = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_h = i_hp // NUM_PB
    slot = tl.load(slots + i_b).to(tl.int64)
    valid = (slot > 0) & (slot < num_slots)
    # Padding rows address slot 0 (never dereferenced: every cache access is masked).
    slot = tl.where(valid, slot, 0)
    o_p = (i_hp % NUM_PB) * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, N)
    m_p = o_p < tl.where(valid, P, 0)
    m_n = o_n < tl.where(valid, N, 0)
    return i_b, i_h, i_h // HEADS_PER_GROUP, slot, valid, o_p, o_n, m_p, m_n, m_p[:, None] & m_n[None, :]


@triton.jit
def standard_decode_kernel(
    state,  # [num_slots, H, P, N] fp32 / bf16 / fp16, updated in place
    x,  # [batch, H, P] bf16
    dt,  # [batch, H] raw dt (strides may be 0: tied)
    A,  # [H]
    B,  # [batch, G, N] bf16
    C,  # [batch, G, N] bf16
    D,  # [H, P] (strides may be 0)
    dt_bias,  # [H]
    slots,  # [batch] int32 / int64
    out,  # [batch, H, P] bf16
    num_slots,
    stride_s_slot,
    stride_s_head,
    stride_s_p,
    stride_x_b,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_h,
    stride_a_h,
    stride_bc_b,
    stride_bc_g,
    stride_c_b,
    stride_c_g,
    stride_d_h,
    stride_d_p,
    stride_dtb_h,
    stride_o_b,
    stride_o_h,
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    i_b, i_h, i_g, slot, valid, o_p, o_n, m_p, m_n, m_s = _tile(slots, num_slots, HEADS_PER_GROUP, BLOCK_P, P, N)

    b_dt = tl.load(dt + i_b * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
    b_dtb = tl.load(dt_bias + i_h * stride_dtb_h).to(tl.float32)
    b_a = tl.load(A + i_h * stride_a_h).to(tl.float32)
    b_dt = _softplus(b_dt + b_dtb)
    b_decay = tl.exp(b_a * b_dt)

    b_x = tl.load(x + i_b * stride_x_b + i_h * stride_x_h + o_p * stride_x_p, mask=m_p, other=0.0).to(tl.float32)
    b_B = tl.load(B + i_b * stride_bc_b + i_g * stride_bc_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(C + i_b * stride_c_b + i_g * stride_c_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_D = tl.load(D + i_h * stride_d_h + o_p * stride_d_p, mask=m_p, other=0.0).to(tl.float32)

    p_s = state + slot * stride_s_slot + i_h * stride_s_head + o_p[:, None] * stride_s_p + o_n[None, :]
    # The state is touched once: do not let it evict the small, reused inputs from L2.
    b_s = tl.load(p_s, mask=m_s, other=0.0, eviction_policy="evict_first").to(tl.float32)
    b_s = b_s * b_decay + (b_x * b_dt)[:, None] * b_B[None, :]
    _store_rn(p_s, b_s, m_s, SOFT_BF16, "evict_first")

    # y from the unrounded FP32 state (padding rows: b_s, b_x are all zero -> y = 0).
    b_y = tl.sum(b_s * b_C[None, :], axis=1) + b_D * b_x
    _store_rn(out + i_b * stride_o_b + i_h * stride_o_h + o_p, b_y, o_p < P, SOFT_BF16, "")


def default_config(state_dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_P, num_warps). A 16-row tile is 8 KiB of fp32 (4 KiB of bf16 / fp16) per
    program: 48 (40) registers per thread on sm_90a, so about 10 programs per SM are
    resident, 40-80 KiB of loads in flight per SM, and batch 32 x 16 heads still gives
    2,048 programs. `bench_decode.py --tune-standard` sweeps the alternatives."""
    return 16, 4


def standard_decode(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_p: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Launch one standard decode step (see the module docstring); returns `out`.

    state [num_slots, H, P, N] (each slot contiguous, any slot stride); x [b, H, P]
    bf16; dt [b, H] or a tied [b, H, P] view; A [H] or tied [H, P, N]; dt_bias [H] or
    tied [H, P]; D [H] or [H, P]; B, C [b, G, N] bf16; state_indices [b] int32/int64.
    The launcher maps tensors to kernel arguments; shapes are assumed valid.
    """
    num_slots, heads, P, N = state.shape
    batch = state_indices.numel()
    groups = B.shape[1]
    if out is None:
        out = torch.empty(batch, heads, P, dtype=torch.bfloat16, device=state.device)
    if batch == 0:
        return out
    assert state.stride(3) == 1 and state.stride(2) == N, "state rows must be contiguous"
    assert B.stride(2) == 1 and C.stride(2) == 1 and out.stride(2) == 1
    dt2 = dt.reshape(batch, heads, -1)[:, :, 0] if dt.dim() == 3 else dt
    A1 = A.reshape(heads, -1)[:, 0]
    dtb1 = dt_bias.reshape(heads, -1)[:, 0]
    D2 = D.reshape(heads, -1)
    stride_d_p = 0 if D2.shape[1] == 1 else D2.stride(1)
    bp, nw = default_config(state.dtype)
    bp = block_p or bp
    nw = num_warps or nw
    assert P % bp == 0, f"BLOCK_P {bp} must divide the head dim {P}"
    grid = (heads * (P // bp), batch)
    standard_decode_kernel[grid](
        state, x, dt2, A1, B, C, D2, dtb1, state_indices.reshape(-1), out,
        num_slots,
        state.stride(0), state.stride(1), state.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        dt2.stride(0), dt2.stride(1),
        A1.stride(0),
        B.stride(0), B.stride(1),
        C.stride(0), C.stride(1),
        D2.stride(0), stride_d_p,
        dtb1.stride(0),
        out.stride(0), out.stride(1),
        HEADS_PER_GROUP=heads // groups,
        BLOCK_P=bp,
        P=P,
        N=N,
        SOFT_BF16=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        num_warps=nw,
    )  # fmt: skip
    return out


def standard_decode_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch twin of `standard_decode` (same arguments, FP32 arithmetic in the kernel's
    order, state written back round-to-nearest in its dtype); returns `out`."""
    num_slots, heads, P = state.shape[:3]
    batch = state_indices.numel()
    groups = B.shape[1]
    if out is None:
        out = torch.empty(batch, heads, P, dtype=torch.bfloat16, device=state.device)
    slot = state_indices.reshape(-1).to(torch.int64)
    valid = (slot > 0) & (slot < num_slots)
    out[~valid] = 0
    if not bool(valid.any()):
        return out
    s_ids = slot[valid]
    dt2 = (dt.reshape(batch, heads, -1)[:, :, 0] if dt.dim() == 3 else dt)[valid].float()
    A1 = A.reshape(heads, -1)[:, 0].float()
    dtb1 = dt_bias.reshape(heads, -1)[:, 0].float()
    D2 = D.reshape(heads, -1).float().expand(heads, P)
    dtp = F.softplus(dt2 + dtb1, beta=1.0, threshold=20.0)  # [n, H]
    decay = torch.exp(A1 * dtp)
    xs = x[valid].float()
    Bh = B[valid].float().repeat_interleave(heads // groups, 1)
    Ch = C[valid].float().repeat_interleave(heads // groups, 1)
    s = state[s_ids].float()
    s = s * decay[:, :, None, None] + (xs * dtp[:, :, None])[:, :, :, None] * Bh[:, :, None, :]
    y = (s * Ch[:, :, None, :]).sum(-1) + D2 * xs
    state[s_ids] = s.to(state.dtype)
    out[valid] = y.to(torch.bfloat16)
    return out


__all__ = ["standard_decode", "standard_decode_ref", "standard_decode_kernel", "default_config"]
