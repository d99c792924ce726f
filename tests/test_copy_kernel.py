"""The one-launch copy (kernels/triton/copy_slots.py; replayssm.copy_slots over layers,
ReplaySSMCache.copy_slots / fork, copy_replayssm_slots) against per-tensor index copies,
bit for bit: every per-slot tensor of every dst slot equals its src slot's bits as they
were before the copy, every other slot and the conv state keep theirs. Caches hold random
bits (NaN and Inf patterns included), so a copy that went through a float register or
skipped a byte would show. CPU: the Triton interpreter (tiny shapes: 8 heads, 1 group);
`gpu` tests: compiled, in a CUDA graph, 16 heads / 2 groups."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

import replayssm
from replayssm import ReplaySSMCache, allocate_cache, copy_replayssm_slots, handoff
from replayssm import layout as L
from replayssm.kernels.triton import copy_slots as K
from tests.helpers import assert_cache_equal, same_bits, snapshot

FMTS = ["fp8", "nvfp4", "fp16"]
# The CPU tests run the kernel in the Triton interpreter, which conftest.py turns on only
# where no GPU is present; on a GPU machine the `gpu` tests run it compiled.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="runs the copy kernel on CPU tensors in the Triton interpreter"
)


def randomize(tensors, gen, device="cpu"):
    """Random bits in every tensor (through integer views: any pattern, NaN included)."""
    for t in tensors:
        b = handoff.as_bits(t)
        lo, hi = (0, 256) if b.dtype == torch.uint8 else (-(2**15), 2**15)
        b.copy_(torch.randint(lo, hi, b.shape, generator=gen).to(device, b.dtype))


def expected_after(before, src, dst, first=1):
    """`before` (bit copies of cache tensors) with rows dst[i] <- before rows src[i] for
    tensors first..; padding pairs (an id <= 0 or >= slots) skipped."""
    want = [t.clone() for t in before]
    for i in range(first, len(want)):
        slots = want[i].shape[0]
        for s, d in zip(src, dst):
            if 0 < s < slots and 0 < d < slots:
                want[i][d] = before[i][s]
    return want


def count_launches(monkeypatch):
    """Count launches of the copy kernel and calls of the per-tensor path."""
    calls = {"kernel": 0, "per_tensor": 0}
    launch, per_tensor = K.copy_slots, handoff.copy_rows

    def kernel(*a, **k):
        calls["kernel"] += 1
        return launch(*a, **k)

    def torch_copy(*a, **k):
        calls["per_tensor"] += 1
        return per_tensor(*a, **k)

    monkeypatch.setattr(K, "copy_slots", kernel)
    monkeypatch.setattr(handoff, "copy_rows", torch_copy)
    return calls


# ---------------------------------------------------------------------------------------
# The table


def test_table_rows_pick_the_widest_access_and_split_tails():
    """Rows (address of the chunk in slot 0, slot stride, bytes, width) of crafted tensors:
    a 16-byte-aligned body goes at width 16 in chunks, its tail (< 16 bytes) at width 4;
    an int32 tensor with a 4-byte stride, width 4; a byte tensor at an odd address, width
    1; a tensor whose slot is < 16 bytes in a 16-byte page, one width-4 row."""
    page = torch.zeros(4, 128, dtype=torch.uint8)  # slot stride 128 bytes
    dense = torch.zeros(4, 40, dtype=torch.float16)  # 80 bytes a slot, stride 80
    body_tail = page[:, 0:20].view(torch.float32)  # 20 bytes: 16 + 4
    small = page[:, 32:44].view(torch.float32)  # 12 bytes
    odd = page[:, 49:56]  # 7 bytes at an odd address
    pos = torch.zeros(4, dtype=torch.int32)
    base = page.data_ptr()
    assert base % 16 == 0 and dense.data_ptr() % 16 == 0
    rows = K.table_rows([dense, body_tail, small, odd, pos], chunk=32)
    d = dense.data_ptr()
    assert rows == [
        (d, 80, 32, 16), (d + 32, 80, 32, 16), (d + 64, 80, 16, 16),
        (base, 128, 16, 16), (base + 16, 128, 4, 4),
        (base + 32, 128, 12, 4),
        (base + 49, 128, 7, 1),
        (pos.data_ptr(), 4, 4, 4),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 16"):
        K.table_rows([dense], chunk=24)


DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [32, None], ids=["chunk32", "default-chunk"])
def test_kernel_copies_every_width_bit_for_bit(chunk, device):
    """The kernel on the crafted tensors of every width (interpreted on the CPU, compiled
    on a GPU): pairs with padding ids (0, -1, slots) skipped, a repeated src (a fork);
    every tensor's dst rows equal the src rows before the copy, everything else
    unchanged."""
    gen = torch.Generator().manual_seed(1)
    page = torch.zeros(7, 128, dtype=torch.uint8, device=device)
    tensors = [
        torch.zeros(7, 40, dtype=torch.float16, device=device),
        page[:, 0:20].view(torch.float32),
        page[:, 32:44].view(torch.float32),
        page[:, 49:56],
        torch.zeros(7, dtype=torch.int32, device=device),
        torch.zeros(7, 3, 16, dtype=torch.bfloat16, device=device),
    ]
    randomize([page, *tensors], gen, device)
    before = snapshot(tensors)
    page_before = page.clone()
    src, dst = [1, 2, 0, 1, -1, 3], [4, 5, 6, 6, 2, 7]
    widths = {w for *_, w in K.table_rows(tensors, chunk or K.default_chunk())}
    assert widths == {1, 4, 16}
    table = K.copy_table(tensors, torch.device(device), chunk)
    K.copy_slots(table, torch.tensor(src, device=device), torch.tensor(dst, dtype=torch.int32, device=device), 7, chunk=chunk)
    want = expected_after(before, src, dst, first=0)
    for i, (got, w) in enumerate(zip(tensors, want)):
        assert same_bits(got, w), i
    # the page's bytes outside the three views are never written
    outside = torch.ones(128, dtype=torch.bool, device=device)
    outside[0:20] = outside[32:44] = outside[49:56] = False
    assert torch.equal(page[:, outside], page_before[:, outside])


# ---------------------------------------------------------------------------------------
# The API on the copy kernel (CPU: ReplaySSMCache(backend="kernels") under the interpreter)


def layers(fmt, n, *, num_slots=6, gen, device="cpu", backend="kernels", **kw):
    caches = [ReplaySSMCache(num_slots, 8, 1, fmt, device, backend=backend, conv_state_shape=(3,), **kw) for _ in range(n)]
    for c in caches:
        randomize(c.tensors, gen, device)
        c.allocator.allocate(num_slots - 1)
    return caches


@interpreted
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("slot_padding", [0, 40], ids=["dense", "padded"])
def test_copy_slots_over_layers_is_one_launch(fmt, slot_padding, monkeypatch):
    """replayssm.copy_slots over three layers on the kernels backend: one kernel launch,
    no per-tensor copies; each layer's dst slots hold its own src slots' bits in every
    per-slot tensor, all else (other slots, the conv state) unchanged; the same bits as
    the per-tensor path (backend="reference") on twin caches."""
    gen = torch.Generator().manual_seed(2)
    caches = layers(fmt, 3, gen=gen, slot_padding=slot_padding)
    twins = layers(fmt, 3, gen=torch.Generator().manual_seed(2), slot_padding=slot_padding)
    before = [snapshot(c.tensors) for c in caches]
    calls = count_launches(monkeypatch)
    src, dst = [1, 1, 2], [3, 4, 5]
    replayssm.copy_slots(caches, src, dst)
    assert calls == {"kernel": 1, "per_tensor": 0}
    replayssm.copy_slots(twins, src, dst, backend="reference")
    assert calls == {"kernel": 1, "per_tensor": 3}
    for c, t, b in zip(caches, twins, before):
        assert_cache_equal(expected_after(b, src, dst), c.tensors)
        assert_cache_equal(t.tensors, c.tensors)


@interpreted
@pytest.mark.parametrize("fmt", FMTS)
def test_cache_copy_and_fork_are_one_launch(fmt, monkeypatch):
    """ReplaySSMCache.copy_slots with int32 ids and fork (n=2) on the kernels backend: one
    launch each, the copied bits as the per-tensor path gives them."""
    gen = torch.Generator().manual_seed(3)
    cache = ReplaySSMCache(8, 8, 1, fmt, "cpu", backend="kernels")
    randomize(cache.tensors, gen)
    cache.allocate(3)  # 1, 2, 3
    before = snapshot(cache.tensors)
    calls = count_launches(monkeypatch)
    cache.copy_slots(torch.tensor([2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    forks = cache.fork([1], n=2).tolist()
    assert calls == {"kernel": 2, "per_tensor": 0}
    assert forks == [4, 5]
    assert_cache_equal(expected_after(before, [2, 1, 1], [3, 4, 5]), cache.tensors)


@interpreted
def test_functional_copy_backend_choice(monkeypatch):
    """copy_replayssm_slots: backend="kernels" runs the kernel under the interpreter;
    "auto" on the CPU the per-tensor copies; both give the same bits; a bad backend is an
    error naming it; "kernels" where the kernel cannot run is a ValueError saying why."""
    gen = torch.Generator().manual_seed(4)
    a = allocate_cache(6, 8, 1, "nvfp4", slot_padding=16, conv_shape=(2,))
    randomize(a, gen)
    b = snapshot(a)
    calls = count_launches(monkeypatch)
    src, dst = torch.tensor([1, 2]), torch.tensor([4, 3])
    copy_replayssm_slots(a, src, dst, state_dtype="nvfp4", backend="kernels")
    copy_replayssm_slots(b, src, dst, state_dtype="nvfp4")
    assert calls == {"kernel": 1, "per_tensor": 1}
    assert_cache_equal(a, b)
    with pytest.raises(ValueError, match="backend must be one of"):
        copy_replayssm_slots(a, src, dst, state_dtype="nvfp4", backend="triton")
    with pytest.raises(TypeError, match="backend must be a str"):
        replayssm.copy_slots([], [1], [2], backend=1)
    monkeypatch.setattr(handoff, "triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match="backend='kernels' cannot copy here: the copy kernel needs a CUDA device"):
        copy_replayssm_slots(a, src, dst, state_dtype="nvfp4", backend="kernels")
    assert_cache_equal(a, b)


BAD = {
    "out-of-range": ([1], [6], "dst must be slot ids"),
    "padding-src": ([0], [2], "src must be slot ids"),
    "dst-repeats": ([1, 2], [3, 3], "dst must name each slot once"),
    "not-disjoint": ([1, 2], [2, 3], "disjoint"),
    "lengths": ([1, 2], [3], "same number"),
    "dst-free": ([1], [5], "dst must be allocated"),
}


@interpreted
@pytest.mark.parametrize("case", list(BAD))
def test_rejected_kernel_copy_changes_nothing(case, monkeypatch):
    """Validation stays in front of the kernel: a clear ValueError naming the argument,
    no launch, every layer unchanged."""
    gen = torch.Generator().manual_seed(5)
    caches = layers("fp8", 2, gen=gen)
    caches[1].release([5])
    before = [snapshot(c.tensors) for c in caches]
    calls = count_launches(monkeypatch)
    src, dst, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        replayssm.copy_slots(caches, src, dst)
    assert calls == {"kernel": 0, "per_tensor": 0}
    for c, b in zip(caches, before):
        assert_cache_equal(b, c.tensors)


@interpreted
def test_copy_plan_is_built_once_per_cache_list_and_dropped_with_it():
    """The table of a cache list is built on the first copy and reused (same plan, same
    table rows as `table_rows` of the tensors); another list gets its own; a list's entry
    goes when one of its caches is collected."""
    gen = torch.Generator().manual_seed(6)
    caches = layers("nvfp4", 2, gen=gen)
    plan = handoff.copy_plan(caches)
    assert handoff.copy_plan(list(caches)) is plan
    rows = K.table_rows([t for c in caches for t in c.tensors[1:]], plan.chunk)
    assert plan.table.tolist() == [list(r) for r in rows]
    assert handoff.copy_plan(caches[:1]) is not plan
    key = tuple(map(id, caches))
    assert key in handoff._LIST_PLANS
    del plan, caches
    gc.collect()
    assert key not in handoff._LIST_PLANS


def test_tuple_plan_follows_the_tuple_layout():
    """The functional API's table is kept per checkpoint tensor and rebuilt when another
    tensor of the tuple changes (its rows always those of the tuple's tensors)."""
    cache = allocate_cache(4, 8, 1, "fp8")
    plan = handoff.tuple_plan(cache, 4)
    assert handoff.tuple_plan(cache, 4) is plan
    moved = list(cache)
    moved[L.READ_COPY] = moved[L.READ_COPY].clone()
    other = handoff.tuple_plan(moved, 4)
    assert other is not plan
    assert other.table.tolist() == [list(r) for r in K.table_rows(moved[1:], other.chunk)]


# ---------------------------------------------------------------------------------------
# Compile-only: the sm_90a build moves the 16-byte-aligned chunks with 16-byte accesses

_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from replayssm.kernels.triton import copy_slots as K
out = {}
for ids in ("*i32", "*i64"):
    sig = dict(p_table="*i64", p_src=ids, p_dst=ids, stride_src="i32", stride_dst="i32", num_slots="i32",
               BLOCK="constexpr", ITERS="constexpr")
    block, iters = K.block_for(16384)
    ptx = triton.compile(ASTSource(K._copy_slots_kernel, sig, {"BLOCK": block, "ITERS": iters}),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[ids] = sorted(set(re.findall(r"\b(?:ld|st)\.global[.a-z0-9]*", ptx)))
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_16_byte_accesses():
    """Compiled for sm_90a in a process without the interpreter (no GPU needed): 16-byte
    loads and stores (the width-16 path), 4-byte and 1-byte ones (the other widths)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for ops in json.loads(res.stdout).values():
        for op in ("ld.global.v4.b32", "st.global.v4.b32", "ld.global.b32", "st.global.b32", "ld.global.b8", "st.global.b8"):
            assert op in ops, (op, ops)


# ---------------------------------------------------------------------------------------
# GPU: compiled, in a CUDA graph


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_copy_slots_over_layers_one_launch_in_a_cuda_graph(fmt):
    """replayssm.copy_slots over 6 layers (16 heads / 2 groups; dense and padded slots)
    with device ids (padding pairs included), captured in a CUDA graph after a warm call,
    replayed after the sources changed: every per-slot tensor of every dst holds its src's
    new bits, everything else unchanged; equal to the per-tensor path."""
    gen = torch.Generator().manual_seed(7)
    kw = dict(backend="reference", conv_state_shape=(4,))
    caches = [ReplaySSMCache(40, 16, 2, fmt, "cuda", slot_padding=48 * (i % 2), **kw) for i in range(6)]
    for c in caches:
        randomize(c.tensors, gen, "cuda")
        c.allocator.allocate(39)
    src = torch.tensor([1, 2, 3, 3, 0, 9], device="cuda")
    dst = torch.tensor([20, 21, 22, 23, 24, 40], dtype=torch.int32, device="cuda")
    replayssm.copy_slots(caches, src, dst, backend="kernels")  # builds the table, compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayssm.copy_slots(caches, src, dst, backend="kernels")
    for c in caches:
        randomize(c.tensors, gen, "cuda")
    before = [snapshot(c.tensors) for c in caches]
    graph.replay()
    torch.cuda.synchronize()
    pairs = (src.tolist(), dst.tolist())
    for c, b in zip(caches, before):
        assert_cache_equal(expected_after(b, *pairs), c.tensors)
        twin = [t.clone() for t in b]
        handoff.copy_rows(twin, torch.tensor([1, 2, 3, 3], device="cuda"), torch.tensor([20, 21, 22, 23], device="cuda"))
        assert_cache_equal(twin, c.tensors)
    # a "cuda" cache (device without an index) takes ids on cuda:0 in its own copy too
    c = caches[1]
    before = snapshot(c.tensors)
    c.copy_slots(torch.tensor([5], device="cuda"), torch.tensor([6], dtype=torch.int32, device="cuda"))
    assert_cache_equal(expected_after(before, [5], [6]), c.tensors)


@pytest.mark.gpu
def test_gpu_first_copy_inside_a_capture_is_a_clear_error():
    """The table is built by the first copy of a cache list (a host-to-device copy); a
    first copy inside a graph capture is a RuntimeError saying to call it once before."""
    cache = ReplaySSMCache(4, 16, 2, "fp8", "cuda", backend="reference")
    cache.allocator.allocate(3)
    src = torch.tensor([1], device="cuda")
    dst = torch.tensor([2], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            replayssm.copy_slots([cache], src, dst, backend="kernels")
