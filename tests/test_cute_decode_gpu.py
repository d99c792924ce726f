"""CuTe DSL FP8 decode kernels against the PyTorch reference, on the GPU.

Every step starts the reference from a copy of the kernels' cache, so both see the same
state and errors never compound; over 48 steps (three periods) every live row flushes
three times, at a different step per row, with padding rows (slot 0, negative, >= S) in
between. Per step:

- outputs: within 2 bf16 ulps (of the row's largest |y|) of the reference on the same
  GPU. Both compute in FP32 from the same quantized data; they differ only in summation
  order (relative error ~1e-6 of the summed magnitudes, far below a bf16 ulp of 2**-8),
  which can move the final bf16 rounding of an element by one ulp;
- positions, x / dt / B rings: bit-exact (dt is processed with the libdevice expf/log1pf
  PyTorch's CUDA softplus uses);
- flush rows: the kernel's FP32 state S (debug variant) within FP32 summation noise of
  the reference fold, and the FP16 checkpoint / FP8 read copy / scales bit-exact with the
  reference quantizers (`to_fp16` with `checkpoint_rbits`, `fp8_encode`) applied to S;
- everything else (state of non-flushing and padding slots, the bytes between slots)
  untouched, with NaN-poisoned memory everywhere the kernels must not read.
A captured CUDA graph of 32 steps replayed twice gives the same bits as eager steps.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from replayssm import layout as L
from replayssm import reference as ref
from replayssm.quant.formats import fp8_encode
from replayssm.quant.minifloat import to_fp16
from replayssm.quant.rng import checkpoint_rbits

from .gpu_harness import DEVICE, MANY_LIVE, MANY_SLOTS, NAN, World, check_graph_replays_whole_periods, check_warmup, ulp_bf16
from .helpers import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None,
        reason="nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')",
    ),
]


@pytest.mark.parametrize(
    "heads,groups,sync,e4m3",
    [
        pytest.param(16, 2, False, "hw", id="fp8-h16-g2-mixed"),
        # The opt-in tensor-core non-flush kernel ($REPLAYSSM_FP8_DECODE=mma).
        pytest.param(16, 2, False, "hw-mma", id="fp8-h16-g2-mixed-mma-decode"),
        pytest.param(16, 1, False, "hw-mma", id="fp8-h16-g1-mixed-mma-decode"),
        # The SIMT non-flush kernel at every batch ($REPLAYSSM_FP8_DECODE=simt; the
        # default is the warp-per-head kernel, decode_warp.py).
        pytest.param(16, 2, False, "hw-simt", id="fp8-h16-g2-mixed-simt-decode"),
        # The flush without PDL on the side stream at batch > 1 ($REPLAYSSM_FLUSH_PDL=0;
        # the default launches it with PDL behind prepare, launch.flush_pdl_for).
        pytest.param(16, 2, False, "hw+noflushpdl", id="fp8-h16-g2-mixed-flush-without-pdl"),
        pytest.param(16, 1, False, "hw", id="fp8-h16-g1-mixed"),
        pytest.param(16, 2, True, "hw", id="fp8-h16-g2-sync"),
        # sm_90a only: the software e4m3 encode instead of the e4m3x2 cvt.
        pytest.param(16, 2, False, "soft", id="fp8-h16-g2-mixed-soft-e4m3"),
        # Subnormal FP16 / e4m3 results: the encoders' general (warp-voted) path.
        pytest.param(16, 2, "wide", "hw", id="fp8-h16-g2-wide-range"),
        pytest.param(16, 2, "wide", "soft", id="fp8-h16-g2-wide-range-soft-e4m3"),
        # A batch of 45 rows: three CTA rows of the flush kernel, the last one partial.
        pytest.param(16, 2, "many", "hw", id="fp8-h16-g2-many-rows"),
        # The same with the flush grid cut to 2 CTA columns: a CTA flushes row groups
        # 0 and 2 in turn (flush_fp8.flush_columns), its flag words alternating.
        pytest.param(16, 2, "many-2col", "hw", id="fp8-h16-g2-many-rows-2-columns"),
        # 64 heads, flush row groups of 32 rows (launch.fp8_flush_rows: from batch 128 on,
        # forced here by $REPLAYSSM_FLUSH_ROWS=32), the second group partial; then with
        # one CTA column, which walks both groups, its flag words alternating.
        pytest.param(64, 8, "many", "hw+rows32", id="fp8-h64-g8-many-rows-32-row-groups"),
        pytest.param(64, 8, "many-1col", "hw+rows32", id="fp8-h64-g8-many-rows-32-row-groups-1-column"),
        # The sm_90a flush's warp-voted rounding ($REPLAYSSM_SM90_FP8_SR=voted; off by
        # default, launch.fp8_sr_voted): its normal-range path, its general one (wide
        # range: subnormal FP16 results), and many rows.
        pytest.param(16, 2, False, "hw+voted", id="fp8-h16-g2-mixed-voted"),
        pytest.param(16, 2, "wide", "hw+voted", id="fp8-h16-g2-wide-range-voted"),
        pytest.param(16, 2, "many", "hw+voted", id="fp8-h16-g2-many-rows-voted"),
        # The non-flush kernel's read-copy loads with the L2 prefetch-size hint
        # ($REPLAYSSM_FP8_READ_HINT=1; by default from heads x batch >= 8192 on).
        pytest.param(16, 2, False, "hw+hint", id="fp8-h16-g2-mixed-read-hint"),
        pytest.param(16, 2, "many", "hw+hint", id="fp8-h16-g2-many-rows-read-hint"),
        # A batch of one row: the non-flush kernel launched with PDL (launch.pdl_for), the
        # warp kernel by default.
        pytest.param(16, 2, "one", "hw", id="fp8-h16-g2-one-row"),
        # The same with the SIMT kernel as the PDL variant ($REPLAYSSM_PDL_KERNEL=simt).
        pytest.param(16, 2, "one-simt", "hw", id="fp8-h16-g2-one-row-simt-pdl"),
    ],
)
def test_kernels_match_reference_over_three_periods(heads, groups, sync, e4m3, monkeypatch):
    from replayssm.kernels import triton_backend
    from replayssm.kernels.cute import launch

    monkeypatch.delenv(launch.SM90_FP8_SR_ENV, raising=False)
    for env in (launch.PDL_ENV, launch.FLUSH_PDL_ENV, launch.FLUSH_ROWS_ENV, launch.FP8_READ_HINT_ENV):
        monkeypatch.delenv(env, raising=False)
    if e4m3.endswith("+hint"):
        e4m3 = e4m3[: -len("+hint")]
        monkeypatch.setenv(launch.FP8_READ_HINT_ENV, "1")
    if e4m3.endswith("+rows32"):
        e4m3 = e4m3[: -len("+rows32")]
        monkeypatch.setenv(launch.FLUSH_ROWS_ENV, "32")
    flush_pdl = not e4m3.endswith("+noflushpdl")
    if not flush_pdl:
        e4m3 = e4m3[: -len("+noflushpdl")]
        monkeypatch.setenv(launch.FLUSH_PDL_ENV, "0")
    if e4m3.endswith("+voted"):  # the flush's warp-voted rounding at any batch
        e4m3 = e4m3[: -len("+voted")]
        monkeypatch.setenv(launch.SM90_FP8_SR_ENV, "voted")
    if "-" in e4m3:  # a non-flush kernel other than the default
        e4m3, mode = e4m3.split("-")
        monkeypatch.setenv(launch.FP8_DECODE_ENV, mode)

    if sync in ("many-2col", "many-1col"):
        columns = 2 if sync == "many-2col" else 1
        monkeypatch.setattr(launch, "flush_grid_columns", lambda *args: columns)
        sync = "many"
    if sync == "one-simt":
        monkeypatch.setenv(launch.PDL_KERNEL_ENV, "simt")
        sync = "one"
    many = {"live": MANY_LIVE, "num_slots": MANY_SLOTS} if sync == "many" else {"live": (5,)} if sync == "one" else {}
    w = World("fp8", heads, groups, sync=sync is True, wide=sync == "wide", **many)
    if sync == "one":  # the PDL launch is what this case is for
        assert w.batch == 1 and launch.pdl_for(w.batch)
    assert launch.flush_pdl_for(w.batch) is (flush_pdl and w.batch > 1)  # the PDL flush above batch 1
    backend = triton_backend()
    cache, H, P, N = w.cache, heads, L.HEAD_DIM, L.STATE_DIM
    out = torch.empty(w.batch, H, P, dtype=torch.bfloat16, device=DEVICE)
    state = torch.empty(w.batch, H, P, N, dtype=torch.float32, device=DEVICE)
    flushed = 0
    worst = 0.0
    for step in range(48):
        tok = w.token()
        x, dt, A, B, C, D, dt_bias = w.inputs(tok)
        before = [t.clone() for t in cache]
        # Kernels: prepare (Triton), then both CuTe kernels, the flush with its S dump.
        out.fill_(NAN)
        state.fill_(NAN)
        plan = backend.prepare(cache, w.ids, out, nvfp4=False, seed=w.seed)
        launch.decode_fp8(cache, x, dt, A, B, C, D, dt_bias, plan, out, state_out=state, e4m3=e4m3)
        # Reference from the same starting state.
        expect = [t.clone() for t in before]
        out_ref = torch.full_like(out, NAN)
        ref.decode(expect, x, dt, A, B, C, D, dt_bias, w.ids, out_ref, nvfp4=False, seed=w.seed)
        torch.cuda.synchronize()

        valid = ref.valid_rows(w.ids.long(), cache[1].shape[0])
        assert bool((out[~valid] == 0).all()), f"step {step}: padding rows must be zero"
        y, yr = out[valid].float(), out_ref[valid].float()
        assert not bool(torch.isnan(y).any()), f"step {step}: NaN in outputs"
        rowmax = yr.abs().amax(dim=-1, keepdim=True)
        err = (y - yr).abs()
        ratio = float((err / ulp_bf16(rowmax)).amax())
        worst = max(worst, ratio)
        assert ratio <= 2.0, f"step {step}: output differs by {ratio:.2f} bf16 ulps of the row max"

        for i in (L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS):
            assert same_bits(cache[i], expect[i]), f"step {step}: cache[{i}] differs from the reference"

        fl = plan.flush.clone()
        slots = plan.slot[fl]
        untouched = torch.ones(cache[1].shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        for i in (L.CHECKPOINT, L.READ_COPY, L.SCALES):
            assert same_bits(cache[i][untouched], before[i][untouched]), f"step {step}: cache[{i}] of a non-flushing slot changed"
        if slots.numel():
            flushed += slots.numel()
            S = state[fl]
            xs, Bs = x[fl], B[fl]
            dts = ref.softplus_dt(dt[fl], dt_bias.view(1, -1))
            S_ref = ref.fold(before, slots, xs, dts, Bs, A, plan.ring_index[fl])
            scale = S_ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            assert float(((S - S_ref).abs() / scale).amax()) < 1e-5, f"step {step}: FP32 state differs"
            ck = to_fp16(S, checkpoint_rbits(plan.key[fl], H))
            codes, scales = fp8_encode(S)
            assert same_bits(cache[L.CHECKPOINT][slots], ck), f"step {step}: checkpoint bits differ from to_fp16(S)"
            assert same_bits(cache[L.READ_COPY][slots], codes), f"step {step}: read copy bits differ from fp8_encode(S)"
            assert same_bits(cache[L.SCALES][slots], scales), f"step {step}: scales differ from fp8_encode(S)"
        assert w.gaps_untouched(), f"step {step}: bytes between slot tensors were written"
    live = int(valid.sum())
    assert flushed == 3 * live, (flushed, live)
    print(f"[{heads}h/{groups}g sync={sync} e4m3={e4m3}] 48 steps, {flushed} row flushes, worst output error {worst:.2f} bf16 ulps of row max")


def test_cuda_graph_replays_whole_periods():
    check_graph_replays_whole_periods("fp8")


def test_cuda_graph_replays_whole_periods_with_the_flush_without_pdl(monkeypatch):
    """$REPLAYSSM_FLUSH_PDL=0: the flush on the side stream, the non-flush kernel on the
    current one (the default captures the flush's PDL launch behind prepare)."""
    from replayssm.kernels.cute import launch

    monkeypatch.setenv(launch.FLUSH_PDL_ENV, "0")
    check_graph_replays_whole_periods("fp8")


def test_cuda_graph_replays_whole_periods_with_32_row_groups(monkeypatch):
    """The FP8 flush with row groups of 32 rows ($REPLAYSSM_FLUSH_ROWS=32; by default
    at 64 heads from batch 128 on), captured."""
    from replayssm.kernels.cute import launch

    monkeypatch.setenv(launch.FLUSH_ROWS_ENV, "32")
    check_graph_replays_whole_periods("fp8")


def test_cuda_graph_replays_whole_periods_with_the_read_hint(monkeypatch):
    """The non-flush kernel with the read hint ($REPLAYSSM_FP8_READ_HINT=1; by default
    from heads x batch >= 8192 on), captured."""
    from replayssm.kernels.cute import launch

    monkeypatch.setenv(launch.FP8_READ_HINT_ENV, "1")
    check_graph_replays_whole_periods("fp8")


def test_cuda_graph_replays_whole_periods_with_the_voted_flush(monkeypatch):
    """The sm_90a flush's warp-voted variant ($REPLAYSSM_SM90_FP8_SR=voted), captured."""
    from replayssm.kernels.cute import launch

    monkeypatch.setenv(launch.SM90_FP8_SR_ENV, "voted")
    check_graph_replays_whole_periods("fp8")


@pytest.mark.parametrize("pdl_kernel", ["simt", "warp"])
def test_cuda_graph_replays_whole_periods_at_batch_1(monkeypatch, pdl_kernel):
    """Batch 1: the non-flush kernel with programmatic dependent launch, captured."""
    from replayssm.kernels.cute import launch

    monkeypatch.delenv(launch.PDL_ENV, raising=False)
    monkeypatch.setenv(launch.PDL_KERNEL_ENV, pdl_kernel)
    assert launch.pdl_for(1)
    check_graph_replays_whole_periods("fp8", live=(5,))


def test_warmup_compiles_and_launches_both_kernels_without_changing_the_cache(monkeypatch):
    from replayssm.kernels.cute import launch

    monkeypatch.delenv(launch.PDL_ENV, raising=False)  # the PDL variant is expected too
    monkeypatch.delenv(launch.FP8_DECODE_ENV, raising=False)
    monkeypatch.setenv(launch.SM90_FP8_SR_ENV, "voted")  # the voted flush on sm_90a
    monkeypatch.delenv(launch.FP8_READ_HINT_ENV, raising=False)
    names = check_warmup("fp8")
    # 16 heads: the non-flush kernel with the read hint too (from batch 512 on).
    assert any(n.startswith("cute.decode_fp8[") and n.endswith(",hint]") for n in names), names
    voted = [n for n in names if n.startswith("cute.flush_fp8[") and n.endswith(",voted]")]
    # sm_90a: the voted flush with PDL (above batch 1) and without (batch 1).
    assert len(voted) == (2 if launch.arch_for() == "sm_90a" else 0), names
