"""CuTe DSL decode kernels (every format) against the PyTorch reference, on the GPU.

Every step starts the reference from a copy of the kernels' cache, so both see the same
state and errors never compound; over 48 steps (three periods) every live row flushes
three times, at a different step per row, with padding rows (slot 0, negative, >= S) in
between. Per step:

- outputs: within 2 bf16 ulps (of the row's largest |y|) of the reference on the same
  GPU. Both compute in FP32 from the same quantized data; they differ only in summation
  order (relative error ~1e-6 of the summed magnitudes, far below a bf16 ulp of 2**-8),
  which can move the final bf16 rounding of an element by one ulp;
- positions, x / dt / B rings (and NVFP4 parity): bit-exact;
- flush rows: the kernel's FP32 state S (the flush's test variant) within FP32 summation
  noise of the reference fold, and the FP16 checkpoint and the read copy bit-exact with
  the reference quantizers applied to S (`to_fp16` with `checkpoint_rbits`; `fp8_encode`;
  `nvfp4_encode` with the live amax, and the group amax of S in meta's other half; fp16
  has no read copy: its steps read the checkpoint);
- everything else (state of non-flushing and padding slots, the bytes between slots)
  untouched, with NaN-poisoned memory everywhere the kernels must not read.
Launch variants beyond a step's default config (`config.step_config`) are forced with
`dataclasses.replace`, as a tuning override would.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from replayssm import layout as L
from replayssm import reference as ref
from replayssm.quant import formats as Q
from replayssm.quant.minifloat import to_fp16
from replayssm.quant.rng import checkpoint_rbits
from replayssm.formats import FORMATS

from . import tolerances as tol
from .gpu_harness import DEVICE, MANY_LIVE, MANY_SLOTS, NAN, World, check_graph_replays_whole_periods, check_warmup, ulp_bf16
from .helpers import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (pip install -e '.[cute]')"),
]


def _world(fmt, heads, groups, case, seed=0):
    many = {"live": MANY_LIVE, "num_slots": MANY_SLOTS} if case.get("many") else {"live": (5,)} if case.get("one") else {}
    dims = {"head_dim": case.get("P", 64), "state_dim": case.get("N", 128)}
    return World(fmt, heads, groups, seed=seed, sync=case.get("sync", False), wide=case.get("wide", False), **many, **dims)


def _config(w: World, case):
    from replayssm.kernels.cute.arch import arch_for
    from replayssm.kernels.cute.config import step_config

    cfg = step_config(arch_for(), w.fmt, w.heads, w.groups, w.batch)
    override = {k: case[k] for k in ("read_hint", "flush_rows", "flush_pdl") if k in case}
    return dataclasses.replace(cfg, **override)


def _step(w: World, out, state, cfg):
    """prepare (Triton) + both CuTe kernels, the flush's test variant writing S."""
    from replayssm.kernels import kernel_backend
    from replayssm.kernels.cute import launch

    x, dt, A, B, C, D, dt_bias = w.inputs(w.token())
    out.fill_(NAN)
    state.fill_(NAN)
    plan = kernel_backend().prepare(w.cache, w.ids, out, fmt=FORMATS[w.fmt], seed=w.seed)
    launch.decode_step(w.cache, x, dt, A, B, C, D, dt_bias, plan, out, state_dtype=w.fmt, config=cfg, state_out=state)
    return (x, dt, A, B, C, D, dt_bias), plan


CASES = [
    pytest.param("fp8", 16, 2, {}, id="fp8-h16-g2-mixed"),
    pytest.param("fp8", 16, 1, {}, id="fp8-h16-g1-mixed"),
    pytest.param("fp8", 16, 2, {"sync": True}, id="fp8-h16-g2-sync"),
    # Subnormal FP16 / e4m3 results: the encoders' general paths.
    pytest.param("fp8", 16, 2, {"wide": True}, id="fp8-h16-g2-wide-range"),
    # A batch of 45 rows: three row groups of the flush, the last one partial; then with
    # the flush grid cut to 2 CTA columns (a CTA walks groups 0 and 2, its flag words
    # alternating).
    pytest.param("fp8", 16, 2, {"many": True}, id="fp8-h16-g2-many-rows"),
    pytest.param("fp8", 16, 2, {"many": True, "columns": 2}, id="fp8-h16-g2-many-rows-2-columns"),
    # 64 heads, flush row groups of 32 rows (the config's choice from batch 128 on), the
    # second group partial; then with one CTA column, which walks both groups.
    pytest.param("fp8", 64, 8, {"many": True, "flush_rows": 32}, id="fp8-h64-g8-many-rows-32-row-groups"),
    pytest.param("fp8", 64, 8, {"many": True, "flush_rows": 32, "columns": 1}, id="fp8-h64-g8-32-row-groups-1-column"),
    # The read-copy loads with the L2 prefetch-size hint (the config's choice from heads x
    # batch >= 8192 on).
    pytest.param("fp8", 16, 2, {"read_hint": ".L2::128B"}, id="fp8-h16-g2-mixed-read-hint"),
    pytest.param("fp8", 16, 2, {"many": True, "read_hint": ".L2::128B"}, id="fp8-h16-g2-many-rows-read-hint"),
    # A batch of one row: the non-flush kernel launched with PDL.
    pytest.param("fp8", 16, 2, {"one": True}, id="fp8-h16-g2-one-row"),
    # Neither kernel with PDL: the flush on the side stream.
    pytest.param("fp8", 16, 2, {"flush_pdl": False}, id="fp8-h16-g2-mixed-flush-without-pdl"),
    pytest.param("nvfp4", 16, 2, {}, id="nvfp4-h16-g2-mixed"),
    pytest.param("nvfp4", 16, 1, {}, id="nvfp4-h16-g1-mixed"),
    pytest.param("nvfp4", 16, 2, {"sync": True}, id="nvfp4-h16-g2-sync"),
    pytest.param("nvfp4", 64, 4, {}, id="nvfp4-h64-g4-mixed"),
    pytest.param("nvfp4", 16, 2, {"many": True}, id="nvfp4-h16-g2-many-rows"),
    pytest.param("nvfp4", 16, 2, {"many": True, "columns": 2}, id="nvfp4-h16-g2-many-rows-2-columns"),
    pytest.param("nvfp4", 16, 2, {"one": True}, id="nvfp4-h16-g2-one-row"),
    # One slot's state spans 10**-12 .. 1: the sm_90a flush's general rounding path
    # (bits.fp16x2_sr_voted) beside the normal one.
    pytest.param("nvfp4", 16, 2, {"wide": True}, id="nvfp4-h16-g2-wide-range"),
    pytest.param("nvfp4", 16, 2, {"flush_pdl": False}, id="nvfp4-h16-g2-mixed-flush-without-pdl"),
    pytest.param("fp16", 16, 2, {}, id="fp16-h16-g2-mixed"),
    pytest.param("fp16", 16, 1, {}, id="fp16-h16-g1-mixed"),
    pytest.param("fp16", 16, 2, {"sync": True}, id="fp16-h16-g2-sync"),
    # FP16-subnormal checkpoint values: the flush's general rounding path, and subnormal
    # f16 operands of the steps' row dots.
    pytest.param("fp16", 16, 2, {"wide": True}, id="fp16-h16-g2-wide-range"),
    pytest.param("fp16", 16, 2, {"many": True}, id="fp16-h16-g2-many-rows"),
    pytest.param("fp16", 16, 2, {"many": True, "columns": 2}, id="fp16-h16-g2-many-rows-2-columns"),
    pytest.param("fp16", 64, 8, {"many": True}, id="fp16-h64-g8-many-rows"),
    pytest.param("fp16", 16, 2, {"one": True}, id="fp16-h16-g2-one-row"),
    pytest.param("fp16", 16, 2, {"flush_pdl": False}, id="fp16-h16-g2-mixed-flush-without-pdl"),
    # Heads-a-group ratios of served models (Nemotron-H 4B 112/8, Granite 4.0-H Tiny 48/1)
    # and their tensor-parallel-8 shards (14/1, 6/1), and the ratio's bounds (1, 128).
    *(pytest.param(f, h, g, {}, id=f"{f}-h{h}-g{g}-mixed") for f in ("fp8", "nvfp4", "fp16")
      for h, g in ((112, 8), (14, 1), (48, 1), (6, 1))),
    pytest.param("nvfp4", 8, 8, {}, id="nvfp4-h8-g8-mixed"),
    pytest.param("fp8", 128, 1, {}, id="fp8-h128-g1-mixed"),
    # State dim 256 (Nemotron-H 47B / 56B: 256 heads in 8 groups, its TP-8 shard 32 / 1;
    # Falcon-H1: 1 group): the flush's 8-warp CTA, the steps' four n-chunks.
    *(pytest.param(f, h, g, {"N": 256, **c}, id=f"{f}-h{h}-g{g}-n256-{n}") for f in ("fp8", "nvfp4", "fp16")
      for h, g, c, n in ((16, 2, {}, "mixed"), (32, 1, {}, "mixed"), (16, 2, {"many": True, "columns": 2}, "many-rows-2-columns"),
                         (16, 2, {"wide": True}, "wide-range"))),
    pytest.param("nvfp4", 8, 8, {"N": 256}, id="nvfp4-h8-g8-n256-mixed"),
    # Head dim 80 (Nemotron Nano 2: 128 heads / 8 groups, TP-8 16 / 1): the steps' fifth
    # m-tile, the flush's five row parts a head; with state dim 256 too.
    *(pytest.param(f, h, g, {"P": 80, "N": n, **c}, id=f"{f}-h{h}-g{g}-p80-n{n}-{k}") for f in ("fp8", "nvfp4", "fp16")
      for h, g, n, c, k in ((16, 2, 128, {}, "mixed"), (16, 1, 128, {}, "mixed"), (16, 2, 128, {"many": True, "columns": 2}, "many-rows-2-columns"),
                            (16, 2, 128, {"wide": True}, "wide-range"), (16, 2, 256, {}, "mixed"))),
]


@pytest.mark.parametrize("fmt,heads,groups,case", CASES)
def test_kernels_match_reference_over_three_periods(fmt, heads, groups, case, monkeypatch):
    from replayssm.kernels.cute import launch

    if "columns" in case:
        monkeypatch.setattr(launch, "flush_columns", lambda *args: case["columns"])
    w = _world(fmt, heads, groups, case)
    cfg = _config(w, case)
    assert cfg.nonflush_pdl == (w.batch == 1)
    nvfp4 = fmt == "nvfp4"
    has_copy = FORMATS[fmt].has_read_copy
    cache, H, (P, N) = w.cache, heads, L.dims(w.cache)
    hpg = H // groups
    out = torch.empty(w.batch, H, P, dtype=torch.bfloat16, device=DEVICE)
    state = torch.empty(w.batch, H, P, N, dtype=torch.float32, device=DEVICE)
    flushed, worst = 0, 0.0
    exact = (L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS) + ((L.PARITY,) if nvfp4 else ())
    copies = (L.CHECKPOINT,) + ((L.READ_COPY, L.SCALES) if has_copy else ()) + ((L.META,) if nvfp4 else ())
    for step in range(48):
        before = [t.clone() for t in cache]
        (x, dt, A, B, C, D, dt_bias), plan = _step(w, out, state, cfg)
        expect = [t.clone() for t in before]
        out_ref = torch.full_like(out, NAN)
        ref.decode(expect, x, dt, A, B, C, D, dt_bias, w.ids, out_ref, fmt=FORMATS[fmt], seed=w.seed)
        torch.cuda.synchronize()

        valid = ref.valid_rows(w.ids.long(), cache[1].shape[0])
        assert bool((out[~valid] == 0).all()), f"step {step}: padding rows must be zero"
        y, yr = out[valid].float(), out_ref[valid].float()
        assert not bool(torch.isnan(y).any()), f"step {step}: NaN in outputs"
        ratio = float(((y - yr).abs() / ulp_bf16(yr.abs().amax(dim=-1, keepdim=True))).amax())
        worst = max(worst, ratio)
        assert ratio <= tol.KERNEL_OUTPUT_BF16_ULPS, f"step {step}: output differs by {ratio:.2f} bf16 ulps of the row max"
        for i in exact:
            assert same_bits(cache[i], expect[i]), f"step {step}: cache[{i}] differs from the reference"

        fl = plan.flush.clone()
        slots = plan.slot[fl]
        untouched = torch.ones(cache[1].shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        for i in copies:
            assert same_bits(cache[i][untouched], before[i][untouched]), f"step {step}: cache[{i}] of a non-flushing slot changed"
        if slots.numel():
            flushed += slots.numel()
            S = state[fl]
            dts = ref.softplus_dt(dt[fl], dt_bias.view(1, -1))
            S_ref = ref.fold(before, slots, x[fl], dts, B[fl], A, plan.ring_index[fl])
            scale = S_ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            assert float(((S - S_ref).abs() / scale).amax()) < tol.FOLD_REL_TOL, f"step {step}: FP32 state differs"
            ck = to_fp16(S, checkpoint_rbits(plan.key[fl], H, 0, P, N))
            assert same_bits(cache[L.CHECKPOINT][slots], ck), f"step {step}: checkpoint bits differ from to_fp16(S)"
            if nvfp4:
                old = plan.old_parity[fl]
                meta_b = before[L.META][slots]  # prepare leaves the live half (1 - old) as it was
                live_amax = meta_b.gather(2, (1 - old).view(-1, 1, 1).expand(-1, groups, 1)).squeeze(-1)
                codes, scales = Q.nvfp4_encode(S, live_amax.repeat_interleave(hpg, dim=1))
                meta = cache[L.META][slots]
                measured = S.abs().reshape(S.shape[0], groups, -1).amax(dim=-1)
                acc = meta.gather(2, old.view(-1, 1, 1).expand(-1, groups, 1)).squeeze(-1)
                kept = meta.gather(2, (1 - old).view(-1, 1, 1).expand(-1, groups, 1)).squeeze(-1)
                assert same_bits(acc, measured), f"step {step}: meta[old] is not the group amax of S"
                assert same_bits(kept, live_amax), f"step {step}: the live half of meta changed"
            elif has_copy:
                codes, scales = Q.fp8_encode(S)
            if has_copy:
                assert same_bits(cache[L.READ_COPY][slots], codes), f"step {step}: read copy bits differ from the encoder applied to S"
                assert same_bits(cache[L.SCALES][slots], scales), f"step {step}: scales differ from the encoder applied to S"
        assert w.gaps_untouched(), f"step {step}: bytes between slot tensors were written"
    live = int(valid.sum())
    assert flushed == 3 * live, (flushed, live)
    print(f"[{fmt} {heads}h/{groups}g {case}] 48 steps, {flushed} row flushes, worst {worst:.2f} bf16 ulps of the row max")


def test_nvfp4_runs_are_bit_identical_with_many_ctas_per_group():
    """64 heads in 4 groups (16 CTAs race on each group's amax atomic): two runs from the
    same start give identical bits everywhere (outputs, checkpoint, copy, meta)."""
    runs = []
    for _ in range(2):
        w = World("nvfp4", 64, 4, seed=5)
        cfg = _config(w, {})
        out = torch.empty(w.batch, 64, 64, dtype=torch.bfloat16, device=DEVICE)
        state = torch.empty(w.batch, 64, 64, 128, dtype=torch.float32, device=DEVICE)
        outs = []
        for _ in range(32):
            _step(w, out, state, cfg)
            outs.append(out.clone())
        torch.cuda.synchronize()
        runs.append((outs, [t.clone() for t in w.cache]))
    (o1, c1), (o2, c2) = runs
    for s, (a, b) in enumerate(zip(o1, o2)):
        assert same_bits(a, b), f"step {s}: outputs differ between runs"
    for i, (a, b) in enumerate(zip(c1, c2)):
        assert same_bits(a, b), f"cache[{i}] differs between runs"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_cuda_graph_replays_whole_periods(fmt):
    check_graph_replays_whole_periods(fmt)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_cuda_graph_replays_whole_periods_at_batch_1(fmt):
    """Batch 1: the non-flush kernel with programmatic dependent launch, captured."""
    check_graph_replays_whole_periods(fmt, live=(5,))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_warmup_compiles_and_launches_both_kernels_without_changing_the_cache(fmt):
    check_warmup(fmt)
