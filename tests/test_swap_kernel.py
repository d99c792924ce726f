"""Staged host swap (kernels/triton/copy_slots.py `stage_slots`; replayssm.export_slots /
import_slots over layers, ReplaySSMCache.export / import_, the functional export / import
on the copy kernel): one gather launch into one staging buffer and one copy to one host
buffer, and back. Against the per-tensor export (`handoff.export_rows`) bit for bit, on caches
of random bits (NaN and Inf patterns included). CPU: the Triton interpreter (tiny shapes:
8 heads, 1 group); `gpu` tests: compiled, 16 heads / 2 groups, several layers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import replayssm
from replayssm import ReplaySSMCache, allocate_cache, export_replayssm_slots, handoff, import_replayssm_slots
from replayssm.formats import format_of
from replayssm.kernels.triton import copy_slots as K
from tests.helpers import assert_cache_equal, same_bits, snapshot
from tests.test_copy_kernel import interpreted, randomize

FMTS = ["fp8", "nvfp4"]
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]


def count_staging(monkeypatch):
    """Count launches of the staging kernel (gathers and scatters), of the copy kernel and
    calls of the per-tensor export."""
    calls = {"gather": 0, "scatter": 0, "copy": 0, "per_tensor_export": 0}
    stage, copy, export = K.stage_slots, K.copy_slots, handoff.export_rows

    def staged(*a, **k):
        calls["gather" if k["to_staging"] else "scatter"] += 1
        return stage(*a, **k)

    def copied(*a, **k):
        calls["copy"] += 1
        return copy(*a, **k)

    def exported(*a, **k):
        calls["per_tensor_export"] += 1
        return export(*a, **k)

    monkeypatch.setattr(K, "stage_slots", staged)
    monkeypatch.setattr(K, "copy_slots", copied)
    monkeypatch.setattr(handoff, "export_rows", exported)
    return calls


def layers(fmt, n, *, num_slots=6, gen, device="cpu", backend="kernels", heads=8, groups=1, **kw):
    caches = [
        ReplaySSMCache(num_slots, heads, groups, fmt, device, backend=backend, conv_state_shape=(3,),
                       slot_padding=kw.get("slot_padding", 0) * (i % 2))
        for i in range(n)
    ]  # fmt: skip
    for c in caches:
        randomize(c.tensors, gen, device)
        valid_bookkeeping(c.tensors)
        c.allocator.allocate(num_slots - 1)
    return caches


def valid_bookkeeping(cache) -> None:
    """Random bits everywhere but in the values an import checks: positions >= 0 (pending
    counts 0..1), NVFP4 parity 0 or 1."""
    pos = cache[-1]
    pos.copy_(pos.abs() % 4096)
    if pos.dim() == 2:
        pos[:, 1] %= 2
    if len(cache) == 10:
        cache[8].copy_(cache[8].abs() % 2)


def per_tensor(caches, slots):
    """The per-tensor export of every layer (the reference for the staged one)."""
    ids = torch.tensor(slots, device=caches[0].tensors[1].device)
    return [handoff.export_rows(c.tensors, ids, c.format, False) for c in caches]


def assert_same_export(got, want):
    assert len(got) == len(want)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), layer
        for name in w:
            assert g[name].shape == w[name].shape and g[name].dtype == w[name].dtype, (layer, name)
            assert g[name].device.type == "cpu" and g[name].is_contiguous(), (layer, name)
            assert same_bits(g[name], w[name]), (layer, name)


def one_buffer(data) -> bool:
    return len({t.untyped_storage().data_ptr() for d in data for t in d.values()}) == 1


# ---------------------------------------------------------------------------------------
# The staging table and the kernel


def test_stage_rows_order_by_alignment_and_keep_one_width_a_tensor():
    """Staging order: tensors by the alignment of their slot bytes (16, 8, 4, 2, 1),
    stable; prefixes the sum of the slot bytes before; a tensor at one width throughout
    (16 where address, stride and size allow; a 20-byte slot at 4; 7 bytes at 1), rows
    (address of the chunk in slot 0, stride, bytes, width, prefix, size, offset, 0)."""
    page = torch.zeros(4, 128, dtype=torch.uint8)
    dense = torch.zeros(4, 40, dtype=torch.float16)  # 80 bytes: 16-aligned
    body_tail = page[:, 0:20].view(torch.float32)  # 20 bytes: 4-aligned
    odd = page[:, 49:56]  # 7 bytes
    pos = torch.zeros(4, dtype=torch.int32)  # 4 bytes
    wide = torch.zeros(4, 8, dtype=torch.float32)  # 32 bytes
    rows, prefixes = K.stage_rows([pos, dense, body_tail, odd, wide], chunk=32)
    assert K.staging_order([4, 80, 20, 7, 32]) == [1, 4, 0, 2, 3]
    # with kinds: one kind's tensors together (where the kind first appears), alignment first
    assert K.staging_order([32, 4, 32, 4, 16], kinds=["a", "p", "a", "p", "b"]) == [0, 2, 4, 1, 3]
    assert prefixes == [112, 0, 116, 136, 80]
    d, w, p, b = dense.data_ptr(), wide.data_ptr(), pos.data_ptr(), page.data_ptr()
    assert rows == [
        (d, 80, 32, 16, 0, 80, 0, 0), (d + 32, 80, 32, 16, 0, 80, 32, 0), (d + 64, 80, 16, 16, 0, 80, 64, 0),
        (w, 32, 32, 16, 80, 32, 0, 0),
        (p, 4, 4, 4, 112, 4, 0, 0),
        (b, 128, 20, 4, 116, 20, 0, 0),
        (b + 49, 128, 7, 1, 136, 7, 0, 0),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 16"):
        K.stage_rows([dense], chunk=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [32, None], ids=["chunk32", "default-chunk"])
def test_stage_kernel_gathers_and_scatters_every_width_bit_for_bit(chunk, device):
    """Gather slots [3, 1, 0, 5] (0: padding, its bytes untouched) of crafted tensors of
    every width into one buffer: each tensor's region holds its slots' bytes in call
    order; scatter the buffer into slots [6, 2, 0, 4]: those rows equal the gathered
    ones, every other row and the page bytes outside the views unchanged."""
    gen = torch.Generator().manual_seed(11)
    page = torch.zeros(7, 128, dtype=torch.uint8, device=device)
    tensors = [
        torch.zeros(7, dtype=torch.int32, device=device),
        torch.zeros(7, 40, dtype=torch.float16, device=device),
        page[:, 0:20].view(torch.float32),
        page[:, 49:56],
        torch.zeros(7, 3, 16, dtype=torch.bfloat16, device=device),
    ]
    randomize([page, *tensors], gen, device)
    chunk_bytes = chunk or K.default_chunk()
    rows, prefixes = K.stage_rows(tensors, chunk_bytes)
    assert {r[3] for r in rows} == {1, 4, 16}
    table = K.stage_table(rows, torch.device(device))
    sizes = [t[0].numel() * t.element_size() for t in tensors]
    slots = [3, 1, 0, 5]
    n = len(slots)
    staging = torch.full((n * sum(sizes),), 0xA5, dtype=torch.uint8, device=device)
    ids = torch.tensor(slots, dtype=torch.int32, device=device)
    K.stage_slots(table, ids, staging, 7, to_staging=True, chunk=chunk)
    for t, prefix, size in zip(tensors, prefixes, sizes):
        region = staging[n * prefix : n * (prefix + size)].view(n, size)
        for i, s in enumerate(slots):
            want = t[s].reshape(-1).contiguous().view(torch.uint8) if s else torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
            assert torch.equal(region[i], want), (prefix, i)
    before, page_before = snapshot(tensors), page.clone()
    dst = [6, 2, 0, 4]
    K.stage_slots(table, torch.tensor(dst, device=device), staging, 7, to_staging=False, chunk=chunk)
    for t, b in zip(tensors, before):
        want = b.clone()
        for s, d in zip(slots, dst):
            if d:
                want[d] = b[s]
        assert same_bits(t, want)
    outside = torch.ones(128, dtype=torch.bool, device=device)
    outside[0:20] = outside[49:56] = False
    assert torch.equal(page[:, outside], page_before[:, outside])


# ---------------------------------------------------------------------------------------
# The API on the staging kernel (CPU: ReplaySSMCache(backend="kernels") under the interpreter)


@interpreted
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("slot_padding", [0, 40], ids=["dense", "padded"])
def test_export_slots_is_one_gather_and_equals_the_per_tensor_export(fmt, slot_padding, monkeypatch):
    """export_slots over three layers: one gather launch, no per-tensor export; each
    layer's dict has the per-tensor export's keys (same order), shapes, dtypes and bits,
    every tensor a contiguous view of one host buffer; the caches unchanged."""
    caches = layers(fmt, 3, gen=torch.Generator().manual_seed(12), slot_padding=slot_padding)
    before = [snapshot(c.tensors) for c in caches]
    calls = count_staging(monkeypatch)
    data = replayssm.export_slots(caches, [4, 2])
    assert calls == {"gather": 1, "scatter": 0, "copy": 0, "per_tensor_export": 0}
    assert one_buffer(data)
    assert_same_export(data, per_tensor(caches, [4, 2]))
    staged = handoff.copy_plan(caches).staging
    assert len(staged.groups) == len(data[0])  # each tensor of every layer in one run: one view each
    for c, b in zip(caches, before):
        assert_cache_equal(b, c.tensors)


@interpreted
@pytest.mark.parametrize("fmt", FMTS)
def test_import_slots_after_release_and_reuse_restores_the_bits(fmt, monkeypatch):
    """Export slots [2, 5] of every layer, release them, reuse them for other data (new
    random bits), allocate again and import: one scatter launch; every per-slot tensor of
    both slots equals its bits before the export in every layer, other slots and the conv
    state untouched. Then into other slot ids ([1, 3]): the same bits there."""
    gen = torch.Generator().manual_seed(13)
    caches = layers(fmt, 3, gen=gen)
    want = [[t[[2, 5]].clone() for t in c.tensors[1:]] for c in caches]
    data = replayssm.export_slots(caches, torch.tensor([2, 5]))
    for c in caches:
        c.release([2, 5])
        randomize([t[2:3] for t in c.tensors[1:]] + [t[5:6] for t in c.tensors[1:]], gen)  # another request's bits
        valid_bookkeeping(c.tensors)
        c.allocator.allocate(2)
    others = [snapshot(c.tensors) for c in caches]
    calls = count_staging(monkeypatch)
    replayssm.import_slots(caches, data, [2, 5])
    assert calls == {"gather": 0, "scatter": 1, "copy": 0, "per_tensor_export": 0}
    for c, w, o in zip(caches, want, others):
        for i, (t, wt) in enumerate(zip(c.tensors[1:], w), start=1):
            assert same_bits(t[[2, 5]], wt), i
            keep = [s for s in range(c.num_slots) if s not in (2, 5)]
            assert same_bits(t[keep], o[i][keep]), i
        assert same_bits(c.tensors[0], o[0])
    replayssm.import_slots(caches, data, [1, 3])
    assert calls["scatter"] == 2
    for c, w in zip(caches, want):
        for t, wt in zip(c.tensors[1:], w):
            assert same_bits(t[[1, 3]], wt)


@interpreted
@pytest.mark.parametrize("fmt", FMTS)
def test_cache_export_import_through_one_buffer(fmt, monkeypatch):
    """ReplaySSMCache.export / import_ on the kernels backend: one gather, one buffer, the
    per-tensor export's bits; import_ of it one scatter; import_ of a per-tensor export
    (separate tensors) falls back to the per-tensor writes with the same result."""
    gen = torch.Generator().manual_seed(14)
    (cache,) = layers(fmt, 1, gen=gen, num_slots=8)
    want = [t[[3]].clone() for t in cache.tensors[1:]]
    calls = count_staging(monkeypatch)
    data = cache.export([3])
    assert calls["gather"] == 1 and calls["per_tensor_export"] == 0
    assert one_buffer([data])
    assert_same_export([data], per_tensor([cache], [3]))
    cache.import_(data, [6])
    assert calls["scatter"] == 1
    separate = {k: v.clone() for k, v in data.items()}
    cache.import_(separate, [7])
    assert calls["scatter"] == 1
    for t, w in zip(cache.tensors[1:], want):
        assert same_bits(t[[6]], w) and same_bits(t[[7]], w)


@interpreted
def test_import_slots_of_other_data_falls_back_per_layer(monkeypatch):
    """import_slots of dicts that are not one export buffer (per-layer exports; one tensor
    replaced by a copy; the layers' dicts in another order than the caches) takes the
    per-tensor path and still writes the right bits; a compact dict among them imports as
    a snapshot would."""
    gen = torch.Generator().manual_seed(15)
    caches = layers("nvfp4", 2, gen=gen)
    want = [[t[[1]].clone() for t in c.tensors[1:]] for c in caches]
    staged = replayssm.export_slots(caches, [1])
    calls = count_staging(monkeypatch)
    per_layer = [c.export([1]) for c in caches]  # two buffers
    assert calls["gather"] == 2
    replayssm.import_slots(caches, per_layer, [2])
    copied = [dict(d) for d in staged]
    copied[1]["checkpoint"] = copied[1]["checkpoint"].clone()
    replayssm.import_slots(caches, copied, [3])
    assert calls["scatter"] == 0
    for c, w in zip(caches, want):
        for t, wt in zip(c.tensors[1:], w):
            assert same_bits(t[[2]], wt) and same_bits(t[[3]], wt)
    # swapped layer order: the buffer is one, but not at this list's layout
    twins = caches[::-1]
    replayssm.import_slots(twins, staged[::-1], [4])
    assert calls["scatter"] == 0
    for c, w in zip(caches, want):
        for t, wt in zip(c.tensors[1:], w):
            assert same_bits(t[[4]], wt)


BAD = {
    "padding-slot": (lambda d: d, [0], "slots must be slot ids"),
    "repeat": (lambda d: d, [1, 1], "slots must name each slot once"),
    "free-slot": (lambda d: d, [5], "slots must be allocated"),
    "count": (lambda d: d[:1], [1], "one dict per cache"),
    "not-a-list": (lambda d: d[0], [1], "sequence of dicts"),
    "missing-key": (lambda d: [d[0], {k: v for k, v in d[1].items() if k != "positions"}], [1], "data must hold the"),
    "shape": (lambda d: [d[0], {**d[1], "checkpoint": d[1]["checkpoint"][:, :4]}], [1], r"data\['checkpoint'\] must be"),
    "wrong-count": (lambda d: d, [1, 2], r"must be torch.float16 \[2,"),
}


@interpreted
@pytest.mark.parametrize("case", list(BAD))
def test_rejected_import_changes_nothing(case, monkeypatch):
    """Validation stays in front of the scatter: a clear error naming the argument, no
    launch, every layer unchanged (the second layer's dict is checked before the first
    layer is written)."""
    gen = torch.Generator().manual_seed(16)
    caches = layers("fp8", 2, gen=gen)
    data = replayssm.export_slots(caches, [3])
    caches[1].release([5])
    before = [snapshot(c.tensors) for c in caches]
    calls = count_staging(monkeypatch)
    edit, slots, match = BAD[case]
    with pytest.raises((ValueError, TypeError), match=match):
        replayssm.import_slots(caches, edit(data), slots)
    assert calls == {"gather": 0, "scatter": 0, "copy": 0, "per_tensor_export": 0}
    for c, b in zip(caches, before):
        assert_cache_equal(b, c.tensors)
    with pytest.raises(ValueError, match="slots must be allocated"):
        replayssm.export_slots(caches, [5])
    assert calls["gather"] == 0


def test_reference_caches_keep_the_per_tensor_export():
    """CPU caches on the reference backend (and backend="reference" on the call): the
    per-tensor export (a host tensor each), bits as before; import_slots of it back."""
    gen = torch.Generator().manual_seed(17)
    caches = layers("fp8", 2, gen=gen, backend="reference")
    data = replayssm.export_slots(caches, [2])
    assert not one_buffer(data)
    assert_same_export(data, per_tensor(caches, [2]))
    replayssm.import_slots(caches, data, [4], backend="reference")
    for c in caches:
        for t in c.tensors[1:]:
            assert same_bits(t[4], t[2])
    assert replayssm.export_slots([], [1]) == []
    with pytest.raises(TypeError, match="sequence of ReplaySSMCache"):
        replayssm.export_slots(caches[0], [1])


# ---------------------------------------------------------------------------------------
# Compile-only: the sm_90a build of the staging kernel moves 16-byte chunks with 16-byte accesses

_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from replayssm.kernels.triton import copy_slots as K
out = {}
for to_staging in (True, False):
    sig = dict(p_table="*i64", p_slots="*i64", stride_slots="i32", staging="i64", n="i32", first="i32",
               num_slots="i32", TO_STAGING="constexpr", BLOCK="constexpr", ITERS="constexpr")
    block, iters = K.block_for(16384)
    src = ASTSource(K._stage_slots_kernel, sig, {"TO_STAGING": to_staging, "BLOCK": block, "ITERS": iters})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[str(to_staging)] = sorted(set(re.findall(r"\b(?:ld|st)\.global[.a-z0-9]*", ptx)))
print(json.dumps(out))
"""


def test_stage_kernel_compiles_for_sm90_with_16_byte_accesses():
    """Gather and scatter compiled for sm_90a without the interpreter (no GPU needed):
    16-byte loads and stores (width 16), 4-byte and 1-byte ones (the other widths)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for ops in json.loads(res.stdout).values():
        for op in ("ld.global.v4.b32", "st.global.v4.b32", "ld.global.b32", "st.global.b32", "ld.global.b8", "st.global.b8"):
            assert op in ops, (op, ops)


# ---------------------------------------------------------------------------------------
# GPU: compiled, pinned buffers


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_export_import_slots_over_layers(fmt, monkeypatch):
    """6 layers (16 heads / 2 groups, dense and padded slots) on a CUDA device: export_slots
    of 3 slots (non_blocking, then a synchronize) is one gather into one pinned buffer,
    bit for bit the per-tensor export; release, reuse with other bits, import_slots back
    (one scatter): the original bits; into other slot ids too; the cache's own export /
    import_ and the functional pair on a tuple round-trip through one buffer as well."""
    gen = torch.Generator().manual_seed(18)
    caches = layers(fmt, 6, num_slots=40, gen=gen, device="cuda", backend="reference", heads=16, groups=2, slot_padding=48)
    slots = [7, 3, 30]
    want = [[t[slots].clone() for t in c.tensors[1:]] for c in caches]
    calls = count_staging(monkeypatch)
    data = replayssm.export_slots(caches, slots, non_blocking=True, backend="kernels")
    torch.cuda.synchronize()
    assert calls["gather"] == 1 and calls["per_tensor_export"] == 0
    assert one_buffer(data) and all(t.is_pinned() for d in data for t in d.values())
    assert_same_export(data, per_tensor(caches, slots))
    for c in caches:
        c.release(slots)
        randomize([t[s : s + 1] for t in c.tensors[1:] for s in slots], gen, "cuda")
        assert sorted(c.allocate(3).tolist()) == sorted(slots)  # the only free ones
    others = [snapshot(c.tensors) for c in caches]
    replayssm.import_slots(caches, data, torch.tensor(slots, device="cuda"), backend="kernels")
    torch.cuda.synchronize()
    assert calls["scatter"] == 1
    keep = [s for s in range(40) if s not in slots]
    for c, w, o in zip(caches, want, others):
        for i, (t, wt) in enumerate(zip(c.tensors[1:], w), start=1):
            assert same_bits(t[slots], wt), i
            assert same_bits(t[keep], o[i][keep]), i
        assert same_bits(c.tensors[0], o[0])
    replayssm.import_slots(caches, data, [1, 2, 4], backend="kernels")
    torch.cuda.synchronize()
    for c, w in zip(caches, want):
        for t, wt in zip(c.tensors[1:], w):
            assert same_bits(t[[1, 2, 4]], wt)
    # one cache (backend "auto" picks the kernel on CUDA unless it chose "reference")
    (one,) = layers(fmt, 1, num_slots=8, gen=gen, device="cuda", backend="auto", heads=16, groups=2)
    before = [t[[5]].clone() for t in one.tensors[1:]]
    d1 = one.export([5])
    assert one_buffer([d1]) and all(t.is_pinned() for t in d1.values())
    assert_same_export([d1], per_tensor([one], [5]))
    one.import_(d1, [6])
    fd = export_replayssm_slots(one.tensors, torch.tensor([5]), state_dtype=fmt)
    assert one_buffer([fd])
    import_replayssm_slots(one.tensors, fd, torch.tensor([7]), state_dtype=fmt)
    torch.cuda.synchronize()
    for t, b in zip(one.tensors[1:], before):
        assert same_bits(t[[6]], b) and same_bits(t[[7]], b)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_functional_export_import_of_a_padded_tuple(fmt):
    """A tuple allocated with slot padding: the functional export is one buffer, equal to
    the per-tensor export; its import into another slot restores the bits."""
    gen = torch.Generator().manual_seed(19)
    cache = allocate_cache(12, 16, 2, fmt, "cuda", slot_padding=48, conv_shape=(4,))
    randomize(cache, gen, "cuda")
    valid_bookkeeping(cache)
    data = export_replayssm_slots(cache, torch.tensor([2, 9]), state_dtype=fmt)
    assert one_buffer([data])
    ref = handoff.export_rows(cache, torch.tensor([2, 9], device="cuda"), format_of(fmt), False)
    assert_same_export([data], [ref])
    import_replayssm_slots(cache, data, torch.tensor([10, 11]), state_dtype=fmt)
    torch.cuda.synchronize()
    for t in cache[1:]:
        assert same_bits(t[[10, 11]], t[[2, 9]])
