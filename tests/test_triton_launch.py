"""The direct launch of compiled Triton kernels (kernels/triton/launch.py `param_layout`,
`Compiled`): the parameter slots read from a kernel's signature must be exactly the
parameters of its PTX entry, else the launch stays Triton's. The GPU tests of the
bookkeeping kernels (test_triton_bookkeeping.py) check the launches' bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from replayssm.kernels.triton.launch import param_layout

_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from replayssm.kernels.triton.launch import param_layout
from replayssm.kernels.triton.prepare import _prepare_kernel

consts = {"G": 2, "BLOCK_G": 2, "OUT_ROW": 1024, "BLOCK_OUT": 1024, "NVFP4": True, "TRIGGER": True}
names = _prepare_kernel.arg_names
sig = {n: "constexpr" if n in consts else ("*i64" if n.startswith("p_") else "i32") for n in names}
k = triton.compile(ASTSource(fn=_prepare_kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", k.asm["ptx"], re.S).group(1)
print(json.dumps({"sig": list(sig.values()), "ptx": re.findall(r"\.param\s+\.(\w+)", entry), "layout": param_layout(k)}))
"""


def test_prepare_kernel_parameters_match_its_ptx_entry():
    """The prepare kernel compiled for sm_90a (a subprocess: no interpreter): one 8-byte
    slot per non-constexpr argument in order (pointers and 64-bit values whole, int32
    in the low half), then the scratch pointers Triton appends, as the PTX declares."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    args = [(i, t) for i, t in enumerate(out["sig"]) if t != "constexpr"]
    want_fmt = "<" + "".join("Q" if t.startswith("*") else "i4x" for _, t in args)
    fmt, take, count = out["layout"]
    assert fmt == want_fmt and take == [i for i, _ in args]
    assert count == len(out["ptx"]) and 0 <= count - len(args) <= 2
    assert out["ptx"][: len(args)] == ["u64" if t.startswith("*") else "u32" for _, t in args]


def _fake(sig, ptx_params, **meta):
    ptx = ".visible .entry k(\n" + ",\n".join(f"\t.param .{t} k_param_{i}" for i, t in enumerate(ptx_params)) + "\n)\n{\n}"
    md = {"name": "k", "num_ctas": 1, "launch_pdl": False, "launch_cooperative_grid": False, "global_scratch_size": 0,
          "profile_scratch_size": 0, **meta}  # fmt: skip
    return SimpleNamespace(src=SimpleNamespace(signature=sig, fn=SimpleNamespace(arg_names=list(sig))),
                           metadata=SimpleNamespace(**md), asm={"ptx": ptx})  # fmt: skip


SIG = {"p_a": "*fp32", "n": "i32", "BLOCK": "constexpr", "big": "i64", "scale": "fp32"}


def test_param_layout_reads_slots_from_the_signature():
    assert param_layout(_fake(SIG, ["u64", "u32", "u64", "f32", "u64", "u64"])) == ("<Qi4xqf4x", (0, 1, 3, 4), 6)
    assert param_layout(_fake(SIG, ["u64", "u32", "u64", "f32"])) == ("<Qi4xqf4x", (0, 1, 3, 4), 4)


@pytest.mark.parametrize(
    "sig, ptx, meta",
    [
        (SIG, ["u64", "u32", "u64"], {}),  # a parameter fewer than the arguments
        (SIG, ["u64", "u32", "u64", "f32", "u64", "u64", "u64"], {}),  # three extra
        (SIG, ["u64", "u64", "u64", "f32"], {}),  # an int32 declared 64-bit
        (SIG, ["u64", "u32", "u64", "f32", "u32"], {}),  # an extra that is not a pointer
        (SIG, ["u64", "u32", "u64", "f32", "u64", "u64"], {"global_scratch_size": 64}),  # needs scratch
        (SIG, ["u64", "u32", "u64", "f32", "u64", "u64"], {"launch_pdl": True}),  # a launch attribute
        (SIG, ["u64", "u32", "u64", "f32", "u64", "u64"], {"num_ctas": 2}),
        (SIG, ["u64", "u32", "u64", "f32", "u64", "u64"], {"name": "other"}),  # no entry of its name
        ({**SIG, "flag": "i1"}, ["u64", "u32", "u64", "f32", "u8", "u64", "u64"], {}),  # a type without a slot rule
    ],
)
def test_param_layout_refuses_what_it_cannot_prove(sig, ptx, meta):
    assert param_layout(_fake(sig, ptx, **meta)) is None


def _compiled_with_recorder(monkeypatch):
    """A `Compiled` of a fake kernel (SIG, two scratch pointers) whose cuLaunchKernel
    records the grid, block, stream and the parameter slots' bytes; Triton's launch
    records its arguments."""
    import ctypes

    from replayssm.kernels.triton import launch

    calls = {"driver": [], "triton": []}

    def driver(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        slots = [ctypes.c_uint64.from_address(params[i]).value for i in range(6)]
        calls["driver"].append(((gx, gy, gz), (bx, by, bz), shared, stream, slots))
        return 0

    monkeypatch.setattr(launch, "_cu_launch", lambda: driver)
    monkeypatch.setattr(launch, "launch_compiled", lambda kernel, grid, stream, args: calls["triton"].append((grid, stream, list(args))))
    kernel = _fake(SIG, ["u64", "u32", "u64", "f32", "u64", "u64"], num_warps=4, shared=256)
    kernel.function = 1234
    return launch.Compiled(kernel), calls


def test_compiled_launch_packs_the_slots_and_calls_the_driver(monkeypatch):
    """With no launch hook (Triton's hook chains empty, as they are by default) a launch
    is one driver call: pointer and int64 slots whole, int32 and fp32 in the low four
    bytes, the two scratch slots NULL, block = 32 * num_warps."""
    import struct

    import triton

    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "launch_enter_hook", type(runtime.launch_enter_hook)(), raising=False)
    monkeypatch.setattr(runtime, "launch_exit_hook", type(runtime.launch_exit_hook)(), raising=False)
    compiled, calls = _compiled_with_recorder(monkeypatch)
    compiled((3, 2, 1), 77, (0xDEAD0000BEEF, -5, 128, -(2**40) - 3, 0.75))
    assert not calls["triton"]
    ((grid, block, shared, stream, slots),) = calls["driver"]
    assert (grid, block, shared, stream) == ((3, 2, 1), (128, 1, 1), 256, 77)
    f32 = struct.unpack("<I", struct.pack("<f", 0.75))[0]
    assert slots == [0xDEAD0000BEEF, (-5) & 0xFFFFFFFF, (-(2**40) - 3) & (2**64 - 1), f32, 0, 0]


def test_compiled_launch_takes_tritons_path_when_a_hook_is_set(monkeypatch):
    """A launch hook (a profiler) sends launches through Triton's launcher, which calls it."""
    import triton

    runtime = triton.knobs.runtime
    hook = lambda *a, **k: None  # noqa: E731
    enter = runtime.launch_enter_hook
    if hasattr(enter, "add"):  # Triton's hook chains
        chain = type(enter)()
        chain.add(hook)
        monkeypatch.setattr(runtime, "launch_enter_hook", chain)
    else:
        monkeypatch.setattr(runtime, "launch_enter_hook", hook)
    compiled, calls = _compiled_with_recorder(monkeypatch)
    args = (16, 1, 128, 2, 0.5)
    compiled((1, 1, 1), 5, args)
    assert not calls["driver"] and calls["triton"] == [((1, 1, 1), 5, list(args))]
