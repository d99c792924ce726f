"""SlotAllocator: slot 0 is never handed out; clear errors; state unchanged on error."""

import pytest
import torch

from replayssm import NULL_SLOT, SlotAllocator


def test_allocate_unique_ids_never_zero():
    a = SlotAllocator(9)
    ids = a.allocate(8)
    assert ids.dtype == torch.int32
    assert sorted(ids.tolist()) == list(range(1, 9))
    assert NULL_SLOT not in ids.tolist()
    assert a.num_free == 0 and a.num_used == 8


def test_exhaustion_is_an_error_and_changes_nothing():
    a = SlotAllocator(4)
    a.allocate(2)
    with pytest.raises(RuntimeError, match="cannot allocate 2 slots: 1 of 3 are free"):
        a.allocate(2)
    assert a.num_free == 1
    assert a.allocate(1).tolist() == [3]


def test_release_and_reuse_lowest_first():
    a = SlotAllocator(6)
    ids = a.allocate(5)
    a.release(ids[[1, 3]])
    assert a.allocate(2).tolist() == [2, 4]


@pytest.mark.parametrize(
    "bad,match",
    [
        pytest.param([0], "^slots: slot 0 is the padding slot", id="slot-zero"),
        pytest.param([7], r"^slots must be in \[1, 5\]", id="out-of-range"),
        pytest.param([-1], r"^slots must be in \[1, 5\]", id="negative"),
        pytest.param([5], "^slots: slot 5 is not allocated", id="never-allocated"),
        pytest.param([1, 1], "^slots must be unique", id="repeated"),
    ],
)
def test_release_errors_leave_allocator_unchanged(bad, match):
    a = SlotAllocator(6)
    a.allocate(3)
    for given in (torch.tensor(bad), bad):
        with pytest.raises(ValueError, match=match):
            a.release(given)
        assert a.num_used == 3 and a.num_free == 2


@pytest.mark.parametrize("bad", [[1.5], [True], [2.9], [1, 2.0]])
def test_release_rejects_non_integer_ids_in_a_list(bad):
    """A float or bool would be cast to another slot (1.5 and True to 1)."""
    a = SlotAllocator(6)
    a.allocate(3)
    with pytest.raises(TypeError, match="^slots must hold ints"):
        a.release(bad)
    assert a.num_used == 3 and a.num_free == 2


def test_double_release():
    a = SlotAllocator(3)
    ids = a.allocate(2)
    a.release(ids[:1])
    with pytest.raises(ValueError, match="double release"):
        a.release(ids[:1])


@pytest.mark.parametrize("n", [2.0, -1, True])
def test_allocate_rejects_bad_count(n):
    with pytest.raises(ValueError, match="non-negative int"):
        SlotAllocator(3).allocate(n)


def test_constructor_needs_two_slots():
    with pytest.raises(ValueError, match="num_slots must be an int >= 2"):
        SlotAllocator(1)


def test_cache_remembers_allocated_ids_until_changed():
    """ReplaySSMCache.release and prefill_init read the ids `allocate` returned from the
    cache's record (no device read), and an in-place change of the tensor voids it."""
    from replayssm import ReplaySSMCache

    cache = ReplaySSMCache(8, 8, 1, "fp8", "cpu", backend="reference")
    ids = cache.allocate(3)
    assert cache._host_ids(ids) == ids.tolist()
    other = cache.allocate(2)
    cache.release(other)
    assert cache.allocator.num_used == 3
    ids[0] = 7  # not allocated: the record no longer describes the tensor
    assert cache._host_ids(ids) == ids.tolist()
    with pytest.raises(ValueError, match="not allocated"):
        cache.release(ids)
    assert cache.allocator.num_used == 3


def test_cache_remembers_ids_given_as_a_list():
    """Ids passed as a list become a device tensor whose values the cache records, so the
    ownership checks of prefill_init / release need no device read; the checks still run."""
    from replayssm import ReplaySSMCache

    cache = ReplaySSMCache(8, 8, 1, "fp8", "cpu", backend="reference")
    ids = cache.allocate(2).tolist()
    t = cache._slots(ids)
    assert t.tolist() == ids and cache._host_ids(t) == ids
    with pytest.raises(ValueError, match="not allocated"):
        cache.release([ids[0], 7])
    assert cache.allocator.num_used == 2
    cache.release(ids)
    assert cache.allocator.num_used == 0
