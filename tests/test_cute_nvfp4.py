"""NVFP4 CuTe DSL decode kernels: bit-exact CPU twins, compile-only checks for every
target, and (GPU) the kernels against the PyTorch reference.

CPU:
- the software e2m1 encoder / decoders and the block-scale steps the kernels trace
  (kernels/cute/bits_nvfp4.py) run here, as the very same Python source, on numpy uint32 /
  float32 arrays, and must give quant/minifloat.py's and quant/formats.py's bits;
- compile-only for sm_90a, sm_100a, sm_103a: PTX and cubin produced; the e2m1 `cvt`
  instructions on sm_100a / sm_103a and none on sm_90a; the block reciprocal an IEEE
  `rcp.rn.f32` / `div.rn.f32`, never an approximate one; one atomic max per flushed row.
GPU (@pytest.mark.gpu), see the section header below.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from replayssm import layout as L
from replayssm.quant import formats as Q
from replayssm.quant.minifloat import E2M1, E4M3, decode_e2m1, decode_e4m3, encode

from .gpu_harness import DEVICE, MANY_LIVE, MANY_SLOTS, NAN, World, check_graph_replays_whole_periods, check_warmup, ulp_bf16
from .helpers import same_bits

HAS_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')")

ARCHS = ("sm_90a", "sm_100a", "sm_103a")


def _bn():
    from replayssm.kernels.cute import bits_nvfp4

    return bits_nvfp4


def _u32(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int32).numpy().view(np.uint32)


def _all_fp16_and_random(n: int = 100_000, seed: int = 0) -> torch.Tensor:
    """Every fp16 value as fp32, random fp32 bit patterns (all exponents, NaN, Inf,
    subnormals) and random values near the e2m1 range, plus the rounding boundaries."""
    g = torch.Generator().manual_seed(seed)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    near = torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 6, (n,), generator=g).float())
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 2.0**-149, 2.0**-126, -0.0])
    edges = torch.cat([edges, -edges, torch.nextafter(edges, torch.zeros(1)), torch.nextafter(edges, torch.full((1,), 9.0))])
    return torch.cat([every, bits, near, edges])


# ---------------------------------------------------------------------------------------
# CPU twins (the kernels' own routines on numpy)


@pytest.mark.parametrize("name", ["e2m1_code", "e2m1_code_rn"])
def test_e2m1_nearest_twin_is_bit_exact(name):
    """Both nearest encoders (the integer one, and the one-addition one the sm_90a flush
    uses) against the reference: every FP16 value, random FP32, and every 37th FP32 bit
    pattern of [0.125, 18) with both signs (all e2m1 ties and binade edges)."""
    bn = _bn()
    band = torch.arange(0x3E000000, 0x41900000, 37, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([_all_fp16_and_random(), band, -band])
    got = getattr(bn, name)(_u32(x), bn.NUMPY_OPS)
    want = (encode(x, E2M1) & 0xF).numpy().astype(np.uint32)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first x={x[bad[0]].item()!r}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"


def test_e2m1_stochastic_twin_is_bit_exact():
    bn = _bn()
    x = _all_fp16_and_random(seed=1)
    g = torch.Generator().manual_seed(2)
    rbits = torch.randint(0, 2**32, x.shape, generator=g, dtype=torch.int64)
    got = bn.e2m1_code(_u32(x), bn.NUMPY_OPS, rbits=rbits.numpy().astype(np.uint32))
    want = (encode(x, E2M1, rbits) & 0xF).numpy().astype(np.uint32)
    assert np.array_equal(got, want)


def test_e2m1_known_codes_and_nibble_order():
    bn = _bn()
    # Known encodings: value -> code (sign in bit 3), ties to even, satfinite, NaN -> +6.
    table = [(0.0, 0x0), (0.25, 0x0), (0.3, 0x1), (0.5, 0x1), (0.75, 0x2), (1.0, 0x2), (1.25, 0x2),
             (1.5, 0x3), (1.75, 0x4), (2.5, 0x4), (3.0, 0x5), (3.5, 0x6), (5.0, 0x6), (5.5, 0x7), (1e9, 0x7),
             (-1.0, 0xA), (-6.0, 0xF), (-0.0, 0x8), (float("inf"), 0x7), (float("-inf"), 0xF), (float("nan"), 0x7)]
    x = torch.tensor([v for v, _ in table], dtype=torch.float32)
    assert bn.e2m1_code(_u32(x), bn.NUMPY_OPS).tolist() == [c for _, c in table]
    # Packing: element k in nibble k (byte j: element 2j low, 2j + 1 high).
    vals = [np.float32(v) for v in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5)]
    word = bn.e2m1x8_rn_soft_words(vals, bn.NUMPY_OPS)
    assert int(word) == 0x97654321
    packed, _ = Q.nvfp4_encode(torch.tensor(vals * 16).reshape(1, 1, 128).expand(1, 64, 128).contiguous(), torch.tensor(6.0 * 448 / 16))
    # bytes of the word (little-endian) = the reference's first 4 packed bytes (scale 1/1 here)
    assert packed[0, 0, :4].tolist() == [0x21, 0x43, 0x65, 0x97]


def test_e2m1_software_decode_is_exact():
    """All 2**16 half-words: the four f16x2 words of the sm_90a decode, times
    SOFT_DECODE_FACTOR, are the e2m1 values in SOFT_DECODE_ORDER."""
    bn = _bn()
    half = np.arange(65536, dtype=np.uint32)
    w = half | (half[::-1] << np.uint32(16))
    words = bn.e2m1x8_f16x2_soft(w, bn.NUMPY_OPS)
    halves = [np.stack([(x & 0xFFFF).astype(np.uint16), (x >> 16).astype(np.uint16)], -1) for x in words]
    vals = np.concatenate(halves, axis=1).view(np.float16).astype(np.float32) * np.float32(bn.SOFT_DECODE_FACTOR)
    nibbles = torch.from_numpy(((w[:, None] >> (4 * np.arange(8, dtype=np.uint32))[None, :]) & 0xF).astype(np.int64))
    want = decode_e2m1(nibbles).numpy()[:, list(bn.SOFT_DECODE_ORDER)]
    assert np.array_equal(vals.view(np.uint32), want.view(np.uint32))


def test_e4m3_value_is_exact():
    bn = _bn()
    codes = np.arange(256, dtype=np.uint32)
    got = bn.e4m3_value(codes, bn.NUMPY_OPS)
    want = decode_e4m3(torch.from_numpy(codes.astype(np.int64))).numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == 2
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _twin_encode(state: torch.Tensor, amax_live: torch.Tensor):
    """formats.nvfp4_encode through the flush kernel's own steps (numpy): block amax from
    the bits, block_scale_input, the e4m3 encode (minifloat, whose DSL twin the FP8
    flush uses), block_recip, e2m1 codes packed 8 to a word."""
    bn = _bn()
    ops = bn.NUMPY_OPS
    n = state.shape[0]
    g = Q.nvfp4_global_scale(amax_live).numpy().reshape(n, 1, 1)
    ig = Q.nvfp4_inv_global_scale(amax_live).numpy().reshape(n, 1, 1)
    blocks = state.numpy().reshape(n, 64, 8, 16)
    bamax = (blocks.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(-1).view(np.float32)
    t = bn.block_scale_input(bamax, ig, ops)
    s = encode(torch.from_numpy(np.ascontiguousarray(t)), E4M3).numpy().astype(np.uint32)
    r = bn.block_recip(s, g, ops)
    scaled = (blocks * r[..., None]).reshape(n, 64, 16, 8)
    words = bn.e2m1x8_rn_soft_words([scaled[..., k] for k in range(8)], ops)
    packed = np.ascontiguousarray(words).view(np.uint8).reshape(n, 64, 64)
    return packed, s.astype(np.uint8)


def test_block_pipeline_twin_matches_nvfp4_encode():
    """Random states (rows from 2**-20 to 2**20, zero blocks, subnormals) under live
    amaxes that are exact, 64x too small (block scales saturate), 64x too large (e4m3
    subnormal scales) and zero."""
    g = torch.Generator().manual_seed(3)
    n = 8
    state = torch.randn(n, 64, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 64, 1), generator=g).float())
    state[0, :4, :16] = 0.0
    state[1, 5, :] = torch.randn(128, generator=g) * 2.0**-140
    amax = state.abs().amax(dim=(1, 2))
    for live in (amax, amax / 64, amax * 64, torch.zeros_like(amax)):
        codes, scales = Q.nvfp4_encode(state, live)
        got_codes, got_scales = _twin_encode(state, live)
        assert np.array_equal(got_codes, codes.numpy())
        assert np.array_equal(got_scales, scales.view(torch.uint8).numpy())


# ---------------------------------------------------------------------------------------
# Compile-only (no GPU)

ROWS_FLUSH = 2  # flush_nvfp4.ROWS: state rows per flush thread (16 values, a whole block, each)
ROWS_DECODE = 4  # decode_nvfp4.ROWS


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from replayssm.kernels.cute import launch_nvfp4

    return {
        arch: [Path(p) for p in launch_nvfp4.compile_variants(arch, tmp_path_factory.mktemp(arch), ((16, 2), (16, 1)))]
        for arch in ARCHS
    }


def _ptx(paths, kind):
    return {p.parent.name: p.read_text() for p in paths if p.suffix == ".ptx" and p.parent.name.startswith(kind)}


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(compiled, arch):
    paths = compiled[arch]
    folders = {p.parent.name for p in paths}
    assert folders == {
        "decode_nvfp4-h16g2", "decode_nvfp4-h16g1", "flush_nvfp4-h16g2", "flush_nvfp4-h16g1",
        "decode_nvfp4-h16g2-pdl", "decode_nvfp4-h16g1-pdl", "flush_nvfp4-h16g2-pdl", "flush_nvfp4-h16g1-pdl",
    }
    for folder in folders:
        assert sorted(p.suffix for p in paths if p.parent.name == folder) == [".cubin", ".ptx"], folder
    for name, text in _ptx(paths, "").items():
        assert re.search(rf"^\.target {arch}\b", text, re.M), name
        assert ".entry kernel_" in text, name


def _decode_ptx(compiled, simt_pdl_ptx, arch):
    """The non-flush kernels' PTX: compile_all's (the warp kernel, plain and PDL) and the
    SIMT kernel's PDL variant ($REPLAYSSM_PDL_KERNEL=simt), with whether it is SIMT."""
    warp = _ptx(compiled[arch], "decode")
    simt = {k: v for k, v in simt_pdl_ptx[arch].items() if k.startswith("decode_nvfp4")}
    assert len(warp) == 4 and len(simt) == 2
    return [(name, text, False) for name, text in warp.items()] + [(name, text, True) for name, text in simt.items()]


@needs_dsl
@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_sm100_uses_hardware_e2m1_conversions(compiled, simt_pdl_ptx, arch):
    for name, text, simt in _decode_ptx(compiled, simt_pdl_ptx, arch):
        # Two codes per cvt. SIMT kernel: 4 rows x 16 codes per thread; warp-per-head
        # kernel: 8 rows x 32 codes per lane.
        assert text.count("cvt.rn.f16x2.e2m1x2") == (ROWS_DECODE * 8 if simt else 8 * 16), name
        assert "cvt.rs" not in text, name
        # The warp kernel's block scales: one e4m3 pair (two blocks of a row) per row.
        assert text.count("cvt.rn.f16x2.e4m3x2") == (0 if simt else 8), name
    for name, text in _ptx(compiled[arch], "flush").items():
        # Per row: 16 values = 8 e2m1x2 conversions and 8 FP16 pairs.
        assert text.count("cvt.rn.satfinite.e2m1x2.f32") == ROWS_FLUSH * 8, name
        assert text.count("cvt.rs.satfinite.f16x2.f32") == ROWS_FLUSH * 8, name
        assert text.count("cvt.rn.satfinite.e4m3x2.f32") == 1, name  # both rows' block scales
        assert "cvt.rs.satfinite.e2m1" not in text, name  # the read copy is rounded to nearest


@needs_dsl
def test_sm90_is_software(compiled, simt_pdl_ptx):
    for name, text in _ptx(compiled["sm_90a"], "").items():
        assert "e2m1" not in text, name
        assert "cvt.rs" not in text, name
    for name, text, simt in _decode_ptx(compiled, simt_pdl_ptx, "sm_90a"):
        assert "e2m1" not in text and "cvt.rs" not in text, name
        # The codes are moved to e4m3 codes and converted two at a time
        # (bits_nvfp4.e2m1x8_f16x2_soft): SIMT 4 rows x 16 codes per thread; the warp
        # kernel 8 rows x 32 codes per lane, plus one pair of block scales per row.
        assert text.count("cvt.rn.f16x2.e4m3x2") == (ROWS_DECODE * 8 if simt else 8 * 16 + 8), name
    from replayssm.kernels.cute.launch import sm90_e4m3

    for name, text in _ptx(compiled["sm_90a"], "flush").items():
        # The block scales' e4m3 encode: one cvt pair for both rows' scales by default
        # (as sm_100a), integer steps with $REPLAYSSM_SM90_E4M3=soft.
        assert text.count("cvt.rn.satfinite.e4m3x2.f32") == (1 if sm90_e4m3() == "hw" else 0), name
        # The checkpoint's rounding (bits.fp16x2_sr_voted): per row one warp vote, the
        # normal-range path's 8 truncating pair conversions and the general path's 8.
        assert text.count("vote.sync.all.pred") == ROWS_FLUSH, name
        assert text.count("cvt.rz.f16x2.f32") == 2 * ROWS_FLUSH * 8, name
        # The read copy's e2m1 codes (bits_nvfp4.e2m1_code_rn): one rounding add.rn a
        # value, 16 values per state row of a thread.
        assert text.count("add.rn.f32") == ROWS_FLUSH * 16, name


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
def test_flush_reciprocal_is_ieee_and_amax_is_one_atomic(compiled, simt_pdl_ptx, arch):
    for name, text in _ptx(compiled[arch], "flush").items():
        ieee = len(re.findall(r"\b(rcp|div)\.rn\.f32\b", text))
        assert ieee == ROWS_FLUSH, (name, ieee)
        assert not re.search(r"\b(div|rcp)\.(approx|full)", text), name
        assert len(re.findall(r"\b(atom|red)(\.\w+)*\.global(\.\w+)*\.max\.s32\b", text)) == 1, name
        # Per row a lane's 16 codes (a whole block) are one 8-byte store, the block scale
        # one byte.
        assert text.count("st.global.v2.b32") == ROWS_FLUSH, name
        assert text.count("st.global.b8") == ROWS_FLUSH, name
        assert text.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 32, name  # the FP8 flush's fold
    for name, text, simt in _decode_ptx(compiled, simt_pdl_ptx, arch):
        assert not re.search(r"\b(atom|red)\.", text), name  # the non-flush kernel writes no meta
        if simt:  # 8 bytes of codes per row and thread
            assert "ld.global.v2.b32" in text and "mma.sync" not in text, name
        else:
            # Warp per (row, head), per lane: 16 bytes of codes for each of 8 rows, C in
            # 2 x 32 bytes, this warp's quarter of two ring entries of B (16 bytes each),
            # 4 ring entries of x (the codes with the streaming operator,
            # launch_nvfp4.NVFP4_READ_HINT); 4 m-tiles x 8 k-steps of f16 MMAs,
            # 2 + 4 bf16 MMAs (its quarter of B_j . C, the ring replay); one barrier (the
            # partial sums).
            streamed = 0 if name.endswith("-pdl") else 8  # the PDL variant (batch 1) loads plainly
            assert text.count("ld.global.cs.v4.b32") == streamed and text.count("ld.global.v4.b32") == 8 - streamed + 4 + 2 + 4, name
            assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 32, name
            assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 6, name
            assert text.count("bar.sync") == 1, name
            # Row dots by block: the block scales multiply FP32 accumulators, no f16 A value;
            # 2 butterfly shuffles for max |C|, 6 for the quad sum of the blocks.
            assert "mul.rn.f16x2" not in text and text.count("shfl.sync.bfly") == 8, name


# ---------------------------------------------------------------------------------------
# GPU: the kernels against the reference
#
# A NaN-poisoned, slot-padded NVFP4 cache; live slots at mixed ring positions with padding
# rows between them (slot 0, negative, >= S); some slots start with a live amax that is
# 64x too small (block scales saturate at the first flush), 64x too large (e4m3 subnormal
# block scales) or zero. Every step starts the reference from a copy of the kernels' cache.
# Per step:
# - outputs within 2 bf16 ulps of the row max of the reference (same quantized inputs,
#   FP32 sums in another order);
# - positions, rings and parity bit-exact with the reference; meta bit-exact except the
#   accumulator half of flushed slots, which must be the group amax of the kernel's own
#   FP32 state S (debug output), bit for bit;
# - flushed slots: S within FP32 noise of the reference fold; checkpoint =
#   to_fp16(S, checkpoint_rbits) and NVFP4 copy = formats.nvfp4_encode(S, A_live) bit for
#   bit; everything else untouched, the bytes between slot tensors included.

def _step(w: World, out, state):
    """prepare (Triton) + both NVFP4 CuTe kernels with the S dump; returns the inputs and plan."""
    from replayssm.kernels import triton_backend
    from replayssm.kernels.cute import launch_nvfp4

    tok = w.token()
    x, dt, A, B, C, D, dt_bias = w.inputs(tok)
    out.fill_(NAN)
    state.fill_(NAN)
    plan = triton_backend().prepare(w.cache, w.ids, out, nvfp4=True, seed=w.seed)
    launch_nvfp4.decode_nvfp4(w.cache, x, dt, A, B, C, D, dt_bias, plan, out, state_out=state)
    return (x, dt, A, B, C, D, dt_bias), plan


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize(
    "heads,groups,sync",
    [
        pytest.param(16, 2, False, id="nvfp4-h16-g2-mixed"),
        pytest.param(16, 1, False, id="nvfp4-h16-g1-mixed"),
        pytest.param(16, 2, True, id="nvfp4-h16-g2-sync"),
        pytest.param(64, 4, False, id="nvfp4-h64-g4-mixed"),
        # A batch of 45 rows: three CTA rows of the flush kernel, the last one partial.
        pytest.param(16, 2, "many", id="nvfp4-h16-g2-many-rows"),
        # The flush grid cut to 2 CTA columns: a CTA flushes row groups 0 and 2 in turn.
        pytest.param(16, 2, "many-2col", id="nvfp4-h16-g2-many-rows-2-columns"),
        pytest.param(16, 2, "one", id="nvfp4-h16-g2-one-row"),  # batch 1: PDL launch (warp kernel)
        pytest.param(16, 2, "one-simt", id="nvfp4-h16-g2-one-row-simt-pdl"),  # the SIMT kernel with PDL
        # One slot's state spans 10**-12 .. 1 (FP16-subnormal checkpoint values): the
        # sm_90a flush's general rounding path (bits.fp16x2_sr_voted), beside the normal one.
        pytest.param(16, 2, "wide", id="nvfp4-h16-g2-wide-range"),
        # The SIMT non-flush kernel at every batch ($REPLAYSSM_NVFP4_DECODE=simt; the
        # default is the warp-per-head kernel).
        pytest.param(16, 2, "simt", id="nvfp4-h16-g2-mixed-simt-decode"),
        # The flush without PDL on the side stream ($REPLAYSSM_FLUSH_PDL=0; the default
        # launches it with PDL behind prepare above batch 1, launch.flush_pdl_for).
        pytest.param(16, 2, "noflushpdl", id="nvfp4-h16-g2-mixed-flush-without-pdl"),
        # sm_90a: the block scales' software e4m3 encode ($REPLAYSSM_SM90_E4M3=soft)
        # instead of the e4m3x2 cvt, in the normal and the wide range.
        pytest.param(16, 2, "soft", id="nvfp4-h16-g2-mixed-soft-e4m3"),
        pytest.param(16, 2, "wide-soft", id="nvfp4-h16-g2-wide-range-soft-e4m3"),
    ],
)
def test_kernels_match_reference_over_three_periods(heads, groups, sync, monkeypatch):
    from replayssm import reference as ref
    from replayssm.quant.minifloat import to_fp16
    from replayssm.quant.rng import checkpoint_rbits

    from replayssm.kernels.cute import launch, launch_nvfp4

    for env in (launch.PDL_ENV, launch.FLUSH_PDL_ENV):
        monkeypatch.delenv(env, raising=False)
    flush_pdl = sync != "noflushpdl"
    if sync == "noflushpdl":
        monkeypatch.setenv(launch.FLUSH_PDL_ENV, "0")
        sync = False
    if sync == "simt":
        monkeypatch.setenv(launch_nvfp4.NVFP4_DECODE_ENV, "simt")
    if sync in ("soft", "wide-soft"):
        monkeypatch.setenv(launch.SM90_E4M3_ENV, "soft")
        sync = "wide" if sync == "wide-soft" else False
    if sync == "one-simt":
        monkeypatch.setenv(launch.PDL_KERNEL_ENV, "simt")
        sync = "one"
    if sync == "many-2col":
        monkeypatch.setattr(launch, "flush_grid_columns", lambda *args: 2)
        sync = "many"
    many = {"live": MANY_LIVE, "num_slots": MANY_SLOTS} if sync == "many" else {"live": (5,)} if sync == "one" else {}
    w = World("nvfp4", heads, groups, sync=sync is True, wide=sync == "wide", **many)
    if sync == "one":  # the PDL launch is what this case is for
        assert w.batch == 1 and launch.pdl_for(w.batch)
    assert launch.flush_pdl_for(w.batch) is (flush_pdl and w.batch > 1)  # the PDL flush above batch 1
    cache, H, P, N = w.cache, heads, 64, 128
    hpg = H // groups
    out = torch.empty(w.batch, H, P, dtype=torch.bfloat16, device=DEVICE)
    state = torch.empty(w.batch, H, P, N, dtype=torch.float32, device=DEVICE)
    flushed, worst = 0, 0.0
    for step in range(48):
        before = [t.clone() for t in cache]
        (x, dt, A, B, C, D, dt_bias), plan = _step(w, out, state)
        expect = [t.clone() for t in before]
        out_ref = torch.full_like(out, NAN)
        ref.decode(expect, x, dt, A, B, C, D, dt_bias, w.ids, out_ref, nvfp4=True, seed=w.seed)
        torch.cuda.synchronize()

        valid = ref.valid_rows(w.ids.long(), cache[1].shape[0])
        assert bool((out[~valid] == 0).all()), f"step {step}: padding rows must be zero"
        y, yr = out[valid].float(), out_ref[valid].float()
        assert not bool(torch.isnan(y).any()), f"step {step}: NaN in outputs"
        ratio = float(((y - yr).abs() / ulp_bf16(yr.abs().amax(dim=-1, keepdim=True))).amax())
        worst = max(worst, ratio)
        assert ratio <= 2.0, f"step {step}: output differs by {ratio:.2f} bf16 ulps of the row max"
        for i in (L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS, L.PARITY):
            assert same_bits(cache[i], expect[i]), f"step {step}: cache[{i}] differs from the reference"

        fl = plan.flush.clone()
        slots = plan.slot[fl]
        old = plan.old_parity[fl]
        untouched = torch.ones(cache[1].shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        for i in (L.CHECKPOINT, L.READ_COPY, L.SCALES, L.META):
            assert same_bits(cache[i][untouched], before[i][untouched]), f"step {step}: cache[{i}] of a non-flushing slot changed"
        if slots.numel():
            flushed += slots.numel()
            S = state[fl]
            dts = ref.softplus_dt(dt[fl], dt_bias.view(1, -1))
            S_ref = ref.fold(before, slots, x[fl], dts, B[fl], A, plan.ring_index[fl])
            scale = S_ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            assert float(((S - S_ref).abs() / scale).amax()) < 1e-5, f"step {step}: FP32 state differs"
            assert same_bits(cache[L.CHECKPOINT][slots], to_fp16(S, checkpoint_rbits(plan.key[fl], H))), f"step {step}: checkpoint"
            meta_b = before[L.META][slots]  # prepare leaves the live half (1 - old) as it was
            live_amax = meta_b.gather(2, (1 - old).view(-1, 1, 1).expand(-1, groups, 1)).squeeze(-1)
            codes, bscales = Q.nvfp4_encode(S, live_amax.repeat_interleave(hpg, dim=1))
            assert same_bits(cache[L.READ_COPY][slots], codes), f"step {step}: NVFP4 codes differ from nvfp4_encode(S)"
            assert same_bits(cache[L.SCALES][slots], bscales), f"step {step}: block scales differ from nvfp4_encode(S)"
            meta = cache[L.META][slots]
            measured = S.abs().reshape(S.shape[0], groups, -1).amax(dim=-1)
            acc = meta.gather(2, old.view(-1, 1, 1).expand(-1, groups, 1)).squeeze(-1)
            kept = meta.gather(2, (1 - old).view(-1, 1, 1).expand(-1, groups, 1)).squeeze(-1)
            assert same_bits(acc, measured), f"step {step}: meta[old] is not the group amax of S"
            assert same_bits(kept, live_amax), f"step {step}: the live half of meta changed"
        assert w.gaps_untouched(), f"step {step}: bytes between slot tensors were written"
    live = int(valid.sum())
    assert flushed == 3 * live, (flushed, live)
    print(f"[nvfp4 {heads}h/{groups}g sync={sync}] 48 steps, {flushed} row flushes, worst {worst:.2f} bf16 ulps")


@pytest.mark.gpu
@needs_dsl
def test_runs_are_bit_identical_with_many_ctas_per_group():
    """64 heads in 4 groups (16 CTAs race on each group's amax atomic): two runs from the
    same start give identical bits everywhere (outputs, checkpoint, copy, meta)."""
    runs = []
    for _ in range(2):
        w = World("nvfp4", 64, 4, seed=5)
        out = torch.empty(w.batch, 64, 64, dtype=torch.bfloat16, device=DEVICE)
        state = torch.empty(w.batch, 64, 64, 128, dtype=torch.float32, device=DEVICE)
        outs = []
        for _ in range(32):
            _step(w, out, state)
            outs.append(out.clone())
        torch.cuda.synchronize()
        runs.append((outs, [t.clone() for t in w.cache]))
    (o1, c1), (o2, c2) = runs
    for s, (a, b) in enumerate(zip(o1, o2)):
        assert same_bits(a, b), f"step {s}: outputs differ between runs"
    for i, (a, b) in enumerate(zip(c1, c2)):
        assert same_bits(a, b), f"cache[{i}] differs between runs"


@pytest.mark.gpu
@needs_dsl
def test_cuda_graph_replays_whole_periods():
    check_graph_replays_whole_periods("nvfp4")


@pytest.mark.gpu
@needs_dsl
def test_cuda_graph_replays_whole_periods_with_the_flush_without_pdl(monkeypatch):
    """$REPLAYSSM_FLUSH_PDL=0: the flush on the side stream (the default captures the
    flush's PDL launch behind prepare)."""
    from replayssm.kernels.cute import launch

    monkeypatch.setenv(launch.FLUSH_PDL_ENV, "0")
    check_graph_replays_whole_periods("nvfp4")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("pdl_kernel", ["simt", "warp"])
def test_cuda_graph_replays_whole_periods_at_batch_1(monkeypatch, pdl_kernel):
    """Batch 1: the non-flush kernel with programmatic dependent launch, captured."""
    from replayssm.kernels.cute import launch

    monkeypatch.delenv(launch.PDL_ENV, raising=False)
    monkeypatch.setenv(launch.PDL_KERNEL_ENV, pdl_kernel)
    assert launch.pdl_for(1)
    check_graph_replays_whole_periods("nvfp4", live=(5,))


@pytest.mark.gpu
@needs_dsl
def test_warmup_compiles_and_launches_both_kernels_without_changing_the_cache(monkeypatch):
    from replayssm.kernels.cute import launch

    monkeypatch.delenv(launch.PDL_ENV, raising=False)  # the PDL variant is expected too
    check_warmup("nvfp4")
