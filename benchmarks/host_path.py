"""The host (Python) time of an eager `ReplaySSMCache.decode` on the kernel backend, on the
CPU: the path an eager GPU call takes (cache.decode -> api.direct_decode ->
KernelBackend.decode -> the context's PrepareLaunch and Step) with the three compiled
CuTe entries replaced by no-ops, so what is left is the Python around the launches and,
with `--entries ffi` (the default where TVM-FFI has it), the conversion of each launch's
arguments: the no-op is then TVM-FFI's own C function `testing.nop`, which takes its
arguments as a compiled entry does (a tuple becomes an ffi.Array on every call).

A CPU tensor cannot be made a CUDA one, so the path is given CPU tensors that claim to
be: once the tensors are made, `torch.Tensor.device` and `.is_cuda` are patched (a cuda:0
device; `get_device()` stays -1 for every tensor, so the device checks agree). Stubbed as
well: the compiled entries (the prepare entry behind an lru_cache, as the real one), the
SM count, the current-stream query (`abs`, a C call as torch's), torch's capture query
(`bool`, a C call returning False) and the side stream's fork and join. A first call on
a twin cache checks that a call launches three kernels. Inputs shaped as an engine
passes them (`synthetic.engine_inputs`) or plain. Printed: the minimum and the median
over rounds of the mean time a call (thread CPU time, which a busy machine perturbs less
than wall time).

    python benchmarks/host_path.py                    # fp8, 16h/2g, batch 1 and 256, engine inputs
    python benchmarks/host_path.py --entries python   # Python no-ops: the Python alone
    python benchmarks/host_path.py --profile          # cProfile of the calls instead
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # backend="kernels" on a CPU cache
os.environ.setdefault("REPLAYSSM_ARCH", "sm_90a")  # a CuTe target without a GPU

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import tvm_ffi  # noqa: E402

from replayssm import ReplaySSMCache  # noqa: E402
from replayssm import layout as L  # noqa: E402
from replayssm.kernels.cute import launch, plan  # noqa: E402
from replayssm.synthetic import engine_inputs, layer_params, plain_inputs, token  # noqa: E402

LAUNCHES = [0]
FFI_NOP = tvm_ffi.get_global_func("testing.nop", allow_missing=True)


def _count(*args) -> None:
    LAUNCHES[0] += 1


def stub_cuda(entry) -> None:
    """Replace the compiled entries by `entry` and the CUDA-only calls of the path (see above)."""
    launch.compiled_decode = lambda *a, **k: entry
    launch.compiled_flush = lambda *a, **k: entry
    launch._sm_count = lambda index: 132
    plan.compiled_prepare = functools.lru_cache(maxsize=None)(lambda *key: entry)
    launch.current_stream = abs
    torch.cuda.graphs._cuda_isCurrentStreamCapturing = bool
    launch._side_stream = lambda index: (1, None, None, None)
    launch._record_wait = lambda event, first, second: None
    cuda = torch.device("cuda", 0)
    torch.Tensor.device = property(lambda self: cuda)
    torch.Tensor.is_cuda = property(lambda self: True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fmt", default="fp8", choices=["fp8", "nvfp4", "fp16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--inputs", default="engine", choices=["engine", "plain"])
    p.add_argument("--entries", default="ffi" if FFI_NOP is not None else "python", choices=["ffi", "python"])
    p.add_argument("--calls", type=int, default=2000, help="calls a round")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    heads, groups = 16, 2

    def case(batch: int):
        """One cache's decode call (made before the stubs: real CPU tensors)."""
        cache = ReplaySSMCache(max(args.batch) + 1, heads, groups, args.fmt, "cpu", backend="kernels")
        object.__setattr__(cache, "_direct", True)  # as a CUDA cache on the kernel backend has it
        gen = torch.Generator().manual_seed(0)
        tok = token(batch, heads, groups, generator=gen)
        params = layer_params(heads, generator=gen)
        inputs = engine_inputs(tok, params) if args.inputs == "engine" else plain_inputs(tok, params)
        out = torch.empty(batch, heads, L.HEAD_DIM, dtype=torch.bfloat16)
        return functools.partial(cache.decode, *inputs, cache.allocate(batch), out=out)

    cases = [(batch, case(batch), case(batch)) for batch in args.batch]  # (batch, counted call, timed call)
    stub_cuda(_count)
    for batch, counted, _ in cases:
        LAUNCHES[0] = 0
        counted()
        assert LAUNCHES[0] == 3, f"a call launched {LAUNCHES[0]} kernels, not prepare, flush and non-flush"
    launch._kernels.cache_clear()  # the timed caches' steps resolve the timed entries
    stub_cuda(FFI_NOP if args.entries == "ffi" else (lambda *a: None))
    for batch, _, call in cases:
        call()
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(lambda: [call() for _ in range(args.calls * args.rounds)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        per_call = []
        for _ in range(args.rounds):
            t0 = time.thread_time()
            for _ in range(args.calls):
                call()
            per_call.append((time.thread_time() - t0) / args.calls * 1e6)
        print(f"{args.fmt} batch {batch} {args.inputs} inputs, {args.entries} entries: {min(per_call):.2f} us a call (min), "
              f"{statistics.median(per_call):.2f} (median of {args.rounds} rounds x {args.calls} calls)")  # fmt: skip


if __name__ == "__main__":
    main()
