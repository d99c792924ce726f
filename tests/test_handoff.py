"""Slot hand-off (replayssm/handoff.py, ReplaySSMCache.copy_slots / fork / snapshot /
export / import_, the Triton materialize kernel) against the exact FP64 recurrence, a twin
cache that never moved its state, and the reference. CPU tests run the reference backend,
and the kernels backend through the Triton interpreter on tiny shapes (8 heads, 1 group);
the `gpu` tests repeat the key ones compiled on a CUDA GPU, with CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

import replayssm
from replayssm import (
    ReplaySSMCache,
    allocate_cache,
    copy_replayssm_slots,
    export_replayssm_slots,
    import_replayssm_slots,
    initialize_replayssm_state,
    materialize_replayssm_state,
    snapshot_replayssm_slots,
)
from replayssm import layout as L
from replayssm import reference as ref
from replayssm.synthetic import ExactRecurrence, layer_params, prefill_states, sqnr_db, token
from replayssm.formats import FP8
from tests.helpers import assert_cache_equal, same_bits, snapshot
from tests.tolerances import FOLD_REL_TOL, OUTPUT_SQNR_FLOOR_DB, STATE_SQNR_FLOOR_DB

FMTS = ["fp8", "nvfp4", "fp16"]
H, G = 16, 2


def slot_tensors(cache, slot: int) -> list[torch.Tensor]:
    """Bit copies of every per-slot tensor (conv state excluded) of `slot`."""
    return [t[slot].clone() for t in cache.tensors[1:]]


def assert_slot_equal(a, sa: int, b, sb: int) -> None:
    for i, (x, y) in enumerate(zip(slot_tensors(a, sa), slot_tensors(b, sb)), start=1):
        assert same_bits(x, y), f"cache[{i}] of slot {sa} differs from slot {sb}"


class Request:
    """A request in `cache`'s slot `slot` beside its exact FP64 twin."""

    def __init__(self, cache, slot, params, state):
        self.cache, self.slot, self.p = cache, slot, params
        self.exact = ExactRecurrence(params, state)

    def step(self, tok):
        p = self.p
        ids = torch.tensor([self.slot], dtype=torch.int32, device=self.cache.device)
        y = self.cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, ids)
        return y, self.exact.step(tok)


def start(fmt, *, gen, num_slots=8, heads=H, groups=G, seed=3, backend="reference", steps=5, device="cpu", **kw):
    """A cache with one prefilled request decoded `steps` tokens; returns (cache, request)."""
    p = layer_params(heads, generator=gen, device=device)
    cache = ReplaySSMCache(num_slots, heads, groups, fmt, device, seed=seed, backend=backend, **kw)
    slot = int(cache.allocate(1)[0])
    states = prefill_states(p, 1, groups, 24, generator=gen, device=device)
    cache.prefill_init(states, [slot])
    req = Request(cache, slot, p, states)
    for _ in range(steps):
        req.step(token(1, heads, groups, generator=gen, device=device))
    return cache, req


def fork_exact(req: Request, cache, slot) -> Request:
    twin = Request(cache, slot, req.p, req.exact.S.float())
    twin.exact.S = req.exact.S.clone()  # the FP64 state itself, not its FP32 rounding
    return twin


# ---------------------------------------------------------------------------------------
# Copy and fork


@pytest.mark.parametrize("fmt", FMTS)
def test_fork_continues_bit_identically_until_its_own_checkpoint_is_folded(fmt):
    """Same inputs to source and fork: outputs bit-identical while every fold reads the
    copied checkpoint (up to and including the first flush after the fork: its output and
    read copy come from the unrounded FP32 state; fp16, whose steps read the checkpoint
    itself, up to that flush), different stochastic roundings of the checkpoint from that
    flush on (the stream tag holds the slot id), and both within the floors of the exact
    recurrence all along."""
    g = torch.Generator().manual_seed(10)
    cache, src = start(fmt, gen=g, conv_state_shape=(4,))
    cache.tensors[L.CONV][src.slot] = 7.0
    (dst_id,) = cache.fork([src.slot]).tolist()
    assert_slot_equal(cache, src.slot, cache, dst_id)
    assert torch.count_nonzero(cache.tensors[L.CONV][dst_id]) == 0  # the conv state is the engine's
    dst = fork_exact(src, cache, dst_id)
    ys, yd, es, ed = [], [], [], []
    same_until = 15 if fmt == "fp16" else 30  # the last position whose step reads the copied state
    for step in range(40):
        q = int(cache.positions[src.slot])
        tok = token(1, H, G, generator=g)
        a, ea = src.step(tok)
        b, eb = dst.step(tok)
        ys.append(a), yd.append(b), es.append(ea), ed.append(eb)
        ckpt_same = same_bits(cache.tensors[L.CHECKPOINT][src.slot], cache.tensors[L.CHECKPOINT][dst_id])
        if q < 15:
            assert ckpt_same, step
        if q <= same_until:
            assert same_bits(a, b), f"step {step} (position {q}): outputs differ while reading the copied state"
        if q == 15:
            assert not ckpt_same  # the first flush after the fork draws the dst slot's bits
            if cache.format.has_read_copy:
                assert same_bits(cache.tensors[L.READ_COPY][src.slot], cache.tensors[L.READ_COPY][dst_id])
    assert not same_bits(torch.stack(ys), torch.stack(yd))  # the documented divergence
    for y, e in ((ys, es), (yd, ed)):
        assert sqnr_db(torch.stack(e), torch.stack(y)) >= OUTPUT_SQNR_FLOOR_DB[fmt]
    states = cache.materialize([src.slot, dst_id])
    assert sqnr_db(src.exact.S, states[:1]) >= STATE_SQNR_FLOOR_DB
    assert sqnr_db(dst.exact.S, states[1:]) >= STATE_SQNR_FLOOR_DB


@pytest.mark.parametrize("fmt", FMTS)
def test_fork_then_different_inputs_each_matches_its_own_recurrence(fmt):
    """Two forks of one request decode different tokens: each matches its own FP64
    recurrence; the source itself is untouched by the fork (bit-identical to a twin cache
    that never forked)."""
    g = torch.Generator().manual_seed(11)
    cache, src = start(fmt, gen=g, steps=7)
    g2 = torch.Generator().manual_seed(11)
    twin_cache, twin = start(fmt, gen=g2, steps=7)
    forks = cache.fork(torch.tensor([src.slot]), n=2).tolist()
    assert len(forks) == 2 and src.slot not in forks
    reqs = [src] + [fork_exact(src, cache, s) for s in forks]
    outs = {r.slot: ([], []) for r in reqs}
    for _ in range(36):
        toks = [token(1, H, G, generator=g) for _ in reqs]
        for r, tok in zip(reqs, toks):
            y, e = r.step(tok)
            outs[r.slot][0].append(y), outs[r.slot][1].append(e)
        assert same_bits(twin.step(toks[0])[0], outs[src.slot][0][-1])
    for slot, (y, e) in outs.items():
        assert sqnr_db(torch.stack(e), torch.stack(y)) >= OUTPUT_SQNR_FLOOR_DB[fmt], slot
    assert_slot_equal(cache, src.slot, twin_cache, twin.slot)


@pytest.mark.parametrize("fmt", FMTS)
def test_copy_on_the_tuple_moves_every_per_slot_tensor_and_nothing_else(fmt):
    """Functional copy on a tuple with padded slot strides (one byte page per slot, NaN
    poison): dst slots get src's bits in every per-slot tensor (a repeated src forks);
    every other slot and the conv state keep theirs."""
    g = torch.Generator().manual_seed(12)
    p = layer_params(H, generator=g)
    cache = allocate_cache(7, H, G, fmt, slot_padding=48, fill=float("nan"), conv_shape=(3,))
    cache[L.CONV].copy_(torch.arange(21.0).view(7, 3))
    initialize_replayssm_state(cache, prefill_states(p, 2, G, 8, generator=g), torch.tensor([1, 2]), state_dtype=fmt, seed=1, backend="reference")
    for _ in range(18):
        tok = token(2, H, G, generator=g)
        out = torch.empty(2, H, 64, dtype=torch.bfloat16)
        replayssm.selective_state_update_replayssm(
            cache, tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, torch.tensor([1, 2]), out, state_dtype=fmt, seed=1, backend="reference"
        )
    before = snapshot(cache)
    copy_replayssm_slots(cache, torch.tensor([2, 1, 1]), torch.tensor([6, 3, 4], dtype=torch.int32), state_dtype=fmt)
    for s, d in ((2, 6), (1, 3), (1, 4)):
        for i in range(1, len(cache)):
            assert same_bits(cache[i][d], before[i][s]), (i, s, d)
    for i in range(len(cache)):
        for s in (0, 1, 2, 5):
            assert same_bits(cache[i][s], before[i][s]), (i, s)
    assert torch.equal(cache[L.CONV], before[L.CONV])


@pytest.mark.parametrize("fmt", FMTS)
def test_copy_slots_over_all_layers(fmt):
    """replayssm.copy_slots over three layers: each layer's dst is its own src's copy."""
    g = torch.Generator().manual_seed(13)
    layers = [start(fmt, gen=g, num_slots=5, steps=3 + i)[0] for i in range(3)]
    for c in layers:
        c.allocate(2)  # slots 2, 3
    before = [snapshot(c.tensors) for c in layers]
    replayssm.copy_slots(layers, [1, 1], [3, 2])
    for c, b in zip(layers, before):
        for i in range(1, len(c.tensors)):
            for d in (2, 3):
                assert same_bits(c.tensors[i][d], b[i][1])
            assert same_bits(c.tensors[i][4], b[i][4])
    assert not same_bits(layers[0].tensors[L.CHECKPOINT][2], layers[1].tensors[L.CHECKPOINT][2])


# ---------------------------------------------------------------------------------------
# Validation: a clear ValueError naming the argument, and nothing changed


@pytest.fixture
def live():
    g = torch.Generator().manual_seed(14)
    cache, req = start("nvfp4", gen=g, num_slots=6, steps=3)
    cache.allocate(2)  # slots 2, 3 allocated; 4, 5 free
    return cache, req.p


def _bad_calls(cache, p):
    data = cache.export([1])
    fp8 = ReplaySSMCache(6, H, G, "fp8", "cpu", backend="reference")
    fp8_slot = fp8.allocate(1)
    fp8_data = fp8.export(fp8_slot)
    short = dict(data, positions=data["positions"][:0])
    wrong_dtype = dict(data, checkpoint=data["checkpoint"].float())
    return {
        "copy-out-of-range": (lambda: cache.copy_slots([1], [6]), "dst"),
        "copy-padding-src": (lambda: cache.copy_slots([0], [2]), "src"),
        "copy-dst-repeats": (lambda: cache.copy_slots([1, 1], [2, 2]), "dst"),
        "copy-not-disjoint": (lambda: cache.copy_slots([1, 2], [2, 3]), "disjoint"),
        "copy-dst-free": (lambda: cache.copy_slots([1], [4]), "dst must be allocated"),
        "copy-src-free": (lambda: cache.copy_slots([5], [2]), "src must be allocated"),
        "copy-lengths": (lambda: cache.copy_slots([1, 2], [3]), "same number"),
        "copy-float-ids": (lambda: copy_replayssm_slots(cache.tensors, torch.tensor([1.0]), torch.tensor([2]), state_dtype="nvfp4"), "src"),
        "copy-tuple-range": (lambda: copy_replayssm_slots(cache.tensors, torch.tensor([1]), torch.tensor([9]), state_dtype="nvfp4"), "dst"),
        "copy-layers-free": (lambda: replayssm.copy_slots([cache], [1], [5]), "dst must be allocated"),
        "fork-free-src": (lambda: cache.fork([4]), "src must be allocated"),
        "fork-too-many": (lambda: cache.fork([1], n=3), None),
        "fork-bad-n": (lambda: cache.fork([1], n=0), "n must"),
        "snapshot-not-disjoint": (lambda: cache.snapshot([1], [1], p.A), "disjoint"),
        "snapshot-src-repeats": (lambda: cache.snapshot([1, 1], [2, 3], p.A), "src must name each slot once"),
        "snapshot-tuple-src-repeats": (
            lambda: snapshot_replayssm_slots(cache.tensors, torch.tensor([1, 1]), torch.tensor([2, 3]), p.A, state_dtype="nvfp4"),
            "src must name each slot once",
        ),
        "export-free": (lambda: cache.export([4]), "slots must be allocated"),
        "export-padding": (lambda: cache.export([0, 1]), "slots must be slot ids"),
        "import-format": (lambda: cache.import_(fp8_data, [2]), "data must hold the nvfp4"),
        "import-count": (lambda: cache.import_(data, [2, 3]), r"data\['checkpoint'\]"),
        "import-short": (lambda: cache.import_(short, [2]), r"data\['positions'\]"),
        "import-dtype": (lambda: cache.import_(wrong_dtype, [2]), r"data\['checkpoint'\]"),
        "import-free": (lambda: cache.import_(data, [4]), "slots must be allocated"),
        "import-not-dict": (lambda: cache.import_([data], [2]), "data must be a dict"),
        "import-tuple-range": (lambda: import_replayssm_slots(cache.tensors, data, torch.tensor([7]), state_dtype="nvfp4"), "slots"),
    }


BAD = [
    "copy-out-of-range", "copy-padding-src", "copy-dst-repeats", "copy-not-disjoint", "copy-dst-free",
    "copy-src-free", "copy-lengths", "copy-float-ids", "copy-tuple-range", "copy-layers-free", "fork-free-src",
    "fork-too-many", "fork-bad-n", "snapshot-not-disjoint", "snapshot-src-repeats", "snapshot-tuple-src-repeats",
    "export-free", "export-padding", "import-format", "import-count", "import-short", "import-dtype", "import-free",
    "import-not-dict", "import-tuple-range",
]


@pytest.mark.parametrize("case", BAD)
def test_rejected_handoff_changes_nothing(live, case):
    cache, p = live
    call, match = _bad_calls(cache, p)[case]
    before, used = snapshot(cache.tensors), cache.allocator.num_used
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match) as err:
        call()
    if case != "fork-too-many":  # the allocator's own RuntimeError ("cannot allocate")
        assert issubclass(err.type, (ValueError, TypeError))
    assert err.type is not TypeError or case in ("import-not-dict",)
    assert_cache_equal(before, cache.tensors)
    assert cache.allocator.num_used == used


@pytest.mark.parametrize(
    "src, dst, unique_src, match",
    [
        ("host", "device", False, "src must be slot ids in \\[1, 7\\]; got \\[9\\]"),  # host src, device dst
        ("device", "host", False, "dst must be slot ids in \\[1, 7\\]; got \\[9\\]"),
        ("host", "device", True, "src must name each slot once"),
    ],
)
def test_pair_ids_on_the_host_are_checked_when_the_other_side_is_on_the_device(src, dst, unique_src, match):
    """validate_pair reads the side whose ids are on the host, whatever the other side's
    device (the meta device stands in for a GPU: its values cannot be read)."""
    from replayssm.handoff import validate_pair

    meta = torch.device("meta")
    bad = torch.tensor([1, 1]) if unique_src else torch.tensor([9])
    good = torch.tensor([2, 3][: bad.numel()], device=meta)
    s, d = (bad, good) if src == "host" else (good.clone(), bad)
    with pytest.raises(ValueError, match=match):
        validate_pair(s, d, meta, 8, unique_src=unique_src)
    s2, d2 = validate_pair(torch.tensor([4, 5][: bad.numel()]), good, meta, 8, unique_src=unique_src)
    assert s2.device == d2.device == meta and s2.dtype == d2.dtype == torch.int64


# ---------------------------------------------------------------------------------------
# Materialize on the kernels (Triton interpreter on the CPU)


def _kernel_case(fmt, gen, *, slot_padding=0):
    """8 heads / 1 group; slots 1..3 at positions 21 (mod 16: 5), 16 (0) and 15 (15);
    ring entries beyond each slot's live count poisoned with NaN."""
    p = layer_params(8, generator=gen)
    cache = ReplaySSMCache(5, 8, 1, fmt, "cpu", seed=2, backend="reference", slot_padding=slot_padding)
    slots = cache.allocate(3)
    states = prefill_states(p, 3, 1, 8, generator=gen)
    cache.prefill_init(states, slots)
    exact = ExactRecurrence(p, states)
    for step in range(21):
        rows = [0, 1, 2] if step < 15 else ([0, 1] if step < 16 else [0])
        tok = token(len(rows), 8, 1, generator=gen)
        cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots[rows])
        sub = ExactRecurrence(p, exact.S[rows].float())
        sub.S = exact.S[rows]
        sub.step(tok)
        exact.S[rows] = sub.S
    for s in slots.tolist():
        live = int(cache.positions[s]) % 16
        cache.tensors[L.X_RING][s, :, live:] = float("nan")
        cache.tensors[L.DT_RING][s, :, live:] = float("nan")
        cache.tensors[L.B_RING][s, :, live:] = float("nan")
    return cache, p, slots, exact


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("slot_padding", [0, 32], ids=["dense", "padded"])
def test_materialize_kernel_matches_reference_and_exact(fmt, slot_padding):
    """The Triton kernel against `reference.materialize`: both compute in FP32 from the
    same FP16 checkpoint and bf16 / FP32 ring entries and differ only in summation order
    and in exp's last ulp, so the difference is a few FP32 ulps of the state's largest
    terms (FOLD_REL_TOL of the state max bounds 16 terms and the decay with a wide
    margin: ~80 ulps). Against the FP64 recurrence: STATE_SQNR_FLOOR_DB. Padding rows give
    zeros; a NaN-filled `out` is fully written and returned."""
    g = torch.Generator().manual_seed(20)
    cache, p, slots, exact = _kernel_case(fmt, g, slot_padding=slot_padding)
    ids = torch.tensor([0, *slots.tolist(), -3, 5], dtype=torch.int64)
    want = ref.materialize(cache.tensors, ids, p.A)
    out = torch.full((6, 8, 64, 128), float("nan"))
    got = materialize_replayssm_state(cache.tensors, ids, p.A, state_dtype=fmt, backend="kernels", out=out)
    assert got is out and not torch.isnan(got).any()
    for r in range(1, 4):
        err = (got[r] - want[r]).abs().max()
        assert err <= FOLD_REL_TOL * want[r].abs().max(), (r, float(err))
    assert torch.equal(got[[0, 4, 5]], torch.zeros(3, 8, 64, 128))
    assert sqnr_db(exact.S, got[1:4]) >= STATE_SQNR_FLOOR_DB


def test_cache_materialize_out_and_kernels_backend():
    """ReplaySSMCache(backend="kernels") on the CPU materializes through the kernel, into
    `out` when given; the reference backend fills `out` with the reference's states."""
    g = torch.Generator().manual_seed(21)
    cache, p, slots, _ = _kernel_case("fp8", g)
    want = ref.materialize(cache.tensors, slots, p.A)
    out = torch.full((3, 8, 64, 128), float("nan"))
    assert cache.materialize(slots, p.A, out=out) is out and torch.equal(out, want)
    kcache = ReplaySSMCache(5, 8, 1, "fp8", "cpu", seed=2, backend="kernels")
    kcache.allocator.allocate(3)
    for a, b in zip(kcache.tensors, cache.tensors):
        a.copy_(b)
    got = kcache.materialize(slots, p.A)
    assert ((got - want).abs().amax(dim=(1, 2, 3)) <= FOLD_REL_TOL * want.abs().amax(dim=(1, 2, 3))).all()
    with pytest.raises(ValueError, match="out must be contiguous float32"):
        cache.materialize(slots, p.A, out=torch.empty(3, 8, 64, 128, dtype=torch.float16))


# ---------------------------------------------------------------------------------------
# Prefix snapshots


@pytest.mark.parametrize("fmt", FMTS)
def test_snapshot_mid_period_starts_a_request_from_the_exact_state(fmt):
    """snapshot(src, dst) at position 7 (mid-period): dst equals a slot prefilled with the
    materialized state (bits), src is untouched, and a new request decoded from dst
    tracks the FP64 recurrence that starts from src's exact state."""
    g = torch.Generator().manual_seed(30)
    cache, src = start(fmt, gen=g, steps=7)
    (dst_id, twin_id) = cache.allocate(2).tolist()
    before = slot_tensors(cache, src.slot)
    cache.snapshot([src.slot], [dst_id])
    cache.prefill_init(cache.materialize([src.slot]), [twin_id])
    for a, b in zip(slot_tensors(cache, src.slot), before):
        assert same_bits(a, b)
    assert int(cache.positions[dst_id]) == 0
    assert torch.count_nonzero(cache.tensors[L.X_RING][dst_id].float()) == 0
    # The same init but another slot id: identical except the checkpoint's random bits.
    assert same_bits(cache.tensors[L.READ_COPY][dst_id], cache.tensors[L.READ_COPY][twin_id])
    dst = fork_exact(src, cache, dst_id)
    ys, es = [], []
    for _ in range(36):
        y, e = dst.step(token(1, H, G, generator=g))
        ys.append(y), es.append(e)
    assert sqnr_db(torch.stack(es), torch.stack(ys)) >= OUTPUT_SQNR_FLOOR_DB[fmt]
    assert sqnr_db(dst.exact.S, cache.materialize([dst_id])) >= STATE_SQNR_FLOOR_DB


def test_snapshot_functional_on_the_kernels_backend():
    """snapshot_replayssm_slots with backend="kernels" (interpreted materialize and
    initialize): dst's materialized state tracks src's exact state."""
    g = torch.Generator().manual_seed(31)
    cache, p, slots, exact = _kernel_case("nvfp4", g)
    for s in slots.tolist():  # un-poison: the kernels backend's decode is not used here
        live = int(cache.positions[s]) % 16
        cache.tensors[L.X_RING][s, :, live:] = 0
        cache.tensors[L.DT_RING][s, :, live:] = 0
        cache.tensors[L.B_RING][s, :, live:] = 0
    snapshot_replayssm_slots(cache.tensors, slots[:1], torch.tensor([4]), p.A, state_dtype="nvfp4", seed=2, backend="kernels")
    assert int(cache.positions[4]) == 0
    state = ref.materialize(cache.tensors, torch.tensor([4]), p.A)
    assert sqnr_db(exact.S[:1], state) >= STATE_SQNR_FLOOR_DB


# ---------------------------------------------------------------------------------------
# Host swap


def _swap_out_and_reuse(cache, slot, p, g, fmt):
    """Export `slot`, release it, serve another request in it (prefill + 3 decodes),
    release that one and allocate the slot again (lowest free id first)."""
    data = cache.export([slot])
    for t in data.values():
        assert t.device.type == "cpu" and t.is_pinned() == torch.cuda.is_available()
    cache.release([slot])
    (other,) = cache.allocate(1).tolist()
    assert other == slot
    cache.prefill_init(prefill_states(p, 1, G, 8, generator=g), [other])
    for _ in range(3):
        tok = token(1, H, G, generator=g)
        cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, [other])
    cache.release([other])
    return data


@pytest.mark.parametrize("fmt", FMTS)
def test_swap_into_the_same_slot_continues_bit_identically(fmt):
    """Export, release, reuse the slot for another request, import back into the same
    slot id: 24 more steps (crossing flushes at positions 15 and 31) give the outputs and
    every per-slot tensor of a twin cache that never swapped, bit for bit."""
    g, gt = torch.Generator().manual_seed(40), torch.Generator().manual_seed(40)
    cache, req = start(fmt, gen=g, steps=9)
    twin_cache, twin = start(fmt, gen=gt, steps=9)
    data = _swap_out_and_reuse(cache, req.slot, req.p, torch.Generator().manual_seed(99), fmt)
    (back,) = cache.allocate(1).tolist()
    assert back == req.slot
    cache.import_(data, [back])
    assert_slot_equal(cache, back, twin_cache, twin.slot)
    for _ in range(24):
        tok = token(1, H, G, generator=g)
        assert same_bits(req.step(tok)[0], twin.step(tok)[0])
        assert_slot_equal(cache, back, twin_cache, twin.slot)
    assert int(cache.positions[back]) == 33


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
def test_swap_into_another_slot_keeps_the_accuracy(fmt, compact):
    """Import into another slot id (full form: every tensor; compact form: the FP32 state,
    restored as a snapshot): the request continues within the floors of its exact
    recurrence over 24 steps."""
    g = torch.Generator().manual_seed(41)
    cache, req = start(fmt, gen=g, steps=9)
    data = cache.export([req.slot], compact=compact)
    if compact:
        assert list(data) == ["state"] and data["state"].shape == (1, H, 64, 128)
    cache.release([req.slot])
    cache.allocate(1)  # the old slot now serves someone else
    (new,) = cache.allocate(1).tolist()
    assert new != req.slot
    cache.import_(data, [new])
    assert int(cache.positions[new]) == (0 if compact else 9)
    moved = fork_exact(req, cache, new)
    ys, es = [], []
    for _ in range(24):
        y, e = moved.step(token(1, H, G, generator=g))
        ys.append(y), es.append(e)
    assert sqnr_db(torch.stack(es), torch.stack(ys)) >= OUTPUT_SQNR_FLOOR_DB[fmt]
    assert sqnr_db(moved.exact.S, cache.materialize([new])) >= STATE_SQNR_FLOOR_DB


def test_functional_export_import_round_trip():
    """export_replayssm_slots / import_replayssm_slots on a tuple: bits round-trip."""
    g = torch.Generator().manual_seed(42)
    cache, req = start("fp8", gen=g, steps=4)
    data = export_replayssm_slots(cache.tensors, torch.tensor([req.slot]), state_dtype="fp8")
    assert set(data) == {name for name, _, _ in L.tensor_specs(H, G, FP8)}
    import_replayssm_slots(cache.tensors, data, torch.tensor([5]), state_dtype="fp8")
    assert_slot_equal(cache, req.slot, cache, 5)


# ---------------------------------------------------------------------------------------
# GPU (compiled kernels, CUDA graphs); skipped without a CUDA GPU


def _gpu_layer(fmt, gen, *, batch=8, steps=21, heads=H, groups=G):
    p = layer_params(heads, generator=gen, device="cuda")
    cache = ReplaySSMCache(2 * batch + 2, heads, groups, fmt, "cuda", seed=5)
    slots = cache.allocate(batch)
    states = prefill_states(p, batch, groups, 16, generator=gen, device="cuda")
    cache.prefill_init(states, slots)
    exact = ExactRecurrence(p, states)
    for _ in range(steps):
        tok = token(batch, heads, groups, generator=gen, device="cuda")
        cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
        exact.step(tok)
    return cache, p, slots, exact


@pytest.mark.gpu
def test_gpu_snapshot_functional_rejects_repeated_host_src():
    """A CUDA cache given host src ids that repeat: the ValueError before any write (the
    check once read the ids after they had moved to the device, and skipped them)."""
    cache, req = start("fp8", gen=torch.Generator().manual_seed(21), num_slots=6, steps=3, device="cuda")
    cache.allocate(2)
    before = snapshot(cache.tensors)
    with pytest.raises(ValueError, match="src must name each slot once"):
        snapshot_replayssm_slots(cache.tensors, torch.tensor([1, 1]), torch.tensor([2, 3]), req.p.A, state_dtype="fp8")
    assert_cache_equal(before, cache.tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_materialize_kernel_in_a_cuda_graph(fmt):
    """The compiled materialize kernel, captured in a CUDA graph with device ids and
    `out`, replayed after more decode steps: matches the reference within FOLD_REL_TOL of
    each state's max and the exact recurrence within STATE_SQNR_FLOOR_DB."""
    g = torch.Generator().manual_seed(50)
    cache, p, slots, exact = _gpu_layer(fmt, g)
    assert cache.backend_name == "kernels"
    ids = torch.cat([slots.long(), torch.zeros(2, dtype=torch.int64, device="cuda")])
    out = torch.full((ids.numel(), H, 64, 128), float("nan"), device="cuda")
    kw = dict(state_dtype=fmt, backend="kernels", out=out)
    materialize_replayssm_state(cache.tensors, ids, p.A, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        materialize_replayssm_state(cache.tensors, ids, p.A, **kw)
    for _ in range(7):
        tok = token(slots.numel(), H, G, generator=g, device="cuda")
        cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
        exact.step(tok)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.materialize(cache.tensors, ids, p.A)
    n = slots.numel()
    err = (out[:n] - want[:n]).abs().amax(dim=(1, 2, 3))
    assert (err <= FOLD_REL_TOL * want[:n].abs().amax(dim=(1, 2, 3))).all()
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert sqnr_db(exact.S, out[:n]) >= STATE_SQNR_FLOOR_DB


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_copy_in_a_cuda_graph_and_fork_decodes(fmt):
    """copy_replayssm_slots with device ids captured in a CUDA graph and replayed: every
    per-slot tensor copied; then the copies decode the sources' inputs on the CuTe kernels,
    outputs bit-identical before the second flush after the copy (fp16, whose steps read the
    checkpoint the first flush rounds with each slot's own random bits: before the first),
    within the floor of the exact recurrence over 40 steps."""
    g = torch.Generator().manual_seed(51)
    batch = 8
    cache, p, slots, exact = _gpu_layer(fmt, g, batch=batch, steps=5)
    dst = cache.allocate(batch)
    src_d, dst_d = slots.long(), dst.long()
    kw = dict(state_dtype=fmt)
    copy_replayssm_slots(cache.tensors, src_d, dst_d, **kw)  # warm the allocator and kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_replayssm_slots(cache.tensors, src_d, dst_d, **kw)
    graph.replay()
    torch.cuda.synchronize()
    for s, d in zip(slots.tolist(), dst.tolist()):
        assert_slot_equal(cache, s, cache, d)
    both = torch.cat([slots, dst])
    ys, yd, es = [], [], []
    for step in range(40):
        tok = token(batch, H, G, generator=g, device="cuda")
        tok2 = type(tok)(*(torch.cat([t, t]) for t in (tok.x, tok.dt, tok.B, tok.C)))
        out = cache.decode(tok2.x, tok2.dt, p.A, tok2.B, tok2.C, p.D, p.dt_bias, both)
        if 5 + step < (16 if fmt == "fp16" else 31):
            assert same_bits(out[:batch], out[batch:]), step
        ys.append(out[:batch]), yd.append(out[batch:]), es.append(exact.step(tok))
    for y in (ys, yd):
        assert sqnr_db(torch.stack(es), torch.stack(y)) >= OUTPUT_SQNR_FLOOR_DB[fmt]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_swap_same_slot_bit_identical(fmt):
    """Host swap on the GPU: pinned host tensors; export, release, reuse, import into the
    same slot id: 24 steps bit-identical to a twin cache that never swapped."""
    g, gt = torch.Generator().manual_seed(52), torch.Generator().manual_seed(52)
    cache, p, slots, _ = _gpu_layer(fmt, g, batch=2, steps=9)
    twin, _, tslots, _ = _gpu_layer(fmt, gt, batch=2, steps=9)
    data = cache.export(slots[:1])
    assert all(t.is_pinned() for t in data.values())
    cache.release(slots[:1])
    (other,) = cache.allocate(1).tolist()
    cache.prefill_init(prefill_states(p, 1, G, 8, generator=g, device="cuda"), [other])
    cache.release([other])
    (back,) = cache.allocate(1).tolist()
    assert back == int(slots[0])
    cache.import_(data, [back])
    for _ in range(24):
        tok = token(2, H, G, generator=g, device="cuda")
        y = cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
        yt = twin.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, tslots)
        assert same_bits(y[0].cpu(), yt[0].cpu())
        assert_slot_equal(cache, back, twin, int(tslots[0]))


@pytest.mark.gpu
def test_gpu_device_ids_are_checked_only_under_debug(monkeypatch):
    """Device-resident ids are not read back on the hot path; with REPLAYSSM_DEBUG=1 a
    repeated dst on the GPU is a ValueError naming `dst`, and nothing changes."""
    g = torch.Generator().manual_seed(53)
    cache, p, slots, _ = _gpu_layer("fp8", g, batch=2, steps=3)
    dst = torch.tensor([5, 5], dtype=torch.int64, device="cuda")
    monkeypatch.setenv("REPLAYSSM_DEBUG", "1")
    before = snapshot(cache.tensors)
    with pytest.raises(ValueError, match="dst"):
        copy_replayssm_slots(cache.tensors, slots.long(), dst, state_dtype="fp8")
    assert_cache_equal(before, cache.tensors)
