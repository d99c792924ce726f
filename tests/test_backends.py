"""Backend choice: `backend="auto" | "kernels" | "reference"` on ReplaySSMCache and the
functional API; "auto" warns once per reason when it falls back to the reference,
"kernels" raises instead; the cache validates its tuple once, the functional API on every
call."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import replayssm.layout
from replayssm import (
    ReplaySSMCache,
    allocate_cache,
    clear_replayssm_slots,
    initialize_replayssm_state,
    materialize_replayssm_state,
    selective_state_update_replayssm,
)
from replayssm import layout as L
from replayssm.kernels import BACKENDS, REFERENCE, KernelBackend, backend_for, kernel_backend
from replayssm.synthetic import layer_params, prefill_states, token

from .helpers import assert_cache_equal, snapshot

H, G = 16, 2
HAS_CUDA = torch.cuda.is_available()


def test_backend_names():
    assert BACKENDS == ("reference", "kernels")
    assert REFERENCE.name == "reference" and KernelBackend.name == "kernels"


def test_reference_is_chosen_explicitly_anywhere():
    assert backend_for("cpu", "reference") is REFERENCE
    assert backend_for("cuda", "reference") is REFERENCE  # no GPU query for the reference
    assert ReplaySSMCache(4, H, G, "fp8", "cpu", backend="reference").backend_name == "reference"


def test_kernels_on_the_cpu_need_the_interpreter(monkeypatch):
    if HAS_CUDA:
        pytest.skip("CPU-only machines run the Triton kernels in the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend_for("cpu", "kernels") is kernel_backend()
    assert ReplaySSMCache(4, H, G, "fp8", "cpu", backend="kernels").backend_name == "kernels"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    msg = r"^backend='kernels' needs a CUDA device \(or TRITON_INTERPRET=1, .*\); got device cpu; pass backend='auto' or 'reference'$"
    with pytest.raises(ValueError, match=msg):
        ReplaySSMCache(4, H, G, "fp8", "cpu", backend="kernels")
    cache = allocate_cache(4, H, G, "fp8")
    before = snapshot(cache)
    with pytest.raises(ValueError, match=msg):
        initialize_replayssm_state(cache, torch.ones(1, H, 64, 128), torch.tensor([1]), state_dtype="fp8", backend="kernels")
    with pytest.raises(ValueError, match=msg):
        clear_replayssm_slots(cache, torch.tensor([1]), state_dtype="fp8", backend="kernels")
    with pytest.raises(ValueError, match=msg):
        materialize_replayssm_state(cache, torch.tensor([1]), -torch.ones(H), state_dtype="fp8", backend="kernels")
    assert_cache_equal(before, cache)


def test_cpu_reasons_of_the_kernel_backend():
    assert kernel_backend().cute_unavailable(device="cpu") == "the CuTe decode kernels need a CUDA device; got cpu"
    cache = allocate_cache(4, H, G, "nvfp4")
    assert kernel_backend().cute_for(cache) is None
    assert "need a CUDA device; got cpu" in kernel_backend().cute_unavailable(cache)


@pytest.mark.parametrize(
    "backend,exc,match",
    [
        pytest.param("torch", ValueError, r"^backend must be one of \('auto', 'reference', 'kernels'\); got 'torch'$", id="old-name"),
        pytest.param("triton", ValueError, "backend must be one of", id="triton"),
        pytest.param("cute", ValueError, "backend must be one of", id="cute"),
        pytest.param("", ValueError, "backend must be one of", id="empty"),
        pytest.param(None, TypeError, r"^backend must be a str in .*; got NoneType$", id="none"),
        pytest.param(1, TypeError, "backend must be a str", id="int"),
    ],
)
def test_bad_backend_values(backend, exc, match):
    with pytest.raises(exc, match=match):
        ReplaySSMCache(4, H, G, "fp8", "cpu", backend=backend)
    cache = allocate_cache(4, H, G, "fp8")
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        initialize_replayssm_state(cache, torch.ones(1, H, 64, 128), torch.tensor([1]), state_dtype="fp8", backend=backend)
    with pytest.raises(exc, match=match):
        clear_replayssm_slots(cache, torch.tensor([1]), state_dtype="fp8", backend=backend)
    assert_cache_equal(before, cache)


_WARN_ONCE = r"""
import json, warnings, torch
from replayssm import ReplaySSMCache, allocate_cache, clear_replayssm_slots
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ReplaySSMCache(4, 16, 2, "fp8", "cpu", backend="reference")
    ReplaySSMCache(4, 16, 2, "fp8", "cpu")
    ReplaySSMCache(4, 16, 2, "nvfp4", "cpu", backend="auto")
    cache = allocate_cache(4, 16, 2, "fp8")
    clear_replayssm_slots(cache, torch.tensor([1]), state_dtype="fp8")
print(json.dumps([[w.category.__name__, str(w.message), w.filename, w.lineno] for w in seen]))
"""


def test_auto_on_the_cpu_warns_once_with_the_reason_at_the_callers_line():
    """A fresh process: the explicit reference is silent; the first "auto" warns, pointing
    at the caller's line; later "auto" calls (cache or functional) with the same reason
    do not."""
    run = subprocess.run([sys.executable, "-c", _WARN_ONCE], capture_output=True, text=True, check=True)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == [
        [
            "ReferenceFallbackWarning",
            "replayssm backend='auto' runs the PyTorch reference: the kernels need a CUDA device; got cpu "
            "(pass backend='reference' to choose it explicitly)",
            "<string>",
            7,
        ]
    ]


def test_kernels_backend_gives_the_reference_bits_on_the_cpu():
    """backend="kernels" (on the CPU: the reference's initialize, clear and decode math,
    Triton materialize in the interpreter) and backend="reference" give identical bytes:
    17 steps, one flush."""
    if HAS_CUDA:
        pytest.skip("on a GPU the kernels backend runs the CuTe kernels (tests/test_triton_bookkeeping.py)")
    g = torch.Generator().manual_seed(5)
    p = layer_params(H, generator=g)
    states = prefill_states(p, 2, G, 16, generator=g)
    caches = {b: ReplaySSMCache(5, H, G, "nvfp4", "cpu", seed=4, backend=b) for b in ("kernels", "reference")}
    for c in caches.values():
        c.allocate(2)
        c.prefill_init(states, [2, 1])
    for step in range(17):
        tok = token(3, H, G, generator=g)
        outs = [c.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, [1, 0, 2]) for c in caches.values()]
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"step {step}"
        assert_cache_equal(caches["kernels"].tensors, caches["reference"].tensors)
    assert caches["kernels"].positions[1:3].tolist() == [17, 17]


def test_cache_validates_its_tuple_once_and_the_functional_api_every_call(monkeypatch):
    calls = []
    check = replayssm.layout.check_cache

    def counting(cache, fmt):
        calls.append(fmt.name)
        return check(cache, fmt)

    monkeypatch.setattr(replayssm.layout, "check_cache", counting)
    g = torch.Generator().manual_seed(6)
    p = layer_params(H, generator=g)
    cache = ReplaySSMCache(5, H, G, "fp8", "cpu", backend="reference")
    assert calls == ["fp8"]
    slots = cache.allocate(2)
    cache.prefill_init(prefill_states(p, 2, G, 8, generator=g), slots)
    tok = token(2, H, G, generator=g)
    cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
    cache.materialize(slots)
    cache.reset(slots[:1])
    cache.release(slots)
    assert calls == ["fp8"]
    tensors = list(cache.tensors)
    out = torch.empty(2, H, 64, dtype=torch.bfloat16)
    kw = dict(state_dtype="fp8", backend="reference")
    initialize_replayssm_state(tensors, torch.zeros(2, H, 64, 128), torch.tensor([1, 2]), **kw)
    selective_state_update_replayssm(tensors, tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, torch.tensor([1, 2]), out, **kw)
    materialize_replayssm_state(tensors, torch.tensor([1]), p.A, **kw)
    clear_replayssm_slots(tensors, torch.tensor([1]), **kw)
    assert calls == ["fp8"] * 5


def test_the_owned_tuple_cannot_be_swapped():
    cache = ReplaySSMCache(4, H, G, "fp8", "cpu", backend="reference")
    with pytest.raises(TypeError):
        cache.tensors[L.CHECKPOINT] = torch.zeros(4, H, 64, 128)
