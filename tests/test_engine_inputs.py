"""A decode step with inputs shaped as engines pass them (synthetic.engine_inputs: x, B, C
column slices of one projection, dt bf16 tied over the head dim, A [H, 64, 128] with
strides (1, 0, 0), D and dt_bias tied) gives the bits of the same values passed as plain
contiguous FP32 / bf16 tensors, and launches only the step's own kernels: nothing is
copied or converted before them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from replayssm import ReplaySSMCache
from replayssm import layout as L
from replayssm.api import normalize_decode_inputs
from replayssm.synthetic import engine_inputs, layer_params, plain_inputs, prefill_states, token

from .helpers import same_bits

HEADS, GROUPS = 16, 2


def _pair(fmt, device, backend, batch=5, seed=0):
    """Twin caches with the same live slots at desynchronized positions."""
    caches = [ReplaySSMCache(batch + 3, HEADS, GROUPS, fmt, device, backend=backend, seed=7) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    params = layer_params(HEADS, generator=gen, device=device)
    states = prefill_states(params, batch, GROUPS, 8, generator=gen, device=device)
    slots = []
    for c in caches:
        s = c.allocate(batch)
        c.prefill_init(states, s)
        c.positions[s.long()] = torch.arange(batch, dtype=torch.int32, device=device) * 3 % 16
        slots.append(s)
    return caches, slots, params, gen


def test_normalized_engine_inputs_are_views_of_the_callers_tensors():
    gen = torch.Generator().manual_seed(0)
    params = layer_params(HEADS, generator=gen)
    tok = token(3, HEADS, GROUPS, generator=gen)
    eng = engine_inputs(tok, params)
    norm = normalize_decode_inputs(*eng, 3, HEADS, GROUPS)
    for name, given, got in zip(("x", "dt", "A", "B", "C", "D", "dt_bias"), eng, norm):
        assert got.untyped_storage().data_ptr() == given.untyped_storage().data_ptr(), name
        assert got.dtype == given.dtype, name
    plain = normalize_decode_inputs(*plain_inputs(tok, params), 3, HEADS, GROUPS)
    for a, b in zip(norm, plain):
        assert torch.equal(a.float(), b.float())


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_engine_shaped_inputs_give_the_plain_inputs_bits_cpu(fmt, backend):
    """CPU: the reference, and the kernel backend under the Triton interpreter, over a
    flush of every row (20 steps)."""
    caches, slots, params, gen = _pair(fmt, "cpu", backend)
    for _ in range(20):
        tok = token(5, HEADS, GROUPS, generator=gen)
        a = caches[0].decode(*engine_inputs(tok, params), slots[0])
        b = caches[1].decode(*plain_inputs(tok, params), slots[1])
        assert same_bits(a, b)
    for x, y in zip(caches[0].tensors[1:], caches[1].tensors[1:]):
        assert same_bits(x, y)


needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (pip install -e '.[cute]')")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("batch", [1, 5, 45])
def test_engine_shaped_inputs_give_the_plain_inputs_bits_gpu(fmt, batch):
    """Over 34 steps (every row flushes twice): outputs and every cache tensor."""
    caches, slots, params, gen = _pair(fmt, "cuda", "kernels", batch=batch)
    for _ in range(34):
        tok = token(batch, HEADS, GROUPS, generator=gen, device="cuda")
        a = caches[0].decode(*engine_inputs(tok, params), slots[0])
        b = caches[1].decode(*plain_inputs(tok, params), slots[1])
        assert same_bits(a, b)
    torch.cuda.synchronize()
    for x, y in zip(caches[0].tensors[1:], caches[1].tensors[1:]):
        assert same_bits(x, y)


def _kernels_of_one_step(cache, slots, inputs, out):
    from torch.profiler import ProfilerActivity, profile

    cache.decode(*inputs, slots, out=out)  # compiled and loaded
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cache.decode(*inputs, slots, out=out)
        torch.cuda.synchronize()
    names = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            names.append(evt.name)
    return names


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("shape", ["engine", "plain"])
@pytest.mark.parametrize("batch", [1, 64])
def test_a_step_launches_only_its_three_kernels(fmt, shape, batch):
    """The profiler sees exactly prepare, the flush and the non-flush kernel in one step
    (no copy, no conversion, no memset), for engine-shaped and plain inputs."""
    caches, slots, params, gen = _pair(fmt, "cuda", "kernels", batch=batch)
    tok = token(batch, HEADS, GROUPS, generator=gen, device="cuda")
    inputs = engine_inputs(tok, params) if shape == "engine" else plain_inputs(tok, params)
    out = torch.empty(batch, HEADS, L.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    names = _kernels_of_one_step(caches[0], slots[0], inputs, out)
    kinds = sorted("prepare" if "cuteplanprepare" in n.lower() else "flush" if "cuteflushflush" in n.lower() else "decode" if "cutedecodedecode" in n.lower() else n for n in names)
    assert kinds == ["decode", "flush", "prepare"], names


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_the_eager_fast_path_gives_the_ops_bits_and_launches_directly(fmt, monkeypatch):
    """An eager `ReplaySSMCache.decode` on the kernel backend skips the custom op
    (`api.direct_decode`) and launches the prepare and CuTe kernels through their TVM-FFI
    entries (`launch.compile_entry`): over 34 steps with engine-shaped inputs and a padding row, the
    outputs and every cache tensor equal, bit for bit, those of a twin cache decoded
    through the op (the general path)."""
    from replayssm import api, ops
    from replayssm.kernels import kernel_backend
    from replayssm.kernels.cute.plan import compiled_prepare

    batch = 6
    caches, slots, params, gen = _pair(fmt, "cuda", "kernels", batch=batch)
    slots[0][2] = slots[1][2] = 0  # a padding row
    through_op = []
    real_op = ops.decode
    monkeypatch.setattr(ops, "decode", lambda *a, **k: (through_op.append(1), real_op(*a, **k)))
    out = [torch.empty(batch, HEADS, L.HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for step in range(34):
        tok = token(batch, HEADS, GROUPS, generator=gen, device="cuda")
        inputs = engine_inputs(tok, params)
        caches[0].decode(*inputs, slots[0], out=out[0])
        assert not through_op, "the eager call went through the op"
        with monkeypatch.context() as m:
            m.setattr(api, "direct_decode", lambda *a, **k: False)
            caches[1].decode(*inputs, slots[1], out=out[1])
        assert through_op == [1]
        through_op.clear()
        assert same_bits(out[0], out[1]), step
    torch.cuda.synchronize()
    for x, y in zip(caches[0].tensors[1:], caches[1].tensors[1:]):
        assert same_bits(x, y)
    steps = kernel_backend()._context(caches[0].tensors).steps.values()
    entries = [k for s in steps for ks in s.kernels.values() for k in ks[:2]]
    assert entries and all(type(k).__module__.split(".")[0] == "tvm_ffi" for k in entries), [type(k) for k in entries]
    prepares = kernel_backend()._context(caches[0].tensors).prepares.values()
    assert prepares and all(type(compiled_prepare(*p.key, slots[0].dtype)).__module__.split(".")[0] == "tvm_ffi" for p in prepares)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_the_eager_pending_fast_path_gives_the_ops_bits(fmt, monkeypatch):
    """Pending mode (spec_tokens 3): an eager `ReplaySSMCache.decode` of the dense layout
    on the kernel backend skips the custom op (`api.direct_decode_pending`), launching the
    plan and the CuTe fold and step from the cache context's `PendingPlanLaunch` /
    `PendingLaunch` with the inputs as they are; over 24 calls with engine-shaped inputs
    (a projection's column slices, dt tied), random verdicts and a padding row, the
    outputs and every cache tensor equal, bit for bit, those of a twin cache decoded
    through the op with B in a layout the step cannot read (heads 256 elements apart),
    which the backend copies once."""
    from replayssm import api, ops
    from replayssm.kernels import kernel_backend

    batch, T = 6, 4
    gen = torch.Generator().manual_seed(3)
    params = layer_params(HEADS, generator=gen, device="cuda")
    states = prefill_states(params, batch, GROUPS, 8, generator=gen, device="cuda")
    caches = [ReplaySSMCache(batch + 2, HEADS, GROUPS, fmt, "cuda", backend="kernels", seed=7, spec_tokens=T - 1) for _ in range(2)]
    slots = []
    for c in caches:
        s = c.allocate(batch)
        c.prefill_init(states, s)
        s = s.clone()
        s[2] = 0  # a padding row
        slots.append(s)
    through_op = []
    real_op = ops.decode_pending
    monkeypatch.setattr(ops, "decode_pending", lambda *a, **k: (through_op.append(1), real_op(*a, **k)))
    apart = torch.empty(batch, T, GROUPS, 256, dtype=torch.bfloat16, device="cuda")[..., :128]
    out = [torch.empty(batch, T, HEADS, L.HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    acc = None
    for call in range(24):
        tok = token(batch * T, HEADS, GROUPS, generator=gen, device="cuda")
        x, dt, A, B, C, D, dt_bias = engine_inputs(tok, params)
        inputs = (x.unflatten(0, (batch, T)), dt.unflatten(0, (batch, T)), A, B.unflatten(0, (batch, T)), C.unflatten(0, (batch, T)), D, dt_bias)
        caches[0].decode(*inputs, slots[0], out=out[0], num_accepted_tokens=acc)
        assert not through_op, "the eager call went through the op"
        apart.copy_(inputs[3].reshape(batch, T, GROUPS, 128))
        with monkeypatch.context() as m:
            m.setattr(api, "direct_decode_pending", lambda *a, **k: False)
            caches[1].decode(*inputs[:3], apart, *inputs[4:], slots[1], out=out[1], num_accepted_tokens=acc)
        assert through_op == [1]
        through_op.clear()
        assert same_bits(out[0], out[1]), call
        acc = torch.randint(0, T + 1, (batch,), generator=gen, dtype=torch.int32).cuda()
    torch.cuda.synchronize()
    for x, y in zip(caches[0].tensors[1:], caches[1].tensors[1:]):
        assert same_bits(x, y)
    assert kernel_backend()._context(caches[0].tensors).pending_launches
