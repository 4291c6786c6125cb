"""`device.request_nice`: the threads that answer the kernel's requests run at that nice
value, the rest of the server (its main thread, the maintainer) at its own; where the
server may not raise a priority (no CAP_SYS_NICE), it runs anyway and says so. The installed
CLI in its own processes, as an operator runs it."""

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
NO_SYS_NICE = ["setpriv", "--inh-caps", "-sys_nice", "--bounding-set", "-sys_nice"]

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "fusermount3", "setpriv"])),
                       reason="nbdkit/util-linux/fuse3 missing (./setup.sh installs them)"),
    pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed"),
]


@pytest.fixture
def az(tmp_path):
    run_dir = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"device": {"size": "64M", "run_dir": run_dir,
                                                 "request_nice": -7},
                                      "pool": {"swap_out_path": None}}))

    def run(*args, prefix=()):
        return subprocess.run([*prefix, AZ, "--config", str(config), *args],
                              capture_output=True, text=True, timeout=180,
                              env={**os.environ, "PYTHONPATH": TREE},
                              stdin=subprocess.DEVNULL, cwd="/")
    run.run_dir = run_dir
    yield run
    if os.path.exists(os.path.join(run_dir, "state.json")):
        run("down", "--force")
    assert not any(leftovers(run_dir).values()), leftovers(run_dir)
    assert_clean(run_dir)


def nice_of_threads(pid: int) -> dict[int, int]:
    """tid -> nice value (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def server_of(az) -> dict:
    stats = az("stats", "--json")
    assert stats.returncode == 0, stats.stdout + stats.stderr
    return json.loads(stats.stdout)["server"]


def test_the_request_threads_run_at_request_nice_and_the_rest_at_the_servers(az):
    up = az("up")
    assert up.returncode == 0, up.stdout + up.stderr
    server = server_of(az)
    assert server["request_nice_set"] is True
    nice = nice_of_threads(server["pid"])
    assert nice[server["pid"]] == 0  # the main thread: nbdkit's, not a request thread
    assert sum(1 for v in nice.values() if v == -7) >= 4, nice  # the FUSE workers
    assert any(v == 0 for tid, v in nice.items() if tid != server["pid"]), nice  # maintainer...
    down = az("down")
    assert down.returncode == 0, down.stdout + down.stderr


def test_without_cap_sys_nice_the_server_runs_and_says_why(az):
    up = az("up", prefix=NO_SYS_NICE)
    assert up.returncode == 0, up.stdout + up.stderr
    server = server_of(az)
    assert server["request_nice_set"] is False
    assert all(v >= 0 for v in nice_of_threads(server["pid"]).values())
    log = Path(az.run_dir, "nbdkit.log").read_text()
    assert "device.request_nice -7 not set" in log, log[-2000:]
    down = az("down")
    assert down.returncode == 0, down.stdout + down.stderr
