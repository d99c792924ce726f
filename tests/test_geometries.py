"""The served models' geometries. Heads-a-group ratios beyond 8 and 16 with head dim 64
and state dim 128 (Nemotron-H 4B: 112 heads in 8 groups, Granite 4.0-H Tiny: 48 heads in
one group) and their tensor-parallel-8 shards (14 and 6 heads in one group), plus the
bounds of the ratio (1 and 128); head dim 80 (Nemotron Nano 2) and state dim 256
(Nemotron-H 47B / 56B, Falcon-H1), which run on the PyTorch reference. Output SQNR
against the exact FP64 recurrence at or above each format's floor, single-token and
pending mode (T = 4, drafts accepted with p 0.7): on the CPU through the reference, on
the GPU through the kernels (tests/test_cute_decode_gpu.py and test_pending_kernels.py
hold the 64 / 128 geometries against the reference step by step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replayssm import ReplaySSMCache, allocate_cache
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
    with pytest.raises(ValueError, match=r"kernels take \(head_dim, state_dim\) in \(\(64, 128\), \(64, 256\)\); got \(80, 128\)"):
        ReplaySSMCache(4, 8, 1, "fp8", "cpu", head_dim=80, backend="kernels")
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
