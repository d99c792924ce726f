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
end (outputs, checkpoint and read copy written, the last barrier). Per flush CTA, its SM:
how many flush CTAs each SM holds (the block scheduler packs them; docs/design.md,
section 4).

A flush CTA records the rows of the first `flush_fp8.TRACE_TRIPS` (16) trips of its walk:
above 16 trips x 16 rows x the flush's columns (at 16 heads on an H200, batch 1,536 for
FP8, 2,560 for NVFP4) later rows are left out of the flush's counts.

The traced variants issue ~10% more instructions (the FP8 ones spill a few words), so
the step time of the traced graph is printed beside the untraced one: read the phases as
shares, not as exact times. %clock64 counts cycles of the SM's clock; they are turned
into microseconds by the median ratio of clock to %globaltimer over the CTAs' lifetimes.
"""

from __future__ import annotations

import collections
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.step_timeline import capture_period, step_args  # noqa: E402


# (name, first, last) %clock64 words of a record a phase spans.
NONFLUSH_PHASES = (("plan (slot back)", 2, 3), ("read copy + row dots", 3, 4), ("finish", 4, 5), ("exit", 5, 6))
FLUSH_PHASES = (("fold (loads, staging, MMAs)", 1, 2), ("partials + barrier", 2, 3), ("outputs + stores", 3, 4), ("whole row", 1, 4))


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def summary(v: list[float]) -> str:
    return f"{statistics.median(v):6.2f} [{pct(v, 0.1):5.2f}, {pct(v, 0.9):5.2f}]" if v else "     -"


def analyse(nf: torch.Tensor, fl: torch.Tensor, trips: int) -> dict:
    """The phases of the last step's records (nf int64 [CTAs, 8], fl int64 [CTAs, 8 + 5 *
    16 * trips], layouts in decode_warp.TRACE_WORDS / flush_fp8.FLUSH_TRACE_WORDS), times
    in us: lists of per-CTA (per flushed row) values and per-tenth counts."""
    nf = nf.cpu().tolist()
    seen = [r for r in nf if r[0]]
    live = [r for r in seen if r[7] >> 32 == 1]
    t0 = min(r[0] for r in seen)
    ghz = statistics.median((r[6] - r[2]) / max(1, r[1] - r[0]) for r in seen)  # cycles per ns (every record has both)
    us = lambda c: c / ghz / 1000  # noqa: E731
    span = (max(r[1] for r in seen) - t0) / 1000
    n_sm = len({r[7] & 0xFFFFFFFF for r in seen})
    edges = [span * k / 10 for k in range(11)]
    starts = [(r[0] - t0) / 1000 for r in seen]
    st = {
        "live": len(live),
        "exiting": len(seen) - len(live),
        "span": span,
        "ghz": ghz,
        "lifetime": [(r[1] - r[0]) / 1000 for r in live],
        "phases": {name: [us(r[b] - r[a]) for r in live] for name, a, b in NONFLUSH_PHASES},
        "started": [sum(1 for x in starts if edges[k] <= x < edges[k + 1] or (k == 9 and x == span)) for k in range(10)],
        "resident": [
            sum(1 for r in seen if (r[0] - t0) / 1000 <= (edges[k] + edges[k + 1]) / 2 < (r[1] - t0) / 1000) / n_sm
            for k in range(10)
        ],
        "first_exit": min((r[1] - t0) / 1000 for r in seen),
        "last_start": max(starts),
        "flush_ctas": 0,
    }
    ctas = [r for r in fl.cpu().tolist() if r[0]]
    if not ctas:
        return st
    units, waits = [], []
    for r in ctas:
        mine = [r[8 + 5 * u : 8 + 5 * (u + 1)] for u in range(16 * trips)]
        mine = [u for u in mine if u[0] >= r[0]]  # this step's (older steps' records start before the CTA did)
        units += mine
        if mine:
            waits.append((min(u[0] for u in mine) - r[0]) / 1000)
    st.update(
        flush_ctas=len(ctas),
        flush_rows=len(units),
        flush_from=(min(r[0] for r in ctas) - t0) / 1000,
        flush_to=(max(r[1] for r in ctas) - t0) / 1000,
        flush_lifetime=[(r[1] - r[0]) / 1000 for r in ctas],
        flush_phases={name: [us(u[b] - u[a]) for u in units] for name, a, b in FLUSH_PHASES},
        flush_first_row=waits,
        flush_per_sm=sorted(collections.Counter(collections.Counter(r[2] for r in ctas).values()).items()),
        flush_sms=len({r[2] for r in ctas}),
    )
    return st


def report(st: dict) -> None:
    print(f"  non-flush: {st['live']} live + {st['exiting']} exiting CTAs over {st['span']:.2f} us (clock {st['ghz']:.2f} GHz)")
    print(f"    lifetime (median [p10, p90], us): {summary(st['lifetime'])}")
    for name, v in st["phases"].items():
        print(f"    {name:>22}: {summary(v)}")
    print("    CTAs started by tenth of the span:", st["started"])
    print("    CTAs resident an SM at each tenth's middle:", [round(x, 1) for x in st["resident"]])
    print(f"    first exit {st['first_exit']:.2f} us, last start {st['last_start']:.2f} us")
    if not st["flush_ctas"]:
        print("  flush: no records")
        return
    per_cta = st["flush_rows"] / st["flush_ctas"]
    print(f"  flush: {st['flush_ctas']} CTAs, {st['flush_rows']} flushed (row, head half)s ({per_cta:.2f} a CTA), "
          f"from {st['flush_from']:.2f} to {st['flush_to']:.2f} us")  # fmt: skip
    print(f"    CTA lifetime: {summary(st['flush_lifetime'])}")
    for name, v in st["flush_phases"].items():
        print(f"    {name:>28}: {summary(v)}")
    print(f"    CTA start -> its first row: {summary(st['flush_first_row'])}")
    print(f"    flush CTAs on {st['flush_sms']} SMs; (CTAs an SM, SMs): {st['flush_per_sm']}")


def main(argv=None) -> None:
    ap = step_args(__doc__.split("\n\n")[0])
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
            _, plain = capture_period(fmt, batch, a.layers, a.heads, a.groups, a.sync)
            decode_warp._WarpHead.trace_addr = nf.data_ptr()
            flush_fp8.FlushFp8.trace_addr = fl.data_ptr()
            launch._COMPILED.clear()
            g, traced = capture_period(fmt, batch, a.layers, a.heads, a.groups, a.sync)
            nf.zero_()
            fl.zero_()
            g.replay()
            torch.cuda.synchronize()
            print(f"{fmt} batch {batch}, {a.heads} heads / {a.groups} groups: {plain:.2f} us a step, traced {traced:.2f}")
            report(analyse(nf, fl, flush_fp8.TRACE_TRIPS))
    decode_warp._WarpHead.trace_addr = flush_fp8.FlushFp8.trace_addr = 0
    launch._COMPILED.clear()


if __name__ == "__main__":
    main()
