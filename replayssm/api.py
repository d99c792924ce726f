"""Functional API with the serving engine's signatures: validate -> plan -> launch.

Everything a call could reject is checked before anything is written. `backend`: "auto"
(the default: the kernels where they can run, else the PyTorch reference with a warning),
"kernels" or "reference". A public function validates the cache tuple and calls its
checked entry (what `ReplaySSMCache` and the hand-off functions call), which validates
the other inputs and calls the op (`replayssm.ops`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import checks as chk
from . import layout as L
from . import ops
from .formats import Format, format_of
from .geometry import Geometry
from .kernels import backend_for
from .kernels.env import debug

_describe = chk.describe


def _expect(name: str, t: torch.Tensor, dtype: torch.dtype, ok: bool, want: str) -> None:
    """A DTypeError unless `t` is `dtype`, else a ValueError unless `ok`."""
    if t.dtype != dtype or not ok:
        error = chk.DTypeError if t.dtype != dtype else ValueError
        raise error(f"{name} must be {want}; got {_describe(t)}")


def _check_unique(ids: torch.Tensor, num_slots: int) -> None:
    """REPLAYSSM_DEBUG=1: live slots are unique (a host sync, so off on the hot path)."""
    live = ids[(ids > 0) & (ids < num_slots)]
    if live.numel() != torch.unique(live).numel():
        raise ValueError(f"state_indices must name each live slot once; got {ids.tolist()}")


def initialize_replayssm_state(
    cache: Sequence[torch.Tensor],
    states: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    state_dtype: str,
    seed: int = 0,
    backend: str = "auto",
    head_offset: int = 0,
) -> None:
    """Initialize the FP16 checkpoint and the read copy independently from FP32 prefill
    states [batch, heads, P, N] (may be broadcast over the batch), and clear the rings and
    positions of the slots. Nonpositive and out-of-range slot indices are ignored; with
    REPLAYSSM_DEBUG=1 live slots must be unique and their states finite. `head_offset`:
    the model's head of this cache's head 0 in a tensor-parallel shard (docs/format.md
    section 6)."""
    fmt = format_of(state_dtype)
    checks = debug()  # read (and validated) once per call
    chk.seed(seed)
    chk.head_offset(head_offset)
    geometry = L.check_cache(cache, fmt)
    impl = backend_for(cache[L.CHECKPOINT].device, backend, cache, fmt)
    initialize(
        cache, geometry, impl, states, state_indices, fmt=fmt, seed=seed, checks=checks,
        head_offset=head_offset,
    )


def initialize(
    cache, geometry: Geometry, impl, states, state_indices, *, fmt: Format, seed: int, checks: bool,
    head_offset: int = 0, ids_name: str = "state_indices",
) -> None:
    slots, heads, _, P, N = geometry
    device = cache[L.CHECKPOINT].device
    if chk.tensor("states", states).dtype != torch.float32 or states.dim() != 4 or states.shape[1:] != (heads, P, N):
        _expect("states", states, torch.float32, False, f"float32 [batch, {heads}, {P}, {N}]")
    chk.on_device("states", states, device)
    ids = chk.slot_ids(ids_name, state_indices, device)
    if ids.numel() != states.shape[0]:
        raise ValueError(f"{ids_name} must hold one slot per state ({states.shape[0]}); got {ids.numel()}")
    if ids.numel() == 0:
        return
    if checks and not torch.compiler.is_compiling():  # host reads: eager only
        _check_unique(ids, slots)
        live = (ids > 0) & (ids < slots)
        bad = (~torch.isfinite(states[live])).flatten(1).any(dim=1)
        if bool(bad.any()):
            rows = torch.nonzero(live).flatten()[bad].tolist()
            raise ValueError(f"states must be finite (REPLAYSSM_DEBUG=1); rows {rows} hold NaN or Inf")
    ops.initialize(cache, states, ids, state_dtype=fmt.name, seed=seed, backend=impl.name, head_offset=head_offset)


def clear_replayssm_slots(
    cache: Sequence[torch.Tensor], state_indices: torch.Tensor, *, state_dtype: str, backend: str = "auto"
) -> None:
    """Zero the rings and positions of the given slots (invalid ids ignored). `backend`
    as for `initialize_replayssm_state`."""
    fmt = format_of(state_dtype)
    debug()  # validates $REPLAYSSM_DEBUG, as every entry point does
    L.check_cache(cache, fmt)
    clear(cache, backend_for(cache[L.CHECKPOINT].device, backend, cache, fmt), state_indices)


def clear(cache, impl, state_indices) -> None:
    ids = chk.slot_ids("state_indices", state_indices, cache[L.CHECKPOINT].device)
    if ids.numel():
        ops.clear(cache, ids, backend=impl.name)


def _normalize(x, dt, A, B, C, D, dt_bias, lead: tuple, heads: int, groups: int, P, N, lay, dt_want):
    """x lead + [H, P] or lead + [H*P], B, C lead + [G, N] or lead + [G*N], all bf16, dt
    lead + [H] or a tied lead + [H, P], as views in the kernels' layout (x, B, C keep
    their row strides); A, D, dt_bias as `chk.params` leaves them."""
    for name, t, n, w in (("x", x, heads, P), ("B", B, groups, N), ("C", C, groups, N)):
        ok = tuple(chk.tensor(name, t).shape) in (lead + (n, w), lead + (n * w,))
        _expect(name, t, torch.bfloat16, ok, f"bfloat16 {[*lead, n, w]} or {[*lead, n * w]}{lay}")
    chk.floating("dt", dt)
    if tuple(dt.shape) not in (lead + (heads,), lead + (heads, P)):
        raise ValueError(f"dt must be {dt_want}; got {_describe(dt)}")
    tied = dt.dim() == len(lead) + 2
    chk.tied("dt", dt, dt if tied else dt.unsqueeze(-1))
    A, D, dt_bias = chk.params(A, D, dt_bias, heads, P, N)
    x, B, C = x.reshape(*lead, heads, P), B.reshape(*lead, groups, N), C.reshape(*lead, groups, N)
    return x, dt[..., 0] if tied else dt, A, B, C, D, dt_bias


def normalize_decode_inputs(
    x, dt, A, B, C, D, dt_bias, batch: int, heads: int, groups: int, P: int = L.HEAD_DIM, N: int = L.STATE_DIM
):
    """Validate one decode step's inputs and return them in the kernels' layout: x [b, H, P]
    (or [b, H*P]), dt [b, H] (or tied [b, H, P]; a float type other than f32 / bf16 / f16
    is converted), B, C [b, G, N] (or [b, G*N])."""
    dt_want = f"[{batch}, {heads}] or a tied [{batch}, {heads}, {P}] view"
    x, dt, *rest = _normalize(x, dt, A, B, C, D, dt_bias, (batch,), heads, groups, P, N, "", dt_want)
    return x, dt if dt.dtype in _DT_DTYPES else dt.float(), *rest


def normalize_pending_inputs(
    x, dt, A, B, C, D, dt_bias, lead: tuple[int, ...], heads: int, groups: int, P: int = L.HEAD_DIM,
    N: int = L.STATE_DIM,
):
    """`normalize_decode_inputs` of a pending-mode call, [b] replaced by `lead`: (b, T) for
    the dense layout, (total,) for varlen; dt of any float type is not converted."""
    lead = tuple(int(v) for v in lead)
    lay = "dense [b, T, ...] with T == max_seqlen" if len(lead) == 2 else "varlen [total, ...]"
    dt_want = f"{[*lead, heads]} or {[*lead, heads, P]} (tied) ({lay})"
    return _normalize(x, dt, A, B, C, D, dt_bias, lead, heads, groups, P, N, f" ({lay})", dt_want)


def _check_out(out: object, lead: tuple[int, ...], heads: int, lay: str, P: int = L.HEAD_DIM) -> None:
    """`out` of a decode call: contiguous bf16 lead + [H, P] (or lead + [H*P])."""
    ok = tuple(chk.tensor("out", out).shape) in (lead + (heads, P), lead + (heads * P,))
    want = f"contiguous bfloat16 {[*lead, heads, P]} or {[*lead, heads * P]}{lay}"
    _expect("out", out, torch.bfloat16, ok and out.is_contiguous(), want)


def check_max_seqlen(max_seqlen: object) -> int:
    """Pending mode's tokens per row and call: a Python int in 1..8."""
    from .pending import MAX_SEQLEN

    if not 1 <= chk.integer("max_seqlen", max_seqlen) <= MAX_SEQLEN:
        raise ValueError(f"max_seqlen must be in 1..{MAX_SEQLEN} in pending mode; got {max_seqlen}")
    return max_seqlen


def selective_state_update_replayssm(
    cache: Sequence[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    *,
    state_dtype: str,
    seed: int = 0,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 1,
    scratch=None,
    backend: str = "auto",
    head_offset: int = 0,
) -> torch.Tensor:
    """Decode one token per row and advance the device-resident positions.

    Applies softplus to dt + dt_bias. Rows whose slot is <= 0 or >= num_slots are padding:
    their output rows are zeroed and nothing else changes. Active slot indices must be
    unique (checked when REPLAYSSM_DEBUG=1). Returns `out` (bf16 [batch, heads, P]).
    `scratch`: optional per-row plan buffers for the kernel backend (shared ones
    otherwise). `backend` and `head_offset` as for `initialize_replayssm_state`.

    Pending mode (positions [slots, 2]; docs/format.md section 5b): each row brings up to
    `max_seqlen` (1..8) tokens; `num_accepted_tokens` (int32 / int64 [b], None: accept
    all) is the verdict on each row's previous call, clamped to the row's pending count
    (with REPLAYSSM_DEBUG=1 one outside 0..max_seqlen is a ValueError). Dense layout
    (`cu_seqlens` None): x [b, max_seqlen, H, P], dt [b, max_seqlen, H], B, C [b,
    max_seqlen, G, N], out [b, max_seqlen, H, P]. Varlen layout: `cu_seqlens` int32 [b + 1]
    (0 first, non-decreasing, x.shape[0] last), x [total, H, P], dt [total, H], B, C
    [total, G, N], out [total, H, P] (a row with no tokens still commits). Decode a
    cache's slots with one max_seqlen between inits (a pending count above the call's
    max_seqlen is rejected). Eager calls read cu_seqlens and the pending counts on the
    host for their checks (not while a CUDA graph is captured).
    """
    fmt = format_of(state_dtype)
    checks = debug()  # read (and validated) once per call
    chk.seed(seed)
    chk.head_offset(head_offset)
    geometry = L.check_cache(cache, fmt)
    if cache[L.POSITIONS].dim() == 2:
        check_max_seqlen(max_seqlen)
        impl = backend_for(cache[L.CHECKPOINT].device, backend, cache, fmt)
        return decode_pending(
            cache, geometry, impl, x, dt, A, B, C, D, dt_bias, state_indices, out,
            fmt=fmt, seed=seed, checks=checks, max_seqlen=max_seqlen,
            num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, head_offset=head_offset,
        )
    if num_accepted_tokens is not None or cu_seqlens is not None:
        raise ValueError(
            "num_accepted_tokens and cu_seqlens are pending-mode arguments (a cache with positions [slots, 2]); "
            f"this cache is in separate mode (positions {list(cache[L.POSITIONS].shape)}) and takes neither"
        )
    if max_seqlen != 1:
        raise ValueError(
            f"separate mode decodes one token per row: max_seqlen must be 1; got {max_seqlen} "
            "(allocate the cache with pending=True for speculative decoding)"
        )
    impl = backend_for(cache[L.CHECKPOINT].device, backend, cache, fmt)
    return decode(
        cache, geometry, impl, x, dt, A, B, C, D, dt_bias, state_indices, out,
        fmt=fmt, seed=seed, checks=checks, scratch=scratch, head_offset=head_offset,
    )


_INPUTS = ("x", "dt", "A", "B", "C", "D", "dt_bias", "out")


def decode(
    cache, geometry: Geometry, impl, x, dt, A, B, C, D, dt_bias, state_indices, out,
    *, fmt: Format, seed: int, checks: bool, scratch=None, head_offset: int = 0, try_direct: bool = True,
    ids_name: str = "state_indices",
) -> torch.Tensor:
    """One step: the eager fast path (`direct_decode`, unless `try_direct` is False: the
    caller tried it), else the validating path through the op."""
    slots, heads, groups, P, N = geometry
    device = cache[L.CHECKPOINT].device
    if (
        try_direct
        and not checks
        and impl.name == "kernels"
        and device.type == "cuda"
        and not torch.compiler.is_compiling()
        and direct_decode(cache, heads, groups, impl, x, dt, A, B, C, D, dt_bias, state_indices, out, fmt,
                          seed, scratch, head_offset)
    ):  # fmt: skip
        return out
    ids = chk.slot_ids(ids_name, state_indices, device)
    batch = ids.numel()
    _check_out(out, (batch,), heads, "", P)
    for name, t in zip(_INPUTS, (x, dt, A, B, C, D, dt_bias, out)):
        chk.on_device(name, chk.tensor(name, t), device)
    norm = normalize_decode_inputs(x, dt, A, B, C, D, dt_bias, batch, heads, groups, P, N)
    if batch == 0:
        return out
    if checks and not torch.compiler.is_compiling():  # host reads: eager only
        _check_unique(ids, slots)
    if scratch is not None and getattr(scratch, "rows", batch) < batch:
        raise ValueError(f"scratch holds {scratch.rows} rows; the batch has {batch}")
    ops.decode(
        cache, *norm, ids, out, state_dtype=fmt.name, seed=seed, backend=impl.name,
        scratch=ops.scratch_handle(scratch), head_offset=head_offset,
    )
    return out


# -- the eager fast path: inputs as engines pass them go straight to the kernel backend,
# without the op's dispatch (23 boxed arguments), after checks of types, shapes, strides,
# dtypes and devices only; anything else, a bad input included, takes the general path.
_IDS_DTYPES = (torch.int32, torch.int64)
_DT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAMS: dict[tuple, tuple] = {}  # (id(A), id(D), id(dt_bias), heads, ...) -> (tensors, versions, normalized)
_PARAMS_MAX = 1024


def _layer_params(A, D, dt_bias, heads: int, index: int, P: int, N: int):
    """`chk.params`, cached while no tensor's version counter moves (the entry holds them,
    so their ids stay theirs); None unless they are plain tensors on device `index`."""
    key = (id(A), id(D), id(dt_bias), heads, index, P, N)
    hit = _PARAMS.get(key)
    if hit is not None and hit[1] == (A._version, D._version, dt_bias._version):
        return hit[2]
    if any(type(t) is not torch.Tensor or t.get_device() != index for t in (A, D, dt_bias)):
        return None
    norm = chk.params(A, D, dt_bias, heads, P, N)
    if len(_PARAMS) >= _PARAMS_MAX:
        _PARAMS.clear()
    _PARAMS[key] = ((A, D, dt_bias), (A._version, D._version, dt_bias._version), norm)
    return norm


def direct_decode(cache, heads, groups, impl, x, dt, A, B, C, D, dt_bias, ids, out, fmt, seed, scratch,
                  head_offset) -> bool:  # fmt: skip
    """Run the step on the kernel backend if the inputs are in an accepted layout (x, B, C
    go as they are: the launcher reads their row strides), else return False. Each
    property is tested for every tensor at once: this runs every step."""
    index = cache[L.CHECKPOINT].get_device()
    if not (
        type(ids) is type(out) is type(x) is type(B) is type(C) is type(dt) is torch.Tensor
        and ids.get_device() == out.get_device() == x.get_device() == B.get_device() == C.get_device() == dt.get_device() == index
        and out.dtype is x.dtype is B.dtype is C.dtype is torch.bfloat16
        and ids.dtype in _IDS_DTYPES and dt.dtype in _DT_DTYPES
    ):  # fmt: skip
        return False
    shape = ids.shape
    batch = shape[0] if len(shape) == 1 else 0
    if batch == 0 or (scratch is not None and scratch.rows < batch):
        return False
    _, _, P, N = cache[L.CHECKPOINT].shape
    rows, bc = ((batch, heads, P), (batch, heads * P)), ((batch, groups, N), (batch, groups * N))
    if not (out.shape in rows and x.shape in rows and B.shape in bc and C.shape in bc and out.is_contiguous()):
        return False
    shape = dt.shape
    if shape != (batch, heads) and (shape != (batch, heads, P) or dt.stride()[2] != 0):
        return False  # the kernels read dt[b, h] through dt's first two strides
    params = _layer_params(A, D, dt_bias, heads, index, P, N)
    if params is None:
        return False
    A, D, dt_bias = params
    # No no_grad: the kernels write through raw pointers and record no autograd history.
    impl.decode(cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt=fmt, seed=seed, scratch=scratch, head_offset=head_offset)
    return True


def direct_decode_pending(cache, heads, groups, impl, x, dt, A, B, C, D, dt_bias, ids, out, fmt, seed, max_seqlen,
                           num_accepted_tokens, head_offset) -> bool:  # fmt: skip
    """`direct_decode` of a dense pending-mode call on a cache that holds one max_seqlen for
    its slots (`ReplaySSMCache`): T == max_seqlen tokens a row."""
    index = cache[L.CHECKPOINT].get_device()
    T = torch.Tensor
    if type(ids) is not T or ids.dim() != 1 or ids.dtype not in _IDS_DTYPES or ids.get_device() != index:
        return False
    batch = ids.shape[0]
    if batch == 0:
        return False
    acc = num_accepted_tokens
    if acc is not None and (
        type(acc) is not T or acc.dtype not in _IDS_DTYPES or acc.dim() != 1 or acc.shape[0] != batch or acc.get_device() != index
    ):
        return False
    _, _, P, N = cache[L.CHECKPOINT].shape
    for t, n, width in ((out, heads, P), (x, heads, P), (B, groups, N), (C, groups, N)):
        if type(t) is not T or t.dtype != torch.bfloat16 or t.get_device() != index:
            return False
        shape = t.shape
        if not (
            shape[:2] == (batch, max_seqlen)
            and (shape[2:] == (n, width) if len(shape) == 4 else len(shape) == 3 and shape[2] == n * width)
        ):  # fmt: skip
            return False
    if not out.is_contiguous():
        return False
    if type(dt) is not T or dt.dtype not in _DT_DTYPES or dt.get_device() != index:
        return False
    shape = dt.shape
    if not (
        len(shape) in (3, 4) and shape[0] == batch and shape[1] == max_seqlen and shape[2] == heads
        and (len(shape) == 3 or (shape[3] == P and dt.stride(3) == 0))
    ):  # fmt: skip
        return False
    params = _layer_params(A, D, dt_bias, heads, index, P, N)
    if params is None:
        return False
    A, D, dt_bias = params
    if len(shape) == 4:
        dt = dt[..., 0]
    impl.decode_pending(
        cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt=fmt, seed=seed, max_seqlen=max_seqlen,
        num_accepted_tokens=acc, cu_seqlens=None, head_offset=head_offset,
    )
    return True


def decode_pending(
    cache, geometry: Geometry, impl, x, dt, A, B, C, D, dt_bias, state_indices, out,
    *, fmt: Format, seed: int, checks: bool, max_seqlen: int, num_accepted_tokens=None, cu_seqlens=None,
    head_offset: int = 0, own_seqlen: bool = False, own_cu: bool = False, ids_name: str = "state_indices",
) -> torch.Tensor:
    """Validate a pending-mode call, then run the op. The caller guarantees with
    `own_seqlen` one max_seqlen for its slots' lifetime (`ReplaySSMCache`), with `own_cu`
    a valid cu_seqlens (`accept`): the eager checks that read the GPU are skipped."""
    slots, heads, groups, P, N = geometry
    device = cache[L.CHECKPOINT].device
    ids = chk.slot_ids(ids_name, state_indices, device)
    batch = ids.numel()
    varlen = cu_seqlens is not None
    chk.tensor("x", x)
    if varlen:
        if x.dim() not in (2, 3):
            raise ValueError(
                f"x must be bfloat16 [total, {heads}, {P}] or [total, {heads * P}] (varlen layout: cu_seqlens given); "
                f"got {_describe(x)}"
            )
        lead = (x.shape[0],)
    else:
        lead = (batch, max_seqlen)
    for name, t in zip(_INPUTS, (x, dt, A, B, C, D, dt_bias, out)):
        chk.on_device(name, chk.tensor(name, t), device)
    norm = normalize_pending_inputs(x, dt, A, B, C, D, dt_bias, lead, heads, groups, P, N)
    _check_out(out, lead, heads, " (varlen: one row a token)" if varlen else " (dense, T == max_seqlen)", P)
    chk.verdicts(num_accepted_tokens, batch, device, max_seqlen)
    if varlen and not own_cu:
        # Its values (a host read) outside torch.compile; inside it the op checks them.
        ok = tuple(chk.tensor("cu_seqlens", cu_seqlens).shape) == (batch + 1,)
        _expect("cu_seqlens", cu_seqlens, torch.int32, ok, f"int32 [{batch + 1}] (batch + 1)")
        chk.on_device("cu_seqlens", cu_seqlens, device)
        if chk.host_reads_allowed():
            from .pending import check_cu_seqlens

            check_cu_seqlens(cu_seqlens, batch, lead[0], max_seqlen)
    if batch == 0:
        return out
    host_reads = chk.host_reads_allowed()  # not under torch.compile or a CUDA graph capture
    if host_reads and checks:
        _check_unique(ids, slots)
    if host_reads and not own_seqlen:
        # The pending counts fit this call's max_seqlen (the op checks it under torch.compile).
        live = ids[(ids > 0) & (ids < slots)].long()
        q = cache[L.POSITIONS][live][:, 1]
        if q.numel() and int(q.max()) > max_seqlen:
            raise ValueError(
                f"max_seqlen must be the one this cache's slots were decoded with since their init: a slot holds "
                f"{int(q.max())} pending tokens; got max_seqlen={max_seqlen}"
            )
    ops.decode_pending(
        cache, *norm, ids, out, num_accepted_tokens, cu_seqlens, state_dtype=fmt.name, seed=seed,
        backend=impl.name, max_seqlen=max_seqlen, head_offset=head_offset,
    )
    return out


def materialize_replayssm_state(
    cache: Sequence[torch.Tensor], state_indices: torch.Tensor, A: torch.Tensor, *, state_dtype: str,
    backend: str = "auto", out: torch.Tensor | None = None, max_seqlen: int | None = None,
) -> torch.Tensor:
    """FP32 states [n, heads, P, N] of the given slots after every decoded token
    (checkpoint plus live ring entries); reads only. `A` as for decode; padding rows read
    as zero states. `out` (contiguous FP32 [n, heads, P, N] on the cache device) receives
    the states when given. A pending-mode cache needs the `max_seqlen` its slots are
    decoded with (where its checkpoints stand depends on it) and returns the states after
    the committed tokens; a separate-mode cache takes max_seqlen None or 1."""
    fmt = format_of(state_dtype)
    debug()  # validates $REPLAYSSM_DEBUG, as every entry point does
    geometry = L.check_cache(cache, fmt)
    impl = backend_for(cache[L.CHECKPOINT].device, backend, cache, fmt)
    return materialize(cache, geometry, impl, state_indices, A, out, max_seqlen=max_seqlen)


def materialize(
    cache, geometry: Geometry, impl, state_indices, A, out=None, *, max_seqlen=None, ids_name: str = "state_indices"
) -> torch.Tensor:
    _, heads, _, P, N = geometry
    pending_seqlen = None  # max_seqlen: required (1..8) for a pending cache, None or 1 for a separate one
    if cache[L.POSITIONS].dim() == 2:
        if max_seqlen is None:
            raise ValueError(
                "max_seqlen is required for a pending-mode cache (positions [slots, 2]): the max_seqlen its slots "
                "are decoded with; got None"
            )
        pending_seqlen = check_max_seqlen(max_seqlen)
    elif max_seqlen is not None and max_seqlen != 1:
        raise ValueError(f"max_seqlen must be None or 1 for a separate-mode cache; got {max_seqlen!r}")
    device = cache[L.CHECKPOINT].device
    ids = chk.slot_ids(ids_name, state_indices, device)
    A1 = chk.A_param(A, heads, P, N).to(ids.device)
    if out is not None:
        # The backend writes `out` directly: the op returns a new tensor (for torch.compile).
        shape = (ids.numel(), heads, P, N)
        ok = tuple(chk.tensor("out", out).shape) == shape and out.is_contiguous()
        _expect("out", out, torch.float32, ok, f"contiguous float32 {list(shape)}")
        chk.on_device("out", out, device)
        if pending_seqlen is not None:
            return impl.materialize_pending(cache, ids, A1, max_seqlen=pending_seqlen, out=out)
        return impl.materialize(cache, ids, A1, out)
    return ops.materialize(cache, ids, A1, backend=impl.name, max_seqlen=pending_seqlen)
