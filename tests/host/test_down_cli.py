"""`down --force` detaches every loop device whose backing file is in our mount, whatever the
state file says (issue 29, item 1): seen on main after `apt remove` under a live server, a
`down --force` without state.json stopped the server but left /dev/loopN attached to the
dead FUSE file, and the next `up` met a used loop device. Each step its own process of the
installed CLI, with a real swap area."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentzip_blk import procfs
from agentzip_blk.host import chain, facts, procs
from demo.test_swap import leftovers

AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")

pytestmark = [
    pytest.mark.swap,  # conftest: holds /tmp/agentzip-swap.lock
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "fusermount3"])),
                       reason="nbdkit/util-linux/fuse3 missing (./setup.sh installs them)"),
]


def attached_loops() -> set[str]:
    """Every attached loop device, by what sysfs says (a lazily unmounted FUSE file shows as
    "/device", which a search by run-dir path would miss)."""
    return {f"/dev/{n}" for n in os.listdir("/sys/block")
            if n.startswith("loop") and procfs.loop_backing(f"/dev/{n}") is not None}


@pytest.fixture
def op(tmp_path):
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    before = attached_loops()
    run_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"device": {"size": "256M", "run_dir": str(run_dir),
                                                 "frontend": "fuse"},
                                      "pool": {"swap_out_path": str(tmp_path / "tier")}}))

    def az(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([AZ, "--config", str(config), *args], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    yield az, str(run_dir)
    # the safe order, whatever the test left: down --force (it sweeps too), then by hand
    if (run_dir / "state.json").exists() or chain.stray_loops(str(run_dir)):
        az("down", "--force", timeout=300)
    chain.sweep(str(run_dir), 30.0)
    left = leftovers(str(run_dir))
    assert not left, f"left behind: {left}"
    assert attached_loops() <= before, f"loop devices left: {attached_loops() - before}"


def test_down_force_without_a_state_file_detaches_the_loop_and_stops_the_server(op):
    az, run_dir = op
    r = az("up")
    assert r.returncode == 0, r.stdout + r.stderr
    state = yaml.safe_load(Path(run_dir, "state.json").read_text())
    loop, pid = state["loop_device"], state["nbdkit_pid"]
    assert procfs.swap_area(loop) is not None
    assert chain.stray_loops(run_dir) == [loop]

    os.unlink(os.path.join(run_dir, "state.json"))  # what `apt remove` + a new checkout met
    r = az("status")
    assert r.returncode == 3, r.stdout + r.stderr  # nothing attached, as far as state says

    r = az("down", "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"detached {loop}" in r.stdout and "server on its control socket stopped" in r.stdout
    assert procfs.swap_area(loop) is None
    assert procfs.loop_backing(loop) is None or run_dir not in procfs.loop_backing(loop)
    assert not chain.is_mounted(os.path.join(run_dir, "mnt"))
    assert procs.wait_gone(pid, 30.0), "the server did not stop"
    assert not leftovers(run_dir)

    # and the next up finds everything free
    r = az("up")
    assert r.returncode == 0, r.stdout + r.stderr
    r = az("down")
    assert r.returncode == 0, r.stdout + r.stderr


def test_down_force_with_a_state_file_also_sweeps_a_loop_it_does_not_name(op):
    """A second loop device over our FUSE file (an older up's, the state lost in between):
    the state names one, --force detaches both."""
    az, run_dir = op
    r = az("up")
    assert r.returncode == 0, r.stdout + r.stderr
    state = yaml.safe_load(Path(run_dir, "state.json").read_text())
    extra = subprocess.run(["losetup", "--show", "-f", "-r", state["fuse_file"]],
                           capture_output=True, text=True, timeout=30)
    assert extra.returncode == 0, extra.stderr
    extra_loop = extra.stdout.strip()
    assert sorted(chain.stray_loops(run_dir)) == sorted([state["loop_device"], extra_loop])
    r = az("down")  # without --force: refused, nothing unmounted under the extra loop
    assert r.returncode == 1 and f"{extra_loop} still attached over" in r.stderr, r.stderr
    assert procfs.loop_backing(extra_loop) == state["fuse_file"]
    r = az("down", "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    assert chain.stray_loops(run_dir) == []
    assert procfs.loop_backing(extra_loop) is None  # detached, not orphaned as "/device"
    assert not leftovers(run_dir)


def test_down_under_a_log_reports_pages_left_and_rate(op):
    """Without a terminal (ExecStop's stderr is the journal), `down` logs its swapoff: a line
    at the start, one at least every --log-every seconds (10 by default), one at the end."""
    from agentzip_blk.cgroups.fs import LimitBusy, MemoryCgroup
    from agentzip_blk.demo.workload import Workload

    az, run_dir = op
    assert az("up").returncode == 0
    cg = MemoryCgroup.create(f"azt-downlog-{os.getpid()}")
    wl = Workload(cg, 64, seed=3)
    try:
        cg.allow_swap()
        wl.expect("READY", timeout=300)
        for _ in range(50):
            try:
                cg.set_limit(int(cg.usage() * 0.3))
                break
            except LimitBusy:
                time.sleep(0.2)
        assert procfs.swaps()[0].used > 8 << 20
        cg.set_limit(None)  # swapoff charges the pages back: leave room
        r = az("down", "--log-every", "0.05")
        assert r.returncode == 0, r.stdout + r.stderr
        lines = [line for line in r.stderr.splitlines() if "agentzip-blk: swapoff /dev/loop" in line]
        assert lines and "pages left" in lines[0] and "to bring back into RAM" in lines[0], r.stderr
        assert "done:" in lines[-1] and "pages back in" in lines[-1], r.stderr
        for line in lines[1:-1]:
            assert re.search(r"\d+ pages left \(.*\), \d+ pages/s \(.*/s\)", line), line
        wl.send("TOUCH")
        assert wl.expect("VERIFY", timeout=600)[1] == "ok"
    finally:
        wl.stop()
        cg.remove(timeout=60)
