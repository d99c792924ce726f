"""Pending mode (speculative decoding) through the public API: `ReplaySSMCache(spec_tokens=k)`
(`decode` with `num_accepted_tokens` / `cu_seqlens`, `accept`, `materialize`), the functional
`selective_state_update_replayssm` on a cache with positions [S, 2], slot hand-off, and the
custom ops under torch.compile.

Values are checked against the exact FP64 recurrence of the accepted stream
(`replayssm.synthetic`) or against the reference `replayssm.pending` bit for bit."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from replayssm import (
    ReplaySSMCache,
    allocate_cache,
    initialize_replayssm_state,
    layout as L,
    materialize_replayssm_state,
    selective_state_update_replayssm,
    snapshot_replayssm_slots,
)
from replayssm.pending import checkpoint_index, grid, pending_decode, pending_materialize
from replayssm.synthetic import ExactRecurrence, Token, layer_params, prefill_states, sqnr_db
from replayssm.formats import FP8, format_of

from . import tolerances as tol
from .helpers import assert_cache_equal, same_bits, snapshot

HEADS, GROUPS, P, N = 8, 1, L.HEAD_DIM, L.STATE_DIM
NAN = float("nan")


def _tokens(gen: torch.Generator, n: int):
    """n tokens: x [n, H, 64] bf16, dt [n, H] f32 (bf16 values), B, C [n, G, 128] bf16."""
    x = torch.randn(n, HEADS, P, generator=gen).to(torch.bfloat16)
    dt = (0.5 * torch.randn(n, HEADS, generator=gen)).to(torch.bfloat16).float()
    B = torch.randn(n, GROUPS, N, generator=gen).to(torch.bfloat16)
    C = torch.randn(n, GROUPS, N, generator=gen).to(torch.bfloat16)
    return x, dt, B, C


def _cache(fmt, spec_tokens, num_slots=6, seed=3, live=3, prompt=16, data_seed=0):
    """A pending cache with `live` prefilled slots; returns (cache, slots, params, states, gen)."""
    gen = torch.Generator().manual_seed(data_seed)
    p = layer_params(HEADS, generator=gen)
    cache = ReplaySSMCache(num_slots, HEADS, GROUPS, fmt, "cpu", seed=seed, spec_tokens=spec_tokens, backend="reference")
    slots = cache.allocate(live)
    states = prefill_states(p, live, GROUPS, prompt, generator=gen)
    cache.prefill_init(states, slots)
    return cache, slots, p, states, gen


# -- a long run against the exact recurrence ---------------------------------------------


@dataclass
class Request:
    exact: ExactRecurrence  # the state after the committed tokens, FP64
    committed: int = 0  # c: tokens committed since the slot's init
    pending: list = field(default_factory=list)  # the last call's tokens (Token), awaiting a verdict
    verdict: int = 0  # how many of `pending` will be accepted (decided when they were drafted)


def _passed(rng: random.Random, r: Request, max_seqlen: int) -> int:
    """The num_accepted_tokens value an engine passes for `r`: its verdict, sometimes out of
    range where that clamps to the same value."""
    q, a = len(r.pending), r.verdict
    if q == 0:
        return rng.randint(-2, max_seqlen + 2)
    if a == q and rng.random() < 0.2:
        return q + rng.randint(1, 3)
    if a == 0 and rng.random() < 0.2:
        return -rng.randint(1, 3)
    return a


def _commit(r: Request) -> None:
    for tok in r.pending[: r.verdict]:
        r.exact.step(tok)
    r.committed += r.verdict
    r.pending, r.verdict = [], 0


@pytest.mark.parametrize(
    "fmt,spec_tokens", [pytest.param("fp8", 3, id="fp8-M4"), pytest.param("nvfp4", 2, id="nvfp4-M3")]
)
def test_long_run_matches_exact_accepted_stream(fmt, spec_tokens):
    """600 calls: random T_b per row (varlen; every fifth call or so dense, T_b = max_seqlen),
    random verdicts (each draft accepted with probability 0.7; sometimes out of range, which
    clamps), some delivered by `accept`, rows skipping calls (desynchronized), requests
    finishing and their slots reused by new ones, padding rows, and NaN in every input of
    every token that will be rejected. Each accepted token's output is checked against the
    exact FP64 recurrence of the accepted stream: SQNR floors of separate mode over every
    window of 100 calls, no drift from the first quarter to the last, no NaN; padding rows
    output zeros; positions are (committed, T_b); the materialized states at the end are
    the exact committed states."""
    M = spec_tokens + 1
    S, CALLS, WINDOW = 6, 600, 100
    rng = random.Random(1000 + M)
    gen = torch.Generator().manual_seed(M)
    p = layer_params(HEADS, generator=gen)
    cache = ReplaySSMCache(S, HEADS, GROUPS, fmt, "cpu", seed=9, max_batch=8, spec_tokens=spec_tokens, backend="reference")
    reqs: dict[int, Request] = {}
    starts = 0

    def start(n):
        nonlocal starts
        slots = cache.allocate(n).tolist()
        states = prefill_states(p, n, GROUPS, 16, generator=gen)
        cache.prefill_init(states, slots)
        for i, s in enumerate(slots):
            reqs[s] = Request(ExactRecurrence(p, states[i : i + 1]))
        starts += n

    start(3)
    per_call, folds_seen, accepts = [], 0, 0
    for call in range(CALLS):
        if reqs and rng.random() < 0.04:  # a request finishes; its slot is cleared and reused later
            s = rng.choice(sorted(reqs))
            cache.release([s])
            assert cache.positions[s].tolist() == [0, 0]
            del reqs[s]
        if len(reqs) < 3 and rng.random() < 0.5:
            start(1)
        if rng.random() < 0.15:  # verdicts learned after the step: accept() with no new tokens
            acc = [s for s in sorted(reqs) if rng.random() < 0.5]
            if acc:
                values = [_passed(rng, reqs[s], M) for s in acc]
                before = {s: int(cache.positions[s, 0]) for s in acc}
                cache.accept(torch.tensor(acc), torch.tensor(values, dtype=torch.int32))
                for s in acc:
                    _commit(reqs[s])
                    assert cache.positions[s].tolist() == [reqs[s].committed, 0]
                    folds_seen += reqs[s].committed // grid(M) > before[s] // grid(M)
                accepts += 1
        rows = [s for s in sorted(reqs) if rng.random() < 0.8]  # the others skip this call
        batch = rows + rng.choice([[], [0], [S], [0, -1]]) or [0]
        rng.shuffle(batch)
        dense = rng.random() < 0.2
        lens = [M if dense else rng.randint(0, M) for _ in batch]
        passed, all_accepted = [], True
        for s in batch:
            if s in reqs:
                r = reqs[s]
                all_accepted &= r.verdict == len(r.pending)
                passed.append(_passed(rng, r, M))
                _commit(r)
            else:
                passed.append(rng.randint(-1, M))
        num_acc = None if all_accepted and rng.random() < 0.3 else torch.tensor(passed, dtype=torch.int32)
        xs, dts, Bs, Cs, verdicts = [], [], [], [], []
        for s, n in zip(batch, lens):
            x, dt, B, C = _tokens(gen, n)
            # the verdict on these drafts, decided now: the rejected ones get NaN inputs
            a = 0
            while a < n and rng.random() < (0.9 if a == 0 else 0.7):
                a += 1
            for t_ in (x, dt, B, C):
                t_[a:] = NAN
            verdicts.append(a)
            xs.append(x), dts.append(dt), Bs.append(B), Cs.append(C)
        if dense:
            x, dt, B, C = (torch.stack(v) for v in (xs, dts, Bs, Cs))
            out = cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, torch.tensor(batch, dtype=torch.int64), num_accepted_tokens=num_acc)
        else:
            x, dt, B, C = (torch.cat(v) for v in (xs, dts, Bs, Cs))
            cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
            if call % 2:  # engine shapes: x [total, H*64], dt tied over the head dim
                x = x.reshape(x.shape[0], HEADS * P)
                dt = dt[:, :, None].expand(-1, -1, P)
            out = cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, torch.tensor(batch, dtype=torch.int32), num_accepted_tokens=num_acc, cu_seqlens=cu)
            out = torch.stack([torch.cat([o, o.new_zeros(M - o.shape[0], HEADS, P)]) for o in out.split(lens)])
        refs, outs = [], []
        for r_, (s, n, a) in enumerate(zip(batch, lens, verdicts)):
            if s not in reqs:
                assert torch.equal(out[r_], torch.zeros_like(out[r_])), f"call {call}: padding row {s}"
                continue
            req = reqs[s]
            assert cache.positions[s].tolist() == [req.committed, n], (call, s)
            st = ExactRecurrence(p, req.exact.S)
            for t in range(n):
                tok = Token(xs[r_][t : t + 1], dts[r_][t : t + 1], Bs[r_][t : t + 1], Cs[r_][t : t + 1])
                req.pending.append(tok)
                if t < a:
                    refs.append(st.step(tok)[0])
                    outs.append(out[r_, t].double())
            req.verdict = a
        if refs:
            per_call.append((torch.stack(refs), torch.stack(outs)))
    assert starts >= 10 and accepts >= 40 and folds_seen > 0  # slots were reused, accept() ran and folded
    ref_all = torch.cat([r for r, _ in per_call])
    out_all = torch.cat([o for _, o in per_call])
    assert ref_all.shape[0] >= 2 * CALLS and not torch.isnan(out_all).any()
    floor = tol.OUTPUT_SQNR_FLOOR_DB[fmt]
    windows = [per_call[i : i + WINDOW] for i in range(0, len(per_call), WINDOW)]
    db = [sqnr_db(torch.cat([r for r, _ in w]), torch.cat([o for _, o in w])) for w in windows]
    assert min(db) >= floor, db
    q = len(per_call) // 4
    first = sqnr_db(torch.cat([r for r, _ in per_call[:q]]), torch.cat([o for _, o in per_call[:q]]))
    last = sqnr_db(torch.cat([r for r, _ in per_call[-q:]]), torch.cat([o for _, o in per_call[-q:]]))
    assert last >= first - tol.DRIFT_DB, (first, last)
    live = sorted(reqs)
    mat = cache.materialize(torch.tensor(live + [0]))
    for i, s in enumerate(live):
        assert sqnr_db(reqs[s].exact.S[0], mat[i]) >= tol.STATE_SQNR_FLOOR_DB  # committed tokens only
    assert torch.equal(mat[-1], torch.zeros_like(mat[-1]))


# -- varlen == dense, accept == the verdict in the next decode -----------------------------

FORMATS = ["fp8", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_varlen_equals_dense_bit_for_bit(fmt):
    """Full rows: a varlen call (cu_seqlens = 0, M, 2M, ..) equals the dense call on the same
    tokens, outputs and every cache tensor. Rows of random length (0..M): the varlen call
    equals `pending.pending_decode` in the dense layout with those lengths (garbage past
    each row's length) bit for bit, and dense outputs past a row's length are zeros."""
    M = 3
    twins = [_cache(fmt, M - 1, live=3) for _ in range(2)]
    (cd, slots, p, _, _), (cv, _, _, _, _) = twins
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    live = slots.tolist()
    for step in range(16):
        batch = live + [0, 6]
        rng.shuffle(batch)
        b = len(batch)
        ids = torch.tensor(batch, dtype=torch.int32)
        acc = torch.tensor([rng.randint(0, M) for _ in batch], dtype=torch.int32)
        x, dt, B, C = (v.reshape(b, M, *v.shape[1:]) for v in _tokens(gen, b * M))
        if step % 2 == 0:
            cu = torch.arange(0, b * M + 1, M, dtype=torch.int32)
            od = cd.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, num_accepted_tokens=acc)
            ov = cv.decode(*(v.flatten(0, 1) for v in (x, dt)), p.A, *(v.flatten(0, 1) for v in (B, C)), p.D, p.dt_bias, ids,
                           num_accepted_tokens=acc, cu_seqlens=cu)
            assert same_bits(od.flatten(0, 1), ov), step
        else:
            lens = torch.tensor([rng.randint(0, M) for _ in batch])
            ok = torch.arange(M).view(1, -1) < lens.view(-1, 1)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
            want = snapshot(cd.tensors)
            od = torch.full((b, M, HEADS, P), NAN, dtype=torch.bfloat16)
            pending_decode(want, x, dt, p.A, B, C, p.D, p.dt_bias, ids, od, fmt=format_of(fmt), seed=cd.seed,
                           max_seqlen=M, num_accepted_tokens=acc, seq_lens=lens)
            ov = cv.decode(x[ok], dt[ok], p.A, B[ok], C[ok], p.D, p.dt_bias, ids, num_accepted_tokens=acc, cu_seqlens=cu)
            assert same_bits(od[ok], ov), step
            assert torch.equal(od[~ok], torch.zeros_like(od[~ok]))
            for t_dst, t_src in zip(cd.tensors, want):  # the dense twin follows the reference
                t_dst.copy_(t_src)
        assert_cache_equal(cd.tensors, cv.tensors)
    assert min(cv.positions[live, 0].tolist()) > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_accept_equals_the_verdict_in_the_next_decode(fmt):
    """`accept(slots, v)` then `decode(..)` leaves every cache tensor and every output as
    `decode(.., num_accepted_tokens=v)`, bit for bit, after every step (outputs read the
    read copy at f(c') in both, whether or not the commit folds)."""
    M = 4
    (ca, slots, p, _, _), (cb, _, _, _, _) = (_cache(fmt, M - 1, live=3) for _ in range(2))
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    ids = torch.tensor(slots.tolist() + [0], dtype=torch.int32)
    folded = kept = 0
    for step in range(20):
        v = torch.tensor([rng.randint(0, M) for _ in range(4)], dtype=torch.int64)
        x, dt, B, C = (t.reshape(4, M, *t.shape[1:]) for t in _tokens(gen, 4 * M))
        c0 = cb.positions[ids.long() % 6].long()
        ca.accept(ids, v)
        ya = ca.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, num_accepted_tokens=torch.randint(-2, 6, (4,), dtype=torch.int32))
        yb = cb.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, num_accepted_tokens=v)
        assert_cache_equal(ca.tensors, cb.tensors)
        assert same_bits(ya, yb), step
        for r in range(3):
            c, q = c0[r].tolist()
            if (c + min(int(v[r]), q)) // grid(M) > c // grid(M):
                folded += 1
            else:
                kept += 1
        assert torch.equal(ya[3], torch.zeros_like(ya[3])) and torch.equal(yb[3], torch.zeros_like(yb[3]))
    assert folded >= 3 and kept >= 10


# -- validation: every rejected call names the argument and leaves the cache untouched -----

VM = 3  # max_seqlen of the validation world


def _valid_world():
    """A pending cache (max_seqlen 3) whose 3 live slots hold 3 pending drafts each, and the
    arguments of a valid dense and a valid varlen functional call."""
    cache, slots, p, _, gen = _cache("fp8", VM - 1, live=3)
    x, dt, B, C = (v.reshape(3, VM, *v.shape[1:]) for v in _tokens(gen, 3 * VM))
    cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, slots)
    assert cache.positions[slots.long(), 1].tolist() == [VM] * 3
    x, dt, B, C = (v.reshape(3, VM, *v.shape[1:]) for v in _tokens(gen, 3 * VM))
    dense = dict(x=x, dt=dt, A=p.A, B=B, C=C, D=p.D, dt_bias=p.dt_bias, state_indices=slots,
                 out=torch.empty(3, VM, HEADS, P, dtype=torch.bfloat16))
    vx, vdt, vB, vC = _tokens(gen, 5)
    varlen = dict(x=vx, dt=vdt, A=p.A, B=vB, C=vC, D=p.D, dt_bias=p.dt_bias, state_indices=slots,
                  out=torch.empty(5, HEADS, P, dtype=torch.bfloat16))
    return cache, dense, varlen


CU = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
ACC = torch.tensor([1, 2, 3], dtype=torch.int32)
BAD_PENDING_CALLS = [
    pytest.param("dense", {"max_seqlen": 9}, ValueError, r"max_seqlen must be in 1\.\.8 in pending mode; got 9", id="max-seqlen-9"),
    pytest.param("dense", {"max_seqlen": 0}, ValueError, r"max_seqlen must be in 1\.\.8 in pending mode; got 0", id="max-seqlen-0"),
    pytest.param("dense", {"max_seqlen": 3.0}, TypeError, "max_seqlen must be a Python int; got float", id="max-seqlen-float"),
    pytest.param("dense", {"max_seqlen": True}, TypeError, "max_seqlen must be a Python int; got bool", id="max-seqlen-bool"),
    pytest.param("changed", {"max_seqlen": 2}, ValueError, r"a slot holds 3 pending tokens; got max_seqlen=2", id="max-seqlen-changed"),
    pytest.param("varlen", {"cu_seqlens": CU.long()}, ValueError, r"cu_seqlens must be int32 \[4\] \(batch \+ 1\); got torch.int64 \[4\]", id="cu-int64"),
    pytest.param("varlen", {"cu_seqlens": CU[:3]}, ValueError, r"cu_seqlens must be int32 \[4\] \(batch \+ 1\); got torch.int32 \[3\]", id="cu-length"),
    pytest.param("varlen", {"cu_seqlens": [0, 1, 3, 5]}, TypeError, "cu_seqlens must be a torch.Tensor; got list", id="cu-list"),
    pytest.param("varlen", {"cu_seqlens": torch.tensor([0, 3, 1, 5], dtype=torch.int32)}, ValueError, r"cu_seqlens must be non-decreasing; got \[0, 3, 1, 5\]", id="cu-decreasing"),
    pytest.param("varlen", {"cu_seqlens": torch.tensor([1, 1, 3, 5], dtype=torch.int32)}, ValueError, r"cu_seqlens must start at 0; got \[1, 1, 3, 5\]", id="cu-start"),
    pytest.param("varlen", {"cu_seqlens": torch.tensor([0, 1, 3, 4], dtype=torch.int32)}, ValueError, r"cu_seqlens must end at the number of tokens 5 \(x.shape\[0\]\); got \[0, 1, 3, 4\]", id="cu-end"),
    pytest.param("varlen", {"cu_seqlens": torch.tensor([0, 0, 1, 5], dtype=torch.int32)}, ValueError, r"at most max_seqlen=3 tokens; got \[0, 0, 1, 5\]", id="cu-row-too-long"),
    pytest.param("dense", {"num_accepted_tokens": ACC[:2]}, ValueError, r"num_accepted_tokens must be int32 or int64 \[3\] \(one per row\); got torch.int32 \[2\]", id="acc-shape"),
    pytest.param("dense", {"num_accepted_tokens": ACC.view(3, 1)}, ValueError, r"num_accepted_tokens must be int32 or int64 \[3\] \(one per row\); got torch.int32 \[3, 1\]", id="acc-2d"),
    pytest.param("dense", {"num_accepted_tokens": ACC.float()}, ValueError, r"num_accepted_tokens must be int32 or int64 \[3\] \(one per row\); got torch.float32 \[3\]", id="acc-float"),
    pytest.param("dense", {"num_accepted_tokens": ACC.to(torch.int16)}, ValueError, r"num_accepted_tokens must be int32 or int64 \[3\] \(one per row\); got torch.int16", id="acc-int16"),
    pytest.param("dense", {"num_accepted_tokens": [1, 2, 3]}, TypeError, "num_accepted_tokens must be a torch.Tensor; got list", id="acc-list"),
    pytest.param("dense-T2", {}, ValueError, r"x must be bfloat16 \[3, 3, 8, 64\] or \[3, 3, 512\] \(dense \[b, T, \.\.\.\] with T == max_seqlen\); got torch.bfloat16 \[3, 2, 8, 64\]", id="x-T-not-max-seqlen"),
    pytest.param("dense", {"x": "x32"}, ValueError, r"x must be bfloat16 \[3, 3, 8, 64\] or \[3, 3, 512\] .*; got torch.float32 \[3, 3, 8, 64\]", id="x-dtype"),
    pytest.param("dense", {"dt": "untied"}, ValueError, r"dt must hold one value per head", id="dt-untied"),
    pytest.param("dense", {"B": "groups2"}, ValueError, r"B must be bfloat16 \[3, 3, 1, 128\]", id="B-shape"),
    pytest.param("dense", {"out": "sep"}, ValueError, r"out must be contiguous bfloat16 \[3, 3, 8, 64\] or \[3, 3, 512\] \(dense, T == max_seqlen\); got torch.bfloat16 \[3, 8, 64\]", id="out-separate-shape"),
    pytest.param("varlen", {"out": "short"}, ValueError, r"out must be contiguous bfloat16 \[5, 8, 64\] or \[5, 512\] \(varlen: one row a token\); got torch.bfloat16 \[4, 8, 64\]", id="out-varlen-shape"),
    pytest.param("varlen", {"x": "dense"}, ValueError, r"x must be bfloat16 \[total, 8, 64\] or \[total, 512\] \(varlen layout: cu_seqlens given\); got torch.bfloat16 \[1, 5, 8, 64\]", id="x-dense-with-cu"),
]


def _bad(name, value, args):
    if not isinstance(value, str):
        return value
    t = args[name]
    return {
        "x32": lambda: t.float(),
        "untied": lambda: t[..., None].expand(*t.shape, P).contiguous(),
        "groups2": lambda: torch.cat([t, t], dim=-2),
        "sep": lambda: t[:, 0].contiguous(),
        "short": lambda: t[:4],
        "dense": lambda: t.reshape(1, 5, HEADS, P),
    }[value]()


@pytest.mark.parametrize("layout,change,exc,match", BAD_PENDING_CALLS)
def test_rejected_pending_call_names_the_argument_and_leaves_the_cache_untouched(layout, change, exc, match):
    cache, dense, varlen = _valid_world()
    args = dict(varlen if layout == "varlen" else dense)
    kw = dict(state_dtype="fp8", seed=cache.seed, max_seqlen=VM, backend="reference")
    if layout == "varlen":
        kw["cu_seqlens"] = CU
    if layout == "dense-T2":
        for k in ("x", "dt", "B", "C", "out"):
            args[k] = args[k][:, :2]
    if layout == "changed":
        for k in ("x", "dt", "B", "C", "out"):
            args[k] = args[k][:, :2].contiguous()
    for k, v in change.items():
        if k in args:
            args[k] = _bad(k, v, args)
        else:
            kw[k] = v
    before = snapshot(cache.tensors)
    with pytest.raises(exc, match=match):
        selective_state_update_replayssm(cache.tensors, *args.values(), **kw)
    assert_cache_equal(before, cache.tensors)
    # the same call with the valid argument goes through and writes the cache
    good = dict(varlen if layout == "varlen" else dense)
    gkw = dict(state_dtype="fp8", seed=cache.seed, max_seqlen=VM, backend="reference",
               num_accepted_tokens=ACC, cu_seqlens=CU if layout == "varlen" else None)
    selective_state_update_replayssm(cache.tensors, *good.values(), **gkw)
    assert cache.positions[good["state_indices"].long(), 0].tolist() == ACC.tolist()


def test_rejected_cache_calls_leave_the_cache_untouched():
    """ReplaySSMCache: spec_tokens out of range or not an int; a dense call whose T is not
    the cache's max_seqlen; pending arguments on a separate-mode cache; accept on a separate
    cache or with a bad verdict; materialize of a pending tuple without max_seqlen."""
    for bad, exc, match in ((8, ValueError, r"spec_tokens must be in 0\.\.7 \(max_seqlen = spec_tokens \+ 1 <= 8\); got 8"),
                            (-1, ValueError, r"spec_tokens must be in 0\.\.7"),
                            (1.0, TypeError, "spec_tokens must be an int; got float"),
                            (True, TypeError, "spec_tokens must be an int; got bool")):
        with pytest.raises(exc, match=match):
            ReplaySSMCache(4, HEADS, GROUPS, "fp8", "cpu", spec_tokens=bad, backend="reference")
    cache, dense, varlen = _valid_world()
    before = snapshot(cache.tensors)
    d = dict(dense)
    args = [d[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "state_indices")]
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[3, 3, 8, 64\]"):
        cache.decode(*(a[:, :2] if i in (0, 1, 3, 4) else a for i, a in enumerate(args)))
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be int32 or int64 \[3\]"):
        cache.accept(d["state_indices"], ACC[:2])
    with pytest.raises(ValueError, match=r"max_seqlen is required for a pending-mode cache"):
        materialize_replayssm_state(cache.tensors, d["state_indices"], d["A"], state_dtype="fp8", backend="reference")
    with pytest.raises(ValueError, match=r"max_seqlen must be in 1\.\.8"):
        materialize_replayssm_state(cache.tensors, d["state_indices"], d["A"], state_dtype="fp8", backend="reference", max_seqlen=9)
    assert_cache_equal(before, cache.tensors)
    sep, slots, p, _, gen = _cache("fp8", 0, live=2)
    before = snapshot(sep.tensors)
    x, dt, B, C = _tokens(gen, 2)
    with pytest.raises(ValueError, match="num_accepted_tokens and cu_seqlens are pending-mode arguments; this cache has spec_tokens=0"):
        sep.decode(x, dt, p.A, B, C, p.D, p.dt_bias, slots, num_accepted_tokens=ACC[:2])
    with pytest.raises(ValueError, match="accept is pending mode's: this cache has spec_tokens=0"):
        sep.accept(slots, ACC[:2])
    with pytest.raises(ValueError, match=r"max_seqlen must be None or 1 for a separate-mode cache; got 3"):
        materialize_replayssm_state(sep.tensors, slots, p.A, state_dtype="fp8", backend="reference", max_seqlen=3)
    assert_cache_equal(before, sep.tensors)
    # the cache's own max_seqlen: a valid call still goes through afterwards
    assert (cache.max_seqlen, sep.max_seqlen) == (VM, 1)
    y = cache.decode(*args, num_accepted_tokens=ACC)
    assert cache.positions[d["state_indices"].long()].tolist() == [[1, 3], [2, 3], [3, 3]] and not torch.isnan(y).any()


# -- slot hand-off on a pending cache -------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_handoff_of_pending_slots(fmt):
    """copy_slots / fork / export / import_ move both position columns (drafts awaiting a
    verdict included) and every per-slot tensor bit for bit, and the copy continues as its
    source: the same call on both gives the same outputs and positions. snapshot and the
    compact export hold the committed state (`materialize`) and restore it with both
    position columns cleared; the functional snapshot needs max_seqlen."""
    M = 3
    cache, slots, p, _, gen = _cache(fmt, M - 1, num_slots=12, live=3)
    src = int(slots[0])
    dirty = cache.allocate(5)  # destinations, first used so their positions and rings are not zero
    cache.prefill_init(prefill_states(p, 5, GROUPS, 4, generator=gen), dirty)
    everyone = torch.cat([slots, dirty])
    for i in range(8):
        x, dt, B, C = (v.reshape(8, M, *v.shape[1:]) for v in _tokens(gen, 8 * M))
        cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, everyone, num_accepted_tokens=torch.full((8,), 2 + i % 2))
    c_src, q_src = cache.positions[src].tolist()
    assert c_src > grid(M) and q_src == M  # folded at least once, drafts pending
    d_copy, d_imp, d_snap, d_compact, d_func = dirty.tolist()

    def per_slot(s):
        return [t[s].clone() for t in cache.tensors[1:]]

    cache.copy_slots([src], [d_copy])
    data = cache.export([src])
    assert data["positions"].tolist() == [[c_src, q_src]]
    cache.import_(data, [d_imp])
    for d in (d_copy, d_imp):
        for a, b in zip(per_slot(src), per_slot(d)):
            assert same_bits(a, b)
    # the copies continue as the source: same verdict, same tokens (folds included)
    x, dt, B, C = (t.reshape(1, M, *t.shape[1:]).expand(3, M, *t.shape[1:]).contiguous() for t in _tokens(gen, M))
    y = cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, torch.tensor([src, d_copy, d_imp]), num_accepted_tokens=torch.tensor([M] * 3))
    assert same_bits(y[0], y[1]) and same_bits(y[0], y[2])
    assert cache.positions[[src, d_copy, d_imp]].tolist() == [[c_src + q_src, M]] * 3
    # snapshot / compact export: the committed state (the call's drafts excluded), positions cleared
    state = cache.materialize([src])
    cache.snapshot([src], [d_snap])
    compact = cache.export([src], compact=True)
    assert same_bits(compact["state"], state)
    cache.import_(compact, [d_compact])
    snapshot_replayssm_slots(cache.tensors, torch.tensor([src]), torch.tensor([d_func]), p.A, state_dtype=fmt,
                             seed=cache.seed, backend="reference", max_seqlen=M)
    for d in (d_snap, d_compact, d_func):
        assert cache.positions[d].tolist() == [0, 0]
        assert torch.equal(cache.tensors[L.X_RING][d], torch.zeros_like(cache.tensors[L.X_RING][d]))
        assert sqnr_db(state[0], cache.materialize([d])[0]) >= tol.STATE_SQNR_FLOOR_DB
    with pytest.raises(ValueError, match="max_seqlen is required for a pending-mode cache"):
        snapshot_replayssm_slots(cache.tensors, torch.tensor([src]), torch.tensor([d_func]), p.A, state_dtype=fmt, backend="reference")
    # a fork of a slot with drafts: both columns, and the forks accept differently afterwards
    forks = cache.fork([src], 2).tolist()
    assert cache.positions[forks].tolist() == [cache.positions[src].tolist()] * 2
    cache.accept(forks, torch.tensor([0, M]))
    assert cache.positions[forks].tolist() == [[c_src + q_src, 0], [c_src + q_src + M, 0]]


# -- a CUDA cache: the reference runs on the GPU tensors ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_pending_mode_matches_the_exact_accepted_stream(fmt):
    """A CUDA cache with backend "auto" (the pending kernels where the kernel backend can
    run): 60 varlen calls with random lengths and verdicts, some committed by `accept`,
    match the exact recurrence of the accepted stream at separate mode's floors, and
    materialize matches the exact state."""
    import warnings

    M = 3
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    p = layer_params(HEADS, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a reference fallback where the CuTe DSL is missing
        cache = ReplaySSMCache(4, HEADS, GROUPS, fmt, "cuda", seed=1, max_batch=8, spec_tokens=M - 1)
    slots = cache.allocate(3)
    states = prefill_states(p, 3, GROUPS, 8, generator=gen)
    cache.prefill_init(states.cuda(), slots)
    reqs = {int(s): Request(ExactRecurrence(p, states[i : i + 1])) for i, s in enumerate(slots.tolist())}
    gp = [t.cuda() for t in (p.A, p.D, p.dt_bias)]
    refs, outs = [], []
    for call in range(60):
        batch = sorted(reqs) + [0]
        lens = [rng.randint(0, M) for _ in batch]
        acc = []
        for s in batch:
            acc.append(reqs[s].verdict if s in reqs else 0)
            if s in reqs:
                _commit(reqs[s])
        x, dt, B, C = _tokens(gen, sum(lens))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        if call % 5 == 4:
            cache.accept(torch.tensor(batch, device="cuda"), torch.tensor(acc, device="cuda"))
        y = cache.decode(x.cuda(), dt.cuda(), gp[0], B.cuda(), C.cuda(), gp[1], gp[2], torch.tensor(batch, device="cuda"),
                         num_accepted_tokens=torch.tensor(acc, device="cuda"), cu_seqlens=cu.cuda())
        assert y.device.type == "cuda"
        y = y.cpu()
        for r, (s, n) in enumerate(zip(batch, lens)):
            lo = int(cu[r])
            if s not in reqs:
                assert torch.equal(y[lo : lo + n], torch.zeros_like(y[lo : lo + n]))
                continue
            st = ExactRecurrence(p, reqs[s].exact.S)
            a = rng.randint(0, n)
            for t in range(n):
                tok = Token(x[lo + t : lo + t + 1], dt[lo + t : lo + t + 1], B[lo + t : lo + t + 1], C[lo + t : lo + t + 1])
                reqs[s].pending.append(tok)
                refs.append(st.step(tok)[0])
                outs.append(y[lo + t].double())
            reqs[s].verdict = a
    assert all(t.device.type == "cuda" for t in cache.tensors)
    assert sqnr_db(torch.stack(refs), torch.stack(outs)) >= tol.OUTPUT_SQNR_FLOOR_DB[fmt]
    mat = cache.materialize(slots).cpu()
    for i, s in enumerate(slots.tolist()):
        assert sqnr_db(reqs[s].exact.S[0], mat[i]) >= tol.STATE_SQNR_FLOOR_DB


def test_readme_speculative_example_runs_on_cpu(monkeypatch):
    """The README's speculative-decoding example (run after its first example, whose
    states and parameters it reuses) runs as written on the CPU: positions are the
    committed counts of its verdicts, the second call's outputs and the materialized states
    match the exact recurrence of the accepted tokens."""
    import re
    from pathlib import Path

    from replayssm.synthetic import LayerParams

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(0)
    ns: dict = {}
    for block in blocks[:2]:
        exec(compile(block, "README.md", "exec"), ns)
    batch, M, xs, dts, Bs = ns["batch"], ns["M"], ns["xs"], ns["dts"], ns["Bs"]
    first = ns["accepted"].tolist()
    assert ns["cache"].positions[ns["slots"].long()].tolist() == [[a + 2, 0] for a in first]
    params = LayerParams(ns["A"], ns["D"], ns["dt_bias"])
    refs, outs = [], []
    for b in range(batch):
        exact = ExactRecurrence(params, ns["states"][b : b + 1])
        tok = [Token(xs[b, t : t + 1], dts[b, t : t + 1], Bs[b, t : t + 1], Bs[b, t : t + 1]) for t in range(M)]
        for t in range(first[b]):
            exact.step(tok[t])
        probe = ExactRecurrence(params, exact.S)
        for t in range(M):
            refs.append(probe.step(tok[t])[0])
            outs.append(ns["y"][b, t].double())
        for t in range(2):
            exact.step(tok[t])
        assert sqnr_db(exact.S[0], ns["state"][b]) >= tol.STATE_SQNR_FLOOR_DB
    assert sqnr_db(torch.stack(refs), torch.stack(outs)) >= tol.OUTPUT_SQNR_FLOOR_DB["fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [2, 5])
def test_materialize_kernel_in_pending_mode_matches_the_reference(fmt, M):
    """The Triton materialize kernel on a pending cache (Triton interpreter): for slots at
    committed counts on and off the fold grid (pending drafts NaN-filled in the ring, since
    they must not count), the state after the committed tokens within FOLD_REL_TOL of
    `pending.pending_materialize` (both FP32 from the same checkpoint and entries, differing
    in summation order only); padding rows zeros; into `out`."""
    from replayssm.kernels.triton.materialize import materialize

    cache, slots, p, _, gen = _cache(fmt, M - 1, live=3)
    rng = random.Random(M)
    for step in range(11):
        b = slots.numel()
        x, dt, B, C = (v.reshape(b, M, *v.shape[1:]) for v in _tokens(gen, b * M))
        acc = torch.tensor([rng.randint(0, M) for _ in range(b)], dtype=torch.int32)
        cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, slots, num_accepted_tokens=acc if step else None)
    cache.accept(slots, torch.tensor([M, 1, 0], dtype=torch.int32))
    pos = cache.positions
    counts = pos[slots.long(), 0].tolist()
    assert len({c % grid(M) for c in counts}) > 1  # not all on the grid
    for s in slots.tolist():  # the pending drafts: never part of the committed state
        c, q = pos[s].tolist()
        for i in range(c, c + q):
            for t in (cache.tensors[L.X_RING], cache.tensors[L.DT_RING], cache.tensors[L.B_RING]):
                t[s, :, i % 16] = NAN
    ids = torch.tensor([0, *slots.tolist(), 6], dtype=torch.int64)
    want = pending_materialize(cache.tensors, ids, p.A, max_seqlen=M)
    out = torch.full((ids.numel(), HEADS, P, N), NAN)
    got = materialize(cache.tensors, ids, p.A, out, max_seqlen=M)
    assert got is out and not torch.isnan(got).any()
    for r in range(1, 4):
        err = (got[r] - want[r]).abs().max()
        assert err <= tol.FOLD_REL_TOL * want[r].abs().max(), (r, float(err))
    assert torch.equal(got[[0, 4]], torch.zeros(2, HEADS, P, N))
    with pytest.raises(ValueError, match="max_seqlen"):
        materialize(cache.tensors, ids, p.A)


def test_import_rejects_drafts_beyond_the_caches_max_seqlen():
    """ReplaySSMCache.decode trusts its one max_seqlen (no device read a call), so import_
    checks that the imported slots' pending counts fit it, and changes nothing otherwise."""
    big, slots, p, _, gen = _cache("fp8", 3, live=2)  # max_seqlen 4
    x, dt, B, C = (v.reshape(2, 4, *v.shape[1:]) for v in _tokens(gen, 8))
    big.decode(x, dt, p.A, B, C, p.D, p.dt_bias, slots)
    data = big.export(slots)
    assert data["positions"][:, 1].tolist() == [4, 4]
    small, dst, _, _, _ = _cache("fp8", 2, live=2)  # max_seqlen 3
    before = snapshot(small.tensors)
    with pytest.raises(ValueError, match=r"data\['positions'\]\[:, 1\] \(tokens awaiting a verdict\) must be in 0\.\.3 for this cache; got \[4\]"):
        small.import_(data, dst)
    assert_cache_equal(small.tensors, before)
    same, dst2, _, _, _ = _cache("fp8", 3, live=2)
    same.import_(data, dst2)
    assert torch.equal(same.positions[dst2.long()], big.positions[slots.long()])


def test_eager_fast_path_takes_the_dense_engine_layouts_and_nothing_else():
    """`api.direct_decode_pending` (ReplaySSMCache's eager pending call on the kernel
    backend) hands the backend what the op's path would (`normalize_pending_inputs`: the
    same values; x, B, C views of the caller's tensors) for the dense layouts engines pass
    (x, B, C [b, T, n * w] column slices of one projection or plain [b, T, n, w]; dt tied
    over the head dim or [b, T, H]; verdicts None, int32 or int64), and takes nothing else:
    it returns False without calling the backend, so the general path validates the call
    and names the argument. CPU tensors (device index -1 on both sides) and a recording
    backend."""
    from replayssm import api
    from replayssm.synthetic import Token, engine_inputs

    calls = []

    class Recorder:
        name = "kernels"

        def decode_pending(self, *args, **kwargs):
            calls.append((args, kwargs))

    b, T = 3, VM
    gen = torch.Generator().manual_seed(5)
    p = layer_params(HEADS, generator=gen)
    cache = L.allocate_cache(6, HEADS, GROUPS, "fp8", "cpu", pending=True)
    x, dt, B, C = _tokens(gen, b * T)
    eng = engine_inputs(Token(x, dt, B, C), p)
    ex, edt, eA, eB, eC, eD, ebias = eng
    engine = (ex.unflatten(0, (b, T)), edt.unflatten(0, (b, T)), eA, eB.unflatten(0, (b, T)), eC.unflatten(0, (b, T)), eD, ebias)
    plain = (x.reshape(b, T, HEADS, P), dt.reshape(b, T, HEADS), p.A, B.reshape(b, T, GROUPS, N), C.reshape(b, T, GROUPS, N), p.D, p.dt_bias)
    ids = torch.tensor([1, 0, 3], dtype=torch.int32)
    out = torch.empty(b, T, HEADS, P, dtype=torch.bfloat16)

    def direct(inputs, ids=ids, out=out, acc=None):
        calls.clear()
        took = api.direct_decode_pending(cache, HEADS, GROUPS, Recorder(), *inputs, ids, out, FP8, 1, VM, acc, 0)
        assert took == bool(calls)
        return took

    for inputs in (engine, plain):
        for acc in (None, ACC, ACC.long()):
            assert direct(inputs, acc=acc)
            (_, gx, gdt, gA, gB, gC, gD, gbias, gids, gout), kw = calls[0]
            want = api.normalize_pending_inputs(*inputs, (b, T), HEADS, GROUPS)
            got = (gx.reshape(b, T, HEADS, P), gdt, gA, gB.reshape(b, T, GROUPS, N), gC.reshape(b, T, GROUPS, N), gD, gbias)
            for name, w, g in zip(("x", "dt", "A", "B", "C", "D", "dt_bias"), want, got):
                assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), name
            for g, given in ((gx, inputs[0]), (gB, inputs[3]), (gC, inputs[4])):
                assert g.data_ptr() == given.data_ptr()
            assert gids is ids and gout is out and kw["num_accepted_tokens"] is acc
            assert kw == dict(fmt=FP8, seed=1, max_seqlen=VM, num_accepted_tokens=acc, cu_seqlens=None, head_offset=0)
    ex4 = engine[0]
    rejected = {
        "x float32": dict(inputs=(ex4.float(), *engine[1:])),
        "x T - 1": dict(inputs=(ex4[:, :-1], *engine[1:])),
        "x heads": dict(inputs=(ex4[..., :-64], *engine[1:])),
        "dt untied": dict(inputs=(ex4, edt.unflatten(0, (b, T)).contiguous(), *engine[2:])),
        "dt int": dict(inputs=(ex4, plain[1].int(), *engine[2:])),
        "dt [b, T, H, 1]": dict(inputs=(ex4, plain[1][..., None], *engine[2:])),  # the op refuses it too
        "B groups": dict(inputs=(*engine[:3], torch.cat([plain[3]] * 2, dim=2), *engine[4:])),
        "C bf16 -> f16": dict(inputs=(*engine[:4], plain[4].half(), *engine[5:])),
        "A a list": dict(inputs=(*engine[:2], p.A.tolist(), *engine[3:])),
        "out separate": dict(inputs=engine, out=torch.empty(b, HEADS, P, dtype=torch.bfloat16)),
        "out strided": dict(inputs=engine, out=torch.empty(b, T, HEADS, 2 * P, dtype=torch.bfloat16)[..., :P]),
        "out float": dict(inputs=engine, out=out.float()),
        "ids 2-D": dict(inputs=engine, ids=ids.view(3, 1)),
        "ids float": dict(inputs=engine, ids=ids.float()),
        "no rows": dict(inputs=tuple(t[:0] if i in (0, 1, 3, 4) else t for i, t in enumerate(engine)), ids=ids[:0], out=out[:0]),
        "acc float": dict(inputs=engine, acc=ACC.float()),
        "acc short": dict(inputs=engine, acc=ACC[:2]),
        "acc 2-D": dict(inputs=engine, acc=ACC.view(3, 1)),
    }
    for name, kw in rejected.items():
        assert not direct(**kw), name
