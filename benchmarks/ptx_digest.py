"""SHA-256 of the PTX of every CuTe kernel variant, compile-only (no GPU needed).

The guard of "no behaviour change" refactors of the kernels (plumbing only): run it on
the base commit and on the change, the printed lines must be equal. It compiles, for each
arch, the variants the compile tests build:

- `decode` / `flush`: every variant `compile_all` builds (each format, COMPILE_ALL_GEOMETRIES);
- `pending`: the pending step (bf16 dt) and fold of each format at 16 heads / 2 groups
  (tests/test_cute_pending_compile.py), and the step's `rest` / `fold` row filters;
- `bookkeeping`: initialize of each format (rows and elements) and clear, 3 heads a group,
  two position words (tests/test_triton_bookkeeping.py);
- `plan`: the prepare and pending plan kernels of tests/test_triton_bookkeeping.py.

Lines printed: `<arch> <variant> <sha256>`; the digest is over the PTX with `//` comment
lines and `.file` / `.loc` debug lines dropped (none vary today; dropped so that a path
or a compiler banner never does). Usage:

    python benchmarks/ptx_digest.py [--arch sm_90a ...] [--only decode flush ...] [-j 2] > /tmp/ptx.txt
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# The checkout this script lies in, not whatever `replayssm` the environment has installed
# (run as a script, sys.path[0] is benchmarks/, so `import replayssm` found the installed one).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# No cached compile results: every PTX comes from this checkout's source.
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

ARCHS = ("sm_90a", "sm_100a", "sm_103a")
KINDS = ("decode", "flush", "pending", "bookkeeping", "plan")
_DROP = re.compile(r"^\s*(//|\.file\b|\.loc\b)")


def digest(text: str) -> str:
    kept = "\n".join(line for line in text.splitlines() if not _DROP.match(line))
    return hashlib.sha256(kept.encode()).hexdigest()


def variants(arch: str, kinds) -> list[tuple[str, tuple]]:
    """[(name, recipe)]: a recipe is a picklable description `_build` turns into the
    kernel object and its fake arguments."""
    from replayssm.kernels.cute.launch import COMPILE_ALL_GEOMETRIES, STATE_DTYPES, _variants

    out = []
    for state_dtype in STATE_DTYPES:
        for heads, groups in COMPILE_ALL_GEOMETRIES:
            for name, (kind, cfg) in _variants(arch, state_dtype, heads, groups).items():
                if kind in kinds:
                    out.append((name, ("step", kind, cfg)))
    if "pending" in kinds:
        for fmt in STATE_DTYPES:
            out.append((f"pending-step-{fmt}-h16g2", ("pending", fmt, "all")))
            out.append((f"pending-fold-{fmt}-h16g2", ("fold", fmt)))
            for rows in ("rest", "fold"):
                out.append((f"pending-step-{fmt}-h16g2-{rows}", ("pending", fmt, rows)))
    if "bookkeeping" in kinds:
        for fmt in ("fp8", "nvfp4", "fp16", None):
            for vec in (False, True) if fmt else (False,):
                out.append((f"bookkeeping-{fmt or 'clear'}-{'rows' if vec else 'elements'}", ("bookkeeping", fmt, vec)))
    if "plan" in kinds:
        out.append(("plan-prepare", ("prepare",)))
        out.append(("plan-pending", ("pending_plan",)))
    return out


def _build(recipe, arch):
    import torch

    if recipe[0] == "step":
        from replayssm.kernels.cute.launch import decode_kernel, flush_kernel

        _, kind, cfg = recipe
        return decode_kernel(cfg) if kind == "decode" else flush_kernel(cfg)
    if recipe[0] == "pending":
        from replayssm.kernels.cute.pending import pending_kernel

        return pending_kernel(recipe[1], arch, 16, 2, torch.bfloat16, recipe[2])
    if recipe[0] == "fold":
        from replayssm.kernels.cute.pending import fold_kernel

        return fold_kernel(recipe[1], arch, 16, 2)
    if recipe[0] == "bookkeeping":
        from replayssm.kernels.cute.bookkeeping import bookkeeping_kernel

        return bookkeeping_kernel(recipe[1], arch, 3, 2, torch.int32, recipe[2])
    from replayssm.kernels.cute import plan as P

    if recipe[0] == "prepare":
        return P.prepare_kernel(4, 1024, True, True, torch.int32)
    return P.pending_plan_kernel(4, 4, True, True, True, torch.int64, torch.int32)


def _one(job) -> tuple[str, str, str, float]:
    arch, name, recipe, root = job
    from replayssm.kernels.cute.launch import compile_into

    t0 = time.perf_counter()
    obj, fake = _build(recipe, arch)
    paths = compile_into(obj, fake, arch, Path(root) / arch / name)
    ptx = [p for p in paths if p.endswith(".ptx")]
    assert len(ptx) == 1, (arch, name, paths)
    return arch, name, digest(Path(ptx[0]).read_text()), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=list(ARCHS))
    ap.add_argument("--only", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("--keep", help="folder for the PTX / cubins (default: a temporary one)")
    args = ap.parse_args(argv)
    import replayssm

    print(f"# replayssm from {Path(replayssm.__file__).parent}", file=sys.stderr)
    if Path(replayssm.__file__).resolve().parent.parent != ROOT:
        raise SystemExit(f"imported replayssm from {replayssm.__file__}, not from {ROOT}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        jobs = [(arch, name, recipe, root) for arch in args.arch for name, recipe in variants(arch, set(args.only))]
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                results = list(pool.map(_one, jobs))
        else:
            results = [_one(j) for j in jobs]
    for arch, name, sha, _ in sorted(results):
        print(arch, name, sha)
    total = time.perf_counter() - t0
    print(f"# {len(results)} variants in {total:.0f} s (compile time summed {sum(r[3] for r in results):.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
