"""Tensor-parallel decode: each rank holds the cache of its share of a layer's heads.

    torchrun --nproc-per-node 2 examples/tp_decode.py            # CPU, gloo
    torchrun --nproc-per-node 2 examples/tp_decode.py --device cuda   # one GPU a rank, NCCL

A 16-head, 2-group layer split over the ranks by heads (groups split with them): rank k
builds `ReplaySSMCache(..., num_heads=16 // N, head_offset=k * 16 // N)`, prefills and
decodes its heads' share of every token, and the ranks gather their outputs. Rank 0 then
runs the unsharded layer in one cache and compares (exit code 1 on a mismatch):
- after prefill, every shard's cache bytes equal the unsharded cache's share (the
  checkpoint's random bits follow the model's head: `head_offset`);
- on a GPU (the kernels, computed per row and head), the gathered outputs and every
  shard's bytes after all steps equal the unsharded run bit for bit;
- on the CPU (the PyTorch reference, whose vectorized exp / log1p and matrix products
  round by tensor layout in the last FP32 bit), the outputs within 2 bf16 ulps of each
  row's largest value.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from replayssm import ReplaySSMCache
from replayssm import layout as L
from replayssm.synthetic import layer_params, prefill_states, token

HEADS, GROUPS, BATCH, STEPS, SEED = 16, 2, 3, 40, 11


def shard_tensors(cache: ReplaySSMCache, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's share (heads, or groups for the B ring and NVFP4 meta) of an unsharded
    cache's per-slot tensors."""
    out = []
    for i, t in enumerate(cache.tensors[1:], 1):
        if t.dim() >= 2 and t.shape[1] in (HEADS, GROUPS) and i != len(cache.tensors) - 1 and not (cache.state_dtype == "nvfp4" and i == L.PARITY):
            n = t.shape[1] // world
            out.append(t[:, rank * n : (rank + 1) * n])
        else:
            out.append(t)
    return out


def run(fmt: str, device: str, rank: int, world: int) -> bool:
    h, g = HEADS // world, GROUPS // world
    gen = torch.Generator().manual_seed(0)
    params = layer_params(HEADS, generator=gen, device=device)
    states = prefill_states(params, BATCH, GROUPS, 8, generator=gen, device=device)
    toks = [token(BATCH, HEADS, GROUPS, generator=gen, device=device) for _ in range(STEPS)]
    hs, gs = slice(rank * h, (rank + 1) * h), slice(rank * g, (rank + 1) * g)
    shard = ReplaySSMCache(BATCH + 1, h, g, fmt, device, seed=SEED, backend="reference" if device == "cpu" else "auto", head_offset=rank * h)
    slots = shard.allocate(BATCH)
    shard.prefill_init(states[:, hs].contiguous(), slots)
    after_init = gather_bytes(shard, world)
    outs = []
    for t in toks:
        y = shard.decode(t.x[:, hs], t.dt[:, hs], params.A[hs], t.B[:, gs], t.C[:, gs], params.D[hs], params.dt_bias[hs], slots)
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous())
        outs.append(torch.cat(parts, dim=1))
    after_steps = gather_bytes(shard, world)
    if rank != 0:
        return True
    full = ReplaySSMCache(BATCH + 1, HEADS, GROUPS, fmt, device, seed=SEED, backend="reference" if device == "cpu" else "auto")
    fslots = full.allocate(BATCH)
    full.prefill_init(states, fslots)
    ok = same_bytes(fmt, "after prefill", after_init, full, world)
    exact = device != "cpu"
    worst = 0.0
    for step, t in enumerate(toks):
        y = full.decode(t.x, t.dt, params.A, t.B, t.C, params.D, params.dt_bias, fslots).float()
        got = outs[step].float()
        ulp = torch.exp2(torch.floor(torch.log2(y.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-120))) - 7)
        worst = max(worst, float(((got - y).abs() / ulp).amax()))
        if exact and not torch.equal(got, y):
            print(f"{fmt}: step {step}: gathered outputs differ from the unsharded layer")
            ok = False
    if exact:
        ok &= same_bytes(fmt, f"after {STEPS} steps", after_steps, full, world)
    elif worst > 2.0:
        print(f"{fmt}: outputs differ by {worst:.2f} bf16 ulps of the row max")
        ok = False
    print(f"{fmt}: {world} shards x {h} heads, {STEPS} steps: {'bit for bit' if exact else f'outputs within {worst:.2f} bf16 ulps'}"
          f" of one {HEADS}-head cache; prefill bytes equal: {ok}")
    return ok


def gather_bytes(cache: ReplaySSMCache, world: int) -> list[list[torch.Tensor]]:
    """Every rank's per-slot tensors as bytes (gloo has no float8), gathered."""
    out = []
    for t in cache.tensors[1:]:
        b = t.contiguous().view(torch.uint8)
        parts = [torch.empty_like(b) for _ in range(world)]
        dist.all_gather(parts, b)
        out.append(parts)
    return out


def same_bytes(fmt: str, when: str, gathered, full: ReplaySSMCache, world: int) -> bool:
    ok = True
    for r in range(world):
        for i, (mine, ref) in enumerate(zip((p[r] for p in gathered), shard_tensors(full, r, world)), 1):
            if not torch.equal(mine, ref.contiguous().view(torch.uint8)):
                print(f"{fmt}: {when}: rank {r}: cache[{i}] differs from the unsharded cache's share")
                ok = False
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GROUPS % world:
        raise SystemExit(f"the {GROUPS} groups must split over the {world} ranks")
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{rank % torch.cuda.device_count()}"
    ok = all([run(fmt, device, rank, world) for fmt in ("fp8", "nvfp4")])
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if int(flag) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
