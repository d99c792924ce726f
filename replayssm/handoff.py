"""Slot hand-off: copy and fork, prefix snapshots, host swap (export / import). docs/format.md
section 5a is the contract (what moves, the random stream, slot ids: host ids always checked,
CUDA ids only with REPLAYSSM_DEBUG=1); docs/design.md section 9 the copy and staging kernels."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Sequence
from itertools import groupby

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import api
from . import checks as chk
from . import layout as L
from .formats import Format, format_of
from .kernels import triton_interpreting, backend_for, check_backend
from .kernels.env import debug
from .pending import MAX_SEQLEN

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
COMPACT_KEY = "state"  # export(compact=True): the materialized FP32 state alone


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as the integer type of its width: copies move bits (NaN poison, FP8 and
    FP4 codes included) and every dtype has index_select / index_copy_ on every device."""
    return t.view(_INT_VIEW[t.element_size()])


def per_slot_names(cache: Sequence[torch.Tensor], fmt: Format) -> list[tuple[str, int]]:
    """[(name, cache index)] of every per-slot tensor, named as `layout.tensor_specs` does."""
    heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
    specs = L.tensor_specs(heads, groups, fmt, cache[L.POSITIONS].dim() == 2, *L.dims(cache))
    return [(name, i if i < len(specs) else len(cache) - 1) for i, (name, _, _) in enumerate(specs, start=1)]


# -- validation ---------------------------------------------------------------------------
def _ids(name: str, ids: object, device: torch.device) -> torch.Tensor:
    ids = chk.int_ids(name, ids)
    if ids.device != device and ids.device.type != "cpu":
        raise ValueError(f"{name} must be on the cache device {device} or on the host; got {ids.device}")
    return ids.reshape(-1)


def check_host_ids(name: str, values: list[int], num_slots: int, *, unique: bool = True) -> None:
    """Every id in [1, num_slots - 1] and, with `unique`, each once; else a ValueError."""
    bad = sorted({s for s in values if not 0 < s < num_slots})
    if bad:
        raise ValueError(f"{name} must be slot ids in [1, {num_slots - 1}]; got {bad} in {values}")
    if unique and len(set(values)) != len(values):
        rep = sorted(s for s, k in Counter(values).items() if k > 1)
        raise ValueError(f"{name} must name each slot once; slot(s) {rep} repeat; got {values}")


def validate_pair(
    src, dst, device, num_slots: int, *, keep_dtype: bool = False, unique_src: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """src / dst ids (same count; values in range, dst (and with `unique_src` src) unique, the
    two disjoint) on the cache device as int64, or with `keep_dtype` as given (the copy
    kernel's; host ids: one host-to-device copy). Ids on the host are checked on every call,
    ids on the device (a sync) with REPLAYSSM_DEBUG=1."""
    src, dst = _ids("src", src, device), _ids("dst", dst, device)
    if src.numel() != dst.numel():
        raise ValueError(f"src and dst must hold the same number of slots; got {src.numel()} and {dst.numel()}")
    host = src.device.type == "cpu" and dst.device.type == "cpu"
    checks = debug()
    s = src.tolist() if checks or src.device.type == "cpu" else None
    d = dst.tolist() if checks or dst.device.type == "cpu" else None
    if s is not None:
        check_host_ids("src", s, num_slots, unique=unique_src)
    if d is not None:
        check_host_ids("dst", d, num_slots)
    if s is not None and d is not None and (both := sorted(set(s) & set(d))):
        raise ValueError(f"src and dst must be disjoint; slot(s) {both} are in both (src {s}, dst {d})")
    if not keep_dtype:
        return src.to(device, torch.int64), dst.to(device, torch.int64)
    if host and device.type != "cpu":
        return tuple(torch.stack([src.to(torch.int64), dst.to(torch.int64)]).to(device))
    return src.to(device), dst.to(device)


def validate_slots(slots, device, num_slots: int) -> torch.Tensor:
    slots = _ids("slots", slots, device)
    if slots.device.type == "cpu" or debug():
        check_host_ids("slots", slots.tolist(), num_slots)
    return slots.to(device, torch.int64)


# -- copy -----------------------------------------------------------------------------------
def copy_rows(cache: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst rows <- src rows of every per-slot tensor (valid int64 ids on the cache device)."""
    if src.numel() == 0:
        return
    for t in cache[1:]:
        b = as_bits(t)
        b.index_copy_(0, dst, b.index_select(0, src))


def use_kernel(device: torch.device, backend: str, caches: Sequence = ()) -> bool:
    """Whether a copy runs on the copy kernel: "reference" never, "kernels" always (a ValueError
    where it cannot), "auto" on a CUDA device unless a cache of `caches` chose "reference", on the
    CPU (the interpreter: tests) only when every cache of `caches` runs the kernels backend."""
    check_backend(backend)
    if backend == "reference":
        return False
    interpreting, reason = triton_interpreting(), None
    if device.type == "cuda" and interpreting:
        reason = "TRITON_INTERPRET=1 runs Triton kernels on host memory only; the cache is on the GPU"
    elif device.type != "cuda" and not interpreting:
        reason = f"the copy kernel needs a CUDA device (or TRITON_INTERPRET=1 on the CPU); got {device}"
    else:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            reason = f"Triton is unavailable ({exc})"
    if backend == "kernels" and reason is not None:
        raise ValueError(f"backend='kernels' cannot copy here: {reason}; pass backend='auto' or 'reference'")
    if backend == "kernels" or reason is not None:
        return reason is None
    if device.type == "cuda":
        return all(c.backend != "reference" for c in caches)
    return bool(caches) and all(c.backend_name == "kernels" for c in caches)


class CopyPlan:
    """The copy kernel's table for cache tuples on one device (one row per chunk of every
    per-slot tensor), built once; `copy` is one capturable launch for every tensor."""

    def __init__(self, tuples: Sequence[Sequence[torch.Tensor]], num_slots: int, chunk: int | None = None):
        from .kernels.triton import copy_slots as K

        device = tuples[0][L.CHECKPOINT].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "copy_slots: the copy table of these caches is built on the first call, which cannot run inside a "
                "CUDA graph capture; call it once (or replayssm.handoff.copy_plan) before capturing"
            )
        self.device, self.num_slots = device, num_slots
        self.chunk = K.default_chunk() if chunk is None else chunk
        self.table = K.copy_table([t for c in tuples for t in c[1:]], device, self.chunk)
        self.staging: StagePlan | None = None  # built by the first staged export / import
        self._kernels = K

    def _launch(self, fn, table: torch.Tensor, ids: torch.Tensor, buffer: torch.Tensor, **kw) -> None:
        index = self.device.index
        other = self.device.type == "cuda" and index is not None and index != torch.cuda.current_device()
        # Triton launches on the current device
        with torch.cuda.device(index) if other else contextlib.nullcontext():
            fn(table, ids, buffer, self.num_slots, chunk=self.chunk, **kw)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots src[i] -> dst[i] in every tensor (validated ids on the device; padding pairs skipped)."""
        self._launch(self._kernels.copy_slots, self.table, src, dst)

    def stage_plan(self, tuples: Sequence[Sequence[torch.Tensor]], formats: Sequence[Format]) -> StagePlan:
        if self.staging is None:
            self.staging = StagePlan(tuples, formats, self.device, self.chunk)
        return self.staging

    def stage(self, slots: torch.Tensor, staging: torch.Tensor, *, to_staging: bool) -> None:
        """Every per-slot tensor of `slots` into the byte buffer `staging` (`to_staging`), or back."""
        self._launch(self._kernels.stage_slots, self.staging.table, slots, staging, to_staging=to_staging)


class StagePlan:
    """Where every per-slot tensor of cache tuples lies in one byte buffer of n slots
    (`copy_slots.stage_rows`): tensor k's n slots at bytes [n * prefix_k, n * (prefix_k + size_k))."""

    def __init__(self, tuples, formats: Sequence[Format], device: torch.device, chunk: int):
        from .kernels.triton import copy_slots as K

        names, tensors = zip(*[((layer, name), c[i]) for layer, (c, f) in enumerate(zip(tuples, formats))
                               for name, i in per_slot_names(c, f)])  # fmt: skip
        kinds = [(name, tuple(t.shape[1:]), t.dtype) for (_, name), t in zip(names, tensors)]
        rows, prefixes = K.stage_rows(tensors, chunk, kinds)
        self.table = K.stage_table(rows, device)
        self.names = [[name for layer_, name in names if layer_ == layer] for layer in range(len(tuples))]
        sizes = [t[0].numel() * t.element_size() for t in tensors]
        self.slot_bytes = sum(sizes)
        # Runs of one kind in staging order (prefix 0 first), each at consecutive places (the
        # prefixes add up the sizes in that order): (kind, prefix, slot bytes, [(layer, name)]).
        order = sorted(range(len(kinds)), key=prefixes.__getitem__)
        runs = [list(run) for _, run in groupby(order, key=kinds.__getitem__)]
        self.groups = [(kinds[r[0]], prefixes[r[0]], sizes[r[0]], [names[k] for k in r]) for r in runs]

    def views(self, buffer: torch.Tensor, n: int) -> list[dict[str, torch.Tensor]]:
        """Per-layer dicts {name: [n, *per-slot shape]} viewing the byte buffer of n slots."""
        out = [dict.fromkeys(names) for names in self.names]
        for (_, shape, dtype), prefix, size, members in self.groups:
            region = buffer[n * prefix : n * (prefix + len(members) * size)]
            for (layer, name), t in zip(members, region.view(dtype).view(len(members), n, *shape).unbind(0)):
                out[layer][name] = t
        return out

    def buffer_of(self, data: Sequence[dict], n: int) -> torch.Tensor | None:
        """The uint8 buffer of n * slot_bytes that the per-layer dicts `data` view when every
        tensor is a contiguous view at its place in one storage (as `views` made them); else None."""
        if n == 0 or len(data) != len(self.names):
            return None
        layer, name = self.groups[0][3][0]
        first = data[layer][name]
        base, cuda, storage = first.data_ptr(), first.is_cuda, first.untyped_storage()
        offset, nbytes = base - storage.data_ptr(), n * self.slot_bytes
        if offset < 0 or offset + nbytes > storage.nbytes():
            return None
        for _, at, size, members in self.groups:  # tensor j of a run: prefix at + j * size
            for j, t in enumerate(data[layer][name] for layer, name in members):
                if t.data_ptr() != base + n * (at + j * size) or t.is_cuda != cuda or not t.is_contiguous():
                    return None
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, offset, (nbytes,))


# Plans of ReplaySSMCache lists by the caches' ids, with weak references (dropped when one dies) and
# their tensor tuples (a reused id or replaced tuple is never mistaken for them); never evicted while
# they live: a captured graph reads the table. Of bare tuples: by checkpoint, new on a layout change.
_LIST_PLANS: dict[tuple[int, ...], tuple[list, list, CopyPlan]] = {}
_TUPLE_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def copy_plan(caches: Sequence) -> CopyPlan:
    """The (cached) copy plan of a list of ReplaySSMCache (same num_slots, one device)."""
    key = tuple(map(id, caches))
    refs, tuples, plan = _LIST_PLANS.get(key, ((), (), None))
    if plan is not None and all(r() is c and c.tensors is t for r, c, t in zip(refs, caches, tuples)):
        return plan
    plan = CopyPlan([c.tensors for c in caches], caches[0].num_slots)

    def drop(_ref, key=key, plan=plan) -> None:
        if key in _LIST_PLANS and _LIST_PLANS[key][2] is plan:
            del _LIST_PLANS[key]

    _LIST_PLANS[key] = ([weakref.ref(c, drop) for c in caches], [c.tensors for c in caches], plan)
    return plan


def tuple_plan(cache: Sequence[torch.Tensor], num_slots: int) -> CopyPlan:
    layout = tuple((t.data_ptr(), t.stride(0), t.shape, t.dtype) for t in cache[1:])
    old, plan = _TUPLE_PLANS.get(cache[L.CHECKPOINT], (None, None))
    if plan is None or old != layout:
        plan = CopyPlan([cache], num_slots)
        _TUPLE_PLANS[cache[L.CHECKPOINT]] = (layout, plan)
    return plan


def copy_replayssm_slots(
    cache: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, *, state_dtype: str, backend: str = "auto"
) -> None:
    """Copy every per-slot tensor of slots `src` into slots `dst` (src may repeat: a fork). `backend` as
    for `replayssm.copy_slots`; a tuple's first call builds the kernel's table (it cannot be captured)."""
    fmt = format_of(state_dtype)
    num_slots = L.check_cache(cache, fmt).num_slots
    device = cache[L.CHECKPOINT].device
    kernel = use_kernel(device, backend)
    src, dst = validate_pair(src, dst, device, num_slots, keep_dtype=kernel)
    if kernel:
        tuple_plan(cache, num_slots).copy(src, dst)
    else:
        copy_rows(cache, src, dst)


def snapshot_replayssm_slots(
    cache: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, A: torch.Tensor, *, state_dtype: str,
    seed: int = 0, backend: str = "auto", head_offset: int = 0, max_seqlen: int | None = None,
) -> None:
    """Start slots `dst` as if prefilled with the materialized states of the unique slots `src` (`A` as
    for decode; a pending-mode cache needs `max_seqlen`, as `materialize_replayssm_state` does)."""
    fmt = format_of(state_dtype)
    checks = debug()
    chk.seed(seed)
    geometry = L.check_cache(cache, fmt)
    device = cache[L.CHECKPOINT].device
    src, dst = validate_pair(src, dst, device, geometry[0], unique_src=True)
    impl = backend_for(device, backend, cache, fmt)
    head_offset = chk.head_offset(head_offset)
    states = api.materialize(cache, geometry, impl, src, A, max_seqlen=max_seqlen)
    api.initialize(cache, geometry, impl, states, dst, fmt=fmt, seed=seed, checks=checks, head_offset=head_offset)


# -- host swap ------------------------------------------------------------------------------
def host_empty(shape, dtype) -> torch.Tensor:
    """A host tensor, pinned when CUDA is available (asynchronous copies both ways)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def export_replayssm_slots(
    cache: Sequence[torch.Tensor], slots: torch.Tensor, *, state_dtype: str, non_blocking: bool = False
) -> dict[str, torch.Tensor]:
    """Every per-slot tensor of `slots` as host tensors {name: [n, *per-slot shape]}. With
    `non_blocking` the copies are only queued on the current stream: synchronize first."""
    fmt = format_of(state_dtype)
    num_slots = L.check_cache(cache, fmt).num_slots
    device = cache[L.CHECKPOINT].device
    ids = validate_slots(slots, device, num_slots)
    if use_kernel(device, "auto"):
        return export_staged(tuple_plan(cache, num_slots), [cache], [fmt], ids, non_blocking)[0]
    return export_rows(cache, ids, fmt, non_blocking)


def export_rows(cache, ids: torch.Tensor, fmt: Format, non_blocking: bool) -> dict[str, torch.Tensor]:
    data = {}
    for name, i in per_slot_names(cache, fmt):
        t = cache[i]
        data[name] = host = host_empty((ids.numel(), *t.shape[1:]), t.dtype)
        as_bits(host).copy_(as_bits(t).index_select(0, ids), non_blocking=non_blocking and host.is_pinned())
    finish(cache, non_blocking)
    return data


def export_staged(plan: CopyPlan, tuples, formats: Sequence[Format], ids: torch.Tensor, non_blocking: bool) -> list[dict]:
    """Slots `ids` of every tuple: one gather launch, one copy to one host buffer; viewed per tuple."""
    staged, n = plan.stage_plan(tuples, formats), ids.numel()
    staging = torch.empty(n * staged.slot_bytes, dtype=torch.uint8, device=plan.device)
    plan.stage(ids, staging, to_staging=True)
    host = host_empty(staging.shape, torch.uint8)
    host.copy_(staging, non_blocking=non_blocking and host.is_pinned())
    finish(tuples[0], non_blocking)
    return staged.views(host, n)


def import_staged(plan: CopyPlan, tuples, formats: Sequence[Format], data: Sequence[dict], ids: torch.Tensor) -> bool:
    """When the checked full-form `data` view one buffer at the staging layout (an export's):
    one copy to the device and one scatter launch into slots `ids`, True; else False."""
    buffer = plan.stage_plan(tuples, formats).buffer_of(data, ids.numel())
    if buffer is None:
        return False
    staging = buffer.to(plan.device, non_blocking=buffer.is_pinned())
    if staging.data_ptr() % 16:  # already on the device, at an offset: the kernel wants 16-byte alignment
        staging = staging.clone()
    plan.stage(ids, staging, to_staging=False)
    return True


def finish(cache, non_blocking: bool) -> None:
    if not non_blocking and cache[L.CHECKPOINT].device.type == "cuda":
        torch.cuda.current_stream(cache[L.CHECKPOINT].device).synchronize()


def check_export(data: object, cache, fmt: Format, n: int, max_pending: int | None = None) -> bool:
    """Validate exported `data` for `n` slots of `cache` (keys, dtypes, shapes, devices, and the
    values the cache trusts where read without a GPU sync): True for the compact form."""
    if not isinstance(data, dict):
        raise TypeError(f"data must be a dict of tensors (from export); got {type(data).__name__}")
    if set(data) == {COMPACT_KEY}:
        want = {COMPACT_KEY: ((n, cache[L.CHECKPOINT].shape[1], *L.dims(cache)), torch.float32)}
    else:
        # the layout's shapes and dtypes (a checked cache holds them)
        want = {name: ((n, *cache[i].shape[1:]), cache[i].dtype) for name, i in per_slot_names(cache, fmt)}
        if set(data) != set(want):
            raise ValueError(
                f"data must hold the {fmt.name} cache's tensors {sorted(want)} (or only {COMPACT_KEY!r}, the compact "
                f"form); got keys {sorted(data)}"
            )
    device = cache[L.CHECKPOINT].device
    for name, (shape, dt) in want.items():
        t = chk.tensor(f"data[{name!r}]", data[name])
        if t.dtype != dt or tuple(t.shape) != shape:
            error = chk.DTypeError if t.dtype != dt else ValueError
            raise error(f"data[{name!r}] must be {dt} {list(shape)}; got {chk.describe(t)}")
        if t.device != device and t.device.type != "cpu":
            raise ValueError(f"data[{name!r}] must be on the host or the cache device {device}; got {t.device}")
    if COMPACT_KEY in want:
        return True
    pos, pending = chk.host_values(data["positions"]) or [], data["positions"].dim() == 2
    par = (chk.host_values(data["parity"]) or []) if fmt.two_level else []
    counts = [p[0] for p in pos] if pending else pos
    q_max = MAX_SEQLEN if max_pending is None else max_pending
    for bad, what in (
        ([c for c in counts if c < 0], "data['positions'] must hold token counts >= 0"),
        ([p[1] for p in pos if pending and not 0 <= p[1] <= q_max],
         f"data['positions'][:, 1] (tokens awaiting a verdict) must be in 0..{q_max} for this cache"),
        ([p for p in par if p not in (0, 1)],
         "data['parity'] must be 0 or 1 (the live half of the NVFP4 scales)"),
    ):  # fmt: skip
        if bad:
            raise ValueError(f"{what}; got {sorted(set(bad))}")
    return False


def import_replayssm_slots(
    cache: Sequence[torch.Tensor], data: dict[str, torch.Tensor], slots: torch.Tensor, *, state_dtype: str,
    seed: int = 0, backend: str = "auto", head_offset: int = 0,
) -> None:
    """Write exported `data` into `slots` (one per exported slot): the full form restores every tensor,
    the compact form initializes a prefill state (`seed`, `backend` as for `initialize_replayssm_state`)."""
    fmt = format_of(state_dtype)
    checks = debug()
    chk.seed(seed)
    head_offset = chk.head_offset(head_offset)
    geometry = L.check_cache(cache, fmt)
    device = cache[L.CHECKPOINT].device
    ids = validate_slots(slots, device, geometry[0])
    compact = check_export(data, cache, fmt, ids.numel())
    impl = backend_for(device, backend, cache, fmt)
    if not compact and backend != "reference" and use_kernel(device, "auto"):
        if import_staged(tuple_plan(cache, geometry[0]), [cache], [fmt], [data], ids):
            return
    import_rows(cache, geometry, impl, data, ids, compact, fmt=fmt, seed=seed, checks=checks, head_offset=head_offset)


def stage_import(cache, data: dict, compact: bool, fmt: Format):
    """Checked `data` on the cache device before anything is written (a failing copy fails
    first): the compact form's states, or [(cache index, integer view)]."""
    device = cache[L.CHECKPOINT].device
    if compact:
        return data[COMPACT_KEY].to(device, non_blocking=data[COMPACT_KEY].is_pinned())
    return [(i, as_bits(data[name]).to(device, non_blocking=data[name].is_pinned())) for name, i in per_slot_names(cache, fmt)]


def import_rows(cache, geometry, impl, data, ids, compact: bool, *, fmt: Format, seed: int, checks: bool, head_offset: int = 0,
            staged=None) -> None:  # fmt: skip
    """Write checked `data` (`staged` by `stage_import` if the caller did) into slots `ids`."""
    if staged is None:
        staged = stage_import(cache, data, compact, fmt)
    if compact:
        api.initialize(cache, geometry, impl, staged, ids, fmt=fmt, seed=seed, checks=checks, head_offset=head_offset)
        return
    for i, src in staged:
        as_bits(cache[i]).index_copy_(0, ids, src)


__all__ = [
    "CopyPlan", "StagePlan", "copy_plan", "copy_replayssm_slots", "export_replayssm_slots",
    "import_replayssm_slots", "snapshot_replayssm_slots",
]
