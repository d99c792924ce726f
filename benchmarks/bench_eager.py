"""Eager calls, host and GPU time per call (GPU only): what a caller without CUDA graphs
(Hugging Face `generate`, prefill/decode mixing, notebooks) pays per layer and token.

For each format and batch: `ReplaySSMCache.decode` (out given) on the same inputs, shaped
as an engine passes them (`--inputs engine`, the default) or plain. Host us a call = the
median time for one call to return, each call started with the GPU idle (the host's own
cost); b2b us = wall time a call of `--calls` calls in a row until the GPU has run them;
GPU us = CUDA events around those calls; with `--rounds N` every call is measured N times,
the calls interleaved, and the medians reported. Beside it, in the same run, the standard decode's eager call
(benchmarks/standard_decode.py: one Triton kernel, fp32 and bf16 state), `prefill_init` /
`release` of a few slots (`release` timed with the `allocate` that refills the ids, and
`allocate` alone with a host-only return of its ids), and a pending-mode call (4 tokens a
row, speculative decoding). `--out FILE` writes the rows and the run's meta as JSON.

    python benchmarks/bench_eager.py                       # 16 heads / 2 groups, batch 1 and 256
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from replayssm import ReplaySSMCache  # noqa: E402
from replayssm.synthetic import engine_inputs, layer_params, plain_inputs, prefill_states, token  # noqa: E402

from benchmarks.common import commit, version, write_json  # noqa: E402


def timed(fn, calls: int) -> tuple[float, float, float]:
    """(host us, back-to-back us, GPU us) a call of `fn`: host = the median time for one
    call to return, each call started with the GPU idle (the host's own cost, whatever the
    GPU queue holds); back-to-back = wall time a call of `calls` calls in a row until the
    GPU finishes them; GPU = CUDA events around those calls."""
    fn()
    torch.cuda.synchronize()
    alone = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        alone.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e6
    return statistics.median(alone) * 1e6, wall, a.elapsed_time(b) * 1e3 / calls


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=_positive, default=1,
                    help="measure every call this many times, the calls interleaved; report the medians (the lent hosts drift)")
    ap.add_argument("--inputs", default="engine", choices=["engine", "plain"])
    ap.add_argument("--out", default=None, help="JSON file for the rows and the run's meta (default: print only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_eager needs a CUDA GPU")
    from benchmarks.standard_decode import standard_decode

    H, G = args.heads, args.groups
    gen = torch.Generator().manual_seed(0)
    params = layer_params(H, generator=gen, device="cuda")
    calls: list[tuple[str, int, object, int]] = []  # (call, batch, fn, calls timed)
    keep = []  # what the calls use, alive until the end
    for batch in args.batch:
        tok = token(batch, H, G, generator=gen, device="cuda")
        inputs = engine_inputs(tok, params) if args.inputs == "engine" else plain_inputs(tok, params)
        states = prefill_states(params, batch, G, 4, generator=gen, device="cuda")
        out = torch.empty(batch, H, 64, dtype=torch.bfloat16, device="cuda")
        for fmt in ("fp8", "nvfp4"):
            cache = ReplaySSMCache(batch + 9, H, G, fmt, "cuda", backend="kernels")  # room for allocate(4) beside the held ids
            cache.warmup()
            slots = cache.allocate(batch)
            cache.prefill_init(states, slots)
            calls.append((f"replayssm {fmt} decode", batch, lambda c=cache, s=slots, i=inputs, o=out: c.decode(*i, s, out=o), args.calls))
            held = [cache.allocate(min(4, batch))]  # a request admitted: ids as `allocate` returns them
            n = held[0].numel()
            calls.append((f"replayssm {fmt} prefill_init({n})", n, lambda c=cache, h=held, st=states[:n]: c.prefill_init(st, h[0]),
                          max(10, args.calls // 10)))  # fmt: skip

            def cycle(c=cache, held=held, n=n):
                c.release(held[0])
                held[0] = c.allocate(n)

            calls.append((f"replayssm {fmt} release+allocate({n})", n, cycle, max(10, args.calls // 10)))

            def allocate_only(c=cache, n=n):  # the ids back to the pool on the host, no kernel
                c.allocator.release(c._host_ids(c.allocate(n)))

            calls.append((f"replayssm {fmt} allocate({n})", n, allocate_only, max(10, args.calls // 10)))
            # Pending mode (speculative decoding): T = 4 tokens a row, every draft accepted.
            spec = ReplaySSMCache(batch + 1, H, G, fmt, "cuda", backend="kernels", spec_tokens=3)
            sslots = spec.allocate(batch)
            spec.prefill_init(states, sslots)
            T = spec.max_seqlen
            xs = torch.randn(batch, T, H, 64, generator=gen).to(device="cuda", dtype=torch.bfloat16)
            dts = (0.5 * torch.randn(batch, T, H, generator=gen)).to(device="cuda", dtype=torch.bfloat16)
            Bs, Cs = (torch.randn(batch, T, G, 128, generator=gen).to(device="cuda", dtype=torch.bfloat16) for _ in range(2))
            outs = torch.empty(batch, T, H, 64, dtype=torch.bfloat16, device="cuda")
            acc = torch.full((batch,), T, dtype=torch.int32, device="cuda")
            pend = (xs, dts, params.A, Bs, Cs, params.D, params.dt_bias, sslots, outs)
            calls.append((f"replayssm {fmt} pending T={T}", batch,
                          lambda c=spec, p=pend, a=acc: c.decode(*p, num_accepted_tokens=a), args.calls))  # fmt: skip
            keep += [cache, spec]
        x, dt, A, B, C, D, dt_bias = plain_inputs(tok, params)
        ids = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            state = torch.zeros(batch + 1, H, 64, 128, dtype=dtype, device="cuda")
            calls.append((f"standard decode {str(dtype)[6:]} state", batch,
                          lambda st=state, p=(x, dt, A, B, C, D, dt_bias, ids, out): standard_decode(st, *p), args.calls))  # fmt: skip
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    times: dict[int, list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for i, (_, _, fn, n) in enumerate(calls):
            times.setdefault(i, []).append(timed(fn, n))
    rows = []
    for i, (name, batch, _, _) in enumerate(calls):
        host, wall, gpu = (statistics.median(t[k] for t in times[i]) for k in range(3))
        rows.append({"call": name, "batch": batch, "host_us": host, "b2b_us": wall, "gpu_us": gpu,
                     "host_us_rounds": [t[0] for t in times[i]]})  # fmt: skip
    print(f"# {torch.cuda.get_device_name()}  heads={H} groups={G}  {args.inputs} inputs, {args.calls} calls, {args.rounds} rounds")
    print(f"{'call':34}{'batch':>6}{'host us':>10}{'b2b us':>10}{'GPU us':>10}")
    for r in rows:
        print(f"{r['call']:34}{r['batch']:>6}{r['host_us']:>10.1f}{r['b2b_us']:>10.1f}{r['gpu_us']:>10.1f}")
    if args.out:
        meta = {
            "device": torch.cuda.get_device_name(), "host": platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": version("triton"), "commit": commit(),
            "command": " ".join(["python benchmarks/bench_eager.py", *(sys.argv[1:] if argv is None else argv)]),
            "args": vars(args), "started": started,
        }  # fmt: skip
        write_json({"meta": meta, "rows": rows}, Path(args.out))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
