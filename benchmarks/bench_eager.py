"""Eager calls, host and GPU time per call (GPU only): what a caller without CUDA graphs
(Hugging Face `generate`, prefill/decode mixing, notebooks) pays per layer and token.

For each format and batch: `ReplaySSMCache.decode` (out given) called `--calls` times in
a row on the same inputs, shaped as an engine passes them (`--inputs engine`, the
default) or plain; host us a call = the time for the calls to return (launches are
asynchronous; the GPU queue never fills at these counts), GPU us a call = CUDA events
around the same calls. Beside it, in the same run, the standard decode's eager call
(benchmarks/standard_decode.py: one Triton kernel, fp32 and bf16 state), and
`prefill_init` / `release` of a few slots.

    python benchmarks/bench_eager.py                       # 16 heads / 2 groups, batch 1 and 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from replayssm import ReplaySSMCache  # noqa: E402
from replayssm.synthetic import engine_inputs, layer_params, plain_inputs, prefill_states, token  # noqa: E402


def timed(fn, calls: int) -> tuple[float, float]:
    """(host us a call, GPU us a call) of `calls` back-to-back calls of `fn`."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) * 1e3 / calls


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--inputs", default="engine", choices=["engine", "plain"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_eager needs a CUDA GPU")
    from benchmarks.standard_decode import standard_decode

    H, G = args.heads, args.groups
    gen = torch.Generator().manual_seed(0)
    params = layer_params(H, generator=gen, device="cuda")
    rows = []
    print(f"# {torch.cuda.get_device_name()}  heads={H} groups={G}  {args.inputs} inputs, {args.calls} calls")
    print(f"{'call':34}{'batch':>6}{'host us':>10}{'GPU us':>10}")
    for batch in args.batch:
        tok = token(batch, H, G, generator=gen, device="cuda")
        inputs = engine_inputs(tok, params) if args.inputs == "engine" else plain_inputs(tok, params)
        states = prefill_states(params, batch, G, 4, generator=gen, device="cuda")
        out = torch.empty(batch, H, 64, dtype=torch.bfloat16, device="cuda")
        for fmt in ("fp8", "nvfp4"):
            cache = ReplaySSMCache(batch + 1, H, G, fmt, "cuda", backend="kernels")
            cache.warmup()
            slots = cache.allocate(batch)
            cache.prefill_init(states, slots)
            host, gpu = timed(lambda: cache.decode(*inputs, slots, out=out), args.calls)
            rows.append({"call": f"replayssm {fmt} decode", "batch": batch, "host_us": host, "gpu_us": gpu})
            few = slots[: min(4, batch)]
            host_i, gpu_i = timed(lambda: cache.prefill_init(states[: few.numel()], few), max(10, args.calls // 10))
            rows.append({"call": f"replayssm {fmt} prefill_init({few.numel()})", "batch": few.numel(), "host_us": host_i, "gpu_us": gpu_i})

            t0 = time.perf_counter()
            for _ in range(max(10, args.calls // 10)):
                cache.release(few)
                few = cache.allocate(few.numel())
            torch.cuda.synchronize()
            host_r = (time.perf_counter() - t0) / max(10, args.calls // 10) * 1e6
            rows.append({"call": f"replayssm {fmt} release+allocate({few.numel()})", "batch": few.numel(), "host_us": host_r, "gpu_us": float("nan")})
        x, dt, A, B, C, D, dt_bias = plain_inputs(tok, params)
        ids = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            state = torch.zeros(batch + 1, H, 64, 128, dtype=dtype, device="cuda")
            host, gpu = timed(lambda: standard_decode(state, x, dt, A, B, C, D, dt_bias, ids, out), args.calls)
            rows.append({"call": f"standard decode {str(dtype)[6:]} state", "batch": batch, "host_us": host, "gpu_us": gpu})
    for r in rows:
        print(f"{r['call']:34}{r['batch']:>6}{r['host_us']:>10.1f}{r['gpu_us']:>10.1f}")
    return rows


if __name__ == "__main__":
    main()
