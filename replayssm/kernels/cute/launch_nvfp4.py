"""Compile cache entries and launchers of the NVFP4 CuTe DSL decode kernels.

The FP8 launcher's machinery (launch.py) serves both formats: the same compile cache
(keys (kind, arch, heads, groups, PDL variant, non-flush mode)), compile options, pointer typing and layout check;
this module adds the NVFP4 kinds and the per-step launcher. As for FP8, batch, slot count
and strides are runtime arguments, so one compile serves every batch and slot padding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import cutlass.cute as cute
import torch
from cuda.bindings import driver as cuda_driver
from cutlass import BFloat16, Float16, Float32, Int8, Int32, Int64, Uint8, Uint32

from ... import layout as L
from . import launch as _fp8
from .arch import HAS_CVT_RS, arch_for, check_arch
from .decode_nvfp4 import DecodeNvfp4Sm90, DecodeNvfp4Sm100
from .decode_warp import DecodeNvfp4Warp
from .flush_nvfp4 import FlushNvfp4, FlushNvfp4Sm90, FlushNvfp4Sm100

KINDS = ("decode_nvfp4", "flush_nvfp4", "flush_nvfp4_debug")


# The NVFP4 non-flush kernel: "warp" (decode_warp.py, the default: one warp per (row,
# head), tensor-core dots; H200 at batch 256 / 1024, 16 heads / 2 groups: the kernel
# 23-28 % and steps 14-16 % faster than "simt") or "simt" (decode_nvfp4.py). The PDL
# variant (batch 1, launch.PDL_ENV) is the kernel of the mode, except that
# launch.PDL_KERNEL_ENV = "simt" makes it the SIMT kernel in "warp" mode too.
NVFP4_DECODE_ENV = "REPLAYSSM_NVFP4_DECODE"
NVFP4_DECODE_MODES = ("warp", "simt")


def nvfp4_decode() -> str:
    return _fp8.env_choice(NVFP4_DECODE_ENV, NVFP4_DECODE_MODES, NVFP4_DECODE_MODES[0])


# The NVFP4 warp kernel's read-copy loads with the streaming cache operator
# (`ld.global.cs`: evict first in L1 and L2; the codes are read once a step), but in the
# PDL variant (batch 1), which loads plainly. H200, project benchmark, same call, us per
# step, plain -> .cs, 16 heads / 2 groups: batch 1 3.71 -> 3.79 (twice; hence plain
# there), 64 8.57 -> 8.52, 128 12.19 -> 12.03, 256 18.99 / 18.91 -> 18.17 / 18.09, 512
# 34.43 -> 32.54, 1024 63.60 / 63.37 -> 61.88 / 61.58; 64 heads / 8 groups 256 62.16 /
# 61.80 -> 61.00 / 60.67, 1024 227.07 / 228.58 / 228.38 -> 227.76 / 229.08 / 229.09 (0.3%
# slower, kept: one variant). `.L1::no_allocate` (with or without `.nc`) measured about
# the same, `.nc` alone as plain (docs/perf-notes-cute.md, session 17). ncu, the kernel
# alone at batch 1024 (session 18): L1 / L2 hit rates unchanged (49% / 21.5%), the
# long-scoreboard stalls 2.65 -> 2.28 warp-cycles an instruction, 37.0 -> 36.1 us. The
# FP8 kernel got 5-25% slower with any L1 qualifier (launch.FP8_READ_HINT).
NVFP4_READ_HINT = ".cs"


def _kernel_object(kind: str, arch: str, heads: int, groups: int, pdl: bool = False):
    hw = arch in HAS_CVT_RS  # the e2m1 conversions come with the same targets as cvt.rs
    if kind == "decode_nvfp4":
        if nvfp4_decode() == "warp" and (not pdl or _fp8.pdl_kernel() == "warp"):
            obj = DecodeNvfp4Warp(heads, groups, hw=hw)
            obj.pdl = pdl
            obj.rc_hint = "" if pdl else NVFP4_READ_HINT
            return obj
        obj = (DecodeNvfp4Sm100 if hw else DecodeNvfp4Sm90)(heads, groups)
        obj.pdl = pdl  # programmatic dependent launch, as the FP8 non-flush (launch.pdl_for)
        return obj
    if hw:
        obj = FlushNvfp4Sm100(heads, groups, debug=kind == "flush_nvfp4_debug")
    else:
        obj = FlushNvfp4Sm90(heads, groups, debug=kind == "flush_nvfp4_debug", hw_e4m3=_fp8.sm90_e4m3() == "hw")
    obj.pdl = pdl  # PDL above batch 1 (launch.flush_pdl_for)
    return obj


# Pointer arguments of each launcher, in order: (dtype, alignment in bytes); the inputs
# as for FP8.
_INPUT_PTRS = _fp8._INPUT_PTRS
POINTERS = {
    "decode_nvfp4": [
        (Uint32, 16),  # read copy (packed codes), as words
        (Uint8, 1),  # block scales (e4m3 codes)
        (Float32, 4),  # meta
        (Int32, 4),  # parity
        (BFloat16, 16),  # x ring
        (Float32, 4),  # dt ring
        (BFloat16, 16),  # B ring
        *_INPUT_PTRS,
        (Int8, 1),  # plan.valid
        (Int64, 8),  # plan.slot
        (Int64, 8),  # plan.ring_index
        (Int8, 1),  # plan.flush
    ],
    "flush_nvfp4": [
        (Float16, 16),  # checkpoint
        (Uint32, 16),  # read copy, as words
        (Uint8, 1),  # block scales
        (Float32, 4),  # meta
        (BFloat16, 16),  # x ring
        (Float32, 4),  # dt ring
        (BFloat16, 16),  # B ring
        *_INPUT_PTRS,
        (Int64, 8),  # plan.slot
        (Int8, 1),  # plan.flush
        (Int64, 8),  # plan.key
        (Int64, 8),  # plan.old_parity
        (Float32, 16),  # state_out (debug variant)
    ],
}
POINTERS["flush_nvfp4_debug"] = POINTERS["flush_nvfp4"]
# Int64 scalars (slot strides, input strides) after the pointers.
SCALARS = {"decode_nvfp4": 13, "flush_nvfp4": 14, "flush_nvfp4_debug": 14}


def _pointers(kind: str, addresses) -> list:
    return _fp8._pointers(kind, addresses, POINTERS)


def _fake_args(kind: str) -> list:
    return _fp8._fake_args(kind, POINTERS, SCALARS)


def compiled(kind: str, arch: str, heads: int, groups: int, pdl: bool = False):
    """The compiled launcher for (kind, arch, heads, groups), compiling it on first use
    (entries live in launch.py's compile cache; `pdl` as in launch.compiled)."""
    pdl = pdl and _fp8.has_pdl_variant(kind)
    e4m3 = _fp8.sm90_e4m3() if kind != "decode_nvfp4" and arch not in HAS_CVT_RS else None  # the sm_90a block-scale encode
    key = (kind, arch, heads, groups, pdl and _fp8.pdl_kernel(), nvfp4_decode() if kind == "decode_nvfp4" else None, e4m3)
    fn = _fp8._COMPILED.get(key)
    if fn is None:
        obj = _kernel_object(kind, arch, heads, groups, pdl)
        fn = cute.compile(obj, *_fake_args(kind), options=_fp8._options(arch, None))
        _fp8._COMPILED[key] = fn
    return fn


def compile_variants(arch: str, dump_dir: str | os.PathLike, geometries) -> list[str]:
    """Compile the NVFP4 non-flush and flush kernels for `arch` and each (heads, groups)
    into `dump_dir/<kind>-h<H>g<G>` (each kernel's PDL variant into `...-pdl`); returns
    the PTX and cubin paths."""
    arch = check_arch(arch)
    root = Path(dump_dir)
    paths: list[str] = []
    for heads, groups in geometries:
        for kind in ("decode_nvfp4", "flush_nvfp4"):
            for with_pdl in (False, True) if _fp8.has_pdl_variant(kind) else (False,):
                obj = _kernel_object(kind, arch, heads, groups, with_pdl)
                sub = f"{kind}-h{heads}g{groups}" + ("-pdl" if with_pdl else "")
                paths += _fp8.compile_into(obj, _fake_args(kind), arch, root / sub)
    return paths


def warmup(heads: int, groups: int, arch: str | None = None) -> list[str]:
    """Compile both NVFP4 decode kernels for one geometry (before CUDA-graph capture)."""
    arch = arch or arch_for()
    names = []
    for kind in ("decode_nvfp4", "flush_nvfp4"):
        for with_pdl in _fp8.pdl_variants(kind):
            compiled(kind, arch, heads, groups, pdl=with_pdl)
            names.append(f"cute.{kind}[{arch},h{heads},g{groups}{',pdl' if with_pdl else ''}]")
    return names


def launch_padding(cache: Sequence[torch.Tensor], plan, out: torch.Tensor, arch: str) -> None:
    """Launch both kernels (each pair of `launch.step_variants`) for a plan of padding
    rows only (they write nothing): loads the compiled modules before CUDA-graph
    capture."""
    batch = plan.valid.shape[0]
    heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
    dev = out.device
    x = torch.zeros(batch, heads, L.HEAD_DIM, dtype=torch.bfloat16, device=dev)
    bc = torch.zeros(batch, groups, L.STATE_DIM, dtype=torch.bfloat16, device=dev)
    per_head = torch.zeros(heads, device=dev)
    for nonflush_pdl, flush_pdl in _fp8.step_variants():
        decode_nvfp4(
            cache, x, torch.zeros(batch, heads, device=dev), per_head, bc, bc,
            torch.zeros(heads, L.HEAD_DIM, device=dev), per_head, plan, out, arch=arch,
            pdl=nonflush_pdl, flush_pdl=flush_pdl,
        )


def decode_nvfp4(
    cache: Sequence[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    plan,
    out: torch.Tensor,
    *,
    arch: str | None = None,
    state_out: torch.Tensor | None = None,
    pdl: bool | None = None,
    flush_pdl: bool | None = None,
) -> None:
    """Launch the NVFP4 non-flush and flush kernels for one step (after `prepare`, which
    flipped the parity and zeroed the accumulator half of meta for flushing rows).

    Arguments as `launch.decode_fp8`; `state_out` selects the debug flush, which also
    writes the FP32 state of every flushed row (tests only). `pdl` / `flush_pdl`: the
    kernels' PDL variants (defaults `launch.pdl_for(batch)` / `launch.flush_pdl_for(batch)`;
    at most one of the two)."""
    batch, heads = x.shape[0], x.shape[1]
    groups = cache[L.B_RING].shape[1]
    arch = arch or arch_for(x.device)
    x, B, C = _fp8._dense16(x), _fp8._dense16(B), _fp8._dense16(C)
    ckpt, x_ring, dt_ring, b_ring = cache[L.CHECKPOINT], cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING]
    read, scales, meta, parity = cache[L.READ_COPY], cache[L.SCALES], cache[L.META], cache[L.PARITY]
    inputs = [x, dt, A, B, C, D, dt_bias, out]
    input_strides = [dt.stride(0), dt.stride(1), A.stride(0), dt_bias.stride(0), D.stride(0), D.stride(1)]
    pdl, flush_pdl = _fp8.pdl_pair(batch, pdl, flush_pdl)
    nonflush = compiled("decode_nvfp4", arch, heads, groups, pdl=pdl)
    kind = "flush_nvfp4" if state_out is None else "flush_nvfp4_debug"
    flush = compiled(kind, arch, heads, groups, pdl=flush_pdl)
    # The two kernels on the FP8 launcher's streams, overlapping: they touch disjoint slots
    # (meta included: the non-flush kernel reads meta of non-flushing slots only) and
    # disjoint output rows. The flush's atomics need prepare's zeroed meta: a PDL flush
    # waits for prepare (griddepcontrol.wait) before its first global access.
    with _fp8.flush_streams(x.device, flush_pdl) as (flush_stream, nonflush_stream):
        ptrs = [ckpt, read, scales, meta, x_ring, dt_ring, b_ring, *inputs, plan.slot, plan.flush, plan.key, plan.old_parity]
        addresses = [t.data_ptr() for t in ptrs] + [0 if state_out is None else state_out.data_ptr()]
        flush(
            *_pointers(kind, addresses),
            _fp8._stride16(ckpt), _fp8._stride16(read), scales.stride(0), meta.stride(0),
            _fp8._stride16(x_ring), dt_ring.stride(0), _fp8._stride16(b_ring),
            *input_strides, _fp8.flush_grid_columns(FlushNvfp4.ctas_per_sm, heads, x.device),
            batch, cuda_driver.CUstream(flush_stream.cuda_stream),
        )
        ptrs = [read, scales, meta, parity, x_ring, dt_ring, b_ring, *inputs, plan.valid, plan.slot, plan.ring_index, plan.flush]
        nonflush(
            *_pointers("decode_nvfp4", [t.data_ptr() for t in ptrs]),
            _fp8._stride16(read), scales.stride(0), meta.stride(0), parity.stride(0),
            _fp8._stride16(x_ring), dt_ring.stride(0), _fp8._stride16(b_ring),
            *input_strides,
            batch, cuda_driver.CUstream(nonflush_stream.cuda_stream),
        )

__all__ = ["KINDS", "compiled", "compile_variants", "warmup", "launch_padding", "decode_nvfp4"]
