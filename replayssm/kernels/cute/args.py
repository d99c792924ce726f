"""Kernel arguments as a few structs, each made from its one spec.

`_struct` makes a `typing.NamedTuple` of DSL values (which the CuTe DSL flattens field by
field into kernel parameters) from a spec in `SPECS`: a pointer as (dtype, alignment in
bytes), a stride as (tensor field, dim, unit[, DSL type]), unit 16 meaning 16-byte units (the
kernels address 16-byte-aligned tensors by vector), a scalar as (VALUE, DSL type). `fake`
(compile-time placeholders) and `raw` (launch-time ints, as the TVM-FFI entry takes them) read
the same spec, so struct, placeholders and values cannot disagree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from cutlass import BFloat16, Float16, Float32, Int8, Int32, Int64, Uint8, Uint32
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer


# A pointer whose element type is the tensor's (one of DSL_DTYPES), aligned to its size.
INPUT_DTYPE = "input"
# A scalar given by value (a Python int), not read off a tensor: (VALUE, DSL type).
VALUE = "value"
DSL_DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16, torch.float16: Float16}
SPECS: dict[type, dict[str, tuple]] = {}


def _scalar(entry: tuple):
    """The DSL type of a stride or VALUE entry (Int64 unless given); None for a pointer."""
    if len(entry) >= 3:
        return entry[3] if len(entry) > 3 else Int64
    return entry[1] if entry[0] == VALUE else None


def _struct(name: str, spec: dict[str, tuple]) -> type:
    """The NamedTuple of `spec`'s fields (a pointer a Pointer, a stride or value its DSL type)."""
    struct = NamedTuple(name, [(f, _scalar(e) or Pointer) for f, e in spec.items()])
    SPECS[struct] = spec
    return struct


Ring = _struct("Ring", {
    "x": (BFloat16, 16),  # [S, H, 16, P]
    "dt": (Float32, 4),  # [S, H, 16] (processed dt)
    "b": (BFloat16, 16),  # [S, G, 16, N]
    "x_stride16": ("x", 0, 16), "dt_stride": ("dt", 0, 1), "b_stride16": ("b", 0, 16),
})  # fmt: skip
Fp8Copy = _struct("Fp8Copy", {
    "codes": (Uint32, 16),  # e4m3 [S, H, P, N], as 32-bit words
    "scales": (Float32, 4),  # [S, H, P]: one power-of-two scale a row
    "codes_stride16": ("codes", 0, 16), "scale_stride": ("scales", 0, 1),
})  # fmt: skip
Nvfp4Copy = _struct("Nvfp4Copy", {
    "codes": (Uint32, 16),  # e2m1 pairs [S, H, P, N / 2], as 32-bit words
    "scales": (Uint8, 1),  # e4m3 [S, H, P, N / 16]: one block scale per 16 values
    "meta": (Float32, 4),  # [S, G, 2]: second-level amax, double-buffered
    "parity": (Int32, 4),  # [S]: the live half of meta
    "codes_stride16": ("codes", 0, 16), "scale_stride": ("scales", 0, 1),
    "meta_stride": ("meta", 0, 1), "parity_stride": ("parity", 0, 1),
})  # fmt: skip
# state_dtype="fp16" has no read copy: the steps read the checkpoint, as 32-bit words.
Fp16Copy = _struct("Fp16Copy", {"state": (Float16, 16), "stride16": ("state", 0, 16)})
Checkpoint = _struct("Checkpoint", {
    "state": (Float16, 16), "stride16": ("state", 0, 16),  # [S, H, P, N]
    "head_offset": (VALUE, Int32),  # the model's head of this cache's head 0 (tensor-parallel shards)
})  # fmt: skip
# The step's inputs, read through their strides (an engine's column slices and tied views are
# neither copied nor converted), and the contiguous output. x, B, C: 16-byte-aligned rows of
# heads (groups) at 64 (128) elements, row strides 32-bit (one IMAD per row offset).
Inputs = _struct("Inputs", {
    "x": (BFloat16, 16),  # [batch, H, 64]
    "dt": (INPUT_DTYPE, 0),  # f32, bf16 or f16 [batch, H] (raw dt)
    "A": (Float32, 4),  # [H]
    "B": (BFloat16, 16),  # [batch, G, 128]
    "C": (BFloat16, 16),  # [batch, G, 128]
    "D": (Float32, 4),  # [H, 64]
    "dt_bias": (Float32, 4),  # [H]
    "out": (BFloat16, 2),  # [batch, H, 64]
    "dt_stride_b": ("dt", 0, 1), "dt_stride_h": ("dt", 1, 1), "a_stride": ("A", 0, 1),
    "dt_bias_stride": ("dt_bias", 0, 1), "d_stride_h": ("D", 0, 1), "d_stride_p": ("D", 1, 1),
    "x_stride16": ("x", 0, 16, Int32), "b_stride16": ("B", 0, 16, Int32), "c_stride16": ("C", 0, 16, Int32),
})  # fmt: skip
# A pending-mode call's inputs (cute/pending.py): x, B, C, out [rows, tokens, n, w] or, varlen,
# [total, n, w] (row strides 0), at 16-byte-aligned rows and tokens; element strides given.
PendingInputs = _struct("PendingInputs", {
    "x": (BFloat16, 16), "dt": (INPUT_DTYPE, 0), "A": (Float32, 4), "B": (BFloat16, 16), "C": (BFloat16, 16),
    "D": (Float32, 4), "dt_bias": (Float32, 4), "out": (BFloat16, 16),
    **{k: (VALUE, Int64) for k in (
        "x_row", "x_tok", "dt_row", "dt_tok", "dt_h", "b_row", "b_tok", "c_row", "c_tok", "o_row", "o_tok",
        "a_stride", "bias_stride", "d_h", "d_p",
    )},
})  # fmt: skip
# The pending plan kernel's rows (int32 [batch, 8], plan.py `PendingPlanKernel`) and the fold
# kernel's work list (int32; the step resets its count, word 0).
PendingPlan = _struct("PendingPlan", {"rows": (Int32, 16), "fold_list": (Int32, 4)})
# The pending fold's test variant: `PendingPlan` and f32 [batch, H, P, N] for every folded row.
PendingDebugPlan = _struct("PendingDebugPlan", {**SPECS[PendingPlan], "state": (Float32, 16)})
FoldParams = _struct("FoldParams", {"A": (Float32, 4), "a_stride": ("A", 0, 1)})  # the fold's A, f32 [H]
# A cache's per-slot bookkeeping, read and written by the plan kernels (parity and meta: NVFP4
# only; the other formats pass positions in their place).
Slots = _struct("Slots", {
    "positions": (Int32, 4),  # [S] (single-token) or [S, 2] (pending)
    "parity": (Int32, 4),  # [S]
    "meta": (Float32, 4),  # [S, G, 2]
    "pos_stride": ("positions", 0, 1), "parity_stride": ("parity", 0, 1), "meta_stride": ("meta", 0, 1),
    "num_slots": (VALUE, Int32),
})  # fmt: skip
# The prepare kernel's plan (`reference.Plan`), one entry a batch row: valid and flush bool,
# slot, ring index, key (the uint32 stream tag) and old parity int64.
Plan = _struct("Plan", {
    "valid": (Int8, 1), "slot": (Int64, 8), "ring_index": (Int64, 8), "flush": (Int8, 1),
    "key": (Int64, 8), "old_parity": (Int64, 8),
})  # fmt: skip
# The flush's test variant: `Plan` and f32 [batch, H, P, N] for every flushed row.
DebugPlan = _struct("DebugPlan", {**SPECS[Plan], "state": (Float32, 16)})


def row_words(dense: bool, bb, stride16, words_per_row: int):
    """32-bit word offset of batch row bb (Int64) of x, B or C: at the constant row stride in
    the `dense` variant (contiguous rows), else at the runtime one (Int32 16-byte units)."""
    if dense:
        return bb * words_per_row
    return Int64(Int32(bb) * stride16 * 4)


def fake(struct: type, **dtypes: torch.dtype):
    """Compile-time placeholders of `struct` (null pointers of the spec's types; a field
    of the input's own type takes it from `dtypes`, float32 by default)."""
    values = []
    for name, entry in SPECS[struct].items():
        if (scalar := _scalar(entry)) is not None:
            values.append(scalar(0))
        elif entry[0] == INPUT_DTYPE:
            dtype = dtypes.get(name, torch.float32)
            values.append(make_ptr(DSL_DTYPES[dtype], 0, assumed_align=dtype.itemsize))
        else:
            values.append(make_ptr(entry[0], 0, assumed_align=entry[1]))
    return struct(*values)


def raw(struct: type, **tensors) -> list[int]:
    """`struct`'s fields as ints for the given tensors (one per pointer field): addresses,
    strides in the spec's units, VALUE fields' ints."""
    out = []
    for name, entry in SPECS[struct].items():
        if len(entry) >= 3:
            t, dim = tensors[entry[0]], entry[1]
            out.append(t.stride(dim) * t.element_size() // 16 if entry[2] == 16 else t.stride(dim))
        elif entry[0] == VALUE:
            out.append(int(tensors[name]))
        else:
            out.append(tensors[name].data_ptr())
    return out


__all__ = [
    "PendingInputs", "PendingPlan", "PendingDebugPlan", "FoldParams", "raw", "row_words", "DSL_DTYPES",
    "Ring", "Fp8Copy", "Nvfp4Copy", "Fp16Copy", "Checkpoint", "Inputs", "Plan", "DebugPlan", "Slots", "SPECS",
    "fake",
]
