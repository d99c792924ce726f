"""Prepare kernel: the per-row decode plan (`reference.Plan`), bit-exact with
`reference.prepare_decode`, written into caller-owned scratch.

Grid (batch,): program i_b reads row i_b's slot id and
- writes the plan row: valid, slot (0 for padding rows), ring_index = positions[slot] mod
  16, flush = valid and ring_index == 15, key = stream tag of (seed, slot, position) and
  old_parity (NVFP4 flush rows: parity[slot] before the step; 0 otherwise). Padding rows
  get the reference's values too (slot 0, position 0, key of slot 0 at position 0);
- zeroes output row i_b when it is padding;
- advances positions[slot] by one (valid rows);
- NVFP4 flush rows: flips parity[slot] and zeroes meta[slot, g, old_parity] for every
  group g, the half that becomes the amax accumulator of the flush.
Live slots are unique (API precondition), so each slot's positions / parity / meta are
touched by one program only; padding rows write nothing in the cache. No host sync, no
allocation: a CUDA graph captures the launch with the seed baked in, and freshness comes
from the device-resident positions.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import layout as L
from ...formats import Format
from ...quant.rng import seed_key
from ...reference import Plan
from .bits import stream_key
from .launch import int32_pattern, interpreting, keep


@triton.jit(do_not_specialize=["stride_ids", "stride_pos", "stride_parity", "stride_meta", "num_slots", "seed_key"])
def _prepare_kernel(
    p_ids,
    p_pos,
    p_parity,
    p_meta,
    p_out,
    p_valid,
    p_slot,
    p_ring,
    p_flush,
    p_key,
    p_old,
    stride_ids,
    stride_pos,
    stride_parity,
    stride_meta,
    num_slots,
    seed_key,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    OUT_ROW: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    NVFP4: tl.constexpr,
    TRIGGER: tl.constexpr = False,
):
    if TRIGGER:
        # Programmatic dependent launch: a PDL-launched non-flush kernel behind this one
        # may start now; it still waits (griddepcontrol.wait) for this grid to complete.
        tl.extra.cuda.gdc_launch_dependents()
    i_b = tl.program_id(0)
    raw = tl.load(p_ids + i_b.to(tl.int64) * stride_ids)
    valid = (raw > 0) & (raw < num_slots)
    slot = tl.where(valid, raw, 0).to(tl.int64)
    pos = tl.load(p_pos + slot * stride_pos, mask=valid, other=0)
    ring = pos & 15  # == pos mod 16 for every int32 (two's complement), as the reference's int64 %
    flush = valid & (ring == 15)
    key = stream_key(seed_key, slot, pos)
    tl.store(p_pos + slot * stride_pos, pos + 1, mask=valid)
    old = tl.zeros([], tl.int32)
    if NVFP4:
        old = tl.load(p_parity + slot * stride_parity, mask=flush, other=0)
        tl.store(p_parity + slot * stride_parity, 1 - old, mask=flush)
        o_g = tl.arange(0, BLOCK_G)
        # `old & 1`: a corrupt parity word must not send the store outside meta[slot].
        p_m = p_meta + slot * stride_meta + o_g * 2 + (old & 1)
        tl.store(p_m, tl.zeros([BLOCK_G], tl.float32), mask=o_g < tl.where(flush, G, 0))
    o_out = tl.arange(0, BLOCK_OUT)
    p_o = p_out + i_b.to(tl.int64) * OUT_ROW + o_out
    tl.store(p_o, tl.zeros([BLOCK_OUT], tl.int16), mask=o_out < tl.where(valid, 0, OUT_ROW))
    tl.store(p_valid + i_b, valid.to(tl.int8))
    tl.store(p_slot + i_b, slot)
    tl.store(p_ring + i_b, ring.to(tl.int64))
    tl.store(p_flush + i_b, flush.to(tl.int8))
    tl.store(p_key + i_b, key.to(tl.int64))
    tl.store(p_old + i_b, old.to(tl.int64))


# The prepare kernel signals programmatic dependent launch (griddepcontrol.launch_dependents)
# as it starts, not only implicitly as it completes: the PDL-launched kernel right behind it
# (cute/launch.py) becomes resident while prepare runs and waits for the whole prepare
# grid either way. H200, project benchmark at batch 1, 16 heads / 2 groups, same call,
# alternated twice: FP8 3.90 -> 3.48, NVFP4 4.18 -> 3.76 us a step (docs/design.md).
# NVIDIA GPUs of compute capability 9.0 and up only (griddepcontrol is sm_90 PTX), never
# in the interpreter.


@functools.cache
def _has_griddepcontrol(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (9, 0)


def prepare_trigger(device: torch.device) -> bool:
    """Whether the prepare kernel for `device` is compiled with the early trigger."""
    if interpreting() or device.type != "cuda":
        return False
    return _has_griddepcontrol(device.index if device.index is not None else torch.cuda.current_device())


class PlanScratch:
    """Device buffers for the plan of up to `rows` batch rows, in `reference.Plan`'s dtypes:
    valid / flush bool, slot / ring_index / old_parity int64, key int64 holding the uint32
    stream tag (0 .. 2**32 - 1, as quant/rng.py `stream_key` returns it).

    `plan(batch)` returns views of the first `batch` rows, so a decode step allocates no
    device memory. A later `prepare_decode` into the same scratch overwrites them: consume
    a plan (launch the kernels that read it) before preparing the next one on that stream.
    """

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows = rows
        self.device = torch.device(device)
        self.valid = torch.zeros(rows, dtype=torch.bool, device=device)
        self.slot = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ring_index = torch.zeros(rows, dtype=torch.int64, device=device)
        self.flush = torch.zeros(rows, dtype=torch.bool, device=device)
        self.key = torch.zeros(rows, dtype=torch.int64, device=device)
        self.old_parity = torch.zeros(rows, dtype=torch.int64, device=device)
        self._plans: dict[int, Plan] = {}
        # The buffers' addresses: what a `Prepare` launch of this scratch is keyed by.
        self.addresses = tuple(t.data_ptr() for t in (self.valid, self.slot, self.ring_index, self.flush, self.key, self.old_parity))

    def plan(self, batch: int) -> Plan:
        """Views of the first `batch` rows (made once per batch size)."""
        plan = self._plans.get(batch)
        if plan is None:
            plan = self._plans[batch] = Plan(
                self.valid[:batch],
                self.slot[:batch],
                self.ring_index[:batch],
                self.flush[:batch],
                self.key[:batch],
                self.old_parity[:batch],
            )
        return plan


def prepare_decode(
    cache, ids: torch.Tensor, out: torch.Tensor, scratch: PlanScratch, *, fmt: Format, seed: int, stream: int | None = None
) -> Plan:
    """Plan of the rows of `ids` (int32/int64 [batch], batch <= scratch.rows) into
    `scratch`; zero the padding rows of `out` (contiguous [batch, H, 64], 2-byte dtype);
    advance positions; NVFP4 flush rows flip parity and zero the accumulator half of meta.
    Separate mode only (positions [S]). `stream`: the current CUDA stream's handle. One
    launch through Triton's path; a caller launching repeatedly keeps a `Prepare` (the
    kernel backend does, per cache)."""
    if ids.dim() != 1:
        ids = ids.reshape(-1)
    batch = ids.shape[0]
    if batch == 0:
        return scratch.plan(0)
    launch = Prepare(cache, scratch, batch, fmt, seed, ids)
    launch(ids, out, stream, cache, scratch)
    return launch.plan


class Prepare:
    """The prepare launch of one cache, plan scratch, batch size, format and seed, with
    every argument but the ids and the output made once. It holds addresses, not tensors,
    so it keeps no cache alive; its keeper must give it the cache and scratch it was made
    for (the kernel backend keys its `Prepare`s per cache tuple).

    A repeated launch skips Triton's per-call dispatch (binding, specialization key, cache
    lookup: most of its host time). Every runtime integer is unspecialized
    (`do_not_specialize`), so the compiled kernel depends only on the constexprs, the
    dtypes and the 16-byte alignment of the pointers (Triton specializes pointers on it);
    only the ids' and the output's alignment can change between calls, and with them the
    compiled kernel, kept here per alignment. The first launch of each goes through
    Triton's launcher with tensors and returns the compiled kernel; later ones launch it
    with the fixed pointers as addresses (`launch.Compiled`: cuLaunchKernel on a proven
    parameter layout, else Triton's launch). The interpreter, and calls without a stream,
    take Triton's path."""

    def __init__(self, cache, scratch: PlanScratch, batch: int, fmt: Format, seed: int, ids: torch.Tensor) -> None:
        self.batch = batch
        self.plan = scratch.plan(batch)
        pos = cache[L.POSITIONS]
        if fmt.two_level:
            meta, parity = cache[L.META], cache[L.PARITY]
            groups = meta.shape[1]
        else:
            meta = parity = pos  # unused (the NVFP4 branch is compiled out)
            groups = 1
        out_row = cache[L.CHECKPOINT].shape[1] * L.HEAD_DIM
        self.two_level = fmt.two_level
        self.head = tuple(t.data_ptr() for t in (pos, parity, meta))
        self.tail = scratch.addresses
        self.strides = (pos.stride(0), parity.stride(0), meta.stride(0), cache[L.CHECKPOINT].shape[0], int32_pattern(seed_key(seed)))
        self.constexprs = (groups, triton.next_power_of_2(groups), out_row, triton.next_power_of_2(out_row), fmt.two_level, prepare_trigger(ids.device))
        self.compiled: dict[tuple, object] = {}
        self.interpreting = interpreting()

    def __call__(self, ids: torch.Tensor, out: torch.Tensor, stream: int | None, cache, scratch: PlanScratch) -> None:
        """Launch for `ids` and `out`; `cache` and `scratch` (those this launch was made
        for) are passed as tensors to a launch through Triton's path."""
        ids_ptr, out_ptr = ids.data_ptr(), out.data_ptr()
        align = (ids_ptr % 16 == 0, out_ptr % 16 == 0)
        kernel = self.compiled.get(align) if stream is not None and not self.interpreting else None
        if kernel is None:
            pos = cache[L.POSITIONS]
            head = (pos, cache[L.PARITY], cache[L.META]) if self.two_level else (pos, pos, pos)
            tail = (scratch.valid.view(torch.int8), scratch.slot, scratch.ring_index, scratch.flush.view(torch.int8), scratch.key, scratch.old_parity)
            args = (ids, *head, out.view(torch.int16), *tail, ids.stride(0), *self.strides, *self.constexprs)
            keep(self.compiled, align, _prepare_kernel[(self.batch,)](*args, num_warps=4), stream)
            return
        kernel((self.batch, 1, 1), stream, (ids_ptr, *self.head, out_ptr, *self.tail, ids.stride(0), *self.strides, *self.constexprs))
