"""Compile cache and the one launcher of the CuTe DSL decode kernels, every format.

A step (after the prepare kernel of plan.py wrote the plan) launches two kernels, each for
every row of the batch: the flush (flush.py; rows at ring index 15) and the non-flush
kernel (decode.py; the other live rows). They touch disjoint slots and output rows, so
they run side by side: the one launched with programmatic dependent launch (PDL) stays on
the current stream right behind prepare (`StepConfig.flush_pdl`: the flush above batch 1,
else the non-flush kernel), the other goes on a side stream forked from the current one
after prepare and joined back after the step. A captured CUDA graph records the fork and
the join as edges.

Compile keys hold static properties only: the kernel, the format, arch, heads, groups,
the config's variant fields and the cache geometry (head dim P, state dim N). Batch size,
slot count and every stride are runtime arguments (kernels take raw pointers plus slot
strides in 16-byte units, so one compile serves every batch, cache size and slot padding,
and the kernels still know their vector accesses are 16-byte aligned). Every kernel is compiled with the DSL's TVM-FFI entry
(`compile_entry`) and called with its argument structs as tuples of ints (`args.raw`),
its scalars and the stream handle; the structs that repeat between calls are made once
as the ffi.Array the entry takes a tuple as (`tvm_ffi.convert`; converting the tuples on
every call cost about 1 us an eager step on a CPU, `benchmarks/host_path.py`).
Launchers map tensors to arguments (args.py); they do not validate user input
(`replayssm.api` did), only the layout the compiled code assumes (`layout_ok`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import cutlass.cute as cute
import torch
import tvm_ffi  # noqa: F401  (apache-tvm-ffi: the runtime every compiled kernel is called through)
from cutlass import Int32, Int64
from cuda.bindings import driver as cuda_driver
from cutlass.cute.runtime import make_fake_stream

from ... import layout as L
from . import args as A
from .arch import arch_for, check_arch
from .config import StepConfig, step_config, step_configs
from .decode import Decode
from .flush import Flush, flush_columns, shape
from .read_copy import read_copy_format

STATE_DTYPES = ("fp8", "nvfp4", "fp16")
# Geometries `compile_all` builds: 16 heads in 2 groups (8 heads per group, the serving
# geometry) and 16 heads in 1 group (16 heads per group).
COMPILE_ALL_GEOMETRIES = ((16, 2), (16, 1))

_COMPILED: dict[tuple, object] = {}


def _options(arch: str, dump_dir: str | os.PathLike | None) -> str:
    opts = f"--gpu-arch {arch}"
    if dump_dir is not None:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return opts


def compile_entry(obj, fake_args: list, arch: str):
    """Compile kernel object `obj` for `arch` through the DSL's TVM-FFI entry: the result
    is called with its argument structs as tuples of ints (addresses, strides in the
    spec's units: `args.raw`), then the scalars, then the stream handle, on that stream.
    Returns the TVM-FFI function itself (no Python wrapper on the call), or the DSL's
    wrapper where the DSL built no host entry (no GPU of `arch` here: compile-only)."""
    fn = cute.compile(obj, *fake_args, options=_options(arch, None) + " --enable-tvm-ffi")
    entry = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else None
    return fn if entry is None else entry


# The step's inputs as they arrive, part of the compile key: dt's type (f32, bf16 or f16:
# the kernels read it as it is and convert in registers; a Mamba-2 mixer's dt is bf16) and
# whether x, B, C are dense rows (a constant row stride) or row-strided column slices of a
# projection. H200, project benchmark, 16h/2g FP8 at batch 256: reading every input
# through runtime row strides made plain inputs' steps 2.5% slower, hence the dense
# variant. Warmup compiles the plain inputs with f32 and bf16 dt and an engine's.
DT_DTYPES = tuple(A.DSL_DTYPES)
WARMUP_INPUTS = ((True, torch.float32), (True, torch.bfloat16), (False, torch.bfloat16))


def decode_kernel(cfg: StepConfig, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128) -> tuple[Decode, list]:
    """The non-flush kernel object of `cfg` (head dim `P`, state dim `N`) and its
    compile-time arguments."""
    fmt = read_copy_format(cfg.state_dtype, cfg.arch, P, N)
    obj = Decode(fmt, cfg.heads, cfg.groups, pdl=cfg.nonflush_pdl, read_hint=cfg.read_hint, dense_rows=dense_rows)
    return obj, [A.fake(A.Ring), A.fake(fmt.Args), A.fake(A.Inputs, dt=dt_dtype), A.fake(A.Plan), Int32(0), make_fake_stream()]


def flush_kernel(cfg: StepConfig, debug: bool = False, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128) -> tuple[Flush, list]:
    """The flush kernel object of `cfg` (`debug`: the test variant; head dim `P`, state
    dim `N`) and its compile-time arguments."""
    fmt = read_copy_format(cfg.state_dtype, cfg.arch, P, N)
    obj = Flush(fmt, cfg.heads, cfg.groups, pdl=cfg.flush_pdl, rows=cfg.flush_rows, debug=debug, dense_rows=dense_rows)
    plan = A.fake(A.DebugPlan if debug else A.Plan)
    inputs = A.fake(A.Inputs, dt=dt_dtype)
    fake = [A.fake(A.Checkpoint), A.fake(A.Ring), A.fake(fmt.Args), inputs, plan, Int64(0), Int32(0), make_fake_stream()]
    return obj, fake


def compiled_decode(cfg: StepConfig, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128):
    """The compiled non-flush launcher of `cfg` for these inputs (compiled on first use)."""
    key = ("decode", cfg.arch, cfg.state_dtype, cfg.heads, cfg.groups, cfg.nonflush_pdl, cfg.read_hint, dt_dtype, dense_rows, P, N)
    fn = _COMPILED.get(key)
    if fn is None:
        obj, fake = decode_kernel(cfg, dt_dtype, dense_rows, P, N)
        fn = _COMPILED[key] = compile_entry(obj, fake, cfg.arch)
    return fn


def compiled_flush(cfg: StepConfig, debug: bool = False, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128):
    """The compiled flush launcher of `cfg` for these inputs (compiled on first use)."""
    key = ("flush", cfg.arch, cfg.state_dtype, cfg.heads, cfg.groups, cfg.flush_pdl, cfg.flush_rows, debug, dt_dtype, dense_rows, P, N)
    fn = _COMPILED.get(key)
    if fn is None:
        obj, fake = flush_kernel(cfg, debug, dt_dtype, dense_rows, P, N)
        fn = _COMPILED[key] = compile_entry(obj, fake, cfg.arch)
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
    """Compile every decode kernel variant a step may launch, every format, for `arch` (no
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
    P, N = L.dims(cache)
    dev = out.device
    per_head = torch.zeros(heads, device=dev)
    D = torch.zeros(heads, P, device=dev)
    for dense, dt_dtype in inputs:
        pad = 0 if dense else 8  # a wider row: x, B, C as row-strided column slices
        x = torch.zeros(batch, heads * P + pad, dtype=torch.bfloat16, device=dev)[:, : heads * P]
        bc = torch.zeros(batch, groups * N + pad, dtype=torch.bfloat16, device=dev)[:, : groups * N]
        x, bc = x.view(batch, heads, P), bc.view(batch, groups, N)
        dt = torch.zeros(batch, heads, dtype=dt_dtype, device=dev)
        for cfg in step_configs(arch, state_dtype, heads, groups):
            decode_step(cache, x, dt, per_head, bc, bc, D, per_head, plan, out, state_dtype=state_dtype, config=cfg)


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and (t.shape[0] <= 1 or (t.stride(0) * t.element_size()) % 16 == 0)


def layout_ok(cache: Sequence[torch.Tensor]) -> str | None:
    """None when the compiled kernels can address `cache` (16-byte-aligned bases and
    slot strides for the tensors read with vector accesses), else the reason."""
    has_copy = L.READ_COPY < len(cache) - 1  # fp16 has none: its positions (the last tensor) are there
    for i in (L.CHECKPOINT, L.X_RING, L.B_RING) + ((L.READ_COPY,) if has_copy else ()):
        if not _aligned16(cache[i]):
            return f"cache[{i}] needs a 16-byte-aligned base and slot stride (data_ptr {cache[i].data_ptr():#x}, stride {cache[i].stride(0)})"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_ok(t: torch.Tensor, stride: tuple, width: int) -> bool:
    """Whether the kernels read bf16 `t` ([batch, n, width] or [batch, n * width], `stride`
    its strides; width P for x, N for B and C) as it is: each row's heads (groups)
    contiguous, and the base and the row stride 16-byte aligned. Column slices of an
    engine's projection are (their row stride is its width)."""
    inner = stride[2] == 1 and stride[1] == width if len(stride) == 3 else stride[1] == 1
    return inner and t.data_ptr() % 16 == 0 and stride[0] % 8 == 0


def current_stream(index: int) -> int:
    """The handle of the current CUDA stream of device `index`: torch's raw-stream query
    itself where torch has it (a fraction of a microsecond, no Python call around it),
    else through `torch.cuda.current_stream`, which builds an object."""
    return torch.cuda.current_stream(index).cuda_stream


current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or current_stream


_SIDE: dict[int, tuple] = {}


def _side_stream(index: int) -> tuple:
    """(side stream handle, fork event, join event, side stream) of device `index`, made
    once (the stream object keeps its handle alive)."""
    side = _SIDE.get(index)
    if side is None:
        stream = torch.cuda.Stream(device=index, priority=-1)
        flags = cuda_driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with torch.cuda.device(index):  # events belong to the current device's context
            fork, join = (_checked(cuda_driver.cuEventCreate(flags)) for _ in range(2))
        side = _SIDE[index] = (stream.cuda_stream, fork, join, stream)
    return side


def _checked(result):
    """The value of a cuda.bindings driver call's (error, value) result; raises on error."""
    err, *value = result if isinstance(result, tuple) else (result,)
    if err != cuda_driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err} forking / joining a replayssm step's streams")
    return value[0] if value else None


def _record_wait(event, first: int, second: int) -> None:
    """Record `event` on stream handle `first` and make stream `second` wait for it."""
    _checked(cuda_driver.cuEventRecord(event, first))
    _checked(cuda_driver.cuStreamWaitEvent(second, event, 0))


def fork_streams(index: int, flush_pdl: bool, main: int) -> tuple[int, int]:
    """(flush stream, non-flush stream) handles for one step: one is the current stream
    `main`, the other the side stream of device `index`, forked here from `main` (the
    plan and the inputs are ready for it; a PDL kernel on `main` waits for them itself).
    `flush_pdl`: the flush on `main`, else the non-flush kernel. The fork reuses one event
    (a wait orders against the record made just before it)."""
    side = _side_stream(index)
    _record_wait(side[1], main, side[0])
    return (main, side[0]) if flush_pdl else (side[0], main)


def join_streams(index: int, main: int) -> None:
    """Join the side stream of device `index` back into `main` after a step's kernels:
    everything after the step sees both kernels' writes (one reused event, as the fork)."""
    side = _side_stream(index)
    _record_wait(side[2], side[0], main)


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
    stream: int | None = None,
) -> None:
    """Launch the flush and the non-flush kernel of one step (after `prepare`): a `Step`
    made for this call. The kernel backend keeps its `Step`s between calls instead.

    Inputs as `reference.decode_nonflush` takes them (normalized by `replayssm.api`),
    except that x, B and C may also be [batch, H * 64] / [batch, G * 128] (the eager fast
    path passes an engine's 2-D column slices as they are) and `out` any contiguous shape;
    `plan` is the prepare kernel's `reference.Plan` (device buffers). `config` defaults to
    `step_config(arch, state_dtype, heads, groups, batch)`. `state_out` (float32
    [batch, H, 64, 128], contiguous) selects the flush's test variant, which also writes
    the FP32 state of every flushed row there. `head_offset`: the model's head of the
    cache's head 0 (a tensor-parallel shard's), for the checkpoint's random bits.
    `stream`: the handle of the current stream of x's device (looked up when None)."""
    step = Step(cache, plan, state_dtype, arch or arch_for(x.device), head_offset, config)
    step(cache, plan, x, dt, A_, B, C, D, dt_bias, out, current_stream(step.index) if stream is None else stream, state_out)


class Step:
    """The CuTe launches of decode steps on one cache, one plan (batch size) and one
    format, with the argument structs that repeat between steps made once (as ffi.Arrays
    of ints): the cache's (`Checkpoint`, `Ring`, the read copy) and the plan's. A step's own
    struct (its inputs') is read per call. It holds no tensor: a caller keeping `Step`s
    between calls keys them so that the cache and the plan are the ones it was made for
    (the kernel backend keeps them in its per-cache context), and passes them to each call."""

    __slots__ = ("batch", "heads", "groups", "P", "N", "index", "config", "round_up", "ckpt", "ring", "copy", "plan", "kernels")

    def __init__(self, cache, plan, state_dtype: str, arch: str, head_offset: int = 0, config: StepConfig | None = None) -> None:
        self.batch = plan.valid.shape[0]
        self.heads, self.groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
        self.P, self.N = L.dims(cache)
        self.index = cache[L.CHECKPOINT].get_device()
        self.config = config or step_config(arch, state_dtype, self.heads, self.groups, self.batch)
        fmt = read_copy_format(state_dtype, arch, self.P, self.N)
        self.round_up = self.batch <= fmt.flush_round_up_batch  # the flush's column count (flush_columns)
        self.ckpt = tvm_ffi.convert(A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=head_offset))
        self.ring = tvm_ffi.convert(A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING]))
        self.copy = tvm_ffi.convert(A.raw(fmt.Args, **fmt.tensors(cache, L)))
        self.plan = tvm_ffi.convert(A.raw(A.Plan, **plan._asdict()))
        self.kernels: dict[tuple, tuple] = {}

    def __call__(self, cache, plan, x, dt, A_, B, C, D, dt_bias, out, stream: int, state_out=None, fork: bool = True) -> None:
        """Launch both kernels for these inputs on stream handle `stream`; `fork`: the one
        without PDL on the side stream (else both on `stream`, the PDL one first)."""
        batch, heads, groups, P, N = self.batch, self.heads, self.groups, self.P, self.N
        if dt.dtype not in DT_DTYPES:
            dt = dt.float()
        xs, bs, cs = x.stride(), B.stride(), C.stride()
        inputs = inputs_words(x, dt, A_, B, C, D, dt_bias, out, xs[0], bs[0], cs[0])
        # `_rows_ok` of x, B and C at once (the addresses are words 0, 3 and 4), else each
        # one the kernels cannot read as it is copied.
        if not (
            (inputs[0] | inputs[3] | inputs[4]) % 16 == 0 and (xs[0] | bs[0] | cs[0]) % 8 == 0
            and xs[-1] == bs[-1] == cs[-1] == 1 and (len(xs) == 2 or xs[1] == P)
            and (len(bs) == 2 or bs[1] == N) and (len(cs) == 2 or cs[1] == N)
        ):  # fmt: skip
            x, B, C = (
                t if _rows_ok(t, t.stride(), w) else t.reshape(batch, n, w).clone(memory_format=torch.contiguous_format)
                for t, n, w in ((x, heads, P), (B, groups, N), (C, groups, N))
            )
            xs, bs, cs = x.stride(), B.stride(), C.stride()
            inputs = inputs_words(x, dt, A_, B, C, D, dt_bias, out, xs[0], bs[0], cs[0])
        dense = xs[0] == heads * P and bs[0] == cs[0] == groups * N  # A.dense_rows
        debug = state_out is not None
        key = (dt.dtype, dense, debug)
        kernels = self.kernels.get(key)
        if kernels is None:
            kernels = self.kernels[key] = _kernels(self.config, dt.dtype, dense, debug, self.index, P, N, self.round_up)
        nonflush, flush, _, columns = kernels
        flush_plan = tuple(A.raw(A.DebugPlan, **plan._asdict(), state=state_out)) if debug else self.plan
        flush_args = (self.ckpt, self.ring, self.copy, inputs, flush_plan, columns, batch)
        nonflush_args = (self.ring, self.copy, inputs, self.plan, batch)
        if not fork:
            if self.config.flush_pdl:
                flush(*flush_args, stream)
                nonflush(*nonflush_args, stream)
            else:
                nonflush(*nonflush_args, stream)
                flush(*flush_args, stream)
            return
        flush_stream, nonflush_stream = fork_streams(self.index, self.config.flush_pdl, stream)
        flush(*flush_args, flush_stream)
        nonflush(*nonflush_args, nonflush_stream)
        join_streams(self.index, stream)


def inputs_words(x, dt, A_, B, C, D, dt_bias, out, x_stride: int, b_stride: int, c_stride: int) -> tuple:
    """The `A.Inputs` struct of a step as ints, `A.raw(A.Inputs, ...)` written out for the
    eager hot path (bf16 x, B, C: a row stride in elements is 16-byte units times 8), given
    the row strides of x, B and C. (`t.stride()[i]`: a third of the time of `t.stride(i)`.)"""
    ds, Ds = dt.stride(), D.stride()
    return (
        x.data_ptr(), dt.data_ptr(), A_.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), out.data_ptr(),
        ds[0], ds[1], A_.stride()[0], dt_bias.stride()[0], Ds[0], Ds[1], x_stride // 8, b_stride // 8, c_stride // 8,
    )


@functools.lru_cache(maxsize=1024)
def _kernels(config: StepConfig, dt_dtype: torch.dtype, dense: bool, debug: bool, device_index: int, P: int = 64, N: int = 128, round_up: bool = False):
    """(non-flush launcher, flush launcher, read-copy format, flush CTA columns) of a step:
    resolved once per config, inputs' layout, device, cache geometry (P, N) and rounding of
    the column count (`Step.round_up`: the batch at most the format's flush_round_up_batch)."""
    fmt = read_copy_format(config.state_dtype, config.arch, P, N)
    columns = flush_columns(config.heads, fmt.ctas_per_sm, _sm_count(device_index), shape(P, N), round_up)
    return compiled_decode(config, dt_dtype, dense, P, N), compiled_flush(config, debug, dt_dtype, dense, P, N), fmt, columns


__all__ = [
    "COMPILE_ALL_GEOMETRIES", "STATE_DTYPES", "compile_all", "compile_into", "compiled_decode", "compiled_flush",
    "compile_entry", "decode_kernel", "flush_kernel", "variant_name", "warmup", "launch_padding", "layout_ok", "current_stream",
    "fork_streams", "join_streams", "decode_step", "Step",
]
