"""Time the decode step on the CuTe DSL kernels (GPU only), both formats in the same run:
prepare + non-flush + flush (CuTe), through the public API, over whole 16-token
periods, with each kernel's own time beside the step's.

Per batch size, enough
layers that the read copies touched per step exceed --target-mb, decoded token-major; the
16 tokens x layers steps captured in one CUDA graph; us/step = replay time / (16 * layers);
rows desynchronized (row i starts at ring index i mod 16). The floor is the byte model's
period-average bytes over the copy bandwidth measured in the same run. "nonflush" /
"flush" are the two CuTe kernels' GPU times per step (profiler, one eager period).

    python benchmarks/bench_kernels.py                 # 16 heads / 2 groups, batch 1 256 1024
    python benchmarks/bench_kernels.py --formats nvfp4 --batch 64 512

The "nonflush" / "flush" columns come from eager steps, where the host's launch gaps keep
the two kernels apart: they are standalone times, not the share of a captured step.
docs/design.md has the step's design and the project benchmark's numbers
(benchmarks/bench_decode.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import byte_model as bm  # noqa: E402
from benchmarks.common import copy_bandwidth, replay_seconds  # noqa: E402
from replayssm import layout as L  # noqa: E402
from replayssm.api import initialize_replayssm_state, selective_state_update_replayssm  # noqa: E402
from replayssm.kernels import kernel_backend  # noqa: E402
from replayssm.synthetic import layer_params, token  # noqa: E402

RING = 16


def graph_us(fn, reps: int) -> float:
    """Median microseconds of one replay of a CUDA graph capturing `fn`."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    return replay_seconds(g, reps) * 1e6


def make_layer(fmt: str, batch: int, heads: int, groups: int, padding: int, gen: torch.Generator, device: str = "cuda", P: int = L.HEAD_DIM, N: int = L.STATE_DIM):
    """A `fmt` cache (head dim `P`, state dim `N`) with `batch` live slots (random states,
    full random rings) at ring positions i mod 16, the slot ids shuffled (`gen` a
    generator on `device`)."""
    cache = L.allocate_cache(batch + 1, heads, groups, fmt, device, slot_padding=padding, head_dim=P, state_dim=N)
    ids = (torch.randperm(batch, generator=gen, device=device) + 1).to(torch.int32)
    for s in range(0, batch, 256):
        chunk = ids[s : s + 256]
        states = torch.randn(chunk.numel(), heads, P, N, generator=gen, device=device) * 0.5
        initialize_replayssm_state(cache, states, chunk, state_dtype=fmt, seed=0)
    slots = ids.long()
    rand = dict(generator=gen, device=device)
    cache[L.X_RING][slots] = torch.randn(batch, heads, RING, P, **rand).to(torch.bfloat16)
    cache[L.DT_RING][slots] = 0.001 + 0.1 * torch.rand(batch, heads, RING, **rand)
    cache[L.B_RING][slots] = torch.randn(batch, groups, RING, N, **rand).to(torch.bfloat16)
    cache[L.POSITIONS][slots] = torch.arange(batch, dtype=torch.int32, device=device) % RING
    return cache, ids


def kernel_us(fn, steps: int, fmt: str) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {"nonflush": 0.0, "flush": 0.0}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        name = evt.key.lower()
        # The CuTe DSL names a kernel after its module and class: kernels/cute/decode.py's
        # Decode, kernels/cute/flush.py's Flush.
        for tag, key in (("nonflush", "cutedecodedecode"), ("flush", "cuteflushflush")):
            if key in name:
                out[tag] += total / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256, 1024])
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "fp8"], choices=["nvfp4", "fp8"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--target-mb", type=float, default=100.0, help="read-copy bytes touched per step across layers")
    ap.add_argument("--max-layers", type=int, default=8)
    ap.add_argument("--slot-padding", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    H, G = args.heads, args.groups
    backend = kernel_backend()
    p = layer_params(H, generator=torch.Generator().manual_seed(0), device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    tb_s = copy_bandwidth("cuda", 1.0)["tb_per_s"]
    print(f"# {torch.cuda.get_device_name()}  heads={H} groups={G}  copy {tb_s:.2f} TB/s")
    print(f"{'fmt':>6}{'batch':>6}{'layers':>7}{'us/step':>9}{'nonflush':>9}{'flush':>7}{'floor':>7}{'GB/s':>7}{'of copy':>8}")
    for fmt in args.formats:
        per_row = bm.replay_period_average(bm.Shape(H, G), fmt).total
        rc_row = H * L.HEAD_DIM * L.STATE_DIM // (2 if fmt == "nvfp4" else 1)
        for batch in args.batch:
            layers = max(1, min(args.max_layers, math.ceil(args.target_mb * 1e6 / (batch * rc_row))))
            built = [make_layer(fmt, batch, H, G, args.slot_padding, gen) for _ in range(layers)]
            assert backend.cute_for(built[0][0]) is not None, "the CuTe decode kernels must run here"
            cpu_gen = torch.Generator().manual_seed(batch)
            toks = [token(batch, H, G, generator=cpu_gen, device="cuda") for _ in range(RING)]
            outs = [torch.empty(batch, H, L.HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]

            def period():
                for t in toks:
                    for (cache, ids), out in zip(built, outs):
                        selective_state_update_replayssm(
                            cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, ids, out, state_dtype=fmt, seed=0
                        )

            steps = RING * layers
            us = graph_us(period, args.reps) / steps
            k = kernel_us(period, steps, fmt)
            nbytes = per_row * batch
            floor = nbytes / (tb_s * 1e12) * 1e6
            gbs = nbytes / (us * 1e-6) / 1e9
            print(f"{fmt:>6}{batch:>6}{layers:>7}{us:>9.2f}{k['nonflush']:>9.2f}{k['flush']:>7.2f}{floor:>7.2f}"
                  f"{gbs:>7.0f}{gbs / (tb_s * 1e3):>8.0%}")
            del built, outs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
