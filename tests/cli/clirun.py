"""Run this tree's CLI in a separate process, as an operator does (`python -m agentzip_blk.cli`
with this checkout first on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, **kwargs.pop("env", {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "agentzip_blk.cli", *map(str, argv)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kwargs)


def one_error_line(stderr: str) -> str:
    """The single `agentzip-blk: error: ...` line a bad input gives (and nothing else)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("agentzip-blk: error: "), stderr
    return lines[0].removeprefix("agentzip-blk: error: ")
