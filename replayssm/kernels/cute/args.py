"""Kernel arguments as a few structs, built from one spec.

A struct is a `typing.NamedTuple` of DSL values, which the CuTe DSL flattens field by field
into kernel parameters. `SPECS` lists each struct's fields once: a pointer as (dtype,
alignment in bytes), a stride as (tensor field, dim, unit[, DSL type]), unit 16 meaning
16-byte units (the kernels address 16-byte-aligned tensors by vector). `fake` (compile-time
placeholders) and `raw` (launch-time ints, as the TVM-FFI entry takes them) both read it, so
the two cannot disagree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from cutlass import BFloat16, Float16, Float32, Int8, Int32, Int64, Uint8, Uint32
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer


class Ring(NamedTuple):
    x: Pointer  # bf16 [S, H, 16, P]
    dt: Pointer  # f32 [S, H, 16] (processed dt)
    b: Pointer  # bf16 [S, G, 16, N]
    x_stride16: Int64
    dt_stride: Int64
    b_stride16: Int64


class Fp8Copy(NamedTuple):
    codes: Pointer  # e4m3 [S, H, P, N], as 32-bit words
    scales: Pointer  # f32 [S, H, P]: one power-of-two scale a row
    codes_stride16: Int64
    scale_stride: Int64


class Nvfp4Copy(NamedTuple):
    codes: Pointer  # e2m1 pairs [S, H, P, N / 2], as 32-bit words
    scales: Pointer  # e4m3 [S, H, P, N / 16]: one block scale per 16 values
    meta: Pointer  # f32 [S, G, 2]: second-level amax, double-buffered
    parity: Pointer  # int32 [S]: the live half of meta
    codes_stride16: Int64
    scale_stride: Int64
    meta_stride: Int64
    parity_stride: Int64


class Fp16Copy(NamedTuple):
    """state_dtype="fp16": no read copy; the steps read the checkpoint itself."""

    state: Pointer  # f16 [S, H, P, N]: the checkpoint, as 32-bit words
    stride16: Int64


class Checkpoint(NamedTuple):
    state: Pointer  # f16 [S, H, P, N]
    stride16: Int64
    head_offset: Int32  # the model's head of this cache's head 0 (tensor-parallel shards)


class Inputs(NamedTuple):
    """The step's inputs, read through their strides (an engine's column slices and tied views
    are neither copied nor converted), and the contiguous output. x, B, C: 16-byte-aligned
    rows of heads (groups) at 64 (128) elements each."""

    x: Pointer  # bf16 [batch, H, 64]
    dt: Pointer  # f32, bf16 or f16 [batch, H] (raw dt)
    A: Pointer  # f32 [H]
    B: Pointer  # bf16 [batch, G, 128]
    C: Pointer  # bf16 [batch, G, 128]
    D: Pointer  # f32 [H, 64]
    dt_bias: Pointer  # f32 [H]
    out: Pointer  # bf16 [batch, H, 64]
    dt_stride_b: Int64
    dt_stride_h: Int64
    a_stride: Int64
    dt_bias_stride: Int64
    d_stride_h: Int64
    d_stride_p: Int64
    x_stride16: Int32  # row strides of x, B, C (32-bit: one IMAD per row offset)
    b_stride16: Int32
    c_stride16: Int32


class PendingInputs(NamedTuple):
    """A pending-mode call's inputs (cute/pending.py): element strides of a row (dense
    layout; 0 in the varlen layout) and of a token; heads (groups) contiguous at 64 (128)
    elements; x, B, C and out at 16-byte-aligned rows and tokens."""

    x: Pointer  # bf16 [rows, tokens, H, 64] or [total, H, 64]
    dt: Pointer  # f32, bf16 or f16, raw dt
    A: Pointer  # f32 [H]
    B: Pointer  # bf16 [.., G, 128]
    C: Pointer  # bf16 [.., G, 128]
    D: Pointer  # f32 [H, 64]
    dt_bias: Pointer  # f32 [H]
    out: Pointer  # bf16 [.., H, 64]
    x_row: Int64
    x_tok: Int64
    dt_row: Int64
    dt_tok: Int64
    dt_h: Int64
    b_row: Int64
    b_tok: Int64
    c_row: Int64
    c_tok: Int64
    o_row: Int64
    o_tok: Int64
    a_stride: Int64
    bias_stride: Int64
    d_h: Int64
    d_p: Int64


class PendingPlan(NamedTuple):
    """The pending plan kernel's rows (int32 [batch, 8], plan.py `PendingPlanKernel`) and
    the fold kernel's work list (int32; the step resets its count, word 0)."""

    rows: Pointer
    fold_list: Pointer


# The pending fold's test variant: `PendingPlan` and f32 [batch, H, P, N] for every folded row.
PendingDebugPlan = NamedTuple("PendingDebugPlan", [(f, Pointer) for f in (*PendingPlan._fields, "state")])


class FoldParams(NamedTuple):
    """The one layer parameter the pending fold reads."""

    A: Pointer  # f32 [H]
    a_stride: Int64


class Slots(NamedTuple):
    """A cache's per-slot bookkeeping, read and written by the plan kernels (parity and
    meta: NVFP4 only; the other formats pass positions in their place)."""

    positions: Pointer  # int32 [S] (single-token) or [S, 2] (pending)
    parity: Pointer  # int32 [S]
    meta: Pointer  # f32 [S, G, 2]
    pos_stride: Int64
    parity_stride: Int64
    meta_stride: Int64
    num_slots: Int32


class Plan(NamedTuple):
    """The prepare kernel's plan (`reference.Plan`), one entry a batch row."""

    valid: Pointer  # bool
    slot: Pointer  # int64
    ring_index: Pointer  # int64
    flush: Pointer  # bool
    key: Pointer  # int64 (uint32 stream tag)
    old_parity: Pointer  # int64


# The flush's test variant: `Plan` and f32 [batch, H, P, N] for every flushed row.
DebugPlan = NamedTuple("DebugPlan", [(f, Pointer) for f in (*Plan._fields, "state")])


# A pointer whose element type is the tensor's (one of DSL_DTYPES), aligned to its size.
INPUT_DTYPE = "input"
# A scalar given by value (a Python int), not read off a tensor: (VALUE, DSL type).
VALUE = "value"
DSL_DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16, torch.float16: Float16}

SPECS: dict[type, dict[str, tuple]] = {
    Ring: {
        "x": (BFloat16, 16), "dt": (Float32, 4), "b": (BFloat16, 16),
        "x_stride16": ("x", 0, 16), "dt_stride": ("dt", 0, 1), "b_stride16": ("b", 0, 16),
    },
    Fp8Copy: {
        "codes": (Uint32, 16), "scales": (Float32, 4),
        "codes_stride16": ("codes", 0, 16), "scale_stride": ("scales", 0, 1),
    },
    Nvfp4Copy: {
        "codes": (Uint32, 16), "scales": (Uint8, 1), "meta": (Float32, 4), "parity": (Int32, 4),
        "codes_stride16": ("codes", 0, 16), "scale_stride": ("scales", 0, 1),
        "meta_stride": ("meta", 0, 1), "parity_stride": ("parity", 0, 1),
    },
    Fp16Copy: {"state": (Float16, 16), "stride16": ("state", 0, 16)},
    Checkpoint: {"state": (Float16, 16), "stride16": ("state", 0, 16), "head_offset": (VALUE, Int32)},
    Inputs: {
        "x": (BFloat16, 16), "dt": (INPUT_DTYPE, 0), "A": (Float32, 4), "B": (BFloat16, 16), "C": (BFloat16, 16),
        "D": (Float32, 4), "dt_bias": (Float32, 4), "out": (BFloat16, 2),
        "dt_stride_b": ("dt", 0, 1), "dt_stride_h": ("dt", 1, 1), "a_stride": ("A", 0, 1),
        "dt_bias_stride": ("dt_bias", 0, 1), "d_stride_h": ("D", 0, 1), "d_stride_p": ("D", 1, 1),
        "x_stride16": ("x", 0, 16, Int32), "b_stride16": ("B", 0, 16, Int32), "c_stride16": ("C", 0, 16, Int32),
    },
    Plan: {
        "valid": (Int8, 1), "slot": (Int64, 8), "ring_index": (Int64, 8), "flush": (Int8, 1),
        "key": (Int64, 8), "old_parity": (Int64, 8),
    },
}
SPECS[DebugPlan] = {**SPECS[Plan], "state": (Float32, 16)}
SPECS[Slots] = {
    "positions": (Int32, 4), "parity": (Int32, 4), "meta": (Float32, 4),
    "pos_stride": ("positions", 0, 1), "parity_stride": ("parity", 0, 1), "meta_stride": ("meta", 0, 1),
    "num_slots": (VALUE, Int32),
}  # fmt: skip
SPECS[PendingInputs] = {
    "x": (BFloat16, 16), "dt": (INPUT_DTYPE, 0), "A": (Float32, 4), "B": (BFloat16, 16), "C": (BFloat16, 16),
    "D": (Float32, 4), "dt_bias": (Float32, 4), "out": (BFloat16, 16),
    **{name: (VALUE, Int64) for name in PendingInputs._fields[8:]},
}
SPECS[PendingPlan] = {"rows": (Int32, 16), "fold_list": (Int32, 4)}
SPECS[PendingDebugPlan] = {**SPECS[PendingPlan], "state": (Float32, 16)}
SPECS[FoldParams] = {"A": (Float32, 4), "a_stride": ("A", 0, 1)}


def row_words(dense: bool, bb, stride16, words_per_row: int):
    """32-bit word offset of batch row bb (Int64) of x, B or C: at the constant row stride in
    the `dense` variant (contiguous rows), else at the runtime one (Int32 16-byte units)."""
    if dense:
        return bb * words_per_row
    return Int64(Int32(bb) * stride16 * 4)


def _is_stride(entry: tuple) -> bool:
    return len(entry) >= 3  # (tensor field, dim, unit[, DSL type: Int64]); a pointer is (dtype, alignment)


def fake(struct: type, **dtypes: torch.dtype):
    """Compile-time placeholders of `struct` (null pointers of the spec's types; a field
    of the input's own type takes it from `dtypes`, float32 by default)."""
    values = []
    for name, entry in SPECS[struct].items():
        if _is_stride(entry):
            values.append((entry[3] if len(entry) > 3 else Int64)(0))
        elif entry[0] == VALUE:
            values.append(entry[1](0))
        elif entry[0] == INPUT_DTYPE:
            dtype = dtypes.get(name, torch.float32)
            values.append(make_ptr(DSL_DTYPES[dtype], 0, assumed_align=dtype.itemsize))
        else:
            values.append(make_ptr(entry[0], 0, assumed_align=entry[1]))
    return struct(*values)


@functools.cache
def _raw_plan(struct: type) -> tuple:
    """How `raw` reads each field: (kind, tensor or field name, dim, unit), kind 0 a pointer,
    1 a stride, 2 a value."""
    return tuple(
        (1, *entry[:3]) if _is_stride(entry) else (2 if entry[0] == VALUE else 0, name, 0, 0)
        for name, entry in SPECS[struct].items()
    )


def raw(struct: type, **tensors) -> list[int]:
    """`struct`'s fields as ints for the given tensors (one per pointer field): addresses,
    strides in the spec's units, VALUE fields' ints."""
    out = []
    for kind, name, dim, unit in _raw_plan(struct):
        t = tensors[name]
        if kind == 0:
            out.append(t.data_ptr())
        elif kind == 1:
            out.append(t.stride(dim) * t.element_size() // 16 if unit == 16 else t.stride(dim))
        else:
            out.append(int(t))
    return out


__all__ = [
    "PendingInputs", "PendingPlan", "PendingDebugPlan", "FoldParams", "raw", "row_words", "DSL_DTYPES",
    "Ring", "Fp8Copy", "Nvfp4Copy", "Fp16Copy", "Checkpoint", "Inputs", "Plan", "DebugPlan", "Slots", "SPECS",
    "fake",
]
