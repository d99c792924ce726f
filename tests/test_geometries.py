"""The served models' geometries. Heads-a-group ratios beyond 8 and 16 with head dim 64
and state dim 128 (Nemotron-H 4B: 112 heads in 8 groups, Granite 4.0-H Tiny: 48 heads in
one group) and their tensor-parallel-8 shards (14 and 6 heads in one group), plus the
bounds of the ratio (1 and 128); head dim 80 (Nemotron Nano 2) and state dim 256
(Nemotron-H 47B / 56B, Falcon-H1), which run on the PyTorch reference. Output SQNR
against the exact FP64 recurrence at or above each format's floor, single-token and
pending mode (T = 4, drafts accepted with p 0.7): on the CPU through the reference, on
the GPU through the kernels (tests/test_cute_decode_gpu.py and test_pending_kernels.py
hold the 64 / 128 geometries against the reference step by step). The Triton materialize
kernel at every head and state dim against the reference's states: on the CPU through the
Triton interpreter, on the GPU compiled and captured in a CUDA graph."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from replayssm import ReplaySSMCache, allocate_cache, reference
from replayssm import layout as L
from replayssm.pending import grid as pending_grid, pending_materialize
from replayssm.synthetic import ExactRecurrence, engine_inputs, layer_params, prefill_states, sqnr_db, token
from benchmarks.accuracy import pending, single

from . import tolerances as tol

MODELS = [(112, 8), (14, 1), (48, 1), (6, 1)]
BOUNDS = [(8, 8), (128, 1)]
FORMATS = ["fp8", "nvfp4", "fp16"]


def _args(**kw):
    return SimpleNamespace(**{"tokens": 48, "batch": 2, "T": 4, "accept": 0.7, "seed": 3, "backend": "auto", **kw})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,groups", [(14, 1), (6, 1), (8, 8)])
def test_accuracy_at_new_ratios_cpu(fmt, heads, groups):
    args = _args(backend="reference")
    for run in (single, pending):
        r = run(fmt, heads, groups, args, torch.device("cpu"))
        assert r["all"] >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], (run.__name__, r)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,groups", MODELS + BOUNDS)
def test_accuracy_at_model_geometries_gpu(fmt, heads, groups):
    pytest.importorskip("cutlass")
    args = _args(tokens=96, batch=8, backend="kernels")
    for run in (single, pending):
        r = run(fmt, heads, groups, args, torch.device("cuda"))
        assert r["all"] >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], (run.__name__, r)
        print(f"[{fmt} {heads}h/{groups}g {run.__name__}] {r['all']:.2f} dB")


# Tensor-parallel-8 shards of the table's models with another head or state dim (heads,
# groups, head dim, state dim): Nemotron Nano 2 (128 heads / 8 groups / 80 / 128) -> 16 / 1;
# Nemotron-H 47B (256 / 8 / 64 / 256) -> 32 / 1; Falcon-H1 (48 / 1 / 64 / 256) -> 6 / 1
# (a shard of one group gets one head group's worth); and both dims at once.
DIMS = [(16, 1, 80, 128), (32, 1, 64, 256), (6, 1, 64, 256), (8, 2, 80, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,groups,P,N", [(256, 8, 64, 256), (32, 1, 64, 256), (48, 1, 64, 256), (6, 1, 64, 256),
                                               (128, 8, 80, 128), (16, 1, 80, 128), (8, 2, 80, 256)])
def test_accuracy_at_head_and_state_dims_gpu(fmt, heads, groups, P, N):
    """Nemotron-H 47B / 56B (256 heads / 8 groups, its TP-8 shard 32 / 1), Falcon-H1
    (48 / 1, TP-8 6 / 1) at state dim 256, Nemotron Nano 2 (128 / 8, TP-8 16 / 1) at head
    dim 80, and both dims at once, on the kernels, single-token and pending mode, against
    the exact FP64 recurrence."""
    pytest.importorskip("cutlass")
    args = _args(tokens=96, batch=8, backend="kernels", head_dim=P, state_dim=N)
    for run in (single, pending):
        r = run(fmt, heads, groups, args, torch.device("cuda"))
        assert r["all"] >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], (run.__name__, r)
        print(f"[{fmt} {heads}h/{groups}g P={P} N={N} {run.__name__}] {r['all']:.2f} dB")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,groups,P,N", DIMS)
def test_accuracy_at_head_and_state_dims_cpu(fmt, heads, groups, P, N):
    args = _args(backend="reference", tokens=40, head_dim=P, state_dim=N)
    for run in (single, pending):
        r = run(fmt, heads, groups, args, torch.device("cpu"))
        assert r["all"] >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], (run.__name__, r)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_operation_at_head_dim_80_state_dim_256(fmt):
    """Prefill, decode with an engine's strided inputs, materialize against the exact
    state, a fork that decodes bit-identically with its source until its own first flush,
    export / import of the slot's bytes, and the cache tuple's shapes."""
    H, G, P, N = 4, 2, 80, 256
    gen = torch.Generator().manual_seed(5)
    params = layer_params(H, generator=gen)
    cache = ReplaySSMCache(6, H, G, fmt, "cpu", head_dim=P, state_dim=N, backend="reference")
    assert tuple(cache.tensors[1].shape) == (6, H, P, N) and tuple(cache.tensors[4].shape) == (6, G, 16, N)
    ids = cache.allocate(2)
    states = prefill_states(params, 2, G, 8, generator=gen, head_dim=P, state_dim=N)
    cache.prefill_init(states, ids)
    exact = ExactRecurrence(params, states)
    for _ in range(20):  # one flush
        tok = token(2, H, G, generator=gen, head_dim=P, state_dim=N)
        exact.step(tok)
        out = cache.decode(*engine_inputs(tok, params), ids)
    assert tuple(out.shape) == (2, H, P)
    assert sqnr_db(exact.S, cache.materialize(ids, params.A)) >= tol.STATE_SQNR_FLOOR_DB
    fork = cache.allocate(1)
    cache.copy_slots(ids[:1], fork)
    both = torch.cat([ids[:1], fork])
    for _ in range(11):  # the source's and the fork's rings fill alike until the next flush
        tok = token(1, H, G, generator=gen, head_dim=P, state_dim=N)
        two = token(2, H, G, generator=gen, head_dim=P, state_dim=N)
        two = type(two)(*(t[:1].expand(2, *t.shape[1:]).contiguous() for t in (tok.x, tok.dt, tok.B, tok.C)))
        y = cache.decode(*engine_inputs(two, params), both)
        assert torch.equal(y[0], y[1])
    data = cache.export(ids)
    other = ReplaySSMCache(6, H, G, fmt, "cpu", head_dim=P, state_dim=N, backend="reference")
    back = other.allocate(2)
    other.import_(data, back)
    for name, t in other.export(back).items():
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, data[name].view(torch.uint8) if t.element_size() == 1 else data[name]), name


def test_geometry_arguments_are_validated():
    with pytest.raises(ValueError, match="head_dim must be one of"):
        ReplaySSMCache(4, 8, 1, "fp8", "cpu", head_dim=96)
    with pytest.raises(ValueError, match="state_dim"):
        allocate_cache(4, 8, 1, "fp8", state_dim=64)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        allocate_cache(4, 8, 1, "fp8", head_dim=80.0)
    cache = ReplaySSMCache(4, 8, 1, "fp8", "cpu", head_dim=80, backend="reference")
    gen = torch.Generator().manual_seed(0)
    params = layer_params(8, generator=gen)
    tok = token(1, 8, 1, generator=gen)  # head dim 64: not this cache's
    before = [t.clone() for t in cache.tensors]
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[1, 8, 80\]"):
        cache.decode(tok.x, tok.dt, params.A, tok.B, tok.C, params.D, params.dt_bias, cache.allocate(1))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors))


def test_nvfp4_group_amax_is_the_max_of_the_bits():
    """The reference's group amax (init's meta, the flush's stored amax) is the max of the
    FP32 bits of |x| (format.md section 4), as the kernels' reductions and atomic max take
    it: finite values as torch.amax gives them, a NaN with its payload kept."""
    from replayssm.formats import group_amax

    state = torch.randn(3, 4, 64, 128)
    assert torch.equal(group_amax(state, 2), state.abs().reshape(3, 2, -1).amax(-1))
    bits = state.view(torch.int32)
    bits[1, 3, 5, 7] = 0x7FFFFFFF  # a NaN with a payload torch's amax would not keep
    bits[2, 0, 0, 0] = 0xFF800000 - (1 << 32)  # -inf
    got = group_amax(state, 2).view(torch.int32)
    assert got[1, 1] == 0x7FFFFFFF and got[2, 0] == 0x7F800000
    assert torch.equal(got[0], state[0].abs().reshape(2, -1).amax(-1).view(torch.int32))


# -- The Triton materialize kernel at every head and state dim ---------------------------
# (The kernels backend still runs only 64 / 128 caches, so these call the kernel module
# directly on a cache the reference decoded.)

GEOMETRIES = [(64, 128), (80, 128), (64, 256), (80, 256)]
MAT_HEADS, MAT_GROUPS, MAT_SLOTS = 4, 2, 6
NAN = float("nan")


def _materialize_case(fmt, P, N, *, spec_tokens=0, device="cpu", seed=9):
    """A reference-backend cache (4 heads / 2 groups, 6 slots) with 3 prefilled slots and
    decoded tokens: separate mode leaves them at positions 21, 16 and 15 (live ring entries
    5, 0 and 15); pending mode (max_seqlen = spec_tokens + 1) runs 11 calls of max_seqlen
    tokens a row with random verdicts, a verdict by `accept` (all, one, none) and one more
    call, so the slots hold max_seqlen pending drafts and committed counts off the fold
    grid at different offsets, some past it (the ring read from f mod 16 != 0). Returns
    (cache, params, slots, exact FP64 states of the slots (separate mode; None in pending
    mode), generator)."""
    gen = torch.Generator().manual_seed(seed)
    H, G = MAT_HEADS, MAT_GROUPS
    p = layer_params(H, generator=gen, device=device)
    cache = ReplaySSMCache(
        MAT_SLOTS, H, G, fmt, device, seed=2, head_dim=P, state_dim=N, spec_tokens=spec_tokens, backend="reference"
    )
    slots = cache.allocate(3)
    states = prefill_states(p, 3, G, 8, generator=gen, device=device, head_dim=P, state_dim=N)
    cache.prefill_init(states, slots)
    dims = dict(generator=gen, device=device, head_dim=P, state_dim=N)
    if not spec_tokens:
        exact = ExactRecurrence(p, states)
        for step in range(21):
            rows = [0, 1, 2] if step < 15 else ([0, 1] if step < 16 else [0])
            tok = token(len(rows), H, G, **dims)
            cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots[rows])
            sub = ExactRecurrence(p, states[:1])
            sub.S = exact.S[rows]
            sub.step(tok)
            exact.S[rows] = sub.S
        return cache, p, slots, exact, gen
    M = cache.max_seqlen
    rng = random.Random(seed)
    for step in range(11):
        _pending_call(cache, p, slots, rng, dims, verdict=step > 0)
    cache.accept(slots, torch.tensor([M, 1, 0], dtype=torch.int32, device=device))
    _pending_call(cache, p, slots, rng, dims, verdict=False)
    pos = cache.positions[slots.long()].tolist()
    assert len({c % pending_grid(M) for c, _ in pos}) == 3 and max(pos)[0] >= pending_grid(M), pos
    assert all(q == M for _, q in pos), pos
    return cache, p, slots, None, gen


def _pending_call(cache, p, slots, rng, dims, *, verdict=True):
    """One pending-mode decode call: max_seqlen tokens a row and, when `verdict`, the
    previous call's verdict random in 0..max_seqlen."""
    b, M = slots.numel(), cache.max_seqlen
    tok = token(b * M, MAT_HEADS, MAT_GROUPS, **dims)
    x, dt, B, C = (v.reshape(b, M, *v.shape[1:]) for v in (tok.x, tok.dt, tok.B, tok.C))
    acc = None
    if verdict:
        acc = torch.tensor([rng.randint(0, M) for _ in range(b)], dtype=torch.int32, device=slots.device)
    cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, slots, num_accepted_tokens=acc)


def _poison(cache, slots):
    """NaN in every ring entry (x, dt, B) the state must not read: separate mode, the
    entries at and beyond positions mod 16; pending mode, the drafts awaiting a verdict."""
    rings = (cache.tensors[L.X_RING], cache.tensors[L.DT_RING], cache.tensors[L.B_RING])
    for s in slots.tolist():
        pos = cache.positions[s].tolist()
        dead = range(pos % 16, 16) if isinstance(pos, int) else [i % 16 for i in range(pos[0], pos[0] + pos[1])]
        for t in rings:
            t[s, :, list(dead)] = NAN


def _want(cache, ids, A):
    if cache.spec_tokens:
        return pending_materialize(cache.tensors, ids, A, max_seqlen=cache.max_seqlen)
    return reference.materialize(cache.tensors, ids, A)


def _check_states(got, want, live_rows, pad_rows):
    """The kernel's states against the reference's: both compute each state element in FP32
    from the same FP16 checkpoint and bf16 / FP32 ring entries (the decay of S0 plus at
    most 16 rank-1 terms; no sum over P or N, so the bound does not depend on the
    geometry) and differ only in summation order and exp's last ulp: within FOLD_REL_TOL
    of each state's max (as tests/test_handoff.py argues). Padding rows are zeros and
    every element of `out` is written."""
    assert not torch.isnan(got).any()
    for r in live_rows:
        err = (got[r] - want[r]).abs().max()
        assert err <= tol.FOLD_REL_TOL * want[r].abs().max(), (r, float(err))
        assert want[r].abs().max() > 0, r
    assert torch.equal(got[pad_rows], torch.zeros_like(got[pad_rows]))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("P,N", GEOMETRIES)
def test_materialize_kernel_at_every_geometry(fmt, P, N, monkeypatch):
    """The Triton kernel (interpreter) on a separate-mode cache of each geometry against
    `reference.materialize` and the exact FP64 states, ring entries beyond the live ones
    NaN-poisoned, padding rows (0, -3, num_slots) in the batch, into a NaN-filled `out`.
    Head dim 64 runs whole heads a program interpreted; forced to the GPU's 16-row blocks
    it gives the same bits (each element's math does not depend on the block)."""
    pytest.importorskip("triton")
    from replayssm.kernels.triton import materialize as kernel

    cache, p, slots, exact, _ = _materialize_case(fmt, P, N)
    assert [int(cache.positions[s]) for s in slots.tolist()] == [21, 16, 15]
    _poison(cache, slots)
    ids = torch.tensor([0, *slots.tolist(), -3, MAT_SLOTS], dtype=torch.int64)
    want = reference.materialize(cache.tensors, ids, p.A)
    out = torch.full((ids.numel(), MAT_HEADS, P, N), NAN)
    got = kernel.materialize(cache.tensors, ids, p.A, out)
    assert got is out
    _check_states(got, want, [1, 2, 3], [0, 4, 5])
    assert sqnr_db(exact.S, got[1:4]) >= tol.STATE_SQNR_FLOOR_DB
    assert torch.equal(kernel.materialize(cache.tensors, ids[1:2].int(), p.A), got[1:2])  # int32 ids, out allocated
    if P == 64 and fmt == "fp8":  # (the kernel does not read the read copy: one format is enough)
        monkeypatch.setattr(kernel, "interpreting", lambda: False)
        assert torch.equal(kernel.materialize(cache.tensors, ids, p.A), got)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("P,N", GEOMETRIES)
def test_materialize_kernel_in_pending_mode_at_every_geometry(fmt, P, N):
    """The Triton kernel (interpreter) on a pending cache (max_seqlen 3, fold grid 14) of
    each geometry against `pending.pending_materialize`: committed counts 18, 15 and 13
    (4, 1 and 13 entries past the checkpoint, the first two read from ring index 14 on,
    wrapping), the pending drafts NaN-poisoned (never part of the committed state),
    padding rows zeros."""
    pytest.importorskip("triton")
    from replayssm.kernels.triton.materialize import materialize

    cache, p, slots, _, _ = _materialize_case(fmt, P, N, spec_tokens=2)
    assert cache.positions[slots.long(), 0].tolist() == [18, 15, 13]
    _poison(cache, slots)
    ids = torch.tensor([0, *slots.tolist(), MAT_SLOTS], dtype=torch.int64)
    want = pending_materialize(cache.tensors, ids, p.A, max_seqlen=3)
    out = torch.full((ids.numel(), MAT_HEADS, P, N), NAN)
    assert materialize(cache.tensors, ids, p.A, out, max_seqlen=3) is out
    _check_states(out, want, [1, 2, 3], [0, 4])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("P,N", GEOMETRIES)
@pytest.mark.parametrize("spec_tokens", [0, 2], ids=["separate", "pending"])
def test_gpu_materialize_kernel_at_every_geometry_in_a_cuda_graph(fmt, P, N, spec_tokens):
    """The compiled Triton kernel on a CUDA cache of each geometry (decoded by the
    reference backend), captured in a CUDA graph with device ids and `out`, replayed after
    more decode calls and with the dead ring entries NaN-poisoned: within FOLD_REL_TOL of
    the reference (`reference.materialize` / `pending.pending_materialize`), separate mode
    within STATE_SQNR_FLOOR_DB of the exact states, padding rows zeros."""
    pytest.importorskip("triton")
    from replayssm.kernels.triton.materialize import materialize

    cache, p, slots, exact, gen = _materialize_case(fmt, P, N, spec_tokens=spec_tokens, device="cuda")
    ms = cache.max_seqlen if spec_tokens else None
    ids = torch.tensor([0, *slots.tolist(), -3, MAT_SLOTS], dtype=torch.int64, device="cuda")
    out = torch.full((ids.numel(), MAT_HEADS, P, N), NAN, device="cuda")
    materialize(cache.tensors, ids, p.A, out, max_seqlen=ms)  # compile outside the capture
    torch.cuda.synchronize()
    _check_states(out, _want(cache, ids, p.A), [1, 2, 3], [0, 4, 5])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        materialize(cache.tensors, ids, p.A, out, max_seqlen=ms)
    out.fill_(NAN)
    dims = dict(generator=gen, device="cuda", head_dim=P, state_dim=N)
    if spec_tokens:
        rng = random.Random(1)
        for _ in range(3):
            _pending_call(cache, p, slots, rng, dims)
    else:
        for _ in range(7):  # positions 28, 23, 22
            tok = token(slots.numel(), MAT_HEADS, MAT_GROUPS, **dims)
            cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
            exact.step(tok)
    _poison(cache, slots)
    graph.replay()
    torch.cuda.synchronize()
    want = _want(cache, ids, p.A)
    _check_states(out, want, [1, 2, 3], [0, 4, 5])
    if not spec_tokens:
        assert sqnr_db(exact.S, out[1:4]) >= tol.STATE_SQNR_FLOOR_DB


@pytest.mark.gpu
@pytest.mark.parametrize("P,N", [(80, 128), (64, 256), (80, 256)])
def test_engine_shaped_parameters_at_head_and_state_dims_gpu(P, N):
    """A as engines pass it ([H, P, N], tied), D [H, P] and dt_bias [H, P] (tied) through
    a cache's eager calls at this geometry: the same outputs and cache bits as A, D and
    dt_bias [H], over a flush."""
    pytest.importorskip("cutlass")
    H, G = 8, 2
    gen = torch.Generator().manual_seed(4)
    params = layer_params(H, generator=gen, device="cuda")
    caches = [ReplaySSMCache(6, H, G, "fp8", "cuda", head_dim=P, state_dim=N, backend="kernels") for _ in range(2)]
    states = prefill_states(params, 2, G, 8, generator=gen, device="cuda", head_dim=P, state_dim=N)
    slots = [c.allocate(2) for c in caches]
    for c, s in zip(caches, slots):
        c.prefill_init(states, s)
    A_t = params.A.view(H, 1, 1).expand(H, P, N)
    D_t, bias_t = params.D.view(H, 1).expand(H, P), params.dt_bias.view(H, 1).expand(H, P)
    for _ in range(20):
        tok = token(2, H, G, generator=gen, device="cuda", head_dim=P, state_dim=N)
        y0 = caches[0].decode(tok.x, tok.dt, params.A, tok.B, tok.C, params.D, params.dt_bias, slots[0])
        y1 = caches[1].decode(tok.x, tok.dt, A_t, tok.B, tok.C, D_t, bias_t, slots[1])
        assert torch.equal(y0, y1)
    for a, b in zip(caches[0].tensors, caches[1].tensors):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
