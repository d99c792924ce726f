"""Device code and backend choice: two backends with the same methods, run on inputs that
`replayssm.api` validated. `ReferenceBackend` is the PyTorch reference on any device;
`KernelBackend` runs CuTe DSL kernels for initialize, clear and every decode call and Triton
kernels for materialize and slot copies, on a CUDA GPU in the arch table with a 16-byte-aligned
cache (on the CPU only under TRITON_INTERPRET=1, for tests: the Triton kernels interpreted,
the rest the reference). `backend_for` picks one; "auto" falls back to the reference with a
`ReferenceFallbackWarning`, once per reason and process. Triton and the CuTe DSL are imported
on first use: `triton.jit` picks compiler or interpreter when a kernel is defined, so
TRITON_INTERPRET must be set before then.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref
from collections import namedtuple
from collections.abc import Sequence

import torch

from .. import layout as L
from ..formats import FORMATS, Format
from .buffers import PendingPlan, PlanScratch
from .. import pending as pend
from .. import reference as ref

BACKENDS = ("reference", "kernels")
BACKEND_CHOICES = ("auto", *BACKENDS)


class ReferenceFallbackWarning(UserWarning):
    """backend="auto" runs the PyTorch reference because the kernels cannot run; the
    message says why. Pass backend="reference" to choose the reference explicitly."""


class ReferenceBackend:
    """Runs every operation with the PyTorch reference (`replayssm.reference`)."""

    name = "reference"
    initialize = staticmethod(ref.initialize)
    clear = staticmethod(ref.clear)

    def decode(self, cache, x, dt, A, B, C, D, dt_bias, ids, out, *, fmt: Format, seed: int, head_offset: int = 0) -> None:
        ref.decode(cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt=fmt, seed=seed, head_offset=head_offset)

    def materialize(self, cache, ids, A, out=None) -> torch.Tensor:
        states = ref.materialize(cache, ids, A)
        return states if out is None else out.copy_(states)

    def decode_pending(self, cache, x, dt, A, B, C, D, dt_bias, ids, out, **kwargs) -> None:
        pend.pending_decode(cache, x, dt, A, B, C, D, dt_bias, ids, out, **kwargs)

    def materialize_pending(self, cache, ids, A, *, max_seqlen: int, out=None) -> torch.Tensor:
        states = pend.pending_materialize(cache, ids, A, max_seqlen=max_seqlen)
        return states if out is None else out.copy_(states)


# An eager step below this batch launches its two CuTe kernels one after the other on the
# current stream: the side stream's fork and join cost more host time (H200: 6-7 us a call)
# than running them side by side saves. A captured step always runs them side by side.
EAGER_FORK_MIN_BATCH = 512


class _CacheContext:
    """What the kernel backend keeps of one CUDA cache tuple between calls: (launch module,
    arch) or the reason the CuTe kernels cannot run it, and its launch objects by key
    (`decodes`: a decode call's prepare and step, one lookup a call). Weak references only:
    `alive` turns False when a tensor is freed, after which another tensor may take its id."""

    __slots__ = ("refs", "alive", "index", "cute", "reason", "prepares", "steps", "decodes", "pending",
                 "outgrown", "plan_launches", "pending_launches", "bookkeeping")  # fmt: skip

    def __init__(self, cache, cute, reason: str | None) -> None:
        self.alive = True
        self.refs = tuple(weakref.ref(t, self._freed) for t in cache)
        self.index = cache[L.CHECKPOINT].get_device()
        self.cute, self.reason = cute, reason
        self.prepares: dict[tuple, object] = {}
        self.steps: dict[tuple, object] = {}
        self.decodes: dict[tuple, tuple] = {}
        self.plan_launches: dict[tuple, object] = {}
        self.pending_launches: dict[tuple, object] = {}
        self.bookkeeping: dict[tuple, object] = {}
        self.pending = None  # buffers.PendingPlan
        self.outgrown: list = []  # the smaller ones before it: a captured graph may still use them

    def _freed(self, ref) -> None:
        self.alive = False


class KernelBackend:
    """The kernels (see the module docstring); a CUDA call the CuTe kernels cannot run is a
    ValueError, never a silent fallback. A step writes its plan into a `PlanScratch`: the
    caller's (`scratch=`), else the smallest shared one on the device with room for the batch
    (made at the batch rounded up to a power of two, at least 64), so it allocates nothing.
    Shared ones assume one stream per device: the kernels launched right after a prepare
    consume its plan before the next prepare on that stream overwrites it."""

    name = "kernels"

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, int], object] = {}
        self._cute_launch = None  # replayssm.kernels.cute.launch, or why it is unavailable (a str)
        self._cute_arch: dict[torch.device, tuple[str | None, str | None]] = {}  # (arch, reason)
        self._contexts: dict[tuple, _CacheContext] = {}

    def new_scratch(self, device: torch.device | str, rows: int) -> PlanScratch:
        """A private `PlanScratch` (ReplaySSMCache owns one, so caches decoded on different
        streams never share plan buffers)."""
        return PlanScratch(rows, torch.device(device))

    def scratch(self, device: torch.device | str, rows: int) -> PlanScratch:
        """The smallest shared `PlanScratch` on `device` with room for `rows` rows."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        fits = [cap for dev, cap in self._scratch if dev == device and cap >= rows]
        if fits:
            return self._scratch[(device, min(fits))]
        capacity = max(64, 1 << max(rows - 1, 0).bit_length())
        return self._scratch.setdefault((device, capacity), PlanScratch(capacity, device))

    def initialize(self, cache, states, ids, *, fmt: Format, seed: int, head_offset: int = 0) -> None:
        """One CuTe launch on the current stream (cute/bookkeeping.py); on the CPU the reference."""
        if cache[L.CHECKPOINT].device.type != "cuda":
            return ref.initialize(cache, states, ids, fmt=fmt, seed=seed, head_offset=head_offset)
        self._bookkeeping(self._context(cache, "initialize"), cache, ids, states, fmt, seed, head_offset)

    def clear(self, cache, ids) -> None:
        if cache[L.CHECKPOINT].device.type != "cuda":
            return ref.clear(cache, ids)
        self._bookkeeping(self._context(cache, "clear"), cache, ids, None, None, 0, 0)

    @staticmethod
    def _bookkeeping(ctx, cache, ids, states, fmt: Format | None, seed: int, head_offset: int) -> None:
        """Initialize (`fmt` given) or clear."""
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        if ids.shape[0] == 0:
            return
        key = (fmt, seed, head_offset)
        launch = ctx.bookkeeping.get(key)
        if launch is None:
            from .cute.bookkeeping import BookkeepingLaunch

            launch = ctx.bookkeeping[key] = BookkeepingLaunch(cache, fmt, seed, head_offset, ctx.cute[1])
        launch(ids, ctx.cute[0].current_stream(ctx.index), states)

    def prepare(self, cache, ids, out, *, fmt: Format, seed: int, scratch=None) -> ref.Plan:
        """Kernel twin of `reference.prepare_decode` (cute/plan.py) into `scratch` (a shared
        one when None); returns its views. Where the CuTe kernels cannot run, the reference."""
        ctx = self._context(cache) if cache[L.CHECKPOINT].device.type == "cuda" else None
        if ctx is None or ctx.cute is None:
            return ref.prepare_decode(cache, ids, out, fmt=fmt, seed=seed)
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        if scratch is None:
            scratch = self.scratch(ids.device, ids.shape[0])
        if ids.shape[0] == 0:
            return scratch.plan(0)
        stream = ctx.cute[0].current_stream(ids.get_device())
        self._prepare_launch(ctx, cache, scratch, fmt, seed)(ids, out, stream)
        return scratch.plan(ids.shape[0])

    @staticmethod
    def _prepare_launch(ctx, cache, scratch: PlanScratch, fmt: Format, seed: int):
        key = (fmt, seed, scratch.words)
        prep = ctx.prepares.get(key)
        if prep is None:
            from .cute.plan import PrepareLaunch

            prep = ctx.prepares[key] = PrepareLaunch(cache, scratch, fmt, seed, ctx.cute[1])
        return prep

    def decode(
        self, cache, x, dt, A, B, C, D, dt_bias, ids, out, *, fmt: Format, seed: int, scratch=None, head_offset: int = 0
    ) -> None:
        """The prepare kernel, then the CuTe step (flush and non-flush kernel); on the CPU the
        reference. On CUDA, x, B, C may be [batch, H * 64] / [batch, G * 128]."""
        if not cache[L.CHECKPOINT].is_cuda:
            ref.decode(cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt=fmt, seed=seed, head_offset=head_offset)
            return
        ctx = self._context(cache, "decode")
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        batch = ids.numel()
        if batch == 0:
            return
        if scratch is None:
            scratch = self.scratch(cache[L.CHECKPOINT].device, batch)
        plan = scratch.plan(batch)
        key = (batch, fmt, seed, head_offset, scratch.words)
        launches = ctx.decodes.get(key)
        if launches is None:
            step_key = (batch, fmt, head_offset, scratch.words)
            step = ctx.steps.get(step_key)
            if step is None:
                step = ctx.steps[step_key] = ctx.cute[0].Step(cache, plan, fmt.name, ctx.cute[1], head_offset)
            launches = ctx.decodes[key] = (self._prepare_launch(ctx, cache, scratch, fmt, seed), step)
        prepare, step = launches
        stream = ctx.cute[0].current_stream(ctx.index)
        prepare(ids, out, stream)
        fork = batch >= EAGER_FORK_MIN_BATCH or torch.cuda.is_current_stream_capturing()
        step(cache, plan, x, dt, A, B, C, D, dt_bias, out, stream, fork=fork)

    def _context(self, cache, op: str | None = None) -> "_CacheContext":
        """The `_CacheContext` of a CUDA cache tuple, keyed by the tensors' ids (a context
        still `alive` was made for these very tensors); with `op`, a ValueError where the CuTe
        kernels cannot run the cache."""
        key = tuple(map(id, cache))
        ctx = self._contexts.get(key)
        if ctx is None or not ctx.alive:
            if len(self._contexts) >= 4096:
                self._contexts.clear()
            reason = self.cute_unavailable(cache)
            cute = None if reason else (self._cute_launch, self._cute_arch[cache[L.CHECKPOINT].device][0])
            ctx = self._contexts[key] = _CacheContext(cache, cute, reason)
        if op and ctx.cute is None:
            raise ValueError(f"the kernel backend cannot {op} this cache: {ctx.reason}")
        return ctx

    def decode_pending(
        self, cache, x, dt, A, B, C, D, dt_bias, ids, out, *, fmt: Format, seed: int, max_seqlen: int,
        num_accepted_tokens=None, cu_seqlens=None, head_offset: int = 0,
    ) -> None:  # fmt: skip
        """Pending mode: the plan kernel (cute/plan.py), then the CuTe fold and step
        (`cute.pending.fold_and_step`), no host sync. On the CPU and where the CuTe kernels
        cannot run, the reference (which reads a few values on the host)."""
        if cache[L.CHECKPOINT].device.type == "cuda":
            ctx = self._context(cache)
            if ctx.cute is not None and not triton_interpreting():
                return self._pending_launch(
                    ctx, cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt, seed, max_seqlen, num_accepted_tokens, cu_seqlens,
                    head_offset,
                )  # fmt: skip
        REFERENCE.decode_pending(
            cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt=fmt, seed=seed, max_seqlen=max_seqlen,
            num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, head_offset=head_offset,
        )  # fmt: skip

    def _pending_launch(
        self, ctx, cache, x, dt, A, B, C, D, dt_bias, ids, out, fmt, seed, max_seqlen, accepted, cu_seqlens, head_offset
    ) -> None:  # fmt: skip
        """x, B, C, out go as they are where the step reads them so (`reads_as_is`), else as
        contiguous copies. The plan buffer grows (at least doubled) for a larger batch; the
        outgrown ones stay alive, so a CUDA graph captured with any of them replays it."""
        k = _pending_cute()
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        batch = ids.shape[0]
        if batch == 0:
            return
        if ctx.pending is None or ctx.pending.rows < batch:
            if ctx.pending is not None:
                ctx.outgrown.append(ctx.pending)
            ctx.pending = PendingPlan(max(batch, 64, 2 * (ctx.pending.rows if ctx.pending else 0)), cache[L.CHECKPOINT].device)
        varlen = cu_seqlens is not None
        ok = k.reads_as_is
        P, N = L.dims(cache)
        if not (ok(x, P, varlen) and ok(B, N, varlen) and ok(C, N, varlen)):
            heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
            lead = x.shape[:1] if varlen else x.shape[:2]
            x, B, C = (
                t if ok(t, w, varlen) else t.reshape(*lead, n, w).contiguous()
                for t, n, w in ((x, heads, P), (B, groups, N), (C, groups, N))
            )
        result = out
        if not ok(out, P, varlen):  # contiguous (the API checked it) but not 16-byte aligned
            out = torch.empty_like(out)
        plan = ctx.pending
        stream = k.current_stream(cache[L.CHECKPOINT].get_device())
        key = (fmt, seed, max_seqlen, plan.words)
        launch = ctx.plan_launches.get(key)
        if launch is None:
            from .cute.plan import PendingPlanLaunch

            launch = ctx.plan_launches[key] = PendingPlanLaunch(cache, plan, fmt, seed, max_seqlen, ctx.cute[1])
        launch(ids, accepted, cu_seqlens, stream)
        key = (fmt.name, head_offset, plan.words)
        launcher = ctx.pending_launches.get(key)
        if launcher is None:
            launcher = ctx.pending_launches[key] = k.PendingLaunch(
                cache, plan.buf, plan.fold_list, fmt.name, ctx.cute[1], head_offset
            )
        rows, fold_list = plan.buf[:batch], plan.fold_list
        k.fold_and_step(
            cache, x, dt, A, B, C, D, dt_bias, out, rows, fold_list, lambda: launcher.fold(cache, A, rows, fold_list, stream),
            state_dtype=fmt.name, arch=ctx.cute[1], varlen=varlen, stream=stream, launcher=launcher,
        )  # fmt: skip
        if out is not result:
            result.copy_(out)

    def materialize_pending(self, cache, ids, A, *, max_seqlen: int, out=None) -> torch.Tensor:
        from .triton.materialize import materialize

        return materialize(cache, ids, A, out, max_seqlen=max_seqlen)

    def materialize(self, cache, ids, A, out=None) -> torch.Tensor:
        """The Triton materialize kernel: one launch, no host sync; into `out` when given."""
        from .triton.materialize import materialize

        return materialize(cache, ids, A, out)

    def cute_unavailable(self, cache: Sequence[torch.Tensor] | None = None, device: torch.device | str | None = None) -> str | None:
        """None when the CuTe decode kernels can run `cache` (without one, on `device`): a CUDA
        device, the CuTe DSL importable, a GPU in the arch table, a 16-byte-aligned layout;
        else the reason. Import and arch query are done once per process / device."""
        device = torch.device(device) if cache is None else cache[L.CHECKPOINT].device
        if device.type != "cuda":
            return f"the CuTe decode kernels need a CUDA device; got {device}"
        if self._cute_launch is None:
            try:
                from .cute import launch

                self._cute_launch = launch
            except Exception as e:  # ImportError, or the DSL failing to initialize
                self._cute_launch = f"the CuTe DSL decode kernels are unavailable ({type(e).__name__}: {e})"
        if isinstance(self._cute_launch, str):
            return self._cute_launch
        if device not in self._cute_arch:
            from .cute.arch import arch_for

            try:
                self._cute_arch[device] = (arch_for(device), None)
            except ValueError as exc:
                self._cute_arch[device] = (None, str(exc))
        arch, reason = self._cute_arch[device]
        if arch is None or cache is None:
            return reason
        reason = self._cute_launch.layout_ok(cache)
        return None if reason is None else f"the CuTe decode kernels cannot address this cache: {reason}"

    def cute_for(self, cache):
        """(launch module, arch) when the CuTe decode kernels can run `cache`, else None."""
        if self.cute_unavailable(cache) is not None:
            return None
        return self._cute_launch, self._cute_arch[cache[L.CHECKPOINT].device][0]

    def warmup(self, cache) -> list[str]:
        """Compile the kernels for a `ReplaySSMCache` and create its plan scratch, changing
        nothing in the cache: every launch uses padding rows (slot 0) only."""
        fmt, seed, tensors = cache.format, cache.seed, cache.tensors
        device, heads = tensors[L.CHECKPOINT].device, tensors[L.CHECKPOINT].shape[1]
        scratch = self.scratch(device, cache.max_batch)
        cute = self.cute_for(tensors)
        if cute is None:  # every operation runs the reference (CPU): nothing to compile
            return []
        P, N = L.dims(tensors)
        out = torch.empty(2, heads, P, dtype=torch.bfloat16, device=device)
        # Prefill states read by 16-byte rows (broadcast, as `reset` passes them, or
        # contiguous) and element by element (a transposed view).
        rows = torch.zeros(1, heads, P, N, device=device)
        columns = torch.zeros(1, heads, N, P, device=device).transpose(2, 3)
        names = []
        for dtype in (torch.int32, torch.int64):
            ids = torch.zeros(2, dtype=dtype, device=device)
            for states in (rows, columns):
                self.initialize(tensors, states.expand(2, -1, -1, -1), ids, fmt=fmt, seed=seed)
            self.clear(tensors, ids)
            self.prepare(tensors, ids, out, fmt=fmt, seed=seed, scratch=scratch)
            names += [f"cute.initialize[{dtype}]", f"cute.clear[{dtype}]", f"cute.prepare[{dtype}]"]
        # Every decode variant a step may launch, then launched once on padding rows so their
        # modules are loaded before any graph capture.
        launch, arch = cute
        names += launch.warmup(cache.state_dtype, heads, tensors[L.B_RING].shape[1], arch)
        ids = torch.zeros(2, dtype=torch.int32, device=device)
        plan = self.prepare(tensors, ids, out, fmt=fmt, seed=seed, scratch=scratch)
        launch.launch_padding(tensors, plan, out, cache.state_dtype, arch)
        return names


def compile_all(arch: str, dump_dir) -> list[str]:
    """Compile every CuTe DSL decode kernel variant for `arch` (no GPU needed) into the
    existing folder `dump_dir`; returns the paths of the PTX and cubin files."""
    from .cute.arch import check_arch
    from .env import arch_override

    check_arch(arch)
    arch_override()  # a bad $REPLAYSSM_ARCH is an error here too, though `arch` wins
    from .cute.launch import compile_all as _compile_all

    return _compile_all(arch, dump_dir)


_PendingCute = namedtuple("_PendingCute", "PendingLaunch fold_and_step reads_as_is current_stream")


@functools.cache
def _pending_cute() -> _PendingCute:
    """Pending mode's CuTe launchers, imported on first use (a tuple: tests replace one)."""
    from .cute.launch import current_stream
    from .cute.pending import PendingLaunch, fold_and_step, reads_as_is

    return _PendingCute(PendingLaunch, fold_and_step, reads_as_is, current_stream)


REFERENCE = ReferenceBackend()
_WARNED: set[str] = set()  # fallback reasons already warned about in this process


@functools.cache
def kernel_backend() -> KernelBackend:
    """The process-wide `KernelBackend` (its shared plan scratch lives there)."""
    return KernelBackend()


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_backend(backend: object) -> str:
    """`backend` when it is one of BACKEND_CHOICES, else a TypeError / ValueError."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str in {BACKEND_CHOICES}; got {type(backend).__name__}")
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}; got {backend!r}")
    return backend


def backend_for(
    device: torch.device | str, backend: str = "auto", cache: Sequence[torch.Tensor] | None = None,
    fmt: Format | None = None,
) -> ReferenceBackend | KernelBackend:
    """The backend for the caller's choice on `device`; with `cache` (a validated cache tuple)
    the kernels' layout is checked too, with `fmt` whether the kernels run that format.
    "kernels" off CUDA needs TRITON_INTERPRET=1, and is a ValueError saying why where the
    kernels cannot run; "auto" off CUDA is the reference (the interpreter is for tests)."""
    check_backend(backend)
    if backend == "reference":
        return REFERENCE
    device = torch.device(device)
    if fmt is not None and not fmt.on_kernels:
        kinds = tuple(name for name, f in FORMATS.items() if f.on_kernels)
        reason = f"the kernels run state_dtype {kinds}; got {fmt.name!r}"
    elif device.type != "cuda":
        if backend == "kernels":
            if triton_interpreting():
                return kernel_backend()
            raise ValueError(
                "backend='kernels' needs a CUDA device (or TRITON_INTERPRET=1, which runs the Triton "
                f"bookkeeping kernels on the CPU); got device {device}; pass backend='auto' or 'reference'"
            )
        reason = f"the kernels need a CUDA device; got {device}"
    else:
        reason = kernel_backend().cute_unavailable(cache, device)
        if reason is None:
            return kernel_backend()
    if backend == "kernels":
        raise ValueError(f"backend='kernels' cannot run here: {reason}; pass backend='auto' or 'reference'")
    if reason not in _WARNED:
        _WARNED.add(reason)
        # stacklevel: the user's line, the first frame outside replayssm and attrs-generated __init__s
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        frame, level = sys._getframe(), 1
        while frame is not None and frame.f_code.co_filename.startswith((package, "<attrs generated")):
            frame, level = frame.f_back, level + 1
        warnings.warn(
            f"replayssm backend='auto' runs the PyTorch reference: {reason} "
            "(pass backend='reference' to choose it explicitly)",
            ReferenceFallbackWarning,
            stacklevel=level,
        )
    return REFERENCE


__all__ = [
    "BACKENDS", "BACKEND_CHOICES", "KernelBackend", "REFERENCE", "ReferenceBackend",
    "ReferenceFallbackWarning", "backend_for", "check_backend", "compile_all", "kernel_backend",
]
