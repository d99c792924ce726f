"""Compile cache and the one launcher of the CuTe DSL decode kernels, both formats.

A step (after the Triton prepare kernel wrote the plan) launches two kernels, each for
every row of the batch: the flush (flush.py; rows at ring index 15) and the non-flush
kernel (decode.py; the other live rows). They touch disjoint slots and output rows, so
they run side by side: the one launched with programmatic dependent launch (PDL) stays on
the current stream right behind prepare (`StepConfig.flush_pdl`: the flush above batch 1,
else the non-flush kernel), the other goes on a side stream forked from the current one
after prepare and joined back after the step. A captured CUDA graph records the fork and
the join as edges.

Compile keys hold static properties only: the kernel, the format, arch, heads, groups
and the config's variant fields. Batch size, slot count and every stride are runtime
arguments (kernels take raw pointers plus slot strides in 16-byte units, so one compile
serves every batch, cache size and slot padding, and the kernels still know their vector
accesses are 16-byte aligned). Launchers map tensors to arguments (args.py); they do not
validate user input (`replayssm.api` did), only the layout the compiled code assumes
(`layout_ok`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import cutlass.cute as cute
import torch
from cuda.bindings import driver as cuda_driver
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_stream

from ... import layout as L
from . import args as A
from .arch import arch_for, check_arch
from .config import StepConfig, step_config, step_configs
from .decode import Decode
from .flush import Flush, flush_columns
from .read_copy import read_copy_format

STATE_DTYPES = ("fp8", "nvfp4")
# Geometries `compile_all` builds: 16 heads in 2 groups (8 heads per group, the serving
# geometry) and 16 heads in 1 group (16 heads per group).
COMPILE_ALL_GEOMETRIES = ((16, 2), (16, 1))

_COMPILED: dict[tuple, object] = {}


def _options(arch: str, dump_dir: str | os.PathLike | None) -> str:
    opts = f"--gpu-arch {arch}"
    if dump_dir is not None:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return opts


# The step's inputs as they arrive, part of the compile key: dt's type (f32, bf16 or f16:
# the kernels read it as it is and convert in registers; a Mamba-2 mixer's dt is bf16) and
# whether x, B, C are dense rows (a constant row stride) or row-strided column slices of a
# projection. H200, project benchmark, 16h/2g FP8 at batch 256: reading every input
# through runtime row strides made plain inputs' steps 2.5% slower, hence the dense
# variant. Warmup compiles the plain inputs with f32 and bf16 dt and an engine's.
DT_DTYPES = tuple(A.DSL_DTYPES)
WARMUP_INPUTS = ((True, torch.float32), (True, torch.bfloat16), (False, torch.bfloat16))


def decode_kernel(cfg: StepConfig, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True) -> tuple[Decode, list]:
    """The non-flush kernel object of `cfg` and its compile-time arguments."""
    fmt = read_copy_format(cfg.state_dtype, cfg.arch)
    obj = Decode(fmt, cfg.heads, cfg.groups, pdl=cfg.nonflush_pdl, read_hint=cfg.read_hint, dense_rows=dense_rows)
    return obj, [A.fake(A.Ring), A.fake(fmt.Args), A.fake(A.Inputs, dt=dt_dtype), A.fake(A.Plan), Int32(0), make_fake_stream()]


def flush_kernel(cfg: StepConfig, debug: bool = False, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True) -> tuple[Flush, list]:
    """The flush kernel object of `cfg` (`debug`: the test variant) and its compile-time
    arguments."""
    fmt = read_copy_format(cfg.state_dtype, cfg.arch)
    obj = Flush(fmt, cfg.heads, cfg.groups, pdl=cfg.flush_pdl, rows=cfg.flush_rows, debug=debug, dense_rows=dense_rows)
    plan = A.fake(A.DebugPlan if debug else A.Plan)
    inputs = A.fake(A.Inputs, dt=dt_dtype)
    fake = [A.fake(A.Checkpoint), A.fake(A.Ring), A.fake(fmt.Args), inputs, plan, Int64(0), Int32(0), make_fake_stream()]
    return obj, fake


def compiled_decode(cfg: StepConfig, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True):
    """The compiled non-flush launcher of `cfg` for these inputs (compiled on first use)."""
    key = ("decode", cfg.arch, cfg.state_dtype, cfg.heads, cfg.groups, cfg.nonflush_pdl, cfg.read_hint, dt_dtype, dense_rows)
    fn = _COMPILED.get(key)
    if fn is None:
        obj, fake = decode_kernel(cfg, dt_dtype, dense_rows)
        fn = _COMPILED[key] = cute.compile(obj, *fake, options=_options(cfg.arch, None))
    return fn


def compiled_flush(cfg: StepConfig, debug: bool = False, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True):
    """The compiled flush launcher of `cfg` for these inputs (compiled on first use)."""
    key = ("flush", cfg.arch, cfg.state_dtype, cfg.heads, cfg.groups, cfg.flush_pdl, cfg.flush_rows, debug, dt_dtype, dense_rows)
    fn = _COMPILED.get(key)
    if fn is None:
        obj, fake = flush_kernel(cfg, debug, dt_dtype, dense_rows)
        fn = _COMPILED[key] = cute.compile(obj, *fake, options=_options(cfg.arch, None))
    return fn


def variant_name(kind: str, cfg: StepConfig) -> str:
    """A readable name of one kernel variant: `decode-fp8-h16g2-pdl`, `flush-nvfp4-h64g8-rows32`."""
    name = f"{kind}-{cfg.state_dtype}-h{cfg.heads}g{cfg.groups}"
    if kind == "decode":
        name += "-pdl" if cfg.nonflush_pdl else ""
        name += {"": "", ".L2::128B": "-l2", ".cs": "-cs"}[cfg.read_hint]
    else:
        name += "-pdl" if cfg.flush_pdl else ""
        name += f"-rows{cfg.flush_rows}" if cfg.flush_rows != 16 else ""
    return name


def _variants(arch: str, state_dtype: str, heads: int, groups: int) -> dict[str, tuple[str, StepConfig]]:
    """{name: (kind, config)} of every kernel variant a step of this geometry may launch."""
    out = {}
    for cfg in step_configs(arch, state_dtype, heads, groups):
        for kind in ("decode", "flush"):
            out.setdefault(variant_name(kind, cfg), (kind, cfg))
    return out


def compile_into(obj, fake_args: list, arch: str, sub: Path) -> list[str]:
    """Compile kernel object `obj` for `arch` into folder `sub` (created); returns its PTX
    and cubin paths, and raises if the DSL wrote no PTX."""
    sub.mkdir(parents=True, exist_ok=True)  # the DSL writes into an existing folder only
    cute.compile(obj, *fake_args, options=_options(arch, sub))
    found = sorted(str(p) for p in sub.iterdir() if p.suffix in (".ptx", ".cubin"))
    if not any(p.endswith(".ptx") for p in found):
        raise RuntimeError(f"CuTe DSL compile of {type(obj).__name__} for {arch} wrote no PTX into {sub}")
    return found


def compile_all(arch: str, dump_dir: str | os.PathLike) -> list[str]:
    """Compile every decode kernel variant a step may launch, both formats, for `arch` (no
    GPU needed) and the geometries COMPILE_ALL_GEOMETRIES, each into its own folder
    `dump_dir/<variant_name>`; returns the PTX and cubin paths."""
    arch = check_arch(arch)
    root = Path(dump_dir)
    paths: list[str] = []
    for state_dtype in STATE_DTYPES:
        for heads, groups in COMPILE_ALL_GEOMETRIES:
            for name, (kind, cfg) in _variants(arch, state_dtype, heads, groups).items():
                obj, fake = decode_kernel(cfg) if kind == "decode" else flush_kernel(cfg)
                paths += compile_into(obj, fake, arch, root / name)
    return paths


def warmup(state_dtype: str, heads: int, groups: int, arch: str | None = None, inputs=WARMUP_INPUTS) -> list[str]:
    """Compile every kernel variant a step of this geometry may launch, for each of
    `inputs` ((dense rows, dt dtype) pairs; before CUDA-graph capture); returns their names."""
    arch = arch or arch_for()
    names = []
    for dense, dt_dtype in inputs:
        for name, (kind, cfg) in _variants(arch, state_dtype, heads, groups).items():
            if kind == "decode":
                compiled_decode(cfg, dt_dtype, dense)
            else:
                compiled_flush(cfg, False, dt_dtype, dense)
            names.append(f"cute.{name}[{arch},dt={str(dt_dtype).removeprefix('torch.')}{'' if dense else ',strided'}]")
    return names


def launch_padding(cache: Sequence[torch.Tensor], plan, out: torch.Tensor, state_dtype: str, arch: str, inputs=WARMUP_INPUTS) -> None:
    """Launch every config's kernels for a plan of padding rows only (they return at once
    and write nothing), for each of `inputs` as `warmup` takes them: loads the compiled
    modules, e.g. before CUDA-graph capture."""
    batch = plan.valid.shape[0]
    heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
    dev = out.device
    per_head = torch.zeros(heads, device=dev)
    D = torch.zeros(heads, L.HEAD_DIM, device=dev)
    for dense, dt_dtype in inputs:
        pad = 0 if dense else 8  # a wider row: x, B, C as row-strided column slices
        x = torch.zeros(batch, heads * L.HEAD_DIM + pad, dtype=torch.bfloat16, device=dev)[:, : heads * L.HEAD_DIM]
        bc = torch.zeros(batch, groups * L.STATE_DIM + pad, dtype=torch.bfloat16, device=dev)[:, : groups * L.STATE_DIM]
        x, bc = x.view(batch, heads, L.HEAD_DIM), bc.view(batch, groups, L.STATE_DIM)
        dt = torch.zeros(batch, heads, dtype=dt_dtype, device=dev)
        for cfg in step_configs(arch, state_dtype, heads, groups):
            decode_step(cache, x, dt, per_head, bc, bc, D, per_head, plan, out, state_dtype=state_dtype, config=cfg)


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and (t.shape[0] <= 1 or (t.stride(0) * t.element_size()) % 16 == 0)


def layout_ok(cache: Sequence[torch.Tensor]) -> str | None:
    """None when the compiled kernels can address `cache` (16-byte-aligned bases and
    slot strides for the tensors read with vector accesses), else the reason."""
    for i in (L.CHECKPOINT, L.X_RING, L.B_RING, L.READ_COPY):
        if not _aligned16(cache[i]):
            return f"cache[{i}] needs a 16-byte-aligned base and slot stride (data_ptr {cache[i].data_ptr():#x}, stride {cache[i].stride(0)})"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rows_ok(t: torch.Tensor) -> bool:
    """Whether the kernels read `t` ([batch, heads or groups, n] bf16) as it is: each
    row's heads (groups) contiguous, and the base and the row stride 16-byte aligned.
    Column slices of an engine's projection are (their row stride is its width)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0 and (t.stride(0) * 2) % 16 == 0


_SIDE: dict[torch.device, tuple] = {}


def _side_stream(device: torch.device) -> tuple:
    """(side stream, fork event, join event) of `device`, made once."""
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = (torch.cuda.Stream(device=device, priority=-1), torch.cuda.Event(), torch.cuda.Event())
    return side


def fork_streams(device: torch.device, flush_pdl: bool, main: torch.cuda.Stream) -> tuple:
    """(flush stream, non-flush stream) for one step: one is the current stream `main`,
    the other the side stream, forked here from `main` (the plan and the inputs are ready
    for it; a PDL kernel on `main` waits for them itself). `flush_pdl`: the flush on
    `main`, else the non-flush kernel. The fork reuses one event (a wait orders against
    the record made just before it)."""
    side, fork, _ = _side_stream(device)
    fork.record(main)
    side.wait_event(fork)
    return (main, side) if flush_pdl else (side, main)


def join_streams(device: torch.device, main: torch.cuda.Stream) -> None:
    """Join the side stream back into `main` after a step's kernels: everything after the
    step sees both kernels' writes (one reused event, as for the fork)."""
    side, _, join = _side_stream(device)
    join.record(side)
    main.wait_event(join)


def decode_step(
    cache: Sequence[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A_: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    plan,
    out: torch.Tensor,
    *,
    state_dtype: str,
    arch: str | None = None,
    config: StepConfig | None = None,
    state_out: torch.Tensor | None = None,
    head_offset: int = 0,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Launch the flush and the non-flush kernel of one step (after `prepare`).

    Inputs as `reference.decode_nonflush` takes them (normalized by `replayssm.api`);
    `plan` is the prepare kernel's `reference.Plan` (device buffers). `config` defaults to
    `step_config(arch, state_dtype, heads, groups, batch)`. `state_out` (float32
    [batch, H, 64, 128], contiguous) selects the flush's test variant, which also writes
    the FP32 state of every flushed row there. `head_offset`: the model's head of the
    cache's head 0 (a tensor-parallel shard's), for the checkpoint's random bits.
    `stream`: the current stream of x's device (looked up when None)."""
    batch, heads = x.shape[0], x.shape[1]
    groups = cache[L.B_RING].shape[1]
    if not rows_ok(x):
        x = x.clone(memory_format=torch.contiguous_format)
    if not rows_ok(B):
        B = B.clone(memory_format=torch.contiguous_format)
    if not rows_ok(C):
        C = C.clone(memory_format=torch.contiguous_format)
    if dt.dtype not in DT_DTYPES:
        dt = dt.float()
    xs, bs, cs = x.stride(0), B.stride(0), C.stride(0)
    dense = xs == heads * L.HEAD_DIM and bs == groups * L.STATE_DIM and cs == groups * L.STATE_DIM  # A.dense_rows
    if config is None:
        config = step_config(arch or arch_for(x.device), state_dtype, heads, groups, batch)
    if stream is None:
        stream = torch.cuda.current_stream(x.device)
    nonflush, flush, fmt, columns = _kernels(config, dt.dtype, dense, state_out is not None, x.get_device())
    ckpt_words, cache_words = _cache_words(cache, fmt, head_offset)
    # The argument words of both launches: the structs' fields, then the scalars.
    common = (*cache_words, *inputs_words(x, dt, A_, B, C, D, dt_bias, out, xs, bs, cs), *A.raw(A.Plan, **plan._asdict()))
    flush_words = (*ckpt_words, *common, columns, batch) if state_out is None else None

    def nonflush_structs():  # the executor path's arguments (a kernel's first launch)
        ring = A.bound(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING])
        inputs = A.bound(A.Inputs, x=x, dt=dt, A=A_, B=B, C=C, D=D, dt_bias=dt_bias, out=out)
        return (ring, A.bound(fmt.Args, **fmt.tensors(cache, L)), inputs, A.bound(A.Plan, **plan._asdict()))

    def flush_structs():
        ring, copy, inputs, plan_s = nonflush_structs()
        if state_out is not None:
            plan_s = A.bind(A.DebugPlan, **plan._asdict(), state=state_out)
        return (A.bound(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=head_offset), ring, copy, inputs, plan_s)

    flush_stream, nonflush_stream = fork_streams(x.device, config.flush_pdl, stream)
    _launch(flush, flush_structs, (columns, batch), flush_words, flush_stream)
    _launch(nonflush, nonflush_structs, (batch,), (*common, batch), nonflush_stream)
    join_streams(x.device, stream)


def inputs_words(x, dt, A_, B, C, D, dt_bias, out, x_stride: int, b_stride: int, c_stride: int) -> tuple:
    """`A.raw(A.Inputs, ...)` written out for the eager hot path (bf16 x, B, C: a row stride
    in elements is 16-byte units times 8), given the row strides of x, B and C."""
    return (
        x.data_ptr(), dt.data_ptr(), A_.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), out.data_ptr(),
        dt.stride(0), dt.stride(1), A_.stride(0), dt_bias.stride(0), D.stride(0), D.stride(1), x_stride // 8, b_stride // 8, c_stride // 8,
    )


# The cache's argument words (Ring, the read copy, the Checkpoint), made once per cache
# tuple: keyed by the tensors' ids, each entry holding weak references that must still be
# the very tensors of the call (a dead or another tensor under a reused id misses).
_CACHE_WORDS: dict[tuple, tuple] = {}
_CACHE_WORDS_MAX = 4096


def _cache_words(cache: Sequence[torch.Tensor], fmt, head_offset: int) -> tuple[tuple, tuple]:
    """(Checkpoint words, Ring + read-copy words) of `cache`."""
    key = (*map(id, cache), head_offset, fmt.Args)
    hit = _CACHE_WORDS.get(key)
    if hit is not None and all(r() is t for r, t in zip(hit[0], cache)):
        return hit[1], hit[2]
    ring = A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING])
    words = (tuple(A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=head_offset)), (*ring, *A.raw(fmt.Args, **fmt.tensors(cache, L))))
    if len(_CACHE_WORDS) >= _CACHE_WORDS_MAX:
        _CACHE_WORDS.clear()
    _CACHE_WORDS[key] = (tuple(weakref.ref(t) for t in cache), *words)
    return words


@functools.lru_cache(maxsize=1024)
def _kernels(config: StepConfig, dt_dtype: torch.dtype, dense: bool, debug: bool, device_index: int):
    """(non-flush launcher, flush launcher, read-copy format, flush CTA columns) of a step:
    resolved once per config, inputs' layout and device."""
    fmt = read_copy_format(config.state_dtype, config.arch)
    columns = flush_columns(config.heads, fmt.ctas_per_sm, _sm_count(device_index))
    return compiled_decode(config, dt_dtype, dense), compiled_flush(config, debug, dt_dtype, dense), fmt, columns


# Launching a compiled kernel through the DSL executor converts every argument into C
# pointers on every call (`make_ptr` objects, adapters, casts): most of an eager step's
# host time. The direct launcher passes the same argument words without building any DSL
# object: per compiled kernel and thread, a fixed array of 64-bit words (one a kernel
# argument) and the executor's packed argument array pointing at them; a launch writes the
# words and calls the executor's C entry point. It is set up on a kernel's first launch,
# which goes through the executor and proves the layout: the executor's own argument
# pointers must read back exactly the words (struct fields in order, the scalars, the
# stream), or the kernel keeps the executor path. Only a DSL with the executor internals
# below (nvidia-cutlass-dsl as pinned in pyproject.toml) gets the direct path.
_SCALAR_WIDTHS = {"decode": (4,), "flush": (8, 4)}  # (batch,) and (columns, batch); the stream is 8
_TLS = threading.local()


class _Direct:
    """The direct launch of one compiled kernel: argument words, packed pointers, entry."""

    __slots__ = ("words", "packed", "entry", "result")

    def __init__(self, executor, count: int) -> None:
        self.words = (ctypes.c_int64 * count)()
        base = ctypes.addressof(self.words)
        exe_args = [ctypes.c_void_p(base + 8 * i) for i in range(count)]
        packed = executor._get_invoke_packed_args_func(exe_args)  # the executor's buffer: copied
        self.packed = (ctypes.c_void_p * len(packed))()
        ctypes.memmove(self.packed, packed, ctypes.sizeof(packed))
        self.entry = executor.capi_func
        self.result = executor.cuda_result if executor._has_cuda_result else None

    def __call__(self, words) -> None:
        self.words[:] = words
        self.entry(self.packed)
        if self.result is not None and self.result.value != 0:
            raise RuntimeError(f"CUDA error {self.result.value} launching a replayssm CuTe kernel")


def _addr(p) -> int:
    return p.value if isinstance(p, ctypes.c_void_p) else int(p)


def _direct_for(fn, exe_args: list, words: tuple, widths: tuple):
    """A `_Direct` for `fn` if its executor exists and `exe_args` (the executor's argument
    pointers of a launch with these words) read back `words` at `widths`; else None."""
    executor = getattr(fn, "_default_executor", None)
    needed = ("_get_invoke_packed_args_func", "capi_func", "_has_cuda_result", "cuda_result")
    if executor is None or not all(hasattr(executor, a) for a in needed) or len(exe_args) != len(words):
        return None
    for p, w, width in zip(exe_args, words, widths):
        got = (ctypes.c_int64 if width == 8 else ctypes.c_int32).from_address(_addr(p)).value
        if got != w:
            return None
    return _Direct(executor, len(words))


def _launch(fn, structs, scalars: tuple, words: tuple | None, stream: torch.cuda.Stream) -> None:
    """Launch compiled kernel `fn` on `stream`: directly from `words` (the argument words:
    struct fields, then `scalars`; None for a launch that must take the executor path),
    else through the executor with `structs()` (the argument structs)."""
    table = getattr(_TLS, "direct", None)
    if table is None:
        table = _TLS.direct = {}
    handle = stream.cuda_stream
    direct = table.get(id(fn))
    if direct and words is not None:
        direct((*words, handle))
        return
    args = (*structs(), *scalars, cuda_driver.CUstream(handle))
    gen = getattr(getattr(fn, "execution_args", None), "generate_execution_args", None)
    if gen is None or not hasattr(fn, "run_compiled_program"):  # another DSL version: the plain call
        fn(*args)
        return
    exe_args, adapted = gen(args, {})
    fn.run_compiled_program(exe_args)
    if direct is None and words is not None:
        widths = tuple(w for s in args[: -1 - len(scalars)] for w in A.widths(type(s)))
        widths += _SCALAR_WIDTHS["flush" if len(scalars) == 2 else "decode"] + (8,)
        table[id(fn)] = _direct_for(fn, exe_args, (*words, handle), widths) or False
    del adapted  # the executor's converted objects live until the launch is queued


__all__ = [
    "COMPILE_ALL_GEOMETRIES", "STATE_DTYPES", "compile_all", "compile_into", "compiled_decode", "compiled_flush",
    "decode_kernel", "flush_kernel", "variant_name", "warmup", "launch_padding", "layout_ok", "fork_streams", "join_streams", "decode_step",
]
