"""Every tolerance and accuracy floor the tests use, each with the reason for its value.

Bit-exact comparisons (quantizers, the random hash, rings, positions, the checkpoint and
read copy against the reference quantizers) need no constant and are not here. SQNR
floors are in dB against the exact FP64 recurrence (`replayssm.synthetic`); "row max"
means the largest |value| of the row compared. Measured values quoted below come from the
tests' own data on the PyTorch reference unless a GPU is named.
"""

from __future__ import annotations

# -- Output accuracy against the exact recurrence (SQNR, dB) ----------------------------

# Long decodes (576 steps, 36 flushes; the demo's 48 steps; the cache's 40): 9 dB under the
# 42.0 / 31.1 dB that benchmarks/format_choices.py measures over 512 steps (format.md §8);
# fp16 9 dB under the 55.6 dB of tests/test_fp16_format.py.
OUTPUT_SQNR_FLOOR_DB = {"fp8": 33.0, "nvfp4": 22.0, "fp16": 46.5}
# One row over a few periods: the read copy's element SQNR is ~31.5 dB (e4m3) / ~20.4 dB
# (NVFP4) on Gaussian states, and outputs add the exact ring replay; ~1.5 dB below that.
ROW_SQNR_FLOOR_DB = {"fp8": 30.0, "nvfp4": 19.0}
# One row of one step (64 x heads values) spreads more than a few periods' average: its
# floor is ROW_SQNR_FLOOR_DB minus this.
ONE_STEP_ROW_SLACK_DB = 6.0
# No drift: the last 128 of 576 steps may be this much worse than the first 128
# (the stochastic-rounding noise of 36 flushes).
DRIFT_DB = 1.0
# A materialized FP32 state against the exact one: the FP16 checkpoint's 11 significant
# bits (stochastically rounded) bound its error (01_quickstart measures 69.3 dB).
STATE_SQNR_FLOOR_DB = 60.0

# -- Notebooks (examples/; measured value in each comment) ------------------------------

# 01_quickstart, per-token output over 320 tokens: fp8 mean 43.3 / min 35.0 dB, nvfp4
# 33.1 / 23.9 dB; 2-3 dB of margin for other seeds and torch builds.
QUICKSTART_SQNR_FLOOR_DB = {"fp8": {"mean": 41.0, "min": 32.0}, "nvfp4": {"mean": 31.0, "min": 21.0}}
# 01_quickstart, the flush steps' outputs (from the unrounded FP32 state): 55.6 dB.
QUICKSTART_FLUSH_SQNR_FLOOR_DB = 52.0
# 01_quickstart, last period's mean against the whole run's (measured within 0.5 dB).
QUICKSTART_DRIFT_DB = 2.5
# 02_mamba2_model (head dim 80, state dim 128, 16 heads in 2 groups), 400 predictions,
# (top-1 match, max |logit difference|, layer-0 SQNR dB): the committed run (weight seed 0)
# fp8 0.99 / 0.198 / 47.5, nvfp4 0.96 / 0.926 / 40.0, bf16 state 0.99 / 0.092 / 50.4; over
# weight seeds 0-7 fp8 >= 0.9775 / <= 0.518 / >= 44.8, nvfp4 >= 0.9325 / <= 1.52 / >= 35.3,
# bf16 state >= 0.9675 / <= 0.575 / >= 44.9. Margins to the worst seed: 2.9-3.8 dB of
# SQNR, 0.028-0.053 of top-1 match, 1.7-2.6x the logit difference.
MODEL_NOTEBOOK_BOUNDS = {
    "replayssm fp8": (0.95, 1.0, 41.0),
    "replayssm nvfp4": (0.88, 4.0, 32.0),
    "BF16 state (standard decode)": (0.93, 1.0, 42.0),
}
# 02_mamba2_model, the harness's own fp32 update against transformers': measured 8.1e-6
# (seed 0), at most 1.1e-5 over seeds 0-7; FP32 rounding, far under any SSM update's effect.
MODEL_HARNESS_LOGIT_DIFF = 1e-3
# 03_scheduler, worst per-token SQNR of any request (fp8; measured 32.2 dB).
SCHEDULER_SQNR_FLOOR_DB = 28.0

# -- Kernels against the reference on the same device ----------------------------------

# Decode outputs (CuTe and Triton paths), in bf16 ulps of the row max: both sides compute
# in FP32 from the same quantized data and differ in summation order only (~1e-6
# relative), which can move an element's final bf16 rounding by one ulp.
KERNEL_OUTPUT_BF16_ULPS = 2.0
# The flush's FP32 state (debug dump) against the reference fold, relative to the state
# row's max: the tf32 hi / lo split is exact to ~2**-21 a term, 16 terms and the decay.
FOLD_REL_TOL = 1e-5

# -- The standard-decode baseline (tests/test_standard_decode.py) -----------------------

# FP32 state against the exact recurrence: exp / log1p differ from torch's by a few FP32
# ulps of the terms before they cancel: slack relative to the state's max.
STANDARD_FP32_STATE_SLACK_REL = 4e-7
# Outputs: FP32 summation order of the 128 products, relative to the state's max.
STANDARD_OUTPUT_SLACK_REL = 1e-5
# Outputs within this many bf16 ulps of the exact recurrence (one rounding each side).
STANDARD_EXACT_OUTPUT_ULPS = 1.5
# The kernel's SQNR may trail its PyTorch twin's by this much (interpreter casts truncate).
STANDARD_SQNR_SLACK_DB = 3.0
# The twin's own bf16-state SQNR over 8 steps (a regression floor for the twin).
STANDARD_BF16_STATE_SQNR_FLOOR_DB = 40.0
# FP32 state against the twin (CPU / GPU): FP32 noise of exp, log1p and summation order.
STANDARD_FP32_RTOL, STANDARD_FP32_ATOL = 2e-6, 1e-6
STANDARD_FP32_RTOL_GPU = 1e-5
# 16-bit states on the GPU: one ulp where both round one FP32 value differently, plus
# FP32 noise (~2**-23 of terms bounded by the state scale) where the update cancels.
STANDARD_16BIT_SLACK_REL = 2.0**-19
# ... and at most this fraction of elements may differ at all (the rare boundary cases).
STANDARD_16BIT_DIFF_FRACTION = 1e-3
# Large-dt case: absolute slack on outputs of magnitude ~1-10 (FP32 summation order).
STANDARD_LARGE_DT_OUTPUT_SLACK = 1e-4

# -- Quantizers (derived bounds; the encoders themselves are bit-exact) ------------------

# Mean of n stochastic roundings: within this many standard errors of the value, plus the
# bias of truncating the random bits.
STOCHASTIC_MEAN_SIGMAS = 5
# e4m3 nearest rounding of normal values: half an ulp, 2**-4 of the value.
E4M3_REL_HALF_ULP = 2.0**-4
# e4m3 subnormal codes: half the smallest step (2**-9), times the row scale.
E4M3_SUBNORMAL_ABS = 2.0**-10
# NVFP4: one e2m1 step of the block, widened by this for the block scale's e4m3 rounding.
NVFP4_BLOCK_SCALE_ROUNDING = 2.0**-3

# -- Outputs computed in FP32 and stored in bf16 ------------------------------------------

# One bf16 rounding is at most 2**-8 of the value; twice that covers an FP32 result
# rounded once on each side.
BF16_OUTPUT_RTOL = 2.0**-7
# Absolute floor for outputs near zero (FP32 summation noise of ~1-magnitude terms).
BF16_OUTPUT_ATOL = 1e-3

# -- Benchmarks (tests/test_benchmarks.py) ------------------------------------------------

# The benchmark's built-in correctness checks, output against the PyTorch twin: one bf16
# ulp of the largest output (BF16_OUTPUT_RTOL of it) plus BF16_OUTPUT_ATOL.
# A step whose working set is beyond the L2 cannot move the byte model's bytes faster than
# the DRAM: HBM3e's 4.8 TB/s peak is 1.12x the copy bandwidth an H200 measures
# (4.25-4.28 TB/s); the standard decode reaches 0.91 at best.
MAX_FRACTION_OF_COPY_BANDWIDTH = 1.15
# ReplaySSM at batch 64, 16h/2g, against the fp32-state decode in the same run: the byte
# model gives the fp32 state 5.4x FP8's and 7.9x NVFP4's bytes; FP8 measured 1.4x faster at
# batch 32 and 2.4x at 128 on an H200, so at 64 it must at least not be slower.
MIN_SPEEDUP_VS_FP32_BATCH64 = 1.0

# -- The speculative baseline (tests/test_spec_baseline.py) -------------------------------

# Kernel against its PyTorch twin: the twin uses the kernel's formulas and order, but the
# interpreter's exp / log (numpy) and torch's differ by an FP32 ulp on a few inputs, which
# moves a stored bf16 state element by one ulp where its FP32 value lies near a rounding
# boundary (measured: 15 of 98,304 elements). One ulp everywhere, and at most this fraction
# of elements differing at all.
SPEC_16BIT_DIFF_FRACTION = 1e-3
# The twin's accepted stream (bf16 state, 24 calls of T = 4, drafts accepted with p = 0.7)
# against the exact FP64 recurrence: state SQNR measured 44.7-49.9 dB, accepted outputs
# 52.9-55.4 dB over four seeds; the state floor is the standard decode's bf16 floor.
SPEC_BF16_STATE_SQNR_FLOOR_DB = 40.0
SPEC_OUTPUT_SQNR_FLOOR_DB = 48.0
# Processed dt written to the ring by the pending-mode kernels against the reference:
# FP32 log1p(exp(v)) (log1p by Goldberg's identity) against FP64 rounded once, a few
# FP32 ulps (2**-23 each) apart.
DT_RING_REL_TOL = 2.0**-20
