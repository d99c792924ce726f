"""The plan kernels (CuTe DSL): the first launch of every decode call, bit-exact with the
reference's bookkeeping, with no host sync and no allocation, so a CUDA graph captures them
(the seed baked in, freshness from the device-resident positions). Live slots are unique
(API precondition), so one thread touches a slot's positions, parity and meta; padding
rows write nothing in the cache.

`Prepare`: single-token mode's (`reference.prepare_decode`; docs/design.md sections 1-2),
a CTA a row. `PendingPlanKernel`: pending mode's (docs/format.md section 5b steps 1-2), a
thread a row; its plan row is PLAN_COLS int32 words (slot or -1, c', f_old, nf, the live
parity, the fold's stream key, the first token, T_b) and the rows that fold are appended
to the fold's work list (a count the step resets, then rows).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
import tvm_ffi
from cuda.bindings import driver as cuda_driver
from cutlass import Float32, Int8, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cute.typing import Pointer

from ... import layout as L
from ...pending import grid as pending_grid
from ...quant.rng import seed_key_i32
from ..buffers import PLAN_COLS
from . import args as A
from .bits import mix32, sel
from .launch import compile_entry

THREADS = 128
ID_DTYPES = {torch.int32: Int32, torch.int64: Int64}


def slots_words(cache, fmt) -> tuple:
    """`Slots` of a cache tuple as the kernels' TVM-FFI entry takes it."""
    pos = cache[L.POSITIONS]
    parity, meta = (cache[L.PARITY], cache[L.META]) if fmt.two_level else (pos, pos)
    return tuple(A.raw(A.Slots, positions=pos, parity=parity, meta=meta, num_slots=cache[L.CHECKPOINT].shape[0]))


@cute.jit
def stream_key(seed: Int32, slot: Int64, position: Int32) -> Uint32:
    """quant/rng.py `stream_key` from the seed's key (int32 bits) and the low 32 bits of
    slot and position."""
    k = mix32(Uint32(seed) ^ Uint32(Int32(slot)))
    return mix32(k ^ Uint32(position))


@cute.jit
def row_slot(ids, i: Int64, ids_stride: Int64, num_slots: Int32):
    """(valid, slot) of batch row i: valid (Int32 0/1) when 0 < id < num_slots; slot 0 for padding."""
    raw = Int64(ids[i * ids_stride])
    valid = sel(raw > Int64(0), Int32(1), Int32(0)) * sel(raw < Int64(num_slots), Int32(1), Int32(0))
    return valid, sel(valid != Int32(0), raw, Int64(0))


class Prepare:
    """Single-token mode's plan kernel for one (groups, output row, format, trigger); the
    ids' type is the compile-time pointer's. `trigger`: signal dependent launch at once, so
    the PDL kernel behind it becomes resident while it runs (it still waits for the grid)."""

    def __init__(self, groups: int, out_row: int, two_level: bool, trigger: bool) -> None:
        self.groups, self.out_row, self.two_level, self.trigger = groups, out_row, two_level, trigger

    @cute.jit
    def __call__(self, ids: Pointer, ids_stride: Int64, slots: A.Slots, out: Pointer, plan: A.Plan, seed: Int32, batch: Int32, stream: cuda_driver.CUstream):
        self.kernel(ids, ids_stride, slots, out, plan, seed).launch(grid=[batch, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ids, ids_stride, slots, out, plan, seed):
        t, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.trigger):
            cute.arch.griddepcontrol_launch_dependents()
        bb = Int64(b)
        valid, slot = row_slot(ids, bb, ids_stride, slots.num_slots)
        if valid == Int32(0):
            for i in range(Int32(t), Int32(self.out_row), Int32(THREADS)):
                out[bb * self.out_row + Int64(i)] = cutlass.Int16(0)
        if t == 0:
            pos = Int32(0)
            if valid != Int32(0):
                pos = slots.positions[slot * slots.pos_stride]
                slots.positions[slot * slots.pos_stride] = pos + Int32(1)
            ring = pos & Int32(L.RING - 1)  # pos mod 16 for every int32 (two's complement)
            flush = valid * sel(ring == Int32(L.RING - 1), Int32(1), Int32(0))
            old = Int32(0)
            if cutlass.const_expr(self.two_level):
                if flush != Int32(0):
                    p = slot * slots.parity_stride
                    old = slots.parity[p]
                    slots.parity[p] = Int32(1) - old
                    for g in cutlass.range_constexpr(self.groups):
                        # `old & 1`: a corrupt parity word must not send the store outside meta[slot].
                        slots.meta[slot * slots.meta_stride + Int64(2 * g) + Int64(old & Int32(1))] = Float32(0.0)
            plan.valid[bb] = Int8(valid)
            plan.slot[bb] = slot
            plan.ring_index[bb] = Int64(ring)
            plan.flush[bb] = Int8(flush)
            plan.key[bb] = Int64(stream_key(seed, slot, pos))
            plan.old_parity[bb] = Int64(old)


class PendingPlanKernel:
    """Pending mode's plan kernel for one (T, groups, verdicts given, varlen, format)."""

    def __init__(self, T: int, groups: int, has_acc: bool, varlen: bool, two_level: bool) -> None:
        self.T, self.groups, self.has_acc, self.varlen, self.two_level = T, groups, has_acc, varlen, two_level

    @cute.jit
    def __call__(self, ids: Pointer, ids_stride: Int64, acc: Pointer, cu: Pointer, slots: A.Slots, plan: A.PendingPlan,
                 batch: Int32, grid: Int32, seed: Int32, stream: cuda_driver.CUstream):  # fmt: skip
        blocks = (batch + Int32(THREADS - 1)) // Int32(THREADS)
        self.kernel(ids, ids_stride, acc, cu, slots, plan, batch, grid, seed).launch(grid=[blocks, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ids, ids_stride, acc, cu, slots, plan, batch, grid, seed):
        t, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        i = bx * Int32(THREADS) + t
        if i < batch:
            ii = Int64(i)
            valid, slot = row_slot(ids, ii, ids_stride, slots.num_slots)
            c, q = Int32(0), Int32(0)
            p = slot * slots.pos_stride
            if valid != Int32(0):
                c, q = slots.positions[p], slots.positions[p + Int64(1)]
            a = q
            if cutlass.const_expr(self.has_acc):
                verdict = Int64(0)
                if valid != Int32(0):
                    verdict = Int64(acc[ii])
                at_least_0 = sel(verdict < Int64(0), Int64(0), verdict)  # min(max(v, 0), q), as the reference
                a = Int32(sel(at_least_0 > Int64(q), Int64(q), at_least_0))
            cn = c + a
            f_old = (c // grid) * grid
            f_new = (cn // grid) * grid
            nf = valid * (f_new - f_old)
            start, tb = Int32(0), Int32(self.T)
            if cutlass.const_expr(self.varlen):
                start = cu[ii]
                tb = cu[ii + Int64(1)] - start
            if valid != Int32(0):
                slots.positions[p] = cn
                slots.positions[p + Int64(1)] = tb
            live = Int32(0)
            if cutlass.const_expr(self.two_level):
                old = Int32(0)
                if valid != Int32(0):
                    old = slots.parity[slot * slots.parity_stride] & Int32(1)
                live = old
                if nf > Int32(0):
                    live = Int32(1) - old
                    slots.parity[slot * slots.parity_stride] = live
                    for g in cutlass.range_constexpr(self.groups):
                        slots.meta[slot * slots.meta_stride + Int64(2 * g) + Int64(old)] = Float32(0.0)
            row = ii * PLAN_COLS
            words = (sel(valid != Int32(0), Int32(slot), Int32(-1)), cn, f_old, nf, live, Int32(stream_key(seed, slot, f_new)), start, tb)
            for k in cutlass.range_constexpr(PLAN_COLS):
                plan.rows[row + Int64(k)] = words[k]
            if nf > Int32(0):
                at = cute.arch.atomic_add(plan.fold_list, Int32(1), sem="relaxed", scope="gpu")
                plan.fold_list[Int64(at) + Int64(1)] = i


def _ptr(dtype, align: int):
    return make_ptr(dtype, 0, assumed_align=align)


def prepare_kernel(groups: int, out_row: int, two_level: bool, trigger: bool, ids_dtype: torch.dtype) -> tuple[Prepare, list]:
    """The prepare kernel object and its compile-time arguments."""
    idt = ID_DTYPES[ids_dtype]
    fake = [_ptr(idt, ids_dtype.itemsize), Int64(0), A.fake(A.Slots), _ptr(cutlass.Int16, 2), A.fake(A.Plan), Int32(0), Int32(0), make_fake_stream()]
    return Prepare(groups, out_row, two_level, trigger), fake


def pending_plan_kernel(T: int, groups: int, has_acc: bool, varlen: bool, two_level: bool, ids_dtype: torch.dtype, acc_dtype: torch.dtype):
    """The pending plan kernel object and its compile-time arguments."""
    idt, adt = ID_DTYPES[ids_dtype], ID_DTYPES[acc_dtype]
    fake = [
        _ptr(idt, ids_dtype.itemsize), Int64(0), _ptr(adt, acc_dtype.itemsize), _ptr(Int32, 4), A.fake(A.Slots), A.fake(A.PendingPlan),
        Int32(0), Int32(1), Int32(0), make_fake_stream(),
    ]  # fmt: skip
    return PendingPlanKernel(T, groups, has_acc, varlen, two_level), fake


@functools.lru_cache(maxsize=None)
def compiled_prepare(arch: str, groups: int, out_row: int, two_level: bool, ids_dtype: torch.dtype):
    """The compiled prepare kernel (with the early trigger: every arch of the table has PDL)."""
    return compile_entry(*prepare_kernel(groups, out_row, two_level, True, ids_dtype), arch)


@functools.lru_cache(maxsize=None)
def compiled_pending_plan(arch: str, T: int, groups: int, has_acc: bool, varlen: bool, two_level: bool, ids_dtype, acc_dtype):
    return compile_entry(*pending_plan_kernel(T, groups, has_acc, varlen, two_level, ids_dtype, acc_dtype), arch)


class PrepareLaunch:
    """The prepare launches of one cache, plan scratch (`buffers.PlanScratch`), format and
    seed: the structs made once as ffi.Arrays of ints, the kernel of each ids dtype looked
    up once; it holds no tensor."""

    __slots__ = ("slots", "plan", "seed", "key", "entries")

    def __init__(self, cache, scratch, fmt, seed: int, arch: str) -> None:
        self.slots = tvm_ffi.convert(slots_words(cache, fmt))
        self.plan = tvm_ffi.convert(scratch.words)
        self.seed = seed_key_i32(seed)
        self.key = (arch, cache[L.B_RING].shape[1], cache[L.CHECKPOINT].shape[1] * L.dims(cache)[0], fmt.two_level)
        self.entries: dict[torch.dtype, object] = {}

    def __call__(self, ids: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """Plan the rows of `ids` (1-D int32 / int64) into the scratch; zero padding rows of `out`."""
        fn = self.entries.get(ids.dtype)
        if fn is None:
            fn = self.entries[ids.dtype] = compiled_prepare(*self.key, ids.dtype)
        fn(ids.data_ptr(), ids.stride()[0], self.slots, out.data_ptr(), self.plan, self.seed, ids.numel(), stream)


class PendingPlanLaunch:
    """The pending plan launches of one cache, plan buffer (`buffers.PendingPlan`), format,
    seed and max_seqlen (structs made once, as `PrepareLaunch`)."""

    __slots__ = ("slots", "plan", "seed", "grid", "key", "two_level")

    def __init__(self, cache, plan, fmt, seed: int, max_seqlen: int, arch: str) -> None:
        self.slots = slots_words(cache, fmt)
        self.plan = plan.words
        self.seed = seed_key_i32(seed)
        self.grid = pending_grid(max_seqlen)
        self.key = (arch, max_seqlen, cache[L.B_RING].shape[1])
        self.two_level = fmt.two_level

    def __call__(self, ids: torch.Tensor, accepted, cu_seqlens, stream: int) -> None:
        """Plan the rows of `ids` (1-D) with verdicts `accepted` and `cu_seqlens` (None: not given)."""
        acc = ids if accepted is None else accepted
        cu = ids if cu_seqlens is None else cu_seqlens
        fn = compiled_pending_plan(*self.key, accepted is not None, cu_seqlens is not None, self.two_level, ids.dtype, acc.dtype)
        fn(ids.data_ptr(), ids.stride(0), acc.data_ptr(), cu.data_ptr(), self.slots, self.plan, ids.shape[0], self.grid, self.seed, stream)


__all__ = [
    "slots_words", "Prepare", "PendingPlanKernel", "prepare_kernel", "pending_plan_kernel",
    "compiled_prepare", "compiled_pending_plan", "PrepareLaunch", "PendingPlanLaunch",
]  # fmt: skip
