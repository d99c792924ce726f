"""Heads-a-group ratios beyond 8 and 16: the served models' geometries with head dim 64
and state dim 128 (Nemotron-H 4B: 112 heads in 8 groups, Granite 4.0-H Tiny: 48 heads in
one group) and their tensor-parallel-8 shards (14 and 6 heads in one group), plus the
bounds of the ratio (1 and 128). Output SQNR against the exact FP64 recurrence at or
above each format's floor, single-token and pending mode (T = 4, drafts accepted with p
0.7): on the CPU through the reference and the Triton interpreter (bookkeeping), on the
GPU through the kernels (tests/test_cute_decode_gpu.py and test_pending_kernels.py hold
the same geometries against the reference step by step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.accuracy import pending, single

from . import tolerances as tol

MODELS = [(112, 8), (14, 1), (48, 1), (6, 1)]
BOUNDS = [(8, 8), (128, 1)]
FORMATS = ["fp8", "nvfp4", "fp16"]


def _args(**kw):
    return SimpleNamespace(**{"tokens": 48, "batch": 2, "T": 4, "accept": 0.7, "seed": 3, "backend": "auto", **kw})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,groups", [(14, 1), (6, 1), (8, 8)])
def test_accuracy_at_new_ratios_cpu(fmt, heads, groups):
    args = _args(backend="reference")
    for run in (single, pending):
        r = run(fmt, heads, groups, args, torch.device("cpu"))
        assert r["all"] >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], (run.__name__, r)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,groups", MODELS + BOUNDS)
def test_accuracy_at_model_geometries_gpu(fmt, heads, groups):
    pytest.importorskip("cutlass")
    args = _args(tokens=96, batch=8, backend="kernels")
    for run in (single, pending):
        r = run(fmt, heads, groups, args, torch.device("cuda"))
        assert r["all"] >= tol.OUTPUT_SQNR_FLOOR_DB[fmt], (run.__name__, r)
        print(f"[{fmt} {heads}h/{groups}g {run.__name__}] {r['all']:.2f} dB")
