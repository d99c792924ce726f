"""The standard decode kernel (the benchmark baseline) against its PyTorch twin and the
FP64 recurrence. On CPU the kernel runs in the Triton interpreter, whose float -> bf16
casts truncate instead of rounding to nearest, so 16-bit values are compared within one
unit in the last place (ulp) of their storage dtype; on the GPU the casts round to
nearest and the remaining differences come from FP32 exp / log1p / summation order."""

import math
import sys
from pathlib import Path

import pytest
import torch

from replayssm import synthetic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.standard_decode import standard_decode, standard_decode_ref  # noqa: E402

# The kernel runs compiled on a GPU machine (CUDA tensors), in the interpreter elsewhere.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MANT_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_NORMAL_EXP = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of `dtype` at the magnitude of v (subnormal spacing below the normals)."""
    e = torch.floor(torch.log2(v.double().abs().clamp_min(1e-300)))
    e = e.clamp_min(MIN_NORMAL_EXP[dtype])
    return torch.exp2(e - MANT_BITS[dtype])


def within_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, n: float = 1.0, slack=0.0) -> bool:
    err = (got.double() - want.double()).abs()
    return bool((err <= n * ulp(want, dtype) + slack).all())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def make_problem(batch, heads, groups, num_slots, state_dtype, *, seed, slot_pad=0, tied=True, dims=(64, 128)):
    P, N = dims
    g = torch.Generator().manual_seed(seed)
    params = synthetic.layer_params(heads, generator=g, device=DEV)
    tok = synthetic.token(batch, heads, groups, generator=g, device=DEV, head_dim=P, state_dim=N)
    # The state buffer is carved with `slot_pad` extra elements per slot (padded slot
    # stride) and poisoned with NaN everywhere, then the slots get a realistic state.
    per_slot = heads * P * N
    buf = torch.full((num_slots, per_slot + slot_pad), float("nan"), dtype=state_dtype, device=DEV)
    state = buf[:, :per_slot].view(num_slots, heads, P, N)
    init = synthetic.prefill_states(params, num_slots - 1, groups, 3, generator=g, device=DEV, head_dim=P, state_dim=N)
    state[1:] = init.to(state_dtype)
    A, dt_bias, D, dt = params.A, params.dt_bias, params.D, tok.dt
    if tied:  # the serving engine's stride-0 views of per-head scalars
        A = A[:, None, None].expand(heads, P, N)
        dt_bias = dt_bias[:, None].expand(heads, P)
        D = D[:, None].expand(heads, P)
        dt = dt[:, :, None].expand(batch, heads, P)
    return buf, state, tok, params, dict(dt=dt, A=A, D=D, dt_bias=dt_bias)


CASES = [
    pytest.param(torch.float32, 4, 2, [3, 1, 5], 0, (64, 128), id="fp32-h4-g2"),
    pytest.param(torch.bfloat16, 4, 2, [3, 1, 5], 0, (64, 128), id="bf16-h4-g2"),
    pytest.param(torch.float16, 4, 2, [3, 1, 5], 0, (64, 128), id="fp16-h4-g2"),
    pytest.param(torch.bfloat16, 4, 1, [2, 0, 4, -1, 6, 0], 0, (64, 128), id="bf16-h4-g1-pad"),
    pytest.param(torch.float32, 2, 2, [6, 0, 2, 6 + 1, -3], 24, (64, 128), id="fp32-h2-g2-pad-slotstride"),
    pytest.param(torch.float16, 2, 1, [0, 5, 0], 8, (64, 128), id="fp16-h2-g1-pad-slotstride"),
    # the other geometries: head dim 80 (five 16-row tiles a head), state dim 256
    pytest.param(torch.bfloat16, 2, 1, [2, 0, 4], 0, (80, 128), id="bf16-h2-g1-pad-80x128"),
    pytest.param(torch.float32, 2, 2, [6, 1, -3], 24, (64, 256), id="fp32-h2-g2-pad-slotstride-64x256"),
    pytest.param(torch.float16, 2, 1, [3, 0, 5], 8, (80, 256), id="fp16-h2-g1-pad-slotstride-80x256"),
]


@pytest.mark.parametrize("dtype,heads,groups,ids,slot_pad,dims", CASES)
def test_one_step_matches_reference(dtype, heads, groups, ids, slot_pad, dims):
    num_slots = 7
    batch = len(ids)
    P, N = dims
    buf, state, tok, params, tied = make_problem(batch, heads, groups, num_slots, dtype, seed=11, slot_pad=slot_pad,
                                                 dims=dims)  # fmt: skip
    ids_t = torch.tensor(ids, dtype=torch.int32, device=DEV)
    buf_before = buf.clone()
    ref_state = state.clone()
    y_ref = standard_decode_ref(ref_state, tok.x, **tied, B=tok.B, C=tok.C, state_indices=ids_t)
    out = torch.full((batch, heads, P), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = standard_decode(state, tok.x, **tied, B=tok.B, C=tok.C, state_indices=ids_t, out=out)
    assert y is out

    valid = torch.tensor([0 < s < num_slots for s in ids], device=DEV)
    live = [s for s in ids if 0 < s < num_slots]
    untouched = [s for s in range(num_slots) if s not in live]
    # Padding rows: zero output; slot 0, untouched slots and the inter-slot padding keep
    # their exact bits (NaN poison included).
    assert torch.equal(y[~valid], torch.zeros_like(y[~valid]))
    assert torch.equal(bits(buf[untouched]), bits(buf_before[untouched]))
    per_slot = heads * P * N
    assert torch.isnan(buf[:, per_slot:]).all()

    # Live rows: state within one ulp of the storage dtype of the reference's FP32 value
    # (ref rounds to nearest, the interpreter truncates), output within one bf16 ulp.
    # FP32 state: the kernel's exp / log1p differ from torch's by a few FP32 ulps.
    exact = synthetic.ExactRecurrence(params, buf_before[live, :per_slot].view(-1, heads, P, N).float())
    tok_live = synthetic.Token(tok.x[valid], tok.dt[valid], tok.B[valid], tok.C[valid])
    y_exact = exact.step(tok_live)
    # FP32 storage: exp / log1p differ from torch's by a few FP32 ulps, relative to the
    # terms before they cancel, hence an absolute slack at the state's scale.
    s_slack = 4e-7 * float(exact.S.abs().amax()) if dtype == torch.float32 else 0.0
    assert within_ulps(state[live], exact.S, dtype, n=1.0, slack=s_slack)
    assert within_ulps(state[live], ref_state[live], dtype, n=1.0, slack=s_slack)
    y_slack = 1e-5 * float(exact.S.abs().amax()) * (N / 128) ** 0.5  # FP32 summation order of the N products
    assert within_ulps(y[valid], y_ref[valid], torch.bfloat16, n=1.0, slack=y_slack)
    assert within_ulps(y[valid], y_exact, torch.bfloat16, n=1.5, slack=y_slack)


def test_many_steps_track_exact_recurrence():
    """8 steps with bf16 state: the kernel's SQNR against the FP64 recurrence is within
    3 dB of what the PyTorch twin (rounding to nearest) achieves."""
    heads, groups, num_slots, dtype = 2, 1, 4, torch.bfloat16
    g = torch.Generator().manual_seed(5)
    params = synthetic.layer_params(heads, generator=g, device=DEV)
    init = synthetic.prefill_states(params, num_slots - 1, groups, 4, generator=g, device=DEV)
    state = torch.zeros(num_slots, heads, 64, 128, dtype=dtype, device=DEV)
    state[1:] = init.to(dtype)
    ref_state = state.clone()
    exact = synthetic.ExactRecurrence(params, state[1:].float())
    ids = torch.tensor([1, 2, 3], device=DEV)
    for _ in range(8):
        tok = synthetic.token(3, heads, groups, generator=g, device=DEV)
        args = dict(x=tok.x, dt=tok.dt, A=params.A, B=tok.B, C=tok.C, D=params.D, dt_bias=params.dt_bias,
                    state_indices=ids)
        y = standard_decode(state, **args)
        y_ref = standard_decode_ref(ref_state, **args)
        y_exact = exact.step(tok)
    sq_k = synthetic.sqnr_db(exact.S, state[1:].float())
    sq_r = synthetic.sqnr_db(exact.S, ref_state[1:].float())
    assert sq_k >= sq_r - 3.0, (sq_k, sq_r)
    assert synthetic.sqnr_db(y_exact, y.float()) >= synthetic.sqnr_db(y_exact, y_ref.float()) - 3.0
    assert sq_r > 40.0


def test_large_dt_is_linear_softplus():
    """dt + dt_bias > 20 takes the linear branch (as the serving engine), and a very
    negative argument gives the tiny positive softplus, not zero."""
    heads, groups = 2, 1
    g = torch.Generator().manual_seed(9)
    state = torch.randn(3, heads, 64, 128, generator=g).to(DEV)
    ref_state = state.clone()
    x = torch.randn(2, heads, 64, generator=g).bfloat16().to(DEV)
    B = torch.randn(2, groups, 128, generator=g).bfloat16().to(DEV)
    C = torch.randn(2, groups, 128, generator=g).bfloat16().to(DEV)
    dt = torch.tensor([[25.0, -30.0], [-8.0, 19.5]], device=DEV)
    A = torch.tensor([-1e-3, -2.0], device=DEV)
    D = torch.tensor([0.5, 2.0], device=DEV)
    dt_bias = torch.zeros(heads, device=DEV)
    ids = torch.tensor([2, 1], device=DEV)
    y = standard_decode(state, x, dt, A, B, C, D, dt_bias, ids)
    y_ref = standard_decode_ref(ref_state, x, dt, A, B, C, D, dt_bias, ids)
    torch.testing.assert_close(state, ref_state, rtol=2e-6, atol=1e-6)
    assert within_ulps(y, y_ref, torch.bfloat16, n=1.0, slack=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads,groups,P,N", [(16, 2, 64, 128), (64, 8, 64, 128), (32, 1, 64, 256), (16, 1, 80, 128)],
                         ids=["h16-g2", "h64-g8", "h32-g1-64x256", "h16-g1-80x128"])  # fmt: skip
def test_serving_shapes_gpu(dtype, heads, groups, P, N):
    """Batch 256 at serving shapes, slots permuted with padding rows mixed in. On the GPU
    both sides round to nearest: 16-bit state bits may differ by one ulp only where the
    FP32 value lands within FP32 noise of a rounding boundary (exp/log1p differ by a few
    FP32 ulps), which is rare; the output by one bf16 ulp (summation order)."""
    dev = "cuda"
    batch, num_slots = 256, 300
    g = torch.Generator(device=dev).manual_seed(3)
    state = (0.3 * torch.randn(num_slots, heads, P, N, device=dev, generator=g)).to(dtype)
    ids = torch.randperm(num_slots - 1, device=dev, generator=g)[:batch].to(torch.int32) + 1
    ids[::37] = 0  # padding rows
    ref_state = state.clone()
    gc = torch.Generator().manual_seed(4)
    params = synthetic.layer_params(heads, generator=gc, device=dev)
    tok = synthetic.token(batch, heads, groups, generator=gc, device=dev, head_dim=P, state_dim=N)
    args = dict(x=tok.x, dt=tok.dt, A=params.A, B=tok.B, C=tok.C, D=params.D, dt_bias=params.dt_bias,
                state_indices=ids)
    y = standard_decode(state, **args)
    y_ref = standard_decode_ref(ref_state, **args)
    torch.cuda.synchronize()
    if dtype == torch.float32:
        torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)
    else:
        # One ulp where both round the same FP32 value differently, plus FP32 noise
        # (~2**-23 of the terms, which are bounded by the state scale) where the update
        # cancels the decayed state and the result is far smaller than its terms.
        slack = 2.0**-19 * float(ref_state.float().abs().amax())
        assert within_ulps(state, ref_state, dtype, n=1.0, slack=slack)
        frac = (state != ref_state).float().mean().item()
        assert frac < 1e-3, frac
    amax = float(ref_state.float().abs().amax())
    assert within_ulps(y, y_ref, torch.bfloat16, n=1.0, slack=1e-5 * amax * math.sqrt(N))
    assert torch.equal(y[ids == 0], torch.zeros_like(y[ids == 0]))


_COMPILE_SM90 = r"""
import re, sys, json
import triton
from triton.backends.compiler import GPUTarget
from benchmarks.standard_decode import standard_decode_kernel as k, default_config
names = k.arg_names
ptr = {"state": "*" + sys.argv[1], "x": "*bf16", "dt": "*fp32", "A": "*fp32", "B": "*bf16", "C": "*bf16",
       "D": "*fp32", "dt_bias": "*fp32", "slots": "*i32", "out": "*bf16"}
bp, nw = default_config(None)
consts = {"HEADS_PER_GROUP": 8, "BLOCK_P": bp, "P": int(sys.argv[2]), "N": int(sys.argv[3]), "SOFT_BF16": False,
          "stride_x_p": 1, "stride_d_p": 0}
sig = {n: ptr.get(n, "i32") for n in names}
sig.update({n: "constexpr" for n in consts})
# As a launch specializes them: pointers and the slot/head/row strides are multiples of 16.
odd = {"num_slots", "stride_dt_b", "stride_dt_h", "stride_a_h", "stride_dtb_h", "stride_d_h"}
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in consts and n not in odd}
src = triton.compiler.ASTSource(fn=k, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                                attrs=attrs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw}).asm["ptx"]
state = [l for l in ptx.splitlines() if "evict_first" in l and ".global" in l]
print(json.dumps({"state_ld": [l.split()[1] for l in state if "ld.global" in l],
                  "state_st": [l.split()[1] for l in state if "st.global" in l],
                  "cvt_bf16": "cvt.rn.bf16x2.f32" in ptx, "cvt_f16": "cvt.rn.f16x2.f32" in ptx}))
"""


@pytest.mark.parametrize("dtype,P,N", [("fp32", 64, 128), ("bf16", 64, 128), ("fp16", 64, 128), ("bf16", 80, 256)],
                         ids=["fp32", "bf16", "fp16", "bf16-80x256"])  # fmt: skip
def test_compiles_for_sm90_with_16_byte_state_accesses(dtype, P, N):
    """Compile-only (no GPU needed): every state load and store of the sm_90a build is a
    16-byte vector access, and 16-bit states use the hardware round-to-nearest cvt."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90, dtype, str(P), str(N)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)  # fmt: skip
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["state_ld"] and info["state_st"]
    assert all(op.endswith(".v4.b32") for op in info["state_ld"] + info["state_st"]), info
    # 16 rows x N values over 128 threads: N / 8 values per thread per tile.
    per_thread_bytes = N // 8 * {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    assert len(info["state_ld"]) == per_thread_bytes // 16
    # the packed round-to-nearest converts of the state (the bf16 output uses scalar cvt.rn)
    assert info["cvt_bf16"] == (dtype == "bf16")
    assert info["cvt_f16"] == (dtype == "fp16")
