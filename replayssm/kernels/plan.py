"""The plan record: how the prepare kernel stores a step's plan for the decode kernels.

One 64-byte record a batch row, eight int64 words:

    word 0  slot          word 2  key (uint32 stream tag)   word 4  flags: byte 32 valid, byte 33 flush
    word 1  ring_index    word 3  old_parity                words 5-7  zero

`reference.Plan`'s six fields are strided views of it (`views`): a kernel plan has the
reference's values and dtypes, with a row stride of 64 bytes. The decode kernels take the
fields' addresses as before and index row b at b * ROW_WORDS (int64 fields) or
b * ROW_BYTES (the flag bytes), so they read any plan whose fields sit this way; `as_record`
packs any other plan (the reference's, a test's) into a fresh record first.

Why a record and not six arrays: the prepare kernel's programs wrote one flag byte each
into the same 128-byte lines (128 rows a line), and at batch 256 those partial writes cost
0.3-0.4 us of its ~1.9 (H200, docs/perf-notes-cute.md, session 11). A record is one
vector store a row, and the non-flush kernel reads a row's plan with two loads (slot and
ring index in one 16-byte load, both flags in one 4-byte load) instead of four.
"""

from __future__ import annotations

import torch

from ..reference import Plan

ROW_WORDS = 8
ROW_BYTES = 8 * ROW_WORDS
SLOT, RING_INDEX, KEY, OLD_PARITY, FLAGS = 0, 1, 2, 3, 4
VALID_BYTE, FLUSH_BYTE = 8 * FLAGS, 8 * FLAGS + 1
# Byte offset of each field in a record, in `Plan` order.
OFFSETS = {
    "valid": VALID_BYTE,
    "slot": 8 * SLOT,
    "ring_index": 8 * RING_INDEX,
    "flush": FLUSH_BYTE,
    "key": 8 * KEY,
    "old_parity": 8 * OLD_PARITY,
}


def new_record(rows: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed record buffer, int64 [rows, ROW_WORDS] (16-byte-aligned rows)."""
    return torch.zeros(rows, ROW_WORDS, dtype=torch.int64, device=device)


def views(record: torch.Tensor) -> Plan:
    """The `reference.Plan` whose fields are views of `record` (int64 [rows, ROW_WORDS])."""
    as_bool = record.view(torch.bool)
    return Plan(
        as_bool[:, VALID_BYTE],
        record[:, SLOT],
        record[:, RING_INDEX],
        as_bool[:, FLUSH_BYTE],
        record[:, KEY],
        record[:, OLD_PARITY],
    )


def base_address(plan: Plan) -> int | None:
    """The address of row 0's record when every field of `plan` sits in one record
    buffer as `views` lays it out (16-byte aligned), else None."""
    base = plan.slot.data_ptr()
    if base % 16:
        return None
    dtypes = {"valid": torch.bool, "flush": torch.bool}
    for name, offset in OFFSETS.items():
        field = getattr(plan, name)
        stride = ROW_BYTES // field.element_size()
        if field.dtype != dtypes.get(name, torch.int64) or field.dim() != 1 or field.shape[0] != plan.slot.shape[0]:
            return None
        if field.data_ptr() != base + offset or (field.shape[0] > 1 and field.stride(0) != stride):
            return None
    return base


def pack(plan: Plan) -> torch.Tensor:
    """A new record buffer holding `plan` (any layout)."""
    record = new_record(plan.slot.shape[0], plan.slot.device)
    record[:, SLOT] = plan.slot
    record[:, RING_INDEX] = plan.ring_index
    record[:, KEY] = plan.key
    record[:, OLD_PARITY] = plan.old_parity
    record[:, FLAGS] = plan.valid.long() | (plan.flush.long() << 8)
    return record


def as_record(plan: Plan) -> Plan:
    """`plan` itself when it already sits in a record (the prepare kernel's plans), else
    a packed copy (a few small device ops; tests and reference plans only)."""
    return plan if base_address(plan) is not None else views(pack(plan))


__all__ = ["ROW_WORDS", "ROW_BYTES", "SLOT", "RING_INDEX", "KEY", "OLD_PARITY", "FLAGS", "VALID_BYTE", "FLUSH_BYTE", "OFFSETS", "new_record", "views", "base_address", "pack", "as_record"]
