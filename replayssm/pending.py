"""Pure-PyTorch reference of pending mode (speculative decoding, issue 30; dense layout).

A pending cache has positions [S, 2] = (c, q): c tokens committed since init, q tokens
appended by the last call and not yet accepted or rejected. Token index i (counted from
init) lives at ring entry i mod 16. The FP16 checkpoint stands at token index

    f(c) = Gd * (c div Gd),   Gd = grid(max_seqlen) = 17 - max_seqlen,

so where it stands follows from (c, max_seqlen) alone. docs/format.md, "Pending mode",
proves that no ring entry is overwritten while it is live: a call's fold reads entries
f(c) .. f(c')-1 before any of its writes, and its replay and writes lie in a window of 16
token indices from f(c').

One call, per live row (slot in 1..S-1), in order:

1. commit a = clamp(num_accepted_tokens[b], 0, q) (a = q when None); c' = c + a;
2. fold when f(c') > f(c): the committed entries f(c) .. f(c')-1 are folded into the
   checkpoint in FP32 (a commit crosses at most one grid point); the FP16 checkpoint
   is written with stochastic rounding, stream tag stream_key(seed, slot, f(c')) (f(c') >= 1
   and strictly increasing over a slot's lifetime, so it never equals init's tag
   INIT_POSITION = 2**32 - 1 before 2**32 - 1 tokens), and the read copy is re-derived
   from the unrounded FP32 state (NVFP4: parity flip and delayed amax exactly as separate
   mode's flush, format.md section 4);
3. outputs: token t's output is the Mamba-2 output after the committed stream and tokens
   0..t. The base state is the dequantized read copy standing at f(c') for every row (for
   rows that fold, the copy step 2 just re-derived: one kind of row for the kernels); the
   committed ring entries f(c') .. c'-1, then tokens 0..t, are replayed exactly in FP32;
4. append: token i goes to ring entry (c' + i) mod 16; positions become (c', T_b).

Rows with T_b = 0 still commit (and may fold). Padding rows (slot <= 0 or >= S) output
zeros and change nothing. Output entries t >= T_b of a live row are zeros.

Inputs (already normalized, as `reference.py` takes them): x [b, T, H, P] (or
[b, T, H*P]) bf16, dt [b, T, H] (raw), A [H], B, C [b, T, G, N] bf16, D [H] or [H, P],
dt_bias [H], slots [b], out [b, T, H, P], T == max_seqlen; seq_lens int [b] gives T_b
(None: every row has T tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import layout as L
from .quant.minifloat import to_fp16
from .quant.rng import checkpoint_rbits, stream_key
from .formats import Format
from .reference import expand_groups, valid_rows

MAX_SEQLEN = 8
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def grid(max_seqlen: int) -> int:
    """The fold grid Gd = 17 - max_seqlen (16 for max_seqlen 1, 9 for 8)."""
    return L.RING + 1 - max_seqlen


def checkpoint_index(c: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """f(c): the token index the checkpoint stands at after c committed tokens."""
    g = grid(max_seqlen)
    return (c // g) * g


def _check_int_vector(name: str, t, batch: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor [{batch}]; got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype; got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape [{batch}]; got {list(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


def _validate(cache, x, dt, A, B, C, D, dt_bias, slots, out, fmt, max_seqlen, num_accepted_tokens, seq_lens):
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 1 <= max_seqlen <= MAX_SEQLEN:
        raise ValueError(f"max_seqlen must be an int in 1..{MAX_SEQLEN}; got {max_seqlen!r}")
    want = fmt.cache_len()
    if len(cache) != want:
        raise ValueError(f"cache must hold {want} tensors for state_dtype {fmt.name!r}; got {len(cache)}")
    num_slots, heads, P, N = cache[L.CHECKPOINT].shape
    groups = cache[L.B_RING].shape[1]
    pos = cache[L.POSITIONS]
    if pos.dim() != 2 or pos.shape[1] != 2:
        raise ValueError(f"cache positions must be [slots, 2] (pending mode); got {list(pos.shape)}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _INT_DTYPES:
        raise ValueError("slots must be a 1-D integer tensor")
    b = slots.shape[0]
    if x.dim() == 3 and x.shape[2] == heads * P:
        x = x.reshape(x.shape[0], x.shape[1], heads, P)
    if tuple(x.shape) != (b, max_seqlen, heads, P):
        raise ValueError(f"x must be [{b}, {max_seqlen}, {heads}, {P}] (T == max_seqlen); got {list(x.shape)}")
    if tuple(dt.shape) != (b, max_seqlen, heads):
        raise ValueError(f"dt must be [{b}, {max_seqlen}, {heads}]; got {list(dt.shape)}")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (b, max_seqlen, groups, N):
            raise ValueError(f"{name} must be [{b}, {max_seqlen}, {groups}, {N}]; got {list(t.shape)}")
    if tuple(A.shape) != (heads,):
        raise ValueError(f"A must be [{heads}]; got {list(A.shape)}")
    if tuple(dt_bias.shape) != (heads,):
        raise ValueError(f"dt_bias must be [{heads}]; got {list(dt_bias.shape)}")
    if tuple(D.shape) not in ((heads,), (heads, P)):
        raise ValueError(f"D must be [{heads}] or [{heads}, {P}]; got {list(D.shape)}")
    if tuple(out.shape) != (b, max_seqlen, heads, P):
        raise ValueError(f"out must be [{b}, {max_seqlen}, {heads}, {P}]; got {list(out.shape)}")
    dev = slots.device
    if num_accepted_tokens is not None:
        num_accepted_tokens = _check_int_vector("num_accepted_tokens", num_accepted_tokens, b, dev)
    if seq_lens is None:
        seq_lens = torch.full((b,), max_seqlen, dtype=torch.int64, device=dev)
    else:
        seq_lens = _check_int_vector("seq_lens", seq_lens, b, dev)
        if bool(((seq_lens < 0) | (seq_lens > max_seqlen)).any()):
            raise ValueError(f"seq_lens must lie in 0..max_seqlen={max_seqlen}; got {seq_lens.tolist()}")
    slot = slots.to(torch.int64)
    valid = valid_rows(slot, num_slots)
    q = pos[slot[valid]][:, 1].to(torch.int64)
    if bool((q > max_seqlen).any()):
        raise ValueError(
            f"max_seqlen={max_seqlen} is smaller than a slot's pending count {int(q.max())}: "
            "a cache's slots are decoded with one max_seqlen between inits"
        )
    return x, num_accepted_tokens, seq_lens


def _ring_entries(cache, slot, start, count):
    """Ring entries of token indices start .. start+count-1 (count <= 16) in logical order,
    FP32: x [n, H, 16, P], dt [n, H, 16], B [n, G, 16, N]; slots past `count` are zero
    (selected with where, never multiplied: dead entries may hold NaN)."""
    j = torch.arange(L.RING, device=slot.device)
    idx = (start.view(-1, 1) + j.view(1, -1)) % L.RING  # [n, 16]
    live = j.view(1, -1) < count.view(-1, 1)
    n = slot.shape[0]
    xr = cache[L.X_RING][slot].float()  # [n, H, 16, P]
    dr = cache[L.DT_RING][slot].float()  # [n, H, 16]
    br = cache[L.B_RING][slot].float()  # [n, G, 16, N]
    heads, groups = xr.shape[1], br.shape[1]
    xr = xr.gather(2, idx.view(n, 1, L.RING, 1).expand(n, heads, L.RING, xr.shape[3]))
    dr = dr.gather(2, idx.view(n, 1, L.RING).expand(n, heads, L.RING))
    br = br.gather(2, idx.view(n, 1, L.RING, 1).expand(n, groups, L.RING, br.shape[3]))
    zero = torch.zeros((), device=slot.device)
    xr = torch.where(live[:, None, :, None], xr, zero)
    dr = torch.where(live[:, None, :], dr, zero)
    br = torch.where(live[:, None, :, None], br, zero)
    return xr, dr, br


def _weights(dt_e: torch.Tensor, A: torch.Tensor, last: torch.Tensor):
    """pre_j = dt_0 + .. + dt_j; (exp(A pre_last) [n, H], w_j = dt_j exp(A (pre_last - pre_j))
    [n, H, E], zero for j > last). last = -1 gives decay 1 and no terms."""
    pre = torch.cumsum(dt_e, dim=-1)
    lastc = last.clamp_min(0)
    pre_k = pre.gather(-1, lastc.view(-1, 1, 1).expand(-1, pre.shape[1], 1))
    pre_k = torch.where(last.view(-1, 1, 1) >= 0, pre_k, torch.zeros((), device=pre.device))
    a = A.view(1, -1, 1)
    w = dt_e * torch.exp(a * (pre_k - pre))
    j = torch.arange(dt_e.shape[-1], device=dt_e.device)
    w = torch.where(j.view(1, 1, -1) <= last.view(-1, 1, 1), w, torch.zeros((), device=w.device))
    return torch.exp(a * pre_k).squeeze(-1), w


def fold_range(cache, slot, start, count, A) -> torch.Tensor:
    """FP32 state after folding the ring entries of token indices start .. start+count-1
    into the FP16 checkpoint: exp(A pre_last) S_ckpt + sum_j w_j x_j (x) B_j."""
    heads = cache[L.CHECKPOINT].shape[1]
    x_e, dt_e, B_e = _ring_entries(cache, slot, start, count)
    decay, w = _weights(dt_e, A, count - 1)
    s0 = cache[L.CHECKPOINT][slot].float()
    upd = torch.einsum("nhj,nhjp,nhjk->nhpk", w, x_e, expand_groups(B_e, heads))
    return decay[:, :, None, None] * s0 + upd


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, total: int, max_seqlen: int) -> torch.Tensor:
    """Validate `cu_seqlens` (int32 [batch + 1], 0 first, non-decreasing, `total` last,
    no row longer than `max_seqlen`; reads it on the host) and return the row lengths T_b
    (int64 [batch], on its device). ValueError / TypeError naming it otherwise."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 tensor [{batch + 1}]; got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or tuple(cu_seqlens.shape) != (batch + 1,):
        raise ValueError(
            f"cu_seqlens must be int32 [{batch + 1}] (batch + 1); got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    host = cu.tolist()
    if host[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {host}")
    if any(b < a for a, b in zip(host, host[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {host}")
    if host[-1] != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens {total} (x.shape[0]); got {host}")
    longest = max((b - a for a, b in zip(host, host[1:])), default=0)
    if longest > max_seqlen:
        raise ValueError(f"every row of cu_seqlens must hold at most max_seqlen={max_seqlen} tokens; got {host}")
    return lens


def varlen_to_dense(cu_seqlens: torch.Tensor, max_seqlen: int, *tensors: torch.Tensor):
    """Gather varlen tensors [total, ...] (row b's tokens cu_seqlens[b] .. cu_seqlens[b+1]-1)
    into dense [batch, max_seqlen, ...], zeros past each row's length. Returns (lens int64
    [batch], ok bool [batch, max_seqlen] (token t of row b exists), dense tensors)."""
    total = tensors[0].shape[0]
    batch = cu_seqlens.shape[0] - 1
    lens = check_cu_seqlens(cu_seqlens, batch, total, max_seqlen)
    dev = cu_seqlens.device
    t = torch.arange(max_seqlen, device=dev)
    ok = t.view(1, -1) < lens.view(-1, 1)  # [b, T]
    idx = (cu_seqlens[:-1].to(torch.int64).view(-1, 1) + t.view(1, -1)).clamp(0, max(total - 1, 0))
    dense = []
    for v in tensors:
        shape = (batch, max_seqlen, *v.shape[1:])
        if total == 0:
            dense.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
            continue
        g = v[idx.reshape(-1)].reshape(shape)
        keep = ok.view(batch, max_seqlen, *([1] * (v.dim() - 1)))
        dense.append(torch.where(keep, g, torch.zeros((), dtype=v.dtype, device=v.device)))
    return lens, ok, dense


def pending_decode(
    cache: Sequence[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    *,
    fmt: Format,
    seed: int,
    max_seqlen: int,
    num_accepted_tokens: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    head_offset: int = 0,
) -> torch.Tensor:
    """One pending-mode call (module docstring); returns `out` [b, T, H, P].

    Varlen layout with `cu_seqlens` (int32 [b + 1], see `check_cu_seqlens`): x [total, H,
    P] (or [total, H*P]), dt [total, H], B, C [total, G, N], out [total, H, P]; the
    tokens are gathered into the dense layout (zeros past each row's length) and run
    through the dense path, so a varlen call equals the dense call on the same tokens bit
    for bit. Device-agnostic: runs wherever the cache lives (CPU or CUDA); it reads a few
    values on the host (a sync on CUDA), so it is not CUDA-graph capturable."""
    if cu_seqlens is not None:
        if seq_lens is not None:
            raise ValueError("pass seq_lens (dense layout) or cu_seqlens (varlen layout), not both")
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 1 <= max_seqlen <= MAX_SEQLEN:
            raise ValueError(f"max_seqlen must be an int in 1..{MAX_SEQLEN}; got {max_seqlen!r}")
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
    x, num_accepted_tokens, seq_lens = _validate(
        cache, x, dt, A, B, C, D, dt_bias, slots, out, fmt, max_seqlen, num_accepted_tokens, seq_lens
    )
    num_slots, heads, P, N = cache[L.CHECKPOINT].shape
    groups = cache[L.B_RING].shape[1]
    T = max_seqlen
    A = A.float()
    slot_all = slots.to(torch.int64)
    valid = valid_rows(slot_all, num_slots)
    out.zero_()
    if not bool(valid.any()):
        return out
    rows = valid.nonzero().squeeze(-1)
    slot = slot_all[rows]
    n = slot.shape[0]
    pos = cache[L.POSITIONS][slot].to(torch.int64)
    c, q = pos[:, 0], pos[:, 1]
    if num_accepted_tokens is None:
        a = q
    else:
        a = torch.minimum(num_accepted_tokens[rows].clamp_min(0), q)
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
    # (m of them, m <= Gd - 1), then the new tokens.
    base = f_new
    state = fmt.read(cache, slot)
    m = c_new - base
    x_e, dt_e, B_e = _ring_entries(cache, slot, base, m)
    xs = x[rows].float()  # [n, T, H, P]
    # softplus in FP64, rounded once to FP32: torch's FP32 CPU softplus differs in the last
    # bit between its vector body and scalar tail, which would make a token's processed dt
    # depend on where it sits in the batch (and break the bit-exact test (c)).
    dts = F.softplus(dt[rows].double() + dt_bias.double().view(1, 1, -1), beta=1.0, threshold=20.0).float()  # [n, T, H]
    Bs = B[rows].float()  # [n, T, G, N]
    Cs = C[rows].float()
    Dv = D.float().reshape(1, heads, -1)
    zero = torch.zeros((), device=slot.device)
    E = L.RING + T  # the sequence buffer: m committed entries then the new tokens
    j = torch.arange(E, device=slot.device)
    seq_x = torch.zeros(n, heads, E, P, device=slot.device)
    seq_dt = torch.zeros(n, heads, E, device=slot.device)
    seq_B = torch.zeros(n, groups, E, N, device=slot.device)
    seq_x[:, :, : L.RING] = x_e
    seq_dt[:, :, : L.RING] = dt_e
    seq_B[:, :, : L.RING] = B_e
    tok_ok = torch.arange(T, device=slot.device).view(1, -1) < Tb.view(-1, 1)  # [n, T]
    for t in range(T):
        at = m + t  # [n]: sequence slot of token t
        put = (j.view(1, -1) == at.view(-1, 1)) & tok_ok[:, t : t + 1]  # [n, E]
        seq_x = torch.where(put[:, None, :, None], xs[:, t, :, None, :], seq_x)
        seq_dt = torch.where(put[:, None, :], dts[:, t, :, None], seq_dt)
        seq_B = torch.where(put[:, None, :, None], Bs[:, t, :, None, :], seq_B)
    ys = torch.zeros(n, T, heads, P, device=slot.device)
    for t in range(T):
        last = m + t
        decay, w = _weights(seq_dt, A, last)
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
        if not bool(sel.any()):
            continue
        s = slot[sel]
        e = (c_new[sel] + t) % L.RING
        cache[L.X_RING][s, :, e] = x[rows][sel, t].to(cache[L.X_RING].dtype)
        cache[L.DT_RING][s, :, e] = dts[sel, t]
        cache[L.B_RING][s, :, e] = B[rows][sel, t].to(cache[L.B_RING].dtype)
    cache[L.POSITIONS][slot] = torch.stack((c_new, Tb), dim=-1).to(torch.int32)
    return out


def pending_materialize(cache: Sequence[torch.Tensor], slots: torch.Tensor, A: torch.Tensor, *, max_seqlen: int) -> torch.Tensor:
    """FP32 state [n, H, P, N] of `slots` after their committed tokens: the FP16
    checkpoint (at f(c)) advanced through ring entries f(c) .. c-1; pending drafts are not
    included. Padding rows read as zero states. Reads only. (`reference.materialize`
    assumes separate mode's grid and must not be used on a pending cache.)"""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 1 <= max_seqlen <= MAX_SEQLEN:
        raise ValueError(f"max_seqlen must be an int in 1..{MAX_SEQLEN}; got {max_seqlen!r}")
    pos = cache[L.POSITIONS]
    if pos.dim() != 2 or pos.shape[1] != 2:
        raise ValueError(f"cache positions must be [slots, 2] (pending mode); got {list(pos.shape)}")
    num_slots, heads, P, N = cache[L.CHECKPOINT].shape
    slot = slots.reshape(-1).to(torch.int64)
    valid = valid_rows(slot, num_slots)
    states = torch.zeros(slot.shape[0], heads, P, N, device=slot.device)
    live = slot[valid]
    c = pos[live][:, 0].to(torch.int64)
    f = checkpoint_index(c, max_seqlen)
    states[valid] = fold_range(cache, live, f, c - f, A.float())
    return states
