"""Random bytes through the operator's path (issue 27, item 6): `agentzip-blk up` with the
defaults returns, a sandbox whose heap is random bytes is squeezed into swap and reads every
byte back, `stats --json` shows the frames that did not compress stored raw without a try
per page, and `down` detaches. Each command its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentzip_blk import procfs
from agentzip_blk.datapath import native
from agentzip_blk.host import facts
from cliswap import HEAP_WORKLOAD, leave_nothing, squeezed_workload, stop_workload

MiB = 1 << 20
AZ = Path(sys.executable).with_name("agentzip-blk")
TREE = str(Path(__file__).resolve().parents[2])

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "fusermount3"])),
                       reason="nbdkit/util-linux/fuse3 missing (./setup.sh installs them)"),
    pytest.mark.skipif(not AZ.exists(), reason="agentzip-blk is not installed in this venv"),
    pytest.mark.skipif(not native.available(), reason=native.MISSING or "not built"),
]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(AZ), *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": TREE}, stdin=subprocess.DEVNULL,
                          cwd="/")


def test_random_pages_swap_out_raw_and_come_back_exact(tmp_path):
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    run_dir = tempfile.mkdtemp(prefix="azrc-", dir="/tmp")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n"
                   f"device:\n  size: 512M\n  run_dir: {run_dir}\n  frontend: fuse\n")
    cg = proc = None
    try:
        r = cli("--config", str(cfg), "up")
        assert r.returncode == 0, r.stderr
        cg, proc = squeezed_workload(f"azt-random-{os.getpid()}", HEAP_WORKLOAD,
                                     ["64", "random"], limit=24 * MiB, swapped=32 * MiB)
        proc.stdin.write("VERIFY\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "OK"  # every byte back through swap
        assert cg.oom_kills() == 0
        # while the workload lives: once it exits the kernel frees its slots, and the store
        # forgets their pages (the swap map)
        stats = json.loads(cli("--config", str(cfg), "stats", "--json").stdout)
        stop_workload(proc, cg)
        proc = cg = None
        assert stats["server"]["datapath"]["path"] == "native"
        assert stats["units_incompressible"] > 0, stats
        assert stats["unit_fallbacks"] >= stats["units_incompressible"]
        assert stats["raw_pages"] > 0 and stats["errors"] == 0
        r = cli("--config", str(cfg), "down")
        assert r.returncode == 0, r.stderr
        assert "detached" in r.stdout
    finally:
        stop_workload(proc, cg)
        left = leave_nothing(run_dir)
    assert left == []
    assert [a for a in procfs.swaps() if "loop" in a.filename] == []
