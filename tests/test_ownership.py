"""Slot ownership in ReplaySSMCache: prefill_init, reset, materialize and release take only
allocated live slots, each once (padding ids pass); decode checks the same under
REPLAYSSM_DEBUG=1 only (the hot path reads no ids on the host). Non-finite prefill states
are rejected under REPLAYSSM_DEBUG=1 and stored as docs/format.md says otherwise. Every
rejected call leaves the cache bytes and the allocator as they were."""

from __future__ import annotations

import pytest
import torch

from replayssm import ReplaySSMCache, allocate_cache, initialize_replayssm_state
from replayssm import layout as L
from replayssm.slots import SlotAllocator
from replayssm.synthetic import layer_params, prefill_states, token

from .helpers import assert_cache_equal, snapshot

H, G, S = 16, 2, 6
NOT_ALLOCATED = r"^slots must be allocated slots or padding \(<= 0 or >= 6\); slot\(s\) \[{}\] are not allocated; got "
REPEATED = r"^slots must name each live slot once; slot\(s\) \[1\] repeat; got "


@pytest.fixture
def live():
    """A cache with slots 1 and 2 allocated, prefilled and 3 tokens in; slot 3 allocated
    then released; slots 4 and 5 never allocated."""
    g = torch.Generator().manual_seed(0)
    p = layer_params(H, generator=g)
    cache = ReplaySSMCache(S, H, G, "nvfp4", "cpu", seed=1, backend="reference")
    slots = cache.allocate(3)
    cache.prefill_init(prefill_states(p, 3, G, 16, generator=g), slots)
    cache.release(slots[2:])
    for _ in range(3):
        tok = token(2, H, G, generator=g)
        cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots[:2])
    return cache, p, g


def _calls(cache, p, g, ids):
    n = len(ids)
    tok = token(n, H, G, generator=g)
    return {
        "prefill_init": lambda: cache.prefill_init(torch.ones(n, H, 64, 128), ids),
        "reset": lambda: cache.reset(ids),
        "materialize": lambda: cache.materialize(ids),
        "decode": lambda: cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, ids),
    }


BAD_IDS = [
    pytest.param([4], NOT_ALLOCATED.format(4), id="never-allocated"),
    pytest.param([1, 3], NOT_ALLOCATED.format(3), id="released"),
    pytest.param([5, 0, 4, 2], NOT_ALLOCATED.format("4, 5"), id="two-strays-among-padding"),
    pytest.param([1, 1, 2], REPEATED, id="repeated"),
    pytest.param([1, 2, 0, 1], REPEATED, id="repeated-around-padding"),
]


@pytest.mark.parametrize("ids,match", BAD_IDS)
@pytest.mark.parametrize("op", ["prefill_init", "reset", "materialize"])
def test_host_side_operations_check_ownership(live, op, ids, match):
    cache, p, g = live
    before, used = snapshot(cache.tensors), cache.allocator.num_used
    with pytest.raises(ValueError, match=match):
        _calls(cache, p, g, ids)[op]()
    assert_cache_equal(before, cache.tensors)
    assert cache.allocator.num_used == used


@pytest.mark.parametrize("ids,match", BAD_IDS)
def test_decode_checks_ownership_under_debug(live, monkeypatch, ids, match):
    cache, p, g = live
    monkeypatch.setenv("REPLAYSSM_DEBUG", "1")
    before = snapshot(cache.tensors)
    with pytest.raises(ValueError, match=match):
        _calls(cache, p, g, ids)["decode"]()
    assert_cache_equal(before, cache.tensors)


def test_decode_without_debug_trusts_the_precondition(live):
    """No host read of the ids on the hot path: a repeated live slot advances once (the
    documented precondition, unchecked), a never-allocated one advances too."""
    cache, p, g = live
    pos = cache.positions.clone()
    _calls(cache, p, g, [1, 1, 4])["decode"]()
    assert cache.positions[1].item() == pos[1].item() + 1
    assert cache.positions[4].item() == pos[4].item() + 1


@pytest.mark.parametrize("debug", ["0", "1"])
def test_padding_and_owned_slots_pass(live, monkeypatch, debug):
    """Owned slots with repeated padding: every operation runs, and the owned rows match
    a call without the padding rows."""
    cache, p, g = live
    monkeypatch.setenv("REPLAYSSM_DEBUG", debug)
    want = cache.materialize([1, 2])
    got = cache.materialize([0, 2, -1, 1, 0, 99])
    assert torch.equal(got[[3, 1]], want)
    assert torch.equal(got[[0, 2, 4, 5]], torch.zeros_like(got[:4]))
    tok = token(4, H, G, generator=g)
    out = cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, [0, 2, 1, 0])
    assert torch.equal(out[[0, 3]], torch.zeros_like(out[:2])) and bool(out[[1, 2]].abs().sum() > 0)
    cache.reset([2, 0, 0])
    assert cache.positions[2].item() == 0 and torch.count_nonzero(cache.tensors[L.CHECKPOINT][2].float()) == 0


@pytest.mark.parametrize(
    "ids,match",
    [
        pytest.param([4], "slot 4 is not allocated", id="never-allocated"),
        pytest.param([3], "slot 3 is not allocated", id="released"),
        pytest.param([1, 1], "must be unique", id="repeated"),
        pytest.param([0], "padding slot", id="padding"),
        pytest.param([2, 9], r"must be in \[1, 5\]", id="out-of-range"),
    ],
)
def test_release_checks_ownership(live, ids, match):
    cache, _, _ = live
    before, used = snapshot(cache.tensors), cache.allocator.num_used
    with pytest.raises(ValueError, match=match):
        cache.release(ids)
    assert_cache_equal(before, cache.tensors)
    assert cache.allocator.num_used == used


def test_allocator_check_live_names_the_argument_and_shortens_long_lists():
    a = SlotAllocator(40)
    a.allocate(3)
    a.check_live([0, 1, 2, 3, -5, 40, 77, 0])
    with pytest.raises(ValueError, match=r"^state_indices must be allocated .* slot\(s\) \[4\] are not allocated; "
                                         r"got \[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, \.\.\. \(20 ids\)\]$"):  # fmt: skip
        a.check_live([1, 2, 3, 4] * 5, "state_indices")


NON_FINITE = [
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(-float("inf"), id="-inf"),
]


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_debug_rejects_non_finite_prefill_states(monkeypatch, fmt, bad):
    monkeypatch.setenv("REPLAYSSM_DEBUG", "1")
    cache = ReplaySSMCache(S, H, G, fmt, "cpu", backend="reference")
    slots = cache.allocate(2)
    states = torch.ones(2, H, 64, 128)
    states[1, 3, 5, 7] = bad
    before = snapshot(cache.tensors)
    with pytest.raises(ValueError, match=r"^states must be finite \(REPLAYSSM_DEBUG=1\); rows \[1\] hold NaN or Inf$"):
        cache.prefill_init(states, slots)
    assert_cache_equal(before, cache.tensors)
    tensors = allocate_cache(S, H, G, fmt)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match="states must be finite"):
        initialize_replayssm_state(tensors, states, torch.tensor([2, 1]), state_dtype=fmt, backend="reference")
    assert_cache_equal(before, tensors)
    # a padding row's state is ignored, as the row is
    initialize_replayssm_state(tensors, states, torch.tensor([2, 0]), state_dtype=fmt, backend="reference")
    assert torch.equal(tensors[L.CHECKPOINT][2], torch.ones(H, 64, 128, dtype=torch.float16))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_without_debug_the_checkpoint_saturates_as_documented(monkeypatch, fmt):
    """docs/format.md: in the FP16 checkpoint NaN stays NaN, +-Inf and finite values beyond
    FP16's range become +-65504; finite values beyond that range pass the debug check."""
    cache = ReplaySSMCache(S, H, G, fmt, "cpu", backend="reference")
    slots = cache.allocate(1)
    states = torch.full((1, H, 64, 128), 0.5)
    values = [float("nan"), float("inf"), -float("inf"), 1e6, -7e4, 65519.0, 65520.0]
    states[0, 0, 0, : len(values)] = torch.tensor(values)
    cache.prefill_init(states, slots)
    got = cache.tensors[L.CHECKPOINT][1, 0, 0, : len(values)].float()
    assert torch.isnan(got[0])
    assert got[1:].tolist() == [65504.0, -65504.0, 65504.0, -65504.0, 65504.0, 65504.0]
    monkeypatch.setenv("REPLAYSSM_DEBUG", "1")
    states[0, 0, 0, :3] = 0.5
    cache.prefill_init(states, slots)
    assert cache.tensors[L.CHECKPOINT][1, 0, 0, 3].item() == 65504.0
