"""Static SASS statistics of every CuTe DSL decode kernel variant (no GPU needed).

The decode kernels are bound by memory latency (FP8) or instruction issue (NVFP4 on
sm_90a; docs/design.md). Their code is almost straight-line (every loop is unrolled at
compile time), so the static instruction count of a kernel tracks its dynamic count per
warp (the sm_90a FP8 non-flush kernel: 863 static, NOPs excluded, and about 855 executed
a warp by ncu at 16 heads, batch 1024: 13.14 M warp-instructions over 15,360 non-flush
warps), and changes to it can be weighed on a CPU before a GPU run. For each variant `compile_all` writes, this prints registers, spill stack, the
total SASS instruction count and the counts of the instruction classes that matter
(global and shared memory, barriers, shuffles, tensor-core MMAs, conversions, FP32 math,
integer address math).

    python benchmarks/sass_stats.py                      # sm_90a, every variant
    python benchmarks/sass_stats.py --arch sm_100a --only decode_fp8 --opcodes 15

Uses the cuobjdump that ships with Triton (or --cuobjdump PATH).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

# Instruction classes: (column, opcode prefixes).
CLASSES = [
    ("LDG", ("LDG", "LDGSTS")),
    ("STG", ("STG",)),
    ("LDS", ("LDS",)),
    ("STS", ("STS",)),
    ("BAR", ("BAR",)),
    ("SHFL", ("SHFL",)),
    ("MMA", ("HMMA", "IMMA", "QMMA")),
    ("CVT", ("F2FP", "F2F", "I2F", "F2I", "HADD2")),
    ("FP32", ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "MUFU")),
    ("INT", ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "SEL", "PRMT", "IABS", "VIADD", "VIMNMX")),
]
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?")


def default_cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def cubin_stats(cubin: Path, cuobjdump: str) -> dict:
    """Registers, stack bytes, total instructions and opcode counts of one cubin."""
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(1) for m in map(_INSTR.search, sass.splitlines()) if m)
    ops.pop("NOP", None)
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "stack": int(stack.group(1)) if stack else -1,
        "total": sum(ops.values()),
        "ops": ops,
    }


def classify(ops: collections.Counter) -> dict:
    return {name: sum(n for op, n in ops.items() if op.startswith(prefixes)) for name, prefixes in CLASSES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a", choices=["sm_90a", "sm_100a", "sm_103a"])
    ap.add_argument("--only", default=None, help="variants whose folder name contains this")
    ap.add_argument("--opcodes", type=int, default=0, help="also list the N most frequent opcodes per variant")
    ap.add_argument("--cuobjdump", default=None)
    args = ap.parse_args()
    from replayssm.kernels import compile_all

    tool = args.cuobjdump or default_cuobjdump()
    with tempfile.TemporaryDirectory() as d:
        cubins = sorted(Path(p) for p in compile_all(args.arch, d) if p.endswith(".cubin"))
        cols = [name for name, _ in CLASSES]
        print(f"{'variant':28}{'regs':>5}{'stack':>6}{'total':>7}" + "".join(f"{c:>6}" for c in cols))
        for cubin in cubins:
            name = cubin.parent.name
            if args.only and args.only not in name:
                continue
            st = cubin_stats(cubin, tool)
            cls = classify(st["ops"])
            print(f"{name:28}{st['regs']:>5}{st['stack']:>6}{st['total']:>7}" + "".join(f"{cls[c]:>6}" for c in cols))
            if args.opcodes:
                print("    " + ", ".join(f"{op} {n}" for op, n in st["ops"].most_common(args.opcodes)))


if __name__ == "__main__":
    main()
