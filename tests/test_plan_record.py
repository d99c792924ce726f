"""The plan record (replayssm/kernels/plan.py): the views, the packing, and the layout the
decode kernels' loads assume."""

import pytest
import torch

from replayssm import layout as L
from replayssm import reference as ref
from replayssm.kernels import plan as R


def _reference_plan(seed: int = 3, nvfp4: bool = True) -> ref.Plan:
    """A reference plan with every kind of row: padding, flushing, mid-period, odd slots."""
    cache = L.allocate_cache(12, 8, 1, "nvfp4" if nvfp4 else "fp8", "cpu")
    cache[L.POSITIONS].copy_(torch.tensor([0, 15, 3, 31, 7, 2**31 - 1, 14, 47, 0, 9, 15, 1], dtype=torch.int32))
    ids = torch.tensor([1, 0, 3, 5, -1, 10, 11, 12, 2, 7], dtype=torch.int64)  # 0, -1, 12: padding
    out = torch.zeros(ids.numel(), 8, L.HEAD_DIM, dtype=torch.bfloat16)
    return ref.prepare_decode(cache, ids, out, nvfp4=nvfp4, seed=seed)


@pytest.mark.parametrize("nvfp4", [False, True])
def test_pack_views_round_trip(nvfp4):
    """pack then views gives back the plan field for field (values and dtypes), and the
    record's bytes are the documented ones: words 0-3 slot, ring index, key, old parity;
    byte 32 valid, byte 33 flush; everything else zero."""
    plan = _reference_plan(nvfp4=nvfp4)
    record = R.pack(plan)
    got = R.views(record)
    for name in ref.Plan._fields:
        a, b = getattr(got, name), getattr(plan, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    assert bool(plan.flush.any()) and bool((~plan.valid).any()) and bool((plan.valid & ~plan.flush).any())
    raw = record.view(torch.uint8).view(-1, R.ROW_BYTES)
    assert torch.equal(record[:, 0], plan.slot) and torch.equal(record[:, 1], plan.ring_index)
    assert torch.equal(record[:, 2], plan.key) and torch.equal(record[:, 3], plan.old_parity)
    assert torch.equal(raw[:, 32], plan.valid.to(torch.uint8)) and torch.equal(raw[:, 33], plan.flush.to(torch.uint8))
    assert not raw[:, 34:].any()
    # The field order decode_warp.plan_row loads as one 16-byte and one 4-byte word.
    assert (R.SLOT, R.RING_INDEX, R.VALID_BYTE % 4, R.FLUSH_BYTE - R.VALID_BYTE) == (0, 1, 0, 1)
    assert R.ROW_BYTES % 16 == 0


def test_base_address_and_as_record():
    """base_address finds a record-backed plan (any first row of a record buffer) and
    rejects every other layout; as_record keeps the former and packs the latter."""
    record = R.new_record(16, "cpu")
    for first in (0, 3):
        plan = R.views(record[first : first + 5])
        assert R.base_address(plan) == record[first].data_ptr()
        assert R.as_record(plan) is plan
    plan = _reference_plan()
    assert R.base_address(plan) is None  # six separate arrays
    packed = R.as_record(plan)
    assert R.base_address(packed) is not None
    for name in ref.Plan._fields:
        assert torch.equal(getattr(packed, name), getattr(plan, name)), name
    views = R.views(record[:5])
    broken = [
        views._replace(flush=views.valid),  # a field at the wrong offset
        views._replace(key=record[:5, R.KEY].clone()),  # a field outside the buffer
        views._replace(ring_index=R.views(R.new_record(5, "cpu")).ring_index),  # another buffer
        views._replace(old_parity=views.old_parity.to(torch.int32)),  # a wrong dtype
        R.views(torch.zeros(5 * R.ROW_WORDS + 1, dtype=torch.int64)[1:].view(5, R.ROW_WORDS)),  # base 8 bytes off 16
    ]
    for plan in broken:
        assert R.base_address(plan) is None
