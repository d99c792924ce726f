"""Decode-step benchmark: ReplaySSM (FP8, NVFP4) against a standard Mamba-2 decode kernel
(fp32 / bf16 / fp16 state) over batch sizes and model shapes.

Shapes are HEADSxGROUPS (head dim 64, state dim 128) or HEADSxGROUPSxHEADDIMxSTATEDIM
(P in 64, 80; N in 128, 256); every provider's inputs, caches and states take the
shape's P and N, and rows record them.

`vllm-replayssm-fp16` (opt-in via --providers; GPU only, skipped in --dry-run): vLLM's
Triton ReplaySSM decode (`selective_state_update_replayssm_output_only`, fp16 state, x /
dt / B rings of 16 tokens, the flush at the 16th), called from the peer code in --peers
(default ../shared/peers/.peers beside the repository; put on sys.path only when the
provider is asked for). It is timed as the ReplaySSM rows are (same inputs, rows
desynchronized or synchronized by its per-row ring cursor, which vLLM's metadata gives
every layer of a step), checked against the FP32 standard decode in PyTorch (SQNR), and
its bytes are those of the replayssm-fp16 byte model (the same tensors move).

Every timing covers whole 16-token periods, so ReplaySSM's flush is always paid for:

- GPU, graph mode: for each layer cache in rotation, 16 consecutive decode steps are
  captured in one CUDA graph (token-major: token t runs through every layer before token
  t + 1, as in a model); per-step time = median graph replay time / (16 * layers).
- GPU, eager mode (a provider that cannot be captured, e.g. the ReplaySSM reference
  backend, which synchronizes with the host): whole periods timed with CUDA events; the
  row is marked "eager" (its time includes Python and launch overhead).
- CPU (--dry-run): the PyTorch references at tiny sizes, wall-clock; checks the plumbing.

Rows are desynchronized (row i starts at ring position i mod 16, so 1/16 of the rows
flush every step) or synchronized (every row flushes on the same step). Several layers'
caches rotate so the working set exceeds the L2 (default target 3 x 50 MB) wherever the
layer cap allows; rows where it cannot are flagged `l2_resident`. Data is random, never
zero. Bytes per step come from benchmarks/byte_model.py; the copy bandwidth is measured
in the same run (a large device-to-device copy, 2 * bytes / time).

Outputs: a table on stdout, results.json and (if matplotlib is installed) decode.png in
--out. A provider that fails records its error in its row; the run goes on.

    python benchmarks/bench_decode.py --out results/          # full run (one H200: ~5 min)
    python benchmarks/bench_decode.py --dry-run --out /tmp/r  # CPU smoke test (< 1 min)
    python benchmarks/bench_decode.py --replot results/results.json --out results/  # plot only
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import byte_model as bm  # noqa: E402
from benchmarks.common import (  # noqa: E402
    base_states, copy_bandwidth, parse_shapes, row_shape, shape_label, version, write_json,
)  # fmt: skip
from replayssm.formats import FORMATS, FP8, NVFP4

RING = 16
STANDARD = ("standard-fp32", "standard-bf16", "standard-fp16")
REPLAY = ("replayssm-fp8", "replayssm-nvfp4", "replayssm-fp16")
VLLM = "vllm-replayssm-fp16"  # vLLM's Triton ReplaySSM, fp16 state (opt-in)
RINGED = REPLAY + (VLLM,)  # 16-token rings: --sync alignment and --inputs apply
PROVIDERS = REPLAY + STANDARD + (VLLM,)
BYTE_MODEL = {VLLM: "replayssm-fp16"}  # byte_model's name of a provider's traffic, where it differs
STD_DTYPES = {"standard-fp32": torch.float32, "standard-bf16": torch.bfloat16, "standard-fp16": torch.float16}
DEFAULT_BATCHES = (1, 8, 32, 128, 256, 512, 1024)
DEFAULT_SHAPES = ("16x2", "64x8")
BATCH_PRIORITY = (256, 32, 1024, 128, 512, 8, 1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="results", help="results folder (results.json, decode.png)")
    p.add_argument("--dry-run", action="store_true", help="CPU, PyTorch references, tiny sizes (smoke test)")
    p.add_argument("--providers", default=",".join(REPLAY + STANDARD), help=f"comma-separated, some of {PROVIDERS}")
    p.add_argument("--batches", default=None, help=f"comma-separated batch sizes (default {DEFAULT_BATCHES})")
    p.add_argument("--shapes", default=None, help="HEADSxGROUPS or HEADSxGROUPSxHEADDIMxSTATEDIM list "
                                                  f"(default {','.join(DEFAULT_SHAPES)})")  # fmt: skip
    p.add_argument("--peers", default=str(_ROOT.parent / "shared" / "peers" / ".peers"),
                   help=f"folder holding vLLM's peer code (vllm/), for {VLLM}")  # fmt: skip
    p.add_argument("--sync", default="desync,sync", help="ReplaySSM flush alignment: desync, sync or both")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--eager-periods", type=int, default=2, help="timed periods in eager mode (median)")
    p.add_argument("--eager-max-layers", type=int, default=1, help="layer caches in rotation in eager mode")
    p.add_argument("--max-layers", type=int, default=64, help="layer caches in rotation at most (graph mode)")
    p.add_argument("--l2-mb", type=float, default=50.0, help="L2 size used for the working-set target")
    p.add_argument("--ws-factor", type=float, default=3.0, help="working-set target, in L2 sizes")
    p.add_argument("--copy-gib", type=float, default=2.0, help="buffer size of the copy-bandwidth probe")
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds; later rows are skipped (recorded)")
    p.add_argument("--force-eager", action="store_true", help="time ReplaySSM eagerly even if capturable")
    p.add_argument("--block-p", type=int, default=None, help="standard kernel BLOCK_P (default: kernel's)")
    p.add_argument("--num-warps", type=int, default=None, help="standard kernel num_warps (default: kernel's)")
    p.add_argument("--tune-standard", action="store_true",
                   help="only sweep the standard kernel's (BLOCK_P, num_warps) at --batches (default 32,256)")
    p.add_argument("--replot", metavar="RESULTS_JSON", default=None,
                   help="only redraw the table and decode.png (in --out) from a results.json")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks before timing")
    p.add_argument("--no-settle", action="store_true", help="skip the untimed settle row (see settle_row)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", default="plain", choices=["plain", "engine"],
                   help="ReplaySSM step inputs: plain (contiguous x/B/C, FP32 dt) or engine (column slices of one "
                        "projection, bf16 dt; synthetic.engine_inputs)")
    a = p.parse_args(argv)
    if a.batches is None:
        a.batches = "1,2" if a.dry_run else "32,256" if a.tune_standard else ",".join(map(str, DEFAULT_BATCHES))
    if a.shapes is None:
        a.shapes = "8x1" if a.dry_run else ",".join(DEFAULT_SHAPES)
    a.batches = [int(b) for b in a.batches.split(",") if b]
    try:
        a.shapes = parse_shapes(a.shapes)
    except ValueError as e:
        p.error(f"--shapes: {e}")
    a.providers = [s for s in a.providers.split(",") if s]
    for prov in a.providers:
        if prov not in PROVIDERS:
            p.error(f"--providers: unknown provider {prov!r}; expected some of {PROVIDERS}")
    a.sync = [s for s in a.sync.split(",") if s]
    for s in a.sync:
        if s not in ("desync", "sync"):
            p.error(f"--sync: expected desync and/or sync; got {s!r}")
    if a.dry_run:
        a.max_layers = 1
        a.eager_max_layers = 1
        a.eager_periods = 1
        a.copy_gib = min(a.copy_gib, 1 / 32)
    return a


# ----------------------------------------------------------------------------------------
# timing


class Clock:
    """CUDA events on the GPU, perf_counter on the CPU; times in seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_each(self, fn, reps: int) -> list[float]:
        if not self.cuda:
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e-3 for s, e in ev]


# ----------------------------------------------------------------------------------------
# data


@dataclass
class Inputs:
    """16 tokens of step inputs (one per step of a period), shared by all layers, and one
    set of per-layer parameters per layer, all in the serving engine's tied layouts."""

    x: list
    dt: list
    B: list
    C: list
    ids: torch.Tensor
    out: torch.Tensor
    params: list = field(default_factory=list)


def make_inputs(shape, batch, layers, device, seed, kind: str = "plain") -> Inputs:
    """Inputs at `shape` (heads, groups, P, N). `kind` "plain": x, B, C contiguous, dt FP32
    tied over the head dim; "engine": as a Mamba-2 mixer passes them (x, B, C column slices
    of one projection row, dt bf16 tied over the head dim; synthetic.engine_inputs). A, D,
    dt_bias tied views either way."""
    from replayssm import synthetic

    heads, groups, P, N = shape
    g = torch.Generator(device=device).manual_seed(seed)
    xs, dts, Bs, Cs = [], [], [], []
    d_inner, gn = heads * P, groups * N
    for _ in range(RING):
        x = torch.randn(batch, heads, P, device=device, generator=g).to(torch.bfloat16)
        dt = 0.5 * torch.randn(batch, heads, device=device, generator=g)
        B = torch.randn(batch, groups, N, device=device, generator=g).to(torch.bfloat16)
        C = torch.randn(batch, groups, N, device=device, generator=g).to(torch.bfloat16)
        if kind == "engine":
            proj = torch.zeros(batch, 2 * d_inner + 2 * gn + heads, dtype=torch.bfloat16, device=device)
            proj[:, d_inner : 2 * d_inner] = x.reshape(batch, d_inner)
            proj[:, 2 * d_inner : 2 * d_inner + gn] = B.reshape(batch, gn)
            proj[:, 2 * d_inner + gn : 2 * d_inner + 2 * gn] = C.reshape(batch, gn)
            proj[:, 2 * d_inner + 2 * gn :] = dt.to(torch.bfloat16)
            x = proj[:, d_inner : 2 * d_inner].view(batch, heads, P)
            B = proj[:, 2 * d_inner : 2 * d_inner + gn].view(batch, groups, N)
            C = proj[:, 2 * d_inner + gn : 2 * d_inner + 2 * gn].view(batch, groups, N)
            dt = proj[:, 2 * d_inner + 2 * gn :]
        xs.append(x)
        dts.append(dt[:, :, None].expand(batch, heads, P))  # tied over the head dim
        Bs.append(B)
        Cs.append(C)
    # A random permutation of slots 1..batch, as a scheduler hands them out.
    ids = (torch.randperm(batch, device=device, generator=g) + 1).to(torch.int32)
    out = torch.empty(batch, heads, P, dtype=torch.bfloat16, device=device)
    inp = Inputs(xs, dts, Bs, Cs, ids, out)
    gc = torch.Generator().manual_seed(seed + 1)
    for _ in range(layers):
        p = synthetic.layer_params(heads, generator=gc, device=device)
        inp.params.append({
            "A": p.A[:, None, None].expand(heads, P, N),
            "D": p.D[:, None].expand(heads, P),
            "dt_bias": p.dt_bias[:, None].expand(heads, P),
        })  # fmt: skip
    return inp


def make_replay_cache(fmt, shape, batch, device, states, ids, sync: bool, seed: int):
    """A cache for slots 1..batch: checkpoint and read copy from `states` (tiled), random
    ring contents, and positions offset per row (desync) or all at ring index 0 (sync)."""
    import replayssm

    heads, groups, P, N = shape
    cache = replayssm.allocate_cache(batch + 1, heads, groups, fmt, device, head_dim=P, state_dim=N)
    n0 = states.shape[0]
    for lo in range(0, batch, n0):
        n = min(n0, batch - lo)
        slots = torch.arange(lo + 1, lo + 1 + n, device=device, dtype=torch.int32)
        replayssm.initialize_replayssm_state(cache, states[:n], slots, state_dtype=fmt, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 3)
    from replayssm import layout as L

    cache[L.X_RING].copy_(torch.randn(cache[L.X_RING].shape, device=device, generator=g))
    cache[L.DT_RING].copy_(torch.rand(cache[L.DT_RING].shape, device=device, generator=g) * 0.1 + 1e-3)
    cache[L.B_RING].copy_(torch.randn(cache[L.B_RING].shape, device=device, generator=g))
    pos = cache[L.POSITIONS]
    if not sync:
        # Batch row i (slot ids[i]) starts at ring index i mod 16.
        pos[ids.long()] = (torch.arange(batch, device=device, dtype=torch.int32) % RING).to(pos.dtype)
    return cache


# ----------------------------------------------------------------------------------------
# providers


def backend_name(device: torch.device) -> str:
    try:
        from replayssm.kernels import backend_for

        b = backend_for(device)
        return str(getattr(b, "name", type(b).__name__))
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return f"backend lookup failed: {e!r}"


@functools.cache
def vllm_kernel(peers: str):
    """vLLM's `selective_state_update_replayssm_output_only`, imported from the peer code in
    `peers` (the folder holding vllm/), which goes on sys.path only here, when the provider
    is asked for; SystemExit saying what is missing otherwise."""
    folder = Path(peers).resolve()
    if not (folder / "vllm").is_dir():
        raise SystemExit(f"{VLLM}: vLLM's peer code is not at {folder} (no vllm/ there); pass --peers DIR")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        from vllm.model_executor.layers.mamba.ops import selective_state_update_replayssm_output_only as m
    except Exception as e:  # noqa: BLE001 - a broken peer tree: say so before any row runs
        raise SystemExit(f"{VLLM}: importing vLLM's Triton ReplaySSM from {folder} failed: {type(e).__name__}: {e}")
    return m.selective_state_update_replayssm_output_only


def ring_cursors(batch, sync, device) -> tuple[list, list]:
    """vLLM's per-row ring cursors over one period, one (write_pos int32, is_flush bool) pair
    a token, shared by the layers as its metadata is: row i at ring index (i + t) mod 16
    (desync, as make_replay_cache's positions) or t (sync); the 16th token flushes."""
    start = torch.arange(batch, device=device, dtype=torch.int32) % RING
    start = start * 0 if sync else start
    pos = [((start + t) % RING).to(torch.int32) for t in range(RING)]
    return pos, [p == RING - 1 for p in pos]


def provider_skip(provider, shape, device) -> str | None:
    """Why `provider` is not run at `shape` on `device` (None when it is)."""
    if provider == VLLM and device.type != "cuda":
        return f"skipped: {VLLM} needs a CUDA GPU (vLLM's Triton kernel; not run in --dry-run)"
    return None


def probe_capturable(provider, shape, ctx) -> tuple[bool, str]:
    """Whether `provider`'s decode can be captured in a CUDA graph, decided without
    attempting one (a failed capture is best not risked mid-run): one
    whole period at batch 16 is run once to compile, then once more with torch's sync
    debug mode set to "error", which raises on any host synchronization (a path that
    reads tensor values on the host, such as the PyTorch reference, cannot be captured).
    Syncs outside torch are not seen here; a capture that fails still falls back to
    eager timing."""
    args, device = ctx["args"], ctx["device"]
    batch = 16
    inp = make_inputs(shape, batch, 1, device, args.seed)
    steps, keep = build_steps(provider, shape, batch, 1, inp, device, ctx["states"][shape], False, args)
    stage = "warm-up period failed"
    try:
        for st in steps:
            st()
        torch.cuda.synchronize()
        stage = f"{backend_name(device)} backend synchronizes with the host"
        torch.cuda.set_sync_debug_mode("error")
        try:
            for st in steps:
                st()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    except Exception as e:  # noqa: BLE001 - the answer is "no", with the reason
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        return False, f"{stage} ({msg})"
    finally:
        torch.cuda.synchronize()
        del steps, keep
    return True, backend_name(device)


def build_steps(provider, shape, batch, layers, inp: Inputs, device, states, sync, args):
    """[period of step closures] (token-major over layers) and the layers' state. vLLM's
    kernel runs on an fp16 ReplaySSM cache's tensors: its state, x / dt / B rings have
    the checkpoint's and rings' layouts ([slots, H, P, N] fp16, [slots, H, 16, P] bf16,
    [slots, H, 16] fp32, [slots, G, 16, N] bf16)."""
    if provider in RINGED:
        import replayssm
        from replayssm import layout as L

        fmt = "fp16" if provider == VLLM else provider.split("-")[1]
        keep = [make_replay_cache(fmt, shape, batch, device, states, inp.ids, sync, args.seed + li)
                for li in range(layers)]  # fmt: skip
        if provider == VLLM:
            fn = vllm_kernel(args.peers)
            pos, flush = ring_cursors(batch, sync, device)
            bc_pre = torch.empty(batch, shape[1], RING, dtype=torch.float32, device=device)  # the kernel's scratch

        def one(li, t):
            c, prm = keep[li], inp.params[li]
            if provider == VLLM:
                fn(c[L.CHECKPOINT], inp.x[t], inp.dt[t], prm["A"], inp.B[t], inp.C[t], prm["D"], prm["dt_bias"],
                   dt_softplus=True, x_cache=c[L.X_RING], dt_cache=c[L.DT_RING], B_cache=c[L.B_RING], bc_pre=bc_pre,
                   write_pos=pos[t], is_flush=flush[t], max_cache_len=RING, state_batch_indices=inp.ids, out=inp.out)
            else:
                replayssm.selective_state_update_replayssm(
                    c, inp.x[t], inp.dt[t], prm["A"], inp.B[t], inp.C[t], prm["D"], prm["dt_bias"],
                    inp.ids, inp.out, state_dtype=fmt, seed=args.seed,
                )  # fmt: skip
    else:
        from benchmarks.standard_decode import standard_decode, standard_decode_ref

        dtype = STD_DTYPES[provider]
        g = torch.Generator(device=device).manual_seed(args.seed + 5)
        reps = math.ceil(batch / states.shape[0])
        keep = []
        for _ in range(layers):
            st = torch.empty(batch + 1, *states.shape[1:], dtype=dtype, device=device)
            st[1:] = states.to(dtype).repeat(reps, 1, 1, 1)[:batch]
            st[0] = torch.randn(*states.shape[1:], device=device, generator=g).to(dtype)
            keep.append(st)
        fn = (functools.partial(standard_decode, block_p=args.block_p, num_warps=args.num_warps)
              if device.type == "cuda" else standard_decode_ref)  # fmt: skip

        def one(li, t):
            prm = inp.params[li]
            fn(keep[li], inp.x[t], inp.dt[t], prm["A"], inp.B[t], inp.C[t], prm["D"], prm["dt_bias"], inp.ids, inp.out)

    return [functools.partial(one, li, t) for t in range(RING) for li in range(layers)], keep


def time_period(steps, clock: Clock, graph: bool, reps: int) -> tuple[float, str]:
    """Median seconds of one whole period (all steps); ("graph" | "eager" | "cpu")."""

    def period():
        for s in steps:
            s()

    if not clock.cuda:  # smoke test: no warm-up needed (nothing compiles)
        return statistics.median(clock.time_each(period, reps)), "cpu"
    period()  # warm-up: compiles every variant (flush and non-flush steps)
    clock.sync()
    if not graph:
        return statistics.median(clock.time_each(period, reps)), "eager"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        period()
    g.replay()
    clock.sync()
    first = clock.time_each(g.replay, 1)[0]
    n = max(5, min(reps, int(1.0 / max(first, 1e-6))))
    t = statistics.median(clock.time_each(g.replay, n))
    del g
    return t, "graph"


def layers_for(provider, shape, batch, args, eager: bool) -> tuple[int, int]:
    """(layers in rotation, working-set bytes)."""
    s = bm.Shape(*shape)
    per_layer = batch * bm.cache_bytes_per_slot(BYTE_MODEL.get(provider, provider), s)
    inputs = RING * batch * (sum(bm.io_bytes(s).values()))
    target = args.ws_factor * args.l2_mb * 1e6
    cap = args.eager_max_layers if eager else args.max_layers
    layers = max(1, min(cap, math.ceil(max(target - inputs, 0) / per_layer)))
    return layers, layers * per_layer + inputs


def settle_row(ctx) -> dict:
    """Time one untimed row (the first ReplaySSM provider, batch 1) before the timed ones.

    At batch 1 a ReplaySSM row's time depends on what the process did before it (H200):
    the first ReplaySSM row timed in a process is the
    fastest (FP8 3.35-3.47 us per step, NVFP4 3.58-3.79), later ones are 0.4-0.7 us slower
    (FP8 3.87-4.04, NVFP4 4.02-4.26) with the SM clock at 1980 MHz throughout; the cause is
    not known (the allocation history, through the address layout of the 64 layers'
    caches, is a guess). After this row the reported rows no longer depend on the provider
    order (FP8 3.87 / 3.89 us, NVFP4 4.02 / 4.06 us with either provider first). Larger
    batches were not seen to move this way. Returns what `meta.settle_row` records."""
    args = ctx["args"]
    shape = args.shapes[0]
    row = run_row(next(p for p in args.providers if p in REPLAY), shape, 1, "desync", ctx)
    print(f"settle row (untimed): {row['provider']} b=1 {row['us_per_step']} us/step", flush=True)
    return {k: row[k] for k in ("provider", "batch", "us_per_step", "error")}


def new_row(provider, shape, batch, sync_mode, args, error=None) -> dict:
    """A results row before timing (`error`: why it is not timed)."""
    return {
        "provider": provider, "heads": shape[0], "groups": shape[1], "head_dim": shape[2], "state_dim": shape[3],
        "batch": batch, "sync": sync_mode if provider in RINGED else "-",
        "inputs": args.inputs if provider in RINGED else "plain", "timing": None, "layers": None,
        "working_set_mb": None, "l2_resident": None, "us_per_step": None,
        "bytes_per_step": batch * bm.step_bytes(BYTE_MODEL.get(provider, provider), bm.Shape(*shape)).total,
        "tb_per_s": None, "frac_copy_bw": None, "error": error, "note": None,
    }  # fmt: skip


def run_row(provider, shape, batch, sync_mode, ctx) -> dict:
    args, device, clock = ctx["args"], ctx["device"], ctx["clock"]
    row = new_row(provider, shape, batch, sync_mode, args, provider_skip(provider, shape, device))
    if row["error"]:
        return row
    graph = device.type == "cuda"
    if provider in REPLAY and graph:
        key = f"{provider}/{shape_label(shape)}"
        if key not in ctx["capturable"]:
            ctx["capturable"][key] = probe_capturable(provider, shape, ctx)
        ok, why = ctx["capturable"][key]
        if not ok or args.force_eager:
            graph = False
            row["note"] = "eager: " + (why if not ok else "--force-eager")
    layers, ws = layers_for(provider, shape, batch, args, eager=(device.type == "cuda" and not graph))
    row.update(layers=layers, working_set_mb=round(ws / 1e6, 2), l2_resident=ws < 2 * args.l2_mb * 1e6)
    try:
        t, timing, note, n_steps = _measure(provider, shape, batch, sync_mode, layers, graph, ctx)
        us = t / n_steps * 1e6
        row.update(timing=timing, us_per_step=us)
        row["note"] = note or row["note"]
        row["tb_per_s"] = row["bytes_per_step"] / (us * 1e-6) / 1e12
        row["frac_copy_bw"] = row["tb_per_s"] / ctx["copy"]["tb_per_s"]
    except Exception as e:  # noqa: BLE001 - one provider's failure must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["traceback"] = traceback.format_exc(limit=6)
    if provider in STANDARD:
        from benchmarks.standard_decode import default_config

        bp, nw = default_config(STD_DTYPES[provider])
        row.update(block_p=args.block_p or bp, num_warps=args.num_warps or nw)
    if device.type == "cuda":  # the row's tensors are gone: hand their memory back
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            row["error"] = (row["error"] or "") + f" | sync after row failed: {e!r}"
        torch.cuda.empty_cache()
    return row


def _measure(provider, shape, batch, sync_mode, layers, graph, ctx):
    """Build the row's caches and inputs and time them: (seconds per period, timing,
    note, steps per period). Everything allocated here is freed when it returns."""
    args, device, clock = ctx["args"], ctx["device"], ctx["clock"]
    inp = make_inputs(shape, batch, layers, device, args.seed, args.inputs if provider in RINGED else "plain")
    states = ctx["states"][shape]
    sync = sync_mode == "sync"
    steps, keep = build_steps(provider, shape, batch, layers, inp, device, states, sync, args)
    reps = args.reps if graph else args.eager_periods
    try:
        t, timing = time_period(steps, clock, graph, reps)
        return t, timing, None, len(steps)
    except Exception as e:  # noqa: BLE001 - a capture that fails falls back to eager
        if not graph:
            raise
        note = f"eager: capture failed: {type(e).__name__}: {str(e)[:200]}"
    clock.sync()
    del steps, keep
    steps, keep = build_steps(provider, shape, batch, layers, inp, device, states, sync, args)
    t, timing = time_period(steps, clock, False, args.eager_periods)
    return t, timing, note, len(steps)


# ----------------------------------------------------------------------------------------
# correctness checks (one small batch per provider and shape, before timing)


def check_standard(provider, shape, device, args) -> dict:
    from benchmarks.standard_decode import standard_decode, standard_decode_ref

    batch, (heads, _, P, N) = 8, shape
    inp = make_inputs(shape, batch, 1, device, args.seed + 7)
    st = (0.5 * torch.randn(batch + 1, heads, P, N, device=device)).to(STD_DTYPES[provider])
    st_ref = st.clone()
    prm = inp.params[0]
    common = (inp.x[0], inp.dt[0], prm["A"], inp.B[0], inp.C[0], prm["D"], prm["dt_bias"], inp.ids)
    y = standard_decode(st, *common, block_p=args.block_p, num_warps=args.num_warps).float()
    y_ref = standard_decode_ref(st_ref, *common).float()
    return {
        "check": f"{provider} {shape_label(shape, True)} vs PyTorch twin",
        "max_abs_err_y": float((y - y_ref).abs().max()), "max_abs_y": float(y_ref.abs().max()),
        "max_abs_err_state": float((st.float() - st_ref.float()).abs().max()),
        "max_abs_state": float(st_ref.float().abs().max()),
    }  # fmt: skip


def check_period(provider, shape, device, states, args) -> dict:
    """One period at batch 16 on `device`, the benchmark's own steps, against a PyTorch
    twin. ReplaySSM: desynchronized, against the reference decode on a clone of the same
    cache. vLLM's kernel: synchronized (empty rings; every row flushes at the 16th token),
    against the FP32 standard decode from the same (fp16) state: SQNR of the outputs and
    of the state after the flush."""
    from benchmarks.standard_decode import standard_decode_ref
    from replayssm import api, synthetic
    from replayssm import layout as L
    from replayssm import reference as ref

    batch, vllm = 16, provider == VLLM
    inp = make_inputs(shape, batch, 1, device, args.seed + 7)
    steps, (cache,) = build_steps(provider, shape, batch, 1, inp, device, states, vllm, args)
    twin = cache[L.CHECKPOINT].float() if vllm else [t.clone() for t in cache]
    prm = inp.params[0]
    ys, refs = [], []
    for t, step in enumerate(steps):
        step()
        ys.append(inp.out.float())
        y_ref = torch.empty_like(inp.out)
        if vllm:
            standard_decode_ref(twin, inp.x[t], inp.dt[t], prm["A"], inp.B[t], inp.C[t], prm["D"], prm["dt_bias"],
                                inp.ids, y_ref)  # fmt: skip
        else:
            norm = api.normalize_decode_inputs(inp.x[t], inp.dt[t], prm["A"], inp.B[t], inp.C[t], prm["D"],
                                               prm["dt_bias"], batch, *shape)  # fmt: skip
            ref.decode(twin, *norm, inp.ids, y_ref, fmt=FORMATS[provider.split("-")[1]], seed=args.seed)
        refs.append(y_ref.float())
    y, y_ref = torch.stack(ys), torch.stack(refs)
    out = {"check": f"{provider} {shape_label(shape, True)} one period vs "
                    + ("the FP32 standard decode (PyTorch)" if vllm else "reference"),
           "max_abs_err_y": float((y - y_ref).abs().max()), "max_abs_y": float(y_ref.abs().max()),
           "sqnr_y_db": synthetic.sqnr_db(y_ref, y)}  # fmt: skip
    if vllm:
        out["sqnr_state_db"] = synthetic.sqnr_db(twin[1:], cache[L.CHECKPOINT][1:].float())
    return out


# ----------------------------------------------------------------------------------------
# reporting


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_<dtype>: the standard decode's time at the row's shape and batch over the
    row's; with vLLM rows, speedup_vs_vllm_fp16: vLLM's at the same flush alignment too."""
    base = {(r["provider"], row_shape(r), r["batch"], r["sync"]): r["us_per_step"] for r in rows}
    vllm = any(r["provider"] == VLLM for r in rows)
    for r in rows:
        for sp in STANDARD + ((VLLM,) if vllm else ()):
            b = base.get((sp, row_shape(r), r["batch"], r["sync"] if sp == VLLM else "-"))
            key = "speedup_vs_" + sp.split("-")[1] if sp in STANDARD else "speedup_vs_vllm_fp16"
            r[key] = b / r["us_per_step"] if (b and r["us_per_step"]) else None


def fmt_table(rows: list[dict], copy_tbs: float) -> str:
    labels = [shape_label(row_shape(r), table=True) for r in rows]
    vllm = any(r["provider"] == VLLM for r in rows)
    cols = [("shape", max([7, *map(len, labels)])), ("batch", 5), ("provider", 19 if vllm else 16), ("sync", 6),
            ("timing", 6), ("lay", 3), ("us/step", 9), ("MB/step", 8), ("TB/s", 6), ("%copy", 6), ("x fp32", 6),
            ("x bf16", 6), ("x fp16", 6)] + ([("x vllm", 6)] if vllm else [])  # fmt: skip
    lines = [f"copy bandwidth: {copy_tbs:.3f} TB/s (2 x bytes / time)",
             "  ".join(f"{c:>{w}}" for c, w in cols)]  # fmt: skip

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r, label in zip(rows, labels):
        cells = [label, str(r["batch"]), r["provider"], r["sync"], r["timing"] or "-",
                 f(r["layers"], "d"), f(r["us_per_step"], ".2f"), f(r["bytes_per_step"] / 1e6, ".3f"),
                 f(r["tb_per_s"], ".3f"), f(None if r["frac_copy_bw"] is None else 100 * r["frac_copy_bw"], ".1f"),
                 f(r.get("speedup_vs_fp32"), ".2f"), f(r.get("speedup_vs_bf16"), ".2f"),
                 f(r.get("speedup_vs_fp16"), ".2f"), f(r.get("speedup_vs_vllm_fp16"), ".2f")]  # fmt: skip
        line = "  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols))
        if r["l2_resident"]:
            line += "  (L2)"
        if r["error"]:
            line += ("  " if r["error"].startswith("skipped") else "  ERROR ") + r["error"][:120]
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str | None:
    """decode.png: us per step and fraction of copy bandwidth against batch, one column per
    shape. Returns None, or why no plot was written (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    shapes = sorted({row_shape(r) for r in rows})
    colors = dict(zip(PROVIDERS, ["tab:blue", "tab:green", "tab:cyan", "tab:red", "tab:orange", "tab:purple",
                                  "tab:brown"]))  # fmt: skip
    fig, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 8.5), squeeze=False)
    for c, (h, g, hd, sd) in enumerate(shapes):
        series = {}
        for r in rows:
            if row_shape(r) == (h, g, hd, sd) and r["us_per_step"]:
                series.setdefault((r["provider"], r["sync"], r["timing"]), []).append(
                    (r["batch"], r["us_per_step"], r["frac_copy_bw"]))
        top = 1.05
        for (prov, sync, timing), pts in sorted(series.items()):
            pts.sort()
            label = prov + ("" if sync == "-" else f" ({sync})") + (" [eager]" if timing == "eager" else "")
            kw = dict(color=colors.get(prov), linestyle="--" if sync == "sync" else "-",
                      marker="s" if timing == "eager" else "o", label=label)  # fmt: skip
            bs = [p[0] for p in pts]
            axes[0][c].plot(bs, [p[1] for p in pts], **kw)
            axes[1][c].plot(bs, [p[2] for p in pts], **kw)
            top = max(top, 1.05 * max(p[2] for p in pts))
        batches = sorted({r["batch"] for r in rows})
        geo = "" if (hd, sd) == (64, 128) else f", P {hd}, N {sd}"
        axes[0][c].set(xscale="log", yscale="log", ylabel="us per step (one layer)",
                       title=f"{h} heads, {g} group{'s' if g > 1 else ''}{geo}; whole 16-token periods")  # fmt: skip
        axes[1][c].set(xscale="log", xlabel="batch", ylabel="fraction of copy bandwidth", ylim=(0, top))
        for ax in axes[:, c]:
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.grid(True, which="both", alpha=0.3)
        axes[0][c].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------
# tuning of the baseline


def tune_standard(ctx) -> list[dict]:
    args, device, clock = ctx["args"], ctx["device"], ctx["clock"]
    out = []
    for shape in args.shapes:
        for prov in [p for p in args.providers if p in STANDARD]:
            for batch in args.batches:
                for bp in [bp for bp in (8, 16, 32, 64) if shape[2] % bp == 0]:  # BLOCK_P divides P
                    for nw in (1, 2, 4, 8):
                        args.block_p, args.num_warps = bp, nw
                        if time.perf_counter() - ctx["t_start"] > args.time_budget:
                            r = new_row(prov, shape, batch, "-", args, "skipped: --time-budget exhausted")
                        else:
                            r = run_row(prov, shape, batch, "-", ctx)
                        r.update(block_p=bp, num_warps=nw)
                        out.append(r)
                        print(f"{prov:14s} {shape_label(shape, True)} b={batch:5d} BLOCK_P={bp:2d} warps={nw} "
                              f"{r['us_per_step'] or float('nan'):9.2f} us  "
                              f"{100 * (r['frac_copy_bw'] or 0):5.1f}% copy  {r['error'] or ''}", flush=True)  # fmt: skip
    args.block_p = args.num_warps = None
    return out


# ----------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.replot:  # e.g. results from a GPU machine without matplotlib
        result = json.loads(Path(args.replot).read_text())
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        print(fmt_table(result["rows"], result["meta"]["copy_bandwidth"]["tb_per_s"]))
        why = plot(result["rows"], out_dir / "decode.png")
        print(why or f"wrote {out_dir / 'decode.png'}")
        return result
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device: run with --dry-run for the CPU smoke test")
    clock = Clock(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)

    ctx = {"args": args, "device": device, "clock": clock, "t_start": t_start}
    ctx["copy"] = copy_bandwidth(device, args.copy_gib, 10 if device.type == "cuda" else 3)
    ctx["capturable"] = {}
    ctx["states"] = {s: base_states(s[0], s[1], 16, device, args.seed, *s[2:]) for s in args.shapes}
    if VLLM in args.providers and device.type == "cuda":
        vllm_kernel(args.peers)  # a missing or broken peer tree ends the run here, before any row
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": version("triton"),
        "dry_run": args.dry_run,
        "copy_bandwidth": ctx["copy"],
        "replayssm_backend": backend_name(device),
        "replayssm_capturable": ctx["capturable"],  # filled as rows run
        "args": {k: v for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result = {"meta": meta, "byte_model": {}, "checks": [], "rows": []}
    for shape in args.shapes:
        for prov in args.providers:
            result["byte_model"][f"{prov}/{shape_label(shape)}"] = {
                **bm.describe(BYTE_MODEL.get(prov, prov), bm.Shape(*shape)), "provider": prov}

    if args.tune_standard:
        if device.type != "cuda":
            raise SystemExit("--tune-standard needs a GPU")
        result["tuning"] = tune_standard(ctx)
        write_json(result, out_dir / "tuning.json")
        return result

    if not args.no_check and device.type == "cuda":  # on the CPU both sides are the reference
        for shape in args.shapes:
            for prov in [p for p in args.providers if not provider_skip(p, shape, device)]:
                try:
                    if prov in STANDARD:
                        result["checks"].append(check_standard(prov, shape, device, args))
                    else:
                        result["checks"].append(check_period(prov, shape, device, ctx["states"][shape], args))
                except Exception as e:  # noqa: BLE001
                    result["checks"].append({"check": f"{prov} {shape_label(shape)}",
                                             "error": f"{type(e).__name__}: {e}"})  # fmt: skip
        for c in result["checks"]:
            print("check:", json.dumps(c), flush=True)

    if not args.no_settle and device.type == "cuda" and any(p in REPLAY for p in args.providers):
        meta["settle_row"] = settle_row(ctx)

    # The most telling batch sizes first, so a --time-budget cut loses the least; the
    # table and JSON are sorted afterwards.
    order = sorted(args.batches, key=lambda b: (BATCH_PRIORITY.index(b) if b in BATCH_PRIORITY else 99, b))
    plan = []
    for batch in order:
        for shape in args.shapes:
            for prov in args.providers:
                for sync_mode in args.sync if prov in RINGED else ["-"]:
                    plan.append((prov, shape, batch, sync_mode))
    for prov, shape, batch, sync_mode in plan:
        if time.perf_counter() - t_start > args.time_budget:
            row = new_row(prov, shape, batch, sync_mode, args, "skipped: --time-budget exhausted")
        else:
            row = run_row(prov, shape, batch, sync_mode, ctx)
        result["rows"].append(row)
        print(f"{prov:16s} {shape_label(shape, True):>7s} b={batch:5d} {row['sync']:6s} {row['timing'] or '-':5s} "
              f"layers={row['layers'] or 0:3d} "
              + (f"{row['us_per_step']:10.2f} us/step  {100 * row['frac_copy_bw']:5.1f}% copy"
                 if row["us_per_step"] else f"ERROR {row['error']}"), flush=True)  # fmt: skip
        write_json(result, out_dir / "results.json")  # partial results survive a crash or a kill

    rank = {p: i for i, p in enumerate(args.providers)}
    result["rows"].sort(key=lambda r: (args.shapes.index(row_shape(r)), r["batch"], rank[r["provider"]], r["sync"]))
    add_speedups(result["rows"])
    meta["seconds"] = time.perf_counter() - t_start
    print()
    print(fmt_table(result["rows"], ctx["copy"]["tb_per_s"]))
    write_json(result, out_dir / "results.json")
    why = plot(result["rows"], out_dir / "decode.png")
    meta["plot"] = why or str(out_dir / "decode.png")
    write_json(result, out_dir / "results.json")
    print(f"\nwrote {out_dir / 'results.json'}; {meta['plot']}; {meta['seconds']:.1f} s")
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
