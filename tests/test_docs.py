"""The README's table of environment variables names exactly those the package reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_every_environment_variable():
    in_code = set()
    for path in (ROOT / "replayssm").rglob("*.py"):
        in_code |= set(re.findall(r"\"(REPLAYSSM_[A-Z0-9_]+)\"", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Environment variables"):]
    section = section[: section.index("\n## ", 1)]
    in_readme = set(re.findall(r"^\| `(REPLAYSSM_[A-Z0-9_]+)` \|", section, re.M))
    assert in_code == in_readme, (sorted(in_code - in_readme), sorted(in_readme - in_code))
    assert len(in_code) >= 8
