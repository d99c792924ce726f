"""Compile cache and the one launcher of the CuTe DSL decode kernels, every format: a step
(after prepare) launches the flush (flush.py; rows at ring index 15) and the non-flush kernel
(decode.py; the other live rows), side by side on two streams (docs/design.md section 1).
Compile keys hold static properties only; batch, slot count and strides (slot strides in
16-byte units, so the kernels know their vectors are aligned) are runtime arguments. Kernels
are called through the DSL's TVM-FFI entry (`compile_entry`) with their structs as tuples of
ints (`args.raw`); the structs that repeat between calls are converted to ffi.Arrays once
(per call cost ~1 us an eager step on a CPU, `benchmarks/host_path.py`).
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


def compile_entry(obj, fake_args: list, arch: str):
    """`obj` compiled for `arch`, called with its structs as tuples of ints (`args.raw`), the
    scalars, then the stream handle. The TVM-FFI function itself (no Python wrapper on the
    call), or the DSL's wrapper where it built no host entry (no GPU of `arch`: compile-only)."""
    fn = cute.compile(obj, *fake_args, options=f"--gpu-arch {arch} --enable-tvm-ffi")
    entry = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else None
    return fn if entry is None else entry


# Part of the compile key: dt's type (read as it is, converted in registers) and whether x,
# B, C are dense rows or row-strided column slices of a projection. H200, 16h/2g FP8 at batch
# 256: runtime row strides for every input made plain inputs' steps 2.5% slower.
DT_DTYPES = tuple(A.DSL_DTYPES)
WARMUP_INPUTS = ((True, torch.float32), (True, torch.bfloat16), (False, torch.bfloat16))


def decode_kernel(cfg: StepConfig, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128) -> tuple[Decode, list]:
    """The non-flush kernel object of `cfg` and its compile-time arguments."""
    fmt = read_copy_format(cfg.state_dtype, cfg.arch, P, N)
    obj = Decode(fmt, cfg.heads, cfg.groups, pdl=cfg.nonflush_pdl, read_hint=cfg.read_hint, dense_rows=dense_rows)
    return obj, [A.fake(A.Ring), A.fake(fmt.Args), A.fake(A.Inputs, dt=dt_dtype), A.fake(A.Plan), Int32(0), make_fake_stream()]


def flush_kernel(cfg: StepConfig, debug: bool = False, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128) -> tuple[Flush, list]:
    """The flush kernel object of `cfg` (`debug`: the test variant) and its compile-time arguments."""
    fmt = read_copy_format(cfg.state_dtype, cfg.arch, P, N)
    obj = Flush(fmt, cfg.heads, cfg.groups, pdl=cfg.flush_pdl, rows=cfg.flush_rows, debug=debug, dense_rows=dense_rows)
    plan = A.fake(A.DebugPlan if debug else A.Plan)
    inputs = A.fake(A.Inputs, dt=dt_dtype)
    fake = [A.fake(A.Checkpoint), A.fake(A.Ring), A.fake(fmt.Args), inputs, plan, Int64(0), Int32(0), make_fake_stream()]
    return obj, fake


def compiled_decode(cfg: StepConfig, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128):
    key = ("decode", cfg.arch, cfg.state_dtype, cfg.heads, cfg.groups, cfg.nonflush_pdl, cfg.read_hint, dt_dtype, dense_rows, P, N)
    if key not in _COMPILED:
        _COMPILED[key] = compile_entry(*decode_kernel(cfg, dt_dtype, dense_rows, P, N), cfg.arch)
    return _COMPILED[key]


def compiled_flush(cfg: StepConfig, debug: bool = False, dt_dtype: torch.dtype = torch.float32, dense_rows: bool = True, P: int = 64, N: int = 128):
    key = ("flush", cfg.arch, cfg.state_dtype, cfg.heads, cfg.groups, cfg.flush_pdl, cfg.flush_rows, debug, dt_dtype, dense_rows, P, N)
    if key not in _COMPILED:
        _COMPILED[key] = compile_entry(*flush_kernel(cfg, debug, dt_dtype, dense_rows, P, N), cfg.arch)
    return _COMPILED[key]


def variant_name(kind: str, cfg: StepConfig) -> str:
    """`decode-fp8-h16g2-pdl`, `flush-nvfp4-h64g8-rows32`."""
    name = f"{kind}-{cfg.state_dtype}-h{cfg.heads}g{cfg.groups}"
    if kind == "decode":
        hint = {"": "", ".L2::128B": "-l2", ".cs": "-cs"}[cfg.read_hint]
        return name + ("-pdl" if cfg.nonflush_pdl else "") + hint
    rows = f"-rows{cfg.flush_rows}" if cfg.flush_rows != 16 else ""
    return name + ("-pdl" if cfg.flush_pdl else "") + rows


def _variants(arch: str, state_dtype: str, heads: int, groups: int) -> dict[str, tuple[str, StepConfig]]:
    """{name: (kind, config)} of every kernel variant a step of this geometry may launch."""
    out = {}
    for cfg in step_configs(arch, state_dtype, heads, groups):
        for kind in ("decode", "flush"):
            out.setdefault(variant_name(kind, cfg), (kind, cfg))
    return out


def compile_into(obj, fake_args: list, arch: str, sub: Path) -> list[str]:
    """Compile `obj` for `arch` into folder `sub`; returns its PTX and cubin paths."""
    sub.mkdir(parents=True, exist_ok=True)  # the DSL writes into an existing folder only
    cute.compile(obj, *fake_args, options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {sub}")
    found = sorted(str(p) for p in sub.iterdir() if p.suffix in (".ptx", ".cubin"))
    if not any(p.endswith(".ptx") for p in found):
        raise RuntimeError(f"CuTe DSL compile of {type(obj).__name__} for {arch} wrote no PTX into {sub}")
    return found


def compile_all(arch: str, dump_dir: str | os.PathLike) -> list[str]:
    """Compile every variant a step may launch, every format and COMPILE_ALL_GEOMETRIES, for
    `arch` (no GPU needed), each into `dump_dir/<variant_name>`; returns the PTX and cubins."""
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
    """Compile every variant a step of this geometry may launch for each (dense rows, dt
    dtype) of `inputs`; returns their names."""
    arch = arch or arch_for()
    names = []
    for dense, dt in inputs:
        tag = f"{arch},dt={str(dt).removeprefix('torch.')}{'' if dense else ',strided'}"
        for name, (kind, cfg) in _variants(arch, state_dtype, heads, groups).items():
            compiled_decode(cfg, dt, dense) if kind == "decode" else compiled_flush(cfg, False, dt, dense)
            names.append(f"cute.{name}[{tag}]")
    return names


def launch_padding(cache: Sequence[torch.Tensor], plan, out: torch.Tensor, state_dtype: str, arch: str, inputs=WARMUP_INPUTS) -> None:
    """Launch every config's kernels on a plan of padding rows (they write nothing) for each
    of `inputs`: loads the compiled modules before CUDA-graph capture."""
    batch = plan.valid.shape[0]
    heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
    P, N = L.dims(cache)
    dev = out.device
    per_head, D = torch.zeros(heads, device=dev), torch.zeros(heads, P, device=dev)
    for dense, dt_dtype in inputs:
        pad = 0 if dense else 8  # a wider row: x, B, C as row-strided column slices
        x = torch.zeros(batch, heads * P + pad, dtype=torch.bfloat16, device=dev)[:, : heads * P]
        bc = torch.zeros(batch, groups * N + pad, dtype=torch.bfloat16, device=dev)[:, : groups * N]
        x, bc = x.view(batch, heads, P), bc.view(batch, groups, N)
        dt = torch.zeros(batch, heads, dtype=dt_dtype, device=dev)
        for cfg in step_configs(arch, state_dtype, heads, groups):
            decode_step(cache, x, dt, per_head, bc, bc, D, per_head, plan, out, state_dtype=state_dtype, config=cfg)


def layout_ok(cache: Sequence[torch.Tensor]) -> str | None:
    """None when the kernels can address `cache` (16-byte-aligned bases and slot strides of
    the tensors read by vector), else the reason."""
    has_copy = L.READ_COPY < len(cache) - 1  # fp16 has none: its positions (the last tensor) are there
    for i in (L.CHECKPOINT, L.X_RING, L.B_RING) + ((L.READ_COPY,) if has_copy else ()):
        t = cache[i]
        if t.data_ptr() % 16 or (t.shape[0] > 1 and t.stride(0) * t.element_size() % 16):
            return f"cache[{i}] needs a 16-byte-aligned base and slot stride (data_ptr {cache[i].data_ptr():#x}, stride {cache[i].stride(0)})"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_ok(t: torch.Tensor, stride: tuple, width: int) -> bool:
    """Whether the kernels read bf16 `t` ([batch, n, width] or [batch, n * width]) as it is:
    each row's heads (groups) contiguous, base and row stride 16-byte aligned."""
    inner = stride[2] == 1 and stride[1] == width if len(stride) == 3 else stride[1] == 1
    return inner and t.data_ptr() % 16 == 0 and stride[0] % 8 == 0


# The handle of device `index`'s current stream: torch's raw query where it has one (a
# fraction of a microsecond), else through `torch.cuda.current_stream`, which builds an object.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)


@functools.cache
def _side_stream(index: int) -> tuple:
    """(side stream handle, fork event, join event, side stream) of device `index`."""
    stream = torch.cuda.Stream(device=index, priority=-1)
    flags = cuda_driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    with torch.cuda.device(index):  # events belong to the current device's context
        fork, join = (_checked(cuda_driver.cuEventCreate(flags)) for _ in range(2))
    return stream.cuda_stream, fork, join, stream


def _checked(result):
    err, *value = result if isinstance(result, tuple) else (result,)
    if err != cuda_driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err} forking / joining a replayssm step's streams")
    return value[0] if value else None


def _record_wait(event, first: int, second: int) -> None:
    _checked(cuda_driver.cuEventRecord(event, first))
    _checked(cuda_driver.cuStreamWaitEvent(second, event, 0))


def fork_streams(index: int, flush_pdl: bool, main: int) -> tuple[int, int]:
    """(flush stream, non-flush stream) handles of a step: the PDL kernel's is `main`, the
    other the side stream of device `index`, forked here from `main`. One reused event (a
    wait orders against the record made just before it)."""
    side = _side_stream(index)
    _record_wait(side[1], main, side[0])
    return (main, side[0]) if flush_pdl else (side[0], main)


def join_streams(index: int, main: int) -> None:
    """Join the side stream of device `index` back into `main` after a step's kernels."""
    side = _side_stream(index)
    _record_wait(side[2], side[0], main)


def decode_step(
    cache: Sequence[torch.Tensor], x: torch.Tensor, dt: torch.Tensor, A_: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, plan, out: torch.Tensor, *, state_dtype: str,
    arch: str | None = None, config: StepConfig | None = None, state_out: torch.Tensor | None = None,
    head_offset: int = 0, stream: int | None = None,
) -> None:
    """One step (after `prepare`) through a `Step` made for this call. Inputs as
    `reference.decode_nonflush` takes them, except that x, B, C may be [batch, H * 64] /
    [batch, G * 128] and `out` any contiguous shape; `plan`: the prepare kernel's. `config`
    defaults to `step_config`. `state_out` (contiguous float32 [batch, H, P, N]) selects the
    flush's test variant, which writes the FP32 state of every flushed row there.
    `head_offset`: the model's head of the cache's head 0 (the checkpoint's random bits)."""
    step = Step(cache, plan, state_dtype, arch or arch_for(x.device), head_offset, config)
    step(cache, plan, x, dt, A_, B, C, D, dt_bias, out, current_stream(step.index) if stream is None else stream, state_out)


class Step:
    """The launches of decode steps on one cache, plan (batch) and format, with the cache's and
    the plan's structs made once as ffi.Arrays; the inputs' struct is read per call. It holds
    no tensor: its keeper passes the very cache and plan it was made for on each call."""

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
        """`fork`: the kernel without PDL on the side stream (else both on `stream`, PDL first)."""
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
        dense = xs[0] == heads * P and bs[0] == cs[0] == groups * N  # the kernels' dense_rows variant
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
    """`A.raw(A.Inputs, ...)` written out for the eager hot path, given the row strides of x,
    B, C (bf16: 8 elements a 16-byte unit). `t.stride()[i]` takes a third of `t.stride(i)`'s time."""
    ds, Ds = dt.stride(), D.stride()
    return (
        x.data_ptr(), dt.data_ptr(), A_.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), out.data_ptr(),
        ds[0], ds[1], A_.stride()[0], dt_bias.stride()[0], Ds[0], Ds[1], x_stride // 8, b_stride // 8, c_stride // 8,
    )


@functools.lru_cache(maxsize=1024)
def _kernels(config: StepConfig, dt_dtype: torch.dtype, dense: bool, debug: bool, device_index: int, P: int = 64, N: int = 128, round_up: bool = False):
    """(non-flush launcher, flush launcher, read-copy format, flush CTA columns) of a step."""
    fmt = read_copy_format(config.state_dtype, config.arch, P, N)
    columns = flush_columns(config.heads, fmt.ctas_per_sm, _sm_count(device_index), shape(P, N), round_up)
    return compiled_decode(config, dt_dtype, dense, P, N), compiled_flush(config, debug, dt_dtype, dense, P, N), fmt, columns


__all__ = [
    "COMPILE_ALL_GEOMETRIES", "STATE_DTYPES", "compile_all", "compile_into", "compiled_decode", "compiled_flush",
    "compile_entry", "decode_kernel", "flush_kernel", "variant_name", "warmup", "launch_padding", "layout_ok", "current_stream",
    "fork_streams", "join_streams", "decode_step", "Step",
]
