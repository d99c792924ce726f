"""Where a captured decode step spends its time (GPU only): the kernels of 16 tokens x
`--layers` layers captured in one CUDA graph (token-major, rows desynchronized, as
bench_kernels.py builds them), one replay traced by the torch profiler, and per step
the median of: each kernel's duration, the gap from the prepare kernel's end to the
first decode kernel's start, the gap to the next step's prepare, and when the flush
starts and ends relative to the non-flush kernel.

    python benchmarks/step_timeline.py --formats fp8 nvfp4 --batch 256 1024
    python benchmarks/step_timeline.py --pending-tokens 4 --batch 256   # pending mode

Columns: us/step, then the medians of prepare, flush and nonflush (each kernel's
duration, including the time it shares the GPU with the other), gap (prepare's end to
the first decode kernel's start), next (the last decode kernel's end to the next step's
prepare), flush-start and flush-end (the flush's start and end minus the non-flush
kernel's). docs/design.md says what these showed on the H200.

With `--pending-tokens T`, pending-mode calls instead (bench_spec.py's setup: `--calls`
calls of T tokens a row over `--layers` layers, drafts accepted with p 0.7): per call the
medians of the plan, fold and step kernels' durations, the call's span (the plan's start
to the last kernel's end), and each kernel's start and end from the plan's start; the
step's first and second launch (a captured call of 64+ rows splits it: the rows that do
not fold, then the rows that fold) as step1 / step2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.bench_kernels import make_layer  # noqa: E402
from replayssm.api import selective_state_update_replayssm  # noqa: E402
from replayssm.synthetic import layer_params, token  # noqa: E402

RING = 16
COLUMNS = ("prepare", "flush", "nonflush")


def kernel_tag(name: str) -> str:
    """The kernel a profiler record names: the CuTe DSL names a kernel after its module
    and class (kernels/cute/flush.py's Flush and PendingFold, decode.py's Decode,
    pending.py's PendingStep, plan.py's Prepare and PendingPlanKernel) and its argument
    types."""
    n = name.lower()
    for key, tag in (("cuteflushflush", "flush"), ("cutedecodedecode", "nonflush"), ("prepare", "prepare"),
                     ("cuteflushpendingfold", "fold"), ("cutependingpendingstep", "step"), ("pendingplankernel", "plan")):  # fmt: skip
        if key in n:
            return tag
    return "other"


def step_stats(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """Median per-step figures from (tag, start, end) kernel records in time order (us);
    a step starts at each prepare kernel."""
    steps: list[dict] = []
    for tag, start, end in events:
        if tag == "prepare":
            steps.append({})
        if steps and tag in COLUMNS:
            steps[-1][tag] = (start, end)
    full = [s for s in steps if all(k in s for k in COLUMNS)]
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    out = {k: med([s[k][1] - s[k][0] for s in full]) for k in COLUMNS}
    out["gap"] = med([min(s["flush"][0], s["nonflush"][0]) - s["prepare"][1] for s in full])
    out["next"] = med([b["prepare"][0] - max(a["flush"][1], a["nonflush"][1]) for a, b in zip(full, full[1:])])
    out["flush_start"] = med([s["flush"][0] - s["nonflush"][0] for s in full])
    out["flush_end"] = med([s["flush"][1] - s["nonflush"][1] for s in full])
    return out


PENDING_COLUMNS = ("plan", "fold", "step1", "step2")


def pending_stats(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """Median per-call figures from (tag, start, end) kernel records in time order (us); a
    call starts at each plan kernel. For each kernel of PENDING_COLUMNS (the step's first
    and second launch as step1 / step2): its duration, and its start and end from the
    plan's start (`<kernel>_start`, `<kernel>_end`); `span`, the plan's start to the last
    kernel's end. A call without a kernel leaves it out of that kernel's medians."""
    calls: list[dict] = []
    for tag, start, end in events:
        if tag == "plan":
            calls.append({})
        if not calls or tag not in ("plan", "fold", "step"):
            continue
        if tag == "step":
            tag = "step1" if "step1" not in calls[-1] else "step2"
        calls[-1][tag] = (start, end)
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    out = {k: med([c[k][1] - c[k][0] for c in calls if k in c]) for k in PENDING_COLUMNS}
    for k in PENDING_COLUMNS:
        out[k + "_start"] = med([c[k][0] - c["plan"][0] for c in calls if k in c])
        out[k + "_end"] = med([c[k][1] - c["plan"][0] for c in calls if k in c])
    out["span"] = med([max(e for _, e in c.values()) - c["plan"][0] for c in calls])
    return out


def run_pending(fmt: str, batch: int, T: int, layers: int, heads: int, groups: int, calls: int = 4) -> dict[str, float]:
    """Pending-mode calls as bench_spec.py times them (its `build_pending`), captured in one
    CUDA graph; us a call from 10 replays, and pending_stats of one traced replay."""
    from benchmarks import bench_spec
    from benchmarks.common import base_states

    args = bench_spec.parse_args(["--calls", str(calls)])
    device = torch.device("cuda")
    ctx = {"args": args, "device": device, "states": {(heads, groups): base_states(heads, groups, 16, device, args.seed)}}
    call, _, keep = bench_spec.build_pending(f"pending-{fmt}", (heads, groups), batch, T, layers, ctx)
    g, us_call = capture(call, calls * layers)
    stats = pending_stats(traced(g))
    del keep, g
    return {"us_call": us_call, **stats}


def capture_period(fmt: str, batch: int, layers: int, heads: int, groups: int, sync: bool = False, P: int = 64, N: int = 128):
    """(CUDA graph of one 16-token period over `layers` layer caches, us a step from 10
    replays). `sync`: every row at ring position 1 before the period, so that all rows
    flush at its 15th token and none at its last."""
    from replayssm import layout as L

    p = layer_params(heads, generator=torch.Generator().manual_seed(0), device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    caches = [make_layer(fmt, batch, heads, groups, 128, gen, P=P, N=N) for _ in range(layers)]
    if sync:
        for cache, ids in caches:
            cache[L.POSITIONS][ids.long()] = 1
    out = torch.empty(batch, heads, P, dtype=torch.bfloat16, device="cuda")
    toks = [token(batch, heads, groups, generator=torch.Generator().manual_seed(1), device="cuda", head_dim=P, state_dim=N)
            for _ in range(4)]

    def period():
        for i in range(RING):
            t = toks[i % 4]
            for cache, ids in caches:
                selective_state_update_replayssm(cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, ids, out, state_dtype=fmt, seed=0)

    return capture(period, RING * layers)


def capture(fn, units: int):
    """(CUDA graph of `fn` captured after one eager call, which compiles every variant; us
    a unit from 10 replays, `units` units a replay)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return g, start.elapsed_time(end) * 1000 / 10 / units


def traced(g) -> list[tuple[str, float, float]]:
    """(kernel_tag, start, end) of every kernel of one replay of `g`, in time order (us)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return sorted(
        ((kernel_tag(e.name), e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda e: e[1],
    )


def run(fmt: str, batch: int, layers: int, heads: int, groups: int, P: int = 64, N: int = 128) -> dict[str, float]:
    g, us_step = capture_period(fmt, batch, layers, heads, groups, P=P, N=N)
    return {"us_step": us_step, **step_stats(traced(g))}


def step_args(description: str) -> argparse.ArgumentParser:
    """The options of the captured-period tools ."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--formats", nargs="+", default=["fp8", "nvfp4"], choices=["fp8", "nvfp4"])
    ap.add_argument("--batch", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64, help="decode steps only")
    ap.add_argument("--state-dim", type=int, default=128, help="decode steps only")
    ap.add_argument("--pending-tokens", nargs="*", type=int, default=[], help="pending-mode calls of T tokens a row instead")
    return ap


def main(argv=None) -> None:
    a = step_args(__doc__.split("\n\n")[0]).parse_args(argv)
    if a.pending_tokens:
        cols = PENDING_COLUMNS
        print("   fmt batch  T  us/call   span " + " ".join(f"{c:>17}" for c in cols) + "   (duration: start-end)")
        for fmt in a.formats:
            for batch in a.batch:
                for T in a.pending_tokens:
                    r = run_pending(fmt, batch, T, a.layers, a.heads, a.groups)
                    cells = " ".join(f"{r[c]:5.2f}:{r[c + '_start']:5.1f}-{r[c + '_end']:5.1f}" for c in cols)
                    print(f"{fmt:>6} {batch:5d} {T:2d} {r['us_call']:8.2f} {r['span']:6.2f} {cells}", flush=True)
        return
    print("   fmt batch  us/step prepare  flush nonflush  gap  next  flush-start  flush-end")
    for fmt in a.formats:
        for batch in a.batch:
            r = run(fmt, batch, a.layers, a.heads, a.groups, a.head_dim, a.state_dim)
            print(f"{fmt:>6} {batch:5d} {r['us_step']:8.2f} {r['prepare']:7.2f} {r['flush']:6.2f} {r['nonflush']:8.2f} "
                  f"{r['gap']:4.2f} {r['next']:5.2f} {r['flush_start']:12.2f} {r['flush_end']:10.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
