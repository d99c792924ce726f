"""The bookkeeping kernels against the PyTorch reference, bit for bit (every cache tensor
and plan field compared through integer views, so NaN poison compares too): the CuTe
initialize and clear kernels (cute/bookkeeping.py) and the CuTe prepare kernel
(cute/plan.py) on the GPU (the `gpu` tests, at test and serving shapes, captured in CUDA
graphs too); on the CPU their launchers' arguments (the compiled entries replaced by a
recorder) and compile-only checks for every target."""

from __future__ import annotations

import re

import pytest
import torch

from replayssm import layout as L
from replayssm.formats import FORMATS, FP8
from replayssm import reference as ref
from replayssm.kernels import REFERENCE, KernelBackend
from replayssm.kernels.buffers import PlanScratch
from replayssm.quant.rng import seed_key_i32

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
_BACKEND = KernelBackend()


def prepare_decode(cache, ids, out, scratch, *, fmt, seed):
    """The CuTe prepare kernel through the kernel backend (a CUDA cache), into `scratch`."""
    pytest.importorskip("cutlass")
    assert _BACKEND.cute_for(cache) is not None, _BACKEND.cute_unavailable(cache)
    return _BACKEND.prepare(cache, ids, out, fmt=fmt, seed=seed, scratch=scratch)
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.view(INT_VIEW[t.element_size()])


def assert_same_cache(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"cache[{i}]"
        assert torch.equal(as_bits(a).cpu(), as_bits(b).cpu()), f"cache[{i}] differs"


def assert_same_plan(got: ref.Plan, want: ref.Plan):
    for name in ref.Plan._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype, f"plan.{name}: {a.dtype} vs {b.dtype}"
        assert torch.equal(a.cpu(), b.cpu()), f"plan.{name}: {a.tolist()} vs {b.tolist()}"


def twin_caches(slots, heads, groups, fmt, device=DEV, *, garbage=True, gen=None, **alloc):
    """Two identical caches; with `garbage`, rings / positions / parity hold junk (NaN in
    the float rings) that an initialize or clear must overwrite."""
    a = L.allocate_cache(slots, heads, groups, fmt, device, **alloc)
    if garbage:
        g = gen or torch.Generator().manual_seed(1)
        a[L.X_RING].copy_(torch.randn(a[L.X_RING].shape, generator=g))
        a[L.X_RING][:, :, 3] = float("nan")
        a[L.DT_RING].copy_(torch.rand(a[L.DT_RING].shape, generator=g))
        a[L.B_RING].copy_(torch.randn(a[L.B_RING].shape, generator=g))
        a[L.POSITIONS].copy_(torch.randint(1, 1000, a[L.POSITIONS].shape, generator=g))
        if fmt == "nvfp4":
            a[L.PARITY].copy_(torch.randint(0, 2, a[L.PARITY].shape, generator=g))
    b = L.allocate_cache(slots, heads, groups, fmt, device, **alloc)
    for x, y in zip(a, b):
        as_bits(y).copy_(as_bits(x))
    return a, b


def prefill_like(batch, heads, gen, device=DEV, P=64, N=128):
    """FP32 states over a wide range: heads scaled 1e-8 .. 1e8, one all-zero head, FP16
    subnormals and values beyond FP16's range, exact ties, signed zeros."""
    s = torch.randn(batch, heads, P, N, generator=gen)
    s = s * torch.logspace(-8, 8, heads).view(1, heads, 1, 1)
    s[:, 0] = 0.0
    s[:, 0, 0, :8] = -0.0
    s[:, 1, 1, :16] = torch.tensor([1e-6, -3e-7, 6e-8, 1e5, -7e4, 65520.0, 65519.0, 0.5] * 2)
    s[:, 2, :, 5] = 448.0 * 2.0 ** (torch.arange(P) - 30).float()
    return s.to(device)


# ---------------------------------------------------------------------------------------
# initialize and clear (the CuTe kernels: GPU)


def initialize(cache, states, ids, *, fmt, seed, head_offset=0):
    """The CuTe initialize kernel through the kernel backend (a CUDA cache)."""
    pytest.importorskip("cutlass")
    assert _BACKEND.cute_for(cache) is not None, _BACKEND.cute_unavailable(cache)
    _BACKEND.initialize(cache, states, ids, fmt=fmt, seed=seed, head_offset=head_offset)


def clear(cache, ids):
    """The CuTe clear kernel through the kernel backend (a CUDA cache)."""
    pytest.importorskip("cutlass")
    assert _BACKEND.cute_for(cache) is not None, _BACKEND.cute_unavailable(cache)
    _BACKEND.clear(cache, ids)


INIT_CASES = [
    pytest.param("fp8", 16, 2, [3, 0, 5, -1], torch.int32, "contiguous", 0, id="fp8-h16-g2-i32-pad"),
    pytest.param("nvfp4", 16, 2, [3, 0, 5, -1], torch.int32, "contiguous", 0, id="nvfp4-h16-g2-i32-pad"),
    pytest.param("fp8", 16, 2, [9, 2, 2**32 + 1, 0], torch.int64, "contiguous", 64, id="fp8-i64-big-slotstride"),
    pytest.param("nvfp4", 16, 1, [2**32 + 4, 4, 6, 7], torch.int64, "contiguous", 64, id="nvfp4-g1-i64-slotstride"),
    pytest.param("fp8", 16, 2, [1, 0, 4, 0], torch.int32, "broadcast", 0, id="fp8-broadcast"),
    pytest.param("nvfp4", 16, 2, [1, 0, 4, 10], torch.int32, "broadcast", 64, id="nvfp4-broadcast-slotstride"),
    pytest.param("fp8", 16, 2, [2, 8, 0], torch.int64, "transposed", 0, id="fp8-noncontig"),
    pytest.param("nvfp4", 16, 2, [8, -7, 2], torch.int32, "sliced", 0, id="nvfp4-noncontig"),
    pytest.param("nvfp4", 16, 2, [8, 3, 2], torch.int64, "transposed", 16, id="nvfp4-transposed"),
    pytest.param("nvfp4", 24, 3, [5, 0], torch.int32, "contiguous", 32, id="nvfp4-h24-g3"),
    pytest.param("fp16", 16, 2, [3, 0, 5, -1], torch.int32, "contiguous", 0, id="fp16-h16-g2-i32-pad"),
    pytest.param("fp16", 16, 1, [2**32 + 4, 4, 6, 7], torch.int64, "broadcast", 64, id="fp16-g1-i64-broadcast-slotstride"),
    pytest.param("fp16", 16, 2, [8, -7, 2], torch.int32, "sliced", 0, id="fp16-noncontig"),
    # Heads-a-group ratios that are not powers of two, 1 and 128.
    pytest.param("nvfp4", 14, 1, [3, 0, 5], torch.int32, "contiguous", 0, id="nvfp4-h14-g1"),
    pytest.param("nvfp4", 12, 4, [2, 7], torch.int64, "contiguous", 0, id="nvfp4-h12-g4"),
    pytest.param("nvfp4", 4, 4, [4, 1], torch.int32, "contiguous", 0, id="nvfp4-h4-g4"),
    pytest.param("nvfp4", 128, 1, [6, 0, 2], torch.int32, "sliced", 0, id="nvfp4-h128-g1-noncontig"),
    pytest.param("fp8", 6, 1, [1, 0, 2], torch.int32, "contiguous", 0, id="fp8-h6-g1"),
]


def _states(kind, batch, heads, gen, device=DEV):
    if kind == "contiguous":
        return prefill_like(batch, heads, gen, device)
    if kind == "broadcast":
        return prefill_like(1, heads, gen, device).expand(batch, -1, -1, -1)
    if kind == "transposed":  # strides (.., .., 1, 64)
        return prefill_like(batch, heads, gen, device).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert kind == "sliced"  # every other head, an offset window of the state dim
    big = torch.randn(batch, 2 * heads, 64, 130, generator=gen).to(device)
    big[:, ::2, :, 1:129] = prefill_like(batch, heads, gen, device)
    return big[:, ::2, :, 1:129]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, heads, groups, ids, id_dtype, kind, slot_padding", INIT_CASES)
def test_initialize_matches_reference(fmt, heads, groups, ids, id_dtype, kind, slot_padding):
    nvfp4 = fmt == "nvfp4"
    gen = torch.Generator().manual_seed(5)
    got, want = twin_caches(11, heads, groups, fmt, fill=float("nan"), slot_padding=slot_padding, gen=gen)
    states = _states(kind, len(ids), heads, gen)
    ids = torch.tensor(ids, dtype=id_dtype, device=DEV)
    initialize(got, states, ids, fmt=FORMATS[fmt], seed=77)
    ref.initialize(want, states, ids, fmt=FORMATS[fmt], seed=77)
    assert_same_cache(got, want)
    # Poison fully overwritten in the written slots (finite states give finite encodings).
    live = ids[(ids > 0) & (ids < 11)].long()
    copy = (L.SCALES,) if FORMATS[fmt].has_read_copy else ()  # fp16: the checkpoint alone
    for i in (L.CHECKPOINT, *copy) + ((L.META,) if nvfp4 else ()):
        assert not got[i][live].float().isnan().any(), f"cache[{i}] keeps NaN poison"
    if fmt == "fp8":  # 0x7F is e4m3's NaN code
        assert not got[L.READ_COPY][live].view(torch.uint8).eq(0x7F).any()


@pytest.mark.gpu
def test_initialize_empty_batch_is_noop():
    got, want = twin_caches(4, 16, 2, "fp8")
    empty = torch.zeros(0, 16, 64, 128, device=DEV)
    initialize(got, empty, torch.zeros(0, dtype=torch.int32, device=DEV), fmt=FP8, seed=0)
    assert_same_cache(got, want)


CLEAR_CASES = [
    pytest.param("fp8", False, [2, 0, 5, 0, -3], torch.int32, 0, id="fp8-separate-i32-pad"),
    pytest.param("nvfp4", False, [7, 12, 1], torch.int64, 64, id="nvfp4-separate-i64-slotstride"),
    pytest.param("fp8", True, [1, 3, -1, 9], torch.int64, 64, id="fp8-pending-slotstride"),
    pytest.param("nvfp4", True, [4, 0, 0, 2**33 + 2], torch.int64, 0, id="nvfp4-pending-i64-big"),
    pytest.param("fp16", False, [2, 0, 5, 0, -3], torch.int64, 64, id="fp16-separate-i64-slotstride"),
    pytest.param("fp16", True, [4, 0, 9, 1], torch.int32, 0, id="fp16-pending-i32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, pending, ids, id_dtype, slot_padding", CLEAR_CASES)
def test_clear_matches_reference(fmt, pending, ids, id_dtype, slot_padding):
    got, want = twin_caches(10, 16, 2, fmt, pending=pending, slot_padding=slot_padding)
    ids = torch.tensor(ids, dtype=id_dtype, device=DEV)
    clear(got, ids)
    ref.clear(want, ids)
    assert_same_cache(got, want)


@pytest.mark.gpu
def test_clear_strided_ids():
    got, want = twin_caches(10, 16, 2, "fp8")
    ids = torch.tensor([3, 99, 0, 99, 6, 99], dtype=torch.int32, device=DEV)[::2]  # [3, 0, 6], stride 2
    clear(got, ids)
    ref.clear(want, ids.contiguous())
    assert_same_cache(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("pending", [False, True], ids=["separate", "pending"])
def test_backend_launches_match_reference(fmt, pending):
    """The kernel backend's initialize and clear write what the reference writes, on a
    slot-padded cache with strided ids, a broadcast state and a head offset (tensor
    parallel shard), repeated on one cache."""
    gen = torch.Generator().manual_seed(8)
    got, want = twin_caches(9, 16, 2, fmt, fill=float("nan"), slot_padding=64, gen=gen, pending=pending)
    ids = torch.tensor([5, 99, 0, 99, 8, 99, 2, 99], dtype=torch.int64, device=DEV)[::2]  # [5, 0, 8, 2]
    for states in (_states("contiguous", 4, 16, gen), _states("broadcast", 4, 16, gen)):
        initialize(got, states, ids, fmt=FORMATS[fmt], seed=31, head_offset=16)
        ref.initialize(want, states, ids.contiguous(), fmt=FORMATS[fmt], seed=31, head_offset=16)
        assert_same_cache(got, want)
        gone = torch.tensor([8, -1, 3], dtype=torch.int32, device=DEV)
        clear(got, gone)
        ref.clear(want, gone)
        assert_same_cache(got, want)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16", None], ids=["fp8", "nvfp4", "fp16", "clear"])
def test_bookkeeping_launches_pass_the_cache_they_were_made_for(fmt, monkeypatch):
    """The initialize and clear launchers (no GPU: the compiled entries replaced by a
    recorder): the ids' address and stride, the states' address and element strides
    (clear: the checkpoint's address, zero strides), the cache's structs (args.raw of its
    tensors; clear: the checkpoint in the read copy's place, positions in parity's and
    meta's), the seed's key, batch, groups, CTAs a (row, group) and the stream, in the
    kernel's parameter order; the compiled kernel looked up by its static key, with
    16-byte row loads exactly where the states allow them."""
    pytest.importorskip("cutlass")
    from replayssm.kernels.cute import args as A
    from replayssm.kernels.cute import bookkeeping as K
    from replayssm.kernels.cute.plan import slots_words
    from replayssm.kernels.cute.read_copy import read_copy_format

    calls = []
    monkeypatch.setattr(K, "compiled_bookkeeping", lambda *key: lambda *a: calls.append((key, a)))
    f = FORMATS[fmt] if fmt else None
    gen = torch.Generator().manual_seed(9)
    for pending in (False, True):
        cache = L.allocate_cache(9, 24, 3, fmt or "nvfp4", "cpu", slot_padding=64, pending=pending)
        copy = read_copy_format(fmt or "fp16", "sm_100a")
        structs = (
            tuple(A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=5)),
            tuple(A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING])),
            tuple(A.raw(copy.Args, **copy.tensors(cache, L))),
            slots_words(cache, f or FORMATS["fp16"]),
            seed_key_i32(2**40 + 3),
        )
        launch = K.BookkeepingLaunch(cache, f, 2**40 + 3, 5, "sm_100a")
        ids = torch.tensor([3, 99, 0, 99, 5, 99], dtype=torch.int32)[::2]
        width = 2 if pending else 1
        calls.clear()
        if f is None:
            launch(ids, 7)
            assert calls == [((None, "sm_100a", 8, width, torch.int32, False, 64, 128),
                              (ids.data_ptr(), 2, cache[L.CHECKPOINT].data_ptr(), 0, 0, 0, 0, *structs, 3, 3, 8, 7))]  # fmt: skip
            continue
        wide = torch.zeros(3 * 24 * 64 * 128 + 1)  # one element more: an offset view is misaligned
        for kind, states, vec in (
            ("contiguous", _states("contiguous", 3, 24, gen, "cpu"), True),
            ("broadcast", _states("broadcast", 3, 24, gen, "cpu"), True),
            ("transposed", _states("transposed", 3, 24, gen, "cpu"), False),
            ("sliced", _states("sliced", 3, 24, gen, "cpu"), False),
            ("offset", wide[1:].view(3, 24, 64, 128), False),
        ):
            calls.clear()
            launch(ids, 8, states)
            splits = 8  # 3 rows x 3 groups x 8 = 72 CTAs <= NVFP4_CTAS: one head a CTA
            want = (ids.data_ptr(), 2, states.data_ptr(), *states.stride(), *structs, 3, 3, splits, 8)
            assert calls == [((fmt, "sm_100a", 8, width, torch.int32, vec, 64, 128), want)], kind
        big = torch.zeros(1, 24, 64, 128).expand(20, -1, -1, -1)  # 20 rows x 3 groups = 60: NVFP4 splits 3
        calls.clear()
        launch(torch.zeros(20, dtype=torch.int64), 9, big)
        assert calls[0][1][-2] == (3 if fmt == "nvfp4" else 8) and calls[0][0][-4:] == (torch.int64, True, 64, 128)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_bookkeeping_kernels_compile_for_every_arch(arch, tmp_path):
    """Compile-only (no GPU): initialize (each format, states read by 16-byte rows and
    element by element) and clear build PTX and a cubin for each target, 3 heads a group
    and pending mode's two position words, at 64 / 128 and at head dim 80 / state dim 256. Every array in registers (no local memory), no
    atomics (meta is written once, by one thread); clear loads nothing but the row's id
    and needs no barrier;
    initialize rounds the checkpoint with the counter hash, by `cvt.rs` on sm_100a /
    sm_103a and in software on sm_90a, never to nearest; the NVFP4 block reciprocal is
    IEEE (not approximate), its codes by the e2m1x2 conversion where the target has it;
    FP8 codes by the e4m3x2 conversion."""
    pytest.importorskip("cutlass")
    from replayssm.kernels.cute.bookkeeping import bookkeeping_kernel
    from replayssm.kernels.cute.launch import compile_into

    hw = arch != "sm_90a"
    variants = [(fmt, vec, 64, 128) for fmt in ("fp8", "nvfp4", "fp16", None) for vec in ((False, True) if fmt else (False,))]
    variants += [(fmt, fmt is not None, 80, 256) for fmt in ("fp8", "nvfp4", "fp16", None)]  # 3 trips, spare threads
    for fmt, vec, P, N in variants:
        name = f"{fmt or 'clear'}-{'rows' if vec else 'elements'}-{P}-{N}"
        paths = compile_into(*bookkeeping_kernel(fmt, arch, 3, 2, torch.int32, vec, P, N), arch, tmp_path / name)
        assert any(p.endswith(".cubin") for p in paths), name
        text = open(next(p for p in paths if p.endswith(".ptx"))).read()
        assert text.count(".entry kernel_") == 1, name
        body = text[text.index(".entry kernel_") :]
        assert not re.search(r"\.local\b", body) and not re.search(r"\b(atom|red)\.", body), name
        assert not re.search(r"\bcvt\.rn(\.satfinite)?\.f16(x2)?\.f32\b", body), name
        if fmt is None:
            assert len(re.findall(r"\bld\.global", body)) == 1 and "bar.sync" not in body, name
            continue
        assert "2146121005" in body, name  # the hash's lowbias32 constant 0x7FEB352D
        assert ("cvt.rs.satfinite.f16x2.f32" in body) == hw and ("cvt.rz.f16x2.f32" in body) != hw, name
        assert ("ld.global.v4" in body) == vec, name
        assert ("e4m3x2.f32" in body) == (fmt != "fp16"), name  # FP8 codes, NVFP4 block scales
        if fmt == "nvfp4":
            assert re.search(r"\b(rcp|div)\.rn\.f32\b", body) and not re.search(r"\b(rcp|div)\.(approx|full)", body), name
            assert ("cvt.rn.satfinite.e2m1x2.f32" in body) == hw, name


# ---------------------------------------------------------------------------------------
# prepare (the CuTe plan kernel: GPU)

PREP_CASES = [
    pytest.param("fp8", [3, 0, 4, -1, 12, 0, 5, 7], torch.int64, 0, id="fp8-i64-pad"),
    pytest.param("nvfp4", [3, 0, 4, -1, 12, 0, 5, 7], torch.int32, 64, id="nvfp4-i32-pad-slotstride"),
    pytest.param("nvfp4", [2**32 + 3, 6, 8, 9, 1, 2], torch.int64, 0, id="nvfp4-i64-big"),
    # About 40 rows, a few live ones scattered among padding rows (a flush row among them).
    pytest.param("nvfp4", [3 if i == 1 else 4 if i == 17 else 12 if i == 20 else -1 if i == 33 else 5 if i == 35
                           else 7 if i == 39 else 0 for i in range(40)], torch.int32, 0, id="nvfp4-i32-40-rows"),
    pytest.param("fp8", [6 if i == 15 else 9 if i == 16 else 2 if i == 38 else 0 for i in range(39)], torch.int64, 0,
                 id="fp8-i64-39-rows"),
    pytest.param("fp16", [3, 0, 4, -1, 12, 0, 5, 7], torch.int32, 64, id="fp16-i32-pad-slotstride"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, ids, id_dtype, slot_padding", PREP_CASES)
def test_prepare_matches_reference(fmt, ids, id_dtype, slot_padding):
    nvfp4 = fmt == "nvfp4"
    S, H, G = 10, 16, 2
    gen = torch.Generator().manual_seed(6)
    got, want = twin_caches(S, H, G, fmt, fill=float("nan"), slot_padding=slot_padding, gen=gen)
    # Staggered positions: flush rows (15, 31, -1 = 2**32 - 1), the int32 wrap, plain rows.
    pos = torch.tensor([0, 0, 17, 15, 31, 2**31 - 1, -1, 40, 46, 3], dtype=torch.int32, device=DEV)
    for c in (got, want):
        c[L.POSITIONS].copy_(pos)
        if nvfp4:
            c[L.META].copy_(torch.arange(S * G * 2, dtype=torch.float32).view(S, G, 2) + 0.5)
    ids = torch.tensor(ids, dtype=id_dtype, device=DEV)
    out_got = torch.randn(ids.numel(), H, 64, generator=gen).to(DEV, torch.bfloat16)
    out_want = out_got.clone()
    scratch = PlanScratch(max(16, ids.numel()), DEV)
    plan = prepare_decode(got, ids, out_got, scratch, fmt=FORMATS[fmt], seed=2**40 + 3)
    plan_want = ref.prepare_decode(want, ids, out_want, fmt=FORMATS[fmt], seed=2**40 + 3)
    assert_same_plan(plan, plan_want)
    assert torch.equal(out_got.view(torch.int16), out_want.view(torch.int16))
    assert_same_cache(got, want)
    assert plan.key.data_ptr() == scratch.buffers.key.data_ptr()  # views into the caller's scratch


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_plan_kernels_compile_for_every_arch(arch, tmp_path):
    """Compile-only (no GPU needed): both plan kernels build PTX and a cubin for each arch;
    the prepare kernel's first instruction touching memory comes after its one
    griddepcontrol.launch_dependents (the PDL step behind it becomes resident at once),
    and the pending plan appends to the fold's list with one global atomic add."""
    pytest.importorskip("cutlass")
    from replayssm.kernels.cute import plan as P
    from replayssm.kernels.cute.launch import compile_into

    for name, (obj, fake) in {
        "prepare": P.prepare_kernel(4, 1024, True, True, torch.int32),
        "pending": P.pending_plan_kernel(4, 4, True, True, True, torch.int64, torch.int32),
    }.items():
        paths = compile_into(obj, fake, arch, tmp_path / name)
        assert any(p.endswith(".cubin") for p in paths)
        ptx = open(next(p for p in paths if p.endswith(".ptx"))).read()
        body = ptx[ptx.index(".entry"):]
        if name == "prepare":
            assert body.count("griddepcontrol.launch_dependents") == 1
            assert body.index("griddepcontrol.launch_dependents") < body.index("ld.global")
        else:
            assert body.count("atom.global.add") == 1


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_plan_launches_pass_the_cache_and_plan_they_were_made_for(fmt, monkeypatch):
    """The plan kernels' launchers (no GPU: the compiled entries replaced by a recorder):
    the ids' address and stride, the cache's positions (NVFP4: parity and meta; the other
    formats pass positions in their place) with their strides and the slot count, the
    plan buffer's addresses, the seed's key as int32 bits, the batch and the stream, in
    the kernels' parameter order; the compiled kernel looked up by its static key."""
    pytest.importorskip("cutlass")
    from replayssm.formats import FORMATS
    from replayssm.kernels.buffers import PendingPlan
    from replayssm.kernels.cute import plan as P
    from replayssm.quant.rng import seed_key

    calls = []
    monkeypatch.setattr(P, "compiled_prepare", lambda *key: lambda *a: calls.append(("prepare", key, a)))
    monkeypatch.setattr(P, "compiled_pending_plan", lambda *key: lambda *a: calls.append(("plan", key, a)))
    f = FORMATS[fmt]
    key32 = seed_key(2**40 + 3) & 0xFFFFFFFF
    key32 -= (1 << 32) if key32 >= (1 << 31) else 0
    for pending in (False, True):
        cache = L.allocate_cache(9, 16, 2, fmt, "cpu", slot_padding=64, pending=pending)
        pos = cache[L.POSITIONS]
        par, meta = (cache[L.PARITY], cache[L.META]) if f.two_level else (pos, pos)
        slots = (pos.data_ptr(), par.data_ptr(), meta.data_ptr(), pos.stride(0), par.stride(0), meta.stride(0), 9)
        ids = torch.tensor([3, 99, 0, 99, 5, 99], dtype=torch.int32)[::2]
        calls.clear()
        if not pending:
            scratch = PlanScratch(8, "cpu")
            out = torch.empty(3, 16, 64, dtype=torch.bfloat16)
            P.PrepareLaunch(cache, scratch, f, 2**40 + 3, "sm_90a")(ids, out, 7)
            words = tuple(t.data_ptr() for t in scratch.buffers)
            assert calls == [("prepare", ("sm_90a", 2, 16 * 64, f.two_level, torch.int32),
                              (ids.data_ptr(), 2, slots, out.data_ptr(), words, key32, 3, 7))]  # fmt: skip
        else:
            plan = PendingPlan(8, "cpu")
            acc = torch.tensor([1, 0, 2], dtype=torch.int64)
            cu = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
            launch = P.PendingPlanLaunch(cache, plan, f, 2**40 + 3, 3, "sm_90a")
            launch(ids, None, None, 7)
            launch(ids, acc, cu, 8)
            words = (plan.buf.data_ptr(), plan.fold_list.data_ptr())
            assert calls == [
                ("plan", ("sm_90a", 3, 2, False, False, f.two_level, torch.int32, torch.int32),
                 (ids.data_ptr(), 2, ids.data_ptr(), ids.data_ptr(), slots, words, 3, 14, key32, 7)),
                ("plan", ("sm_90a", 3, 2, True, True, f.two_level, torch.int32, torch.int64),
                 (ids.data_ptr(), 2, acc.data_ptr(), cu.data_ptr(), slots, words, 3, 14, key32, 8)),
            ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_prepare_period_sequence(fmt):
    """17 steps of rows in phase (every row flushes at steps 0 and 16, none in between)
    plus a padding row, int32 ids; plan, outputs and cache equal every step."""
    nvfp4 = fmt == "nvfp4"
    got, want = twin_caches(6, 16, 2, fmt, slot_padding=32)
    for c in (got, want):
        c[L.POSITIONS].fill_(15)
        if nvfp4:
            c[L.META].fill_(3.0)  # the zeroed accumulator halves must show
    ids = torch.tensor([4, 0, 1, 5], dtype=torch.int32, device=DEV)
    scratch = PlanScratch(4, DEV)
    flushes = []
    for step in range(17):
        out_got = torch.full((4, 16, 64), float("nan"), dtype=torch.bfloat16, device=DEV)
        out_want = out_got.clone()
        plan = prepare_decode(got, ids, out_got, scratch, fmt=FORMATS[fmt], seed=9)
        plan_want = ref.prepare_decode(want, ids, out_want, fmt=FORMATS[fmt], seed=9)
        assert_same_plan(plan, plan_want)
        assert torch.equal(out_got.view(torch.int16), out_want.view(torch.int16))
        assert_same_cache(got, want)
        flushes.append(int(plan.flush.sum()))
    assert flushes == [3] + [0] * 15 + [3]


# ---------------------------------------------------------------------------------------
# scratch, warmup


def test_shared_scratch_is_reused():
    backend = KernelBackend()
    a = backend.scratch(DEV, 5)
    assert a.rows == 64 and backend.scratch(DEV, 64) is a
    b = backend.scratch(DEV, 65)
    assert b.rows == 128 and backend.scratch(DEV, 100) is b and backend.scratch(DEV, 3) is a
    c = backend.scratch(DEV, 300)  # a warmup at max batch 300: serves every batch above 128
    assert c.rows == 512 and backend.scratch(DEV, 129) is c and backend.scratch(DEV, 90) is b


def test_warmup_changes_nothing():
    from replayssm.cache import ReplaySSMCache

    cache = ReplaySSMCache(4, 16, 2, "nvfp4", DEV, seed=3, slot_padding=16, backend="kernels")
    before = [as_bits(t).clone() for t in cache.tensors]
    names = cache.warmup()
    if _BACKEND.cute_for(cache.tensors) is None:  # the CPU: every operation but materialize is the reference's
        assert names == []
    else:
        assert {"cute.initialize[torch.int32]", "cute.clear[torch.int64]", "cute.prepare[torch.int64]"} <= set(names)
    for i, (a, t) in enumerate(zip(before, cache.tensors)):
        assert torch.equal(a, as_bits(t)), f"cache[{i}] changed"


# ---------------------------------------------------------------------------------------
# GPU: serving shapes, CUDA graphs

GPU_SHAPES = [
    pytest.param("fp8", 16, 2, id="fp8-h16-g2"),
    pytest.param("nvfp4", 16, 2, id="nvfp4-h16-g2"),
    pytest.param("fp8", 64, 8, id="fp8-h64-g8"),
    pytest.param("nvfp4", 64, 4, id="nvfp4-h64-g4"),
    pytest.param("nvfp4", 64, 8, id="nvfp4-h64-g8"),
    pytest.param("fp16", 16, 2, id="fp16-h16-g2"),
    pytest.param("fp16", 64, 8, id="fp16-h64-g8"),
    pytest.param("nvfp4", 112, 8, id="nvfp4-h112-g8"),
    pytest.param("nvfp4", 48, 1, id="nvfp4-h48-g1"),
]


def _gpu_ids(n, num_slots, gen, dtype):
    ids = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    ids[::5] = 0
    ids[1::11] = -1
    ids[2::13] = num_slots + 3
    return ids.to(dtype).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, heads, groups", GPU_SHAPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_gpu_initialize(fmt, heads, groups, id_dtype):
    gen = torch.Generator().manual_seed(20)
    got, want = twin_caches(256, heads, groups, fmt, "cuda", fill=float("nan"), slot_padding=128, gen=gen)
    ids = _gpu_ids(48, 256, gen, id_dtype)
    states = prefill_like(48, heads, gen, "cuda")
    initialize(got, states, ids, fmt=FORMATS[fmt], seed=2**33 + 1)
    ref.initialize(want, states, ids, fmt=FORMATS[fmt], seed=2**33 + 1)
    assert_same_cache(got, want)
    # Broadcast and non-contiguous states.
    ids2 = _gpu_ids(40, 256, gen, id_dtype)
    for st in (
        prefill_like(1, heads, gen, "cuda").expand(40, -1, -1, -1),
        prefill_like(40, heads, gen, "cuda").transpose(-1, -2).contiguous().transpose(-1, -2),
    ):
        initialize(got, st, ids2, fmt=FORMATS[fmt], seed=5)
        ref.initialize(want, st, ids2, fmt=FORMATS[fmt], seed=5)
        assert_same_cache(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("P, N", [(64, 256), (80, 128), (80, 256)], ids=["p64-n256", "p80-n128", "p80-n256"])
@pytest.mark.parametrize("fmt, heads, groups", [("fp8", 6, 2), ("nvfp4", 8, 2), ("nvfp4", 3, 1), ("fp16", 4, 1)])
def test_gpu_bookkeeping_at_head_dim_80_and_state_dim_256(P, N, fmt, heads, groups):
    """Initialize and clear at the geometries whose flush CTA differs from 64 / 128's
    (`flush.Shape`: 8 warps at state dim 256; 5 row parts a head at head dim 80, the
    last trip's spare threads repeating the last part), through the launcher itself (the
    backend takes these caches to the reference until every step kernel does): bits equal
    the reference's, for contiguous, broadcast and transposed states, padding ids too."""
    pytest.importorskip("cutlass")
    from replayssm.kernels.cute.arch import arch_for
    from replayssm.kernels.cute.bookkeeping import BookkeepingLaunch
    from replayssm.kernels.cute.launch import current_stream

    gen = torch.Generator().manual_seed(25)
    dims = {"head_dim": P, "state_dim": N}
    got, want = twin_caches(64, heads, groups, fmt, "cuda", fill=float("nan"), slot_padding=16, gen=gen, **dims)
    init = BookkeepingLaunch(got, FORMATS[fmt], 2**33 + 5, 0, arch_for())
    wipe = BookkeepingLaunch(got, None, 0, 0, arch_for())
    for i, states in enumerate((
        prefill_like(12, heads, gen, "cuda", P, N),
        prefill_like(1, heads, gen, "cuda", P, N).expand(12, -1, -1, -1),
        prefill_like(12, heads, gen, "cuda", P, N).transpose(-1, -2).contiguous().transpose(-1, -2),
    )):
        ids = _gpu_ids(12, 64, gen, torch.int64 if i % 2 else torch.int32)
        init(ids, current_stream(0), states)
        ref.initialize(want, states, ids, fmt=FORMATS[fmt], seed=2**33 + 5)
        assert_same_cache(got, want)
        gone = _gpu_ids(5, 64, gen, torch.int32)
        wipe(gone, current_stream(0))
        ref.clear(want, gone)
        assert_same_cache(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_gpu_repeated_launches_match_reference(fmt):
    """Initialize and clear repeated on new ids and states of one cache, through a
    backend of its own (a new cache context), bits against the reference."""
    pytest.importorskip("cutlass")
    backend = KernelBackend()
    gen = torch.Generator().manual_seed(22)
    got, want = twin_caches(256, 16, 2, fmt, "cuda", fill=float("nan"), slot_padding=128, gen=gen)
    for i in range(4):
        ids = _gpu_ids(24, 256, gen, torch.int32 if i % 2 else torch.int64)
        states = prefill_like(24, 16, gen, "cuda")
        if i == 3:  # one state for every row, as `ReplaySSMCache.reset` passes it
            states = states[:1].expand(24, -1, -1, -1)
        backend.initialize(got, states, ids, fmt=FORMATS[fmt], seed=9)
        ref.initialize(want, states, ids, fmt=FORMATS[fmt], seed=9)
        assert_same_cache(got, want)
        gone = _gpu_ids(12, 256, gen, torch.int32)
        backend.clear(got, gone)
        ref.clear(want, gone)
        assert_same_cache(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_gpu_initialize_and_clear_in_cuda_graph(fmt):
    """Initialize then clear captured in one CUDA graph (after an eager call of each on
    padding rows, which compiles them and writes nothing), replayed with new states and
    ids in the captured buffers: each replay writes the reference's bits; capturing
    writes nothing."""
    gen = torch.Generator().manual_seed(24)
    got, want = twin_caches(64, 16, 2, fmt, "cuda", fill=float("nan"), slot_padding=128, gen=gen)
    states = torch.empty(8, 16, 64, 128, device="cuda")
    ids = torch.zeros(8, dtype=torch.int32, device="cuda")
    gone = torch.zeros(4, dtype=torch.int64, device="cuda")
    initialize(got, states, ids, fmt=FORMATS[fmt], seed=7)
    clear(got, gone)
    torch.cuda.synchronize()
    assert_same_cache(got, want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        initialize(got, states, ids, fmt=FORMATS[fmt], seed=7)
        clear(got, gone)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_same_cache(got, want)
    for _ in range(3):
        states.copy_(prefill_like(8, 16, gen, "cuda"))
        ids.copy_(_gpu_ids(8, 64, gen, torch.int32))
        gone.copy_(_gpu_ids(4, 64, gen, torch.int64))
        graph.replay()
        ref.initialize(want, states, ids, fmt=FORMATS[fmt], seed=7)
        ref.clear(want, gone)
        torch.cuda.synchronize()
        assert_same_cache(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("pending", [False, True], ids=["separate", "pending"])
def test_gpu_clear(pending):
    gen = torch.Generator().manual_seed(21)
    got, want = twin_caches(256, 64, 8, "nvfp4", "cuda", pending=pending, slot_padding=128, gen=gen)
    ids = _gpu_ids(100, 256, gen, torch.int64)
    clear(got, ids)
    ref.clear(want, ids)
    assert_same_cache(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, heads, groups", GPU_SHAPES)
def test_gpu_prepare_and_cuda_graph(fmt, heads, groups):
    """The prepare kernel captured in a CUDA graph and replayed for two whole periods
    (32 steps) gives, step by step, the plans, outputs and cache of eager reference calls."""
    nvfp4 = fmt == "nvfp4"
    gen = torch.Generator().manual_seed(22)
    got, want = twin_caches(256, heads, groups, fmt, "cuda", slot_padding=128, gen=gen)
    pos = torch.randint(0, 10_000, (256,), generator=gen, dtype=torch.int32).cuda()
    meta = torch.rand(256, groups, 2, generator=gen).cuda() + 1.0  # zeroed halves must show
    for c in (got, want):
        c[L.POSITIONS].copy_(pos)
        if nvfp4:
            c[L.META].copy_(meta)
    ids = _gpu_ids(200, 256, gen, torch.int32)
    out = torch.empty(200, heads, 64, dtype=torch.bfloat16, device="cuda")
    out_want = torch.empty_like(out)
    scratch = PlanScratch(256, "cuda")
    # Eager step first (compiles), then capture one step; each replay is one more step.
    plan = prepare_decode(got, ids, out, scratch, fmt=FORMATS[fmt], seed=42)
    plan_want = ref.prepare_decode(want, ids, out_want, fmt=FORMATS[fmt], seed=42)
    assert_same_plan(plan, plan_want)
    assert_same_cache(got, want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    snapshot = [as_bits(t).clone() for t in got]
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        prepare_decode(got, ids, out, scratch, fmt=FORMATS[fmt], seed=42)
    torch.cuda.current_stream().wait_stream(stream)
    for t, s in zip(got, snapshot):  # capture must not have run the kernel
        assert torch.equal(as_bits(t), s)
    flush_steps = 0
    for step in range(32):
        out.fill_(float("nan"))
        out_want.fill_(float("nan"))
        graph.replay()
        plan_want = ref.prepare_decode(want, ids, out_want, fmt=FORMATS[fmt], seed=42)
        torch.cuda.synchronize()
        assert_same_plan(plan, plan_want)
        assert torch.equal(out.view(torch.int16), out_want.view(torch.int16)), f"step {step}"
        assert_same_cache(got, want)
        flush_steps += int(plan.flush.any())
    assert flush_steps > 16


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_gpu_api_decode_uses_kernels(fmt):
    """Through the public API on CUDA (KernelBackend: prepare kernel + CuTe decode kernels)
    vs the reference backend, each step started from the same cache: 17 steps (one
    flush per row). Bookkeeping (positions, rings, parity) bit-exact; outputs within 2
    bf16 ulps of the row's largest value -- both sides compute in FP32 from the same
    quantized data and differ only in summation order (the CuTe tests check the state
    quantizers bit for bit)."""
    from replayssm import api
    from replayssm.synthetic import layer_params, token

    nvfp4 = fmt == "nvfp4"
    H, G = 64, 8
    gen = torch.Generator().manual_seed(23)
    params = layer_params(H, generator=gen)
    got, want = twin_caches(64, H, G, fmt, "cuda", garbage=False, slot_padding=64)
    ids = torch.tensor([5, 0, 9, 33, 63, -2, 1], dtype=torch.int32, device="cuda")
    states = prefill_like(7, H, gen, "cuda") * 1e-3
    api.initialize_replayssm_state(got, states, ids, state_dtype=fmt, seed=3, backend="kernels")
    REFERENCE.initialize(want, states, ids.reshape(-1), fmt=FORMATS[fmt], seed=3)
    assert_same_cache(got, want)
    bookkeeping = [L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS] + ([L.PARITY] if nvfp4 else [])
    for step in range(17):
        for g_t, w_t in zip(got, want):
            w_t.copy_(g_t)
        tok = token(7, H, G, generator=gen)
        A, D, dt_bias = (t.cuda() for t in (params.A, params.D, params.dt_bias))
        args = (tok.x.cuda(), tok.dt.cuda(), A, tok.B.cuda(), tok.C.cuda(), D, dt_bias)
        out = torch.empty(7, H, 64, dtype=torch.bfloat16, device="cuda")
        out_want = torch.empty_like(out)
        api.selective_state_update_replayssm(got, *args, ids, out, state_dtype=fmt, seed=3, backend="kernels")
        norm = api.normalize_decode_inputs(*args, 7, H, G)
        REFERENCE.decode(want, *norm, ids, out_want, fmt=FORMATS[fmt], seed=3)
        row_max = out_want.float().abs().amax(dim=(1, 2), keepdim=True)
        tol = 2 * 2.0**-7 * torch.exp2(torch.floor(torch.log2(row_max.clamp_min(1e-30))))
        assert ((out.float() - out_want.float()).abs() <= tol).all(), f"step {step}"
        for i in bookkeeping:
            assert torch.equal(got[i], want[i]), f"step {step} cache[{i}]"
