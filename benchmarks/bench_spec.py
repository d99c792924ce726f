"""Speculative-decoding benchmark (GPU only): pending mode beside the intermediate-state
baseline of benchmarks/spec_baseline.py and the single-token steps, with pending mode's
targets.

Rows, per shape (HEADSxGROUPS, head dim 64 and state dim 128, or
HEADSxGROUPSxHEADDIMxSTATEDIM; rows record P and N) and batch, one layer's time:

- `spec-bf16` (per T): the baseline call as engines run speculative Mamba-2 today, a
  bf16-state step over T tokens a row that writes T intermediate states, then the
  commit of the accepted one (both Triton kernels, spec_baseline.py). Verdicts: token 0
  is always accepted, each draft with probability `--accept` (0.7), the first rejection
  ends acceptance; rows draw their own (desynchronized). `--calls` calls with their own
  inputs and verdicts run per CUDA graph, each one step for every layer in rotation then
  one commit for every layer (the order of a model's forward pass and the verification
  after it). us/call = replay time / (calls x layers); us/token = us/call / the mean
  number of tokens a row commits per call; `commit` = the commits alone, timed the same way.
- `pending-fp8`, `pending-nvfp4` (per T): `ReplaySSMCache(spec_tokens=T - 1).decode` on the
  kernel backend with the same verdicts as `spec-bf16` (each call's verdict is on the
  row's previous call), timed like the baseline; rows start at committed counts i mod 16.
- `replayssm-fp8`, `replayssm-nvfp4`: the single-token step, `ReplaySSMCache.decode` on the
  kernel backend (the CuTe kernels), whole 16-token periods (row i starts at ring position
  i mod 16) captured in one CUDA graph, token-major over the layers, as bench_decode.py
  times them; one committed token a row per step, so us/token = us/call.
- `standard-bf16`: the single-token bf16-state decode (standard_decode.py), timed the same way.

For each `spec-bf16` row the table also gives the time the pending step must beat at the
same shape, batch and T: min(1.6 x the format's single-token step, the
baseline's us/call / 3); each pending row its ratio to the single-token step, the
baseline's speedup over it and whether it meets that bound. Layer caches rotate so that a row's working set reaches
`--ws-factor` L2 sizes where `--max-layers` allows (rows below twice the L2 are flagged
`(L2)`); a row that does not fit in the free GPU memory is skipped and says why. Bytes
per call come from spec_baseline.step_bytes and byte_model.py; TB/s and the fraction of
the copy bandwidth measured in the same run follow.

Prints a table last; with `--out DIR` writes DIR/results.json (meta: device, versions,
commit, command, arguments, copy bandwidth; the correctness checks; every row).

    python benchmarks/bench_spec.py --out results/spec      # default sweep (few replays, <= 32 layers: short)
    python benchmarks/bench_spec.py --dry-run               # CPU smoke test: plumbing, no timings worth reading
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import byte_model as bm  # noqa: E402
from benchmarks.common import (  # noqa: E402
    base_states, commit, copy_bandwidth, graph_seconds, parse_shapes, row_shape, shape_label, version, write_json,
)  # fmt: skip

RING = 16
SPEC = "spec-bf16"
PENDING = ("pending-fp8", "pending-nvfp4", "pending-fp16")
REPLAY = ("replayssm-fp8", "replayssm-nvfp4", "replayssm-fp16")
STANDARD = "standard-bf16"
PROVIDERS = (SPEC, *PENDING, *REPLAY, STANDARD)
MULTI = (SPEC, *PENDING)  # providers with T tokens a row per call
BATCH_PRIORITY = (256, 32, 1024)
TARGET_STEP_RATIO = 1.6  # the aim: a pending step at most 1.6x the format's single-token step
TARGET_BASELINE_SPEEDUP = 3.0  # ... and at least 3x faster than the baseline


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None, help="folder for results.json (default: print only)")
    p.add_argument("--dry-run", action="store_true", help="CPU, PyTorch references, tiny sizes (smoke test)")
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated, some of {PROVIDERS}")
    p.add_argument("--tokens", default="2,4", help="T values (tokens a row per speculative call)")
    p.add_argument("--shapes", default=None,
                   help="HEADSxGROUPS or HEADSxGROUPSxHEADDIMxSTATEDIM list (default 16x2,64x8)")  # fmt: skip
    p.add_argument("--batches", default="32,256,1024")
    p.add_argument("--accept", type=float, default=0.7, help="probability that a draft is accepted")
    p.add_argument("--calls", type=int, default=4, help="speculative calls (own inputs and verdicts) per graph")
    p.add_argument("--reps", type=int, default=10, help="timed graph replays (median)")
    p.add_argument("--max-layers", type=int, default=32, help="layer caches in rotation at most")
    p.add_argument("--l2-mb", type=float, default=50.0, help="L2 size used for the working-set target")
    p.add_argument("--ws-factor", type=float, default=3.0, help="working-set target, in L2 sizes")
    p.add_argument("--mem-fraction", type=float, default=0.8, help="share of the free GPU memory a row may use")
    p.add_argument("--copy-gib", type=float, default=1.0, help="buffer size of the copy-bandwidth probe")
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds; later rows are skipped (recorded)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.shapes = a.shapes or ("8x1" if a.dry_run else "16x2,64x8")
    if a.dry_run:
        a.batches, a.tokens = "2", "2"
        a.max_layers, a.reps, a.calls, a.copy_gib = 1, 1, 2, 1 / 64
    a.providers = [s for s in a.providers.split(",") if s]
    for prov in a.providers:
        if prov not in PROVIDERS:
            p.error(f"--providers: unknown provider {prov!r}; expected some of {PROVIDERS}")
    a.tokens = [int(t) for t in str(a.tokens).split(",") if t]
    try:
        a.shapes = parse_shapes(a.shapes)
    except ValueError as e:
        p.error(f"--shapes: {e}")
    a.batches = [int(b) for b in str(a.batches).split(",") if b]
    if not 0.0 <= a.accept <= 1.0:
        p.error(f"--accept must be a probability; got {a.accept}")
    return a


# ----------------------------------------------------------------------------------------
# timing


def timed(fn, reps: int, cuda: bool) -> tuple[float, str]:
    """Median seconds of `fn`: on the GPU `fn` is captured in one CUDA graph after a warm-up
    call (compiles) and its replays are timed with CUDA events ("graph"); on the CPU the
    wall-clock of plain calls ("cpu")."""
    if not cuda:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "cpu"
    return graph_seconds(fn, reps), "graph"


# ----------------------------------------------------------------------------------------
# data


def verdicts(batch: int, T: int, p: float, gen: torch.Generator) -> torch.Tensor:
    """num_accepted [batch] int32 in 1..T: token 0 always, then each draft with probability
    p until the first rejection."""
    u = torch.rand(batch, T - 1, generator=gen) < p
    return (1 + torch.cumprod(u.int(), dim=1).sum(dim=1)).to(torch.int32)


def tokens(batch, T, shape, device, gen):
    """One call's inputs at `shape` (heads, groups, P, N): x, dt (fp32, raw), B, C with T
    tokens a row ([b, T, ...])."""
    heads, groups, P, N = shape
    x = torch.randn(batch, T, heads, P, device=device, generator=gen).to(torch.bfloat16)
    dt = 0.5 * torch.randn(batch, T, heads, device=device, generator=gen)
    B = torch.randn(batch, T, groups, N, device=device, generator=gen).to(torch.bfloat16)
    C = torch.randn(batch, T, groups, N, device=device, generator=gen).to(torch.bfloat16)
    return x, dt, B, C


def layer_params(heads, layers, seed, device):
    from replayssm import synthetic

    gc = torch.Generator().manual_seed(seed + 1)
    return [synthetic.layer_params(heads, generator=gc, device=device) for _ in range(layers)]


def tiled(states: torch.Tensor, n: int) -> torch.Tensor:
    return states.repeat(math.ceil(n / states.shape[0]), 1, 1, 1)[:n]


# ----------------------------------------------------------------------------------------
# rows


def row_bytes(provider, shape, batch, T) -> dict:
    """(memory per layer, DRAM bytes per call) for the whole batch."""
    s = bm.Shape(*shape)
    if provider in PENDING:  # the cache as the single-token step's; a call's bytes follow its commits (run_row)
        fmt = provider.split("-")[1]
        return {"mem_per_layer": (batch + 1) * bm.cache_bytes_per_slot("replayssm-" + fmt, s), "bytes_per_call": None,
                "commit_bytes": None}  # fmt: skip
    if provider == SPEC:
        from benchmarks.spec_baseline import step_bytes

        e = s.state_elems * 2
        b = step_bytes(*shape[:2], T, 2, *shape[2:])
        return {"mem_per_layer": (batch + 1) * e + batch * T * e, "bytes_per_call": batch * (b["step"] + b["commit"]),
                "commit_bytes": batch * b["commit"]}  # fmt: skip
    return {"mem_per_layer": (batch + 1) * bm.cache_bytes_per_slot(provider, s),
            "bytes_per_call": batch * bm.step_bytes(provider, s).total, "commit_bytes": None}  # fmt: skip


def plan_layers(mem_per_layer, args, free_bytes) -> tuple[int, str | None]:
    target = args.ws_factor * args.l2_mb * 1e6
    layers = max(1, min(args.max_layers, math.ceil(target / mem_per_layer)))
    if free_bytes is not None:
        fit = int(args.mem_fraction * free_bytes // mem_per_layer)
        if fit < 1:
            return 0, f"skipped: one layer needs {mem_per_layer / 2**30:.1f} GiB, {free_bytes / 2**30:.1f} GiB free"
        layers = min(layers, fit)
    return layers, None


def build_spec(shape, batch, T, layers, ctx):
    """(call closure running `calls` calls, commit-only closure, mean tokens committed a
    row per call, what to keep alive)."""
    from benchmarks import spec_baseline as sb

    args, device = ctx["args"], ctx["device"]
    heads, P = shape[0], shape[2]
    gen = torch.Generator(device=device).manual_seed(args.seed + 3)
    hgen = torch.Generator().manual_seed(args.seed + 4)
    states = tiled(ctx["states"][shape], batch).to(torch.bfloat16)
    caches, inters = [], []
    for _ in range(layers):
        st = torch.empty(batch + 1, *states.shape[1:], dtype=torch.bfloat16, device=device)
        st[1:] = states
        st[0] = 0
        caches.append(st)
        inters.append(sb.new_inter(st, batch, T))
    params = layer_params(heads, layers, args.seed, device)
    ids = (torch.randperm(batch, device=device, generator=gen) + 1).to(torch.int32)
    calls = [tokens(batch, T, shape, device, gen) for _ in range(args.calls)]
    accs = [verdicts(batch, T, args.accept, hgen).to(device) for _ in range(args.calls)]
    mean_acc = float(torch.stack(accs).float().mean())
    out = torch.empty(batch, T, heads, P, dtype=torch.bfloat16, device=device)
    cuda = device.type == "cuda"
    step = sb.spec_step if cuda else sb.spec_step_ref
    commit = sb.spec_commit if cuda else sb.spec_commit_ref

    def run():
        for (x, dt, B, C), acc in zip(calls, accs):
            for st, inter, p in zip(caches, inters, params):
                step(st, inter, x, dt, p.A, B, C, p.D, p.dt_bias, ids, out)
            for st, inter in zip(caches, inters):
                commit(st, inter, ids, acc)

    def run_commits():
        for acc in accs:
            for st, inter in zip(caches, inters):
                commit(st, inter, ids, acc)

    return run, run_commits, mean_acc, (caches, inters, calls, accs)


def replayssm_caches(fmt, shape, batch, layers, states, gen, ctx, spec_tokens=0):
    """`layers` ReplaySSMCaches (kernel backend on the GPU) with slots 1..batch prefilled
    from `states` and random rings (entries of any position hold data)."""
    from replayssm import ReplaySSMCache
    from replayssm import layout as L

    args, device = ctx["args"], ctx["device"]
    heads, groups, P, N = shape
    caches = []
    for li in range(layers):
        c = ReplaySSMCache(batch + 1, heads, groups, fmt, device, seed=args.seed + li, spec_tokens=spec_tokens,
                           backend="kernels" if device.type == "cuda" else "reference", head_dim=P,
                           state_dim=N)  # fmt: skip
        c.prefill_init(states, c.allocate(batch))
        t = c.tensors
        t[L.X_RING].copy_(torch.randn(t[L.X_RING].shape, device=device, generator=gen))
        t[L.DT_RING].copy_(torch.rand(t[L.DT_RING].shape, device=device, generator=gen) * 0.1 + 1e-3)
        t[L.B_RING].copy_(torch.randn(t[L.B_RING].shape, device=device, generator=gen))
        caches.append(c)
    return caches


def build_pending(provider, shape, batch, T, layers, ctx):
    """(call closure running `calls` pending-mode calls over every layer, mean tokens
    committed a row per call, what to keep alive): `ReplaySSMCache(spec_tokens=T - 1)` on
    the kernel backend, with the verdicts of the `spec-bf16` rows (same generator and
    seed), each call's verdict being on the row's previous call. Rows start at committed
    counts i mod 16 with T tokens pending (random rings), so they reach the fold grid at
    different calls, as in a running engine."""
    from replayssm import layout as L

    args, device = ctx["args"], ctx["device"]
    heads, P = shape[0], shape[2]
    fmt = provider.split("-")[1]
    gen = torch.Generator(device=device).manual_seed(args.seed + 6)
    hgen = torch.Generator().manual_seed(args.seed + 4)
    states = tiled(ctx["states"][shape], batch)
    params = layer_params(heads, layers, args.seed, device)
    caches = replayssm_caches(fmt, shape, batch, layers, states, gen, ctx, spec_tokens=T - 1)
    for c in caches:  # committed counts i mod 16, T tokens pending
        pos = c.tensors[L.POSITIONS]
        slots = torch.arange(1, batch + 1, device=device)
        pos[slots, 0] = (torch.arange(batch, device=device, dtype=torch.int32) % RING).to(pos.dtype)
        pos[slots, 1] = T
    ids = (torch.randperm(batch, device=device, generator=gen) + 1).to(torch.int32)
    calls = [tokens(batch, T, shape, device, gen) for _ in range(args.calls)]
    accs = [verdicts(batch, T, args.accept, hgen).to(device) for _ in range(args.calls)]
    mean_acc = float(torch.stack(accs).float().mean())
    out = torch.empty(batch, T, heads, P, dtype=torch.bfloat16, device=device)

    def run():
        for (x, dt, B, C), acc in zip(calls, accs):
            for c, p in zip(caches, params):
                c.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, out, num_accepted_tokens=acc)

    return run, mean_acc, (caches, calls, accs)


def build_single(provider, shape, batch, layers, ctx):
    """(period closure: 16 single-token steps over every layer, token-major), what to keep."""
    args, device = ctx["args"], ctx["device"]
    heads, P = shape[0], shape[2]
    gen = torch.Generator(device=device).manual_seed(args.seed + 5)
    toks = [tokens(batch, 1, shape, device, gen) for _ in range(RING)]
    toks = [(x[:, 0], dt[:, 0], B[:, 0], C[:, 0]) for x, dt, B, C in toks]
    params = layer_params(heads, layers, args.seed, device)
    out = torch.empty(batch, heads, P, dtype=torch.bfloat16, device=device)
    states = tiled(ctx["states"][shape], batch)
    cuda = device.type == "cuda"
    if provider == STANDARD:
        from benchmarks.standard_decode import standard_decode, standard_decode_ref

        fn = standard_decode if cuda else standard_decode_ref
        caches = []
        for _ in range(layers):
            st = torch.zeros(batch + 1, *states.shape[1:], dtype=torch.bfloat16, device=device)
            st[1:] = states.to(torch.bfloat16)
            caches.append(st)
        ids = (torch.randperm(batch, device=device, generator=gen) + 1).to(torch.int32)

        def period():
            for x, dt, B, C in toks:
                for st, p in zip(caches, params):
                    fn(st, x, dt, p.A, B, C, p.D, p.dt_bias, ids, out)

        return period, caches
    from replayssm import layout as L

    fmt = provider.split("-")[1]
    caches = replayssm_caches(fmt, shape, batch, layers, states, gen, ctx)
    ids = torch.arange(1, batch + 1, dtype=torch.int32, device=device)[torch.randperm(batch, device=device, generator=gen)]
    for c in caches:  # desynchronized: batch row i starts at ring position i mod 16
        pos = c.tensors[L.POSITIONS]
        pos[ids.long()] = (torch.arange(batch, device=device, dtype=torch.int32) % RING).to(pos.dtype)

    def period():
        for x, dt, B, C in toks:
            for c, p in zip(caches, params):
                c.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, out)

    return period, caches


def run_row(provider, shape, batch, T, ctx, skip: str | None = None) -> dict:
    args, device = ctx["args"], ctx["device"]
    nb = row_bytes(provider, shape, batch, T)
    row = {"provider": provider, "heads": shape[0], "groups": shape[1], "head_dim": shape[2], "state_dim": shape[3],
           "batch": batch, "T": T if provider in MULTI else 1,
           "timing": None, "layers": None, "working_set_mb": None, "l2_resident": None, "us_per_call": None,
           "tokens_per_row": None, "us_per_token": None, "commit_us": None, "bytes_per_call": nb["bytes_per_call"],
           "tb_per_s": None, "frac_copy_bw": None, "error": None}  # fmt: skip
    if skip is None:
        free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else None
        layers, skip = plan_layers(nb["mem_per_layer"], args, free)
    if skip:
        row["error"] = skip
        return row
    row.update(layers=layers, working_set_mb=round(layers * nb["mem_per_layer"] / 1e6, 1),
               l2_resident=layers * nb["mem_per_layer"] < 2 * args.l2_mb * 1e6)  # fmt: skip
    keep = None
    try:
        if provider == SPEC:
            run, run_commits, mean_acc, keep = build_spec(shape, batch, T, layers, ctx)
            t, timing = timed(run, args.reps, device.type == "cuda")
            us = t / (args.calls * layers) * 1e6
            tc, _ = timed(run_commits, args.reps, device.type == "cuda")
            row.update(commit_us=tc / (args.calls * layers) * 1e6, tokens_per_row=mean_acc)
        elif provider in PENDING:
            run, mean_acc, keep = build_pending(provider, shape, batch, T, layers, ctx)
            t, timing = timed(run, args.reps, device.type == "cuda")
            us = t / (args.calls * layers) * 1e6
            row["tokens_per_row"] = mean_acc
            row["bytes_per_call"] = batch * bm.pending_call(bm.Shape(*shape), provider.split("-")[1], T, mean_acc).total
        else:
            period, keep = build_single(provider, shape, batch, layers, ctx)
            t, timing = timed(period, args.reps, device.type == "cuda")
            us = t / (RING * layers) * 1e6
            row["tokens_per_row"] = 1.0
        row.update(timing=timing, us_per_call=us, us_per_token=us / row["tokens_per_row"])
        if row["bytes_per_call"] is not None:
            row["tb_per_s"] = row["bytes_per_call"] / (us * 1e-6) / 1e12
            row["frac_copy_bw"] = row["tb_per_s"] / ctx["copy"]["tb_per_s"]
    except Exception as e:  # noqa: BLE001 - one row's failure must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["traceback"] = traceback.format_exc(limit=6)
    del keep
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def add_targets(rows: list[dict]) -> None:
    """Per spec row: its us/call against each single-token step, and the target us/call of
    the pending step in each format (min of 1.6x the single-token step and baseline / 3)."""
    single = {(r["provider"], row_shape(r), r["batch"]): r["us_per_call"] for r in rows if r["provider"] not in MULTI}
    for r in rows:
        if r["provider"] != SPEC:
            continue
        for prov in (*REPLAY, STANDARD):
            key = prov.split("-")[1] if prov in REPLAY else "std_bf16"
            s = single.get((prov, row_shape(r), r["batch"]))
            ok = bool(s and r["us_per_call"])
            r[f"x_{key}_step"] = r["us_per_call"] / s if ok else None
            if prov in REPLAY:
                r[f"target_us_{key}"] = (min(TARGET_STEP_RATIO * s, r["us_per_call"] / TARGET_BASELINE_SPEEDUP)
                                         if ok else None)  # fmt: skip
    # Per pending row: x its format's single-token step, the baseline's speedup over it, its target.
    spec = {(row_shape(r), r["batch"], r["T"]): r for r in rows if r["provider"] == SPEC}
    for r in rows:
        if r["provider"] not in PENDING or not r["us_per_call"]:
            continue
        fmt = r["provider"].split("-")[1]
        s = single.get(("replayssm-" + fmt, row_shape(r), r["batch"]))
        base = spec.get((row_shape(r), r["batch"], r["T"]))
        r["x_step"] = r["us_per_call"] / s if s else None
        r["baseline_speedup"] = base["us_per_call"] / r["us_per_call"] if base and base["us_per_call"] else None
        r["target_us"] = base.get(f"target_us_{fmt}") if base else None
        r["meets_target"] = None if r["target_us"] is None else r["us_per_call"] <= r["target_us"]


# ----------------------------------------------------------------------------------------
# checks and reporting


def check_spec(shape, T, ctx) -> dict:
    """The kernels against their PyTorch twins at batch 8 (one padding row), one call."""
    from benchmarks import spec_baseline as sb

    device = ctx["device"]
    heads = shape[0]
    batch = 8
    gen = torch.Generator(device=device).manual_seed(7)
    st = tiled(ctx["states"][shape], batch + 1).to(torch.bfloat16)
    st_ref = st.clone()
    x, dt, B, C = tokens(batch, T, shape, device, gen)
    p = layer_params(heads, 1, 7, device)[0]
    ids = (torch.randperm(batch, device=device, generator=gen) + 1).to(torch.int32)
    ids[3] = 0
    acc = verdicts(batch, T, 0.7, torch.Generator().manual_seed(8)).to(device)
    inter, inter_ref = sb.new_inter(st, batch, T), sb.new_inter(st, batch, T)
    y = sb.spec_step(st, inter, x, dt, p.A, B, C, p.D, p.dt_bias, ids)
    sb.spec_commit(st, inter, ids, acc)
    y_ref = sb.spec_baseline_ref(st_ref, inter_ref, x, dt, p.A, B, C, p.D, p.dt_bias, ids, acc)
    live = ids != 0
    return {
        "check": f"{SPEC} {shape_label(shape, True)} T={T} vs PyTorch twin",
        "max_abs_err_y": float((y - y_ref).float().abs().max()), "max_abs_y": float(y_ref.float().abs().max()),
        "max_abs_err_inter": float((inter[live] - inter_ref[live]).float().abs().max()),
        "max_abs_err_state": float((st - st_ref).float().abs().max()), "max_abs_state": float(st_ref.float().abs().max()),
    }  # fmt: skip


def fmt_table(rows: list[dict], copy_tbs: float) -> str:
    labels = [shape_label(row_shape(r), table=True) for r in rows]
    cols = [("shape", max([6, *map(len, labels)])), ("batch", 5), ("provider", 15), ("T", 2), ("lay", 3),
            ("us/call", 9), ("tok/row", 7), ("us/token", 9), ("commit", 7), ("MB/call", 8), ("%copy", 6), ("x fp8", 6),
            ("tgt fp8", 8), ("tgt nvfp4", 9), ("x step", 6), ("base/x", 6), ("target", 7)]  # fmt: skip
    lines = [f"copy bandwidth: {copy_tbs:.3f} TB/s (2 x bytes / time); us per call of one layer, whole batch",
             "  ".join(f"{c:>{w}}" for c, w in cols)]  # fmt: skip

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r, label in zip(rows, labels):
        cells = [label, str(r["batch"]), r["provider"], str(r["T"]), f(r["layers"], "d"),
                 f(r["us_per_call"], ".2f"), f(r["tokens_per_row"], ".2f"), f(r["us_per_token"], ".2f"),
                 f(r["commit_us"], ".2f"), f(None if r["bytes_per_call"] is None else r["bytes_per_call"] / 1e6, ".2f"),
                 f(None if r["frac_copy_bw"] is None else 100 * r["frac_copy_bw"], ".1f"),
                 f(r.get("x_fp8_step"), ".2f"), f(r.get("target_us_fp8"), ".2f"),
                 f(r.get("target_us_nvfp4"), ".2f"), f(r.get("x_step"), ".2f"), f(r.get("baseline_speedup"), ".2f"),
                 {None: "-", True: "met", False: "missed"}[r.get("meets_target")]]  # fmt: skip
        line = "  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols))
        if r["l2_resident"]:
            line += "  (L2)"
        if r["error"]:
            line += f"  {r['error'][:120]}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("bench_spec needs a CUDA GPU (no CUDA device is visible); --dry-run runs a CPU smoke test")
    torch.manual_seed(args.seed)
    ctx = {"args": args, "device": device}
    ctx["copy"] = copy_bandwidth(device, args.copy_gib, 10 if device.type == "cuda" else 3)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the rows size their layers by the free memory
    ctx["states"] = {s: base_states(s[0], s[1], 16, device, args.seed, *s[2:]) for s in args.shapes}
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": version("triton"),
        "dry_run": args.dry_run,
        "commit": commit(),
        "command": " ".join(["python benchmarks/bench_spec.py", *(sys.argv[1:] if argv is None else argv)]),
        "args": vars(args),
        "copy_bandwidth": ctx["copy"],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result = {"meta": meta, "checks": [], "rows": []}
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda" and SPEC in args.providers:  # on the CPU the timed rows are the twins
        for shape in args.shapes:
            for T in args.tokens:
                try:
                    result["checks"].append(check_spec(shape, T, ctx))
                except Exception as e:  # noqa: BLE001
                    result["checks"].append({"check": f"{SPEC} {shape_label(shape)} T={T}",
                                             "error": f"{type(e).__name__}: {e}"})  # fmt: skip
        for c in result["checks"]:
            print("check:", json.dumps(c), flush=True)
    # Issue 30's target batch first, so a --time-budget cut loses the least; the table and
    # the JSON are sorted afterwards.
    order = sorted(args.batches, key=lambda b: (BATCH_PRIORITY.index(b) if b in BATCH_PRIORITY else 99, b))
    plan = []
    for batch in order:
        for shape in args.shapes:
            for prov in args.providers:
                for T in args.tokens if prov in MULTI else [1]:
                    plan.append((prov, shape, batch, T))
    for prov, shape, batch, T in plan:
        if time.perf_counter() - t_start > args.time_budget:
            row = run_row(prov, shape, batch, T, ctx, skip="skipped: --time-budget exhausted")
        else:
            row = run_row(prov, shape, batch, T, ctx)
        result["rows"].append(row)
        print(f"{prov:16s} {shape_label(shape, True):>7s} b={batch:5d} T={row['T']} layers={row['layers'] or 0:3d} "
              + (f"{row['us_per_call']:10.2f} us/call" if row["us_per_call"] else f"{row['error']}"), flush=True)
        if out_dir:
            write_json(result, out_dir / "results.json")  # partial results survive a crash
    rank = {p: i for i, p in enumerate(PROVIDERS)}
    result["rows"].sort(key=lambda r: (args.shapes.index(row_shape(r)), r["batch"], rank[r["provider"]], r["T"]))
    add_targets(result["rows"])
    meta["seconds"] = time.perf_counter() - t_start
    if out_dir:
        write_json(result, out_dir / "results.json")
        print(f"wrote {out_dir / 'results.json'}")
    print()
    print(fmt_table(result["rows"], ctx["copy"]["tb_per_s"]))
    print(f"{meta['seconds']:.1f} s")
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
