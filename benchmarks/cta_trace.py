"""Where the CTAs of a captured decode step spend their time (GPU only): traced variants
of the warp non-flush kernel and the flush record per CTA (and per flushed row) the
GPU's %globaltimer and the SM's %clock64 at fixed points; this reads the records of the
last step of a captured 16-token period and prints the phases.

    python benchmarks/cta_trace.py --formats fp8 nvfp4 --batch 256 1024

Non-flush kernel, per CTA (`decode_warp._WarpHead.trace_addr`): entry -> the row's slot
is back (the plan's two round trips) -> row dots done (read-copy data, conversions,
MMAs) -> `finish` done (B_j . C, the barrier, the scan, the replay, the output and ring
stores issued) -> exit. Flush, per flushed (row, head half) (`FlushFp8.trace_addr`):
start -> `fold` done (plan, loads, staging, scan, fold MMAs) -> the partials' barrier ->
end (outputs, checkpoint and read copy written, the last barrier).

The traced variants issue ~10% more instructions (the FP8 ones spill a few words), so
the step time of the traced graph is printed beside the untraced one: read the phases as
shares, not as exact times. %clock64 counts cycles of the SM's clock; they are turned
into microseconds by the median ratio of clock to %globaltimer over the CTAs' lifetimes.
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

from benchmarks.bench_cute_nvfp4 import make_layer  # noqa: E402
from replayssm.api import selective_state_update_replayssm  # noqa: E402
from replayssm.synthetic import layer_params, token  # noqa: E402

RING = 16


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def summary(v: list[float]) -> str:
    return f"{statistics.median(v):6.2f} [{pct(v, 0.1):5.2f}, {pct(v, 0.9):5.2f}]" if v else "     -"


def step_graph(fmt: str, batch: int, heads: int, groups: int, layers: int, sync: bool = False):
    """(graph of one 16-token period over `layers` layer caches, us a step). `sync`: every
    row at ring position 1 before the period, so all rows flush at its 15th token and
    none at its last (the traced one)."""
    from replayssm import layout as L

    p = layer_params(heads, generator=torch.Generator().manual_seed(0), device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    caches = [make_layer(fmt, batch, heads, groups, 128, gen) for _ in range(layers)]
    if sync:
        for cache, ids in caches:
            cache[L.POSITIONS][ids.long()] = 1
    out = torch.empty(batch, heads, 64, dtype=torch.bfloat16, device="cuda")
    toks = [token(batch, heads, groups, generator=torch.Generator().manual_seed(1), device="cuda") for _ in range(4)]

    def period():
        for i in range(RING):
            t = toks[i % 4]
            for cache, ids in caches:
                selective_state_update_replayssm(cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, ids, out, state_dtype=fmt, seed=0)

    period()  # compiles every variant
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        period()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return g, start.elapsed_time(end) * 1000 / 10 / (RING * layers)


def analyse(nf: torch.Tensor, fl: torch.Tensor, unit_words: int, trips: int) -> None:
    """Print the phases of the last step's records: nf int64 [CTAs, 8], fl int64 [CTAs,
    8 + 5 * 16 * trips]."""
    nf = nf.cpu().tolist()
    live = [r for r in nf if r[7] >> 32 == 1]
    dead = [r for r in nf if r[0] and r[7] >> 32 == 0]
    t0 = min(r[0] for r in nf if r[0])
    ratio = statistics.median((r[6] - r[2]) / max(1, r[1] - r[0]) for r in live)  # cycles per ns
    us = lambda c: c / ratio / 1000  # noqa: E731
    span = (max(r[1] for r in nf if r[0]) - t0) / 1000
    print(f"  non-flush: {len(live)} live + {len(dead)} exiting CTAs over {span:.2f} us (clock {ratio:.2f} GHz)")
    print(f"    lifetime (median [p10, p90], us): {summary([(r[1] - r[0]) / 1000 for r in live])}")
    for name, a, b in (("plan (slot back)", 2, 3), ("read copy + row dots", 3, 4), ("finish", 4, 5), ("exit", 5, 6)):
        print(f"    {name:>22}: {summary([us(r[b] - r[a]) for r in live])}")
    starts = sorted((r[0] - t0) / 1000 for r in nf if r[0])
    ends = sorted((r[1] - t0) / 1000 for r in nf if r[0])
    sms = {r[7] & 0xFFFFFFFF for r in nf if r[0]}
    edges = [span * k / 10 for k in range(11)]
    resident = []
    for k in range(10):
        mid = (edges[k] + edges[k + 1]) / 2
        resident.append(sum(1 for r in nf if r[0] and (r[0] - t0) / 1000 <= mid < (r[1] - t0) / 1000) / max(1, len(sms)))
    print("    CTAs started by tenth of the span:", [sum(1 for s in starts if edges[k] <= s < edges[k + 1] + (k == 9)) for k in range(10)])
    print("    CTAs resident an SM at each tenth's middle:", [round(x, 1) for x in resident])
    print(f"    first exit {ends[0]:.2f} us, last start {starts[-1]:.2f} us")
    fl = fl.cpu().tolist()
    ctas = [r for r in fl if r[0]]
    if not ctas:
        print("  flush: no records")
        return
    units, waits = [], []
    for r in ctas:
        mine = []
        for u in range(16 * trips):
            rec = r[8 + unit_words * u : 8 + unit_words * (u + 1)]
            if rec[0] >= r[0]:  # this step's (older steps' records start before the CTA did)
                mine.append(rec)
        units += mine
        if mine:
            waits.append((min(u[0] for u in mine) - r[0]) / 1000)
    fspan0 = (min(r[0] for r in ctas) - t0) / 1000
    fspan1 = (max(r[1] for r in ctas) - t0) / 1000
    per_cta = len(units) / len(ctas)
    print(f"  flush: {len(ctas)} CTAs, {len(units)} flushed (row, head half)s ({per_cta:.2f} a CTA), from {fspan0:.2f} to {fspan1:.2f} us")
    print(f"    CTA lifetime: {summary([(r[1] - r[0]) / 1000 for r in ctas])}")
    for name, a, b in (("fold (loads, staging, MMAs)", 1, 2), ("partials + barrier", 2, 3), ("outputs + stores", 3, 4), ("whole row", 1, 4)):
        print(f"    {name:>28}: {summary([us(u[b] - u[a]) for u in units])}")
    print(f"    CTA start -> its first row: {summary(waits)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["fp8", "nvfp4"], choices=["fp8", "nvfp4"])
    ap.add_argument("--batch", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--sync", action="store_true", help="trace a step no row flushes in (the non-flush kernel alone)")
    a = ap.parse_args(argv)

    from replayssm.kernels.cute import decode_warp, flush_fp8, launch

    big = max(a.batch)
    nf = torch.zeros(a.heads * big, decode_warp.TRACE_WORDS, dtype=torch.int64, device="cuda")
    fl = torch.zeros(a.heads * flush_fp8.M_SPLIT * ((big + 15) // 16), flush_fp8.FLUSH_TRACE_WORDS, dtype=torch.int64, device="cuda")
    for fmt in a.formats:
        for batch in a.batch:
            decode_warp._WarpHead.trace_addr = flush_fp8.FlushFp8.trace_addr = 0
            launch._COMPILED.clear()
            _, plain = step_graph(fmt, batch, a.heads, a.groups, a.layers, a.sync)
            decode_warp._WarpHead.trace_addr = nf.data_ptr()
            flush_fp8.FlushFp8.trace_addr = fl.data_ptr()
            launch._COMPILED.clear()
            g, traced = step_graph(fmt, batch, a.heads, a.groups, a.layers, a.sync)
            nf.zero_()
            fl.zero_()
            g.replay()
            torch.cuda.synchronize()
            print(f"{fmt} batch {batch}, {a.heads} heads / {a.groups} groups: {plain:.2f} us a step, traced {traced:.2f}")
            analyse(nf, fl, 5, flush_fp8.TRACE_TRIPS)
    decode_warp._WarpHead.trace_addr = flush_fp8.FlushFp8.trace_addr = 0
    launch._COMPILED.clear()


if __name__ == "__main__":
    main()
