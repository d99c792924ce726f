"""Time the bookkeeping kernels (GPU only): the CuTe initialize (one launch; NVFP4 reads
each group's states twice, for its amax and to encode them), clear and prepare kernels, at
batch 256 and 1024 (all rows live, unique slots).

Each kernel is captured `--reps` times in one CUDA graph and the graph replayed; the time
per call is the replay time over `--reps`, measured with CUDA events (so launch overhead
is excluded); "eager" is the same number of plain calls. Bytes are the DRAM bytes the
kernel must move at the least; GB/s = bytes / graph time.

    python benchmarks/bench_bookkeeping.py                 # H=64, G=8
    python benchmarks/bench_bookkeeping.py --heads 16 --groups 2 --batch 256 1024
"""

from __future__ import annotations

import argparse

import torch

from replayssm import layout as L
from replayssm.kernels import kernel_backend
from replayssm.kernels.buffers import PlanScratch
from replayssm.formats import FP8, NVFP4


def time_ms(fn, reps: int, graph: bool) -> float:
    """Milliseconds per call of `fn`, from `reps` calls in a CUDA graph (or eager)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
            for _ in range(reps):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = g.replay
    else:

        def run():
            for _ in range(reps):
                fn()

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--slot-padding", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_bookkeeping needs a CUDA GPU")
    H, G = args.heads, args.groups
    P, N = L.HEAD_DIM, L.STATE_DIM
    print(f"# {torch.cuda.get_device_name()}  heads={H} groups={G} reps={args.reps}")
    print(f"{'kernel':<12}{'format':<8}{'batch':>6}{'graph us':>11}{'eager us':>11}{'MB':>9}{'GB/s':>9}")
    for fmt in ("fp8", "nvfp4"):
        nvfp4 = fmt == "nvfp4"
        for batch in args.batch:
            slots = batch + 1
            cache = L.allocate_cache(slots, H, G, fmt, "cuda", slot_padding=args.slot_padding)
            ids = torch.randperm(batch, device="cuda").to(torch.int32) + 1
            states = torch.randn(batch, H, P, N, device="cuda")
            out = torch.empty(batch, H, P, dtype=torch.bfloat16, device="cuda")
            scratch = PlanScratch(batch, "cuda")
            ring_bytes = sum(t[0].numel() * t.element_size() for t in cache[2:5]) + 4
            read_bytes = H * P * (N // 2 + N // 16) if nvfp4 else H * P * (N + 4)
            init_bytes = batch * (H * P * N * (4 + 2) + read_bytes + ring_bytes)
            if nvfp4:
                init_bytes += batch * H * P * N * 4  # the group-amax pass reads the states once more
            cases = [
                ("initialize", lambda: kernel_backend().initialize(cache, states, ids, fmt=(NVFP4 if nvfp4 else FP8), seed=1), init_bytes),
                ("clear", lambda: kernel_backend().clear(cache, ids), batch * ring_bytes),
                (
                    "prepare",
                    lambda: kernel_backend().prepare(cache, ids, out, fmt=(NVFP4 if nvfp4 else FP8), seed=1, scratch=scratch),
                    batch * (4 + 4 + 8 * 4 + 2),
                ),
            ]
            for name, fn, nbytes in cases:
                g_ms = time_ms(fn, args.reps, graph=True)
                e_ms = time_ms(fn, args.reps, graph=False)
                print(
                    f"{name:<12}{fmt:<8}{batch:>6}{g_ms * 1e3:>11.1f}{e_ms * 1e3:>11.1f}"
                    f"{nbytes / 1e6:>9.1f}{nbytes / (g_ms * 1e-3) / 1e9:>9.0f}"
                )
            del cache, states


if __name__ == "__main__":
    main()
