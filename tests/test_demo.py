"""The main job (`python -m replayssm demo`): its numbers, its options and its output."""

import io
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from replayssm.__main__ import _Progress, run_demo, state_bytes_per_token
from . import tolerances as tol

DEMO = [sys.executable, "-m", "replayssm", "demo"]
TINY = ["--device", "cpu", "--batch", "1", "--steps", "2", "--prompt", "2", "--format", "fp8"]
USAGE = "usage: python -m replayssm demo "
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_demo_reports_accuracy_and_bytes():
    buf = io.StringIO()
    t0 = time.perf_counter()
    res = run_demo(device="cpu", batch=2, steps=48, progress=False, out=buf)
    wall = time.perf_counter() - t0
    text = buf.getvalue()
    assert "SQNR" in text and "fp8" in text and "nvfp4" in text
    floors = tol.OUTPUT_SQNR_FLOOR_DB
    for r in res:
        assert r["sqnr_db"] >= floors[r["format"]]
        for half in ("sqnr_first_half_db", "sqnr_second_half_db"):
            assert r[half] >= floors[r["format"]] - 3
        # tokens/s is batch rows x steps over the decode loop's own wall time, which is a
        # part of the whole call's.
        assert 0 < r["elapsed_s"] < wall
        assert r["tokens_per_s"] == pytest.approx(2 * 48 / r["elapsed_s"], rel=1e-12)
        (row,) = [line for line in text.splitlines() if line.split()[:1] == [r["format"]]]
        assert int(row.split()[2]) == round(r["tokens_per_s"])
    # design brief section 6: ~11,000 (fp8) and ~7,500 (nvfp4) bytes per head per token
    assert 10_000 < state_bytes_per_token("fp8", 1) < 11_500
    assert 6_000 < state_bytes_per_token("nvfp4", 1) < 7_500


def test_one_step_has_no_halves():
    """A one-step demo has no first and second half to compare: the table shows '-', not
    the -inf dB of an empty half."""
    buf = io.StringIO()
    (r,) = run_demo(device="cpu", formats=("fp8",), batch=1, steps=1, prompt=4, progress=False, out=buf)
    assert r["sqnr_first_half_db"] is None and r["sqnr_second_half_db"] is None
    assert math.isfinite(r["sqnr_db"]) and r["sqnr_db"] >= 30.0
    (row,) = [line for line in buf.getvalue().splitlines() if line.split()[:1] == ["fp8"]]
    assert "-/-" in row.split() and "inf" not in row and "nan" not in row


def test_progress_bar_counts_tokens_per_second():
    """The bar's rate is in the table's unit: batch rows x steps a second."""
    buf = io.StringIO()
    bar = _Progress(buf, "bar")
    t0 = time.perf_counter()
    bar.start("fp8", 10, 4)
    time.sleep(0.05)
    bar.update(10)
    wall = time.perf_counter() - t0
    m = re.search(r"10/10 steps +([0-9.]+) tokens/s\n$", buf.getvalue())
    assert m, buf.getvalue()
    assert 40 / wall * 0.99 <= float(m.group(1)) <= 40 / 0.05


# (id, extra arguments, the error line's text). Each must be refused before anything is
# printed: exit code 2, the demo's usage, one error line, no traceback.
NO_GPU = not torch.cuda.is_available()
MISSING_CUDA = "cuda" if NO_GPU else f"cuda:{torch.cuda.device_count()}"
BAD = [
    ("steps-0", ["--steps", "0"], "argument --steps: must be an integer >= 1; got 0"),
    ("batch-negative", ["--batch", "-3"], "argument --batch: must be an integer >= 1; got -3"),
    ("batch-not-int", ["--batch", "two"], "argument --batch: expected an integer; got 'two'"),
    ("prompt-negative", ["--prompt", "-5"], "argument --prompt: must be an integer >= 0; got -5"),
    ("threads-0", ["--threads", "0"], "argument --threads: must be an integer >= 1; got 0"),
    ("seed-2**70", ["--seed", "1180591620717411303424"], "argument --seed: must be an integer in [0, 2**64)"),
    ("seed-negative", ["--seed", "-1"], "argument --seed: must be an integer in [0, 2**64); got -1"),
    ("heads-13-groups-2", ["--heads", "13"], "heads must be a multiple of groups with 1 to 128 heads a group; got 13 heads in 2 groups"),
    ("heads-16-groups-3", ["--groups", "3"], "heads must be a multiple of groups with 1 to 128 heads a group; got 16 heads in 3 groups"),
    ("heads-258-groups-2", ["--heads", "258"], "heads must be a multiple of groups with 1 to 128 heads a group; got 258 heads in 2 groups"),
    ("device-missing-cuda", ["--device", MISSING_CUDA], "argument --device: " + repr(MISSING_CUDA)),
    ("device-tpu", ["--device", "tpu"], "argument --device: expected auto, cpu or cuda[:N]; got 'tpu'"),
    ("device-mps", ["--device", "mps"], "argument --device: expected auto, cpu or cuda[:N]; got 'mps'"),
    ("device-gpu", ["--device", "gpu"], "argument --device: expected auto, cpu or cuda[:N]; got 'gpu'"),
    ("device-meta", ["--device", "meta"], "argument --device: expected auto, cpu or cuda[:N]; got 'meta'"),
]


def _run(key: str, cmd: list[str]) -> subprocess.CompletedProcess:
    # stderr into stdout for "progress": their order shows what a pipe reader sees when.
    err = subprocess.STDOUT if key == "progress" else subprocess.PIPE
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, timeout=600)


@pytest.fixture(scope="module")
def cli_runs():
    """Every CLI run of this module, four at a time (each is mostly a torch import)."""
    runs = {case_id: [*DEMO, *TINY, *args] for case_id, args, _ in BAD}
    runs["help"] = [*DEMO, "--help"]
    runs["progress"] = [*DEMO, *TINY, "--steps", "32"]
    runs["no-progress"] = [*DEMO, *TINY, "--steps", "16", "--no-progress"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(_run, key, cmd) for key, cmd in runs.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("case_id, message", [pytest.param(c, m, id=c) for c, _, m in BAD])
def test_cli_refuses_bad_options_up_front(cli_runs, case_id, message):
    r = cli_runs[case_id]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""  # nothing, not even the header, before the error
    assert r.stderr.startswith(USAGE), r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m replayssm demo: error: ") and message in last, last


def test_cli_help_shows_defaults(cli_runs):
    r = cli_runs["help"]
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for option, default in (("--device", "auto"), ("--format", "both"), ("--batch", "8"), ("--steps", "256"),
                            ("--heads", "16"), ("--groups", "2"), ("--prompt", "64"), ("--seed", "0"), ("--threads", "1")):
        part = text[text.index(f" {option} ", text.index("options:")):]
        assert f"(default: {default})" in part[: part.index("(default:") + 20], option


def test_cli_prints_progress_lines_when_not_a_terminal(cli_runs):
    """Piped (CI), the demo writes its header at once and plain progress lines in tokens/s,
    the table's unit; the last one gives the number the table prints."""
    r = cli_runs["progress"]
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[0].startswith("replayssm demo: 16 heads, 2 groups, batch 1, 32 tokens")
    steps = [int(m.group(1)) for m in re.finditer(r"^fp8: (\d+)/32 steps, [0-9.]+ tokens/s$", r.stdout, re.M)]
    assert steps == list(range(3, 31, 3)) + [32], steps
    m = re.search(r"^fp8: 32 steps x batch 1 decoded in [0-9.]+ s: ([0-9.]+) tokens/s$", r.stdout, re.M)
    assert m, r.stdout
    (row,) = [line for line in lines if line.split()[:1] == ["fp8"]]
    assert abs(int(row.split()[2]) - float(m.group(1))) <= 0.55  # printed as %.0f and %.1f
    assert lines.index(row) > [i for i, line in enumerate(lines) if line.startswith("fp8: ")][-1]


def test_cli_entry_point(cli_runs):
    r = cli_runs["no-progress"]
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    (row,) = [line for line in r.stdout.splitlines() if line.split()[:1] == ["fp8"]]
    assert float(row.split()[3]) >= 30.0  # SQNR dB over 16 steps
    assert "SQNR" in r.stdout
