"""The benchmark's byte model against the bytes of real cache tensors, and the benchmark
script end to end in --dry-run mode (CPU, PyTorch references, tiny sizes)."""

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import replayssm
from replayssm import layout as L

from . import tolerances as tol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_decode, byte_model as bm, common  # noqa: E402

SHAPES = [pytest.param(8, 1, 64, 128, id="h8-g1"), pytest.param(16, 2, 64, 128, id="h16-g2"),
          pytest.param(64, 8, 64, 128, id="h64-g8"), pytest.param(32, 2, 64, 128, id="h32-g2"),
          pytest.param(8, 1, 64, 256, id="h8-g1-64x256"), pytest.param(6, 2, 80, 128, id="h6-g2-80x128"),
          pytest.param(4, 1, 80, 256, id="h4-g1-80x256")]  # fmt: skip


# What the fixed clock reports for every timed call (seconds).
PERIOD_S = 0.032


def slot_nbytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


@pytest.fixture
def fixed_clock(monkeypatch):
    """The benchmark's clock still runs every timed call (the steps and the copy probe
    execute) but reports PERIOD_S for each, so every derived figure has an exact value
    (the probe's clock, `common.perf_counter`, advances PERIOD_S a reading from 0 at the
    start of a copy)."""

    def time_each(self, fn, reps):
        out = []
        for _ in range(reps):
            fn()
            out.append(PERIOD_S)
        return out

    readings = itertools.count()
    monkeypatch.setattr(bench_decode.Clock, "time_each", time_each)
    monkeypatch.setattr(common, "perf_counter", lambda: (next(readings) % 2) * PERIOD_S)


def us_per_step_of_period(layers: int) -> float:
    """A step's time when one period (16 tokens through `layers` layers) takes PERIOD_S."""
    return PERIOD_S / (bench_decode.RING * layers) * 1e6


@pytest.mark.parametrize("heads,groups,P,N", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_cache_memory_matches_allocated_tensors(fmt, heads, groups, P, N):
    cache = replayssm.allocate_cache(3, heads, groups, fmt, head_dim=P, state_dim=N)
    want = sum(slot_nbytes(t) for t in cache[1:])
    shape = bm.Shape(heads, groups, P, N)
    assert bm.cache_bytes_per_slot(f"replayssm-{fmt}", shape) == want
    mgr = replayssm.ReplaySSMCache(3, heads, groups, fmt, "cpu", backend="reference", head_dim=P, state_dim=N)
    assert mgr.bytes_per_slot() == want
    assert bm.cache_bytes_per_slot("standard-fp32", shape) == torch.empty(heads, P, N).nbytes
    assert bm.cache_bytes_per_slot("standard-bf16", shape) == torch.empty(heads, P, N, dtype=torch.bfloat16).nbytes


@pytest.mark.parametrize("heads,groups,P,N", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_step_bytes_match_cache_tensors(fmt, heads, groups, P, N):
    """Every term of the model recomputed from the tensors a step touches."""
    nvfp4 = fmt == "nvfp4"
    cache = replayssm.allocate_cache(3, heads, groups, fmt, head_dim=P, state_dim=N)
    shape = bm.Shape(heads, groups, P, N)
    # one ring entry: the x, dt and B of one token (ring index 0) of one slot
    entry = cache[L.X_RING][0, :, 0].nbytes + cache[L.DT_RING][0, :, 0].nbytes + cache[L.B_RING][0, :, 0].nbytes
    assert bm.ring_entry_bytes(shape) == entry
    read_copy = slot_nbytes(cache[L.READ_COPY]) + slot_nbytes(cache[L.SCALES])
    meta = slot_nbytes(cache[L.META]) + slot_nbytes(cache[L.PARITY]) if nvfp4 else 0
    assert sum(bm.read_copy_bytes(shape, fmt).values()) == read_copy + meta
    ckpt = slot_nbytes(cache[L.CHECKPOINT])
    pos = slot_nbytes(cache[L.POSITIONS])
    x = torch.empty(1, heads, P, dtype=torch.bfloat16).nbytes
    dt = torch.empty(1, heads).nbytes
    bc = 2 * torch.empty(1, groups, N, dtype=torch.bfloat16).nbytes
    inputs = x + dt + bc + torch.empty(1, dtype=torch.int32).nbytes
    out = x

    # A period: ring index r = 0..14 reads the read copy and r entries and writes one
    # entry; r = 15 reads the checkpoint and 15 entries and writes checkpoint + read copy.
    read = 15 * (read_copy + meta) + ckpt + sum(range(16)) * entry + 16 * (inputs + pos) + meta
    write = 15 * entry + ckpt + read_copy + meta + 16 * (out + pos)
    for r in range(15):
        b = bm.replay_step(shape, fmt, r)
        assert b.read == read_copy + meta + r * entry + inputs + pos
        assert b.write == entry + out + pos
    avg = bm.replay_period_average(shape, fmt)
    assert avg.read == read // 16 and avg.write == write // 16
    assert bm.step_bytes(f"replayssm-{fmt}", shape) == avg

    for dtype, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")]:
        state = torch.empty(1, heads, P, N, dtype=dtype).nbytes
        b = bm.step_bytes(f"standard-{name}", shape)
        assert (b.read, b.write) == (state + inputs, state + out)


@pytest.mark.parametrize("heads,groups,P,N", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_pending_call_bytes_match_cache_tensors(fmt, heads, groups, P, N):
    """Every term of a pending call's model recomputed from a pending cache's tensors: the
    plan's positions, slot id and verdict; the fold's checkpoint, Gd = 17 - T ring entries
    and read copy for committed / Gd of the rows; every row's read copy (fp16: the
    checkpoint), (Gd - 1) / 2 replayed entries, T tokens' inputs, ring entries and outputs."""
    cache = replayssm.allocate_cache(3, heads, groups, fmt, head_dim=P, state_dim=N, pending=True)
    shape = bm.Shape(heads, groups, P, N)
    entry = cache[L.X_RING][0, :, 0].nbytes + cache[L.DT_RING][0, :, 0].nbytes + cache[L.B_RING][0, :, 0].nbytes
    ckpt = slot_nbytes(cache[L.CHECKPOINT])
    meta = slot_nbytes(cache[L.META]) + slot_nbytes(cache[L.PARITY]) if fmt == "nvfp4" else 0
    read_copy = ckpt if fmt == "fp16" else slot_nbytes(cache[L.READ_COPY]) + slot_nbytes(cache[L.SCALES]) + meta
    pos = slot_nbytes(cache[L.POSITIONS])
    assert pos == 8
    x = torch.empty(1, heads, P, dtype=torch.bfloat16).nbytes
    token_in = x + torch.empty(1, heads).nbytes + 2 * torch.empty(1, groups, N, dtype=torch.bfloat16).nbytes
    ids_and_verdict = 2 * torch.empty(1, dtype=torch.int32).nbytes
    for T in (1, 2, 4, 8):
        gd = 17 - T
        for committed in (0.0, T / 2, float(T)):
            f = committed / gd
            read = pos + ids_and_verdict + f * (ckpt + gd * entry + meta) + read_copy + (gd - 1) / 2 * entry + T * token_in
            write = pos + f * (ckpt + (0 if fmt == "fp16" else read_copy)) + T * (entry + x)
            b = bm.pending_call(shape, fmt, T, committed)
            assert (b.read, b.write) == (round(read), round(write)), (T, committed)
    with pytest.raises(ValueError, match="committed"):
        bm.pending_call(shape, fmt, 4, 4.5)
    with pytest.raises(ValueError, match="tokens"):
        bm.pending_call(shape, fmt, 9, 1.0)


def test_state_bytes_per_head_token_match_design_table():
    """Design brief §6: 65,536 / 32,768 bytes per head per token for the standard decode,
    about 11,000 (FP8) and 7,500 (NVFP4) for ReplaySSM."""
    assert bm.state_bytes_per_head_token("standard-fp32") == 65536
    assert bm.state_bytes_per_head_token("standard-bf16") == 32768
    # FP8: (15 * (8192 + 256) + (2 * 16384 + 8192 + 256)) / 16
    assert bm.state_bytes_per_head_token("replayssm-fp8") == (15 * 8448 + 41216) / 16
    # NVFP4: (15 * (4096 + 512) + (2 * 16384 + 4096 + 512)) / 16
    assert bm.state_bytes_per_head_token("replayssm-nvfp4") == (15 * 4608 + 37376) / 16
    assert 10_000 < bm.state_bytes_per_head_token("replayssm-fp8") < 11_500
    assert 6_000 < bm.state_bytes_per_head_token("replayssm-nvfp4") < 7_600


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="ring_index"):
        bm.replay_step(bm.Shape(8, 1), "fp8", 16)
    with pytest.raises(ValueError, match="fmt"):
        bm.read_copy_bytes(bm.Shape(8, 1), "int8")
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--providers", "replayssm-int8"])


def test_dry_run_writes_expected_rows(tmp_path, fixed_clock):
    res = bench_decode.main(["--dry-run", "--out", str(tmp_path), "--batches", "1,2"])
    data = json.loads((tmp_path / "results.json").read_text())
    copy = data["meta"]["copy_bandwidth"]
    assert copy["tb_per_s"] == pytest.approx(2 * copy["bytes"] / PERIOD_S / 1e12)
    assert data["rows"] == json.loads(json.dumps(res["rows"], default=str))
    rows = data["rows"]
    want = {(p, b, s) for b in (1, 2) for p in bench_decode.REPLAY for s in ("desync", "sync")}
    want |= {(p, b, "-") for b in (1, 2) for p in bench_decode.STANDARD}
    assert {(r["provider"], r["batch"], r["sync"]) for r in rows} == want
    assert len(rows) == len(want)
    for r in rows:
        assert r["error"] is None, r
        assert (r["heads"], r["groups"], r["timing"], r["layers"]) == (8, 1, "cpu", 1)
        assert r["bytes_per_step"] == r["batch"] * bm.step_bytes(r["provider"], bm.Shape(8, 1)).total
        assert r["us_per_step"] == pytest.approx(us_per_step_of_period(r["layers"]))
        assert math.isclose(r["tb_per_s"], r["bytes_per_step"] / (r["us_per_step"] * 1e-6) / 1e12)
        assert math.isclose(r["frac_copy_bw"], r["tb_per_s"] / data["meta"]["copy_bandwidth"]["tb_per_s"])
        base = next(s for s in rows if s["provider"] == "standard-bf16" and s["batch"] == r["batch"])
        assert math.isclose(r["speedup_vs_bf16"], base["us_per_step"] / r["us_per_step"])
    assert data["byte_model"]["replayssm-fp8/8x1"]["cache_bytes_per_slot"] == bm.cache_bytes_per_slot(
        "replayssm-fp8", bm.Shape(8, 1))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert data["meta"]["plot"].startswith("no plot")
    else:
        assert (tmp_path / "decode.png").stat().st_size > 10_000


def test_dry_run_at_another_geometry(tmp_path, fixed_clock):
    """--shapes HxGxPxN (4 heads, 2 groups, P 80, N 256): every provider builds its inputs,
    caches and states there (the CPU references check the shapes), rows and byte model
    record P and N; vLLM's kernel cannot run on the CPU: its row says it was skipped."""
    res = bench_decode.main(["--dry-run", "--out", str(tmp_path), "--batches", "1", "--shapes", "4x2x80x256",
                             "--providers", "replayssm-fp8,vllm-replayssm-fp16,standard-bf16", "--sync", "desync",
                             "--inputs", "engine"])  # fmt: skip
    shape = bm.Shape(4, 2, 80, 256)
    rows = {r["provider"]: r for r in res["rows"]}
    assert set(rows) == {"replayssm-fp8", bench_decode.VLLM, "standard-bf16"} and len(res["rows"]) == 3
    for r in res["rows"]:
        assert (r["heads"], r["groups"], r["head_dim"], r["state_dim"]) == (4, 2, 80, 256)
        model = bench_decode.BYTE_MODEL.get(r["provider"], r["provider"])
        assert r["bytes_per_step"] == bm.step_bytes(model, shape).total
    vllm = rows.pop(bench_decode.VLLM)
    assert vllm["error"].startswith("skipped: ") and "CUDA" in vllm["error"] and vllm["us_per_step"] is None
    for r in rows.values():
        assert r["error"] is None and r["us_per_step"] == pytest.approx(us_per_step_of_period(r["layers"])), r
    assert rows["replayssm-fp8"]["speedup_vs_bf16"] == pytest.approx(1.0)
    model = res["byte_model"]["replayssm-fp8/4x2x80x256"]
    assert model["cache_bytes_per_slot"] == bm.cache_bytes_per_slot("replayssm-fp8", shape)
    assert res["byte_model"][f"{bench_decode.VLLM}/4x2x80x256"]["provider"] == bench_decode.VLLM
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == json.loads(json.dumps(res["rows"]))


def test_shapes_and_provider_skips():
    """--shapes takes HxG (P 64, N 128) and HxGxPxN; a shape that is no cache geometry is
    refused. Every provider runs every geometry; vLLM's kernel needs a GPU."""
    assert bench_decode.parse_args(["--shapes", "16x2,48x1x64x256,6x1x80x128"]).shapes == [
        (16, 2, 64, 128), (48, 1, 64, 256), (6, 1, 80, 128)]  # fmt: skip
    for bad in ("16x2x64", "16x2x96x128", "13x2", "16x2x80x512"):
        with pytest.raises(SystemExit):
            bench_decode.parse_args(["--shapes", bad])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bench_decode.provider_skip("replayssm-nvfp4", (16, 1, 80, 128), cuda) is None
    assert bench_decode.provider_skip("replayssm-fp8", (16, 1, 64, 256), cuda) is None
    assert bench_decode.provider_skip("standard-bf16", (16, 1, 80, 128), cuda) is None
    assert bench_decode.provider_skip(bench_decode.VLLM, (16, 1, 80, 128), cuda) is None
    assert bench_decode.provider_skip("replayssm-fp8", (16, 1, 80, 128), cpu) is None  # the smoke test's reference
    assert bench_decode.provider_skip(bench_decode.VLLM, (16, 2, 64, 128), cpu).startswith("skipped: ")


def test_speedups_pair_rows_of_one_geometry():
    """Speedups compare rows of the same heads, groups, P, N and batch (and, against vLLM's
    kernel, the same flush alignment), never across geometries."""
    def row(prov, n, us, sync="desync"):
        return {"provider": prov, "heads": 32, "groups": 1, "head_dim": 64, "state_dim": n, "batch": 256,
                "sync": sync, "us_per_step": us}  # fmt: skip

    rows = [row("standard-bf16", 128, 40.0, "-"), row("standard-bf16", 256, 80.0, "-"), row("replayssm-fp8", 128, 20.0),
            row("replayssm-fp8", 256, 10.0), row(bench_decode.VLLM, 256, 30.0),
            row(bench_decode.VLLM, 256, 60.0, "sync")]  # fmt: skip
    bench_decode.add_speedups(rows)
    assert [r["speedup_vs_bf16"] for r in rows] == [1.0, 1.0, 2.0, 8.0, 80 / 30, 80 / 60]
    assert rows[2]["speedup_vs_vllm_fp16"] is None and rows[3]["speedup_vs_vllm_fp16"] == 3.0
    more = {"timing": "graph", "layers": 1, "bytes_per_step": 1, "tb_per_s": 1.0, "frac_copy_bw": 0.5,
            "l2_resident": False, "error": None}  # fmt: skip
    table = bench_decode.fmt_table([{**r, **more} for r in rows], 1.0)
    assert "x vllm" in table.splitlines()[1] and "32h1g/64x256" in table


def test_replot_redraws_from_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bench_decode.main(["--dry-run", "--out", str(tmp_path / "run"), "--batches", "1", "--providers", "standard-fp16"])
    capsys.readouterr()
    res = bench_decode.main(["--replot", str(tmp_path / "run" / "results.json"), "--out", str(tmp_path / "plot")])
    table = capsys.readouterr().out
    row = res["rows"][0]
    assert f"{row['us_per_step']:.2f}" in table
    assert (tmp_path / "plot" / "decode.png").stat().st_size > 10_000


def test_failing_provider_is_recorded_not_fatal(tmp_path, monkeypatch, fixed_clock):
    real = bench_decode.build_steps

    def broken(provider, *a, **k):
        if provider == "replayssm-nvfp4":
            raise RuntimeError("boom")
        return real(provider, *a, **k)

    monkeypatch.setattr(bench_decode, "build_steps", broken)
    res = bench_decode.main(["--dry-run", "--out", str(tmp_path), "--batches", "1",
                             "--providers", "replayssm-nvfp4,standard-fp16", "--sync", "desync"])  # fmt: skip
    rows = {r["provider"]: r for r in res["rows"]}
    assert rows["replayssm-nvfp4"]["error"] == "RuntimeError: boom"
    assert rows["replayssm-nvfp4"]["us_per_step"] is None
    std = rows["standard-fp16"]
    assert std["error"] is None and std["us_per_step"] == pytest.approx(us_per_step_of_period(std["layers"]))


@pytest.mark.gpu
def test_gpu_smoke_run(tmp_path):
    """A small real run: every row timed, the standard decode captured in CUDA graphs, the
    correctness checks within bf16 rounding of the PyTorch twins. Each row's time lies
    between the byte model's floor (its bytes over the copy bandwidth measured in the run,
    where the working set is beyond the L2) and the run's own duration, and a captured
    ReplaySSM step at batch 64 is not slower than the fp32-state decode, which moves 5.4x
    (FP8) / 7.9x (NVFP4) its bytes."""
    res = bench_decode.main(["--out", str(tmp_path), "--batches", "8,64", "--shapes", "16x2", "--reps", "5",
                             "--max-layers", "4", "--eager-periods", "1", "--copy-gib", "0.25"])  # fmt: skip
    copy_bytes_per_us = res["meta"]["copy_bandwidth"]["tb_per_s"] * 1e6
    for r in res["rows"]:
        assert r["error"] is None, r
        period_s = bench_decode.RING * r["layers"] * r["us_per_step"] * 1e-6
        assert period_s <= res["meta"]["seconds"], r
        if not r["l2_resident"]:
            nbytes = r["batch"] * bm.step_bytes(r["provider"], bm.Shape(r["heads"], r["groups"])).total
            floor_us = nbytes / copy_bytes_per_us
            assert r["us_per_step"] * tol.MAX_FRACTION_OF_COPY_BANDWIDTH >= floor_us, (floor_us, r)
        if r["provider"] in bench_decode.STANDARD:
            assert r["timing"] == "graph"
        else:
            assert r["timing"] in ("graph", "eager")
            if r["timing"] == "graph" and r["batch"] == 64:
                assert r["speedup_vs_fp32"] >= tol.MIN_SPEEDUP_VS_FP32_BATCH64, r
    for c in res["checks"]:
        assert "error" not in c, c
        assert c["max_abs_err_y"] <= tol.BF16_OUTPUT_RTOL * c["max_abs_y"] + tol.BF16_OUTPUT_ATOL, c


@pytest.mark.gpu
def test_gpu_vllm_provider(tmp_path):
    """vLLM's Triton ReplaySSM beside ours (the peer tree must be at --peers' default): its
    rows are captured in CUDA graphs at 64x128 and 64x256, and one synchronized period
    tracks the FP32 standard decode (loose floors: fp16 state, bf16 B in the flush's dot)."""
    if not Path(bench_decode.parse_args([]).peers, "vllm").is_dir():
        pytest.skip("vLLM's peer code is not beside the repository")
    res = bench_decode.main(["--out", str(tmp_path), "--batches", "32", "--shapes", "16x2,8x1x64x256", "--reps", "3",
                             "--max-layers", "2", "--copy-gib", "0.25", "--no-settle",
                             "--providers", f"replayssm-fp8,{bench_decode.VLLM}"])  # fmt: skip
    for r in res["rows"]:
        allowed = ("graph",) if r["provider"] == bench_decode.VLLM else ("graph", "eager")
        assert r["error"] is None and r["timing"] in allowed, r
        assert r["provider"] == bench_decode.VLLM or r["speedup_vs_vllm_fp16"] > 0, r
    checks = [c for c in res["checks"] if c["check"].startswith(bench_decode.VLLM)]
    assert len(checks) == 2
    for c in checks:
        assert c["sqnr_y_db"] >= 30.0 and c["sqnr_state_db"] >= 30.0, c


def test_step_timeline_statistics():
    """benchmarks/step_timeline.py's per-step figures from kernel records: two steps,
    hand-computed durations, gaps and flush offsets (medians of the two)."""
    pytest.importorskip("cutlass", reason="benchmarks/step_timeline.py imports the CuTe launchers (the cute extra)")
    from benchmarks.step_timeline import kernel_tag, step_stats

    decode = "kernel_cutlass_kernel_replayssmkernelscutedecodeDecode_object_at__ptrbf16_flush_y"
    flush = "kernel_cutlass_kernel_replayssmkernelscuteflushFlush_object_at__ptrf16_decode_x"
    assert [kernel_tag(n) for n in ("_prepare_kernel", flush, decode, "memcpy")] == [
        "prepare", "flush", "nonflush", "other",
    ]  # fmt: skip
    events = [
        ("prepare", 0.0, 2.0), ("flush", 2.5, 10.0), ("nonflush", 3.0, 20.0),
        ("prepare", 20.5, 22.5), ("flush", 23.0, 33.0), ("other", 24.0, 25.0), ("nonflush", 23.5, 41.0),
    ]  # fmt: skip
    got = step_stats(events)
    assert got["prepare"] == 2.0 and got["flush"] == (7.5 + 10.0) / 2 and got["nonflush"] == (17.0 + 17.5) / 2
    assert got["gap"] == 0.5 and got["next"] == 0.5
    assert got["flush_start"] == -0.5 and got["flush_end"] == (-10.0 - 8.0) / 2


def test_pending_timeline_statistics():
    """benchmarks/step_timeline.py's per-call figures of pending mode: the kernel names it
    tags, and two calls (the first with the step split in two launches, the second with
    one step and no fold) with hand-computed durations, offsets from the plan and spans."""
    pytest.importorskip("cutlass", reason="benchmarks/step_timeline.py imports the CuTe launchers (the cute extra)")
    from benchmarks.step_timeline import kernel_tag, pending_stats

    fold = "kernel_cutlass_kernel_replayssmkernelscuteflushPendingFold_object_at__ptrf16"
    step = "kernel_cutlass_kernel_replayssmkernelscutependingPendingStep_object_at__ptrbf16"
    plan = "kernel_cutlass_kernel_replayssmkernelscuteplanPendingPlanKernel_object_at__Ptrgeneric"
    prep = "kernel_cutlass_kernel_replayssmkernelscuteplanPrepare_object_at__Ptrgeneric"
    assert [kernel_tag(n) for n in (plan, fold, step, prep)] == ["plan", "fold", "step", "prepare"]
    events = [
        ("plan", 0.0, 2.0), ("fold", 1.5, 20.0), ("step", 10.0, 30.0), ("other", 12.0, 13.0), ("step", 21.0, 32.0),
        ("plan", 40.0, 43.0), ("step", 42.0, 50.0),
    ]  # fmt: skip
    got = pending_stats(events)
    assert got["plan"] == 2.5 and got["plan_start"] == 0.0 and got["plan_end"] == 2.5
    assert got["fold"] == 18.5 and got["fold_start"] == 1.5 and got["fold_end"] == 20.0
    assert got["step1"] == (20.0 + 8.0) / 2 and got["step1_start"] == (10.0 + 2.0) / 2 and got["step1_end"] == (30.0 + 10.0) / 2
    assert got["step2"] == 11.0 and got["step2_start"] == 21.0 and got["step2_end"] == 32.0
    assert got["span"] == (32.0 + 10.0) / 2


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_profile_steps_runs_the_layer_for_the_given_steps(fmt):
    """benchmarks/profile_steps.py (the ncu driver) on the CPU reference: every live row's
    position (tokens decoded) advances by the number of steps from its desynchronized start
    (i mod 16, so rows 11 to 15 cross a flush in 5 steps), and a second run gives the same
    outputs bit for bit."""
    pytest.importorskip("cutlass", reason="benchmarks/bench_kernels.py imports the CuTe launchers (the cute extra)")
    from benchmarks.bench_kernels import RING
    from benchmarks.profile_steps import run_steps

    batch, steps = 16, 5
    cache, ids, out = run_steps(fmt, batch, steps, heads=8, groups=1, device="cpu")
    start = torch.arange(batch, dtype=torch.int32) % RING
    assert torch.equal(cache[L.POSITIONS][ids.long()], start + steps)
    assert torch.isfinite(out.float()).all()
    _, _, again = run_steps(fmt, batch, steps, heads=8, groups=1, device="cpu")
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="--dry-run switches the process to the Triton interpreter; run the benchmark itself on a GPU")
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_bench_handoff_dry_run_measures_the_bytes_it_claims(tmp_path, fmt):
    """benchmarks/bench_handoff.py --dry-run (CPU, interpreter, 2 layers x 8 slots): its
    correctness checks pass, and every row's bytes are what the caches hold (copy: slots x
    bytes a slot x layers; swap: one slot over the layers; materialize: checkpoints, live
    ring entries and FP32 states of its rows); results.json holds the same rows."""
    from benchmarks import bench_handoff as bh

    result = bh.main(["--dry-run", "--formats", fmt, "--out", str(tmp_path)])
    args = result["meta"]["args"]
    assert all(c.get("ok", True) for c in result["checks"]), result["checks"]
    mat = [c for c in result["checks"] if "materialize" in c["check"]]
    assert mat and mat[0]["value"] <= tol.FOLD_REL_TOL
    per_slot = replayssm.ReplaySSMCache(3, args["heads"], args["groups"], fmt, "cpu", backend="reference").bytes_per_slot()
    rows = {r["op"]: r for r in result["rows"]}
    copy = args["copy_slots"] * per_slot * args["layers"]
    swap = per_slot * args["layers"]
    for op in ("copy_slots, one launch", "copy_slots, per tensor", "torch copy, same bytes (peer)"):
        assert rows[op]["bytes"] == copy, op
    for op in (
        "export 1 slot, one buffer", "import 1 slot, one buffer", "export 1 slot, per tensor", "import 1 slot, per tensor",
        "pinned D2H, same bytes (peer)",
    ):  # fmt: skip
        assert rows[op]["bytes"] == swap, op
    state = args["heads"] * 64 * 128
    entry = args["heads"] * (64 * 2 + 4) + args["groups"] * 128 * 2
    m = rows[f"materialize, batch {args['batch']}"]["bytes"] - args["batch"] * state * (2 + 4)
    assert 0 <= m <= args["batch"] * 15 * entry and m % entry == 0
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]


def test_bench_spec_verdicts_follow_the_acceptance_rule():
    """Token 0 always accepted, each draft with probability p until the first rejection:
    counts in 1..T with mean 1 + p + ... + p^(T-1)."""
    from benchmarks import bench_spec as bs

    for T in (1, 2, 4):
        acc = bs.verdicts(200_000, T, 0.7, torch.Generator().manual_seed(0))
        assert int(acc.min()) >= 1 and int(acc.max()) <= T
        want = sum(0.7**i for i in range(T))
        assert abs(float(acc.float().mean()) - want) < 0.01, (T, float(acc.float().mean()), want)


def test_bench_spec_dry_run_rows_bytes_and_targets(tmp_path):
    """benchmarks/bench_spec.py --dry-run (CPU, PyTorch twins, 8 heads / 1 group, batch 2):
    one row per provider, no errors; the baseline's bytes are the state read once, T
    intermediate states written and the commit's copy (plus inputs and outputs); the
    targets are min(1.6x the single-token step, baseline / 3); results.json holds the rows."""
    from benchmarks import bench_spec as bs

    res = bs.main(["--dry-run", "--out", str(tmp_path)])
    rows = {r["provider"]: r for r in res["rows"]}
    assert set(rows) == set(bs.PROVIDERS) and len(res["rows"]) == len(bs.PROVIDERS)
    for r in res["rows"]:
        assert r["error"] is None, r
        assert (r["heads"], r["groups"], r["batch"], r["timing"], r["layers"]) == (8, 1, 2, "cpu", 1)
        assert r["us_per_call"] > 0
    spec = rows[bs.SPEC]
    T, state = spec["T"], 8 * 64 * 128 * 2
    per_token = 8 * 64 * 2 + 8 * 4 + 2 * 128 * 2 + 8 * 64 * 2  # x, dt, B, C in; y out
    assert spec["bytes_per_call"] == 2 * ((1 + T) * state + T * per_token + 4 + 2 * state + 8)
    assert 1.0 <= spec["tokens_per_row"] <= T
    assert math.isclose(spec["us_per_token"], spec["us_per_call"] / spec["tokens_per_row"])
    for fmt in ("fp8", "nvfp4", "fp16"):  # a pending call's bytes follow its measured commits
        r = rows[f"pending-{fmt}"]
        assert r["bytes_per_call"] == 2 * bm.pending_call(bm.Shape(8, 1), fmt, r["T"], r["tokens_per_row"]).total
        assert math.isclose(r["tb_per_s"], r["bytes_per_call"] / (r["us_per_call"] * 1e-6) / 1e12)
    for fmt in ("fp8", "nvfp4"):
        single = rows[f"replayssm-{fmt}"]["us_per_call"]
        assert math.isclose(spec[f"target_us_{fmt}"], min(1.6 * single, spec["us_per_call"] / 3))
        assert math.isclose(spec[f"x_{fmt}_step"], spec["us_per_call"] / single)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["rows"] == json.loads(json.dumps(res["rows"], default=str))
    assert data["meta"]["command"].startswith("python benchmarks/bench_spec.py --dry-run")
    assert "commit" in data["meta"]


def test_bench_spec_dry_run_at_another_geometry():
    """bench_spec.py --dry-run --shapes 4x2x80x256: the baseline, pending and single-token
    rows run there and record P and N; the baseline's bytes are the state read once, T
    intermediate states written and the commit's copy at that geometry."""
    from benchmarks import bench_spec as bs

    res = bs.main(["--dry-run", "--shapes", "4x2x80x256", "--providers", "spec-bf16,pending-fp8,replayssm-fp8"])
    rows = {r["provider"]: r for r in res["rows"]}
    assert set(rows) == {"spec-bf16", "pending-fp8", "replayssm-fp8"} and len(res["rows"]) == 3
    for r in res["rows"]:
        assert r["error"] is None and r["us_per_call"] > 0, r
        assert (r["heads"], r["groups"], r["head_dim"], r["state_dim"], r["batch"]) == (4, 2, 80, 256, 2)
    spec, T, state = rows[bs.SPEC], 2, 4 * 80 * 256 * 2
    per_token = 4 * 80 * 2 + 4 * 4 + 2 * 2 * 256 * 2 + 4 * 80 * 2  # x, dt, B, C in; y out
    assert spec["bytes_per_call"] == 2 * ((1 + T) * state + T * per_token + 4 + 2 * state + 8)
    pending = rows["pending-fp8"]
    assert math.isclose(pending["baseline_speedup"], spec["us_per_call"] / pending["us_per_call"])


def test_results_record_the_commit_and_whether_the_tree_differs(tmp_path):
    """`benchmarks.common.commit`: the short HEAD of a checkout, "+dirty" once a tracked file
    differs from it (the GPU machine's copy of a tree whose .git lags), None outside a
    checkout."""
    import subprocess

    from benchmarks.common import commit

    outside = tmp_path / "plain"
    outside.mkdir()
    in_checkout = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=outside, capture_output=True).returncode == 0
    if not in_checkout:  # pytest's tmp_path lies outside any checkout on CI and here
        assert commit(outside) is None
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "a.txt"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "a"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    assert commit(repo) == head
    (repo / "b.txt").write_text("untracked\n")  # untracked files do not count
    assert commit(repo) == head
    (repo / "a.txt").write_text("two\n")
    assert commit(repo) == head + "+dirty"
