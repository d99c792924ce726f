"""The torch custom ops (replayssm/ops.py): schemas, `torch.library.opcheck`, fake tensors,
and `torch.compile(fullgraph=True)` of a Mamba-2-like layer against the same layer run
eagerly, bit for bit (outputs and every cache tensor), on the CPU reference and (GPU
marker) on the H200 kernels."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from replayssm import (
    ReplaySSMCache,
    allocate_cache,
    initialize_replayssm_state,
    layout as L,
    materialize_replayssm_state,
    ops,
    selective_state_update_replayssm,
)
from replayssm import reference as ref
from replayssm.api import normalize_decode_inputs
from replayssm.pending import grid
from replayssm.kernels import REFERENCE
from replayssm.synthetic import layer_params, prefill_states, token
from replayssm.formats import FP8, NVFP4, format_of

from .helpers import assert_cache_equal, same_bits, snapshot

FORMATS = ["fp8", "nvfp4"]
KERNEL_FORMATS = [*FORMATS, "fp16"]  # the kernel backend's tests run fp16 too
H, G, P, N = 16, 2, L.HEAD_DIM, L.STATE_DIM


# -- schemas --------------------------------------------------------------------------------

CACHE_W = (
    "Tensor conv, Tensor(a!) checkpoint, Tensor(b!) x_ring, Tensor(c!) dt_ring, Tensor(d!) b_ring, "
    "Tensor(e!)? read_copy, Tensor(f!)? scales, Tensor(g!)? meta, Tensor(h!)? parity, Tensor(i!) positions"
)
CACHE_R = (
    "Tensor conv, Tensor checkpoint, Tensor x_ring, Tensor dt_ring, Tensor b_ring, "
    "Tensor? read_copy, Tensor? scales, Tensor? meta, Tensor? parity, Tensor positions"
)
EXPECTED_SCHEMAS = {
    "initialize": f"replayssm::initialize({CACHE_W}, Tensor states, Tensor state_indices, *, "
    "str state_dtype, int seed, str backend, int head_offset=0) -> ()",
    "clear": "replayssm::clear(Tensor conv, Tensor checkpoint, Tensor(a!) x_ring, Tensor(b!) dt_ring, "
    "Tensor(c!) b_ring, Tensor? read_copy, Tensor? scales, Tensor? meta, Tensor? parity, Tensor(d!) positions, "
    "Tensor state_indices, *, str backend) -> ()",
    "decode": f"replayssm::decode({CACHE_W}, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, "
    "Tensor dt_bias, Tensor state_indices, Tensor(j!) out, *, str state_dtype, int seed, str backend, "
    "int scratch, int head_offset=0) -> ()",
    "materialize": f"replayssm::materialize({CACHE_R}, Tensor state_indices, Tensor A, *, str backend) -> Tensor",
    "decode_pending": f"replayssm::decode_pending({CACHE_W}, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
    "Tensor D, Tensor dt_bias, Tensor state_indices, Tensor(j!) out, Tensor? num_accepted_tokens, "
    "Tensor? cu_seqlens, *, str state_dtype, int seed, str backend, int max_seqlen, int head_offset=0) -> ()",
    "materialize_pending": f"replayssm::materialize_pending({CACHE_R}, Tensor state_indices, Tensor A, *, "
    "str backend, int max_seqlen) -> Tensor",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_registered_schema_marks_exactly_what_the_op_writes(name):
    assert str(getattr(torch.ops.replayssm, name).default._schema) == EXPECTED_SCHEMAS[name]


# -- one small world for the op-level tests ------------------------------------------------


def _world(fmt, seed=0, heads=8, groups=1, slots=5):
    """A prefilled cache (slots 1..3 live; slot 1 at ring index 15, so a decode flushes it,
    slot 2 at index 3), normalized decode inputs for the rows [1, 0, 2, 3, 9] (two padding
    rows), prefill states and ids."""
    g = torch.Generator().manual_seed(seed)
    p = layer_params(heads, generator=g)
    cache = allocate_cache(slots, heads, groups, fmt)
    live = torch.tensor([1, 2, 3], dtype=torch.int32)
    REFERENCE.initialize(cache, prefill_states(p, 3, groups, 4, generator=g), live, fmt=format_of(fmt), seed=seed)
    ids = torch.tensor([1, 0, 2, 3, 9], dtype=torch.int32)
    for pos_of_slot1 in range(15):  # real ring entries below each slot's position
        tok = token(2, heads, groups, generator=g)
        ids12 = torch.tensor([1, 2] if pos_of_slot1 < 3 else [1], dtype=torch.int32)
        n = ids12.numel()
        out = torch.empty(n, heads, P, dtype=torch.bfloat16)
        REFERENCE.decode(cache, tok.x[:n], tok.dt[:n], p.A, tok.B[:n], tok.C[:n], p.D[:, None].expand(heads, P),
                         p.dt_bias, ids12, out, fmt=format_of(fmt), seed=seed)
    assert cache[L.POSITIONS][1:4].tolist() == [15, 3, 0]
    tok = token(ids.numel(), heads, groups, generator=g)
    norm = normalize_decode_inputs(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, ids.numel(), heads, groups)
    states = prefill_states(p, ids.numel(), groups, 2, generator=g)
    return cache, norm, ids, states, p.A


def _op_args(name, fmt, backend="reference"):
    cache, norm, ids, states, A = _world(fmt)
    c = ops.cache_args(cache)
    out = torch.full((ids.numel(), cache[L.CHECKPOINT].shape[1], P), float("nan"), dtype=torch.bfloat16)
    if name == "initialize":
        return ops._initialize_op, (*c, states, ids), dict(state_dtype=fmt, seed=7, backend=backend)
    if name == "clear":
        return ops._clear_op, (*c, ids), dict(backend=backend)
    if name == "decode":
        return ops._decode_op, (*c, *norm, ids, out), dict(state_dtype=fmt, seed=7, backend=backend, scratch=0)
    return ops._materialize_op, (*c, ids, A), dict(backend=backend)


OPS = ["initialize", "clear", "decode", "materialize"]


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


@pytest.fixture
def fp8_allclose(monkeypatch):
    """opcheck's schema check (SchemaCheckMode) tells a mutated argument by
    `torch.allclose(before, after, equal_nan=True)`, which has no Float8_e4m3fn kernel
    in torch 2.13 ("mul_cpu_reduced_float" not implemented): compare FP8 tensors by
    their bytes instead, everything else as before."""
    allclose = torch.allclose

    def patched(a, b, *args, **kwargs):
        if a.dtype in FLOAT8 and b.dtype == a.dtype:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", patched)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, fmt, fp8_allclose):
    """Schema (mutations as annotated, nothing else), autograd registration, fake tensor
    (outputs' shapes, dtypes, strides) and AOT dispatch (static and dynamic shapes: the
    results and the mutated cache tensors equal eager's) checks."""
    op, args, kwargs = _op_args(name, fmt)
    result = torch.library.opcheck(
        op, args, kwargs,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"),
    )
    assert set(result.values()) == {"SUCCESS"}, result
    # opcheck skips the autograd registration check when no input requires grad: give it
    # one (A for decode and materialize, the prefill states for initialize; clear reads
    # no float input).
    if name != "clear":
        grad_arg = {"initialize": 10, "decode": 12, "materialize": 11}[name]
        args = list(args)
        args[grad_arg] = args[grad_arg].clone().requires_grad_()
        result = torch.library.opcheck(op, tuple(args), kwargs, test_utils="test_autograd_registration")
        assert result == {"test_autograd_registration": "SUCCESS"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["initialize", "clear", "decode"])
def test_opcheck_kernel_backend_in_the_interpreter(name, fmt, fp8_allclose):
    """The same checks with the kernel backend (on the CPU: its Triton kernels interpreted)."""
    op, args, kwargs = _op_args(name, fmt, backend="kernels")
    result = torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_aot_dispatch_static"))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", OPS)
def test_op_equals_the_backend_called_directly(name, fmt):
    """Each op runs its backend method on the caller's tuple, bit for bit, and writes
    nothing the schema does not name."""
    op, args, kwargs = _op_args(name, fmt)
    cache, norm, ids, states, A = _world(fmt)
    want = snapshot(cache)
    nvfp4 = fmt == "nvfp4"
    got = op(*args, **kwargs)
    c_args = args[:10]
    got_cache = [t for t in c_args if t is not None]
    if name == "initialize":
        REFERENCE.initialize(want, states, ids, fmt=(NVFP4 if nvfp4 else FP8), seed=7)
    elif name == "clear":
        REFERENCE.clear(want, ids)
    elif name == "decode":
        out = torch.full_like(args[-1], float("nan"))
        REFERENCE.decode(want, *norm, ids, out.view(ids.numel(), -1, P), fmt=(NVFP4 if nvfp4 else FP8), seed=7)
        assert got is None and same_bits(args[-1], out)
    else:
        assert same_bits(got, REFERENCE.materialize(want, ids, A))
    assert_cache_equal(want, got_cache)
    written = {name_ for (name_, _), a, b in zip(ops.CACHE_ARGS, ops.cache_args(snapshot(cache)), c_args)
               if a is not None and not same_bits(a, b)}
    assert written <= ops.WRITES[name]
    if name != "materialize":
        assert written, "the world is built so that every writing op changes the cache"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("device", ["fake", "meta"])
def test_fake_outputs(name, fmt, device):
    """Fake (meta) implementations: materialize gives FP32 [n, heads, 64, 128] like the real
    op (shape, dtype, strides), the other ops nothing; fake runs leave the real cache as is."""
    op, args, kwargs = _op_args(name, fmt)
    real_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    real = op(*real_args, **kwargs)
    if device == "fake":
        with FakeTensorMode() as mode:
            fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            got = op(*fargs, **kwargs)
    else:
        got = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    if name == "materialize":
        heads = args[1].shape[1]
        assert (tuple(got.shape), got.dtype) == ((args[10].numel(), heads, P, N), torch.float32)
        assert (got.shape, got.dtype, got.stride()) == (real.shape, real.dtype, real.stride())
        assert got.device.type == ("cpu" if device == "fake" else "meta")
    else:
        assert got is None and real is None
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert same_bits(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_step_from_inputs_that_require_grad_leaves_no_autograd_history(fmt):
    """A from a parameter (requires grad, grad mode on): the cache and `out` get the
    reference's bits and no autograd history (the ops run their backend under no_grad;
    the reference called directly would leave NVFP4's meta and `out` attached to A)."""
    cache, norm, ids, _, _ = _world(fmt)
    want = snapshot(cache)
    A = norm[2].clone().requires_grad_()
    out, out_want = (torch.empty(ids.numel(), 8, P, dtype=torch.bfloat16) for _ in range(2))
    selective_state_update_replayssm(cache, *norm[:2], A, *norm[3:], ids, out, state_dtype=fmt, backend="reference")
    assert not any(t.requires_grad for t in cache) and not out.requires_grad
    with torch.no_grad():
        REFERENCE.decode(want, *norm, ids, out_want, fmt=format_of(fmt), seed=0)
    assert same_bits(out, out_want)
    assert_cache_equal(want, cache)


# -- pending mode: replayssm::decode_pending and ::materialize_pending ------------------------

PENDING_M = 3  # max_seqlen of the pending world (fold grid 14)


def _pending_world(fmt, seed=0, heads=8, groups=1, slots=5):
    """A pending cache (max_seqlen 3, fold grid 14): slots 1..3 live at (c, q) = (12, 3),
    (4, 3), (0, 3), so that accepting slot 1's drafts at the next call folds it. Returns the cache, dense and varlen normalized
    inputs for the rows [1, 0, 2, 3, 9] (two padding rows), the verdicts, cu_seqlens and A."""
    from replayssm.pending import pending_decode

    g = torch.Generator().manual_seed(seed)
    p = layer_params(heads, generator=g)
    cache = allocate_cache(slots, heads, groups, fmt, pending=True)
    live = torch.tensor([1, 2, 3], dtype=torch.int32)
    REFERENCE.initialize(cache, prefill_states(p, 3, groups, 4, generator=g), live, fmt=format_of(fmt), seed=seed)

    def tokens(n, lead):
        x = torch.randn(*lead, heads, P, generator=g).to(torch.bfloat16)
        dt = (0.5 * torch.randn(*lead, heads, generator=g)).float()
        B, C = (torch.randn(*lead, groups, N, generator=g).to(torch.bfloat16) for _ in range(2))
        return x, dt, B, C

    for _ in range(5):
        x, dt, B, C = tokens(3, (3, PENDING_M))
        out = torch.empty(3, PENDING_M, heads, P, dtype=torch.bfloat16)
        pending_decode(cache, x, dt, p.A, B, C, p.D, p.dt_bias, live, out, fmt=format_of(fmt), seed=seed,
                       max_seqlen=PENDING_M, num_accepted_tokens=torch.tensor([3, 1, 0], dtype=torch.int32))
    assert cache[L.POSITIONS][1:4].tolist() == [[12, 3], [4, 3], [0, 3]]
    ids = torch.tensor([1, 0, 2, 3, 9], dtype=torch.int32)
    accepted = torch.tensor([3, 2, 1, 0, 5], dtype=torch.int32)  # slot 1: c 12 -> 15 crosses the grid point 14
    D = p.D[:, None].expand(heads, P).float()
    dense = (*tokens(5, (5, PENDING_M)),)
    dense = (dense[0], dense[1], p.A, dense[2], dense[3], D, p.dt_bias)
    cu = torch.tensor([0, 3, 4, 6, 6, 7], dtype=torch.int32)
    var = (*tokens(7, (7,)),)
    var = (var[0], var[1], p.A, var[2], var[3], D, p.dt_bias)
    return cache, dense, var, ids, accepted, cu, p.A


def _pending_op_args(name, fmt, layout="dense", backend="reference"):
    cache, dense, var, ids, accepted, cu, A = _pending_world(fmt)
    c = ops.cache_args(cache)
    if name == "materialize_pending":
        return ops._materialize_pending_op, (*c, ids, A), dict(backend=backend, max_seqlen=PENDING_M)
    heads = cache[L.CHECKPOINT].shape[1]
    if layout == "dense":
        out = torch.full((ids.numel(), PENDING_M, heads, P), float("nan"), dtype=torch.bfloat16)
        args = (*c, *dense, ids, out, accepted, None)
    else:
        out = torch.full((int(cu[-1]), heads, P), float("nan"), dtype=torch.bfloat16)
        args = (*c, *var, ids, out, accepted, cu)
    return ops._decode_pending_op, args, dict(state_dtype=fmt, seed=7, backend=backend, max_seqlen=PENDING_M)


PENDING_OPS = [
    pytest.param("decode_pending", "dense", id="decode-dense"),
    pytest.param("decode_pending", "varlen", id="decode-varlen"),
    pytest.param("materialize_pending", "dense", id="materialize"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,layout", PENDING_OPS)
def test_opcheck_pending(name, layout, fmt, fp8_allclose):
    """The pending-mode ops: schema (mutations as annotated), fake tensor, AOT dispatch
    (static and dynamic shapes) and autograd registration checks, dense and varlen."""
    op, args, kwargs = _pending_op_args(name, fmt, layout)
    result = torch.library.opcheck(
        op, args, kwargs,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"),
    )
    assert set(result.values()) == {"SUCCESS"}, result
    args = list(args)
    i_A = 12 if name == "decode_pending" else 11
    args[i_A] = args[i_A].clone().requires_grad_()
    result = torch.library.opcheck(op, tuple(args), kwargs, test_utils="test_autograd_registration")
    assert result == {"test_autograd_registration": "SUCCESS"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,layout", PENDING_OPS)
def test_pending_op_equals_the_reference(name, layout, fmt):
    """Each pending op runs `replayssm.pending` on the caller's tuple, bit for bit, and
    writes nothing its schema does not name; the decode call folds slot 1."""
    from replayssm import pending

    op, args, kwargs = _pending_op_args(name, fmt, layout)
    cache, dense, var, ids, accepted, cu, A = _pending_world(fmt)
    want = snapshot(cache)
    got = op(*args, **kwargs)
    got_cache = [t for t in args[:10] if t is not None]
    if name == "decode_pending":
        out = torch.full_like(args[18], float("nan"))
        inputs = dense if layout == "dense" else var
        pending.pending_decode(want, *inputs, ids, out, fmt=format_of(fmt), seed=7, max_seqlen=PENDING_M,
                               num_accepted_tokens=accepted, cu_seqlens=None if layout == "dense" else cu)
        assert got is None and same_bits(args[18], out)
        assert not same_bits(want[L.CHECKPOINT][1], cache[L.CHECKPOINT][1])  # slot 1 folded
    else:
        assert same_bits(got, pending.pending_materialize(want, ids, A, max_seqlen=PENDING_M))
    assert_cache_equal(want, got_cache)
    written = {n for (n, _), a, b in zip(ops.CACHE_ARGS, ops.cache_args(snapshot(cache)), args[:10])
               if a is not None and not same_bits(a, b)}
    assert written <= ops.WRITES[name]
    if name == "decode_pending":
        assert {"checkpoint", "x_ring", "read_copy", "positions"} <= written


# -- scalars and scratch --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", [2**63 + 11, 2**64 + 5, -3], ids=["above-int64", "above-2^64", "negative"])
def test_any_python_int_seed_gives_the_references_bits(fmt, seed):
    """Seeds the schema's int64 cannot hold are passed mod 2**64 (as the random streams
    take them): initialize and a flushing decode equal the reference called with the seed."""
    cache, norm, ids, states, _ = _world(fmt)
    want = snapshot(cache)
    initialize_replayssm_state(cache, states[:2], ids[2:4], state_dtype=fmt, seed=seed, backend="reference")
    REFERENCE.initialize(want, states[:2], ids[2:4], fmt=format_of(fmt), seed=seed)
    assert_cache_equal(want, cache)
    out, out_want = (torch.empty(ids.numel(), 8, P, dtype=torch.bfloat16) for _ in range(2))
    selective_state_update_replayssm(cache, *norm, ids, out, state_dtype=fmt, seed=seed, backend="reference")
    REFERENCE.decode(want, *norm, ids, out_want, fmt=format_of(fmt), seed=seed)
    assert same_bits(out, out_want)
    assert_cache_equal(want, cache)


def test_scratch_handles_follow_the_scratch_lifetime():
    class Scratch:  # what the registry needs of a PlanScratch: identity and a weak reference
        rows = 8

    a, b = Scratch(), Scratch()
    ha, hb = ops.register_scratch(a), ops.register_scratch(b)
    assert ha != hb and ops.scratch_handle(a) == ha and ops.register_scratch(a) == ha
    assert ops.scratch_handle(None) == 0 and ops._SCRATCH[ha] is a
    del a
    assert ha not in ops._SCRATCH and hb in ops._SCRATCH
    assert ops.scratch_handle(b) == hb


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_decode_op_fills_the_scratch_it_is_given(fmt):
    """Kernel backend (GPU): the plan of a decode through the functional API lands in the
    caller's scratch, bit-equal to the reference plan, and the positions advance as the
    reference's (the GPU decode tests bound the outputs)."""
    pytest.importorskip("cutlass")
    from replayssm import layout as L
    from replayssm.kernels.buffers import PlanScratch

    cache, norm, ids, _, _ = _world(fmt)
    want = snapshot(cache)
    cache, norm, ids = [t.cuda() for t in cache], [t.cuda() for t in norm], ids.cuda()
    scratch = PlanScratch(8, "cuda")
    scratch.buffers.slot.fill_(-1)
    out, out_want = torch.empty(ids.numel(), 8, P, dtype=torch.bfloat16, device="cuda"), torch.empty(ids.numel(), 8, P, dtype=torch.bfloat16)
    selective_state_update_replayssm(cache, *norm, ids, out, state_dtype=fmt, seed=1, backend="kernels", scratch=scratch)
    plan = ref.prepare_decode(want, ids.cpu(), out_want, fmt=format_of(fmt), seed=1)
    for got_t, want_t in zip(scratch.plan(ids.numel()), plan):
        assert torch.equal(got_t.cpu(), want_t)
    assert torch.equal(cache[L.POSITIONS].cpu(), want[L.POSITIONS])


# -- torch.compile of a Mamba-2-like layer ---------------------------------------------------


class Mixer(torch.nn.Module):
    """The decode step of a Mamba-2 mixer as serving engines shape it: one bf16 projection
    whose column slices are x, B, C and dt (row stride = projection width), dt and the
    per-head parameters broadcast with stride-0 views, then the output projection."""

    def __init__(self, cache: ReplaySSMCache, d_model: int = 64, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        p = layer_params(H, generator=g)
        device = cache.device
        width = H * P + 2 * G * N + H
        self.cache = cache
        self.in_proj = torch.nn.Linear(d_model, width, bias=False, dtype=torch.bfloat16, device=device)
        self.out_proj = torch.nn.Linear(H * P, d_model, bias=False, dtype=torch.bfloat16, device=device)
        self.in_proj.weight.data.copy_(torch.randn(width, d_model, generator=g) * d_model**-0.5)
        self.out_proj.weight.data.copy_(torch.randn(d_model, H * P, generator=g) * (H * P) ** -0.5)
        self.register_buffer("A", p.A.to(device))
        self.register_buffer("D", p.D.to(device))
        self.register_buffer("dt_bias", p.dt_bias.to(device))

    def forward(self, hidden, slots, out=None):
        n = hidden.shape[0]
        x, B, C, dt = torch.split(self.in_proj(hidden), [H * P, G * N, G * N, H], dim=-1)
        y = self.cache.decode(
            x.view(n, H, P), dt[:, :, None].expand(n, H, P), self.A[:, None, None].expand(H, P, N),
            B.view(n, G, N), C.view(n, G, N), self.D[:, None].expand(H, P), self.dt_bias[:, None].expand(H, P),
            slots, out=out,
        )
        return self.out_proj(y.view(n, H * P)), y


class Twin:
    """A layer and its cache with three live slots at positions 0, 9 and 15 (slot c flushes
    at the first step, b at the 7th, a at the 16th, c again at the 17th) and a batch
    [a, 0, b, num_slots, c] with two padding rows. Built twice from the same seeds, two
    twins hold the same bits."""

    def __init__(self, fmt, device="cpu", backend="reference", seed=0, slot_padding=0):
        self.device = device
        self.cache = ReplaySSMCache(6, H, G, fmt, device, seed=seed + 3, backend=backend, slot_padding=slot_padding)
        self.layer = Mixer(self.cache, seed=seed)
        self.gen = torch.Generator().manual_seed(seed + 1)
        a, b, c = self.cache.allocate(3).tolist()
        p = layer_params(H, generator=self.gen)
        states = prefill_states(p, 3, G, 8, generator=self.gen).to(device)
        self.cache.prefill_init(states, torch.tensor([a, b, c], device=device))
        with torch.no_grad():
            for slot, steps in ((b, 9), (c, 15)):
                for _ in range(steps):
                    self.layer(self.hidden(1), torch.tensor([slot], dtype=torch.int32, device=device))
        self.ids = torch.tensor([a, 0, b, 6, c], dtype=torch.int32, device=device)
        assert self.cache.positions[self.ids.long() % 6].tolist() == [0, 0, 9, 0, 15]

    def hidden(self, n):
        return torch.randn(n, 64, generator=self.gen).to(self.device, torch.bfloat16)


def _compare_steps(fmt, compile_backend, out_given, device="cpu", backend="reference", steps=20, slot_padding=0):
    """`steps` compiled steps (fullgraph) against eager ones on a twin: every output and
    every cache tensor bit-identical after every step; one compiled graph serves them all."""
    torch._dynamo.reset()
    eager, comp = (Twin(fmt, device, backend, slot_padding=slot_padding) for _ in range(2))
    assert_cache_equal(eager.cache.tensors, comp.cache.tensors)
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(comp.layer, fullgraph=True, backend=counter)
    n = eager.ids.numel()
    outs = [torch.full((n, H, P), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(2)]
    with torch.no_grad():
        for step in range(steps):
            h = eager.hidden(n)
            assert same_bits(h, comp.hidden(n))
            ye, oe = eager.layer(h, eager.ids, outs[0] if out_given else None)
            yc, oc = compiled(h, comp.ids, outs[1] if out_given else None)
            assert same_bits(ye, yc) and same_bits(oe, oc), f"step {step}: outputs differ"
            if out_given:
                assert oc.data_ptr() == outs[1].data_ptr()
            assert_cache_equal(eager.cache.tensors, comp.cache.tensors)
            assert oc[1].abs().sum() == 0 and oc[3].abs().sum() == 0  # padding rows
    assert comp.cache.positions[comp.ids.long() % 6].tolist() == [steps, 0, 9 + steps, 0, 15 + steps]
    assert counter.frame_count == 1  # positions live on the device: no recompiles
    if backend == "kernels" and device != "cpu":  # the last step's plan is in the cache's own scratch
        assert comp.cache._scratch.buffers.slot[:n].tolist() == [int(s) if 0 < s < 6 else 0 for s in comp.ids.tolist()]
    # The compiled layer's A is what materialize uses afterwards, as after eager steps.
    live = comp.ids[[0, 2, 4]]
    assert same_bits(comp.cache.materialize(live), eager.cache.materialize(live))
    decodes = [n for g in counter.graphs for n in g.graph.nodes if str(n.target) == "replayssm.decode.default"]
    assert len(counter.graphs) == 1 and len(decodes) == 1  # one opaque op in the one graph


@pytest.mark.parametrize("out_given", [True, False], ids=["out", "no-out"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_layer_matches_eager_bit_for_bit(fmt, compile_backend, out_given):
    _compare_steps(fmt, compile_backend, out_given)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_compiled_layer_on_the_kernel_backend_matches_eager(fmt):
    """The kernel backend on the CPU (Triton prepare kernel interpreted, the reference's
    decode math fed its plan), compiled through functionalization (aot_eager: the op gets
    copies of the cache): same bits as eager, and the step finds the cache's own plan
    scratch through its handle."""
    _compare_steps(fmt, "aot_eager", True, backend="kernels")


@pytest.mark.parametrize(
    "compile_backend",
    [
        "eager",
        pytest.param(
            "aot_eager",
            marks=pytest.mark.xfail(
                raises=torch._dynamo.exc.BackendCompilerFailed, strict=True,
                reason="torch 2.13 AOTAutograd: 'does not yet handle input mutations on views with different "
                "dtypes' (the cache tensors are views of one byte page per slot); Inductor likewise",
            ),
        ),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_layer_with_a_page_carved_cache(fmt, compile_backend):
    """A cache carved from one byte page per slot (slot_padding > 0, as serving engines
    lay it out): dynamo alone (backend="eager") compiles the layer fullgraph and matches
    eager bit for bit; backends that functionalize (aot_eager, Inductor) are refused by
    torch, since the mutated cache tensors are views of one storage with different dtypes."""
    _compare_steps(fmt, compile_backend, True, slot_padding=64)


@pytest.mark.slow
@pytest.mark.parametrize("out_given", [True, False], ids=["out", "no-out"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_inductor_compiled_layer_matches_eager_bit_for_bit(fmt, out_given):
    """The default backend (Inductor, C++ on the CPU)."""
    _compare_steps(fmt, "inductor", out_given)


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_pending_decode_matches_eager_bit_for_bit(fmt, compile_backend):
    """`ReplaySSMCache(spec_tokens=2).decode` in pending mode, dense and varlen (rows of 0..3
    tokens, padding rows, random verdicts, folds), compiled with fullgraph=True: every
    output and cache tensor equals the eager twin's after every step; one graph a layout,
    each holding one replayssm.decode_pending op."""
    torch._dynamo.reset()
    heads, groups, M = 8, 1, 3
    twins = [ReplaySSMCache(6, heads, groups, fmt, "cpu", seed=3, spec_tokens=M - 1, backend="reference") for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    p = layer_params(heads, generator=g)
    states = prefill_states(p, 3, groups, 4, generator=g)
    for c in twins:
        c.prefill_init(states, c.allocate(3))
    ids = torch.tensor([1, 0, 2, 3, 7], dtype=torch.int32)

    def step(cache, x, dt, B, C, acc, cu):
        return cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, num_accepted_tokens=acc, cu_seqlens=cu)

    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    lens_cycle = [[3, 1, 0, 2, 3], [1, 3, 2, 0, 3], [2, 2, 3, 1, 1]]  # 9 tokens each
    with torch.no_grad():
        for i in range(12):
            varlen = i % 2 == 1
            lead = (9,) if varlen else (5, M)
            x = torch.randn(*lead, heads, P, generator=g).to(torch.bfloat16)
            dt = 0.5 * torch.randn(*lead, heads, generator=g)
            B, C = (torch.randn(*lead, groups, N, generator=g).to(torch.bfloat16) for _ in range(2))
            acc = torch.randint(-1, M + 2, (5,), generator=g, dtype=torch.int32)
            cu = torch.tensor([0, *lens_cycle[i % 3]], dtype=torch.int32).cumsum(0).to(torch.int32) if varlen else None
            ye = step(twins[0], x, dt, B, C, acc, cu)
            yc = compiled(twins[1], x, dt, B, C, acc, cu)
            assert same_bits(ye, yc), f"step {i}: outputs differ"
            assert_cache_equal(twins[0].tensors, twins[1].tensors)
    assert max(twins[1].positions[1:4, 0].tolist()) >= grid(PENDING_M)  # past the fold grid: folds ran
    assert counter.frame_count == 2  # dense and varlen
    pend = [n for gr in counter.graphs for n in gr.graph.nodes if str(n.target) == "replayssm.decode_pending.default"]
    assert len(counter.graphs) == 2 and len(pend) == 2


def _split_top_level(args: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in args:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch in "(["
        depth -= ch in ")]"
        cur += ch
    return parts + [cur.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_inductor_calls_the_decode_op_in_place_on_the_cache(fmt):
    """With `out` given, Inductor's code calls replayssm.decode once, on the graph inputs
    themselves (the cache tensors and `out`): functionalization's copies are all
    re-inplaced, so the compiled step adds no allocation and no copy around the op."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    twin = Twin(fmt)
    out = torch.empty(twin.ids.numel(), H, P, dtype=torch.bfloat16)
    compiled = torch.compile(twin.layer, fullgraph=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, twin.hidden(5), twin.ids, out)
    body = "\n".join(codes).split("def call(")[1]
    calls = re.findall(r"torch\.ops\.replayssm\.decode\.default\((.*)\)\n", body)
    assert len(calls) == 1, body
    args = _split_top_level(calls[0])
    cache_in = args[:10]
    want_none = 0 if fmt == "nvfp4" else 2
    assert cache_in.count("None") == want_none
    assert all(re.fullmatch(r"arg\d+_1", a) for a in cache_in if a != "None"), cache_in
    assert re.fullmatch(r"arg\d+_1", args[18]), args[18]  # out: the caller's tensor
    assert not re.search(r"\.copy_\(|clone|aten\.copy", body), body


def test_explain_finds_one_graph_and_no_break():
    torch._dynamo.reset()
    twin = Twin("nvfp4")
    out = torch.empty(5, H, P, dtype=torch.bfloat16)
    with torch.no_grad():
        explained = torch._dynamo.explain(twin.layer)(twin.hidden(5), twin.ids, out)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    ops_seen = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops_seen.count("replayssm.decode.default") == 1, ops_seen


@pytest.mark.parametrize("fmt", FORMATS)
def test_debug_checks_stay_eager_and_do_not_break_the_graph(fmt, monkeypatch):
    """REPLAYSSM_DEBUG=1: eager decode still rejects an unallocated slot; a compiled
    decode (fullgraph) traces without the host checks and matches eager."""
    monkeypatch.setenv("REPLAYSSM_DEBUG", "1")
    torch._dynamo.reset()
    eager, comp = Twin(fmt), Twin(fmt)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"slots must be allocated"):
            eager.layer(eager.hidden(1), torch.tensor([5], dtype=torch.int32))
        comp.hidden(1)  # keep the twins' generators in step
        compiled = torch.compile(comp.layer, fullgraph=True, backend="eager")
        h = eager.hidden(5)
        comp.hidden(5)
        assert same_bits(eager.layer(h, eager.ids)[1], compiled(h, comp.ids)[1])
    assert_cache_equal(eager.cache.tensors, comp.cache.tensors)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_functional_api_matches_eager(fmt):
    """The functional entry points compile too (fullgraph): decode, then materialize."""
    torch._dynamo.reset()
    worlds = [_world(fmt), _world(fmt)]

    def step(cache, x, dt, A, B, C, D, dt_bias, ids, out):
        selective_state_update_replayssm(cache, x, dt, A, B, C, D, dt_bias, ids, out, state_dtype=fmt, seed=4,
                                         backend="reference")
        return materialize_replayssm_state(cache, ids, A, state_dtype=fmt, backend="reference")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn, (cache, norm, ids, _, _) in zip((step, compiled), worlds):
        out = torch.empty(ids.numel(), 8, P, dtype=torch.bfloat16)
        results.append((fn(cache, *norm, ids, out), out, cache))
    (se, oe, ce), (sc, oc, cc) = results
    assert same_bits(se, sc) and same_bits(oe, oc)
    assert_cache_equal(ce, cc)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_rejection_names_the_argument_and_writes_nothing(fmt):
    """Validation runs at trace time, before the op: a rejected compiled call (not
    fullgraph) raises the eager ValueError and leaves the cache untouched."""
    torch._dynamo.reset()
    cache, norm, ids, _, _ = _world(fmt)
    before = snapshot(cache)

    def step(x):
        out = torch.empty(ids.numel(), 8, P, dtype=torch.bfloat16)
        return selective_state_update_replayssm(cache, x, *norm[1:], ids, out, state_dtype=fmt, backend="reference")

    with pytest.raises(ValueError, match=r"^x must be bfloat16"):
        torch.compile(step, backend="aot_eager")(norm[0].float())
    assert_cache_equal(before, cache)


# -- the same on the GPU, with the kernel backend --------------------------------------------

NEEDS_CUTE = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (pip install -e '.[cute]')"
)



@pytest.mark.parametrize("out_given", [True, False], ids=["out", "no-out"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.gpu
@NEEDS_CUTE
def test_gpu_compiled_layer_matches_eager_bit_for_bit(fmt, compile_backend, out_given):
    """CUDA, kernel backend (prepare + CuTe decode kernels inside the op): compiled steps
    equal eager ones bit for bit over 20 steps crossing flushes."""
    _compare_steps(fmt, compile_backend, out_given, device="cuda", backend="kernels")


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.gpu
@NEEDS_CUTE
def test_gpu_compiled_decode_neither_allocates_nor_synchronizes(fmt):
    """Inductor-compiled `ReplaySSMCache.decode` with `out` given and inputs already in the
    kernels' layout: no CUDA allocation (the caching allocator's count) and no host
    synchronization (sync debug mode "error") in a step, as eager; same bits as eager."""
    torch._dynamo.reset()
    eager, comp = Twin(fmt, "cuda", "kernels"), Twin(fmt, "cuda", "kernels")
    n = eager.ids.numel()
    g = torch.Generator().manual_seed(5)
    p = layer_params(H, generator=g, device="cuda")
    D = p.D[:, None].expand(H, P).contiguous()

    def step(cache, x, dt, B, C, ids, out):
        return cache.decode(x, dt, p.A, B, C, D, p.dt_bias, ids, out=out)

    compiled = torch.compile(step, fullgraph=True)
    outs = [torch.empty(n, H, P, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    with torch.no_grad():
        for i in range(20):
            tok = token(n, H, G, generator=g, device="cuda")
            counts = []
            for fn, twin, out in ((step, eager, outs[0]), (compiled, comp, outs[1])):
                fn(twin.cache, tok.x, tok.dt, tok.B, tok.C, twin.ids, out)  # i == 0: compiles, loads the modules
                torch.cuda.synchronize()
                before = torch.cuda.memory_stats()["allocation.all.allocated"]
                if i:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    fn(twin.cache, tok.x, tok.dt, tok.B, tok.C, twin.ids, out)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
                counts.append(torch.cuda.memory_stats()["allocation.all.allocated"] - before)
            assert counts == [0, 0], f"step {i}: allocations (eager, compiled) {counts}"
            assert same_bits(outs[0], outs[1])
            assert_cache_equal(eager.cache.tensors, comp.cache.tensors)


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compiled_fp16_layer_matches_eager_bit_for_bit(compile_backend):
    """state_dtype="fp16" (no read copy: the ops' read copy and scales arguments are
    None): the compiled layer's steps equal the eager ones bit for bit, one graph."""
    _compare_steps("fp16", compile_backend, True)
