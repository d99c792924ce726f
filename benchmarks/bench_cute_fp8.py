"""Time the FP8 decode step on the CuTe DSL kernels (GPU only): prepare (Triton) +
non-flush + flush (CuTe), through the public API, over whole 16-token periods.

For each batch size, `layers` caches (enough that the read copies touched per step exceed
--target-mb, i.e. several times the L2) are decoded token-major: token t runs through
every layer before token t + 1; the 16 tokens x layers steps are captured in one CUDA
graph and the graph replayed. us/step = replay time / (16 * layers). Rows are
desynchronized (row i starts at ring index i mod 16, so 1/16 of the rows flush each step).
The byte floor is the byte model's period-average bytes (benchmarks/byte_model.py) over
the device-to-device copy bandwidth measured in the same run; "prepare" is the same graph
with the prepare kernel alone (the bookkeeping share); "nonflush" / "flush" are the two
CuTe kernels' GPU times per step from the PyTorch profiler over one eager period.

    python benchmarks/bench_cute_fp8.py                      # 16 heads / 2 groups, batch 1 256 1024
    python benchmarks/bench_cute_fp8.py --batch 64 512 --reps 50
    python benchmarks/bench_cute_fp8.py --ablate     # also: flush overlap on/off x sm_90a e4m3 soft/hw
    REPLAYSSM_FP8_DECODE=mma python benchmarks/bench_cute_fp8.py   # the tensor-core non-flush kernel
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import byte_model as bm  # noqa: E402
from replayssm import layout as L  # noqa: E402
from replayssm.api import initialize_replayssm_state, selective_state_update_replayssm  # noqa: E402
from replayssm.kernels import triton_backend  # noqa: E402
from replayssm.kernels.cute import launch  # noqa: E402
from replayssm.synthetic import layer_params, token  # noqa: E402

RING = 16


def copy_tb_s(gib: float = 1.0) -> float:
    n = int(gib * 2**30) // 4
    src = torch.rand(n, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * 4 * n / statistics.median(times[2:]) / 1e12


def make_layer(batch: int, heads: int, groups: int, padding: int, gen: torch.Generator, sync: bool = False):
    """A cache with `batch` live slots (random states, full random rings) at ring
    positions i mod 16 (`sync`: all at 0, so every row flushes on the same step), the
    slot ids shuffled."""
    cache = L.allocate_cache(batch + 1, heads, groups, "fp8", "cuda", slot_padding=padding)
    ids = (torch.randperm(batch, generator=gen, device="cuda") + 1).to(torch.int32)
    for s in range(0, batch, 256):
        chunk = ids[s : s + 256]
        states = torch.randn(chunk.numel(), heads, L.HEAD_DIM, L.STATE_DIM, generator=gen, device="cuda") * 0.5
        initialize_replayssm_state(cache, states, chunk, state_dtype="fp8", seed=0)
    slots = ids.long()
    rand = dict(generator=gen, device="cuda")
    cache[L.X_RING][slots] = torch.randn(batch, heads, RING, L.HEAD_DIM, **rand).to(torch.bfloat16)
    cache[L.DT_RING][slots] = 0.001 + 0.1 * torch.rand(batch, heads, RING, **rand)
    cache[L.B_RING][slots] = torch.randn(batch, groups, RING, L.STATE_DIM, **rand).to(torch.bfloat16)
    pos = torch.arange(batch, dtype=torch.int32, device="cuda") % RING
    cache[L.POSITIONS][slots] = pos * 0 if sync else pos
    return cache, ids


def graph_us(fn, reps: int) -> float:
    """Median milliseconds of one replay of a graph capturing `fn`, in microseconds."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernel_us(fn, steps: int) -> dict[str, float]:
    """GPU microseconds per step of each kernel family launched by `fn` (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {"prepare": 0.0, "nonflush": 0.0, "flush": 0.0}
    for evt in prof.key_averages():
        name = evt.key.lower()
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        # Non-flush: decode_fp8.py (SIMT) or decode_warp.py's DecodeFp8Warp.
        for tag, keys in (("prepare", ("prepare",)), ("nonflush", ("decode_fp8", "decodefp8warp")), ("flush", ("flush_fp8",))):
            if any(key in name for key in keys):
                out[tag] += total / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256, 1024])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--target-mb", type=float, default=150.0, help="read-copy bytes touched per step across layers")
    ap.add_argument("--max-layers", type=int, default=8)
    ap.add_argument("--slot-padding", type=int, default=128)
    ap.add_argument("--ablate", action="store_true", help="time flush overlap on/off x sm_90a e4m3 soft/hw too")
    ap.add_argument("--sync", action="store_true", help="synchronized rows: all flush on the same step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cute_fp8 needs a CUDA GPU")
    H, G = args.heads, args.groups
    backend = triton_backend()
    p = layer_params(H, generator=torch.Generator().manual_seed(0), device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    tb_s = copy_tb_s()
    per_row = bm.replay_period_average(bm.Shape(H, G), "fp8").total
    rows = "synchronized" if args.sync else "desynchronized"
    print(f"# {torch.cuda.get_device_name()}  heads={H} groups={G} {rows}  copy {tb_s:.2f} TB/s  "
          f"model {per_row} B/row/step (period average)")
    print(f"{'batch':>6}{'layers':>7}{'us/step':>10}{'prepare':>9}{'nonflush':>10}{'flush':>8}{'floor us':>10}{'GB/s':>8}{'of copy':>9}")
    for batch in args.batch:
        rc_bytes = batch * H * L.HEAD_DIM * L.STATE_DIM
        layers = max(1, min(args.max_layers, math.ceil(args.target_mb * 1e6 / rc_bytes)))
        built = [make_layer(batch, H, G, args.slot_padding, gen, args.sync) for _ in range(layers)]
        assert backend.cute_for(built[0][0]) is not None, "the CuTe decode kernels must run here"
        cpu_gen = torch.Generator().manual_seed(batch)
        toks = [token(batch, H, G, generator=cpu_gen, device="cuda") for _ in range(RING)]
        outs = [torch.empty(batch, H, L.HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        scratch = backend.scratch("cuda", batch)

        def period():
            for t in toks:
                for (cache, ids), out in zip(built, outs):
                    selective_state_update_replayssm(
                        cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, ids, out, state_dtype="fp8", seed=0
                    )

        def prepare_only():
            for _ in toks:
                for (cache, ids), out in zip(built, outs):
                    backend.prepare(cache, ids, out, nvfp4=False, seed=0, scratch=scratch)

        steps = RING * layers
        us = graph_us(period, args.reps) / steps
        prep = graph_us(prepare_only, args.reps) / steps
        per_kernel = kernel_us(period, steps)
        nbytes = per_row * batch
        floor = nbytes / (tb_s * 1e12) * 1e6
        gbs = nbytes / (us * 1e-6) / 1e9
        print(
            f"{batch:>6}{layers:>7}{us:>10.2f}{prep:>9.2f}{per_kernel['nonflush']:>10.2f}{per_kernel['flush']:>8.2f}"
            f"{floor:>10.2f}{gbs:>8.0f}{gbs / (tb_s * 1e3):>9.0%}"
        )
        if args.ablate:
            default_overlap, default_e4m3 = launch.OVERLAP, os.environ.get(launch.SM90_E4M3_ENV)
            cells = []
            for overlap in (True, False):
                for e4m3 in ("soft", "hw"):
                    launch.OVERLAP = overlap
                    os.environ[launch.SM90_E4M3_ENV] = e4m3
                    t = graph_us(period, args.reps) / steps
                    k = kernel_us(period, steps)
                    cells.append(f"overlap={int(overlap)} e4m3={e4m3}: {t:.2f} (flush {k['flush']:.2f})")
            launch.OVERLAP = default_overlap
            if default_e4m3 is None:
                os.environ.pop(launch.SM90_E4M3_ENV, None)
            else:
                os.environ[launch.SM90_E4M3_ENV] = default_e4m3
            print("        ablation us/step: " + " | ".join(cells))
        del built, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
