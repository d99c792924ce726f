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

import functools
import os
from collections.abc import Sequence
from contextlib import contextmanager
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


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy where the kernels cannot read it as it is (rows_ok)."""
    return t if rows_ok(t) else t.clone(memory_format=torch.contiguous_format)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = torch.cuda.Stream(device=device, priority=-1)
    return side


@contextmanager
def step_streams(device: torch.device, flush_pdl: bool):
    """(flush stream, non-flush stream) for one step: one is the current stream `main`,
    the other the side stream, forked from `main` on entry (the plan and the inputs are
    ready for it; a PDL kernel on `main` waits for them itself) and joined back into it
    on exit (everything after the step sees both kernels' writes). `flush_pdl`: the
    flush on `main`, else the non-flush kernel."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    yield (main, side) if flush_pdl else (side, main)
    main.wait_stream(side)


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
) -> None:
    """Launch the flush and the non-flush kernel of one step (after `prepare`).

    Inputs as `reference.decode_nonflush` takes them (normalized by `replayssm.api`);
    `plan` is the prepare kernel's `reference.Plan` (device buffers). `config` defaults to
    `step_config(arch, state_dtype, heads, groups, batch)`. `state_out` (float32
    [batch, H, 64, 128], contiguous) selects the flush's test variant, which also writes
    the FP32 state of every flushed row there. `head_offset`: the model's head of the
    cache's head 0 (a tensor-parallel shard's), for the checkpoint's random bits."""
    batch, heads = x.shape[0], x.shape[1]
    groups = cache[L.B_RING].shape[1]
    x, B, C = _rows16(x), _rows16(B), _rows16(C)
    if dt.dtype not in DT_DTYPES:
        dt = dt.float()
    dense = A.dense_rows(x, B, C)
    if config is None:
        config = step_config(arch or arch_for(x.device), state_dtype, heads, groups, batch)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    nonflush, flush, fmt, columns = _kernels(config, dt.dtype, dense, state_out is not None, index)
    ring = A.bound(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING])
    copy = fmt.bind(cache, L)
    inputs = A.bound(A.Inputs, x=x, dt=dt, A=A_, B=B, C=C, D=D, dt_bias=dt_bias, out=out)
    plan_t = plan._asdict()
    nonflush_plan = A.bound(A.Plan, **plan_t)
    flush_plan = nonflush_plan if state_out is None else A.bind(A.DebugPlan, **plan_t, state=state_out)
    ckpt = A.bound(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=head_offset)
    with step_streams(x.device, config.flush_pdl) as (flush_stream, nonflush_stream):
        _launch(flush, (ckpt, ring, copy, inputs, flush_plan), (columns, batch), flush_stream.cuda_stream)
        _launch(nonflush, (ring, copy, inputs, nonflush_plan), (batch,), nonflush_stream.cuda_stream)


@functools.lru_cache(maxsize=1024)
def _kernels(config: StepConfig, dt_dtype: torch.dtype, dense: bool, debug: bool, device_index: int):
    """(non-flush launcher, flush launcher, read-copy format, flush CTA columns) of a step:
    resolved once per config, inputs' layout and device."""
    fmt = read_copy_format(config.state_dtype, config.arch)
    columns = flush_columns(config.heads, fmt.ctas_per_sm, _sm_count(device_index))
    return compiled_decode(config, dt_dtype, dense), compiled_flush(config, debug, dt_dtype, dense), fmt, columns


# The DSL executor turns a launch's arguments into C pointers on every call (most of a
# launch's host time). A launch whose structs (args.bound: the same objects while their
# tensors keep addresses and strides), scalars and stream repeat reuses the pointers of
# the first such launch; the entry holds those objects, so they outlive it.
_EXE: dict[tuple, tuple] = {}
_EXE_MAX = 4096


def _launch(fn, structs: tuple, scalars: tuple, stream: int) -> None:
    key = (id(fn), *map(id, structs), *scalars, stream)
    hit = _EXE.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], structs)):
        args = (*structs, *scalars, cuda_driver.CUstream(stream))
        gen = getattr(getattr(fn, "execution_args", None), "generate_execution_args", None)
        if gen is None or not hasattr(fn, "run_compiled_program"):  # another DSL version: the plain call
            fn(*args)
            return
        exe_args, adapted = gen(args, {})
        if len(_EXE) >= _EXE_MAX:
            _EXE.clear()
        hit = _EXE[key] = (structs, exe_args, adapted, args)
    fn.run_compiled_program(hit[1])

__all__ = [
    "COMPILE_ALL_GEOMETRIES", "STATE_DTYPES", "compile_all", "compile_into", "compiled_decode", "compiled_flush",
    "decode_kernel", "flush_kernel", "variant_name", "warmup", "launch_padding", "layout_ok", "step_streams", "decode_step",
]
