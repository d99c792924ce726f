"""Device code and backend choice.

`backend_for(device)` returns the object that runs the cache operations for tensors on
`device`: the PyTorch reference on the CPU (and wherever kernels are missing), the
Triton bookkeeping kernels on CUDA. Backends take inputs already validated and
normalized by `replayssm.api`; they never validate user input themselves.

The Triton kernels live in `replayssm.kernels.triton` and are imported on first use:
`triton.jit` chooses between compiler and CPU interpreter when a kernel is defined, so
TRITON_INTERPRET=1 (CPU tests) must be set before then; importing replayssm alone never
imports Triton. The CuTe DSL decode kernels (`replayssm.kernels.cute`, FP8 and NVFP4 read
copies) are imported on first use too; `compile_all` builds them for any target without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import layout as L
from .. import reference as ref

BACKENDS = ("torch", "triton")

log = logging.getLogger(__name__)


class ReferenceBackend:
    """Runs every operation with the PyTorch reference (`replayssm.reference`)."""

    name = "torch"

    def initialize(self, cache, states, ids, *, nvfp4: bool, seed: int) -> None:
        ref.initialize(cache, states, ids, nvfp4=nvfp4, seed=seed)

    def clear(self, cache, ids) -> None:
        ref.clear(cache, ids)

    def decode(self, cache, x, dt, A, B, C, D, dt_bias, ids, out, *, nvfp4: bool, seed: int) -> None:
        ref.decode(cache, x, dt, A, B, C, D, dt_bias, ids, out, nvfp4=nvfp4, seed=seed)


class _TritonKernels(NamedTuple):
    initialize: Callable
    clear: Callable
    prepare_decode: Callable
    PlanScratch: type


class TritonBackend:
    """Bookkeeping on Triton kernels (`initialize`, `clear`, the decode plan `prepare`)
    and the decode math on the CuTe DSL kernels (`cute_for`); where those cannot run
    (no CuTe DSL, an unsupported GPU, an unaligned cache) the decode math falls back to
    `reference.decode_nonflush` / `reference.decode_flush` fed the kernel-made plan,
    which is correct but synchronizes with the host (not CUDA-graph capturable).

    Runs on CUDA, and on the CPU when Triton interprets (TRITON_INTERPRET=1, for tests).

    Plan scratch: `prepare` / `decode` write the plan into a `PlanScratch` so a step
    allocates no device memory. A caller may pass its own (`scratch=`, e.g. one per cache
    sized for its max batch, or one per stream). Otherwise the backend keeps a few, keyed
    by (device, capacity): a call uses the smallest one with room for its batch, and only
    when none has room creates one (capacity: the batch rounded up to a power of two, at
    least 64), so once `warmup` has made the max-batch one, every later batch reuses an
    existing buffer -- the same one in eager calls and in a captured CUDA graph. Shared
    buffers assume one stream per device: a plan is consumed by the kernels launched right
    after it, before the next `prepare` on the same stream overwrites it.
    """

    name = "triton"

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, int], object] = {}
        self._cute_launch = None  # replayssm.kernels.cute.launch, False when unavailable
        self._cute_nvfp4 = None  # replayssm.kernels.cute.launch_nvfp4, loaded with it
        self._cute_arch: dict[torch.device, str | None] = {}
        self._warned: set[str] = set()

    @staticmethod
    def _kernels():
        from .triton import clear, initialize, prepare

        return _TritonKernels(initialize.initialize, clear.clear, prepare.prepare_decode, prepare.PlanScratch)

    def new_scratch(self, device: torch.device | str, rows: int):
        """A private `PlanScratch` for `rows` rows (ReplaySSMCache owns one, sized for its
        max_batch, so caches decoded on different streams never share plan buffers)."""
        return self._kernels().PlanScratch(rows, torch.device(device))

    def scratch(self, device: torch.device | str, rows: int):
        """The smallest shared `PlanScratch` on `device` with room for `rows` rows
        (created when none has room)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        fits = [cap for dev, cap in self._scratch if dev == device and cap >= rows]
        if fits:
            return self._scratch[(device, min(fits))]
        capacity = max(64, 1 << max(rows - 1, 0).bit_length())
        buf = self._kernels().PlanScratch(capacity, device)
        self._scratch[(device, capacity)] = buf
        return buf

    def initialize(self, cache, states, ids, *, nvfp4: bool, seed: int) -> None:
        self._kernels().initialize(cache, states, ids, nvfp4=nvfp4, seed=seed)

    def clear(self, cache, ids) -> None:
        self._kernels().clear(cache, ids)

    def prepare(self, cache, ids, out, *, nvfp4: bool, seed: int, scratch=None) -> ref.Plan:
        """Kernel twin of `reference.prepare_decode`; returns views into the scratch."""
        if scratch is None:
            scratch = self.scratch(ids.device, ids.numel())
        return self._kernels().prepare_decode(cache, ids, out, scratch, nvfp4=nvfp4, seed=seed)

    def decode(self, cache, x, dt, A, B, C, D, dt_bias, ids, out, *, nvfp4: bool, seed: int, scratch=None) -> None:
        """Prepare kernel, then the CuTe decode kernels (FP8 or NVFP4 on a supported GPU:
        both the non-flush and the flush kernel launch every step), else the reference decode."""
        plan = self.prepare(cache, ids, out, nvfp4=nvfp4, seed=seed, scratch=scratch)
        cute = self.cute_for(cache, nvfp4=nvfp4)
        if cute is not None:
            launch, arch = cute
            step = launch.decode_nvfp4 if nvfp4 else launch.decode_fp8
            step(cache, x, dt, A, B, C, D, dt_bias, plan, out, arch=arch)
            return
        ref.decode_nonflush(cache, x, dt, A, B, C, D, dt_bias, plan, out, nvfp4=nvfp4)
        ref.decode_flush(cache, x, dt, A, B, C, D, dt_bias, plan, out, nvfp4=nvfp4, seed=seed)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s; decoding with the PyTorch reference instead", message)

    def cute_for(self, cache, nvfp4: bool = False):
        """(launch module, arch) when the CuTe decode kernels can run `cache` (CUDA
        tensors, the CuTe DSL importable, a GPU in the arch table, 16-byte-aligned
        layout); None otherwise, with the reason logged once. The module is
        `cute.launch` (FP8) or `cute.launch_nvfp4` (`nvfp4=True`)."""
        device = cache[L.CHECKPOINT].device
        if device.type != "cuda":
            return None
        if self._cute_launch is None:
            try:
                from .cute import launch, launch_nvfp4

                self._cute_launch = launch
                self._cute_nvfp4 = launch_nvfp4
            except Exception as exc:  # ImportError, or the DSL failing to initialize
                self._cute_launch = False
                self._warn_once(f"the CuTe DSL decode kernels are unavailable ({type(exc).__name__}: {exc})")
        if self._cute_launch is False:
            return None
        if device not in self._cute_arch:
            from .cute.arch import arch_for

            try:
                self._cute_arch[device] = arch_for(device)
            except ValueError as exc:
                self._cute_arch[device] = None
                self._warn_once(str(exc))
        arch = self._cute_arch[device]
        if arch is None:
            return None
        reason = self._cute_launch.layout_ok(cache)
        if reason is not None:
            self._warn_once(f"the CuTe decode kernels cannot address this cache: {reason}")
            return None
        return (self._cute_nvfp4 if nvfp4 else self._cute_launch), arch

    def warmup(self, cache) -> list[str]:
        """Compile the bookkeeping kernels for a `ReplaySSMCache` and create its plan
        scratch, changing nothing in the cache: every launch uses padding rows only
        (slot 0), which write nothing but their own output rows."""
        nvfp4 = L.is_nvfp4(cache.state_dtype)
        tensors, device = cache.tensors, cache.tensors[L.CHECKPOINT].device
        heads = tensors[L.CHECKPOINT].shape[1]
        scratch = self.scratch(device, cache.max_batch)
        zero_state = torch.zeros(1, heads, L.HEAD_DIM, L.STATE_DIM, device=device)
        out = torch.empty(2, heads, L.HEAD_DIM, dtype=torch.bfloat16, device=device)
        names = []
        for dtype in (torch.int32, torch.int64):
            ids = torch.zeros(2, dtype=dtype, device=device)
            # Contiguous and broadcast (stride-0, as `reset` passes) prefill states.
            self.initialize(tensors, zero_state.repeat(2, 1, 1, 1), ids, nvfp4=nvfp4, seed=cache.seed)
            self.initialize(tensors, zero_state.expand(2, -1, -1, -1), ids, nvfp4=nvfp4, seed=cache.seed)
            self.prepare(tensors, ids, out, nvfp4=nvfp4, seed=cache.seed, scratch=scratch)
            names += [f"triton.initialize[{dtype}]", f"triton.clear[{dtype}]", f"triton.prepare[{dtype}]"]
        cute = self.cute_for(tensors, nvfp4=nvfp4)
        if cute is not None:
            # Compile the decode kernels in each variant a step may launch (the non-flush
            # kernel with PDL at batch 1, the flush with PDL above it), then launch them
            # once on padding rows (which exit at once) so their modules are loaded before
            # any graph capture.
            launch, arch = cute
            names += launch.warmup(heads, tensors[L.B_RING].shape[1], arch)
            ids = torch.zeros(2, dtype=torch.int32, device=device)
            plan = self.prepare(tensors, ids, out, nvfp4=nvfp4, seed=cache.seed, scratch=scratch)
            launch.launch_padding(tensors, plan, out, arch)
        return names


def compile_all(arch: str, dump_dir) -> list[str]:
    """Compile every CuTe DSL decode kernel variant (FP8 and NVFP4, non-flush and flush,
    8 and 16 heads per group) for `arch` ("sm_90a", "sm_100a" or "sm_103a"; no GPU needed) into
    the existing folder `dump_dir`; returns the paths of the PTX and cubin files."""
    from .cute.arch import check_arch
    from .env import arch_override

    check_arch(arch)
    arch_override()  # a bad $REPLAYSSM_ARCH is an error here too, though `arch` wins
    from .cute.launch import compile_all as _compile_all

    return _compile_all(arch, dump_dir)


REFERENCE = ReferenceBackend()
_TRITON: TritonBackend | None = None


def triton_backend() -> TritonBackend:
    """The process-wide `TritonBackend` (its shared plan scratch lives there)."""
    global _TRITON
    if _TRITON is None:
        _TRITON = TritonBackend()
    return _TRITON


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend_for(device: torch.device | str, prefer: str | None = None):
    """The backend for tensors on `device`: Triton on CUDA, the reference elsewhere.

    `prefer="torch"` forces the reference; `prefer="triton"` asks for the Triton backend,
    which on a non-CUDA device needs the Triton interpreter (TRITON_INTERPRET=1)."""
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"prefer must be None or one of {BACKENDS}; got {prefer!r}")
    if prefer == "torch":
        return REFERENCE
    device = torch.device(device)
    if device.type == "cuda":
        return triton_backend()
    if prefer == "triton":
        if not _triton_interpreting():
            raise ValueError(
                f"the triton backend needs a CUDA device or TRITON_INTERPRET=1; got device {device}"
            )
        return triton_backend()
    return REFERENCE


__all__ = [
    "BACKENDS",
    "ReferenceBackend",
    "TritonBackend",
    "REFERENCE",
    "backend_for",
    "compile_all",
    "triton_backend",
]
