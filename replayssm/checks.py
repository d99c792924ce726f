"""Argument checks shared by every entry point, so one fault gives one exception and
message wherever it is made: TypeError for a missing tensor or int, `DTypeError` for a
dtype (also a ValueError, as the serving engine's contract has it), ValueError for a
shape, device, layout or value. Values are read from host tensors only, and from device
tensors with REPLAYSSM_DEBUG=1 in eager calls."""

from __future__ import annotations

import torch

from . import layout as L
from .kernels.env import debug


class DTypeError(TypeError, ValueError):
    """A tensor argument of the wrong dtype."""


def describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    return t


def integer(name: str, v: object, *, low: int | None = None, high: int | None = None) -> int:
    """A Python int (not a bool) in [low, high] (either bound optional)."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be a Python int; got {type(v).__name__}")
    if (low is not None and v < low) or (high is not None and v > high):
        bounds = [f"{op} {b}" for op, b in ((">=", low), ("<=", high)) if b is not None]
        raise ValueError(f"{name} must be {' and '.join(bounds)}; got {v}")
    return v


def seed(v: object) -> int:
    return integer("seed", v)


def head_offset(v: object) -> int:
    return integer("head_offset", v, low=0, high=2**24 - 1)


def on_device(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device != device:
        raise ValueError(f"{name} must be on the cache device {device}; got {t.device}")
    return t


def floating(name: str, t: object) -> torch.Tensor:
    tensor(name, t)
    if not t.dtype.is_floating_point:
        raise DTypeError(f"{name} must be a floating-point tensor; got {describe(t)}")
    return t


def int_ids(name: str, t: object) -> torch.Tensor:
    """An int32 / int64 tensor of ids, 1-D (0-D is taken as one id)."""
    tensor(name, t)
    if t.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"{name} must be int32 or int64; got {describe(t)}")
    if t.dim() > 1:
        raise ValueError(f"{name} must be 1-D [batch]; got {describe(t)}")
    return t if t.dim() == 1 else t.reshape(-1)


def id_list(name: str, ids: object) -> torch.Tensor:
    """An int or a flat sequence of integers (not bools or floats, which a cast would turn
    into another slot) as a host int64 tensor."""
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    try:
        values = list(ids)
    except TypeError as e:
        raise TypeError(f"{name} must be a tensor, an int or a sequence of ints; got {type(ids).__name__}") from e
    bools = any(k.__name__ in ("bool", "bool_") for k in set(map(type, values)))  # one pass in C
    bad = [v for v in values if type(v).__name__ in ("bool", "bool_")] if bools else []
    if not bad:
        try:
            host = torch.tensor(values) if values else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be a sequence of ints; got {values!r}") from e
        if host.dim() != 1:
            raise ValueError(f"{name} must be a flat sequence of ints; got shape {list(host.shape)}")
        if not (host.dtype.is_floating_point or host.dtype.is_complex or host.dtype == torch.bool):
            return host.to(torch.int64)
        bad = [v for v in values if not hasattr(type(v), "__index__")] or values
    raise TypeError(f"{name} must hold ints; got {bad[0]!r} ({type(bad[0]).__name__}) in {values!r}")


def slot_ids(name: str, t: object, device: torch.device) -> torch.Tensor:
    return on_device(name, int_ids(name, t), device)


def host_values(t: torch.Tensor) -> list | None:
    """The values of a host tensor, or of any with REPLAYSSM_DEBUG=1 where host reads are allowed."""
    if (t.device.type == "cpu" or debug()) and host_reads_allowed():
        return t.tolist()
    return None


def host_reads_allowed() -> bool:
    """Not while torch.compile traces the call, nor while a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def tied(name: str, t: torch.Tensor, flat: torch.Tensor) -> None:
    """`flat` (t with its per-head values on the last dim) holds one value per head."""
    if flat.shape[-1] != 1 and flat.stride(-1) != 0:
        raise ValueError(
            f"{name} must hold one value per head: extra dims must be tied views (stride 0); "
            f"got shape {list(t.shape)} with strides {list(t.stride())}"
        )


def per_head(name: str, t: object, heads: int, shapes: tuple[tuple[int, ...], ...], *, tie: bool) -> torch.Tensor:
    """A floating per-head parameter of exactly one of `shapes`; with `tie`, every dim
    after the first a tied (stride-0) view. Returns it as [heads, -1]."""
    floating(name, t)
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        kind = " (extra dims tied, stride 0)" if tie and len(shapes) > 1 else ""
        raise ValueError(f"{name} must be {want}{kind}; got {describe(t)}")
    flat = t.reshape(heads, -1)
    if tie:
        tied(name, t, flat)
    return flat


def A_param(A: object, heads: int, P: int = L.HEAD_DIM, N: int = L.STATE_DIM) -> torch.Tensor:
    """A: float [H], or a tied [H, P] / [H, P, N] view, finite and <= 0 (0, no decay, is
    allowed; values checked as `host_values` reads them). Returns A [H] float32."""
    flat = per_head("A", A, heads, ((heads,), (heads, P), (heads, P, N)), tie=True)
    a = flat[:, 0].float()
    values = host_values(a)
    if values is not None and not all(-float("inf") < v <= 0 for v in values):
        raise ValueError(f"A must be finite and <= 0 in every head (A = -exp(A_log)); got {values}")
    return a


def params(A: object, D: object, dt_bias: object, heads: int, P: int = L.HEAD_DIM, N: int = L.STATE_DIM):
    """A [H] f32, D [H, P] f32, dt_bias [H] f32 (tied views read at their first element)."""
    a = A_param(A, heads, P, N)
    bias = per_head("dt_bias", dt_bias, heads, ((heads,), (heads, P)), tie=True)[:, 0].float()
    d = per_head("D", D, heads, ((heads,), (heads, P)), tie=False)
    return a, d.expand(heads, P).float(), bias


def verdicts(t: object, batch: int, device: torch.device, max_seqlen: int) -> None:
    """num_accepted_tokens: None, or int32 / int64 [batch] on the cache device; values outside
    0..max_seqlen are clamped (docs/format.md section 5b), an error with REPLAYSSM_DEBUG=1."""
    if t is None:
        return
    name = "num_accepted_tokens"
    tensor(name, t)
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (batch,):
        error = DTypeError if t.dtype not in (torch.int32, torch.int64) else ValueError
        raise error(f"{name} must be int32 or int64 [{batch}] (one per row); got {describe(t)}")
    on_device(name, t, device)
    if debug() and host_reads_allowed() and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi > max_seqlen:
            raise ValueError(
                f"{name} must be in 0..max_seqlen={max_seqlen} (REPLAYSSM_DEBUG=1; otherwise clamped); "
                f"got {t.tolist()}"
            )


__all__ = ["DTypeError"]
