"""The main job (`python -m replayssm demo`) runs and its numbers are sane."""

import io
import subprocess
import sys

from replayssm.__main__ import run_demo, state_bytes_per_token


def test_demo_reports_accuracy_and_bytes():
    buf = io.StringIO()
    res = run_demo(device="cpu", batch=2, steps=48, progress=False, out=buf)
    text = buf.getvalue()
    assert "SQNR" in text and "fp8" in text and "nvfp4" in text
    floors = {"fp8": 33.0, "nvfp4": 22.0}
    for r in res:
        assert r["sqnr_db"] >= floors[r["format"]]
        assert r["tokens_per_s"] > 0
    # design brief section 6: ~11,000 (fp8) and ~7,500 (nvfp4) bytes per head per token
    assert 10_000 < state_bytes_per_token("fp8", 1) < 11_500
    assert 6_000 < state_bytes_per_token("nvfp4", 1) < 7_500


def test_cli_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "replayssm", "demo", "--device", "cpu", "--batch", "1", "--steps", "16",
         "--format", "fp8", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "fp8" in r.stdout and "SQNR" in r.stdout


def test_cli_rejects_unsupported_geometry_cleanly():
    r = subprocess.run(
        [sys.executable, "-m", "replayssm", "demo", "--device", "cpu", "--heads", "12", "--groups", "2", "--steps", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 2
    assert "heads per group must be one of (8, 16)" in r.stderr and "Traceback" not in r.stderr
