"""Eager decode steps of one layer, for a kernel profiler to attach to (GPU; CPU runs the
PyTorch reference, for its test).

A `fmt` cache of `batch` live slots at ring positions i mod 16 (bench_kernels.make_layer:
1/16 of the rows flush each step), then `--steps` eager calls of
`selective_state_update_replayssm`, cycling through four tokens. Every step launches the
prepare kernel, the flush and the non-flush kernel, so ncu can pick kernels by name and
launch index (two CuTe kernels a step). A profile as docs/design.md (section 3) uses:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section SchedulerStats --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section InstructionStats \\
        -k "regex:cutedecodeDecode|cuteflushFlush" --launch-skip 32 -c 4 --page raw --csv \\
        python benchmarks/profile_steps.py nvfp4 1024

(one kernel's name alone with `--launch-skip 16 -c 2`.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.bench_kernels import make_layer  # noqa: E402
from replayssm.api import selective_state_update_replayssm  # noqa: E402
from replayssm.synthetic import layer_params, token  # noqa: E402


def run_steps(fmt: str, batch: int, steps: int, heads: int = 16, groups: int = 2, device: str = "cuda"):
    """Build the layer and run `steps` eager decode steps; returns (cache, ids, out)."""
    p = layer_params(heads, generator=torch.Generator().manual_seed(0), device=device)
    cache, ids = make_layer(fmt, batch, heads, groups, 128, torch.Generator(device).manual_seed(0), device)
    out = torch.empty(batch, heads, 64, dtype=torch.bfloat16, device=device)
    toks = [token(batch, heads, groups, generator=torch.Generator().manual_seed(1 + k), device=device) for k in range(4)]
    for i in range(steps):
        t = toks[i % 4]
        selective_state_update_replayssm(cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, ids, out, state_dtype=fmt, seed=0)
    if device != "cpu":
        torch.cuda.synchronize()
    return cache, ids, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fmt", choices=("fp8", "nvfp4"))
    ap.add_argument("batch", type=int)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    run_steps(args.fmt, args.batch, args.steps, args.heads, args.groups, args.device)


if __name__ == "__main__":
    main()
