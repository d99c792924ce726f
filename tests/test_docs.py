"""The documents say what the code does: the public environment variables, and no file
narrates numbered rounds of work (history lives in git and CHANGELOG.md)."""

from __future__ import annotations

import re
import subprocess
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
