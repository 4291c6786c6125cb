"""Lint in the default run: ruff (the rules in pyproject.toml's [tool.ruff]) over the tree,
and vulture for code nothing calls (its allow-list: tests/vulture_allow.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    return found


def test_ruff():
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_vulture_finds_no_dead_code_in_the_package():
    """Unused functions, methods, classes, attributes and variables of agentzip_blk. The
    tests and the benchmarks count as users (they use the package as a library); what they
    leave unused themselves is not reported."""
    users = [p for p in ("tools", "bench") if (ROOT / p).is_dir()]  # the benchmarks
    r = subprocess.run([_tool("vulture"), "--min-confidence", "60", "agentzip_blk", *users,
                        "tests", "tests/vulture_allow.py"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode in (0, 3), r.stderr  # 3: it found something
    dead = [line for line in r.stdout.splitlines() if line.startswith("agentzip_blk/")]
    assert not dead, ("unused code (remove it, or add it to tests/vulture_allow.py with who "
                      "uses it):\n" + "\n".join(dead))
