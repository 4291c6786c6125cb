"""The offline benches in a small mode, end to end through `python -m bench`: in-process, no
root, no swap, nothing written to BENCHMARKS.md or results/. A smoke test (the figures are
not asserted: speed goals live in BENCHMARKS.md). The root benches' quick mode is
tests/test_bench_density.py; every bench's --help is tests/test_bench_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# bench, its small mode, and a line its output must hold
QUICK = {
    "hash": (["--pages", "500"], "xxh3-128 seeded (PageHasher)"),
    "warm_rows": (["--pages", "512"], '"warm_algorithm": "lz4"'),
    "store_contention": (["--reads", "100"], "read_busy_p99_us"),
}


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode(name):
    args, expect = QUICK[name]
    before = (ROOT / "BENCHMARKS.md").stat().st_mtime_ns
    r = subprocess.run([sys.executable, "-m", "bench", name, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout
    assert (ROOT / "BENCHMARKS.md").stat().st_mtime_ns == before


def test_integrity_quick_mode():
    """--json: every figure of both experiments, as JSON on stdout."""
    r = subprocess.run([sys.executable, "-m", "bench", "integrity", "--mib", "4", "--rounds", "1",
                        "--reads", "50", "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert {"checksums", "encryption"} <= set(json.loads(r.stdout))
