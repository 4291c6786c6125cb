"""An existing file at the disk tier's path is refused unless it carries the header our tier
writes (issue 27, item 3): before, any regular file of root's with mode 0600 and one link was
truncated. The installed CLI, its own process, as an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentzip_blk.host import facts
from agentzip_blk.store.disk import TIER_HEADER
from host.test_device import assert_clean

AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
TREE = str(Path(__file__).resolve().parents[2])

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "fusermount3"])), reason="tools missing"),
    pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed"),
]


def test_up_refuses_a_file_without_the_tier_header_and_keeps_a_leftover_tier(tmp_path):
    run_dir = str(tmp_path / "run")
    tier = tmp_path / "tier"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"device": {"size": "64M", "run_dir": run_dir},
                                      "pool": {"swap_out_path": str(tier)}}))

    def az(*args):
        return subprocess.run([AZ, "--config", str(config), *args], capture_output=True,
                              text=True, timeout=180, env={**os.environ, "PYTHONPATH": TREE},
                              stdin=subprocess.DEVNULL, cwd="/")

    precious = b"an operator's database, mode 0600 like a tier\n" * 100
    tier.write_bytes(precious)
    os.chmod(tier, 0o600)
    try:
        up = az("up")
        assert up.returncode == 2, up.stdout + up.stderr
        lines = up.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agentzip-blk: error: "), up.stderr
        assert str(tier) in lines[0] and "not an agentzip disk tier" in lines[0], lines[0]
        assert tier.read_bytes() == precious
        # a tier file a dead server left (our header) is emptied and used
        tier.write_bytes(TIER_HEADER + b"old sealed extents" * 100)
        up = az("up")
        assert up.returncode == 0, up.stdout + up.stderr
        assert tier.read_bytes()[:len(TIER_HEADER)] == TIER_HEADER
        assert b"old sealed extents" not in tier.read_bytes()
    finally:
        down = az("down", "--force")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not tier.exists()
    assert_clean(run_dir)
