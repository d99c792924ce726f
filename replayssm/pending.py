"""Pure-PyTorch reference of pending mode (speculative decoding), specified in docs/format.md
section 5b: positions [S, 2] = (c committed tokens, q awaiting a verdict), the fold grid
f(c) = Gd * (c div Gd) with Gd = 17 - max_seqlen. Inputs as `reference.py` takes them with a
token axis T == max_seqlen: x [b, T, H, P] (or [b, T, H*P]) bf16, dt [b, T, H] (raw), B, C
[b, T, G, N] bf16, out [b, T, H, P]; seq_lens int [b] gives T_b (None: T every row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import layout as L
from .quant.minifloat import to_fp16
from .quant.rng import checkpoint_rbits, stream_key
from .formats import Format
from .reference import expand_groups, fold_entries, materialize, replay_weights, ring_entries, valid_rows

MAX_SEQLEN = 8
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def grid(max_seqlen: int) -> int:
    """The fold grid Gd = 17 - max_seqlen (16 for max_seqlen 1, 9 for 8)."""
    return L.RING + 1 - max_seqlen


def checkpoint_index(c: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """f(c): the token index the checkpoint stands at after c committed tokens."""
    g = grid(max_seqlen)
    return (c // g) * g


def _check_max_seqlen(max_seqlen) -> None:
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 1 <= max_seqlen <= MAX_SEQLEN:
        raise ValueError(f"max_seqlen must be an int in 1..{MAX_SEQLEN}; got {max_seqlen!r}")


def _check_pending_positions(pos: torch.Tensor) -> None:
    if pos.dim() != 2 or pos.shape[1] != 2:
        raise ValueError(f"cache positions must be [slots, 2] (pending mode); got {list(pos.shape)}")


def _check_int_vector(name: str, t, batch: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor [{batch}]; got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype; got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape [{batch}]; got {list(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


def fold_range(cache, slot, start, count, A) -> torch.Tensor:
    """FP32 state after folding the ring entries of token indices start .. start+count-1
    into the FP16 checkpoint: exp(A pre_last) S_ckpt + sum_j w_j x_j (x) B_j."""
    return fold_entries(cache, slot, *ring_entries(cache, slot, start, count), A, count - 1)


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, total: int, max_seqlen: int) -> torch.Tensor:
    """Validate `cu_seqlens` on the host (int32 [batch + 1], 0 first, non-decreasing, `total`
    last, rows of at most `max_seqlen`); return the row lengths T_b (int64 [batch])."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 tensor [{batch + 1}]; got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or tuple(cu_seqlens.shape) != (batch + 1,):
        raise ValueError(
            f"cu_seqlens must be int32 [{batch + 1}] (batch + 1); got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    cu = cu_seqlens.to(torch.int64)
    host = cu.tolist()
    if host[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {host}")
    if any(b < a for a, b in zip(host, host[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {host}")
    if host[-1] != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens {total} (x.shape[0]); got {host}")
    if max((b - a for a, b in zip(host, host[1:])), default=0) > max_seqlen:
        raise ValueError(f"every row of cu_seqlens must hold at most max_seqlen={max_seqlen} tokens; got {host}")
    return cu[1:] - cu[:-1]


def varlen_to_dense(cu_seqlens: torch.Tensor, max_seqlen: int, *tensors: torch.Tensor):
    """Gather varlen tensors [total, ...] (row b's tokens cu_seqlens[b] .. cu_seqlens[b+1]-1)
    into dense [batch, max_seqlen, ...], zeros past each row's length. Returns (lens int64
    [batch], ok bool [batch, max_seqlen] (token t of row b exists), dense tensors)."""
    total = tensors[0].shape[0]
    batch = cu_seqlens.shape[0] - 1
    lens = check_cu_seqlens(cu_seqlens, batch, total, max_seqlen)
    t = torch.arange(max_seqlen, device=cu_seqlens.device)
    ok = t.view(1, -1) < lens.view(-1, 1)  # [b, T]
    idx = (cu_seqlens[:-1].to(torch.int64).view(-1, 1) + t.view(1, -1)).clamp(0, max(total - 1, 0))
    dense = []
    for v in tensors:
        shape = (batch, max_seqlen, *v.shape[1:])
        g = v[idx.reshape(-1)].reshape(shape) if total else v.new_zeros(shape)
        keep = ok.view(batch, max_seqlen, *([1] * (v.dim() - 1)))
        dense.append(torch.where(keep, g, torch.zeros((), dtype=v.dtype, device=v.device)))
    return lens, ok, dense


def pending_decode(
    cache: Sequence[torch.Tensor], x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, *,
    fmt: Format, seed: int, max_seqlen: int, num_accepted_tokens: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, head_offset: int = 0,
) -> torch.Tensor:
    """One pending-mode call (docs/format.md 5b); returns `out` [b, T, H, P]. Varlen layout
    with `cu_seqlens` (int32 [b + 1]): x [total, H, P] (or [total, H*P]), dt [total, H], B,
    C [total, G, N], out [total, H, P], gathered into the dense layout (the same bits). It
    reads a few values on the host, so it is not graph-capturable."""
    if cu_seqlens is not None and seq_lens is not None:
        raise ValueError("pass seq_lens (dense layout) or cu_seqlens (varlen layout), not both")
    _check_max_seqlen(max_seqlen)
    if cu_seqlens is not None:
        heads, P = cache[L.CHECKPOINT].shape[1:3]
        if out.shape[0] != x.shape[0] or out.numel() != x.shape[0] * heads * P:
            raise ValueError(f"out must be [{x.shape[0]}, {heads}, {P}] (varlen: one row a token); got {list(out.shape)}")
        lens, ok, (xd, dtd, Bd, Cd) = varlen_to_dense(cu_seqlens, max_seqlen, x, dt, B, C)
        dense_out = torch.empty(xd.shape[0], max_seqlen, heads, P, dtype=out.dtype, device=out.device)
        pending_decode(
            cache, xd, dtd, A, Bd, Cd, D, dt_bias, slots, dense_out, fmt=fmt, seed=seed, max_seqlen=max_seqlen,
            num_accepted_tokens=num_accepted_tokens, seq_lens=lens, head_offset=head_offset,
        )
        out.copy_(dense_out[ok].reshape(out.shape))
        return out
    if len(cache) != (want := fmt.cache_len()):
        raise ValueError(f"cache must hold {want} tensors for state_dtype {fmt.name!r}; got {len(cache)}")
    num_slots, heads, P, N = cache[L.CHECKPOINT].shape
    groups = cache[L.B_RING].shape[1]
    _check_pending_positions(cache[L.POSITIONS])
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _INT_DTYPES:
        raise ValueError("slots must be a 1-D integer tensor")
    b, T = slots.shape[0], max_seqlen
    if x.dim() == 3 and x.shape[2] == heads * P:
        x = x.reshape(x.shape[0], x.shape[1], heads, P)
    if tuple(x.shape) != (b, T, heads, P):
        raise ValueError(f"x must be [{b}, {T}, {heads}, {P}] (T == max_seqlen); got {list(x.shape)}")
    shapes = (("dt", dt, (b, T, heads)), ("B", B, (b, T, groups, N)), ("C", C, (b, T, groups, N)),
              ("A", A, (heads,)), ("dt_bias", dt_bias, (heads,)), ("D", D, (heads,), (heads, P)),
              ("out", out, (b, T, heads, P)))  # fmt: skip
    for name, t, *allow in shapes:
        if tuple(t.shape) not in allow:
            raise ValueError(f"{name} must be {' or '.join(map(str, map(list, allow)))}; got {list(t.shape)}")
    dev = slots.device
    if num_accepted_tokens is not None:
        num_accepted_tokens = _check_int_vector("num_accepted_tokens", num_accepted_tokens, b, dev)
    if seq_lens is None:
        seq_lens = torch.full((b,), T, dtype=torch.int64, device=dev)
    else:
        seq_lens = _check_int_vector("seq_lens", seq_lens, b, dev)
        if bool(((seq_lens < 0) | (seq_lens > T)).any()):
            raise ValueError(f"seq_lens must lie in 0..max_seqlen={T}; got {seq_lens.tolist()}")
    slot_all = slots.to(torch.int64)
    valid = valid_rows(slot_all, num_slots)
    rows = valid.nonzero().squeeze(-1)
    slot = slot_all[rows]
    pos = cache[L.POSITIONS][slot].to(torch.int64)
    c, q = pos[:, 0], pos[:, 1]
    if bool((q > T).any()):
        raise ValueError(
            f"max_seqlen={T} is smaller than a slot's pending count {int(q.max())}: "
            "a cache's slots are decoded with one max_seqlen between inits"
        )
    out.zero_()
    if not bool(valid.any()):
        return out
    A = A.float()
    a = q if num_accepted_tokens is None else torch.minimum(num_accepted_tokens[rows].clamp_min(0), q)
    c_new = c + a
    f_old = checkpoint_index(c, max_seqlen)
    f_new = checkpoint_index(c_new, max_seqlen)
    folds = f_new > f_old
    Tb = seq_lens[rows]

    if bool(folds.any()):
        fs = slot[folds]
        folded = fold_range(cache, fs, f_old[folds], (f_new - f_old)[folds], A)
        key = stream_key(seed, fs, f_new[folds])
        cache[L.CHECKPOINT][fs] = to_fp16(folded, checkpoint_rbits(key, heads, head_offset, P, N))
        # Separate mode's prepare and flush in one (format.md section 4): NVFP4's parity
        # flips, the copy is encoded with the previous fold's amax, the new one stored.
        fmt.refresh(cache, fs, folded, fmt.flip(cache, fs))

    # Base state: every live row's dequantized read copy, standing at f(c') (rows that
    # folded read the copy just re-derived). Replay: committed ring entries f(c') .. c'-1
    # (m of them, m <= Gd - 1), then the new tokens, in a sequence buffer of 16 + T.
    state = fmt.read(cache, slot)
    m = c_new - f_new
    xs = x[rows].float()  # [n, T, H, P]
    # softplus in FP64, rounded once to FP32: torch's FP32 CPU softplus differs in the last
    # bit between its vector body and scalar tail, which would make a token's processed dt
    # depend on where it sits in the batch (and break the bit-exact test (c)).
    dts = F.softplus(dt[rows].double() + dt_bias.double().view(1, 1, -1), beta=1.0, threshold=20.0).float()  # [n, T, H]
    Bs = B[rows].float()  # [n, T, G, N]
    Cs = C[rows].float()
    Dv = D.float().reshape(1, heads, -1)
    zero = torch.zeros((), device=slot.device)
    j = torch.arange(L.RING + T, device=slot.device)
    seq_x, seq_dt, seq_B = (torch.cat([e, e.new_zeros(*e.shape[:2], T, *e.shape[3:])], 2)
                            for e in ring_entries(cache, slot, f_new, m))  # fmt: skip
    tok_ok = torch.arange(T, device=slot.device).view(1, -1) < Tb.view(-1, 1)  # [n, T]
    for t in range(T):
        put = (j.view(1, -1) == (m + t).view(-1, 1)) & tok_ok[:, t : t + 1]  # [n, E]: token t's entry
        seq_x = torch.where(put[:, None, :, None], xs[:, t, :, None, :], seq_x)
        seq_dt = torch.where(put[:, None, :], dts[:, t, :, None], seq_dt)
        seq_B = torch.where(put[:, None, :, None], Bs[:, t, :, None, :], seq_B)
    ys = torch.zeros(slot.shape[0], T, heads, P, device=slot.device)
    for t in range(T):
        last = m + t
        decay, w = replay_weights(seq_dt, A, last)
        Ct = Cs[:, t]  # [n, G, N]
        y = decay.unsqueeze(-1) * torch.einsum("nhpk,nhk->nhp", state, expand_groups(Ct, heads))
        # Token t reads sequence entries 0..last only, selected with where: the call's later
        # tokens may be rejected drafts holding anything (NaN), and 0 * NaN is NaN.
        keep = j.view(1, 1, -1) <= last.view(-1, 1, 1)  # [n, 1, E]
        bc = torch.einsum("ngjk,ngk->ngj", torch.where(keep[..., None], seq_B, zero), Ct)
        y = y + torch.einsum("nhj,nhjp->nhp", w * expand_groups(bc, heads), torch.where(keep[..., None], seq_x, zero))
        y = y + Dv * xs[:, t]
        ys[:, t] = torch.where(tok_ok[:, t, None, None], y, zero)
    out[rows] = ys.to(out.dtype)

    # Append tokens 0..T_b-1 at ring entries (c' + i) mod 16.
    for t in range(T):
        sel = tok_ok[:, t]
        s, e = slot[sel], (c_new[sel] + t) % L.RING
        for i, v in ((L.X_RING, x[rows][sel, t]), (L.DT_RING, dts[sel, t]), (L.B_RING, B[rows][sel, t])):
            cache[i][s, :, e] = v.to(cache[i].dtype)
    cache[L.POSITIONS][slot] = torch.stack((c_new, Tb), dim=-1).to(torch.int32)
    return out


def pending_materialize(cache: Sequence[torch.Tensor], slots: torch.Tensor, A: torch.Tensor, *, max_seqlen: int) -> torch.Tensor:
    """FP32 state [n, H, P, N] of `slots` after their committed tokens: the FP16
    checkpoint (at f(c)) advanced through ring entries f(c) .. c-1; pending drafts are not
    included. Padding rows read as zero states. Reads only. (`reference.materialize`
    without `grid` assumes separate mode's grid and must not be used on a pending cache.)"""
    _check_max_seqlen(max_seqlen)
    _check_pending_positions(cache[L.POSITIONS])
    return materialize(cache, slots, A, grid(max_seqlen))
