"""Compile cache and launchers of the CuTe DSL decode kernels (FP8 read copy).

Compile keys hold static properties only: (kernel, arch, heads, groups, for the FP8
flush the sm_90a e4m3 encoder choice and row-group size, for the non-flush kernel its
variant ($REPLAYSSM_FP8_DECODE) and read hint, and whether the kernel is the PDL one). Batch size, slot
count and every stride are runtime arguments (kernels take raw pointers plus slot strides
in 16-byte units, so one compile serves every batch, cache size and slot padding, and the
kernels still know their vector accesses are 16-byte aligned). Launches go to the current
torch stream and a side stream forked from it and joined back (see OVERLAP), one of
the two kernels launched with programmatic dependent launch behind the prepare kernel (at
batch 1 the non-flush kernel, see PDL_ENV; above it the flush, see FLUSH_PDL_ENV), so a
captured CUDA graph records them. Launchers map tensors to arguments;
they do not validate user input (`replayssm.api` did), only the layout assumptions the
compiled code makes (`layout_ok`).
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
from cutlass import BFloat16, Float16, Float32, Int8, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_stream, make_ptr

from ... import layout as L
from ..env import env_choice
from .arch import HAS_CVT_RS, arch_for, check_arch
from .decode_fp8 import DecodeFp8
from .decode_fp8_mma import DecodeFp8Mma
from .decode_warp import DecodeFp8Warp
from .flush_fp8 import ROWS_PER_CTA, FlushFp8, FlushFp8Sm90, FlushFp8Sm100, flush_columns

KINDS = ("decode_fp8", "flush_fp8", "flush_fp8_debug")
# Geometries `compile_all` builds: 16 heads in 2 groups (8 heads per group, the serving
# geometry) and 16 heads in 1 group (16 heads per group).
COMPILE_ALL_GEOMETRIES = ((16, 2), (16, 1))
# The sm_90a read-copy encode: "hw" (cvt.rn.satfinite.e4m3x2.f32, which Hopper has, as
# sm_100a uses it) or "soft" (integer steps of quant/minifloat.py). Both give the
# reference's bits (GPU-tested); "hw" makes the flush 2-6 us per step faster on an H200
# at batch 256 (docs/perf-notes-cute.md).
SM90_E4M3_ENV = "REPLAYSSM_SM90_E4M3"
SM90_E4M3_DEFAULT = "hw"

_COMPILED: dict[tuple, object] = {}


# The FP8 non-flush kernel: "warp" (decode_warp.py, the default: one warp per (row,
# head), tensor-core dots; H200 at batch 256 / 1024, 16 heads / 2 groups: steps 6-8 %
# faster than "simt"), "simt" (decode_fp8.py) or "mma" (decode_fp8_mma.py, session 2's
# tensor-core kernel, slower; docs/perf-notes-cute.md). The PDL variant (batch 1, see
# PDL_ENV) is the warp kernel ("warp") or the SIMT one ("simt"; PDL_KERNEL_ENV chooses
# between them in "warp" mode); "mma" has none.
FP8_DECODE_ENV = "REPLAYSSM_FP8_DECODE"
FP8_DECODE_MODES = ("warp", "simt", "mma")


def fp8_decode() -> str:
    return env_choice(FP8_DECODE_ENV, FP8_DECODE_MODES, FP8_DECODE_MODES[0])


def sm90_e4m3() -> str:
    return env_choice(SM90_E4M3_ENV, ("soft", "hw"), SM90_E4M3_DEFAULT)


# The sm_90a FP8 flush's checkpoint rounding: "plain" (bits.fp16x2_sr_fma for every pair),
# "voted" (bits.fp16x2_sr_voted, a warp-uniform branch to the normal-range path) or
# "auto", which is plain. Both give the same bits (GPU-tested). Session 13 chose voted at
# batch x heads >= 8192 for the 8-warp flush (16 heads / 2 groups at 1024: 64.20 -> 62.91
# us a step). With the 4-warp flush (session 14), where that rule picked voted, plain is
# faster at batch 1024 and 0.3% slower at 64 heads / 8 groups batch 256: H200, project
# benchmark, same call, four runs each, voted -> plain, 16 heads / 2 groups batch 1024
# 61.98 -> 61.46 us, 64 heads / 8 groups 1024 228.58 -> 228.17, 256 62.63 -> 62.79
# (docs/perf-notes-cute.md, session 14); no rule on batch x heads separates those
# (16,384 both). sm_100a / sm_103a round in hardware.
SM90_FP8_SR_ENV = "REPLAYSSM_SM90_FP8_SR"
SM90_FP8_SR_MODES = ("auto", "plain", "voted")


def sm90_fp8_sr() -> str:
    return env_choice(SM90_FP8_SR_ENV, SM90_FP8_SR_MODES, SM90_FP8_SR_MODES[0])


def fp8_sr_voted(arch: str) -> bool:
    """Whether the FP8 flush on `arch` is the warp-voted variant ($REPLAYSSM_SM90_FP8_SR)."""
    return arch not in HAS_CVT_RS and sm90_fp8_sr() == "voted"


# Batch rows of the FP8 flush's row groups: 32 at 64 heads and more from batch 128 on,
# else 16 (flush_fp8.ROWS_PER_CTA); $REPLAYSSM_FLUSH_ROWS = 16 / 32 forces one. With many
# heads the grid has few CTA columns (2 at 64 heads on an H200), each walking many row
# groups, and groups of 32 halve the walk's flag ballots and barriers; at small batches
# they leave columns idle. H200, project benchmark, 64 heads / 8 groups, alternated
# twice, us per step, 16 -> 32 rows: batch 8 6.34 -> 6.35, 32 11.53 -> 12.28, 128 34.16
# -> 33.60, 256 61.97 -> 60.94, 1024 230.43 -> 225.97; the NVFP4 flush gained nothing
# (227.0 -> 227.5 at 1024) and 16 heads / 2 groups lost at batch 256 (FP8 19.12 ->
# 20.43) (docs/perf-notes-cute.md, session 15). Between 16 and 64 heads unmeasured.
FLUSH_ROWS_ENV = "REPLAYSSM_FLUSH_ROWS"
WIDE_GROUP_HEADS, WIDE_GROUP_BATCH = 64, 128


def fp8_flush_rows(heads: int, batch: int) -> int:
    """Batch rows of the FP8 flush's row groups for a `batch`-row step at `heads` heads."""
    mode = env_choice(FLUSH_ROWS_ENV, ("auto", "16", "32"), "auto")
    if mode != "auto":
        return int(mode)
    return 32 if heads >= WIDE_GROUP_HEADS and batch >= WIDE_GROUP_BATCH else ROWS_PER_CTA


def fp8_flush_rows_variants(heads: int) -> tuple[int, ...]:
    """The row-group sizes the FP8 flush at `heads` heads may launch with."""
    return tuple(dict.fromkeys((fp8_flush_rows(heads, 1), fp8_flush_rows(heads, WIDE_GROUP_BATCH))))


# The FP8 warp kernel's read-copy loads with the L2 prefetch-size qualifier
# `.L2::128B` (decode_warp._WarpHead.rc_hint) from heads x batch >= READ_HINT_MIN_WORK
# on; $REPLAYSSM_FP8_READ_HINT = 0 / 1 forces it off / on. A lane loads 16 bytes of a
# 128-byte read-copy row, a warp instruction half of eight rows; with the qualifier a
# miss fetches the whole line into L2 (ncu, the kernel alone at batch 1024: L2 hit rate
# 22% -> 34%, no faster alone; the gain is beside the flush, session 18). H200, project benchmark, same call, us per step,
# plain -> `.L2::128B`, 16 heads / 2 groups: batch 64 8.00 -> 8.20 (`.L2::256B`), 128
# 11.70 -> 12.02 (`.L2::256B`), 256 19.09 -> 19.28, 512 33.39 -> 33.36 (`.L2::256B`), 1024
# 60.62 -> 59.08; 64 heads / 8 groups 256 60.93 -> 59.77, 1024 222.10 -> 213.47
# (`.L2::256B` within 0.6 us of it everywhere; any L1 qualifier with it, `.cs`,
# `.L1::evict_first`, `.L1::no_allocate`, made the kernel 5-25% slower;
# docs/perf-notes-cute.md, session 17). Where the step is the flush's row chain (small
# batches) the hint costs 1-3%; from about 8,192 (row, head) pairs on it gains. The rule
# checked at other geometries (off -> on, two runs each): 32 heads / 4 groups batch 64
# 11.50 -> 11.87, 128 19.53 -> 19.62, 256 33.31 -> 33.15, 512 60.20 -> 58.72; 64 heads /
# 8 groups 64 19.04 -> 18.80 (the one point it misses), 128 33.62 -> 33.12, 256 61.95 ->
# 60.87, 512 115.55 -> 111.87.
FP8_READ_HINT_ENV = "REPLAYSSM_FP8_READ_HINT"
FP8_READ_HINT = ".L2::128B"
READ_HINT_MIN_WORK = 8192


def fp8_read_hint(heads: int, batch: int) -> bool:
    """Whether the FP8 non-flush kernel of a `batch`-row step at `heads` heads loads its
    read copy with FP8_READ_HINT."""
    mode = env_choice(FP8_READ_HINT_ENV, ("auto", "0", "1"), "auto")
    if mode != "auto":
        return mode == "1"
    return heads * batch >= READ_HINT_MIN_WORK


# Programmatic dependent launch (PDL) of the non-flush kernel at batch 1: launched right
# behind the prepare kernel on the current stream, it may start while that kernel
# finishes and waits for it (griddepcontrol.wait) before its first memory access, which
# hides a launch latency. (The wait is for the grid just before it on the stream: the
# prepare kernel, or a copy `_dense16` made after it, which started only once prepare
# had finished.) The flush, forked onto the side stream by an event, is launched as
# before. (Above batch 1 the flush takes the PDL launch instead: FLUSH_PDL_ENV.) H200,
# project benchmark at batch 1, 16 heads / 2 groups, same-run A/B: FP8
# 4.28 -> 3.47 us, NVFP4 4.52 -> 4.26 us; PDL at every batch made batch 32-1024 slower
# (NVFP4 at batch 32 8.8 -> 16.0 us), hence batch 1 only (docs/perf-notes-cute.md,
# session 4; again in session 10 with the warp kernels and prepare's early trigger, FP8
# at batch 256 / 1024 22.0 / 64.7 -> 30.3 / 85.0 us: the non-flush CTAs take the SMs
# before the flush, forked when prepare completes, can start). Both variants are
# compiled; $REPLAYSSM_PDL=0 turns PDL off. The opt-in tensor-core FP8 kernel has no PDL
# variant.
PDL_ENV = "REPLAYSSM_PDL"
PDL_MAX_BATCH = 1


def pdl() -> bool:
    return env_choice(PDL_ENV, ("0", "1"), "1") == "1"


# Which non-flush kernel the PDL variant (batch 1) is: "warp" (decode_warp.py with
# griddepcontrol.wait before its first global access, the default) or "simt"
# (decode_fp8.py / decode_nvfp4.py with PDL). H200, project benchmark at batch 1, 16 heads
# / 2 groups, same call, alternated twice, with the prepare kernel's early trigger
# (triton/prepare.py): FP8 3.66 -> 3.48, NVFP4 3.87 -> 3.76 us a step (without the
# trigger 4.01 -> 3.90, 4.18 -> 4.18; docs/perf-notes-cute.md, session 10).
PDL_KERNEL_ENV = "REPLAYSSM_PDL_KERNEL"
PDL_KERNELS = ("warp", "simt")


def pdl_kernel() -> str:
    return env_choice(PDL_KERNEL_ENV, PDL_KERNELS, PDL_KERNELS[0])


def pdl_for(batch: int) -> bool:
    """Whether the non-flush kernel of a `batch`-row step is launched with PDL."""
    return batch <= PDL_MAX_BATCH and pdl()


# Above batch 1 the flush is the kernel launched with PDL: on the current stream right
# behind the prepare kernel (whose early trigger lets it launch at once), its persistent
# CTAs become resident while prepare runs and wait for it (griddepcontrol.wait) before
# their first global access, so they start work as prepare ends instead of a launch
# latency later. The non-flush kernel goes on the side stream, forked after prepare (a
# full dependency). H200, project benchmark, same call, alternated twice, us per step,
# 16 heads / 2 groups at batch 256 / 1024: FP8 20.00 / 61.81 -> 19.21 / 61.10, NVFP4
# 20.08 / 65.53 -> 19.67 / 65.00; 64 heads / 8 groups: FP8 63.20 / 230.27 -> 62.21 /
# 229.82, NVFP4 62.73 / 228.75 -> 62.14 / 228.22 (docs/perf-notes-cute.md, session 15).
# $REPLAYSSM_FLUSH_PDL=0 keeps the flush on the side stream without PDL (as at batch 1);
# $REPLAYSSM_PDL=0 turns off both.
FLUSH_PDL_ENV = "REPLAYSSM_FLUSH_PDL"


def flush_pdl() -> bool:
    return env_choice(FLUSH_PDL_ENV, ("0", "1"), "1") == "1"


def flush_pdl_for(batch: int) -> bool:
    """Whether the flush of a `batch`-row step is launched with PDL."""
    return batch > PDL_MAX_BATCH and pdl() and flush_pdl()


FLUSH_KINDS = ("flush_fp8", "flush_fp8_debug", "flush_nvfp4", "flush_nvfp4_debug")


def has_pdl_variant(kind: str) -> bool:
    """Whether kernel `kind` has a PDL variant: the flushes, and the non-flush kernels
    (FP8: unless "mma"), whose PDL variant is the warp kernel (decode_warp.py) or the
    SIMT kernel (decode_fp8.py, decode_nvfp4.py) when pdl_kernel() or the decode mode is
    "simt"."""
    return kind in FLUSH_KINDS or kind == "decode_nvfp4" or (kind == "decode_fp8" and fp8_decode() != "mma")


def pdl_variants(kind: str = "decode_fp8") -> tuple[bool, ...]:
    """The variants (PDL or not) of kernel `kind` a step may launch (warmup compiles and
    loads each)."""
    on = pdl() and has_pdl_variant(kind) and (kind not in FLUSH_KINDS or flush_pdl())
    return (False, True) if on else (False,)


def step_variants() -> tuple[tuple[bool, bool], ...]:
    """The (non-flush PDL, flush PDL) pairs a step may launch: above batch 1 and at it."""
    return tuple(dict.fromkeys(((False, flush_pdl_for(2)), (pdl_for(1), False))))


def fp8_read_hint_variants(heads: int, nonflush_pdl: bool) -> tuple[bool, ...]:
    """The read-hint choices (fp8_read_hint) of the FP8 non-flush kernel at `heads` heads
    launched with PDL (batch 1) or without (above it)."""
    batches = (1,) if nonflush_pdl else (PDL_MAX_BATCH + 1, max(PDL_MAX_BATCH + 1, -(-READ_HINT_MIN_WORK // heads)))
    return tuple(dict.fromkeys(fp8_read_hint(heads, b) for b in batches))


def _warp_kernel(kind: str, pdl: bool) -> bool:
    """Whether kernel `kind` with this PDL choice is the FP8 warp kernel (decode_warp.py),
    the one with the read hint (fp8_read_hint)."""
    return kind == "decode_fp8" and fp8_decode() == "warp" and (not pdl or pdl_kernel() == "warp")


def _kernel_object(
    kind: str, arch: str, heads: int, groups: int, e4m3: str, pdl: bool = False, voted: bool = False, rows: int = ROWS_PER_CTA,
    read_hint: bool = False,
):
    if kind == "decode_fp8":
        mode = fp8_decode()
        if mode == "mma":
            return DecodeFp8Mma(heads, groups)
        if _warp_kernel(kind, pdl):
            obj = DecodeFp8Warp(heads, groups)
            obj.pdl = pdl
            obj.rc_hint = FP8_READ_HINT if read_hint else ""
            return obj
        obj = DecodeFp8(heads, groups)
        obj.pdl = pdl
        return obj
    debug = kind == "flush_fp8_debug"
    if arch in HAS_CVT_RS:
        obj = FlushFp8Sm100(heads, groups, debug=debug)
    else:
        obj = FlushFp8Sm90(heads, groups, debug=debug, hw_e4m3=e4m3 == "hw", sr_voted=voted)
    obj.pdl = pdl
    obj.rows = rows
    return obj


# Pointer arguments of each launcher, in order: (dtype, alignment in bytes). The same
# table types the placeholders at compile time and the addresses at launch time.
_INPUT_PTRS = [
    (BFloat16, 16),  # x
    (Float32, 4),  # dt
    (Float32, 4),  # A
    (BFloat16, 16),  # B
    (BFloat16, 16),  # C
    (Float32, 4),  # D
    (Float32, 4),  # dt_bias
    (BFloat16, 2),  # out
]
POINTERS = {
    "decode_fp8": [
        (Uint32, 16),  # read copy, as words
        (Float32, 4),  # scales
        (BFloat16, 16),  # x ring
        (Float32, 4),  # dt ring
        (BFloat16, 16),  # B ring
        *_INPUT_PTRS,
        (Int8, 1),  # plan.valid
        (Int64, 8),  # plan.slot
        (Int64, 8),  # plan.ring_index
        (Int8, 1),  # plan.flush
    ],
    "flush_fp8": [
        (Float16, 16),  # checkpoint
        (Uint32, 16),  # read copy, as words
        (Float32, 4),  # scales
        (BFloat16, 16),  # x ring
        (Float32, 4),  # dt ring
        (BFloat16, 16),  # B ring
        *_INPUT_PTRS,
        (Int64, 8),  # plan.slot
        (Int8, 1),  # plan.flush
        (Int64, 8),  # plan.key
        (Float32, 16),  # state_out (debug variant)
    ],
}
POINTERS["flush_fp8_debug"] = POINTERS["flush_fp8"]
# Int64 scalars (slot strides, input strides) after the pointers.
SCALARS = {"decode_fp8": 11, "flush_fp8": 13, "flush_fp8_debug": 13}


def _pointers(kind: str, addresses, table: dict = POINTERS) -> list:
    """Typed pointers for a launch of `kind` (`table`: kind -> [(dtype, alignment)])."""
    return [make_ptr(dtype, addr, assumed_align=align) for (dtype, align), addr in zip(table[kind], addresses, strict=True)]


def _fake_args(kind: str, table: dict = POINTERS, scalars: dict = SCALARS) -> list:
    """Placeholder arguments with the types (and pointer alignments) of a launch."""
    ptrs = _pointers(kind, [0] * len(table[kind]), table)
    return [*ptrs, *([Int64(0)] * scalars[kind]), Int32(0), make_fake_stream()]


def _options(arch: str, dump_dir: str | os.PathLike | None) -> str:
    opts = f"--gpu-arch {arch}"
    if dump_dir is not None:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return opts


def compiled(
    kind: str, arch: str, heads: int, groups: int, e4m3: str | None = None, pdl: bool = False, voted: bool = False, rows: int = ROWS_PER_CTA,
    read_hint: bool = False,
):
    """The compiled launcher for (kind, arch, heads, groups), compiling it on first use
    (`e4m3`: the sm_90a read-copy encode, default `sm90_e4m3()`; `pdl`: the variant
    launched with programmatic dependent launch; `voted`: the sm_90a flush with
    the warp-voted rounding, see fp8_sr_voted; `rows`: the FP8 flush's row-group size,
    see fp8_flush_rows; `read_hint`: the FP8 warp kernel's read-copy loads with
    FP8_READ_HINT, see fp8_read_hint)."""
    e4m3 = "hw" if arch in HAS_CVT_RS or kind == "decode_fp8" else (e4m3 or sm90_e4m3())
    pdl = pdl and has_pdl_variant(kind)
    voted = voted and kind != "decode_fp8" and arch not in HAS_CVT_RS
    rows = ROWS_PER_CTA if kind == "decode_fp8" else rows
    read_hint = read_hint and _warp_kernel(kind, pdl)
    key = (kind, arch, heads, groups, e4m3, fp8_decode() if kind == "decode_fp8" else None, pdl and pdl_kernel(), voted, rows, read_hint)
    fn = _COMPILED.get(key)
    if fn is None:
        obj = _kernel_object(kind, arch, heads, groups, e4m3, pdl, voted, rows, read_hint)
        fn = cute.compile(obj, *_fake_args(kind), options=_options(arch, None))
        _COMPILED[key] = fn
    return fn


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
    """Compile every FP8 and NVFP4 decode variant for `arch` (no GPU needed) into `dump_dir`.

    Each variant gets its own folder `dump_dir/<kind>-h<H>g<G>`, each kernel's PDL
    variant (the non-flush kernel's at batch 1, `pdl_for`; the flush's above it,
    `flush_pdl_for`) `dump_dir/<kind>-h<H>g<G>-pdl`, the sm_90a FP8 flush's warp-voted
    variants ($REPLAYSSM_SM90_FP8_SR=voted) `dump_dir/flush_fp8-h<H>g<G>[-pdl]-voted`, the
    non-flush warp kernel with the read hint (fp8_read_hint)
    `dump_dir/decode_fp8-h<H>g<G>-hint` (the DSL names its dumps after the launcher, which
    all variants share). Returns the PTX and cubin paths."""
    arch = check_arch(arch)
    root = Path(dump_dir)
    paths: list[str] = []
    for heads, groups in COMPILE_ALL_GEOMETRIES:
        for kind in ("decode_fp8", "flush_fp8"):
            pdls = (False, True) if has_pdl_variant(kind) else (False,)
            voteds = (False, True) if kind == "flush_fp8" and arch not in HAS_CVT_RS else (False,)
            variants = [(p, v, False) for v in voteds for p in pdls]
            if _warp_kernel(kind, False):
                variants.append((False, False, True))
            for with_pdl, voted, hint in variants:
                obj = _kernel_object(kind, arch, heads, groups, sm90_e4m3(), with_pdl, voted, read_hint=hint)
                sub = f"{kind}-h{heads}g{groups}" + ("-pdl" if with_pdl else "") + ("-voted" if voted else "") + ("-hint" if hint else "")
                paths += compile_into(obj, _fake_args(kind), arch, root / sub)
    from .launch_nvfp4 import compile_variants  # the NVFP4 kinds (that module imports this one)

    paths += compile_variants(arch, root, COMPILE_ALL_GEOMETRIES)
    return paths


def warmup(heads: int, groups: int, arch: str | None = None) -> list[str]:
    """Compile the decode kernels for one geometry, every variant a step may launch
    (`pdl_variants`, `fp8_flush_rows_variants`; the FP8 flush's rounding as
    `fp8_sr_voted` chooses) included (before CUDA-graph capture)."""
    arch = arch or arch_for()
    names = []
    for with_pdl in pdl_variants("decode_fp8"):
        for hint in fp8_read_hint_variants(heads, with_pdl):
            compiled("decode_fp8", arch, heads, groups, pdl=with_pdl, read_hint=hint)
            tags = (",pdl" if with_pdl else "") + (",hint" if hint and _warp_kernel("decode_fp8", with_pdl) else "")
            names.append(f"cute.decode_fp8[{arch},h{heads},g{groups}{tags}]")
    voted = fp8_sr_voted(arch)
    for with_pdl in pdl_variants("flush_fp8"):
        for rows in fp8_flush_rows_variants(heads):
            compiled("flush_fp8", arch, heads, groups, pdl=with_pdl, voted=voted, rows=rows)
            tags = (",pdl" if with_pdl else "") + (",voted" if voted else "") + (f",rows{rows}" if rows != ROWS_PER_CTA else "")
            names.append(f"cute.flush_fp8[{arch},h{heads},g{groups}{tags}]")
    return names


def launch_padding(cache: Sequence[torch.Tensor], plan, out: torch.Tensor, arch: str) -> None:
    """Launch the decode kernels (each pair of `step_variants`, each row-group size of
    `fp8_flush_rows_variants`) for a plan of padding rows only (they return at once and
    write nothing): loads the compiled modules, e.g. before CUDA-graph capture."""
    batch = plan.valid.shape[0]
    heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
    dev = out.device
    x = torch.zeros(batch, heads, L.HEAD_DIM, dtype=torch.bfloat16, device=dev)
    bc = torch.zeros(batch, groups, L.STATE_DIM, dtype=torch.bfloat16, device=dev)
    per_head = torch.zeros(heads, device=dev)
    for nonflush_pdl, flush_pdl in step_variants():
        for rows in fp8_flush_rows_variants(heads):
            for hint in fp8_read_hint_variants(heads, nonflush_pdl):
                decode_fp8(
                    cache, x, torch.zeros(batch, heads, device=dev), per_head, bc, bc,
                    torch.zeros(heads, L.HEAD_DIM, device=dev), per_head, plan, out, arch=arch,
                    pdl=nonflush_pdl, flush_pdl=flush_pdl, flush_rows=rows, read_hint=hint,
                )


# ---------------------------------------------------------------------------------------
# Launch


def pdl_pair(batch: int, pdl: bool | None, flush_pdl: bool | None) -> tuple[bool, bool]:
    """(non-flush PDL, flush PDL) for a step: the given values, defaults `pdl_for(batch)`
    and `flush_pdl_for(batch)`. Only the kernel on the current stream right behind
    prepare can be the PDL one, so not both."""
    pdl = pdl_for(batch) if pdl is None else pdl
    flush_pdl = flush_pdl_for(batch) if flush_pdl is None else flush_pdl
    if pdl and flush_pdl:
        raise ValueError("pdl and flush_pdl: at most one of the two kernels is launched with PDL, got both")
    return pdl, flush_pdl


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


def flush_grid_columns(ctas_per_sm: float, heads: int, device: torch.device) -> int:
    """The flush launch's CTA columns (flush_fp8.flush_columns) on `device`'s SM count."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return flush_columns(heads, ctas_per_sm, _sm_count(index))


def _stride16(t: torch.Tensor) -> int:
    return t.stride(0) * t.element_size() // 16


def _dense16(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte-aligned base (a copy only for unusual caller tensors)."""
    if not t.is_contiguous():
        return t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


# Run one of the two kernels on a side stream, forked from and joined back into the
# current stream, so that they overlap: the two touch disjoint slots and output rows
# (non-flush rows vs flush rows of one plan). The kernel launched with PDL stays on the
# current stream right behind the prepare kernel (the flush above batch 1, the non-flush
# kernel at it); the other goes on the side stream. A captured CUDA graph records the
# fork and the join as edges. False: both on the current stream.
OVERLAP = True
_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    side = _SIDE.get(device)
    if side is None:
        # High priority (for the flush, which was the latency-critical kernel when it went
        # here at every batch; above batch 1 it now holds the non-flush kernel, for which
        # high or normal priority measured the same: docs/perf-notes-cute.md, session 15).
        side = torch.cuda.Stream(device=device, priority=-1)
        _SIDE[device] = side
    return side


@contextmanager
def flush_streams(device: torch.device, flush_pdl: bool = False):
    """(flush stream, non-flush stream) for one step: one is the current stream `main`,
    the other the side stream, forked from `main` on entry (the plan and the inputs are
    ready for it; a PDL kernel on `main` waits for them itself) and joined back into it
    on exit (everything after the step sees both kernels' writes). `flush_pdl`: the
    flush on `main` (launched with PDL), else the non-flush kernel. With OVERLAP off both
    are `main`."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device) if OVERLAP else main
    if side is not main:
        side.wait_stream(main)
    yield (main, side) if flush_pdl else (side, main)
    if side is not main:
        main.wait_stream(side)


def decode_fp8(
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
    e4m3: str | None = None,
    pdl: bool | None = None,
    flush_pdl: bool | None = None,
    voted: bool | None = None,
    flush_rows: int | None = None,
    read_hint: bool | None = None,
) -> None:
    """Launch the non-flush and the flush kernel for one step (after `prepare`).

    Inputs as `reference.decode_nonflush` takes them (normalized by `replayssm.api`);
    `plan` is the prepare kernel's `reference.Plan` (device buffers). `state_out`
    (float32 [batch, H, 64, 128], contiguous) selects the debug flush, which also writes
    the FP32 state of every flushed row there (tests only); `e4m3` picks the sm_90a
    read-copy encode ("hw" / "soft", default $REPLAYSSM_SM90_E4M3 or "hw"); `pdl` the
    non-flush variant (default `pdl_for(batch)`), `flush_pdl` the flush's (default
    `flush_pdl_for(batch)`; at most one of the two); `voted` the flush variant (default
    `fp8_sr_voted(arch)`); `flush_rows` its row-group size (default
    `fp8_flush_rows(heads, batch)`); `read_hint` the non-flush kernel's read-copy loads
    (default `fp8_read_hint(heads, batch)`)."""
    batch, heads = x.shape[0], x.shape[1]
    groups = cache[L.B_RING].shape[1]
    arch = arch or arch_for(x.device)
    x, B, C = _dense16(x), _dense16(B), _dense16(C)
    ckpt, x_ring, dt_ring, b_ring = cache[L.CHECKPOINT], cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING]
    read, scales = cache[L.READ_COPY], cache[L.SCALES]
    inputs = [x, dt, A, B, C, D, dt_bias, out]
    input_strides = [dt.stride(0), dt.stride(1), A.stride(0), dt_bias.stride(0), D.stride(0), D.stride(1)]
    pdl, flush_pdl = pdl_pair(batch, pdl, flush_pdl)
    hint = fp8_read_hint(heads, batch) if read_hint is None else read_hint
    nonflush = compiled("decode_fp8", arch, heads, groups, pdl=pdl, read_hint=hint)
    kind = "flush_fp8" if state_out is None else "flush_fp8_debug"
    rows = fp8_flush_rows(heads, batch) if flush_rows is None else flush_rows
    flush = compiled(kind, arch, heads, groups, e4m3, pdl=flush_pdl, voted=fp8_sr_voted(arch) if voted is None else voted, rows=rows)
    with flush_streams(x.device, flush_pdl) as (flush_stream, nonflush_stream):
        ptrs = [ckpt, read, scales, x_ring, dt_ring, b_ring, *inputs, plan.slot, plan.flush, plan.key]
        addresses = [t.data_ptr() for t in ptrs] + [0 if state_out is None else state_out.data_ptr()]
        flush(
            *_pointers(kind, addresses),
            _stride16(ckpt), _stride16(read), scales.stride(0), _stride16(x_ring), dt_ring.stride(0), _stride16(b_ring),
            *input_strides, flush_grid_columns(FlushFp8.ctas_per_sm, heads, x.device),
            batch, cuda_driver.CUstream(flush_stream.cuda_stream),
        )
        ptrs = [read, scales, x_ring, dt_ring, b_ring, *inputs, plan.valid, plan.slot, plan.ring_index, plan.flush]
        nonflush(
            *_pointers("decode_fp8", [t.data_ptr() for t in ptrs]),
            _stride16(read), scales.stride(0), _stride16(x_ring), dt_ring.stride(0), _stride16(b_ring),
            *input_strides,
            batch, cuda_driver.CUstream(nonflush_stream.cuda_stream),
        )


__all__ = ["KINDS", "COMPILE_ALL_GEOMETRIES", "fp8_sr_voted", "fp8_flush_rows", "fp8_read_hint", "flush_pdl_for", "step_variants", "compiled", "compile_all", "warmup", "launch_padding", "layout_ok", "decode_fp8"]
