"""The main job (`python -m replayssm demo`): its numbers, its options and its output."""

import io
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from replayssm.__main__ import _Progress, main, run_demo, standard_bytes_per_token, state_bytes_per_token
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
    ("head-dim-96", ["--head-dim", "96"], "argument --head-dim: invalid choice: 96 (choose from 64, 80)"),
    ("state-dim-64", ["--state-dim", "64"], "argument --state-dim: invalid choice: 64 (choose from 128, 256)"),
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
                            ("--heads", "16"), ("--groups", "2"), ("--head-dim", "64"), ("--state-dim", "128"),
                            ("--prompt", "64"), ("--seed", "0"), ("--threads", "1")):
        part = text[text.index(f" {option} ", text.index("options:")):]
        assert f"(default: {default})" in part[: part.index("(default:") + 20], option


def test_cli_prints_progress_lines_when_not_a_terminal(cli_runs):
    """Piped (CI), the demo writes its header at once and plain progress lines in tokens/s,
    the table's unit; the last one gives the number the table prints."""
    r = cli_runs["progress"]
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[0] == "replayssm demo: 16 heads, 2 groups, head dim 64, state dim 128, batch 1, 32 tokens, device cpu"
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


# -- The layer geometry from a Hugging Face Mamba-2 config.json (--config) ----------------

# A Nemotron-Nano-2-like Mamba2Config in transformers' key names: Nano 2's head dim 80 and
# state dim 128 at 16 heads in 2 groups (Nano 2 9B: 128 in 8), hidden_size * expand =
# num_heads * head_dim.
NANO2 = {"model_type": "mamba2", "hidden_size": 640, "expand": 2, "num_heads": 16, "n_groups": 2, "head_dim": 80,
         "state_size": 128, "num_hidden_layers": 2, "vocab_size": 512}
SMALL = ["--device", "cpu", "--batch", "2", "--steps", "20", "--prompt", "8", "--no-progress"]


def _write_config(directory, **changes):
    """NANO2 with `changes` (None drops the key) as directory/config.json."""
    cfg = {k: v for k, v in {**NANO2, **changes}.items() if v is not None}
    path = directory / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _cli(capsys, *args):
    """`python -m replayssm demo *args` in this process (no second torch import): exit code,
    stdout, stderr."""
    try:
        code = main(["demo", *args])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["fp8"], ["nvfp4"])}


@pytest.mark.parametrize("state_size", [pytest.param(128, id="nano2-h16-g2-p80-n128"), pytest.param(256, id="h16-g2-p80-n256")])
def test_demo_takes_the_geometry_from_a_mamba2_config(tmp_path, capsys, state_size):
    """--config (here the directory holding config.json) sets heads, groups, head dim and
    state dim; both formats decode that geometry on the reference above the floors of the
    default geometry (20 steps, one flush), and the byte column is the byte model's at it.
    Measured (seed 0): fp8 42.7 / 41.1 dB, nvfp4 31.7 / 29.9 dB at state dim 128 / 256."""
    _write_config(tmp_path, state_size=state_size)
    code, out, err = _cli(capsys, "--config", str(tmp_path), *SMALL)
    assert code == 0 and err == "", err
    header = f"replayssm demo: 16 heads, 2 groups, head dim 80, state dim {state_size}, batch 2, 20 tokens, device cpu"
    assert out.splitlines()[0] == header
    rows = _rows(out)
    floors = tol.OUTPUT_SQNR_FLOOR_DB
    for fmt in ("fp8", "nvfp4"):
        row = rows[fmt]
        assert row[1] == "reference", row
        assert float(row[3]) >= floors[fmt], row
        assert all(float(h) >= floors[fmt] - 3 for h in row[4].split("/")), row
        assert int(row[5]) == round(state_bytes_per_token(fmt, 16, 80, state_size)), row


@pytest.mark.parametrize("model", ["nemotron_h", "falcon_h1", "bamba", "granitemoehybrid"])
def test_hybrid_configs_give_their_mamba_geometry(tmp_path, model):
    """A hybrid's config.json names the Mamba layers' geometry with its own keys (its
    attention's head_dim, where it has one, is not the Mamba head dim)."""
    from replayssm.__main__ import CONFIG_KEYS, read_mamba2_config

    cfg = {"model_type": model, "head_dim": 128, **dict(zip(CONFIG_KEYS[model], (128, 8, 80, 128)))}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert tuple(read_mamba2_config(str(tmp_path))) == (128, 8, 80, 128)


def test_config_and_options_give_the_same_run(tmp_path, capsys):
    """--config and the same geometry as --heads / --groups / --head-dim / --state-dim
    decode the same data: the same SQNR to the printed digit and the same bytes."""
    _write_config(tmp_path, num_heads=4, state_size=256)
    runs = [
        _cli(capsys, *SMALL, "--format", "fp8", "--config", str(tmp_path / "config.json")),
        _cli(capsys, *SMALL, "--format", "fp8", "--heads", "4", "--groups", "2", "--head-dim", "80", "--state-dim", "256"),
    ]
    assert [code for code, _, _ in runs] == [0, 0]
    (a, b) = [_rows(out)["fp8"] for _, out, _ in runs]
    assert a[:2] + a[3:] == b[:2] + b[3:]  # all but tokens/s
    assert runs[0][1].splitlines()[0] == runs[1][1].splitlines()[0]


def test_byte_model_at_other_geometries():
    """Hand-computed at P x N = 80 x 128 and 80 x 256, per head: fp8 moves P*N codes and 4P
    scale bytes a step, and at the flush 4PN checkpoint bytes more; NVFP4 PN/2 codes and
    PN/16 block scales; fp16 reads the 2PN checkpoint every step and writes it at the flush."""
    assert state_bytes_per_token("fp8", 1, 80, 128) == (15 * 10_560 + 40_960 + 10_560) / 16 == 13_120
    assert state_bytes_per_token("nvfp4", 1, 80, 256) == (15 * 11_520 + 81_920 + 11_520) / 16 == 16_640
    assert state_bytes_per_token("fp16", 1, 80, 256) == (15 * 40_960 + 81_920) / 16 == 43_520
    assert standard_bytes_per_token(2, 16, 80, 256) == 16 * 80 * 256 * 2 * 2


# (id, config.json changes or raw text, extra options, the error line's text): refused
# before anything is printed, as BAD.
BAD_CONFIGS = [
    ("missing-head-dim", {"head_dim": None}, [], "missing key 'head_dim' (a mamba2 config has num_heads, n_groups, head_dim, state_size)"),
    ("missing-state-size", {"state_size": None}, [], "missing key 'state_size'"),
    ("head-dim-96", {"head_dim": 96}, [], "head_dim must be one of (64, 80); got 96"),
    ("head-dim-float", {"head_dim": 80.0}, [], "head_dim must be a positive integer; got 80.0"),
    ("state-size-64", {"state_size": 64}, [], "state_size must be one of (128, 256); got 64"),
    ("heads-13", {"num_heads": 13}, [],
     "num_heads 13, n_groups 2: heads must be a multiple of groups with 1 to 128 heads a group; got 13 heads in 2 groups"),
    ("nemotron-h-keys", {"model_type": "nemotron_h"}, [], "missing key 'mamba_num_heads' (a nemotron_h config has"),
    ("jamba", {"model_type": "jamba"}, [], "model_type must be one of ('mamba2', 'nemotron_h', 'falcon_h1', 'bamba', "),
    ("not-json", "{num_heads: 16", [], "is not JSON: "),
    ("not-an-object", "[16, 2, 80, 128]", [], "expected a JSON object; got list"),
    ("with-heads", {}, ["--heads", "16"],
     "argument --heads: not allowed with argument --config (the config sets heads, groups, head dim and state dim)"),
    ("with-state-dim", {}, ["--state-dim", "256"], "argument --state-dim: not allowed with argument --config"),
]


@pytest.mark.parametrize("changes, extra, message", [pytest.param(c, e, m, id=i) for i, c, e, m in BAD_CONFIGS])
def test_cli_refuses_bad_configs_up_front(tmp_path, capsys, changes, extra, message):
    if isinstance(changes, str):
        (tmp_path / "config.json").write_text(changes)
    else:
        _write_config(tmp_path, **changes)
    code, out, err = _cli(capsys, *TINY, "--config", str(tmp_path / "config.json"), *extra)
    assert code == 2 and out == "", (out, err)
    assert err.startswith(USAGE) and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m replayssm demo: error: ") and message in last, last
    if not extra:  # an error about the file names the file
        assert last.startswith(f"python -m replayssm demo: error: argument --config: {str(tmp_path / 'config.json')!r}"), last


def test_cli_names_a_missing_config(tmp_path, capsys):
    code, out, err = _cli(capsys, *TINY, "--config", str(tmp_path))  # a directory without config.json
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        f"python -m replayssm demo: error: argument --config: no such file: {str(tmp_path / 'config.json')!r}"
    )
