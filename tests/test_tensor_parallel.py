"""Tensor-parallel shards: a layer's heads split over N caches (`head_offset`), groups
split with them, hold the bytes one unsharded cache holds. The checkpoint's random bits
follow the model's head (quant/rng.py checkpoint_rbits), so N shards round the same FP32
state to the same FP16 checkpoint.

On the CPU the PyTorch reference's vectorized exp / log1p and matrix products round by
tensor layout in the last FP32 bit, so whole decodes are compared within bf16 rounding
there, and bit for bit on the GPU (the kernels compute per row and head)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayssm import ReplaySSMCache
from replayssm import layout as L
from replayssm.quant.rng import checkpoint_rbits, stream_key
from replayssm.synthetic import layer_params, prefill_states, token

from . import tolerances as tol
from .helpers import same_bits

ROOT = Path(__file__).resolve().parent.parent
HEADS, GROUPS, BATCH = 16, 2, 3


def _share(cache: ReplaySSMCache, i: int, k: int, world: int) -> torch.Tensor:
    """Shard k's part of the unsharded cache's tensor i (heads, or groups for the B ring
    and NVFP4 meta; the whole tensor for per-slot scalars)."""
    t = cache.tensors[i]
    if i == len(cache.tensors) - 1 or (cache.state_dtype == "nvfp4" and i == L.PARITY):  # positions, parity
        return t
    n = t.shape[1] // world
    return t[:, k * n : (k + 1) * n]


def _caches(fmt, device, backend, world=2):
    full = ReplaySSMCache(BATCH + 1, HEADS, GROUPS, fmt, device, seed=11, backend=backend)
    shards = [
        ReplaySSMCache(BATCH + 1, HEADS // world, GROUPS // world, fmt, device, seed=11, backend=backend, head_offset=k * HEADS // world)
        for k in range(world)
    ]
    return full, shards


def test_checkpoint_bits_follow_the_models_head():
    key = stream_key(3, torch.tensor([5, 9]), torch.tensor([15, 31]))
    full = checkpoint_rbits(key, 16)
    assert torch.equal(checkpoint_rbits(key, 8, 8), full[:, 8:])
    assert torch.equal(checkpoint_rbits(key, 8), full[:, :8])
    assert not torch.equal(checkpoint_rbits(key, 8), full[:, 8:])


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_shards_hold_the_unsharded_bytes_after_prefill(fmt, backend):
    """After prefill every per-slot tensor of each shard equals the unsharded cache's
    share bit for bit (both backends; the kernels' initialize in the interpreter). Without
    head_offset the second shard's checkpoint differs."""
    full, shards = _caches(fmt, "cpu", backend)
    gen = torch.Generator().manual_seed(0)
    params = layer_params(HEADS, generator=gen)
    states = prefill_states(params, BATCH, GROUPS, 8, generator=gen)
    full.prefill_init(states, full.allocate(BATCH))
    for k, shard in enumerate(shards):
        shard.prefill_init(states[:, 8 * k : 8 * (k + 1)].contiguous(), shard.allocate(BATCH))
        for i in range(1, len(full.tensors)):
            assert same_bits(shard.tensors[i], _share(full, i, k, 2)), (k, i)
    plain = ReplaySSMCache(BATCH + 1, 8, 1, fmt, "cpu", seed=11, backend=backend)
    plain.prefill_init(states[:, 8:].contiguous(), plain.allocate(BATCH))
    assert not same_bits(plain.tensors[L.CHECKPOINT], _share(full, L.CHECKPOINT, 1, 2))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_sharded_decode_tracks_the_unsharded_one_on_the_cpu(fmt):
    """40 steps (two flushes a row), the reference: the gathered outputs within 2 bf16
    ulps of each row's max of the unsharded layer's (the reference's last-bit rounding
    depends on tensor layout on the CPU)."""
    full, shards = _caches(fmt, "cpu", "reference")
    gen = torch.Generator().manual_seed(1)
    params = layer_params(HEADS, generator=gen)
    states = prefill_states(params, BATCH, GROUPS, 8, generator=gen)
    fs = full.allocate(BATCH)
    full.prefill_init(states, fs)
    ss = [s.allocate(BATCH) for s in shards]
    for k, s in enumerate(shards):
        s.prefill_init(states[:, 8 * k : 8 * (k + 1)].contiguous(), ss[k])
    for _ in range(40):
        t = token(BATCH, HEADS, GROUPS, generator=gen)
        y = full.decode(t.x, t.dt, params.A, t.B, t.C, params.D, params.dt_bias, fs).float()
        parts = []
        for k, s in enumerate(shards):
            h, g = slice(8 * k, 8 * (k + 1)), slice(k, k + 1)
            parts.append(s.decode(t.x[:, h], t.dt[:, h], params.A[h], t.B[:, g], t.C[:, g], params.D[h], params.dt_bias[h], ss[k]))
        got = torch.cat(parts, dim=1).float()
        ulp = torch.exp2(torch.floor(torch.log2(y.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-120))) - 7)
        assert float(((got - y).abs() / ulp).amax()) <= tol.KERNEL_OUTPUT_BF16_ULPS


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (pip install -e '.[cute]')")
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_sharded_decode_is_bit_identical_on_the_gpu(fmt):
    full, shards = _caches(fmt, "cuda", "kernels")
    gen = torch.Generator().manual_seed(1)
    params = layer_params(HEADS, generator=gen, device="cuda")
    states = prefill_states(params, BATCH, GROUPS, 8, generator=gen, device="cuda")
    fs = full.allocate(BATCH)
    full.prefill_init(states, fs)
    ss = [s.allocate(BATCH) for s in shards]
    for k, s in enumerate(shards):
        s.prefill_init(states[:, 8 * k : 8 * (k + 1)].contiguous(), ss[k])
    for step in range(40):
        t = token(BATCH, HEADS, GROUPS, generator=gen, device="cuda")
        y = full.decode(t.x, t.dt, params.A, t.B, t.C, params.D, params.dt_bias, fs)
        parts = []
        for k, s in enumerate(shards):
            h, g = slice(8 * k, 8 * (k + 1)), slice(k, k + 1)
            parts.append(s.decode(t.x[:, h], t.dt[:, h], params.A[h], t.B[:, g], t.C[:, g], params.D[h], params.dt_bias[h], ss[k]))
        assert same_bits(torch.cat(parts, dim=1), y), step
    for k, s in enumerate(shards):
        for i in range(1, len(full.tensors)):
            assert same_bits(s.tensors[i], _share(full, i, k, 2)), (k, i)


def test_torchrun_example_with_two_cpu_ranks():
    """examples/tp_decode.py under `torchrun --nproc-per-node 2` (gloo): two processes,
    each its heads, gathered and compared with one process's unsharded layer."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517", str(ROOT / "examples" / "tp_decode.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for fmt in ("fp8", "nvfp4"):
        assert f"{fmt}: 2 shards x 8 heads, 40 steps" in res.stdout and "prefill bytes equal: True" in res.stdout, res.stdout
