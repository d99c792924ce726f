"""Copy kernel: every per-slot tensor of any number of cache tuples, slots `src` into slots
`dst`, in one launch (docs/design.md section 9).

The copy table (`copy_table`, int64 [chunks, 4]) has a row per chunk of at most `chunk` bytes
of one tensor's slot: [address in slot 0, slot stride, bytes, width], slot s's copy at address
+ s * stride; `width` 16 (address, stride and bytes multiples of 16), 4 or 1. Grid (chunks,
pairs); a pair with a padding id (<= 0 or >= num_slots) is skipped. Staging (host swap,
`stage_slots`): the same chunks between cache slots and one contiguous byte buffer, from a
staging table (`stage_rows`, int64 [chunks, 8]) whose rows add each chunk's place in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import interpreting

TABLE_COLUMNS = 4  # address, slot stride, bytes, width
MAX_PAIRS_PER_LAUNCH = 65535  # CUDA's limit on grid dim 1


@triton.jit
def _move(p_s, p_d, n, o, STEP: tl.constexpr, ITERS: tl.constexpr):
    """Copy elements [0, n) of `p_s` to `p_d`: offsets `o` (arange(0, STEP)), ITERS static
    iterations (masks end it)."""
    for i in tl.static_range(ITERS):
        m = i * STEP + o < n
        tl.store(p_d + i * STEP + o, tl.load(p_s + i * STEP + o, mask=m), mask=m)


@triton.jit
def _move_chunk(a_src, a_dst, nbytes, width, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Copy `nbytes` from address `a_src` to address `a_dst` (int64) at `width` (16, 4, 1):
    ITERS * BLOCK int32 (4 * BLOCK bytes) cover a chunk."""
    # One arange for the 16- and 4-byte copies (one each took ~8% more instructions on sm_90).
    o = tl.arange(0, BLOCK)
    # Each branch makes its own pointers (Triton types a variable once across branches); the
    # 16-byte alignment is restated on the pointer, where the conversion does not lose it.
    if width == 16:
        p_s16 = tl.multiple_of(a_src.to(tl.pointer_type(tl.int32)), 16)
        p_d16 = tl.multiple_of(a_dst.to(tl.pointer_type(tl.int32)), 16)
        _move(p_s16, p_d16, (nbytes // 16) * 4, o, BLOCK, ITERS)  # a multiple of 4: no mask splits a vector
    elif width == 4:
        p_s4, p_d4 = a_src.to(tl.pointer_type(tl.int32)), a_dst.to(tl.pointer_type(tl.int32))
        _move(p_s4, p_d4, nbytes // 4, o, BLOCK, ITERS)
    else:
        p_s1, p_d1 = a_src.to(tl.pointer_type(tl.uint8)), a_dst.to(tl.pointer_type(tl.uint8))
        _move(p_s1, p_d1, nbytes, tl.arange(0, 4 * BLOCK), 4 * BLOCK, ITERS)


@triton.jit
def _row(p_table, i_c, COLUMNS: tl.constexpr):
    """Row i_c of a copy or staging table: its pointer, then (address, slot stride, bytes, width)."""
    p_row = p_table + i_c.to(tl.int64) * COLUMNS
    return p_row, tl.load(p_row), tl.load(p_row + 1), tl.load(p_row + 2), tl.load(p_row + 3)


@triton.jit(do_not_specialize=["num_slots"])
def _copy_slots_kernel(
    p_table, p_src, p_dst, stride_src, stride_dst, num_slots, BLOCK: tl.constexpr, ITERS: tl.constexpr
):
    i_c = tl.program_id(0)
    i_p = tl.program_id(1)
    s = tl.load(p_src + i_p.to(tl.int64) * stride_src)
    d = tl.load(p_dst + i_p.to(tl.int64) * stride_dst)
    if (s <= 0) | (s >= num_slots) | (d <= 0) | (d >= num_slots):  # a padding pair
        return
    _, base, stride, nbytes, width = _row(p_table, i_c, 4)
    _move_chunk(base + s.to(tl.int64) * stride, base + d.to(tl.int64) * stride, nbytes, width, BLOCK, ITERS)


@triton.jit(do_not_specialize=["staging", "n", "first", "num_slots"])
def _stage_slots_kernel(
    p_table, p_slots, stride_slots, staging, n, first, num_slots,
    TO_STAGING: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0)
    i_p = tl.program_id(1)
    s = tl.load(p_slots + i_p.to(tl.int64) * stride_slots)
    if (s <= 0) | (s >= num_slots):  # a padding id: its staging bytes are left as they are
        return
    p_row, base, stride, nbytes, width = _row(p_table, i_c, 8)
    prefix = tl.load(p_row + 4)
    size = tl.load(p_row + 5)
    offset = tl.load(p_row + 6)
    a_cache = base + s.to(tl.int64) * stride
    a_stage = staging.to(tl.int64) + n.to(tl.int64) * prefix + (first + i_p).to(tl.int64) * size + offset
    if TO_STAGING:
        _move_chunk(a_cache, a_stage, nbytes, width, BLOCK, ITERS)
    else:
        _move_chunk(a_stage, a_cache, nbytes, width, BLOCK, ITERS)


def default_chunk() -> int:
    """Chunk bytes of the table: a few large programs for the interpreter (it pays per
    program), 16 KiB on the GPU (four 4 KiB iterations of a 4-warp program)."""
    return 1 << 20 if interpreting() else 16384


def _width(address: int, stride: int, nbytes: int, widths=(16, 4)) -> int:
    return next((w for w in widths if address % w == stride % w == nbytes % w == 0), 1)


def _slots(tensors: Sequence[torch.Tensor], chunk: int) -> list[tuple[int, int, int]]:
    """(address, slot stride, slot bytes) of each of `tensors` ([slots, ...], contiguous within
    a slot), checking the chunk bytes."""
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"chunk must be a positive multiple of 16 bytes; got {chunk}")
    sizes = [t[0].numel() * t.element_size() if t.shape[0] else 0 for t in tensors]
    return [(t.data_ptr(), t.stride(0) * t.element_size(), size) for t, size in zip(tensors, sizes)]


def table_rows(tensors: Sequence[torch.Tensor], chunk: int) -> list[tuple[int, int, int, int]]:
    """The copy table's rows for `tensors` (each [slots, ...], contiguous within a slot), in
    order: chunks of `chunk` bytes (a multiple of 16) of each tensor's slot at the widest
    access it allows: 16-byte aligned tensors a body at 16 and a tail at 4 or 1."""
    rows = []
    for base, stride, size in _slots(tensors, chunk):
        body = size - size % 16 if _width(base, stride, 0, (16,)) == 16 else 0
        tail = _width(base + body, stride, size - body, (4,))
        for start, end, width in ((0, body, 16), (body, size, tail)):
            for off in range(start, end, chunk):
                rows.append((base + off, stride, min(chunk, end - off), width))
    return rows


def copy_table(tensors: Sequence[torch.Tensor], device: torch.device, chunk: int | None = None) -> torch.Tensor:
    """The copy table of `tensors` on `device`. Not capturable (a host-to-device copy)."""
    rows = table_rows(tensors, default_chunk() if chunk is None else chunk)
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, TABLE_COLUMNS).to(device)


def block_for(chunk: int) -> tuple[int, int]:
    """(BLOCK, ITERS): a chunk moves in ITERS iterations of BLOCK int32; one iteration in the
    interpreter (it pays per op), 4 KiB ones on the GPU."""
    block = chunk // 4 if interpreting() else min(1024, chunk // 4)
    block = max(4, triton.next_power_of_2(block))
    return block, max(1, triton.cdiv(chunk, 4 * block))


def copy_slots(table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_slots: int, *, chunk: int | None = None) -> None:
    """Copy every chunk of `table` (`copy_table` with the same `chunk`) from slot src[i] into
    slot dst[i] (int32/int64 [n], any stride). One launch per 65535 pairs; no host sync."""
    src, dst = src.reshape(-1), dst.reshape(-1)
    n, chunks = src.numel(), table.shape[0]
    if n == 0 or chunks == 0:
        return
    block, iters = block_for(default_chunk() if chunk is None else chunk)
    for start in range(0, n, MAX_PAIRS_PER_LAUNCH):
        s, d = src[start : start + MAX_PAIRS_PER_LAUNCH], dst[start : start + MAX_PAIRS_PER_LAUNCH]
        _copy_slots_kernel[(chunks, s.numel())](
            table, s, d, s.stride(0), d.stride(0), num_slots, BLOCK=block, ITERS=iters, num_warps=4
        )


# -- staging: slots <-> one contiguous buffer (host swap) ------------------------------------
STAGE_COLUMNS = 8  # address, slot stride, bytes, width, staging prefix, slot bytes, offset, 0


def staging_order(sizes: Sequence[int], kinds: Sequence | None = None) -> list[int]:
    """Indices of tensors with per-slot byte sizes `sizes` in staging order (stable): by the
    alignment of their size (the largest of 16, 8, 4, 2, 1 dividing it), then tensors of one
    of `kinds` (a hashable per tensor) together, in order of first appearance (docs/design.md
    section 9 says why)."""
    kinds = range(len(sizes)) if kinds is None else kinds
    first = {k: i for i, k in reversed(list(enumerate(kinds)))}
    return sorted(range(len(sizes)), key=lambda i: (-min(16, sizes[i] & -sizes[i] or 16), first[kinds[i]]))


def stage_rows(
    tensors: Sequence[torch.Tensor], chunk: int, kinds: Sequence | None = None
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The staging table's rows for `tensors` (each [slots, ...], contiguous within a slot)
    and each tensor's prefix (staging bytes per slot of the tensors before it).

    For n slots, tensor k (in `staging_order`) holds bytes [n * prefix_k, n * (prefix_k +
    size_k)), slot i at n * prefix_k + i * size_k: [n, *per-slot shape], as an export of that
    tensor alone would hold it. Rows as STAGE_COLUMNS, one width for the whole tensor (a tail
    at another width would break the staging side's alignment)."""
    slots = _slots(tensors, chunk)
    prefixes = [0] * len(slots)
    rows: list[tuple[int, ...]] = []
    prefix = 0
    for k in staging_order([size for *_, size in slots], kinds):
        base, stride, size = slots[k]
        prefixes[k] = prefix
        width = _width(base, stride, size)
        for off in range(0, size, chunk):
            rows.append((base + off, stride, min(chunk, size - off), width, prefix, size, off, 0))
        prefix += size
    return rows, prefixes


def stage_table(rows: Sequence[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, STAGE_COLUMNS).to(device)


def stage_slots(
    table: torch.Tensor, slots: torch.Tensor, staging: torch.Tensor, num_slots: int, *, to_staging: bool,
    chunk: int | None = None,
) -> None:
    """Gather (`to_staging`) every chunk of `table` (`stage_table` with the same `chunk`) of
    `slots` (int32/int64 [n]) into the 16-byte-aligned byte buffer `staging` (at least n x the
    table's bytes per slot) at `stage_rows`' layout, or scatter it back. One launch per 65535
    slots; no host sync. A padding id (<= 0 or >= num_slots) moves nothing."""
    slots = slots.reshape(-1)
    n, chunks = slots.numel(), table.shape[0]
    if n == 0 or chunks == 0:
        return
    if staging.data_ptr() % 16:
        raise ValueError("the staging buffer must be 16-byte aligned")
    block, iters = block_for(default_chunk() if chunk is None else chunk)
    for start in range(0, n, MAX_PAIRS_PER_LAUNCH):
        s = slots[start : start + MAX_PAIRS_PER_LAUNCH]
        _stage_slots_kernel[(chunks, s.numel())](
            table, s, s.stride(0), staging.data_ptr(), n, start, num_slots,
            TO_STAGING=to_staging, BLOCK=block, ITERS=iters, num_warps=4,
        )  # fmt: skip
