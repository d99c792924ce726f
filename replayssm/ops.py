"""The cache operations as torch custom ops: `replayssm::initialize`, `::clear`,
`::decode`, `::materialize`, and pending mode's `::decode_pending`, `::materialize_pending`.

torch.compile sees each as one opaque op whose schema marks exactly the cache tensors it
writes, so a model calling `ReplaySSMCache.decode` compiles with fullgraph=True. The ops
validate nothing (`replayssm.api` does, at trace time under torch.compile); an eager call
runs the body directly, without the dispatcher's boxing of ~20 arguments.

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
    """`seed` as the int64 equal to it mod 2**64 (the random streams take it mod 2**64)."""
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


# -- the ops -------------------------------------------------------------------------------
# Plain `torch.library.Library`, not `custom_op`, whose ADInplaceOrView kernel
# (`torch._library.utils.fill_defaults`) re-reads `schema.arguments` per argument on every
# call, quadratic in decode's 23: 130-250 us of host time a call on this project's CPU
# machine against ~20 us here, where Autograd takes the C++ fallback and ADInplaceOrView
# falls through.

_LIB = torch.library.Library("replayssm", "DEF")


def _states_fake(*args, **kwargs) -> torch.Tensor:
    """materialize's output: FP32 [n, heads, P, N] on the device of the slot ids (the cache's)."""
    ids, checkpoint = args[10], args[1]
    return ids.new_empty((ids.numel(), *checkpoint.shape[1:]), dtype=torch.float32)


def _define(name: str, body=None):
    """Op `name` and its wrapper, which takes a validated cache tuple, then the op's other
    arguments (inputs validated and normalized by `replayssm.api`). Under torch.compile the
    wrapper calls the op; eagerly, and as the op's kernel (at run time is_compiling() is
    False), `body(backend, cache, *inputs, **scalars)` (default: the backend's method
    `name`) under no_grad, with `fmt` for state_dtype."""
    body = body or (lambda impl, *args, **kwargs: getattr(impl, name)(*args, **kwargs))

    def wrapper(cache, *inputs, backend: str, **scalars):
        if "seed" in scalars:
            scalars["seed"] = _int64(scalars["seed"])
        if torch.compiler.is_compiling():
            return op(*cache_args(cache), *inputs, backend=backend, **scalars)
        impl = _backend(backend)
        if "state_dtype" in scalars:
            scalars["fmt"] = format_of(scalars.pop("state_dtype"))
        with torch.no_grad():
            return body(impl, cache, *inputs, **scalars)

    def kernel(*args, **kwargs):
        # The caller's cache tuple back from the ten cache arguments: the absent ones are None.
        return wrapper(tuple(t for t in args[:10] if t is not None), *args[10:], **kwargs)

    _LIB.define(name + SCHEMAS[name])
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    fake = _states_fake if _OPS[name][2] == "Tensor" else lambda *args, **kwargs: None
    torch.library.register_fake(f"replayssm::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.replayssm, name).default
    return op, wrapper


def _decode(impl, cache, x, dt, A, B, C, D, dt_bias, state_indices, out, *, scratch: int = 0, **scalars):
    """Inputs as `api.normalize_decode_inputs` leaves them; writes `out` (contiguous bf16,
    batch * heads * P elements) and the cache. `scratch`: a `scratch_handle` (0: the
    backend's shared plan scratch)."""
    buf = _SCRATCH.get(scratch) if scratch else None
    if buf is not None:
        scalars["scratch"] = buf
    out = out.view(state_indices.numel(), *cache[L.CHECKPOINT].shape[1:3])
    impl.decode(cache, x, dt, A, B, C, D, dt_bias, state_indices, out, **scalars)


def _decode_pending(impl, cache, *inputs, **scalars) -> None:
    """Inputs as `api.normalize_pending_inputs` leaves them, then num_accepted_tokens and
    cu_seqlens: dense x [b, T, H, P] with `cu_seqlens` None, or varlen x [total, H, P] with
    `cu_seqlens` int32 [b + 1]."""
    *inputs, accepted, cu_seqlens = inputs
    impl.decode_pending(cache, *inputs, num_accepted_tokens=accepted, cu_seqlens=cu_seqlens, **scalars)


_initialize_op, initialize = _define("initialize")
_clear_op, clear = _define("clear")
_decode_op, decode = _define("decode", _decode)
_materialize_op, _materialize = _define("materialize")
_decode_pending_op, decode_pending = _define("decode_pending", _decode_pending)
_materialize_pending_op, _materialize_pending = _define("materialize_pending")


def materialize(cache, state_indices, A, *, backend: str, max_seqlen: int | None = None) -> torch.Tensor:
    """A new FP32 tensor; `max_seqlen` given: a pending cache's states after the committed
    tokens (`replayssm::materialize_pending`)."""
    if max_seqlen is None:
        return _materialize(cache, state_indices, A, backend=backend)
    return _materialize_pending(cache, state_indices, A, backend=backend, max_seqlen=max_seqlen)


__all__ = [
    "CACHE_ARGS", "SCHEMAS", "WRITES", "cache_args", "clear", "decode", "decode_pending", "initialize",
    "materialize", "register_scratch", "scratch_handle",
]
