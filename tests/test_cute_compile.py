"""Compile-only checks of the CuTe DSL decode kernels, every format, every target (CPU CI).

No GPU is needed: `compile_all` names the target explicitly. The checks are properties of
the code, not instruction counts (those move with any harmless change of the compiler or
of unrolling):

- the conversions by target: sm_100a / sm_103a round the checkpoint with the hardware
  `cvt.rs.satfinite.f16x2.f32` and convert the read copy with the e4m3x2 / e2m1x2 `cvt`
  forms, with no software rounding left; sm_90a has no `cvt.rs` or e2m1 conversion and
  emits none (its software paths are present instead, checked bit for bit by the GPU
  tests); no flush rounds the checkpoint to nearest; fp16 (no read copy) converts no
  state to f16 in its non-flush kernel and encodes nothing but the checkpoint;
- the tensor cores: f16 and bf16 `mma.m16n8k16` in the non-flush kernel, tf32
  `mma.m16n8k8` in the flush, each and only where docs/design.md puts it;
- one kernel entry a module, the PDL wait in the `-pdl` variants only and before their
  first global access, the non-flush kernel's one barrier;
- the read-copy cache hints the config names (present or absent, the loads otherwise the
  same), 16-bit dt loads for 16-bit dt, IEEE reciprocals and an atomic max in the NVFP4
  flush, no local memory in any PTX;
- from the cubins (cuobjdump): registers that allow each kernel's CTAs an SM, no spill
  stack in the non-flush kernels and the NVFP4 flush, each flush PDL variant its plain
  twin plus the one wait, a flushed row's loads issued before its staging.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (pip install -e '.[cute]')")

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
GEOMETRIES = ((16, 2), (16, 1))
F16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
TF32_MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
# A conversion to FP16 rounded to nearest: the checkpoint must never take one.
F16_RN = re.compile(r"\bcvt\.rn(\.satfinite)?\.f16(x2)?\.f32\b")
# Every 16-byte global load, whatever its cache qualifiers.
V4_LOAD = re.compile(r"\bld\.global(\.[\w:]+)*\.v4\.b32\b")
ATOMIC = re.compile(r"\b(?:atom|red)(?:\.\w+)+")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from replayssm.kernels import compile_all

    return {arch: [Path(p) for p in compile_all(arch, tmp_path_factory.mktemp(arch))] for arch in ARCHS}


def _ptx(paths, prefix):
    return {p.parent.name: p.read_text() for p in paths if p.suffix == ".ptx" and p.parent.name.startswith(prefix)}


def _expected_folders(arch):
    from replayssm.kernels.cute.config import step_configs
    from replayssm.kernels.cute.launch import variant_name

    return {variant_name(kind, cfg) for fmt in ("fp8", "nvfp4", "fp16") for h, g in GEOMETRIES for cfg in step_configs(arch, fmt, h, g) for kind in ("decode", "flush")}


def _fits(regs, threads, ctas_per_sm):
    """Whether `ctas_per_sm` CTAs of `threads` threads at `regs` registers a thread fit one
    SM's 64K registers (allocated 8 a thread at a time)."""
    return 0 < regs <= 255 and -(-regs // 8) * 8 * threads * ctas_per_sm <= 65536


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(compiled, arch):
    paths = compiled[arch]
    folders = {p.parent.name for p in paths}
    # At 16 heads: the non-flush kernel plain, as the batch-1 PDL kernel and (FP8) with
    # the read hint (NVFP4, fp16: streamed); the flush plain (batch 1) and as the PDL
    # kernel above it.
    want = set()
    for h, g in GEOMETRIES:
        want |= {f"decode-fp8-h{h}g{g}{v}" for v in ("-pdl", "", "-l2")}
        want |= {f"decode-{fmt}-h{h}g{g}{v}" for fmt in ("nvfp4", "fp16") for v in ("-pdl", "-cs")}
        want |= {f"flush-{fmt}-h{h}g{g}{v}" for fmt in ("fp8", "nvfp4", "fp16") for v in ("", "-pdl")}
    assert folders == want == _expected_folders(arch)
    for folder in folders:
        assert sorted(p.suffix for p in paths if p.parent.name == folder) == [".cubin", ".ptx"], folder
    for name, text in _ptx(paths, "").items():
        assert re.search(rf"^\.target {arch}\b", text, re.M), name
        assert text.count(".entry kernel_") == 1, name
        assert not re.search(r"\.local\b", text), name  # every array in registers (or shared memory)


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_pdl_variants_wait_for_the_prepare_kernel(compiled, arch):
    """The PDL kernel waits (`griddepcontrol.wait`) once, before its first global access;
    the others never wait."""
    for name, text in _ptx(compiled[arch], "").items():
        body = text[text.index(".entry kernel_") :]
        assert body.count("griddepcontrol.wait") == (1 if "-pdl" in name else 0), name
        if "-pdl" in name:
            first = min(m.start() for m in re.finditer(r"\b(ld|st|atom|red)\.global\b", body))
            assert body.index("griddepcontrol.wait") < first, name


@pytest.mark.parametrize("arch", ARCHS)
def test_flush_loops_over_the_flushing_rows_only(compiled, arch):
    """Every format's flush takes one trip per set bit of the CTA's flush mask (a `popc`
    trip count, the lowest set bit by `bfind`), not one per batch row of the group; fold
    on the tf32 tensor cores, round the checkpoint with the counter hash and never to
    nearest."""
    flushes = _ptx(compiled[arch], "flush")
    assert len(flushes) == 12
    for name, text in flushes.items():
        assert "popc.b32" in text and "bfind.u32" in text, name
        assert TF32_MMA in text and F16_MMA not in text and BF16_MMA not in text, name
        assert "2146121005" in text, name  # the hash's lowbias32 constant 0x7FEB352D
        assert not F16_RN.search(text), name


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_sm100_uses_hardware_conversions(compiled, arch):
    for name, text in _ptx(compiled[arch], "flush").items():
        # The stochastic rounding by `cvt.rs` alone: no software path's truncating
        # conversion or warp vote left.
        assert "cvt.rs.satfinite.f16x2.f32" in text, name
        assert "cvt.rz.f16x2.f32" not in text and "vote.sync.all" not in text, name
        # FP8 codes, NVFP4 block scales; fp16 encodes no read copy.
        assert ("cvt.rn.satfinite.e4m3x2.f32" in text) == ("fp16" not in name), name
    for name, text in _ptx(compiled[arch], "flush-nvfp4").items():
        # The e2m1 codes by the hardware conversion, rounded to nearest (the read copy),
        # not by the software encode's rounding add.
        assert "cvt.rn.satfinite.e2m1x2.f32" in text, name
        assert "cvt.rs.satfinite.e2m1" not in text and "add.rn.f32" not in text, name
    for name, text in _ptx(compiled[arch], "decode-nvfp4").items():
        # The codes decoded by e2m1x2 -> f16x2, the block scales by e4m3x2 -> f16x2.
        assert "cvt.rn.f16x2.e2m1x2" in text and "cvt.rn.f16x2.e4m3x2" in text, name


def test_sm90_is_software(compiled):
    for name, text in _ptx(compiled["sm_90a"], "").items():
        assert "cvt.rs" not in text and "e2m1" not in text, name
    for name, text in _ptx(compiled["sm_90a"], "flush-fp8").items():
        # bits.fp16x2_sr_fma: a clamp and an fma.rz a value, truncating pair conversions,
        # no warp vote; the read copy by the e4m3x2 cvt Hopper has.
        assert "min.NaN.xorsign.abs.f32" in text and "fma.rz.f32" in text, name
        assert "cvt.rz.f16x2.f32" in text and "vote.sync.all" not in text, name
        assert "cvt.rn.satfinite.e4m3x2.f32" in text, name
    for name, text in _ptx(compiled["sm_90a"], "flush-nvfp4").items():
        # bits.fp16x2_sr_voted: a warp vote and truncating pair conversions; the e2m1
        # codes by a rounding add.rn (bits_nvfp4.e2m1_code_rn); the block scales by cvt.
        assert "vote.sync.all.pred" in text and "cvt.rz.f16x2.f32" in text, name
        assert "add.rn.f32" in text and "cvt.rn.satfinite.e4m3x2.f32" in text, name
    for name, text in _ptx(compiled["sm_90a"], "decode-nvfp4").items():
        # The codes moved to e4m3 codes and converted two at a time, as the block scales.
        assert "cvt.rn.f16x2.e4m3x2" in text, name
    for name, text in _ptx(compiled["sm_90a"], "flush-fp16").items():
        # The checkpoint by the warp-voted rounding (as NVFP4's); no read copy encoded.
        assert "vote.sync.all.pred" in text and "cvt.rz.f16x2.f32" in text, name
        assert "e4m3" not in text and "add.rn.f32" not in text, name


@pytest.mark.parametrize("arch", ARCHS)
def test_non_flush_kernels_read_vectors_and_use_the_tensor_cores(compiled, arch):
    for name, text in _ptx(compiled[arch], "decode").items():
        assert "cvt.rs" not in text and not re.search(r"\b(atom|red)\.", text), name  # writes no state, no meta
        # Row dots as f16 MMAs, B_j . C and the replay as bf16 MMAs.
        assert F16_MMA in text and BF16_MMA in text and TF32_MMA not in text, name
        assert text.count("bar.sync") == 1, name  # the one barrier: the B_j . C partial sums
        if "fp8" in name:
            assert "cvt.rn.f16x2.e4m3x2" in text, name  # codes to f16 pairs exactly
        elif "fp16" in name:
            # The checkpoint's words are the MMA's f16 pairs as loaded: no conversion, no scaling.
            assert "e4m3" not in text and "e2m1" not in text and "mul.rn.f16x2" not in text, name
        else:
            # Row dots by block: block scales multiply FP32 accumulators (no f16 scaling),
            # summed by butterfly shuffles.
            assert "mul.rn.f16x2" not in text and "shfl.sync.bfly" in text, name


@pytest.mark.parametrize("arch", ARCHS)
def test_read_copy_loads_carry_the_configs_cache_hint(compiled, arch):
    """FP8: `.L2::128B` read-copy loads in the `-l2` variant only, never an L1 qualifier
    (`.cs` among them: C and the B ring meet in L1); NVFP4 and fp16: streamed (`.cs`) loads
    but in the batch-1 PDL variant, no L2 hint. C and the rings stay plain 16-byte loads,
    and a hint changes no load: each variant issues its twin's 16-byte loads."""
    decodes = _ptx(compiled[arch], "decode")
    for name, text in decodes.items():
        assert re.search(r"\bld\.global\.v4\.b32\b", text) and ".L1::" not in text, name
        if "fp8" in name:
            assert ("ld.global.L2::128B.v4.b32" in text) == name.endswith("-l2"), name
            assert "ld.global.cs" not in text, name
        else:
            assert ("ld.global.cs.v4.b32" in text) == (not name.endswith("-pdl")), name
            assert "L2::" not in text, name
        twin = re.sub(r"-(l2|cs)$", "-pdl" if name.endswith("-cs") else "", name)
        assert twin in decodes, name
        assert len(V4_LOAD.findall(text)) == len(V4_LOAD.findall(decodes[twin])), (name, twin)


@pytest.mark.parametrize("arch", ARCHS)
def test_nvfp4_flush_reciprocal_is_ieee_and_amax_is_an_atomic_max(compiled, arch):
    """The block-scale reciprocal rounds to nearest (IEEE, not approximate); the only
    atomic is the group amax's max into meta; a lane's codes of a block are one 8-byte
    store, the block scale a byte."""
    for name, text in _ptx(compiled[arch], "flush-nvfp4").items():
        assert re.search(r"\b(rcp|div)\.rn\.f32\b", text), name
        assert not re.search(r"\b(div|rcp)\.(approx|full)", text), name
        atomics = set(ATOMIC.findall(text))
        assert atomics and all(re.fullmatch(r"(atom|red)(\.\w+)*\.global(\.\w+)*\.max\.s32", a) for a in atomics), (name, atomics)
        assert "st.global.v2.b32" in text and "st.global.b8" in text, name


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_dt_is_read_in_its_own_type(tmp_path, arch):
    """dt as engines pass it (bf16, or f16) is loaded at its width and converted in
    registers (the widening to FP32 is the compiler's cvt or shift, by target); FP32 dt
    has no 16-bit load. The GPU tests (test_engine_inputs.py) check the values."""
    import torch

    from replayssm.kernels.cute import launch
    from replayssm.kernels.cute.config import step_config

    cfg = step_config(arch, "fp8", 16, 2, 256)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for kind in ("decode", "flush"):
            obj, fake = launch.decode_kernel(cfg, dt) if kind == "decode" else launch.flush_kernel(cfg, False, dt)
            (ptx,) = [p for p in launch.compile_into(obj, fake, arch, tmp_path / f"{kind}-{dt}") if p.endswith(".ptx")]
            text = Path(ptx).read_text()
            loads16 = re.search(r"ld\.global(\.\w+)*\.(b16|u16)\b", text)
            assert bool(loads16) == (dt != torch.float32), (kind, dt)


def test_unknown_arch_is_rejected(tmp_path):
    from replayssm.kernels import compile_all

    with pytest.raises(ValueError, match="sm_90a"):
        compile_all("sm_80", tmp_path)


def test_the_flush_test_variant_writes_the_state_and_only_it(tmp_path):
    """The flush's test variant (a DebugPlan) adds one pointer parameter, its state
    buffer, and 16-byte stores of S into it; the shipped variant has neither."""
    from replayssm.kernels.cute import launch
    from replayssm.kernels.cute.config import step_config

    cfg = step_config("sm_90a", "fp8", 16, 2, 256)
    texts = {}
    for debug in (False, True):
        obj, fake = launch.flush_kernel(cfg, debug)
        (ptx,) = [p for p in launch.compile_into(obj, fake, "sm_90a", tmp_path / str(debug)) if p.endswith(".ptx")]
        texts[debug] = Path(ptx).read_text()
    params = {d: len(re.findall(r"\.param \.u64", t[: t.index(")")])) for d, t in texts.items()}
    assert params[True] == params[False] + 1
    stores = {d: t.count("st.global.v4.f32") + t.count("st.global.v4.b32") for d, t in texts.items()}
    assert stores[True] > stores[False]


# ---------------------------------------------------------------------------------------
# The config rules and the launcher's pieces (no compile)


def test_step_config_rules():
    from replayssm.kernels.cute.config import step_config

    def cfg(fmt, heads, batch):
        return step_config("sm_90a", fmt, heads, heads // 8, batch)

    for fmt in ("fp8", "nvfp4", "fp16"):
        one, two = cfg(fmt, 16, 1), cfg(fmt, 16, 2)
        assert (one.nonflush_pdl, one.flush_pdl) == (True, False)  # batch 1: the non-flush kernel takes PDL
        assert (two.nonflush_pdl, two.flush_pdl) == (False, True)  # above it the flush
    # FP8 read hint from heads x batch >= 8192; FP8 row groups of 32 from 64 heads and batch 128.
    assert [cfg("fp8", 16, b).read_hint for b in (1, 511, 512, 1024)] == ["", "", ".L2::128B", ".L2::128B"]
    assert [cfg("fp8", 64, b).read_hint for b in (127, 128)] == ["", ".L2::128B"]
    assert [cfg("fp8", 64, b).flush_rows for b in (1, 127, 128, 1024)] == [16, 16, 32, 32]
    assert [cfg("fp8", 32, b).flush_rows for b in (128, 1024)] == [16, 16]
    # NVFP4 and fp16: streamed read copy (checkpoint) but in the batch-1 PDL variant; row
    # groups of 16.
    for fmt in ("nvfp4", "fp16"):
        assert [cfg(fmt, 16, b).read_hint for b in (1, 2, 1024)] == ["", ".cs", ".cs"]
        assert {cfg(fmt, 64, b).flush_rows for b in (1, 128, 1024)} == {16}


def test_step_configs_cover_every_batch():
    """warmup compiles `step_configs`: every config a batch of 1..4096 rows gets."""
    from replayssm.kernels.cute.config import step_config, step_configs

    for fmt in ("fp8", "nvfp4", "fp16"):
        for heads, groups in ((8, 1), (16, 2), (16, 1), (32, 4), (64, 8), (128, 8)):
            got = set(step_configs("sm_100a", fmt, heads, groups))
            want = {step_config("sm_100a", fmt, heads, groups, b) for b in range(1, 4097)}
            assert got == want, (fmt, heads)


def test_step_config_rejects_two_pdl_kernels():
    from replayssm.kernels.cute.config import step_config

    cfg = step_config("sm_90a", "fp8", 16, 2, 256)
    with pytest.raises(ValueError, match="at most one"):
        dataclasses.replace(cfg, nonflush_pdl=True)
    with pytest.raises(ValueError, match="flush_rows"):
        dataclasses.replace(cfg, flush_rows=7)


def test_argument_structs_raw_is_what_the_spec_reads():
    """`raw` (launch time: the ints a kernel's TVM-FFI entry takes) and `fake` (compile
    time) come from one spec: one value a field, pointers the tensors' addresses (16-byte
    aligned where the placeholder assumes it), strides in the spec's units."""
    import torch

    from replayssm import layout as L
    from replayssm.kernels.cute import args as A

    cache = L.allocate_cache(5, 16, 2, "nvfp4", "cpu", slot_padding=64)
    ring = A.Ring(*A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING]))
    fake = A.fake(A.Ring)
    for name, key in (("x", L.X_RING), ("dt", L.DT_RING), ("b", L.B_RING)):
        assert getattr(ring, name) == cache[key].data_ptr(), name
        assert getattr(ring, name) % getattr(fake, name)._assumed_align == 0, name
    assert ring.x_stride16 * 16 == cache[L.X_RING].stride(0) * 2
    assert ring.dt_stride == cache[L.DT_RING].stride(0)
    proj = torch.zeros(3, 16 * 64 + 2 * 2 * 128 + 24, dtype=torch.bfloat16)  # an engine's projection
    x = proj[:, : 16 * 64].view(3, 16, 64)
    B = proj[:, 16 * 64 : 16 * 64 + 256].view(3, 2, 128)
    dt = torch.zeros(3, 16, 64).select(2, 0)  # strided
    per_head = torch.zeros(16)
    D = torch.zeros(16, 1).expand(16, 64)  # tied over the head dim: stride 0
    inputs = A.Inputs(*A.raw(A.Inputs, x=x, dt=dt, A=per_head, B=B, C=B, D=D, dt_bias=per_head, out=x))
    assert (inputs.dt_stride_b, inputs.dt_stride_h, inputs.d_stride_h, inputs.d_stride_p) == (16 * 64, 64, 1, 0)
    assert (inputs.x_stride16, inputs.b_stride16, inputs.c_stride16) == (proj.stride(0) * 2 // 16,) * 3
    ckpt = A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=8)
    assert ckpt == [cache[L.CHECKPOINT].data_ptr(), cache[L.CHECKPOINT].stride(0) * 2 // 16, 8]
    for struct in (A.Ring, A.Nvfp4Copy, A.Fp8Copy, A.Fp16Copy, A.Checkpoint, A.Inputs, A.Plan, A.DebugPlan, A.PendingInputs):
        assert list(A.SPECS[struct]) == list(struct._fields), struct.__name__
    assert len(A.DebugPlan._fields) == len(A.Plan._fields) + 1


def test_streams_fork_and_join(monkeypatch):
    """The launcher's streams (no GPU: the driver replaced by a recorder): the side stream
    waits for the fork event recorded on the current one before the kernels, and the
    current one for the join event recorded on the side stream after them; the PDL kernel
    stays on the current stream."""
    from replayssm.kernels.cute import launch

    ok = launch.cuda_driver.CUresult.CUDA_SUCCESS
    calls = []

    class Driver:  # stands in for cuda.bindings' driver module
        CUresult = launch.cuda_driver.CUresult

        def __init__(self, wait_result=ok):
            self.wait_result = wait_result

        def cuEventRecord(self, event, stream):
            calls.append(("record", event, stream))
            return (ok,)

        def cuStreamWaitEvent(self, stream, event, flags):
            calls.append(("wait", stream, event))
            return (self.wait_result,)

    monkeypatch.setattr(launch, "cuda_driver", Driver())
    monkeypatch.setattr(launch, "_side_stream", lambda index: (200, 11, 12))
    for flush_pdl in (False, True):
        calls.clear()
        f, n = launch.fork_streams(0, flush_pdl, 100)
        launch.join_streams(0, 100)
        assert (f, n) == ((100, 200) if flush_pdl else (200, 100))
        assert calls == [("record", 11, 100), ("wait", 200, 11), ("record", 12, 200), ("wait", 100, 12)]

    monkeypatch.setattr(launch, "cuda_driver", Driver(launch.cuda_driver.CUresult.CUDA_ERROR_INVALID_HANDLE))
    with pytest.raises(RuntimeError, match="CUDA driver error"):
        launch.fork_streams(0, True, 100)


@pytest.mark.parametrize("N", [128, 256])
def test_flush_fragment_maps_are_bijections(N):
    """The flush's permuted column maps: the staging positions the kernel writes
    (`_b_stage_base`, + 4 (i % 2) + i // 2 for column 8 ch + i) equal `_b_slot`, `_b_slot`
    is a permutation of the N columns, and lane (gq, q)'s B fragment (its 8 n-tiles,
    read 4 at a time as consecutive staged floats at 64 part + 32 k + 4 gq) holds exactly
    the columns its accumulators are stored to (the lane's 16 consecutive columns)."""
    from replayssm.kernels.cute.flush import COLUMNS, NT, Flush, _b_slot, _b_stage_base, shape
    from replayssm.kernels.cute.read_copy import read_copy_format

    flush = Flush(read_copy_format("fp8", "sm_90a", 64, N), 16, 2)
    B_ROW, mt = flush.B_ROW, flush.sh.mt
    lane_cols = 2 * NT
    assert (NT, COLUMNS, flush.sh) == (8, 64, shape(64, N)) and flush.sh.cp == N // 64
    assert sorted(_b_slot(n, N) for n in range(N)) == list(range(N))
    for ch in range(N // 8):  # staging thread: columns 8 ch .. 8 ch + 7
        base = _b_stage_base(ch)
        for i in range(8):
            assert base + 4 * (i % 2) + i // 2 == _b_slot(8 * ch + i, N), (ch, i)
    for part in range(flush.sh.cp):
        for g in range(8):  # MMA column g of n-tile nt is state column phys(nt, g)
            for nt in range(NT):
                phys = part * COLUMNS + (g // 2) * lane_cols + 2 * nt + g % 2
                assert _b_slot(phys, N) == part * COLUMNS + 32 * (nt // 4) + 4 * g + nt % 4
        for q in range(4):
            cols = sorted(part * COLUMNS + (c // 2) * lane_cols + 2 * nt + c % 2 for nt in range(NT) for c in (2 * q, 2 * q + 1))
            first = part * COLUMNS + lane_cols * q
            assert cols == list(range(first, first + lane_cols))
            for w in range(mt * part, mt * part + mt):
                assert Flush.lane_geometry(32 * w + q, 0, mt)[3] == first
    # Bank-conflict-free B fragment loads: the 8 lanes of each 16-byte load phase read
    # distinct 4-bank groups.
    for a in range(4):
        assert len({((q * B_ROW + 4 * (2 * a + b)) % 32) // 4 for q in range(4) for b in range(2)}) == 8, a


def test_step_lane_n_sets_cover_each_state_column_once():
    """The steps' n-sets (`c_word`: the C and B ring words of lane q, and fp16's checkpoint
    words, so that a row's word j and C's word j hold the same two columns): the four
    lanes of a row hold each of the 128 columns once, a 16-byte vector 8 consecutive ones;
    fp16's four lanes read one 64-byte span of a row with each of their 16-byte loads."""
    from replayssm.kernels.cute.read_copy import read_copy_format

    for name in ("fp8", "nvfp4", "fp16"):
        fmt = read_copy_format(name, "sm_90a")
        cols = sorted(2 * fmt.c_word(c, q, h) + e for q in range(4) for c in range(2) for h in range(2) for e in range(8))
        assert cols == list(range(128)), name
    fp16 = read_copy_format("fp16", "sm_90a")
    for c in range(2):
        for h in range(2):
            starts = sorted(4 * fp16.c_word(c, q, h) for q in range(4))  # bytes into the row
            assert starts == list(range(starts[0], starts[0] + 64, 16)) and starts[0] % 64 == 0, (c, h)


@pytest.mark.parametrize("P, N", [(64, 128), (64, 256), (80, 128), (80, 256)])
def test_flush_lane_map_covers_each_state_row_part_once(P, N):
    """`flush.Shape`: m_split CTAs of `threads` threads a head cover each (row, column) of
    the state once, CTA mh the rows 16 mt mh .. + 16 mt; 16 warps an SM at 128 registers
    a thread."""
    from replayssm.kernels.cute.flush import NT, Flush, shape

    sh = shape(P, N)
    assert sh.m_split * sh.mt * 16 == P and sh.cp * 64 == N and sh.warps * sh.min_ctas == 16
    seen = []
    for mh in range(sh.m_split):
        for t in range(sh.threads):
            _, _, rows, col0 = Flush.lane_geometry(t, mh, sh.mt)
            assert all(16 * sh.mt * mh <= r < 16 * sh.mt * (mh + 1) for r in rows)
            seen += [(r, col0 + c) for r in rows for c in range(2 * NT)]
    assert sorted(seen) == [(p, n) for p in range(P) for n in range(N)]


@pytest.mark.parametrize("heads", [16, 64, 256])
@pytest.mark.parametrize("batch", [1, 45, 256, 1024, 1031])
def test_flush_grid_visits_every_row_group_once(heads, batch):
    """The persistent flush grid, walked as the kernel walks it: every (head half, row
    group) once, and a CTA's successive groups alternate between the two flag words
    (flush_mask's `buf`); groups of 16 and of 32 rows, both formats' CTAs an SM."""
    from replayssm.kernels.cute.flush import flush_columns, shape
    from replayssm.kernels.cute.read_copy import Fp8, Nvfp4

    sh = shape(64, 128)
    hm = heads * sh.m_split
    for rows in (16, 32):
        n_by = -(-batch // rows)
        for ctas_per_sm in (Fp8.ctas_per_sm, Nvfp4.ctas_per_sm, 0.0, 100.0):
            for sms, round_up in itertools.product((132, 148, 1), (False, True)):
                columns = flush_columns(heads, ctas_per_sm, sms, sh, round_up)
                # About ctas_per_sm CTAs of 4 warps an SM: the nearest whole column count
                # or (round_up) the least one at or above it, never none.
                exact = ctas_per_sm * 4 / sh.warps * sms / hm
                assert columns >= 1 and (columns == 1 or (exact <= columns < exact + 1 if round_up else abs(columns - exact) <= 0.5))
                n_ctas = hm * min(n_by, columns)
                seen = []
                for bid in range(n_ctas):
                    step = n_ctas // hm
                    groups = list(range(bid // hm, n_by, step))
                    assert [(by // step) & 1 for by in groups] == [i % 2 for i in range(len(groups))]
                    seen += [(bid % hm, by) for by in groups]
                assert sorted(seen) == [(h, by) for h in range(hm) for by in range(n_by)], (ctas_per_sm, sms)


# ---------------------------------------------------------------------------------------
# SASS (cuobjdump; Triton's has no sm_103a, whose code is sm_100a's)


def _sass_stats():
    sys.path.insert(0, str(ROOT))
    from benchmarks import sass_stats

    return sass_stats


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_sass_stats_reads_the_kernels_resources(compiled, arch):
    """benchmarks/sass_stats.py reads the cubins right: every kernel holds tensor-core
    MMAs, global loads and stores and barriers, the non-flush kernel its one barrier; the
    registers allow the CTAs an SM each kernel is compiled for (`min_blocks_per_mp`:
    the format's step_ctas_per_sm, the flush Shape's min_ctas; 128 registers at 4 CTAs of 128
    threads, 168 at fp16's 3);
    no spill stack in the non-flush kernels or the NVFP4 flush (its voted rounding is the
    form that does not spill; docs/design.md section 7); each flush PDL variant differs
    from its plain twin by the one wait."""
    from replayssm.kernels.cute import decode, flush
    from replayssm.kernels.cute.read_copy import read_copy_format

    sass_stats = _sass_stats()
    tool = sass_stats.default_cuobjdump()
    stats = {p.parent.name: sass_stats.cubin_stats(p, tool) for p in compiled[arch] if p.suffix == ".cubin"}
    for name, st in stats.items():
        cls = sass_stats.classify(st["ops"])
        assert cls["MMA"] and cls["LDG"] and cls["STG"] and cls["BAR"], (name, cls)
        if name.startswith("flush"):
            sh = flush.shape(64, 128)
            threads, ctas = sh.threads, sh.min_ctas
        else:
            assert cls["BAR"] == 1, (name, cls)
            fmt, heads, groups = re.search(r"-(\w+)-h(\d+)g(\d+)", name).groups()
            hpc = decode.heads_per_cta(int(heads) // int(groups))
            threads = 32 * hpc
            ctas = decode.Decode(read_copy_format(fmt, arch), int(heads), int(groups)).ctas_per_sm
        assert _fits(st["regs"], threads, ctas), (name, st["regs"], threads, ctas)
        if not name.startswith("flush-fp8"):  # the FP8 flush is not: 8 bytes at 16h/2g on sm_90a
            assert st["stack"] == 0, (name, st["stack"])
    for name in stats:
        if name.endswith("-pdl") and name.startswith("flush"):
            plain = stats[name.removesuffix("-pdl")]
            extra = stats[name]["ops"] - plain["ops"]
            assert sum(extra.values()) == stats[name]["total"] - plain["total"] == 1, (name, extra)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_flush_issues_a_rows_loads_before_its_staging(compiled, arch):
    """Every flush variant issues a flushed row's small loads (dt_j, dt, dt_bias, A, D: the
    4-byte LDG.E; NVFP4, which stages from one source a thread: every load) before its
    first shared store, and no global load after the row's staging barrier: loaded
    later, each was a memory round trip of its own in every flushed row's chain."""
    tool = _sass_stats().default_cuobjdump()
    cubins = [p for p in compiled[arch] if p.suffix == ".cubin" and p.parent.name.startswith("flush")]
    assert len(cubins) == 12
    for cubin in cubins:
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
        bars = [i for i, op in enumerate(ops) if op.startswith("BAR")]
        row = ops[bars[0] + 1 : bars[1]]  # bars[0]: the flag ballot; bars[1]: the staging barrier
        name = cubin.parent.name
        loads = [i for i, op in enumerate(row) if op == "LDG.E" or ("nvfp4" in name and op.startswith("LDG"))]
        stores = [i for i, op in enumerate(row) if op.startswith("STS")]
        assert loads and stores and max(loads) < min(stores), (name, row)
        assert not [op for op in ops[bars[1] :] if op.startswith("LDG")], name


def test_the_hot_paths_structs_are_the_specs():
    """launch.inputs_words (the eager hot path's Inputs struct) and a `launch.Step`'s
    structs (the cache's and the plan's, made once) equal args.raw of the same tensors,
    for engine-shaped and plain inputs."""
    import torch

    from replayssm import layout as L
    from replayssm.kernels.cute import args as A
    from replayssm.kernels.cute import launch
    from replayssm.kernels.cute.read_copy import read_copy_format
    from replayssm.synthetic import engine_inputs, layer_params, plain_inputs, token

    gen = torch.Generator().manual_seed(0)
    params = layer_params(16, generator=gen)
    tok = token(3, 16, 2, generator=gen)
    out = torch.zeros(3, 16, 64, dtype=torch.bfloat16)
    for x, dt, A_, B, C, D, dt_bias in (engine_inputs(tok, params), plain_inputs(tok, params)):
        x, B, C = x.reshape(3, 16, 64), B.reshape(3, 2, 128), C.reshape(3, 2, 128)
        dt, A_, dt_bias = dt.reshape(3, 16, -1)[:, :, 0], A_.reshape(16, -1)[:, 0], dt_bias.reshape(16, -1)[:, 0]
        D = D.reshape(16, -1).expand(16, 64)
        want = A.raw(A.Inputs, x=x, dt=dt, A=A_, B=B, C=C, D=D, dt_bias=dt_bias, out=out)
        got = launch.inputs_words(x, dt, A_, B, C, D, dt_bias, out, x.stride(0), B.stride(0), C.stride(0))
        assert list(got) == want
    from replayssm.reference import Plan

    plan = Plan(*(torch.zeros(3, dtype=d) for d in (torch.bool, torch.int64, torch.int64, torch.bool, torch.int64, torch.int64)))
    for fmt_name in ("fp8", "nvfp4", "fp16"):
        fmt = read_copy_format(fmt_name, "sm_90a")
        cache = L.allocate_cache(5, 16, 2, fmt_name, "cpu", slot_padding=64)
        step = launch.Step(cache, plan, fmt_name, "sm_90a", head_offset=3)
        assert list(step.ckpt) == A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=3)
        assert list(step.ring) == A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING])
        assert list(step.copy) == A.raw(fmt.Args, **fmt.tensors(cache, L))
        if fmt_name == "fp16":  # no read copy: the steps read the checkpoint
            assert list(step.copy) == list(step.ckpt)[:2]
        assert list(step.plan) == A.raw(A.Plan, **plan._asdict())
        assert (step.batch, step.heads, step.groups) == (3, 16, 2)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_every_kernel_compiles_at_head_dim_80_and_state_dim_256(arch, tmp_path):
    """Compile-only, both dims off 64 / 128 at once (the fifth m-tile and four n-chunks in
    the steps, 5 row parts of 4 warps a head in the flush, fold and initialize): every
    kernel builds for each target, the rounding of the checkpoint is `cvt.rs` exactly where
    the target has it, and (from the cubins; cuobjdump has no sm_103a) the registers allow
    the CTAs an SM each kernel is launched with."""
    pytest.importorskip("cutlass")
    import torch

    from replayssm.kernels.cute import bookkeeping, launch, pending
    from replayssm.kernels.cute.config import step_config
    from replayssm.kernels.cute.flush import fold_ctas_per_sm, shape
    from replayssm.kernels.cute.read_copy import read_copy_format

    P, N, hw = 80, 256, arch != "sm_90a"
    sh = shape(P, N)
    tool = _sass_stats().default_cuobjdump() if arch != "sm_103a" else None
    for fmt in ("fp8", "nvfp4"):
        f = read_copy_format(fmt, arch, P, N)
        cfg = step_config(arch, fmt, 16, 2, 256)
        kernels = {
            "decode": (launch.decode_kernel(cfg, P=P, N=N), 32 * 4, f.step_ctas_per_sm),
            "step": (pending.pending_kernel(fmt, arch, 16, 2, torch.bfloat16, "all", P, N), 32 * 4, f.step_ctas_per_sm),
            "flush": (launch.flush_kernel(cfg, P=P, N=N), sh.threads, sh.min_ctas),
            "fold": (pending.fold_kernel(fmt, arch, 16, 2, P=P, N=N), sh.threads, fold_ctas_per_sm(f)),
            "init": (bookkeeping.bookkeeping_kernel(fmt, arch, 8, 1, torch.int32, True, P, N), bookkeeping.THREADS, 1),
        }
        for kind, ((obj, fake), threads, ctas) in kernels.items():
            paths = launch.compile_into(obj, fake, arch, tmp_path / f"{kind}-{fmt}")
            body = open(next(p for p in paths if p.endswith(".ptx"))).read()
            if kind in ("flush", "fold", "init"):
                assert ("cvt.rs.satfinite.f16x2.f32" in body) == hw, (kind, fmt)
            if tool is not None:
                st = _sass_stats().cubin_stats(Path(next(p for p in paths if p.endswith(".cubin"))), tool)
                assert _fits(st["regs"], threads, ctas), (kind, fmt, st["regs"], threads, ctas)


@pytest.mark.parametrize("heads,groups,hpc", [(112, 8, 2), (8, 8, 1)])
def test_small_ctas_keep_sixteen_warps_an_sm(tmp_path, heads, groups, hpc):
    """At 14 heads a group (Nemotron-H 4B: 112 heads, 8 groups) a step CTA holds 2 heads,
    at 1 head a group 1; its launch asks registers for 4 / hpc times the CTAs, so an SM
    still holds 16 warps (sm_90a cubins of the decode and the pending step, FP8 and
    NVFP4: 128 registers a thread)."""
    import torch

    from replayssm.kernels.cute import decode, launch, pending
    from replayssm.kernels.cute.config import step_config

    arch = "sm_90a"
    assert decode.heads_per_cta(heads // groups) == hpc
    tool = _sass_stats().default_cuobjdump()
    for fmt in ("fp8", "nvfp4"):
        cfg = step_config(arch, fmt, heads, groups, 256)
        for kind, (obj, fake) in {
            "decode": launch.decode_kernel(cfg),
            "step": pending.pending_kernel(fmt, arch, heads, groups, torch.bfloat16, "all"),
        }.items():
            assert obj.ctas_per_sm == 16 // hpc, (kind, fmt)
            paths = launch.compile_into(obj, fake, arch, tmp_path / f"{kind}-{fmt}")
            st = _sass_stats().cubin_stats(Path(next(p for p in paths if p.endswith(".cubin"))), tool)
            assert _fits(st["regs"], 32 * hpc, 16 // hpc), (kind, fmt, st["regs"])


def test_the_flush_rounds_its_columns_up_for_fp8_up_to_batch_256(monkeypatch):
    """The column count a step passes the flush (132 SMs): FP8 16h/2g takes 7 columns
    (1.5 x 132 / 32 = 6.19 rounded up) at batch 256 and below, 6 above; NVFP4 (4 CTAs an
    SM: 16.5) and fp16 keep the nearest at every batch."""
    import torch

    from replayssm import layout as L
    from replayssm.kernels.cute import launch
    from replayssm.reference import Plan

    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(launch, "compiled_decode", lambda *a: None)
    monkeypatch.setattr(launch, "compiled_flush", lambda *a: None)
    want = {("fp8", 256): 7, ("fp8", 1): 7, ("fp8", 257): 6, ("fp8", 1024): 6, ("nvfp4", 256): 16, ("nvfp4", 1024): 16,
            ("fp16", 256): 6, ("fp16", 1024): 6}  # fmt: skip
    for (fmt, batch), columns in want.items():
        plan = Plan(*(torch.zeros(batch, dtype=d) for d in (torch.bool, torch.int64, torch.int64, torch.bool, torch.int64, torch.int64)))
        step = launch.Step(L.allocate_cache(2, 16, 2, fmt, "cpu"), plan, fmt, "sm_90a")
        got = launch._kernels.__wrapped__(step.config, torch.bfloat16, True, False, 0, 64, 128, step.round_up)[3]
        assert got == columns, (fmt, batch, got)
