"""The speculative-decoding baseline (benchmarks/spec_baseline.py: a step that writes an
intermediate state per token, then the commit of the accepted one) against its PyTorch
twin and the exact FP64 recurrence of the accepted stream. On CPU the kernels run in the
Triton interpreter (tiny shapes); the stored bf16 values round to nearest there as on the
GPU (integer rounding in the kernel), and the twin follows the kernel's formulas and
order, so kernel and twin differ only where numpy's and torch's FP32 exp / log differ by
an ulp (tests/tolerances.py)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from replayssm import synthetic

from . import tolerances as tol
from .test_standard_decode import bits, within_ulps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.spec_baseline import (  # noqa: E402
    new_inter,
    spec_baseline_ref,
    spec_commit,
    spec_commit_ref,
    spec_step,
    spec_step_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_problem(batch, T, heads, groups, num_slots, dtype, *, seed, tied=False, dims=(64, 128)):
    """Slots 1.. hold prefill states, slot 0 NaN; T tokens per row stacked on dim 1."""
    P, N = dims
    g = torch.Generator().manual_seed(seed)
    params = synthetic.layer_params(heads, generator=g, device=DEV)
    state = torch.full((num_slots, heads, P, N), float("nan"), dtype=dtype, device=DEV)
    state[1:] = synthetic.prefill_states(params, num_slots - 1, groups, 3, generator=g, device=DEV, head_dim=P,
                                         state_dim=N).to(dtype)  # fmt: skip
    toks = [synthetic.token(batch, heads, groups, generator=g, device=DEV, head_dim=P, state_dim=N) for _ in range(T)]
    x, dt, B, C = (torch.stack([getattr(t, k) for t in toks], 1) for k in ("x", "dt", "B", "C"))
    A, D, dt_bias = params.A, params.D, params.dt_bias
    if tied:  # the serving engine's stride-0 views of per-head scalars
        dt = dt[..., None].expand(batch, T, heads, P)
        A = A[:, None, None].expand(heads, P, N)
        D = D[:, None].expand(heads, P)
        dt_bias = dt_bias[:, None].expand(heads, P)
    return params, state, dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias), toks


@pytest.mark.parametrize("dtype,tied,dims", [(torch.bfloat16, False, (64, 128)), (torch.bfloat16, True, (64, 128)),
                                             (torch.float32, False, (64, 128)), (torch.bfloat16, True, (80, 256))],
                         ids=["bf16", "bf16-tied", "fp32", "bf16-tied-80x256"])  # fmt: skip
def test_step_matches_reference(dtype, tied, dims):
    """b = 3 with one padding row, T = 3, 2 heads, 1 group: the kernel reads the state
    without writing it, fills the live rows' intermediate states as the twin does (bf16:
    within one ulp and almost all bit-equal; fp32: FP32 noise), outputs within one bf16
    ulp; padding rows output zeros and leave their intermediate rows untouched. Also at
    head dim 80 (five 16-row tiles a head) and state dim 256."""
    heads, groups, T, num_slots = 2, 1, 3, 5
    ids = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEV)
    params, state, inp, _ = make_problem(3, T, heads, groups, num_slots, dtype, seed=11, tied=tied, dims=dims)
    before = state.clone()
    inter = torch.full((3, T, heads, *dims), float("nan"), dtype=dtype, device=DEV)
    inter_ref = inter.clone()
    out = torch.full((3, T, heads, dims[0]), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = spec_step(state, inter, **inp, state_indices=ids, out=out)
    assert y is out
    y_ref = spec_step_ref(state, inter_ref, **inp, state_indices=ids)

    assert torch.equal(bits(state), bits(before))  # the state cache is not written
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.isnan(inter[1].float()).all()
    live = [0, 2]
    got, want = inter[live], inter_ref[live]
    if dtype == torch.bfloat16:
        assert within_ulps(got, want, dtype, n=1.0)
        frac = (bits(got) != bits(want)).float().mean().item()
        assert frac <= tol.SPEC_16BIT_DIFF_FRACTION, frac
    else:
        slack = tol.STANDARD_FP32_STATE_SLACK_REL * float(want.abs().amax())
        assert within_ulps(got, want, dtype, n=2.0, slack=slack)
    y_slack = tol.STANDARD_OUTPUT_SLACK_REL * float(want.float().abs().amax())
    assert within_ulps(y[live], y_ref[live], torch.bfloat16, n=1.0, slack=y_slack)


@pytest.mark.parametrize("dims", [(64, 128), (80, 256)], ids=["64x128", "80x256"])
def test_commit_copies_the_accepted_state(dims):
    """The commit kernel against its twin on the same intermediate states, bit for bit:
    a = 1, T and 7 (clamped to T) copy inter[row, a - 1]; a = 0 and padding rows change
    nothing (slot 0's NaN and the untouched slot stay)."""
    heads, T, num_slots = 2, 3, 7
    g = torch.Generator().manual_seed(3)
    state = torch.randn(num_slots, heads, *dims, generator=g).to(DEV, torch.bfloat16)
    state[0] = float("nan")
    inter = torch.randn(5, T, heads, *dims, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([2, 5, 0, 4, 1], dtype=torch.int32, device=DEV)
    acc = torch.tensor([1, 3, 2, 0, 7], dtype=torch.int32, device=DEV)
    want = state.clone()
    spec_commit_ref(want, inter, ids, acc)
    spec_commit(state, inter, ids, acc)
    assert torch.equal(bits(state), bits(want))
    assert torch.equal(bits(state[2]), bits(inter[0, 0])) and torch.equal(bits(state[5]), bits(inter[1, 2]))
    assert torch.equal(bits(state[1]), bits(inter[4, T - 1]))
    assert not torch.equal(bits(state[4]), bits(inter[3, 0]))


def _calls(gen, batch, T, heads, groups, n):
    """n calls' inputs [b, T, ...] and verdicts: token 0 always accepted, each draft with
    probability 0.7, the first rejection ends acceptance."""
    for _ in range(n):
        toks = [synthetic.token(batch, heads, groups, generator=gen, device=DEV) for _ in range(T)]
        x, dt, B, C = (torch.stack([getattr(t, k) for t in toks], 1) for k in ("x", "dt", "B", "C"))
        acc = torch.ones(batch, dtype=torch.int32)
        for r in range(batch):
            while acc[r] < T and torch.rand(1, generator=gen).item() < 0.7:
                acc[r] += 1
        yield x, dt, B, C, acc.to(DEV)


def _run_stream(step, commit, batch, T, n_calls, seed):
    """n_calls of step + commit on a bf16 state (row 1 a padding row); returns the SQNR
    (dB) of the committed states and of the accepted tokens' outputs against per-row exact
    FP64 recurrences of the accepted stream."""
    heads, groups, num_slots = 2, 1, batch + 2
    g = torch.Generator().manual_seed(seed)
    params = synthetic.layer_params(heads, generator=g, device=DEV)
    state = torch.zeros(num_slots, heads, 64, 128, dtype=torch.bfloat16, device=DEV)
    state[1:] = synthetic.prefill_states(params, num_slots - 1, groups, 4, generator=g, device=DEV).to(torch.bfloat16)
    ids = torch.arange(1, batch + 1, dtype=torch.int32, device=DEV).flip(0)
    ids[1] = 0
    live = [r for r in range(batch) if r != 1]
    exact = {r: synthetic.ExactRecurrence(params, state[ids[r]][None].float()) for r in live}
    inter = new_inter(state, batch, T)
    got, want = [], []
    for x, dt, B, C, acc in _calls(g, batch, T, heads, groups, n_calls):
        y = step(state, inter, x, dt, params.A, B, C, params.D, params.dt_bias, ids)
        commit(state, inter, ids, acc)
        assert torch.equal(y[1], torch.zeros_like(y[1]))
        for r in live:
            for t in range(int(acc[r])):
                tok = synthetic.Token(x[r : r + 1, t], dt[r : r + 1, t], B[r : r + 1, t], C[r : r + 1, t])
                want.append(exact[r].step(tok)[0])
                got.append(y[r, t].float())
    s_exact = torch.cat([exact[r].S for r in live])
    s_got = state[ids[live].long()].float()
    return synthetic.sqnr_db(s_exact, s_got), synthetic.sqnr_db(torch.stack(want), torch.stack(got))


def test_reference_tracks_exact_recurrence_of_the_accepted_stream():
    """The twin over 24 calls of T = 4 (bf16 state, drafts accepted with p = 0.7): the
    committed states and the accepted outputs keep the bf16 state's accuracy."""
    sq_state, sq_y = _run_stream(spec_step_ref, spec_commit_ref, 4, 4, 24, seed=0)
    assert sq_state >= tol.SPEC_BF16_STATE_SQNR_FLOOR_DB, sq_state
    assert sq_y >= tol.SPEC_OUTPUT_SQNR_FLOOR_DB, sq_y


def test_kernels_track_exact_recurrence_like_the_reference():
    """The kernels over 4 calls of T = 3 (interpreter on CPU): SQNR within
    STANDARD_SQNR_SLACK_DB of the twin's on the same data, and above the floors."""
    k_state, k_y = _run_stream(spec_step, spec_commit, 3, 3, 4, seed=1)
    r_state, r_y = _run_stream(spec_step_ref, spec_commit_ref, 3, 3, 4, seed=1)
    assert k_state >= r_state - tol.STANDARD_SQNR_SLACK_DB, (k_state, r_state)
    assert k_y >= r_y - tol.STANDARD_SQNR_SLACK_DB, (k_y, r_y)
    assert k_state >= tol.SPEC_BF16_STATE_SQNR_FLOOR_DB and k_y >= tol.SPEC_OUTPUT_SQNR_FLOOR_DB


def test_baseline_ref_accepting_all_equals_the_last_intermediate():
    """spec_baseline_ref with num_accepted None commits the last token's state."""
    params, state, inp, _ = make_problem(2, 2, 2, 1, 3, torch.bfloat16, seed=4)
    inter = new_inter(state, 2, 2)
    ids = torch.tensor([2, 1], device=DEV)
    spec_baseline_ref(state, inter, **inp, state_indices=ids, num_accepted=None)
    assert torch.equal(bits(state[2]), bits(inter[0, 1])) and torch.equal(bits(state[1]), bits(inter[1, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups,P,N", [(16, 2, 64, 128), (64, 8, 64, 128), (32, 1, 64, 256), (16, 1, 80, 128)],
                         ids=["h16-g2", "h64-g8", "h32-g1-64x256", "h16-g1-80x128"])  # fmt: skip
def test_serving_shapes_gpu(heads, groups, P, N):
    """Batch 256, T = 4, slots permuted, padding rows: intermediate states within one bf16
    ulp of the twin (plus FP32 noise where the update cancels) and rarely different at
    all; outputs within one ulp; the commit bit-exact to its twin."""
    batch, T, num_slots = 256, 4, 300
    g = torch.Generator(device="cuda").manual_seed(3)
    state = (0.3 * torch.randn(num_slots, heads, P, N, device="cuda", generator=g)).to(torch.bfloat16)
    ids = torch.randperm(num_slots - 1, device="cuda", generator=g)[:batch].to(torch.int32) + 1
    ids[::37] = 0
    gc = torch.Generator().manual_seed(4)
    params = synthetic.layer_params(heads, generator=gc, device="cuda")
    toks = [synthetic.token(batch, heads, groups, generator=gc, device="cuda", head_dim=P, state_dim=N)
            for _ in range(T)]  # fmt: skip
    x, dt, B, C = (torch.stack([getattr(t, k) for t in toks], 1) for k in ("x", "dt", "B", "C"))
    args = dict(x=x, dt=dt, A=params.A, B=B, C=C, D=params.D, dt_bias=params.dt_bias, state_indices=ids)
    inter, inter_ref = new_inter(state, batch, T), new_inter(state, batch, T)
    y = spec_step(state, inter, **args)
    y_ref = spec_step_ref(state, inter_ref, **args)
    live = ids != 0
    amax = float(inter_ref[live].float().abs().amax())
    assert within_ulps(inter[live], inter_ref[live], torch.bfloat16, n=1.0, slack=tol.STANDARD_16BIT_SLACK_REL * amax)
    assert (inter[live] != inter_ref[live]).float().mean().item() < tol.STANDARD_16BIT_DIFF_FRACTION
    y_slack = tol.STANDARD_OUTPUT_SLACK_REL * amax * math.sqrt(N)
    assert within_ulps(y[live], y_ref[live], torch.bfloat16, n=1.0, slack=y_slack)
    assert torch.equal(y[~live], torch.zeros_like(y[~live]))
    acc = torch.randint(0, T + 1, (batch,), device="cuda", generator=g)
    want = state.clone()
    spec_commit_ref(want, inter, ids, acc)
    spec_commit(state, inter, ids, acc)
    assert torch.equal(bits(state), bits(want))


_COMPILE_SM90 = r"""
import sys, json
import triton
from triton.backends.compiler import GPUTarget
from benchmarks.spec_baseline import spec_step_kernel, spec_commit_kernel, BLOCK_P, NUM_WARPS
dtype = sys.argv[1]
ptr = {"state": "*" + dtype, "inter": "*" + dtype, "x": "*bf16", "dt": "*fp32", "A": "*fp32", "B": "*bf16",
       "C": "*bf16", "D": "*fp32", "dt_bias": "*fp32", "slots": "*i32", "out": "*bf16", "num_accepted": "*i32"}
info = {}
for k, consts in ((spec_step_kernel, {"T": 4, "HEADS_PER_GROUP": 8, "BLOCK_P": BLOCK_P, "P": 64, "N": 128,
                                      "SOFT_BF16": False}),
                  (spec_commit_kernel, {"T": 4, "BLOCK_P": BLOCK_P, "P": 64, "N": 128})):
    names = k.arg_names
    sig = {n: ptr.get(n, "i32") for n in names}
    sig.update({n: "constexpr" for n in consts})
    odd = {"num_slots"} | {n for n in names if n.startswith(("stride_dt", "stride_a", "stride_dtb", "stride_d_"))}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in consts and n not in odd}
    src = triton.compiler.ASTSource(fn=k, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS}).asm["ptx"]
    lines = [l for l in ptx.splitlines() if "evict_first" in l and ".global" in l]
    info[k.__name__] = {"ld": [l.split()[1] for l in lines if "ld.global" in l],
                        "st": [l.split()[1] for l in lines if "st.global" in l]}
print(json.dumps(info))
"""


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_sm90_with_16_byte_state_accesses(dtype):
    """Compile-only (no GPU needed; the interpreter does not catch compile errors): both
    kernels build for sm_90a, and every state / intermediate-state access is a 16-byte
    vector access: the step loads one tile and stores T = 4, the commit one of each."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90, dtype], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)  # fmt: skip
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    per_tile = 16 * {"fp32": 4, "bf16": 2}[dtype] // 16  # 16 values a thread per tile, in 16-byte accesses
    step, commit = info["spec_step_kernel"], info["spec_commit_kernel"]
    for ops in (step["ld"], step["st"], commit["ld"], commit["st"]):
        assert ops and all(op.endswith(".v4.b32") for op in ops), info
    assert (len(step["ld"]), len(step["st"])) == (per_tile, 4 * per_tile)
    assert (len(commit["ld"]), len(commit["st"])) == (per_tile, per_tile)
