"""The documents say what the code does: the public environment variables, the README's
Python blocks run as written, and no file narrates numbered rounds of work (history lives
in git and CHANGELOG.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_ENV = {"REPLAYSSM_ARCH", "REPLAYSSM_DEBUG"}


def test_the_package_reads_only_the_public_environment_variables_and_the_readme_lists_them():
    in_code = set()
    for path in (ROOT / "replayssm").rglob("*.py"):
        in_code |= set(re.findall(r"\"(REPLAYSSM_[A-Z0-9_]+)\"", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Environment variables"):]
    section = section[: section.index("\n## ", 1)]
    in_readme = set(re.findall(r"^\| `(REPLAYSSM_[A-Z0-9_]+)` \|", section, re.M))
    assert in_code == in_readme == PUBLIC_ENV, (sorted(in_code), sorted(in_readme))


def test_every_readme_python_block_runs_standalone_on_the_cpu():
    """Each ```python block of README.md runs as written in a fresh interpreter with no GPU
    visible, on its own (no block leans on names another defines). The blocks run side by
    side; each is mostly a torch import."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)
    assert len(blocks) >= 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", block], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for block in blocks
    ]
    for i, proc in enumerate(procs, 1):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"README.md python block {i}:\n{err[-3000:]}"


def test_no_file_narrates_numbered_rounds_of_work():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\b(session|round|sprint|iteration) [0-9]+\b|\bsessions [0-9]+|\bs1[0-9]-", re.I)
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".ipynb", ".toml", ".txt", ".json") or name == "CHANGELOG.md":
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:40])
