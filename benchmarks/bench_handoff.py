"""Slot hand-off benchmark (GPU only): copy, host swap and materialize, against the copy
bandwidth and the PCIe rate measured in the same run.

For each format, `--layers` layer caches of `--slots` slots (`--heads` / `--groups`),
filled with random bits (never zeros):

- copy: `replayssm.copy_slots(caches, src, dst)` of `--copy-slots` slots over every
  layer, src and dst random disjoint live slots as device ids, on the copy kernel (one
  launch, backend="kernels") and on the per-tensor path (backend="reference": an
  index_select and an index_copy_ per tensor and layer); with `--chunks`, the kernel
  alone on copy tables of other chunk sizes. GPU time: `--inner` calls
  captured in one CUDA graph, median over `--reps` replays, per call; eager time: the
  wall-clock of one call and a synchronize (host work included), median. Bytes: the
  slots' per-slot bytes over all layers, read once and written once; effective bandwidth
  = 2 * bytes / GPU time, against a device-to-device torch copy of the same bytes timed
  the same way (the peer).
- swap: `replayssm.export_slots(caches, [slot], non_blocking=True)` of one slot over
  every layer then one synchronize (one gather launch into a device staging buffer, one
  device-to-host copy into one pinned buffer; backend="kernels"), and `import_slots` of
  that data back into the slot (one host-to-device copy, one scatter launch) then one
  synchronize; the same on the per-tensor path (backend="reference": an index_select and
  a copy per tensor and layer, a host tensor each); wall-clock, median over `--reps`.
  Bytes: one slot's bytes over all layers; against pinned device-to-host and
  host-to-device copies of the same bytes (CUDA events; the PCIe rate).
- materialize: the Triton kernel (`backend="kernels"`, `out=` given) at `--batch` rows
  of one layer, rows at random positions; CUDA graph as for the copy. Bytes: the FP16
  checkpoints and the live ring entries read, the FP32 states written.

Prints a table last; with `--out DIR`, writes DIR/results.json (meta: device, versions,
commit, command, arguments; the correctness checks run before timing; every row).

    python benchmarks/bench_handoff.py                          # 64 layers x 1024 slots, both formats
    python benchmarks/bench_handoff.py --layers 8 --slots 300   # a quick run
    python benchmarks/bench_handoff.py --dry-run                # CPU smoke test: the plumbing, no timings worth reading
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import replayssm  # noqa: E402
from benchmarks.common import commit, copy_bandwidth  # noqa: E402
from benchmarks.common import graph_seconds as common_graph_seconds  # noqa: E402
from replayssm import ReplaySSMCache, materialize_replayssm_state  # noqa: E402
from replayssm import layout as L  # noqa: E402
from replayssm import reference as ref  # noqa: E402
from replayssm.handoff import CopyPlan, as_bits  # noqa: E402
from replayssm.kernels import kernel_backend  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=64, help="layer caches (default 64)")
    p.add_argument("--slots", type=int, default=1024, help="slots per layer cache, slot 0 included (default 1024)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--formats", default="fp8,nvfp4", help="comma-separated: fp8, nvfp4")
    p.add_argument("--copy-slots", type=int, default=8, help="slots per copy_slots call (default 8)")
    p.add_argument("--batch", type=int, default=256, help="materialize rows (default 256)")
    p.add_argument("--reps", type=int, default=20, help="timed repeats (median)")
    p.add_argument("--inner", type=int, default=10, help="calls per captured CUDA graph")
    p.add_argument("--chunks", default="",
                   help="comma-separated KiB: also time the copy kernel with tables of these chunk sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for results.json (default: print only)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton interpreter, tiny sizes, wall-clock timers: checks the plumbing")
    a = p.parse_args(argv)
    if a.dry_run:
        a.layers, a.slots, a.heads, a.groups = min(a.layers, 2), min(a.slots, 8), 8, 1
        a.copy_slots, a.batch, a.reps, a.inner = min(a.copy_slots, 2), min(a.batch, 2), 1, 1
    a.formats = [f for f in a.formats.split(",") if f]
    a.chunks = [int(c) for c in a.chunks.split(",") if c]
    for f in a.formats:
        if f not in L.STATE_DTYPES:
            p.error(f"--formats: expected some of {L.STATE_DTYPES}; got {f!r}")
    if a.slots < 2 + 2 * a.copy_slots or a.slots < 1 + a.batch:
        p.error(f"--slots must leave room for 2 x --copy-slots and for --batch live slots; got {a.slots}")
    return a


# ----------------------------------------------------------------------------------------
# timing


CUDA = True  # False in --dry-run: every timer is the wall-clock of the call


def _wall(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_seconds(fn, inner: int, reps: int) -> float:
    """GPU seconds per call of `fn` (`common.graph_seconds`: `inner` calls in one CUDA
    graph, median of `reps` replays); wall-clock seconds on the CPU."""
    if not CUDA:
        return _wall(fn, reps)
    return common_graph_seconds(fn, reps, inner)


def event_seconds(fn, reps: int) -> float:
    """GPU seconds of one call of `fn` (CUDA events around it), median of `reps`."""
    if not CUDA:
        return _wall(fn, reps)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def wall_seconds(fn, reps: int) -> float:
    """Wall-clock seconds of `fn` followed by a synchronize (host work included), median."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------
# data


def make_layers(fmt: str, args, device: str) -> list[ReplaySSMCache]:
    """`args.layers` caches, every slot but 0 allocated, random bits in every tensor;
    positions random in [16, 4096) (any ring fill), NVFP4 parity 0 or 1, checkpoints finite
    (materialize reads them as numbers)."""
    caches = []
    for _ in range(args.layers):
        c = ReplaySSMCache(args.slots, args.heads, args.groups, fmt, device, seed=args.seed, backend="reference")
        c.allocator.allocate(args.slots - 1)
        for t in c.tensors[1:]:
            b = as_bits(t)
            b.copy_(torch.randint(-(2**15), 2**15, b.shape, device=device, dtype=torch.int32).to(b.dtype))
        ckpt = c.tensors[L.CHECKPOINT]
        ckpt.normal_(0.0, 0.5)
        for i, scale in ((L.X_RING, 1.0), (L.B_RING, 1.0)):
            c.tensors[i].normal_(0.0, scale)
        c.tensors[L.DT_RING].uniform_(0.001, 0.1)
        c.positions.copy_(torch.randint(16, 4096, c.positions.shape, device=device, dtype=torch.int32))
        if c.format.two_level:  # NVFP4's parity: import checks it is 0 or 1
            c.tensors[L.PARITY].copy_(torch.randint(0, 2, c.tensors[L.PARITY].shape, device=device))
        caches.append(c)
    return caches


def distinct_slots(n: int, num_slots: int, gen: torch.Generator) -> list[int]:
    return (torch.randperm(num_slots - 1, generator=gen)[:n] + 1).tolist()


# ----------------------------------------------------------------------------------------
# measurements


def bench_copy(caches, args, gen, checks: list) -> list[dict]:
    ids = distinct_slots(2 * args.copy_slots, args.slots, gen)
    device = caches[0].device
    src = torch.tensor(ids[: args.copy_slots], device=device)
    dst = torch.tensor(ids[args.copy_slots :], device=device)
    nbytes = args.copy_slots * caches[0].bytes_per_slot() * len(caches)
    rows = []
    # correctness before timing: the kernel's copy equals the sources' bits
    want = [[t[src].clone() for t in c.tensors[1:]] for c in caches]
    replayssm.copy_slots(caches, src, dst, backend="kernels")
    ok = all(torch.equal(as_bits(t[dst]), as_bits(w)) for c, ws in zip(caches, want) for t, w in zip(c.tensors[1:], ws))
    checks.append({"check": f"{caches[0].state_dtype} copy_slots kernel == sources", "ok": ok})
    del want
    peer_src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    peer_dst = torch.empty_like(peer_src)
    peer = graph_seconds(lambda: peer_dst.copy_(peer_src), args.inner, args.reps)
    del peer_src, peer_dst
    for label, backend in (("copy_slots, one launch", "kernels"), ("copy_slots, per tensor", "reference")):
        fn = lambda b=backend: replayssm.copy_slots(caches, src, dst, backend=b)  # noqa: E731
        gpu = graph_seconds(fn, args.inner, args.reps)
        eager = wall_seconds(fn, args.reps)
        rows.append(row(label, caches[0].state_dtype, nbytes, gpu, 2 * nbytes / gpu, 2 * nbytes / peer, "torch copy", eager))
    for kib in args.chunks:  # the kernel alone, on tables of other chunk sizes
        plan = CopyPlan([c.tensors for c in caches], args.slots, chunk=kib * 1024)
        gpu = graph_seconds(lambda p=plan: p.copy(src, dst), args.inner, args.reps)
        rows.append(row(f"copy kernel, {kib} KiB chunks", caches[0].state_dtype, nbytes, gpu, 2 * nbytes / gpu, 2 * nbytes / peer, "torch copy"))
    rows.append(row("torch copy, same bytes (peer)", caches[0].state_dtype, nbytes, peer, 2 * nbytes / peer, 2 * nbytes / peer, "torch copy"))
    return rows


def bench_swap(caches, args, gen, checks: list) -> list[dict]:
    (slot,) = distinct_slots(1, args.slots, gen)
    nbytes = caches[0].bytes_per_slot() * len(caches)
    fmt = caches[0].state_dtype
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=CUDA)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=caches[0].device).random_(0, 256)
    d2h = event_seconds(lambda: host.copy_(dev, non_blocking=True), args.reps)
    h2d = event_seconds(lambda: dev.copy_(host, non_blocking=True), args.reps)
    del host, dev

    def export(backend):
        data = replayssm.export_slots(caches, [slot], non_blocking=True, backend=backend)
        sync()
        return data

    def round_trip(backend) -> bool:
        data = export(backend)
        before = [[t[slot].clone() for t in c.tensors[1:]] for c in caches]
        for c in caches:  # the import must write: clobber the slot first
            for t in c.tensors[1:]:
                as_bits(t)[slot] = 0
        replayssm.import_slots(caches, data, [slot], backend=backend)
        sync()
        return all(torch.equal(as_bits(t[slot]), as_bits(b)) for c, bs in zip(caches, before) for t, b in zip(c.tensors[1:], bs))

    staged, per_tensor = export("kernels"), export("reference")
    same = all(torch.equal(as_bits(s[k]), as_bits(p[k])) for s, p in zip(staged, per_tensor) for k in p)
    buffers = {t.untyped_storage().data_ptr() for d in staged for t in d.values()}
    checks.append({"check": f"{fmt} export_slots == per-tensor export, in one host buffer", "ok": same and len(buffers) == 1})
    for backend, how in (("kernels", "one buffer"), ("reference", "per tensor")):
        checks.append({"check": f"{fmt} export / import round trip, {how}", "ok": round_trip(backend)})
    del staged, per_tensor
    rows = []
    for backend, label in (("kernels", "one buffer"), ("reference", "per tensor")):
        data = export(backend)
        t_export = wall_seconds(lambda b=backend: export(b), args.reps)
        t_import = wall_seconds(lambda b=backend, d=data: replayssm.import_slots(caches, d, [slot], backend=b), args.reps)
        rows.append(row(f"export 1 slot, {label}", fmt, nbytes, t_export, nbytes / t_export, nbytes / d2h, "pinned D2H"))
        rows.append(row(f"import 1 slot, {label}", fmt, nbytes, t_import, nbytes / t_import, nbytes / h2d, "pinned H2D"))
        del data
    return rows + [
        row("pinned D2H, same bytes (peer)", fmt, nbytes, d2h, nbytes / d2h, nbytes / d2h, "pinned D2H"),
        row("pinned H2D, same bytes (peer)", fmt, nbytes, h2d, nbytes / h2d, nbytes / h2d, "pinned H2D"),
    ]


def bench_materialize(cache, args, gen, copy_bw: float, checks: list) -> list[dict]:
    fmt, device = cache.state_dtype, cache.device
    ids = torch.tensor(distinct_slots(args.batch, args.slots, gen), device=device)
    A = -torch.rand(args.heads, generator=gen).add_(0.1).to(device)  # in [-1.1, -0.1)
    out = torch.empty(args.batch, args.heads, L.HEAD_DIM, L.STATE_DIM, device=device)
    try:  # the public call; without the CuTe DSL backend="kernels" is refused: the launcher itself
        materialize_replayssm_state(cache.tensors, ids, A, state_dtype=fmt, backend="kernels", out=out)
        fn = lambda: materialize_replayssm_state(cache.tensors, ids, A, state_dtype=fmt, backend="kernels", out=out)  # noqa: E731
        how = "materialize_replayssm_state(backend='kernels', out=)"
    except ValueError:
        launcher = kernel_backend().materialize
        fn = lambda: launcher(cache.tensors, ids, A, out)  # noqa: E731
        how = "KernelBackend.materialize (the Triton launcher; CuTe DSL unavailable)"
    fn()
    want = ref.materialize(cache.tensors, ids[:8], A)
    err = float(((out[:8] - want).abs().amax() / want.abs().amax().clamp_min(1e-30)).item())
    checks.append({"check": f"{fmt} materialize kernel vs reference (8 rows), max error / max |state|", "value": err, "call": how})
    live = (cache.positions[ids] % L.RING).long()
    t = cache.tensors
    entry = sum(x[0, :, 0].numel() * x.element_size() for x in (t[L.X_RING], t[L.DT_RING], t[L.B_RING]))
    ckpt = t[L.CHECKPOINT][0].numel() * t[L.CHECKPOINT].element_size()
    nbytes = int(args.batch * ckpt + int(live.sum()) * entry + out.numel() * out.element_size())
    gpu = graph_seconds(fn, args.inner, args.reps)
    eager = wall_seconds(fn, args.reps)
    return [row(f"materialize, batch {args.batch}", fmt, nbytes, gpu, nbytes / gpu, copy_bw, "copy bandwidth", eager)]


def row(op, fmt, nbytes, seconds, rate, peer_rate, peer, eager=None) -> dict:
    return {
        "op": op,
        "format": fmt,
        "bytes": nbytes,
        "us": seconds * 1e6,
        "gb_per_s": rate / 1e9,
        "peer": peer,
        "peer_gb_per_s": peer_rate / 1e9,
        "frac_peer": rate / peer_rate,
        "eager_us": None if eager is None else eager * 1e6,
    }


def fmt_table(rows) -> str:
    head = f"{'op':34}{'fmt':>6}{'MB':>9}{'us':>10}{'GB/s':>9}{'%peer':>7}  {'peer (GB/s)':22}{'eager us':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        eager = "" if r["eager_us"] is None else f"{r['eager_us']:10.1f}"
        peer = f"{r['peer']} ({r['peer_gb_per_s']:.0f})"
        lines.append(
            f"{r['op']:34}{r['format']:>6}{r['bytes'] / 1e6:9.2f}{r['us']:10.1f}{r['gb_per_s']:9.0f}"
            f"{100 * r['frac_peer']:6.0f}%  {peer:22}{eager}"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    global CUDA
    args = parse_args(argv)
    if args.dry_run:
        # The copy and materialize kernels run in Triton's CPU interpreter; it must be chosen
        # before any kernel is defined (replayssm imports Triton lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        CUDA, device = False, "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        raise SystemExit("bench_handoff needs a CUDA GPU (no CUDA device is visible); --dry-run runs a CPU smoke test")
    import triton

    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    meta = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit(),
        "command": " ".join(["python benchmarks/bench_handoff.py", *(sys.argv[1:] if argv is None else argv)]),
        "args": vars(args),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    rows, checks = [], []
    probe = copy_bandwidth(device, 1.0 if CUDA else 2**-10, 10 if CUDA else 3)
    copy_bw = probe["tb_per_s"] * 1e12
    meta["copy_bandwidth_gb_per_s"] = copy_bw / 1e9  # a device copy (2 * bytes / time)
    meta["copy_probe_bytes"] = probe["bytes"]
    for fmt in args.formats:
        t0 = time.perf_counter()
        caches = make_layers(fmt, args, device)
        per_slot = caches[0].bytes_per_slot()
        print(f"# {fmt}: {args.layers} layers x {args.slots} slots, {per_slot} bytes a slot "
              f"({args.layers * args.slots * per_slot / 2**30:.1f} GiB); set up in {time.perf_counter() - t0:.1f} s", flush=True)
        for part in (
            lambda: bench_copy(caches, args, gen, checks),
            lambda: bench_swap(caches, args, gen, checks),
            lambda: bench_materialize(caches[0], args, gen, copy_bw, checks),
        ):
            got = part()
            rows += got
            for r in got:
                print(json.dumps(r), flush=True)
        del caches
        gc.collect()  # caches sit in reference cycles; free them before the next format
        if CUDA:
            torch.cuda.empty_cache()
    result = {"meta": meta, "checks": checks, "rows": rows}
    for c in checks:
        print("check:", json.dumps(c))
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out_dir / 'results.json'}")
    print(f"\n# {meta['device']}: {args.heads} heads / {args.groups} groups, {args.layers} layers x {args.slots} slots; "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s ({meta['copy_probe_bytes'] / 2**20:.0f} MiB device copy)")
    print(fmt_table(rows))
    return result


if __name__ == "__main__":
    main()
