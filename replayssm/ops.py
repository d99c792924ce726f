"""The cache operations as torch custom ops: `replayssm::initialize`, `::clear`,
`::decode`, `::materialize`, and pending mode's `::decode_pending`, `::materialize_pending`.

torch.compile sees each as one opaque op whose schema marks exactly the cache tensors it
writes, so a model calling `ReplaySSMCache.decode` compiles with fullgraph=True. The ops
validate nothing (`replayssm.api` does, at trace time under torch.compile). Under
torch.compile a wrapper below calls the op; an eager call runs its body directly, without
the dispatcher's boxing of ~20 arguments (a generic wrapper's *args / **kwargs measured
~0.8 us a call more on the CPU).

- The cache tensors are separate arguments, not one `Tensor(a!)[]` list: a list marks
  every entry written, and functionalization (e.g. backend="aot_eager") then copies them
  all on every call. Read copy, scales, meta and parity are optional, so one op serves
  every format (meta and parity None for FP8, all four for FP16).
- No autograd formula: the bodies run under no_grad, so inputs that require grad leave
  no history on the cache or `out`.
- A cache carved from one byte page per slot (`slot_padding` > 0) holds views of one
  storage with different dtypes: torch 2.13's AOTAutograd (aot_eager, Inductor) refuses
  such mutated inputs, dynamo alone (backend="eager") compiles it.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from . import layout as L
from .formats import format_of
from .kernels import REFERENCE, kernel_backend

_OPTIONAL = ("read_copy", "scales", "meta", "parity")
# The cache tuple as op arguments, in tuple order: (name, optional).
CACHE_ARGS = tuple(
    (name, name in _OPTIONAL)
    for name in ("conv", "checkpoint", "x_ring", "dt_ring", "b_ring", *_OPTIONAL, "positions")
)
_STATE = {name for name, _ in CACHE_ARGS[1:]}
_KW = "str state_dtype, int seed, str backend"  # of the ops that write the cache
# op: (its own inputs, a trailing `?`: optional; keyword-only scalars; returns; what it
# writes of the cache tensors and outputs, everything else being read only)
_OPS = {
    "initialize": ("states state_indices", f"{_KW}, int head_offset=0", "()", _STATE),
    "clear": ("state_indices", "str backend", "()", {"x_ring", "dt_ring", "b_ring", "positions"}),
    "decode": (
        "x dt A B C D dt_bias state_indices out", f"{_KW}, int scratch, int head_offset=0", "()",
        _STATE | {"out"},
    ),
    "materialize": ("state_indices A", "str backend", "Tensor", set()),
    "decode_pending": (
        "x dt A B C D dt_bias state_indices out num_accepted_tokens? cu_seqlens?",
        f"{_KW}, int max_seqlen, int head_offset=0", "()", _STATE | {"out"},
    ),
    "materialize_pending": ("state_indices A", "str backend, int max_seqlen", "Tensor", set()),
}
WRITES = {op: writes for op, (*_, writes) in _OPS.items()}


def _schema(op: str, inputs: str, kwargs: str, returns: str, writes: set) -> str:
    """The cache tensors with the alias set `(x!)` of each one `op` writes, then its inputs."""
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    args = [*CACHE_ARGS, *((name.rstrip("?"), name.endswith("?")) for name in inputs.split())]
    parts = (f"Tensor{f'({next(letters)}!)' if n in writes else ''}{'?' * opt} {n}" for n, opt in args)
    return f"({', '.join(parts)}, *, {kwargs}) -> {returns}"


SCHEMAS = {op: _schema(op, *row) for op, row in _OPS.items()}


def cache_args(cache: Sequence[torch.Tensor]) -> tuple:
    """A validated cache tuple (8 tensors for FP8, 10 for NVFP4, 6 for FP16) as the ops'
    ten cache arguments (meta, parity None for FP8; read copy and scales too for FP16)."""
    copy = tuple(cache[L.READ_COPY:-1])  # read copy, scales, meta, parity: those present
    return (*cache[:L.READ_COPY], *copy, *(None,) * (4 - len(copy)), cache[-1])


def _backend(name: str):
    if name == "reference":
        return REFERENCE
    if name == "kernels":
        return kernel_backend()
    raise ValueError(f"backend must be 'reference' or 'kernels' (a resolved backend); got {name!r}")


def _int64(seed: int) -> int:
    """`seed` as the int64 equal to it mod 2**64."""
    s = seed % (1 << 64)
    return s - (1 << 64) if s >= 1 << 63 else s


# -- plan scratch handles ------------------------------------------------------------------
# handle -> scratch (weak: its owner keeps it alive), id(scratch) -> handle (dropped when the
# scratch is collected, before the id can be reused). A lookup traces under torch.compile,
# registering (weakref) does not: ReplaySSMCache registers its scratch when it is built.
_SCRATCH: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_HANDLE_OF: dict[int, int] = {}
_NEXT_HANDLE = itertools.count(1)


def register_scratch(scratch) -> int:
    """The handle of `scratch` (a kernel backend `PlanScratch`), registering it first if
    needed; 0 for None."""
    if scratch is None:
        return 0
    handle = _HANDLE_OF.get(id(scratch))
    if handle is None:
        handle = _HANDLE_OF[id(scratch)] = next(_NEXT_HANDLE)
        _SCRATCH[handle] = scratch
        weakref.finalize(scratch, _HANDLE_OF.pop, id(scratch), None)
    return handle


scratch_handle = register_scratch  # what a compiled step traces: the lookup, for a registered one


# -- wrappers: a validated cache tuple and validated, normalized inputs in -----------------
# Each is also its op's implementation (`_register`): at run time is_compiling() is False.


def initialize(
    cache, states, state_indices, *, state_dtype: str, seed: int, backend: str, head_offset: int = 0
) -> None:
    if torch.compiler.is_compiling():
        return _initialize_op(
            *cache_args(cache), states, state_indices, state_dtype=state_dtype, seed=_int64(seed),
            backend=backend, head_offset=head_offset,
        )
    with torch.no_grad():
        _backend(backend).initialize(
            cache, states, state_indices, fmt=format_of(state_dtype), seed=_int64(seed),
            head_offset=head_offset,
        )


def clear(cache, state_indices, *, backend: str) -> None:
    if torch.compiler.is_compiling():
        return _clear_op(*cache_args(cache), state_indices, backend=backend)
    with torch.no_grad():
        _backend(backend).clear(cache, state_indices)


def decode(
    cache, x, dt, A, B, C, D, dt_bias, state_indices, out,
    *, state_dtype: str, seed: int, backend: str, scratch: int = 0, head_offset: int = 0,
) -> None:
    """Inputs as `api.normalize_decode_inputs` leaves them; writes `out` (contiguous bf16,
    batch * heads * P elements) and the cache. `scratch`: a `scratch_handle`."""
    if torch.compiler.is_compiling():
        return _decode_op(
            *cache_args(cache), x, dt, A, B, C, D, dt_bias, state_indices, out,
            state_dtype=state_dtype, seed=_int64(seed), backend=backend, scratch=scratch,
            head_offset=head_offset,
        )
    buf = _SCRATCH.get(scratch) if scratch else None
    extra = {} if buf is None else {"scratch": buf}
    with torch.no_grad():
        _backend(backend).decode(
            cache, x, dt, A, B, C, D, dt_bias, state_indices,
            out.view(state_indices.numel(), *cache[L.CHECKPOINT].shape[1:3]),
            fmt=format_of(state_dtype), seed=_int64(seed), head_offset=head_offset, **extra,
        )


def materialize(cache, state_indices, A, *, backend: str, max_seqlen: int | None = None) -> torch.Tensor:
    """A new FP32 tensor; `max_seqlen` given: a pending cache's states after the committed
    tokens (`replayssm::materialize_pending`)."""
    if torch.compiler.is_compiling():
        if max_seqlen is None:
            return _materialize_op(*cache_args(cache), state_indices, A, backend=backend)
        return _materialize_pending_op(
            *cache_args(cache), state_indices, A, backend=backend, max_seqlen=max_seqlen
        )
    with torch.no_grad():
        if max_seqlen is None:
            return _backend(backend).materialize(cache, state_indices, A)
        return _backend(backend).materialize_pending(cache, state_indices, A, max_seqlen=max_seqlen)


def decode_pending(
    cache, x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
    *, state_dtype: str, seed: int, backend: str, max_seqlen: int, head_offset: int = 0,
) -> None:
    """Inputs as `api.normalize_pending_inputs` leaves them: dense x [b, T, H, P] with
    `cu_seqlens` None, or varlen x [total, H, P] with `cu_seqlens` int32 [b + 1]."""
    if torch.compiler.is_compiling():
        return _decode_pending_op(
            *cache_args(cache), x, dt, A, B, C, D, dt_bias, state_indices, out,
            num_accepted_tokens, cu_seqlens, state_dtype=state_dtype, seed=_int64(seed), backend=backend,
            max_seqlen=max_seqlen, head_offset=head_offset,
        )
    with torch.no_grad():
        _backend(backend).decode_pending(
            cache, x, dt, A, B, C, D, dt_bias, state_indices, out,
            fmt=format_of(state_dtype), seed=_int64(seed), max_seqlen=max_seqlen,
            num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, head_offset=head_offset,
        )


# -- the ops -------------------------------------------------------------------------------
# Plain `torch.library.Library`, not `custom_op`, whose ADInplaceOrView kernel
# (`torch._library.utils.fill_defaults`) re-reads `schema.arguments` per argument on every
# call, quadratic in decode's 23: 130-250 us of host time a call on this project's CPU
# machine against ~20 us here, where Autograd takes the C++ fallback and ADInplaceOrView
# falls through.

_LIB = torch.library.Library("replayssm", "DEF")


def _register(name: str, wrapper, fake) -> torch._ops.OpOverload:
    def kernel(*args, **kwargs):
        # The caller's cache tuple back from the ten cache arguments: the absent ones are None.
        return wrapper(tuple(t for t in args[:10] if t is not None), *args[10:], **kwargs)

    _LIB.define(name + SCHEMAS[name])
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    torch.library.register_fake(f"replayssm::{name}", fake, lib=_LIB)
    return getattr(torch.ops.replayssm, name).default


def _writes_only(*args, **kwargs) -> None:
    return None


def _states_fake(*args, **kwargs) -> torch.Tensor:
    """materialize's output: FP32 [n, heads, P, N] on the device of the slot ids (the cache's)."""
    ids, checkpoint = args[10], args[1]
    return ids.new_empty((ids.numel(), *checkpoint.shape[1:]), dtype=torch.float32)


_initialize_op = _register("initialize", initialize, _writes_only)
_clear_op = _register("clear", clear, _writes_only)
_decode_op = _register("decode", decode, _writes_only)
_materialize_op = _register("materialize", materialize, _states_fake)
_decode_pending_op = _register("decode_pending", decode_pending, _writes_only)
_materialize_pending_op = _register("materialize_pending", materialize, _states_fake)


__all__ = [
    "CACHE_ARGS", "SCHEMAS", "WRITES", "cache_args", "clear", "decode", "decode_pending", "initialize",
    "materialize", "register_scratch", "scratch_handle",
]
