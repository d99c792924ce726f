"""The cache tuple (docs/format.md section 1): indices, shapes, dtypes, allocation (optionally
carved from one byte page per slot with padding between slots) and its validation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from .formats import FORMATS, Format, format_of
from .geometry import (  # noqa: F401  (the cache tuple's names, re-exported)
    B_RING, CHECKPOINT, CONV, DT_RING, HEAD_DIM, HEAD_DIMS, MAX_HEADS_PER_GROUP, META, NVFP4_BLOCK, PARITY,
    POSITIONS, READ_COPY, RING, SCALES, STATE_DIM, STATE_DIMS, X_RING, Geometry, dims_error, group_error,
)

STATE_DTYPES = tuple(FORMATS)


def check_device(device: object) -> torch.device:
    """`device` as a torch.device where a cache can live: the CPU or a CUDA GPU torch sees;
    else a ValueError saying what it accepts (a TypeError for a value that is no device)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device; got {type(device).__name__}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accepted = f"'cpu', 'cuda' or 'cuda:0'..'cuda:{gpus - 1}'" if gpus else "'cpu' (no CUDA GPU is visible)"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):  # an unknown device type or a malformed string
        dev = None
    cpu_ok = dev is not None and dev.type == "cpu" and dev.index in (None, 0)
    cuda_ok = dev is not None and dev.type == "cuda" and gpus > 0 and (dev.index is None or dev.index < gpus)
    if not (cpu_ok or cuda_ok):
        raise ValueError(f"device must be {accepted}; got {str(device)!r}")
    return dev


def tensor_specs(heads: int, groups: int, fmt: Format, pending: bool = False, head_dim: int = HEAD_DIM, state_dim: int = STATE_DIM):
    """[(name, per-slot shape, dtype)] for cache indices 1.. (index 0, the conv state, is
    the caller's): checkpoint, rings, the format's tensors, positions."""
    return [
        ("checkpoint", (heads, head_dim, state_dim), torch.float16),
        ("x_ring", (heads, RING, head_dim), torch.bfloat16),
        ("dt_ring", (heads, RING), torch.float32),
        ("b_ring", (groups, RING, state_dim), torch.bfloat16),
        *fmt.specs(heads, groups, head_dim, state_dim),
        ("positions", (2,) if pending else (), torch.int32),
    ]


def allocate_cache(
    num_slots: int, heads: int, groups: int, state_dtype: str, device: torch.device | str = "cpu", *,
    conv_shape: Sequence[int] | None = None, conv_dtype: torch.dtype = torch.bfloat16, slot_padding: int = 0,
    fill: float | None = None, pending: bool = False, head_dim: int = HEAD_DIM, state_dim: int = STATE_DIM,
) -> list[torch.Tensor]:
    """Allocate a cache tuple. With `slot_padding` > 0 every slot's tensors are carved from
    one byte page per slot (as serving engines do), `slot_padding` bytes of slack after
    each tensor. `fill` (e.g. NaN) poisons the state tensors; rings and positions are zeroed."""
    fmt = format_of(state_dtype)
    device = check_device(device)
    check_geometry(num_slots, heads, groups, head_dim, state_dim)
    conv_shape = check_conv(conv_shape, conv_dtype)
    if not isinstance(slot_padding, int) or isinstance(slot_padding, bool):
        raise TypeError(f"slot_padding must be an int (bytes); got {type(slot_padding).__name__}")
    if slot_padding < 0:
        raise ValueError(f"slot_padding must be >= 0 (bytes of slack after each tensor of a slot); got {slot_padding}")
    if fill is not None and (not isinstance(fill, (int, float)) or isinstance(fill, bool)):
        raise TypeError(f"fill must be a float or None; got {type(fill).__name__}")
    if not isinstance(pending, bool):
        raise TypeError(f"pending must be a bool; got {type(pending).__name__}")
    specs = tensor_specs(heads, groups, fmt, pending, head_dim, state_dim)
    conv = torch.zeros(num_slots, *(conv_shape or (0,)), dtype=conv_dtype, device=device)
    if slot_padding <= 0:
        tensors = [torch.empty(num_slots, *shape, dtype=dt, device=device) for _, shape, dt in specs]
    else:
        sizes = [math.prod(shape) * dt.itemsize for _, shape, dt in specs]
        # Every tensor starts 16-byte aligned, `slot_padding` bytes or more after the last.
        offsets = [0, *itertools.accumulate(-(-(nbytes + slot_padding) // 16) * 16 for nbytes in sizes)]
        page = torch.empty(num_slots, offsets[-1], dtype=torch.uint8, device=device)
        if fill is not None:
            page.fill_(0xFF)  # NaN in every float dtype used here
        tensors = [page[:, off : off + nbytes].view(dt).reshape(num_slots, *shape)
                   for (_, shape, dt), off, nbytes in zip(specs, offsets, sizes)]  # fmt: skip
    for (name, _, _), t in zip(specs, tensors):
        poison = fill is not None and t.dtype.is_floating_point and not name.endswith("_ring")
        t.fill_(fill if poison else 0)
    return [conv, *tensors]


def check_geometry(num_slots: object, heads: object, groups: object, head_dim: object = HEAD_DIM, state_dim: object = STATE_DIM) -> None:
    """Python ints: slots >= 2 (slot 0 is the padding slot), heads and groups as
    `group_error` wants them, head_dim and state_dim as `dims_error` does."""
    for name, v in (("num_slots", num_slots), ("num_heads", heads), ("num_groups", groups), ("head_dim", head_dim), ("state_dim", state_dim)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int; got {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"{name} must be positive; got {v}")
    if num_slots < 2:
        raise ValueError(f"num_slots must be >= 2 (slot 0 is the padding slot); got {num_slots}")
    if error := group_error(heads, groups) or dims_error(head_dim, state_dim):
        raise ValueError(error)


def check_conv(shape: object, dtype: object) -> tuple[int, ...] | None:
    """Check the conv-state shape per slot (ints >= 0, or None) and dtype; the shape as a tuple."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"conv_state_dtype must be a torch.dtype (e.g. torch.bfloat16); got {dtype!r}")
    if shape is None:
        return None
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"conv_state_shape must be a sequence of ints or None; got {type(shape).__name__}")
    if any(not isinstance(v, int) or isinstance(v, bool) for v in shape):
        raise TypeError(f"conv_state_shape must hold ints; got {tuple(shape)!r}")
    if any(v < 0 for v in shape):
        raise ValueError(f"conv_state_shape must hold sizes >= 0; got {tuple(shape)}")
    return tuple(shape)


def slot_stride_ok(t: torch.Tensor) -> bool:
    """Every dim after the slot dim is contiguous; the slot stride covers one slot."""
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return t.stride(0) >= expect or t.shape[0] <= 1


def dims(cache: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(head dim P, state dim N) of a cache tuple (from its checkpoint)."""
    return tuple(cache[CHECKPOINT].shape[2:4])


def check_cache(cache: Sequence[torch.Tensor], fmt: Format) -> Geometry:
    """Validate a cache tuple of format `fmt`; return its `Geometry`."""
    if isinstance(cache, torch.Tensor) or not isinstance(cache, Sequence):
        raise TypeError(f"cache must be a sequence of tensors; got {type(cache).__name__}")
    want = fmt.cache_len()
    if len(cache) != want:
        raise ValueError(f"cache for state_dtype {fmt.name!r} must hold {want} tensors; got {len(cache)}")
    for i, t in enumerate(cache):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cache[{i}] must be a torch.Tensor; got {type(t).__name__}")
    ckpt = cache[CHECKPOINT]
    if ckpt.dim() != 4 or ckpt.shape[2] not in HEAD_DIMS or ckpt.shape[3] not in STATE_DIMS:
        raise ValueError(
            f"cache[1] (checkpoint) must be [slots, heads, P, N] with P in {HEAD_DIMS}, N in {STATE_DIMS}; got {list(ckpt.shape)}"
        )
    slots, heads, P, N = ckpt.shape
    bring = cache[B_RING]
    if bring.dim() != 4:
        raise ValueError(f"cache[4] (B ring) must be [slots, groups, 16, {N}]; got {list(bring.shape)}")
    groups = bring.shape[1]
    if error := group_error(heads, groups):
        raise ValueError(error)
    specs = tensor_specs(heads, groups, fmt, cache[POSITIONS].dim() == 2, P, N)
    device = ckpt.device
    for idx, (name, shape, dt) in enumerate(specs, start=1):  # positions: idx == len(cache) - 1
        t = cache[idx]
        if t.dtype != dt or tuple(t.shape) != (slots, *shape):
            raise ValueError(
                f"cache[{idx}] ({name}) must be {dt} {[slots, *shape]}; got {t.dtype} {list(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"cache[{idx}] ({name}) must be on {device}; got {t.device}")
        if not slot_stride_ok(t):
            raise ValueError(
                f"cache[{idx}] ({name}) must be contiguous within a slot with slot stride >= slot size; "
                f"got strides {t.stride()}"
            )
    if slots < 2:
        raise ValueError(f"cache needs at least 2 slots (slot 0 is the padding slot); got {slots}")
    return Geometry(slots, heads, groups, P, N)
