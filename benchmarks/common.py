"""Helpers the benchmark scripts share: the run's metadata and results files, the
--shapes geometries, the realistic prefill states rows start from, the CUDA-graph timer
and the copy-bandwidth probe."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from time import perf_counter

import torch

ROOT = Path(__file__).resolve().parent.parent


def commit(root: Path = ROOT) -> str | None:
    """The short commit of the source checkout at `root`, with "+dirty" when its tracked
    files differ from that commit (a copied tree whose .git lags, an uncommitted change);
    None outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if diff.returncode == 1 else "")


def version(mod: str) -> str | None:
    """`mod.__version__`, None when it cannot be imported."""
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return None


def write_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """A --shapes list: comma-separated "HxG" (head dim 64, state dim 128) or "HxGxPxN"
    items, as (heads, groups, P, N); a ValueError names an item that is neither or no
    cache geometry."""
    from replayssm.geometry import HEAD_DIM, STATE_DIM, dims_error, group_error

    out = []
    for item in str(text).split(","):
        parts = item.strip().lower().split("x") if item.strip() else []
        if not parts:
            continue
        if len(parts) not in (2, 4) or not all(p.isdigit() for p in parts):
            raise ValueError(f"shape {item!r}: expected HEADSxGROUPS or HEADSxGROUPSxHEADDIMxSTATEDIM")
        shape = tuple(map(int, parts)) + (HEAD_DIM, STATE_DIM)[len(parts) - 2 :]
        err = group_error(*shape[:2]) or dims_error(*shape[2:])
        if err:
            raise ValueError(f"shape {item!r}: {err}")
        out.append(shape)
    return out


def shape_label(shape, table: bool = False) -> str:
    """A (heads, groups, P, N) shape as --shapes spells it ("16x2" at P, N = 64, 128, else
    "48x1x64x256"), or with `table` as the tables do ("16h2g", "48h1g/64x256")."""
    h, g, p, n = shape
    tail = "" if (p, n) == (64, 128) else (f"/{p}x{n}" if table else f"x{p}x{n}")
    return (f"{h}h{g}g" if table else f"{h}x{g}") + tail


def row_shape(row: dict) -> tuple[int, int, int, int]:
    """A results row's (heads, groups, P, N); rows written before P and N were recorded are 64 / 128."""
    return row["heads"], row["groups"], row.get("head_dim", 64), row.get("state_dim", 128)


def base_states(heads, groups, n, device, seed, head_dim: int = 64, state_dim: int = 128) -> torch.Tensor:
    """n realistic FP32 prefill states (exact recurrence over a short random prompt; the
    random draws on the CPU, the FP64 recurrence on `device`: at 256 heads and N = 256
    it takes seconds on a CPU)."""
    from replayssm import synthetic

    gc = torch.Generator().manual_seed(seed + 2)
    params = synthetic.layer_params(heads, generator=gc)
    return synthetic.prefill_states(params, n, groups, 8, generator=gc, device=device, head_dim=head_dim,
                                    state_dim=state_dim)  # fmt: skip


def graph_seconds(fn, reps: int, inner: int = 1) -> float:
    """GPU seconds per call of `fn`: a call outside the capture (compiles, builds tables,
    warms allocators) and one on a side stream, as torch's graph docs do, then `inner`
    calls captured in one CUDA graph; median of `reps` replays timed with CUDA events,
    divided by `inner`."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    seconds = replay_seconds(graph, reps) / inner
    del graph
    return seconds


def replay_seconds(graph, reps: int) -> float:
    """Median GPU seconds of one replay of a captured CUDA graph: one warm replay, then
    `reps` replays timed with CUDA events."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device | str, gib: float, reps: int = 10) -> dict:
    """The copy bandwidth every benchmark states its fractions against: a device-to-device
    copy of a `gib` GiB buffer, launched eagerly (3 warm-up copies) and timed one by one
    with CUDA events (perf_counter on the CPU), the median of `reps`; bandwidth = 2 *
    bytes / time (read + write). Eagerly because the same copy captured in a CUDA graph
    runs slower: on the H200, in one call, 2.66 TB/s captured against 4.15 eager."""
    device = torch.device(device)
    n = int(gib * 2**30) // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            dst.copy_(src)
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) * 1e-3 for start, end in events]
    else:
        for _ in range(reps):
            t0 = perf_counter()
            dst.copy_(src)
            times.append(perf_counter() - t0)
    del src, dst
    t = statistics.median(times)
    return {"bytes": 4 * n, "seconds": t, "tb_per_s": 2 * 4 * n / t / 1e12}

