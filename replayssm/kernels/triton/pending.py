"""Pending mode's plan kernel (speculative decoding, docs/format.md section 5b): the first of
a call's launches (then the CuTe fold and step of `kernels/cute/pending.py`); no host sync,
no allocation once a plan buffer of the batch size exists, so a CUDA graph captures it.

`_plan_kernel`, grid (cdiv(batch, BLOCK),): per row, the commit and the fold decision of
`pending.pending_decode` steps 1-2 from the device-resident positions (c, q):
a = clamp(num_accepted, 0, q) (q when None), c' = c + a, f_old = f(c), f_new = f(c');
positions become (c', T_b); NVFP4 rows that fold flip parity and zero the half of meta
that becomes the amax accumulator (as separate mode's prepare does for its flush). It
writes the plan row (PLAN_COLS int32 words: slot or -1, c', f_old, nf = f_new - f_old,
the live parity, the fold's stream key, the row's first token, T_b) and appends the rows
that fold to the fold's work list (its count is reset by the step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import layout as L
from ...formats import Format
from ...pending import grid as pending_grid
from ...quant.rng import seed_key
from .bits import stream_key
from .launch import int32_pattern, interpreting, keep

# Int32 words of a plan row (the CuTe fold and step read them as their plan rows).
PLAN_COLS = 8


@triton.jit(do_not_specialize=["batch", "stride_ids", "stride_pos", "stride_parity", "stride_meta", "num_slots", "grid", "seed_key"])
def _plan_kernel(
    p_ids,
    p_pos,
    p_acc,
    p_cu,
    p_parity,
    p_meta,
    p_plan,
    p_list,
    batch,
    stride_ids,
    stride_pos,
    stride_parity,
    stride_meta,
    num_slots,
    grid,
    seed_key,
    T: tl.constexpr,
    G: tl.constexpr,
    HAS_ACC: tl.constexpr,
    VARLEN: tl.constexpr,
    NVFP4: tl.constexpr,
    BLOCK: tl.constexpr,
):
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = o_b < batch
    raw = tl.load(p_ids + o_b.to(tl.int64) * stride_ids, mask=row, other=0)
    valid = row & (raw > 0) & (raw < num_slots)
    slot = tl.where(valid, raw, 0).to(tl.int64)
    c = tl.load(p_pos + slot * stride_pos, mask=valid, other=0)
    q = tl.load(p_pos + slot * stride_pos + 1, mask=valid, other=0)
    if HAS_ACC:
        acc = tl.load(p_acc + o_b, mask=valid, other=0).to(tl.int64)
        a = tl.minimum(tl.maximum(acc, 0), q.to(tl.int64)).to(tl.int32)
    else:
        a = q
    cn = c + a
    f_old = (c // grid) * grid
    f_new = (cn // grid) * grid
    nf = tl.where(valid, f_new - f_old, 0)
    if VARLEN:
        start = tl.load(p_cu + o_b, mask=row, other=0)
        tb = tl.load(p_cu + o_b + 1, mask=row, other=0) - start
    else:
        start = tl.zeros([BLOCK], tl.int32)
        tb = tl.full([BLOCK], T, tl.int32)
    tl.store(p_pos + slot * stride_pos, cn, mask=valid)
    tl.store(p_pos + slot * stride_pos + 1, tb, mask=valid)
    live = tl.zeros([BLOCK], tl.int32)
    if NVFP4:
        fold = nf > 0
        old = tl.load(p_parity + slot * stride_parity, mask=valid, other=0) & 1
        live = tl.where(fold, 1 - old, old)
        tl.store(p_parity + slot * stride_parity, live, mask=fold)
        for g in tl.static_range(G):
            tl.store(p_meta + slot * stride_meta + g * 2 + old, tl.zeros([BLOCK], tl.float32), mask=fold)
    key = stream_key(seed_key, slot, f_new).to(tl.int32, bitcast=True)
    p_row = p_plan + o_b.to(tl.int64) * 8
    tl.store(p_row + 0, tl.where(valid, slot.to(tl.int32), -1), mask=row)
    tl.store(p_row + 1, cn, mask=row)
    tl.store(p_row + 2, f_old, mask=row)
    tl.store(p_row + 3, nf, mask=row)
    tl.store(p_row + 4, live, mask=row)
    tl.store(p_row + 5, key, mask=row)
    tl.store(p_row + 6, start, mask=row)
    tl.store(p_row + 7, tb, mask=row)
    # Rows that fold join the fold's work list: p_list[0] counts them (reset to 0 by the
    # step, which runs after the fold), p_list[1 + i] are their rows.
    fold_row = nf > 0
    at = tl.atomic_add(p_list + tl.zeros([BLOCK], tl.int32), fold_row.to(tl.int32), mask=fold_row, sem="relaxed")
    tl.store(p_list + 1 + at, o_b, mask=fold_row)


class PendingPlan:
    """Plan buffers for up to `rows` batch rows: `buf` (int32 [rows, PLAN_COLS], the
    words `_plan_row` names; `view(batch)` is its first rows, so a call allocates nothing) and the fold
    work list (int32 [rows + 1]: a count, zero between calls, then rows)."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows = rows
        self.buf = torch.zeros(rows, PLAN_COLS, dtype=torch.int32, device=device)
        self.fold_list = torch.zeros(rows + 1, dtype=torch.int32, device=device)

    def view(self, batch: int) -> torch.Tensor:
        return self.buf[:batch]


def _plan_arguments(cache, plan: PendingPlan, ids, accepted, cu_seqlens, fmt: Format, seed: int, max_seqlen: int):
    """The plan kernel's arguments (tensors, then its scalars) and constexprs for a call
    of `ids` (1-D) with verdicts `accepted` and `cu_seqlens` (None: not given; the ids
    fill their slots, unread)."""
    pos = cache[L.POSITIONS]
    meta, parity = (cache[L.META], cache[L.PARITY]) if fmt.two_level else (pos, pos)  # unused for FP8
    batch = ids.shape[0]
    acc = accepted if accepted is not None else ids
    cu = cu_seqlens if cu_seqlens is not None else ids
    args = (
        ids, pos, acc, cu, parity, meta, plan.view(batch), plan.fold_list,
        batch, ids.stride(0), pos.stride(0), parity.stride(0), meta.stride(0), cache[L.CHECKPOINT].shape[0],
        pending_grid(max_seqlen), int32_pattern(seed_key(seed)),
    )  # fmt: skip
    constexprs = dict(T=max_seqlen, G=cache[L.B_RING].shape[1], HAS_ACC=accepted is not None,
                      VARLEN=cu_seqlens is not None, NVFP4=fmt.two_level, BLOCK=64 if interpreting() else 128)  # fmt: skip
    return args, constexprs


class PlanLaunch:
    """The plan launch of one cache, plan buffer, format, seed and max_seqlen, with every
    argument but the ids, the verdicts and cu_seqlens made once (addresses, not tensors:
    its keeper gives it the cache and plan it was made for). Every runtime integer of the
    plan kernel is unspecialized, so the compiled kernel depends on the dtypes and 16-byte
    alignment of the three per-call tensors and on whether verdicts and cu_seqlens are
    given; the first launch of each goes through Triton's launcher with tensors, later
    ones launch it with addresses (`launch.Compiled`)."""

    def __init__(self, cache, plan: PendingPlan, fmt: Format, seed: int, max_seqlen: int) -> None:
        self.args = (fmt, seed, max_seqlen)
        ids = plan.fold_list[:1]  # stands in for the per-call tensors
        args, constexprs = _plan_arguments(cache, plan, ids, None, None, fmt, seed, max_seqlen)
        self.middle = tuple(t.data_ptr() for t in args[4:8])  # parity, meta, plan rows, fold list
        self.pos = args[1].data_ptr()
        self.scalars = args[10:]
        self.constexprs = constexprs
        self.compiled: dict[tuple, object] = {}

    def __call__(self, cache, plan: PendingPlan, ids, accepted, cu_seqlens, stream: int) -> None:
        """Launch for `ids` (1-D), `accepted` and `cu_seqlens` (None: not given) on stream
        handle `stream`."""
        batch = ids.shape[0]
        acc = accepted if accepted is not None else ids
        cu = cu_seqlens if cu_seqlens is not None else ids
        ptrs = (ids.data_ptr(), acc.data_ptr(), cu.data_ptr())
        key = (ids.dtype, acc.dtype, cu.dtype, accepted is None, cu_seqlens is None, *(p % 16 == 0 for p in ptrs))
        kernel = self.compiled.get(key)
        blocks = triton.cdiv(batch, self.constexprs["BLOCK"])
        if kernel is None:
            args, constexprs = _plan_arguments(cache, plan, ids, accepted, cu_seqlens, *self.args)
            keep(self.compiled, key, _plan_kernel[(blocks,)](*args, **constexprs, num_warps=4), stream)
            return
        c = self.constexprs
        kernel(
            (blocks, 1, 1), stream,
            (ptrs[0], self.pos, ptrs[1], ptrs[2], *self.middle, batch, ids.stride(0), *self.scalars,
             c["T"], c["G"], accepted is not None, cu_seqlens is not None, c["NVFP4"], c["BLOCK"]),
        )  # fmt: skip
