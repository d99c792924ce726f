"""The NVFP4 bit routines the CuTe DSL kernels trace, run on the CPU (numpy twins).

The software e2m1 encoder / decoder and the block-scale steps (kernels/cute/bits_nvfp4.py)
are written once against a tiny `ops` namespace; here the very same Python source runs on
numpy uint32 / float32 arrays and must give quant/minifloat.py's and quant/formats.py's
bits. The compile-only checks are in test_cute_compile.py, the GPU checks in
test_cute_decode_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayssm.quant import formats as Q
from replayssm.quant.minifloat import E2M1, E4M3, decode_e2m1, decode_e4m3, encode


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


def test_e2m1_nearest_twin_is_bit_exact():
    """The one-addition nearest encoder the sm_90a flush uses against the reference: every
    FP16 value, random FP32, and every 37th FP32 bit pattern of [0.125, 18) with both
    signs (all e2m1 ties and binade edges)."""
    bn = _bn()
    band = torch.arange(0x3E000000, 0x41900000, 37, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([_all_fp16_and_random(), band, -band])
    got = bn.e2m1_code_rn(_u32(x), bn.NUMPY_OPS)
    want = (encode(x, E2M1) & 0xF).numpy().astype(np.uint32)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first x={x[bad[0]].item()!r}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"


def test_e2m1_known_codes_and_nibble_order():
    bn = _bn()
    # Known encodings: value -> code (sign in bit 3), ties to even, satfinite, NaN -> +6.
    table = [(0.0, 0x0), (0.25, 0x0), (0.3, 0x1), (0.5, 0x1), (0.75, 0x2), (1.0, 0x2), (1.25, 0x2),
             (1.5, 0x3), (1.75, 0x4), (2.5, 0x4), (3.0, 0x5), (3.5, 0x6), (5.0, 0x6), (5.5, 0x7), (1e9, 0x7),
             (-1.0, 0xA), (-6.0, 0xF), (-0.0, 0x8), (float("inf"), 0x7), (float("-inf"), 0xF), (float("nan"), 0x7)]
    x = torch.tensor([v for v, _ in table], dtype=torch.float32)
    assert bn.e2m1_code_rn(_u32(x), bn.NUMPY_OPS).tolist() == [c for _, c in table]
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
