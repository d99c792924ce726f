"""The cache operations as torch custom ops, registered once here with `torch.library`:
`replayssm::initialize`, `replayssm::clear`, `replayssm::decode`, `replayssm::materialize`,
and for pending mode (speculative decoding, positions [S, 2]) `replayssm::decode_pending`,
`replayssm::materialize_pending`.

`torch.compile` sees each operation as one opaque op whose schema says which cache tensors
it writes, so a model that calls `ReplaySSMCache.decode` compiles with `fullgraph=True`;
the functional API (`replayssm.api`) and `ReplaySSMCache` validate on the host, then call
these ops through the wrappers below. The ops themselves validate nothing: host-side
validation runs before them, at trace time under torch.compile, on shapes and dtypes only.
One rule for every operation: under torch.compile the wrapper calls the op; an eager call
runs the op's body (the backend) directly, without the dispatcher's boxing of its ~20
arguments.

Schemas (`SCHEMAS` holds them; the cache tuple is passed tensor by tensor):

    replayssm::initialize(Tensor conv, Tensor(a!) checkpoint, Tensor(b!) x_ring,
        Tensor(c!) dt_ring, Tensor(d!) b_ring, Tensor(e!)? read_copy, Tensor(f!)? scales,
        Tensor(g!)? meta, Tensor(h!)? parity, Tensor(i!) positions, Tensor states,
        Tensor state_indices, *, str state_dtype, int seed, str backend) -> ()
    replayssm::clear(Tensor conv, Tensor checkpoint, Tensor(a!) x_ring, Tensor(b!) dt_ring,
        Tensor(c!) b_ring, Tensor? read_copy, Tensor? scales, Tensor? meta, Tensor? parity,
        Tensor(d!) positions, Tensor state_indices, *, str backend) -> ()
    replayssm::decode(Tensor conv, Tensor(a!) checkpoint, ..., Tensor(i!) positions
        (the cache as for initialize), Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C,
        Tensor D, Tensor dt_bias, Tensor state_indices, Tensor(j!) out, *, str state_dtype,
        int seed, str backend, int scratch) -> ()
    replayssm::materialize(Tensor conv, ..., Tensor positions (nothing written),
        Tensor state_indices, Tensor A, *, str backend) -> Tensor
    replayssm::decode_pending(the cache as for decode, Tensor x, ..., Tensor(j!) out,
        Tensor? num_accepted_tokens, Tensor? cu_seqlens, *, str state_dtype, int seed,
        str backend, int max_seqlen, int head_offset=0) -> ()
    replayssm::materialize_pending(the cache as for materialize, Tensor state_indices,
        Tensor A, *, str backend, int max_seqlen) -> Tensor

Choices:
- The cache tensors are separate arguments, not one `Tensor(a!)[]` list (which torch 2.13
  also accepts): a list marks every entry written, the conv state and, for `clear`, the
  checkpoint and read copy included, and functionalization (torch.compile without
  Inductor's re-inplacing, e.g. backend="aot_eager") then copies them all on every call.
  Per-tensor annotations name exactly what each op writes.
- One op per operation for every format: the read copy, scales, meta and parity are
  optional tensors (meta and parity None for FP8, all four for FP16; `cache_args` maps
  each tuple to the argument list). The conv state
  (cache[0]) is passed unannotated so the op rebuilds the caller's tuple as is.
- `backend` is the resolved backend's name, "reference" or "kernels"; choosing it ("auto",
  warnings, layout checks) happens once, before the op (`kernels.backend_for`).
- `seed` is passed as the int64 with the same value mod 2**64 (the random streams take the
  seed mod 2**64, docs/format.md), so every Python int seed fits the schema's int.
- `scratch` is a handle (`scratch_handle`) to a plan scratch for the kernel backend
  (ReplaySSMCache's own, or one passed to the functional API); 0 means the backend's
  shared scratch. The scratch is the op's private workspace, filled and consumed within
  the call, so the schema does not list it.
- Host checks that read data (REPLAYSSM_DEBUG=1's unique / owned slot and finite state
  checks) run only outside torch.compile (`torch.compiler.is_compiling()`): a compiled
  graph never synchronizes with the host for them, and debugging runs eagerly.
- No autograd formula: these are inference ops. Their kernels run under no_grad, so
  inputs that require grad leave no autograd history on the cache or `out`; the C++
  autograd fallback warns if a backward pass reaches materialize's output.
- A cache carved from one byte page per slot (`slot_padding` > 0, engine layouts) holds
  views of one storage with different dtypes: dynamo alone compiles it (backend="eager"),
  but torch 2.13's AOTAutograd, under aot_eager and Inductor, refuses mutated inputs of
  that kind ("does not yet handle input mutations on views with different dtypes").
  Separately allocated tensors (ReplaySSMCache's default) compile with every backend.
- Under torch.compile, validation raises at trace time: a rejected call is the eager
  ValueError / TypeError (with fullgraph=True, dynamo's Unsupported error carrying that
  message), and nothing is written.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from . import layout as L
from .formats import format_of
from .kernels import REFERENCE, kernel_backend

# The cache tuple as op arguments, in tuple order: (name, optional). `meta` and `parity`
# (NVFP4 only) are None for FP8; positions is the last entry of either tuple.
CACHE_ARGS = (
    ("conv", False),
    ("checkpoint", False),
    ("x_ring", False),
    ("dt_ring", False),
    ("b_ring", False),
    ("read_copy", True),
    ("scales", True),
    ("meta", True),
    ("parity", True),
    ("positions", False),
)
_ALL_STATE = {"checkpoint", "x_ring", "dt_ring", "b_ring", "read_copy", "scales", "meta", "parity", "positions"}
# What each op writes (cache tensors and outputs); everything else is read only.
WRITES = {
    "initialize": _ALL_STATE,
    "clear": {"x_ring", "dt_ring", "b_ring", "positions"},
    "decode": _ALL_STATE | {"out"},
    "materialize": set(),
    "decode_pending": _ALL_STATE | {"out"},
    "materialize_pending": set(),
}


def _schema(op: str, inputs: str, kwargs: str, returns: str) -> str:
    """The op's schema: the cache tensors with the alias set `(x!)` of each one `op`
    writes, then the op's own inputs (a trailing `?`: optional), keyword-only scalars and
    the returns."""
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    parts = []
    for name, optional in CACHE_ARGS:
        alias = f"({next(letters)}!)" if name in WRITES[op] else ""
        parts.append(f"Tensor{alias}{'?' if optional else ''} {name}")
    for name in inputs.split():
        optional = name.endswith("?")
        name = name.rstrip("?")
        alias = f"({next(letters)}!)" if name in WRITES[op] else ""
        parts.append(f"Tensor{alias}{'?' if optional else ''} {name}")
    return f"({', '.join(parts)}, *, {kwargs}) -> {returns}"


SCHEMAS = {
    "initialize": _schema("initialize", "states state_indices", "str state_dtype, int seed, str backend, int head_offset=0", "()"),
    "clear": _schema("clear", "state_indices", "str backend", "()"),
    "decode": _schema(
        "decode", "x dt A B C D dt_bias state_indices out",
        "str state_dtype, int seed, str backend, int scratch, int head_offset=0", "()",
    ),
    "materialize": _schema("materialize", "state_indices A", "str backend", "Tensor"),
    "decode_pending": _schema(
        "decode_pending", "x dt A B C D dt_bias state_indices out num_accepted_tokens? cu_seqlens?",
        "str state_dtype, int seed, str backend, int max_seqlen, int head_offset=0", "()",
    ),
    "materialize_pending": _schema("materialize_pending", "state_indices A", "str backend, int max_seqlen", "Tensor"),
}


def cache_args(cache: Sequence[torch.Tensor]) -> tuple:
    """A validated cache tuple (8 tensors for FP8, 10 for NVFP4, 6 for FP16) as the ops'
    ten cache arguments (meta, parity None for FP8; read copy and scales too for FP16)."""
    if len(cache) == 10:
        return tuple(cache)
    if len(cache) == 8:
        return (*cache[:7], None, None, cache[7])
    return (*cache[:5], None, None, None, None, cache[5])


def _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions) -> tuple:
    """The caller's cache tuple back from the op arguments (layout.py's indices)."""
    if read_copy is None:
        return (conv, checkpoint, x_ring, dt_ring, b_ring, positions)
    if meta is None:
        return (conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, positions)
    return (conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)


def _backend(name: str):
    """The backend object named `name` ("reference" or "kernels", as `backend_for` resolved it)."""
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
# handle -> scratch (weak: the owner, e.g. a ReplaySSMCache, keeps it alive) and
# id(scratch) -> handle (an entry is dropped when its scratch is collected, before the id
# can be reused). Looking up a registered scratch traces under torch.compile; registering
# does not (weakref), so ReplaySSMCache registers its scratch when it is built.
_SCRATCH: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_HANDLE_OF: dict[int, int] = {}
_NEXT_HANDLE = itertools.count(1)


def register_scratch(scratch) -> int:
    """The handle of `scratch` (a kernel backend `PlanScratch`), registering it first if
    needed; 0 for None."""
    if scratch is None:
        return 0
    handle = _HANDLE_OF.get(id(scratch))
    if handle is not None:
        return handle
    handle = next(_NEXT_HANDLE)
    _SCRATCH[handle] = scratch
    _HANDLE_OF[id(scratch)] = handle
    weakref.finalize(scratch, _HANDLE_OF.pop, id(scratch), None)
    return handle


def scratch_handle(scratch) -> int:
    """`register_scratch` with the lookup of a registered scratch first (what a compiled
    step traces)."""
    if scratch is None:
        return 0
    handle = _HANDLE_OF.get(id(scratch))
    return handle if handle is not None else register_scratch(scratch)


# -- the ops -------------------------------------------------------------------------------
# Registered with the plain `torch.library.Library` API, not `torch.library.custom_op`:
# custom_op runs Python kernels at the Autograd and ADInplaceOrView keys on every call, and
# its ADInplaceOrView kernel (`torch._library.utils.fill_defaults`) re-reads
# `schema.arguments` per argument (quadratic in the 23 arguments of decode): 130-250 us of
# host time a call on this project's CPU machine, against ~20 us here (most of it the
# dispatcher boxing 23 arguments), where the Autograd key takes the C++ fallback and
# ADInplaceOrView falls through. The kernels run under no_grad: the ops have no autograd
# formula (the fallback warns on backward), and a cache written from inputs that require
# grad (A from a parameter) must not pick up autograd history. The kernels are registered
# for CPU and CUDA; Meta and fake tensors get the fake implementations.

_LIB = torch.library.Library("replayssm", "DEF")


def _register(name: str, kernel, fake) -> torch._ops.OpOverload:
    _LIB.define(name + SCHEMAS[name])
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    torch.library.register_fake(f"replayssm::{name}", fake, lib=_LIB)
    return getattr(torch.ops.replayssm, name).default


def _initialize_kernel(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions,
    states, state_indices, *, state_dtype, seed, backend, head_offset=0,
) -> None:
    cache = _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)
    _run_initialize(cache, states, state_indices, state_dtype, seed, backend, head_offset)


def _run_initialize(cache, states, state_indices, state_dtype, seed, backend, head_offset) -> None:
    """The body of `replayssm::initialize` on a cache tuple (the op's implementation and
    the eager wrapper's)."""
    with torch.no_grad():
        _backend(backend).initialize(
            cache, states, state_indices, fmt=format_of(state_dtype), seed=seed, head_offset=head_offset
        )


def _clear_kernel(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions, state_indices, *, backend,
) -> None:
    cache = _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)
    _run_clear(cache, state_indices, backend)


def _run_clear(cache, state_indices, backend) -> None:
    """The body of `replayssm::clear` on a cache tuple."""
    with torch.no_grad():
        _backend(backend).clear(cache, state_indices)


def _decode_kernel(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions,
    x, dt, A, B, C, D, dt_bias, state_indices, out, *, state_dtype, seed, backend, scratch, head_offset=0,
) -> None:
    cache = _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)
    _run_decode(cache, x, dt, A, B, C, D, dt_bias, state_indices, out, state_dtype, seed, backend, scratch, head_offset)


def _run_decode(cache, x, dt, A, B, C, D, dt_bias, state_indices, out, state_dtype, seed, backend, scratch, head_offset) -> None:
    """The body of `replayssm::decode` on a cache tuple (`scratch`: a `scratch_handle`)."""
    batch = state_indices.numel()
    extra = {}
    if scratch:
        buf = _SCRATCH.get(scratch)
        if buf is not None:
            extra["scratch"] = buf
    with torch.no_grad():
        _backend(backend).decode(
            cache, x, dt, A, B, C, D, dt_bias, state_indices, out.view(batch, *cache[L.CHECKPOINT].shape[1:3]),
            fmt=format_of(state_dtype), seed=seed, head_offset=head_offset, **extra,
        )


def _materialize_kernel(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions, state_indices, A, *, backend,
) -> torch.Tensor:
    cache = _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)
    return _run_materialize(cache, state_indices, A, backend)


def _run_materialize(cache, state_indices, A, backend, max_seqlen: int | None = None) -> torch.Tensor:
    """The body of `replayssm::materialize` (`max_seqlen` None) and `::materialize_pending`."""
    with torch.no_grad():
        if max_seqlen is None:
            return _backend(backend).materialize(cache, state_indices, A)
        return _backend(backend).materialize_pending(cache, state_indices, A, max_seqlen=max_seqlen)


def _decode_pending_kernel(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions,
    x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
    *, state_dtype, seed, backend, max_seqlen, head_offset=0,
) -> None:
    cache = _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)
    _run_decode_pending(
        cache, x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
        state_dtype, seed, backend, max_seqlen, head_offset,
    )


def _run_decode_pending(
    cache, x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
    state_dtype, seed, backend, max_seqlen, head_offset,
) -> None:
    """The body of `replayssm::decode_pending` on a cache tuple."""
    with torch.no_grad():
        _backend(backend).decode_pending(
            cache, x, dt, A, B, C, D, dt_bias, state_indices, out, fmt=format_of(state_dtype), seed=seed,
            max_seqlen=max_seqlen, num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
            head_offset=head_offset,
        )


def _materialize_pending_kernel(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions, state_indices, A,
    *, backend, max_seqlen,
) -> torch.Tensor:
    cache = _cache_tuple(conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions)
    return _run_materialize(cache, state_indices, A, backend, max_seqlen)


def _writes_only(*args, **kwargs) -> None:
    """Fake implementation of initialize, clear and decode: they return nothing."""
    return None


def _materialize_fake(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions, state_indices, A, *, backend,
) -> torch.Tensor:
    # FP32 [n, heads, P, N], contiguous, on the device of the slot ids (the cache's).
    shape = (state_indices.numel(), *checkpoint.shape[1:])
    return state_indices.new_empty(shape, dtype=torch.float32)


def _materialize_pending_fake(
    conv, checkpoint, x_ring, dt_ring, b_ring, read_copy, scales, meta, parity, positions, state_indices, A,
    *, backend, max_seqlen,
) -> torch.Tensor:
    shape = (state_indices.numel(), *checkpoint.shape[1:])
    return state_indices.new_empty(shape, dtype=torch.float32)


_initialize_op = _register("initialize", _initialize_kernel, _writes_only)
_clear_op = _register("clear", _clear_kernel, _writes_only)
_decode_op = _register("decode", _decode_kernel, _writes_only)
_materialize_op = _register("materialize", _materialize_kernel, _materialize_fake)
_decode_pending_op = _register("decode_pending", _decode_pending_kernel, _writes_only)
_materialize_pending_op = _register("materialize_pending", _materialize_pending_kernel, _materialize_pending_fake)


# -- wrappers: a validated cache tuple and validated, normalized inputs in ---------------


def initialize(cache, states, state_indices, *, state_dtype: str, seed: int, backend: str, head_offset: int = 0) -> None:
    """`replayssm::initialize` on a validated cache tuple (`backend`: a resolved name).
    Eager calls go to the backend directly, as the op's implementation does, without the
    dispatcher (most of a small call's host time); torch.compile traces the op."""
    if not torch.compiler.is_compiling():
        _run_initialize(cache, states, state_indices, state_dtype, _int64(seed), backend, head_offset)
        return
    _initialize_op(
        *cache_args(cache), states, state_indices, state_dtype=state_dtype, seed=_int64(seed), backend=backend,
        head_offset=head_offset,
    )


def clear(cache, state_indices, *, backend: str) -> None:
    """`replayssm::clear` on a validated cache tuple (eager calls: the backend directly,
    as `initialize`)."""
    if not torch.compiler.is_compiling():
        _run_clear(cache, state_indices, backend)
        return
    _clear_op(*cache_args(cache), state_indices, backend=backend)


def decode(
    cache, x, dt, A, B, C, D, dt_bias, state_indices, out, *, state_dtype: str, seed: int, backend: str, scratch: int = 0,
    head_offset: int = 0,
) -> None:
    """`replayssm::decode` on a validated cache tuple and normalized inputs
    (`api.normalize_decode_inputs`); writes `out` (contiguous bf16, batch * heads * P
    elements) and the cache. `scratch`: a `scratch_handle`. Eager calls go to the backend
    directly (as `initialize`)."""
    if not torch.compiler.is_compiling():
        _run_decode(cache, x, dt, A, B, C, D, dt_bias, state_indices, out, state_dtype, _int64(seed), backend, scratch,
                    head_offset)  # fmt: skip
        return
    _decode_op(
        *cache_args(cache), x, dt, A, B, C, D, dt_bias, state_indices, out,
        state_dtype=state_dtype, seed=_int64(seed), backend=backend, scratch=scratch, head_offset=head_offset,
    )


def materialize(cache, state_indices, A, *, backend: str) -> torch.Tensor:
    """`replayssm::materialize` on a validated cache tuple; a new FP32 tensor. Eager
    calls go to the backend directly (as `initialize`)."""
    if not torch.compiler.is_compiling():
        return _run_materialize(cache, state_indices, A, backend)
    return _materialize_op(*cache_args(cache), state_indices, A, backend=backend)


def decode_pending(
    cache, x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
    *, state_dtype: str, seed: int, backend: str, max_seqlen: int, head_offset: int = 0,
) -> None:
    """`replayssm::decode_pending` on a validated pending cache tuple (positions [S, 2]) and
    normalized inputs (`api.normalize_pending_inputs`): dense x [b, T, H, P] with
    `cu_seqlens` None, or varlen x [total, H, P] with `cu_seqlens` int32 [b + 1]; writes
    `out` and the cache. Eager calls go to the backend directly (as `initialize`)."""
    if not torch.compiler.is_compiling():
        _run_decode_pending(
            cache, x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
            state_dtype, _int64(seed), backend, max_seqlen, head_offset,
        )
        return
    _decode_pending_op(
        *cache_args(cache), x, dt, A, B, C, D, dt_bias, state_indices, out, num_accepted_tokens, cu_seqlens,
        state_dtype=state_dtype, seed=_int64(seed), backend=backend, max_seqlen=max_seqlen, head_offset=head_offset,
    )


def materialize_pending(cache, state_indices, A, *, backend: str, max_seqlen: int) -> torch.Tensor:
    """`replayssm::materialize_pending` on a validated pending cache tuple: the FP32 states
    after the committed tokens; a new tensor. Eager calls go to the backend directly."""
    if not torch.compiler.is_compiling():
        return _run_materialize(cache, state_indices, A, backend, max_seqlen)
    return _materialize_pending_op(*cache_args(cache), state_indices, A, backend=backend, max_seqlen=max_seqlen)


__all__ = [
    "CACHE_ARGS", "SCHEMAS", "WRITES", "cache_args", "clear", "decode", "decode_pending", "initialize", "materialize",
    "materialize_pending",
    "register_scratch", "scratch_handle",
]
