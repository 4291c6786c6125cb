"""If the server cannot lock its memory it does not run silently (issue 27, item 3): with the
disk tier on, `up` fails in one line that names the limit; without it, the server runs and
`status` and `doctor` say so. The installed CLI in its own processes, started the way a unit
with a small LimitMEMLOCK= would start it: without CAP_IPC_LOCK (setpriv) and with a 64 KiB
RLIMIT_MEMLOCK (prlimit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentzip_blk.host import facts
from host.test_device import assert_clean, leftovers

AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
TREE = str(Path(__file__).resolve().parents[2])
UNLOCKABLE = ["setpriv", "--inh-caps", "-ipc_lock", "--bounding-set", "-ipc_lock",
              "prlimit", "--memlock=65536:65536"]

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "fusermount3", "setpriv", "prlimit"])),
                       reason="nbdkit/util-linux/fuse3 missing (./setup.sh installs them)"),
    pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed"),
]


@pytest.fixture
def operator(tmp_path):
    run_dir = str(tmp_path / "run")

    def make(tier: str | None):
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"device": {"size": "64M", "run_dir": run_dir},
                                          "pool": {"swap_out_path": tier}}))

        def az(*args, prefix=()):
            return subprocess.run([*prefix, AZ, "--config", str(config), *args],
                                  capture_output=True, text=True, timeout=180,
                                  env={**os.environ, "PYTHONPATH": TREE},
                                  stdin=subprocess.DEVNULL, cwd="/")
        return az

    made = []

    def factory(tier):
        made.append(make(tier))
        return made[-1]

    yield factory, run_dir
    for az in made:
        if os.path.exists(os.path.join(run_dir, "state.json")):
            az("down", "--force")
    assert not any(leftovers(run_dir).values()), leftovers(run_dir)
    assert_clean(run_dir)


def test_with_the_disk_tier_an_unlockable_server_is_refused(operator, tmp_path):
    factory, run_dir = operator
    az = factory(str(tmp_path / "tier"))
    up = az("up", prefix=UNLOCKABLE)
    assert up.returncode == 2, up.stdout + up.stderr
    lines = up.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentzip-blk: error: "), up.stderr
    assert "mlockall failed" in lines[0] and "RLIMIT_MEMLOCK" in lines[0] \
        and "LimitMEMLOCK=" in lines[0], lines[0]
    assert not (tmp_path / "tier").exists()
    with open("/proc/swaps") as f:
        assert run_dir not in f.read()


def test_without_the_disk_tier_it_runs_and_says_so(operator):
    factory, run_dir = operator
    az = factory(None)
    up = az("up", prefix=UNLOCKABLE)
    assert up.returncode == 0, up.stdout + up.stderr
    status = az("status", "--json")
    st = json.loads(status.stdout)
    assert st["healthy"] is True, st
    assert st["health"]["nbdkit"]["memory_locked"] is False
    warned = [w for w in st["warnings"] if "not locked" in w]
    assert warned and "RLIMIT_MEMLOCK" in warned[0], st["warnings"]
    doctor = json.loads(az("doctor", "--json").stdout)
    check = next(c for c in doctor["checks"] if c["name"] == "server memory")
    assert check["status"] in ("warn", "fail") and "LimitMEMLOCK" in check["fix"], check
    assert "memory NOT locked" in Path(run_dir, "nbdkit.log").read_text()
    down = az("down")
    assert down.returncode == 0, down.stdout + down.stderr
