"""Slot allocation for a scheduler: slot 0 (`NULL_SLOT`) is the padding slot and is never
handed out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import attrs
import torch

from .checks import id_list

NULL_SLOT = 0
"""The padding slot id: a row whose slot is `NULL_SLOT` (or any id <= 0 or >= num_slots)
outputs zeros and changes no cache state."""


def _show(ids: Sequence[int], limit: int = 16) -> str:
    """`ids` for an error message: the first `limit` of them and the count beyond."""
    ids = list(ids)
    return str(ids) if len(ids) <= limit else f"[{', '.join(map(str, ids[:limit]))}, ... ({len(ids)} ids)]"


@attrs.define
class SlotAllocator:
    """Hands out unique slot ids in [1, num_slots - 1]; lowest free ids first."""

    num_slots: int = attrs.field()
    _free: list[int] = attrs.field(init=False, repr=False)
    _used: set[int] = attrs.field(init=False, factory=set, repr=False)

    @num_slots.validator
    def _check_num_slots(self, _attr, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ValueError(f"num_slots must be an int >= 2 (slot 0 is reserved); got {value!r}")

    def __attrs_post_init__(self) -> None:
        self._free = list(range(self.num_slots - 1, NULL_SLOT, -1))  # popped from the end

    @property
    def capacity(self) -> int:
        """Slots that can be allocated: num_slots - 1 (slot 0 is padding)."""
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def is_allocated(self, slot: int) -> bool:
        return slot in self._used

    def check_live(self, ids: Sequence[int], name: str = "slots") -> None:
        """Raise a ValueError naming `name` unless every live id in `ids` (0 < id <
        num_slots) is allocated and appears once; padding ids pass."""
        live = [s for s in ids if 0 < s < self.num_slots]
        stray = sorted({s for s in live if s not in self._used})
        if stray:
            raise ValueError(
                f"{name} must be allocated slots or padding (<= 0 or >= {self.num_slots}); "
                f"slot(s) {stray} are not allocated; got {_show(ids)}"
            )
        if len(set(live)) != len(live):
            repeated = sorted(s for s, count in Counter(live).items() if count > 1)
            raise ValueError(f"{name} must name each live slot once; slot(s) {repeated} repeat; got {_show(ids)}")

    def allocate(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """n unique slot ids as an int32 tensor; raises if fewer than n are free."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int; got {n!r}")
        if n > len(self._free):
            raise RuntimeError(
                f"cannot allocate {n} slots: {len(self._free)} of {self.capacity} are free"
            )
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return torch.tensor(ids, dtype=torch.int32, device=device)

    def release(self, slots: torch.Tensor | Iterable[int] | int) -> None:
        """Return slots to the pool; rejects (changing nothing) slot 0, ids out of range or
        not allocated, and ids repeated in one call."""
        if isinstance(slots, torch.Tensor):
            if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise TypeError(f"slots must be an integer tensor; got {slots.dtype}")
            ids = [int(s) for s in slots.reshape(-1).tolist()]
        else:
            ids = id_list("slots", slots).tolist()
        for s in ids:
            if s == NULL_SLOT:
                raise ValueError("slots: slot 0 is the padding slot and is never allocated; cannot release it")
            if not 0 < s < self.num_slots:
                raise ValueError(f"slots must be in [1, {self.num_slots - 1}]; got {s}")
            if s not in self._used:
                raise ValueError(f"slots: slot {s} is not allocated (double release?)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"slots must be unique; got {ids}")
        self._used.difference_update(ids)
        self._free.extend(ids)
        self._free.sort(reverse=True)
