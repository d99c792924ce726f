"""Launch-time helpers shared by the Triton launchers (no kernels here)."""

from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Launchers use it to pick tile sizes: the interpreter pays per program and per op, so
    it gets a few large programs; the GPU gets many small ones."""
    return bool(triton.knobs.runtime.interpret)


def int32_pattern(value: int) -> int:
    """A uint32 value as the int32 with the same bits (kernel scalars are int32, so every
    seed shares one compiled variant)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


def current_stream(device: torch.device) -> int | None:
    """The raw handle of the current CUDA stream of `device` (torch's raw-stream query),
    or None off CUDA and in the interpreter (launches then take Triton's own path)."""
    if device.type != "cuda" or interpreting():
        return None
    return torch._C._cuda_getCurrentRawStream(device.index)


def relaunchable(kernel):
    """The compiled kernel a launch through Triton's launcher returned (an asynchronous
    compile's future resolved), or None where it lacks what `launch_compiled` calls."""
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
        return kernel
    return None


def launch_compiled(kernel, grid: tuple, stream: int, args) -> None:
    """Launch a compiled kernel as Triton's launcher does (launch metadata and hooks
    included): `grid` three sizes, `args` every parameter in order (constexprs too), with
    tensors given as addresses."""
    hooks = triton.knobs.runtime
    metadata = kernel.launch_metadata(grid, stream, *args)
    kernel.run(
        grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata,
        hooks.launch_enter_hook, hooks.launch_exit_hook, *args,
    )


class Relaunch:
    """Repeated launches of one Triton kernel without Triton's per-call dispatch (binding,
    specialization key, cache lookup: most of a small launch's host time).

    A launch's variant key is, per argument, a tensor's dtype and 16-byte alignment (all
    Triton specializes a pointer on) or an integer's exact value (finer than Triton's
    specialization on divisibility by 16 and equality to 1), plus the constexprs. The first
    launch of a key goes through Triton's launcher with tensors and returns the compiled
    kernel, kept here; later ones make the call Triton's launcher makes (launch metadata
    and hooks included) with the tensors' addresses. Launches without a stream (CPU, the
    interpreter) always take Triton's path."""

    def __init__(self, fn, **options) -> None:
        self.fn = fn
        self.options = options
        self.names = list(fn.arg_names)
        self.compiled: dict[tuple, object] = {}

    def __call__(self, grid: tuple, stream: int | None, args: tuple, constexprs: dict) -> None:
        if stream is None:
            self.fn[grid](*args, **constexprs, **self.options)
            return
        values = list(args) + [constexprs[n] for n in self.names[len(args):]]
        key = tuple((v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor) else (type(v), v) for v in values)
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = relaunchable(self.fn[grid](*args, **constexprs, **self.options))
            if kernel is not None:
                self.compiled[key] = kernel
            return
        raw = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
        launch_compiled(kernel, (tuple(grid) + (1, 1))[:3], stream, raw)
