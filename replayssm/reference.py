"""Pure-PyTorch reference of every replayssm operation (CPU or CUDA), split as the kernels
are and with their argument names. Quantization and random bits come from
`replayssm.quant` (bit-exact with the kernels); float accumulation is FP32 in the
kernels' order. Inputs are normalized by `replayssm.api`: x [batch, H, P] bf16, dt
[batch, H] f32 (raw), A [H] f32, D [H, P] f32, dt_bias [H] f32, B, C [batch, G, N] bf16,
slots [batch] int (P, N the cache's `layout.dims`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import layout as L
from .formats import Format
from .quant.minifloat import to_fp16
from .quant.rng import INIT_POSITION, checkpoint_rbits, stream_key


class Plan(NamedTuple):
    """What `prepare_decode` tells the decode kernels about each batch row."""

    valid: torch.Tensor  # bool [batch]: the row names a live slot
    slot: torch.Tensor  # int64 [batch]: slot id (0 for padding rows)
    ring_index: torch.Tensor  # int64 [batch]: positions[slot] mod 16 before the step
    flush: torch.Tensor  # bool [batch]: valid and ring_index == 15
    key: torch.Tensor  # int64 [batch]: random-stream tag (uint32), see quant/rng.py
    old_parity: torch.Tensor  # int64 [batch]: NVFP4 live half before the step (0 for fp8)


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """softplus(dt + dt_bias) in FP32, linear above 20 (as the serving engine does)."""
    return F.softplus(dt.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def valid_rows(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    return (slots > 0) & (slots < num_slots)


def clear(cache: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
    """Zero the rings and positions of the valid `slots` (both position layouts)."""
    slot = slots.to(torch.int64)
    slot = slot[valid_rows(slot, cache[L.CHECKPOINT].shape[0])]
    for i in (L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS):
        cache[i][slot] = 0


def initialize(
    cache: Sequence[torch.Tensor], states: torch.Tensor, slots: torch.Tensor, *, fmt: Format, seed: int, head_offset: int = 0
) -> None:
    """FP16 checkpoint (stochastic rounding, tag INIT_POSITION, `head_offset` as in
    checkpoint_rbits) and read copy from FP32 `states` [batch, H, P, N]; rings, positions cleared."""
    slot = slots.reshape(-1).to(torch.int64)
    keep = valid_rows(slot, cache[L.CHECKPOINT].shape[0])
    slot, state = slot[keep], states[keep].float()
    key = stream_key(seed, slot, torch.full_like(slot, INIT_POSITION))
    rbits = checkpoint_rbits(key, state.shape[1], head_offset, *L.dims(cache))
    cache[L.CHECKPOINT][slot] = to_fp16(state, rbits)
    fmt.init(cache, slot, state)
    clear(cache, slot)


def prepare_decode(
    cache: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor, *, fmt: Format, seed: int
) -> Plan:
    """Per-row plan; zero the output rows of padding rows; advance positions; for NVFP4
    flush rows flip the parity and zero the half that becomes the amax accumulator."""
    slot = slots.reshape(-1).to(torch.int64)
    valid = valid_rows(slot, cache[L.CHECKPOINT].shape[0])
    slot = torch.where(valid, slot, 0)
    pos = torch.where(valid, cache[L.POSITIONS][slot].to(torch.int64), 0)
    ring_index = pos % L.RING
    flush = valid & (ring_index == L.RING - 1)
    key = stream_key(seed, slot, pos)
    old_parity = torch.zeros_like(slot)
    out.reshape(slot.shape[0], -1)[~valid] = 0
    cache[L.POSITIONS][slot[valid]] = (pos[valid] + 1).to(torch.int32)
    old_parity[flush] = fmt.flip(cache, slot[flush])
    return Plan(valid, slot, ring_index, flush, key, old_parity)


def ring_entries(cache, slot, start, count):
    """Ring entries of token indices start .. start+count-1 (count <= 16) in logical order,
    FP32: x [n, H, 16, P], dt [n, H, 16], B [n, G, 16, N]; entries past `count` are zero
    (selected with where, never multiplied: dead entries may hold NaN)."""
    j = torch.arange(L.RING, device=slot.device)
    idx = (start.view(-1, 1) + j.view(1, -1)) % L.RING  # [n, 16]
    live = j.view(1, -1) < count.view(-1, 1)
    zero = torch.zeros((), device=slot.device)
    out = []
    for i in (L.X_RING, L.DT_RING, L.B_RING):
        t = cache[i][slot].float()
        shape = (-1, 1, L.RING) + (1,) * (t.dim() - 3)
        out.append(torch.where(live.view(shape), t.gather(2, idx.view(shape).expand(t.shape)), zero))
    return out


def _entries(cache, slot, x, dt, B, r):
    """Ring entries 0..r-1 of each row plus the current token at entry r (as `ring_entries`)."""
    cur = torch.arange(L.RING, device=x.device).view(1, -1) == r.view(-1, 1)  # [n, 16]
    pairs = zip(ring_entries(cache, slot, torch.zeros_like(r), r), (x.float(), dt, B.float()))
    return [torch.where(cur.view(-1, 1, L.RING, *(1,) * (e.dim() - 3)), v.unsqueeze(2), e) for e, v in pairs]


def replay_weights(dt_e: torch.Tensor, A: torch.Tensor, last: torch.Tensor):
    """pre_j = dt_0 + .. + dt_j; (exp(A pre_last) [n, H], w_j = dt_j exp(A (pre_last - pre_j))
    [n, H, E], zero for j > last). last = -1 gives decay 1 and no terms."""
    pre = torch.cumsum(dt_e, dim=-1)
    pre_k = pre.gather(-1, last.clamp_min(0).view(-1, 1, 1).expand(-1, pre.shape[1], 1))  # [n, H, 1]
    pre_k = torch.where(last.view(-1, 1, 1) >= 0, pre_k, torch.zeros((), device=pre.device))
    a = A.view(1, -1, 1)
    w = dt_e * torch.exp(a * (pre_k - pre))
    j = torch.arange(dt_e.shape[-1], device=dt_e.device)
    w = torch.where(j.view(1, 1, -1) <= last.view(-1, 1, 1), w, torch.zeros((), device=w.device))
    return torch.exp(a * pre_k).squeeze(-1), w


def fold_entries(cache, slot, x_e, dt_e, B_e, A, last) -> torch.Tensor:
    """FP32 state after folding entries 0..last into the FP16 checkpoint:
    exp(A pre_last) S_ckpt + sum_j w_j x_j (x) B_j."""
    decay, w = replay_weights(dt_e, A, last)
    s0 = cache[L.CHECKPOINT][slot].float()
    upd = torch.einsum("nhj,nhjp,nhjk->nhpk", w, x_e, expand_groups(B_e, x_e.shape[1]))
    return decay[:, :, None, None] * s0 + upd


def expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[n, G, ...] -> [n, H, ...] (head h reads group h // (H / G))."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _select(rows, plan: Plan, x, dt, B, C, dt_bias):
    """The plan's slot and ring index and the step's inputs (processed dt, C as FP32) of `rows`."""
    dts = softplus_dt(dt[rows], dt_bias.view(1, -1))
    return plan.slot[rows], plan.ring_index[rows], x[rows], dts, B[rows], C[rows].float()


def decode_nonflush(cache, x, dt, A, B, C, D, dt_bias, plan: Plan, out, *, fmt: Format) -> None:
    """Rows that do not flush: y = exp(A pre_k) (read copy . C) + ring replay + D x;
    the token's (x, processed dt, B) is stored at ring entry `ring_index`."""
    rows = plan.valid & ~plan.flush
    if not bool(rows.any()):
        return
    slot, r, xs, dts, Bs, Cs = _select(rows, plan, x, dt, B, C, dt_bias)
    heads = xs.shape[1]
    x_e, dt_e, B_e = _entries(cache, slot, xs, dts, Bs, r)
    decay, w = replay_weights(dt_e, A, r)
    y = decay.unsqueeze(-1) * torch.einsum("nhpk,nhk->nhp", fmt.read(cache, slot), expand_groups(Cs, heads))
    bc = torch.einsum("ngjk,ngk->ngj", B_e, Cs)  # B_j . C, shared by a group's heads
    y = y + torch.einsum("nhj,nhjp->nhp", w * expand_groups(bc, heads), x_e)
    y = y + D.view(1, heads, -1) * xs.float()
    out[rows] = y.to(out.dtype)
    for i, v in ((L.X_RING, xs), (L.DT_RING, dts), (L.B_RING, Bs)):
        cache[i][slot, :, r] = v


def fold(cache, slot, x, dts, B, A, last) -> torch.Tensor:
    """FP32 state after folding ring entries 0..last-1 and the current token (entry
    `last`) into the FP16 checkpoint."""
    return fold_entries(cache, slot, *_entries(cache, slot, x, dts, B, last), A, last)


def decode_flush(cache, x, dt, A, B, C, D, dt_bias, plan: Plan, out, *, fmt: Format, seed: int, head_offset: int = 0) -> None:
    """Rows at ring index 15: fold 16 tokens into the checkpoint in FP32, output from the
    unrounded state, checkpoint written with stochastic rounding, read copy re-derived."""
    rows = plan.flush
    if not bool(rows.any()):
        return
    slot, r, xs, dts, Bs, Cs = _select(rows, plan, x, dt, B, C, dt_bias)
    heads = xs.shape[1]
    state = fold(cache, slot, xs, dts, Bs, A, r)
    y = torch.einsum("nhpk,nhk->nhp", state, expand_groups(Cs, heads)) + D.view(1, heads, -1) * xs.float()
    out[rows] = y.to(out.dtype)
    cache[L.CHECKPOINT][slot] = to_fp16(state, checkpoint_rbits(plan.key[rows], heads, head_offset, *L.dims(cache)))
    fmt.refresh(cache, slot, state, plan.old_parity[rows])


def decode(cache, x, dt, A, B, C, D, dt_bias, slots, out, *, fmt: Format, seed: int, head_offset: int = 0) -> torch.Tensor:
    """One decode step for a batch (normalized inputs); returns `out` [batch, H, P]."""
    plan = prepare_decode(cache, slots, out, fmt=fmt, seed=seed)
    decode_nonflush(cache, x, dt, A, B, C, D, dt_bias, plan, out, fmt=fmt)
    decode_flush(cache, x, dt, A, B, C, D, dt_bias, plan, out, fmt=fmt, seed=seed, head_offset=head_offset)
    return out


def materialize(
    cache: Sequence[torch.Tensor], slots: torch.Tensor, A: torch.Tensor, grid: int = L.RING
) -> torch.Tensor:
    """FP32 state [n, H, P, N] of `slots` after every decoded (committed) token c: the FP16
    checkpoint, standing at token index f = grid * (c div grid), advanced through ring entries
    f .. c-1 (`grid`: pending mode's). Padding rows (slot <= 0 or >= num_slots) read as zero
    states, as decode writes zero outputs for them. Reads only."""
    num_slots, heads, P, N = cache[L.CHECKPOINT].shape
    slot = slots.reshape(-1).to(torch.int64)
    valid = valid_rows(slot, num_slots)
    states = torch.zeros(slot.shape[0], heads, P, N, device=slot.device)
    slot = slot[valid]
    c = cache[L.POSITIONS][slot].to(torch.int64)
    c = c[:, 0] if c.dim() == 2 else c
    f = (c // grid) * grid
    states[valid] = fold_entries(cache, slot, *ring_entries(cache, slot, f, c - f), A.float(), c - f - 1)
    return states
