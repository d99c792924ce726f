"""Speculative Mamba-2 decode as engines run it today: a bf16-state step that writes an
intermediate state per draft token, then a commit of the accepted one (the baseline of
pending mode; no ReplaySSM).

A speculative step gives each batch row T tokens (the last verified token and T - 1
drafts). The engine does not yet know how many will be accepted, so it must be able to
resume from the state after any of them. vLLM and SGLang do that for Mamba-2 by keeping
the state cache untouched during the step and writing every intermediate state
S_1 .. S_T to a per-layer buffer in the state dtype; after verification a second
operation copies the state after the last accepted token into the state cache.

Step (`spec_step`, one Triton kernel): per batch row and head, read the state S [P, N]
(bf16, or fp32; head dim P 64 or 80, state dim N 128 or 256) from the slot-indexed cache
[num_slots, H, P, N] once, then for
t = 0 .. T-1, in FP32 registers and with the math of benchmarks/standard_decode.py,

    dt' = softplus(dt_t + dt_bias)   (linear above 20)
    S   = exp(A dt') S + dt' x_t (x) B_t
    y_t = S . C_t + D x_t            (bf16 out [b, T, H, P], from the unrounded FP32 S)

and write S, rounded to nearest in the state dtype, to inter[row, t] ([b, T, H, P, N],
indexed by batch row). The state cache is not written. The chain within a step stays in
FP32 (as in the engines' kernels); only the stored copies are rounded. Rows whose slot is
<= 0 or >= num_slots are padding: zero outputs, nothing read or written.

Commit (`spec_commit`, a second small Triton kernel, not a torch gather/copy: a torch
`state[slots] = inter[rows, a - 1]` needs the live rows selected on the host, which
synchronizes and cannot be captured in a CUDA graph): per live row with a =
num_accepted[row] >= 1 (clamped to T; it counts the step's first token), copy
inter[row, a - 1] into state[slot]. Rows with a <= 0 and padding rows change nothing.

Bytes per live row and layer, state of e bytes per element and E = H * P * N
elements: the step reads E * e and writes T * E * e; the commit reads and writes E * e;
inputs and outputs come on top (`step_bytes`).

Kernel shape: one program per (head-dim block of BLOCK_P rows, head, batch row) for both
kernels, as the standard decode. `spec_step_ref` / `spec_commit_ref` are the PyTorch
twins (FP32 arithmetic in the kernel's order, the kernel's softplus formula);
`replayssm.synthetic.ExactRecurrence` is the FP64 ground truth of the accepted stream.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from benchmarks.standard_decode import _softplus, _store_rn, _tile
from replayssm.layout import HEAD_DIM, STATE_DIM


@triton.jit
def spec_step_kernel(
    state,  # [num_slots, H, P, N] bf16 / fp32, read only
    inter,  # [b, T, H, P, N] state dtype, written
    x,  # [b, T, H, P] bf16
    dt,  # [b, T, H] raw dt (head stride may be anything)
    A,  # [H]
    B,  # [b, T, G, N] bf16
    C,  # [b, T, G, N] bf16
    D,  # [H, P] (strides may be 0)
    dt_bias,  # [H]
    slots,  # [b] int32 / int64
    out,  # [b, T, H, P] bf16
    num_slots,
    stride_s_slot,
    stride_s_head,
    stride_s_p,
    stride_i_b,
    stride_i_t,
    stride_i_head,
    stride_i_p,
    stride_x_b,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_t,
    stride_dt_h,
    stride_a_h,
    stride_bc_b,
    stride_bc_t,
    stride_bc_g,
    stride_c_b,
    stride_c_t,
    stride_c_g,
    stride_d_h,
    stride_d_p,
    stride_dtb_h,
    stride_o_b,
    stride_o_t,
    stride_o_h,
    T: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    i_b, i_h, i_g, slot, valid, o_p, o_n, m_p, m_n, m_s = _tile(slots, num_slots, HEADS_PER_GROUP, BLOCK_P, P, N)

    b_dtb = tl.load(dt_bias + i_h * stride_dtb_h).to(tl.float32)
    b_a = tl.load(A + i_h * stride_a_h).to(tl.float32)
    b_D = tl.load(D + i_h * stride_d_h + o_p * stride_d_p, mask=m_p, other=0.0).to(tl.float32)

    p_s = state + slot * stride_s_slot + i_h * stride_s_head + o_p[:, None] * stride_s_p + o_n[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0, eviction_policy="evict_first").to(tl.float32)
    p_i = inter + i_b * stride_i_b + i_h * stride_i_head + o_p[:, None] * stride_i_p + o_n[None, :]
    for t in tl.static_range(T):
        b_dt = tl.load(dt + i_b * stride_dt_b + t * stride_dt_t + i_h * stride_dt_h).to(tl.float32)
        b_dt = _softplus(b_dt + b_dtb)
        b_decay = tl.exp(b_a * b_dt)
        b_x = tl.load(x + i_b * stride_x_b + t * stride_x_t + i_h * stride_x_h + o_p * stride_x_p, mask=m_p,
                      other=0.0).to(tl.float32)  # fmt: skip
        b_B = tl.load(B + i_b * stride_bc_b + t * stride_bc_t + i_g * stride_bc_g + o_n, mask=m_n,
                      other=0.0).to(tl.float32)  # fmt: skip
        b_C = tl.load(C + i_b * stride_c_b + t * stride_c_t + i_g * stride_c_g + o_n, mask=m_n,
                      other=0.0).to(tl.float32)  # fmt: skip
        b_s = b_s * b_decay + (b_x * b_dt)[:, None] * b_B[None, :]
        _store_rn(p_i + t * stride_i_t, b_s, m_s, SOFT_BF16, "evict_first")
        # y from the unrounded FP32 state (padding rows: b_s, b_x are all zero -> y = 0).
        b_y = tl.sum(b_s * b_C[None, :], axis=1) + b_D * b_x
        _store_rn(out + i_b * stride_o_b + t * stride_o_t + i_h * stride_o_h + o_p, b_y, o_p < P, SOFT_BF16, "")


@triton.jit
def spec_commit_kernel(
    state,  # [num_slots, H, P, N], written
    inter,  # [b, T, H, P, N], read
    slots,  # [b]
    num_accepted,  # [b] int32 / int64
    num_slots,
    stride_s_slot,
    stride_s_head,
    stride_s_p,
    stride_i_b,
    stride_i_t,
    stride_i_head,
    stride_i_p,
    T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
):
    NUM_PB: tl.constexpr = P // BLOCK_P
    i_hp = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_h = i_hp // NUM_PB
    i_p = i_hp % NUM_PB
    slot = tl.load(slots + i_b).to(tl.int64)
    acc = tl.load(num_accepted + i_b).to(tl.int64)
    valid = (slot > 0) & (slot < num_slots) & (acc > 0)
    slot = tl.where(valid, slot, 0)
    src_t = tl.where(valid, tl.minimum(acc, T) - 1, 0)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, N)
    m_s = (o_p < tl.where(valid, P, 0))[:, None] & (o_n < tl.where(valid, N, 0))[None, :]
    p_i = inter + i_b * stride_i_b + src_t * stride_i_t + i_h * stride_i_head + o_p[:, None] * stride_i_p + o_n[None, :]
    v = tl.load(p_i, mask=m_s, other=0.0, eviction_policy="evict_first")
    p_s = state + slot * stride_s_slot + i_h * stride_s_head + o_p[:, None] * stride_s_p + o_n[None, :]
    tl.store(p_s, v, mask=m_s, eviction_policy="evict_first")


BLOCK_P, NUM_WARPS = 16, 4  # the standard decode's default tile (benchmarks/standard_decode.py); divides P = 64, 80


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _scalars(dt, A, D, dt_bias, batch, T, heads):
    """dt as [b, T, H] (a tied [b, T, H, P] view is sliced), A, dt_bias as [H], D as [H, k]."""
    dt3 = dt[..., 0] if dt.dim() == 4 else dt.reshape(batch, T, heads)
    return dt3, A.reshape(heads, -1)[:, 0], D.reshape(heads, -1), dt_bias.reshape(heads, -1)[:, 0]


def new_inter(state: torch.Tensor, batch: int, T: int) -> torch.Tensor:
    """An intermediate-state buffer [batch, T, H, P, N] in the state's dtype and geometry."""
    return torch.empty(batch, T, *state.shape[1:], dtype=state.dtype, device=state.device)


def spec_step(state, inter, x, dt, A, B, C, D, dt_bias, state_indices, out=None) -> torch.Tensor:
    """Launch one speculative step (module docstring); returns `out` [b, T, H, P] bf16.

    state [num_slots, H, P, N] bf16 / fp32 (rows contiguous), read only; inter [b, T,
    H, P, N] in the state dtype (rows contiguous), written for live rows; x [b, T, H,
    P] bf16; dt [b, T, H] or a tied [b, T, H, P] view; A, dt_bias [H] or tied views; D
    [H] or [H, P]; B, C [b, T, G, N] bf16; state_indices [b] int32 / int64."""
    num_slots, heads, P, N = state.shape
    batch, T = x.shape[0], x.shape[1]
    groups = B.shape[2]
    if out is None:
        out = torch.empty(batch, T, heads, P, dtype=torch.bfloat16, device=state.device)
    if batch == 0:
        return out
    assert state.stride(3) == 1 and state.stride(2) == N, "state rows must be contiguous"
    assert inter.shape[:3] == (batch, T, heads) and inter.dtype == state.dtype
    assert inter.stride(4) == 1 and B.stride(3) == 1 and C.stride(3) == 1 and out.stride(3) == 1
    dt3, A1, D2, dtb1 = _scalars(dt, A, D, dt_bias, batch, T, heads)
    stride_d_p = 0 if D2.shape[1] == 1 else D2.stride(1)
    grid = (heads * (P // BLOCK_P), batch)
    spec_step_kernel[grid](
        state, inter, x, dt3, A1, B, C, D2, dtb1, state_indices.reshape(-1), out,
        num_slots,
        state.stride(0), state.stride(1), state.stride(2),
        inter.stride(0), inter.stride(1), inter.stride(2), inter.stride(3),
        x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        dt3.stride(0), dt3.stride(1), dt3.stride(2),
        A1.stride(0),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        D2.stride(0), stride_d_p,
        dtb1.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        T=T, HEADS_PER_GROUP=heads // groups, BLOCK_P=BLOCK_P, P=P, N=N, SOFT_BF16=_interpreting(),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def spec_commit(state, inter, state_indices, num_accepted) -> None:
    """Launch the commit: state[slot] = inter[row, min(a, T) - 1] for live rows with a =
    num_accepted[row] >= 1 (module docstring)."""
    num_slots, heads, P, N = state.shape
    batch, T = inter.shape[0], inter.shape[1]
    if batch == 0:
        return
    assert inter.dtype == state.dtype and inter.stride(4) == 1 and state.stride(3) == 1
    grid = (heads * (P // BLOCK_P), batch)
    spec_commit_kernel[grid](
        state, inter, state_indices.reshape(-1), num_accepted.reshape(-1), num_slots,
        state.stride(0), state.stride(1), state.stride(2),
        inter.stride(0), inter.stride(1), inter.stride(2), inter.stride(3),
        T=T, BLOCK_P=BLOCK_P, P=P, N=N, num_warps=NUM_WARPS,
    )  # fmt: skip


def _softplus_ref(v: torch.Tensor) -> torch.Tensor:
    """The kernel's softplus in FP32 torch ops (log1p by Goldberg's formula, linear above 20)."""
    u = torch.exp(torch.clamp_max(v, 20.0))
    w = 1.0 + u
    den = torch.where(w == 1.0, torch.ones_like(w), w - 1.0)
    lp = torch.where(w == 1.0, u, torch.log(w) * (u / den))
    return torch.where(v > 20.0, v, lp)


def spec_step_ref(state, inter, x, dt, A, B, C, D, dt_bias, state_indices, out=None) -> torch.Tensor:
    """PyTorch twin of `spec_step` (same arguments, FP32 arithmetic in the kernel's order,
    intermediate states stored round-to-nearest in the state dtype); returns `out`."""
    num_slots, heads, P = state.shape[:3]
    batch, T = x.shape[0], x.shape[1]
    groups = B.shape[2]
    if out is None:
        out = torch.empty(batch, T, heads, P, dtype=torch.bfloat16, device=state.device)
    slot = state_indices.reshape(-1).to(torch.int64)
    valid = (slot > 0) & (slot < num_slots)
    out[~valid] = 0
    if not bool(valid.any()):
        return out
    dt3, A1, D2, dtb1 = _scalars(dt, A, D, dt_bias, batch, T, heads)
    A1, dtb1 = A1.float(), dtb1.float()
    D2 = D2.float().expand(heads, P)
    rows = valid.nonzero().flatten()
    s = state[slot[valid]].float()
    for t in range(T):
        dtp = _softplus_ref(dt3[valid, t].float() + dtb1)  # [n, H]
        decay = torch.exp(A1 * dtp)
        xs = x[valid, t].float()
        Bh = B[valid, t].float().repeat_interleave(heads // groups, 1)
        Ch = C[valid, t].float().repeat_interleave(heads // groups, 1)
        s = s * decay[:, :, None, None] + (xs * dtp[:, :, None])[:, :, :, None] * Bh[:, :, None, :]
        inter[rows, t] = s.to(inter.dtype)
        out[rows, t] = ((s * Ch[:, :, None, :]).sum(-1) + D2 * xs).to(torch.bfloat16)
    return out


def spec_commit_ref(state, inter, state_indices, num_accepted) -> None:
    """PyTorch twin of `spec_commit` (host loop over rows)."""
    num_slots, T = state.shape[0], inter.shape[1]
    for row, (s, a) in enumerate(zip(state_indices.reshape(-1).tolist(), num_accepted.reshape(-1).tolist())):
        if 0 < s < num_slots and a > 0:
            state[s] = inter[row, min(a, T) - 1]


def spec_baseline_ref(state, inter, x, dt, A, B, C, D, dt_bias, state_indices, num_accepted, out=None):
    """The baseline's whole call in PyTorch: `spec_step_ref` then `spec_commit_ref`
    (num_accepted None: accept every token); returns `out`."""
    out = spec_step_ref(state, inter, x, dt, A, B, C, D, dt_bias, state_indices, out)
    if num_accepted is None:
        num_accepted = torch.full_like(state_indices, x.shape[1])
    spec_commit_ref(state, inter, state_indices, num_accepted)
    return out


def step_bytes(heads: int, groups: int, T: int, state_bytes: int = 2, head_dim: int = HEAD_DIM,
               state_dim: int = STATE_DIM) -> dict[str, int]:  # fmt: skip
    """DRAM bytes of one live row and layer: the step (state read once, T intermediate
    states written, T tokens of inputs and outputs, the slot id) and the commit (one
    intermediate state read, the state written, the slot id and count)."""
    e = heads * head_dim * state_dim * state_bytes
    tok_in = heads * head_dim * 2 + heads * 4 + 2 * groups * state_dim * 2
    tok_out = heads * head_dim * 2
    return {"step": e + T * e + T * (tok_in + tok_out) + 4, "commit": 2 * e + 8}


__all__ = [
    "spec_step", "spec_commit", "spec_step_ref", "spec_commit_ref", "spec_baseline_ref", "new_inter", "step_bytes",
    "spec_step_kernel", "spec_commit_kernel",
]  # fmt: skip
