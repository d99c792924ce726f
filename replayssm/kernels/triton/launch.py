"""Launch-time helpers shared by the Triton launchers (no kernels here)."""

from __future__ import annotations

import ctypes
import functools
import operator
import re
import struct

import torch
import triton

from .. import driver


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


def launch_hooked() -> bool:
    """Whether a Triton launch hook is set (a profiler such as proton): then launches go
    through Triton's launcher, which calls it. Triton keeps its hooks in chains (empty:
    none set) or, in older releases, as a callable or None."""
    runtime = triton.knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def _hook_set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def relaunchable(kernel) -> "Compiled | None":
    """The repeated launch (`Compiled`) of the compiled kernel a launch through Triton's
    launcher returned (an asynchronous compile's future resolved), or None where it lacks
    what Triton's launch calls."""
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
        return Compiled(kernel)
    return None


def keep(compiled: dict, key, launched, stream: int | None) -> None:
    """After a launch through Triton's launcher (`launched`: what it returned) on stream
    handle `stream`, keep its repeated launch (`Compiled`) in `compiled` under `key`;
    launches without a stream (the interpreter, the CPU) keep nothing."""
    if stream is None or interpreting():
        return
    kernel = relaunchable(launched)
    if kernel is not None:
        compiled[key] = kernel


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


# A compiled kernel's parameters as Triton's launcher passes them to cuLaunchKernelEx: the
# non-constexpr arguments in order, then its scratch pointers (NULL when the kernel needs
# no scratch). `param_layout` reads that list from the kernel's signature and proves it
# against the parameters of the kernel's PTX entry (count and widths), so a Triton whose
# convention differs keeps Triton's own launch.
_SIG_FORMATS = {"i32": "i4x", "u32": "I4x", "i64": "q", "u64": "Q", "fp32": "f4x"}  # one 8-byte slot each
_PTX_WIDTHS = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def param_layout(kernel) -> tuple[str, tuple[int, ...], int] | None:
    """(struct format of the argument slots, indices of the launch arguments that fill
    them, number of parameter slots) of a compiled Triton kernel whose PTX entry takes
    exactly its non-constexpr arguments (pointers, 32/64-bit integers, fp32) and up to two
    scratch pointers it does not use, launched without cluster, cooperative or PDL
    attributes; else None."""
    src, meta, asm = getattr(kernel, "src", None), getattr(kernel, "metadata", None), getattr(kernel, "asm", None)
    sig = getattr(src, "signature", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if not isinstance(sig, dict) or names is None or list(sig) != list(names) or meta is None or not asm or "ptx" not in asm:
        return None
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False) or getattr(meta, "launch_cooperative_grid", False):
        return None
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return None
    entry = re.search(r"\.entry\s+" + re.escape(str(getattr(meta, "name", ""))) + r"\s*\((.*?)\)", asm["ptx"], re.S)
    if entry is None:
        return None
    widths = [_PTX_WIDTHS.get(t) for t in re.findall(r"\.param\s+\.(\w+)", entry.group(1))]
    fmts, take = [], []
    for i, ty in enumerate(sig.values()):
        if ty == "constexpr":
            continue
        fmt = "Q" if isinstance(ty, str) and ty.startswith("*") else _SIG_FORMATS.get(ty)
        if fmt is None:
            return None
        fmts.append(fmt)
        take.append(i)
    extra = len(widths) - len(fmts)
    if not take or not 0 <= extra <= 2:
        return None
    fmts += ["Q"] * extra  # the scratch pointers: NULL (the buffer starts zeroed)
    if widths != [8 if f in ("q", "Q") else 4 for f in fmts]:
        return None
    return "<" + "".join(fmts[: len(take)]), tuple(take), len(fmts)


@functools.cache
def _cu_launch():
    """cuLaunchKernel (None where it cannot be loaded), called holding the GIL: no other
    thread repacks a `Compiled`'s buffer while the driver reads it."""
    return driver.function("cuLaunchKernel", [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3, hold_gil=True)


class Compiled:
    """Repeated launches of one compiled Triton kernel. Where `param_layout` proves its
    parameters, a launch writes them into a fixed buffer and calls cuLaunchKernel (one
    ctypes call: Triton's launcher adds a Python frame, the launch metadata and the
    parsing of every argument, constexprs included); with a launch hook set (a profiler),
    or an unproven layout, it is Triton's launch (`launch_compiled`)."""

    __slots__ = ("kernel", "pack", "take", "buf", "params", "block", "shared", "function", "launch")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        layout = param_layout(kernel)
        self.launch = _cu_launch() if layout is not None else None
        if self.launch is None:
            return
        fmt, take, count = layout
        self.pack = struct.Struct(fmt).pack_into
        self.take = operator.itemgetter(*take) if len(take) > 1 else (lambda args, i=take[0]: (args[i],))
        self.buf = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * count)(*(base + 8 * i for i in range(count)))
        self.block = 32 * kernel.metadata.num_warps
        self.shared = kernel.metadata.shared
        self.function = kernel.function

    def __call__(self, grid: tuple, stream: int, args) -> None:
        """Launch on stream handle `stream`: `grid` three sizes, `args` every parameter in
        order (constexprs too), tensors as addresses."""
        if self.launch is None or launch_hooked():
            launch_compiled(self.kernel, grid, stream, args)
            return
        if grid[0] * grid[1] * grid[2] == 0:
            return
        self.pack(self.buf, 0, *self.take(args))
        err = self.launch(self.function, grid[0], grid[1], grid[2], self.block, 1, 1, self.shared, stream, self.params, None)
        if err == _NO_CONTEXT:  # a thread without a current context: Triton's launch makes one current
            launch_compiled(self.kernel, grid, stream, args)
        elif err:
            raise RuntimeError(f"CUDA error {err} launching Triton kernel {self.kernel.metadata.name}")


class Relaunch:
    """Repeated launches of one Triton kernel without Triton's per-call dispatch (binding,
    specialization key, cache lookup: most of a small launch's host time).

    A launch's variant key is, per argument, a tensor's dtype and 16-byte alignment (all
    Triton specializes a pointer on) or an integer's exact value (finer than Triton's
    specialization on divisibility by 16 and equality to 1), plus the constexprs and the
    device of the first tensor. The first launch of a key goes through Triton's launcher
    with tensors and returns the compiled kernel, kept here (`Compiled`); later ones launch
    it with the tensors' addresses. Launches without a stream (CPU, the interpreter) always
    take Triton's path."""

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
        key += (next((v.get_device() for v in values if isinstance(v, torch.Tensor)), None),)
        kernel = self.compiled.get(key)
        if kernel is None:
            keep(self.compiled, key, self.fn[grid](*args, **constexprs, **self.options), stream)
            return
        raw = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
        kernel((tuple(grid) + (1, 1))[:3], stream, raw)
