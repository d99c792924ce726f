"""A batch made only of padding rows (slot <= 0 or >= num_slots: CUDA-graph batch padding)
is normal input for every operation, on every backend that runs here (the reference; the
kernel backend on the CPU, its Triton kernels under the interpreter) and both formats:
the cache keeps every byte, outputs are zeros."""

from __future__ import annotations

import pytest
import torch

from replayssm import (
    ReplaySSMCache,
    clear_replayssm_slots,
    initialize_replayssm_state,
    materialize_replayssm_state,
    selective_state_update_replayssm,
)
from replayssm import layout as L
from replayssm.kernels import backend_for
from replayssm.synthetic import layer_params, prefill_states, token
from replayssm.formats import FP8, NVFP4, format_of

from .helpers import assert_cache_equal, snapshot

H, G, S = 16, 2, 9
DEV = "cuda" if torch.cuda.is_available() else "cpu"
PADDING = [
    pytest.param([0], id="zero"),
    pytest.param([99], id="beyond"),
    pytest.param([-1], id="negative"),
    pytest.param([0, 0], id="zero-twice"),
    pytest.param([S, -7, 0], id="mixed"),
]
BACKENDS = ["reference", "kernels"]
FORMATS = ["fp8", "nvfp4"]


def _backend(name):
    return backend_for(DEV, name)


def _live_cache(fmt):
    """A cache with two live slots (1 and 2) mid-period, so padding rows have something
    they could wrongly read or overwrite."""
    g = torch.Generator().manual_seed(0)
    p = layer_params(H, generator=g)
    cache = L.allocate_cache(S, H, G, fmt, DEV)
    ids = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    initialize_replayssm_state(
        cache, prefill_states(p, 2, G, 16, generator=g).to(DEV), ids, state_dtype=fmt, backend="reference"
    )
    for _ in range(3):
        tok = token(2, H, G, generator=g, device=DEV)
        out = torch.empty(2, H, 64, dtype=torch.bfloat16, device=DEV)
        selective_state_update_replayssm(
            cache, tok.x, tok.dt, p.A.to(DEV), tok.B, tok.C, p.D.to(DEV), p.dt_bias.to(DEV), ids, out,
            state_dtype=fmt, backend="reference",
        )
    return cache, p


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("ids", PADDING)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_only_batch_changes_nothing(fmt, backend, ids, dtype):
    cache, p = _live_cache(fmt)
    nvfp4 = fmt == "nvfp4"
    impl = _backend(backend)
    n = len(ids)
    ids = torch.tensor(ids, dtype=dtype, device=DEV)
    before = snapshot(cache)
    g = torch.Generator().manual_seed(1)

    # init: contiguous states and a broadcast zero state (as reset passes)
    impl.initialize(cache, torch.randn(n, H, 64, 128, generator=g).to(DEV), ids, fmt=(NVFP4 if nvfp4 else FP8), seed=0)
    impl.initialize(cache, torch.zeros(1, H, 64, 128, device=DEV).expand(n, -1, -1, -1), ids, fmt=(NVFP4 if nvfp4 else FP8), seed=0)
    assert_cache_equal(before, cache)
    # clear
    impl.clear(cache, ids)
    assert_cache_equal(before, cache)
    # decode: zero outputs over NaN-poisoned rows
    tok = token(n, H, G, generator=g, device=DEV)
    out = torch.full((n, H, 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    D = p.D[:, None].expand(H, 64).to(DEV)
    impl.decode(cache, tok.x, tok.dt, p.A.to(DEV), tok.B, tok.C, D, p.dt_bias.to(DEV), ids, out, fmt=(NVFP4 if nvfp4 else FP8), seed=0)
    assert torch.equal(out, torch.zeros_like(out))
    assert_cache_equal(before, cache)


@pytest.mark.parametrize("ids", PADDING)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_only_batch_through_the_functional_api(fmt, backend, ids):
    cache, p = _live_cache(fmt)
    n = len(ids)
    ids = torch.tensor(ids, dtype=torch.int32, device=DEV)
    before = snapshot(cache)
    g = torch.Generator().manual_seed(1)
    kw = dict(state_dtype=fmt, backend=backend)
    initialize_replayssm_state(cache, torch.randn(n, H, 64, 128, generator=g).to(DEV), ids, **kw)
    clear_replayssm_slots(cache, ids, **kw)
    tok = token(n, H, G, generator=g, device=DEV)
    out = torch.full((n, H, 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    selective_state_update_replayssm(
        cache, tok.x, tok.dt, p.A.to(DEV), tok.B, tok.C, p.D.to(DEV), p.dt_bias.to(DEV), ids, out, **kw
    )
    assert torch.equal(out, torch.zeros_like(out))
    # materialize: padding rows read as zero states, as decode writes zero outputs
    got = materialize_replayssm_state(cache, ids, p.A.to(DEV), **kw)
    assert torch.equal(got, torch.zeros(n, H, 64, 128, device=DEV))
    assert_cache_equal(before, cache)


@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_rows_among_live_rows_materialize_as_zeros(fmt):
    cache, p = _live_cache(fmt)
    A = p.A.to(DEV)
    kw = dict(state_dtype=fmt, backend="reference")
    live = materialize_replayssm_state(cache, torch.tensor([1, 2], device=DEV), A, **kw)
    got = materialize_replayssm_state(cache, torch.tensor([0, 2, S, 1, -1], device=DEV), A, **kw)
    zero = torch.zeros_like(live[0])
    for row, want in enumerate([zero, live[1], zero, live[0], zero]):
        assert torch.equal(got[row], want), f"row {row}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_methods_accept_padding_only_batches(fmt, backend):
    cache = ReplaySSMCache(S, H, G, fmt, DEV, seed=2, backend=backend)
    assert cache.backend_name == backend
    g = torch.Generator().manual_seed(3)
    p = layer_params(H, generator=g)
    slots = cache.allocate(2)
    cache.prefill_init(prefill_states(p, 2, G, 16, generator=g).to(DEV), slots)
    before = snapshot(cache.tensors)
    for ids in ([0], [99], [-1], [0, 0]):
        n = len(ids)
        cache.prefill_init(torch.zeros(n, H, 64, 128, device=DEV), torch.tensor(ids, dtype=torch.int32, device=DEV))
        cache.reset(ids)
        tok = token(n, H, G, generator=g, device=DEV)
        out = cache.decode(tok.x, tok.dt, p.A.to(DEV), tok.B, tok.C, p.D.to(DEV), p.dt_bias.to(DEV), ids)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(cache.materialize(ids), torch.zeros(n, H, 64, 128, device=DEV))
        assert_cache_equal(before, cache.tensors)
