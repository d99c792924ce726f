"""Helpers the benchmark scripts share: the run's metadata and results files, the
realistic prefill states rows start from, and the CUDA-graph timer."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

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


def base_states(heads, groups, n, device, seed) -> torch.Tensor:
    """n realistic FP32 prefill states (exact recurrence over a short random prompt)."""
    from replayssm import synthetic

    gc = torch.Generator().manual_seed(seed + 2)
    params = synthetic.layer_params(heads, generator=gc)
    return synthetic.prefill_states(params, n, groups, 8, generator=gc).to(device)


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
