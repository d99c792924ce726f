"""Pending mode (speculative decoding, issue 30): the reference in replayssm/pending.py.

(a) an FP64 simulation of the fold grid with NaN in every rejected draft's ring entry;
(b) the reference against the exact FP64 recurrence of the accepted stream;
(c) accepting every token against a one-token-per-call run of the same reference;
(d) invalid inputs."""

from __future__ import annotations

import random

import pytest
import torch

from replayssm import layout as L, reference as ref
from replayssm.layout import allocate_cache
from replayssm.pending import checkpoint_index, grid, pending_decode, pending_materialize
from replayssm.synthetic import ExactRecurrence, Token, layer_params, prefill_states, sqnr_db
from replayssm.formats import FORMATS, FP8

from . import tolerances as tol

HEADS, GROUPS = 8, 1
CALLS, LIVE = 240, [1, 2, 3, 4, 5, 6, 7, 8]


# -- (a) the grid rule in FP64, scalar per head ------------------------------------------


@pytest.mark.parametrize("max_seqlen", range(1, 9))
def test_grid_rule_never_overwrites_a_live_entry(max_seqlen):
    """A scalar FP64 recurrence per row with a 16-entry ring, the checkpoint at f(c), NaN
    written into every rejected draft's entry, each call's fold before its writes: the live
    entries between calls fit the ring, the fold's reads lie in one window of 16 from f(c),
    the replay and the writes in one window of 16 from f(c'), no live entry is overwritten,
    and the outputs match the sequential recurrence exactly up to FP64 rounding."""
    rng = random.Random(max_seqlen)
    g = grid(max_seqlen)
    a_decay = 0.9
    for _ in range(4):  # rows
        ckpt, ckpt_at = 0.0, 0  # checkpoint value and the token index it stands at
        ring = [float("nan")] * L.RING
        ring_tok = [None] * L.RING  # which token index each entry holds
        c, q = 0, 0
        exact = 0.0  # sequential state after the committed stream
        drafts: list[float] = []
        for _ in range(400):
            acc = rng.randint(0, q)
            for v in drafts[:acc]:
                exact = a_decay * exact + v
            for i in range(acc, q):  # rejected: the entry holds garbage from now on
                ring[(c + i) % L.RING] = float("nan")
            c_new = c + acc
            f_new = int(checkpoint_index(torch.tensor(c_new), max_seqlen))
            assert f_new == g * (c_new // g) and f_new >= ckpt_at
            assert c + q - ckpt_at <= L.RING, "live entries fit the ring"
            reads = list(range(ckpt_at, c_new))
            T = rng.randint(0, max_seqlen)
            assert c_new + T - f_new <= L.RING, "replay and writes in one window from f(c')"
            for i in reads:  # every committed entry since the checkpoint is intact
                assert ring_tok[i % L.RING] == i and ring[i % L.RING] == ring[i % L.RING]
            while ckpt_at < f_new:  # fold
                ckpt = a_decay * ckpt + ring[ckpt_at % L.RING]
                ckpt_at += 1
            state = ckpt
            for i in range(ckpt_at, c_new):
                state = a_decay * state + ring[i % L.RING]
            assert state == pytest.approx(exact, rel=1e-12, abs=1e-12)
            drafts = [rng.gauss(0, 1) for _ in range(T)]
            for i, v in enumerate(drafts):
                e = (c_new + i) % L.RING
                assert ring_tok[e] is None or ring_tok[e] < ckpt_at or ring_tok[e] >= c_new, "live entry overwritten"
                ring[e], ring_tok[e] = v, c_new + i
            c, q = c_new, T


# -- helpers for the tensor tests --------------------------------------------------------


def _make(fmt, num_slots, live, seed=0, prompt=32):
    gen = torch.Generator().manual_seed(seed)
    params = layer_params(HEADS, generator=gen)
    cache = allocate_cache(num_slots, HEADS, GROUPS, fmt, pending=True)
    states = prefill_states(params, len(live), GROUPS, prompt, generator=gen)
    ref.initialize(cache, states, torch.tensor(live), fmt=FORMATS[fmt], seed=seed)
    return gen, params, cache, states


def _tokens(gen, b, T):
    x = torch.randn(b, T, HEADS, L.HEAD_DIM, generator=gen).to(torch.bfloat16)
    dt = (0.5 * torch.randn(b, T, HEADS, generator=gen)).to(torch.bfloat16).float()
    B = torch.randn(b, T, GROUPS, L.STATE_DIM, generator=gen).to(torch.bfloat16)
    C = torch.randn(b, T, GROUPS, L.STATE_DIM, generator=gen).to(torch.bfloat16)
    return x, dt, B, C


def _call(cache, params, fmt, slots, toks, M, seq_lens, acc, seed=0):
    x, dt, B, C = toks
    out = torch.full((len(slots), M, HEADS, L.HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    return pending_decode(
        cache, x, dt, params.A, B, C, params.D, params.dt_bias, torch.tensor(slots), out,
        fmt=FORMATS[fmt], seed=seed, max_seqlen=M,
        num_accepted_tokens=None if acc is None else torch.tensor(acc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


def _poison_rejected(cache, slot, c_new, q_old, acc):
    for i in range(acc, q_old):
        e = (c_new - acc + i) % L.RING
        cache[L.X_RING][slot, :, e] = float("nan")
        cache[L.DT_RING][slot, :, e] = float("nan")
        cache[L.B_RING][slot, :, e] = float("nan")


# -- (b) against the exact recurrence ----------------------------------------------------


@pytest.mark.parametrize(
    "fmt,M", [("fp8", 2), ("fp8", 5), ("fp8", 8), ("nvfp4", 3), ("nvfp4", 8)], ids=lambda v: str(v)
)
def test_reference_matches_exact_accepted_stream(fmt, M):
    calls, live = CALLS, LIVE
    gen, params, cache, states = _make(fmt, len(live) + 3, live, seed=M)
    rng = random.Random(100 + M)
    exact = {s: ExactRecurrence(params, states[i : i + 1]) for i, s in enumerate(live)}
    pending = {s: [] for s in live}  # the previous call's tokens of each slot
    # rows desynchronized: each live slot is skipped on some calls; padding rows mixed in
    outs, refs, per_call = [], [], []
    for call in range(calls):
        batch = [s for s in live if rng.random() < 0.8] + [0, -1, len(live) + 3]
        rng.shuffle(batch)
        b = len(batch)
        toks = _tokens(gen, b, M)
        seq_lens, acc = [], []
        for s in batch:
            T = rng.randint(0, M) if s in live else M
            seq_lens.append(T)
            if s in live:
                q = len(pending[s])
                a = sum(1 for _ in iter(lambda: rng.random() < 0.7, False)) if q else 0
                a = min(a, q) if rng.random() < 0.9 else rng.choice([-3, q + 2])
                acc.append(a)
                a_eff = max(0, min(a, q))
                c_new = int(cache[L.POSITIONS][s, 0]) + a_eff
                _poison_rejected(cache, s, c_new, q, a_eff)
                for tok in pending[s][:a_eff]:
                    exact[s].step(tok)
            else:
                acc.append(1)
        out = _call(cache, params, fmt, batch, toks, M, seq_lens, acc)
        x, dt, B, C = toks
        o_call, r_call = [], []
        for r, s in enumerate(batch):
            if s not in live:
                assert torch.equal(out[r], torch.zeros_like(out[r]))
                continue
            st = ExactRecurrence(params, exact[s].S)
            pending[s] = []
            for t in range(seq_lens[r]):
                tok = Token(x[r : r + 1, t], dt[r : r + 1, t], B[r : r + 1, t], C[r : r + 1, t])
                pending[s].append(tok)
                o_call.append(out[r, t].double())
                r_call.append(st.step(tok)[0])
            assert torch.equal(out[r, seq_lens[r] :], torch.zeros_like(out[r, seq_lens[r] :]))
            assert int(cache[L.POSITIONS][s, 1]) == seq_lens[r]
        if o_call:
            per_call.append((torch.stack(r_call), torch.stack(o_call)))
            outs += o_call
            refs += r_call
    assert not torch.isnan(torch.stack(outs)).any()
    total = sqnr_db(torch.stack(refs), torch.stack(outs))
    assert total >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], total
    k = len(per_call) // 4
    first = sqnr_db(torch.cat([p[0] for p in per_call[:k]]), torch.cat([p[1] for p in per_call[:k]]))
    last = sqnr_db(torch.cat([p[0] for p in per_call[-k:]]), torch.cat([p[1] for p in per_call[-k:]]))
    assert last >= first - tol.DRIFT_DB, (first, last)
    # padding slots 0 untouched
    assert int(cache[L.POSITIONS][0].abs().sum()) == 0
    # the materialized state is the exact state after the committed stream (drafts excluded)
    mat = pending_materialize(cache, torch.tensor(live + [0]), params.A, max_seqlen=M)
    for i, s in enumerate(live):
        assert sqnr_db(exact[s].S[0], mat[i]) >= tol.STATE_SQNR_FLOOR_DB
    assert torch.equal(mat[-1], torch.zeros_like(mat[-1]))


# -- (c) accept everything == one token per call -----------------------------------------


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("M", [2, 5, 8])
def test_accepting_every_token_matches_one_token_per_call(fmt, M):
    """With every draft accepted, T tokens per call leave the checkpoint, read copy, meta,
    parity and rings bit for bit as one token per call (same max_seqlen), compared at equal
    committed counts: a commit of a <= M tokens crosses at most one grid point (Gd = 17 - M
    >= M), so both runs fold at the same grid points with the same stream tags."""
    live = [1, 2]
    _, params, multi, _ = _make(fmt, 4, live, seed=7)
    _, _, single, _ = _make(fmt, 4, live, seed=7)
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(M)
    g = grid(M)
    assert g >= M
    committed = 0
    chunks = []
    for _ in range(30):
        T = rng.randint(1, M)
        chunks.append((T, _tokens(gen, len(live), M)))
    idx = [L.CHECKPOINT, L.READ_COPY, L.SCALES, L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS]
    if fmt == "nvfp4":
        idx += [L.META, L.PARITY]

    def view(t):
        return t.view(torch.uint8) if t.dtype.itemsize == 1 else t

    for T, toks in chunks:
        # multi: one call with T tokens (accepting the previous call's all), then an accept
        _call(multi, params, fmt, live, toks, M, [T, T], None)
        _call(multi, params, fmt, live, _tokens(gen, 2, M), M, [0, 0], None)
        for t in range(T):
            one = tuple(v[:, t : t + 1].expand(-1, M, *v.shape[2:]).contiguous() for v in toks)
            _call(single, params, fmt, live, one, M, [1, 1], None)
        _call(single, params, fmt, live, _tokens(gen, 2, M), M, [0, 0], None)
        committed += T
        assert multi[L.POSITIONS][live, 0].tolist() == [committed] * 2
        for i in idx:
            assert torch.equal(view(multi[i]), view(single[i])), (i, committed)
    assert committed > 2 * g  # the runs folded at least twice


# -- (d) validation ------------------------------------------------------------------------


def test_invalid_inputs_raise():
    _, params, cache, _ = _make("fp8", 4, [1, 2], seed=1)
    gen = torch.Generator().manual_seed(0)
    M = 3
    x, dt, B, C = _tokens(gen, 2, M)
    out = torch.zeros(2, M, HEADS, L.HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.tensor([1, 2])
    p = params

    def call(**kw):
        args = dict(x=x, dt=dt, B=B, C=C, out=out, slots=slots)
        opts = dict(fmt=FP8, seed=0, max_seqlen=M)
        for k in list(kw):
            (args if k in args else opts)[k] = kw[k]
        pending_decode(cache, args["x"], args["dt"], p.A, args["B"], args["C"], p.D, p.dt_bias, args["slots"], args["out"], **opts)

    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="max_seqlen"):
            call(max_seqlen=bad)
    with pytest.raises(ValueError, match="x must"):
        call(x=x[:, :2])
    with pytest.raises(ValueError, match="dt must"):
        call(dt=dt[:, :, :2])
    with pytest.raises(ValueError, match="C must"):
        call(C=C[:1])
    with pytest.raises(ValueError, match="out must"):
        call(out=out[:, :2])
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        call(num_accepted_tokens=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        call(num_accepted_tokens=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        call(num_accepted_tokens=[1, 1])
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=torch.tensor([4, 1]))
    sep = allocate_cache(4, HEADS, GROUPS, "fp8")
    with pytest.raises(ValueError, match="positions"):
        pending_decode(sep, x, dt, p.A, B, C, p.D, p.dt_bias, slots, out, fmt=FP8, seed=0, max_seqlen=M)
    call()  # valid: q = 3 pending now
    with pytest.raises(ValueError, match="max_seqlen"):
        call(max_seqlen=2, x=x[:, :2], dt=dt[:, :2], B=B[:, :2], C=C[:, :2], out=out[:, :2])
