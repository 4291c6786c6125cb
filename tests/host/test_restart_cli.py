"""`agentzip-blk restart` as the operator runs it: each command its own process.

`up` (FUSE front door); a workload whose heap is mostly in the device; then `restart` ten
times while the workload re-reads and checks every byte of it (its pages fault through the
server being replaced), one restart with a config change that takes effect; a restart that
would change the device size is refused by name; a new server that fails its check leaves
the old one serving; the swap area and the loop device never change; `down` works after.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agentzip_blk import procfs
from agentzip_blk.host import facts
from cliswap import HEAP_WORKLOAD, leave_nothing, squeezed_workload, stop_workload
from nbdkit_server import nbdkit_available

MiB = 1 << 20
CLI = Path(sys.executable).with_name("agentzip-blk")

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                       reason="needs root and /dev/fuse"),
    pytest.mark.skipif(nbdkit_available() is not None, reason=nbdkit_available() or ""),
    pytest.mark.skipif(not CLI.exists(), reason="agentzip-blk is not installed in this venv"),
    pytest.mark.skipif(facts.nbd_kernel_available(), reason="kernel nbd host"),
]


# a plugin whose store never passes its check: the new server of a failed restart
FAILING_PLUGIN = r"""
from agentzip_blk.errors import StoreError
from agentzip_blk.store import PageStore


def _refuse(self, *args, **kwargs):
    raise StoreError("injected: the store's check failed")


PageStore.check = _refuse
from agentzip_blk.datapath.nbdkit_plugin import *  # noqa: E402,F401,F403
"""


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, env=env)


def write_config(path: Path, run_dir: str, tier: Path, level: int) -> None:
    path.write_text(f"pool:\n  swap_out_path: {tier}\n"
                    f"compression:\n  level: {level}\n"
                    f"device:\n  size: 512M\n  run_dir: {run_dir}\n  frontend: fuse\n")


class Toucher:
    """The workload, verified over and over from a thread while the server is replaced."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.results: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def verify(self) -> str:
        self.proc.stdin.write("VERIFY\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(self.verify())

    def __enter__(self) -> Toucher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)


def status(cfg: Path) -> dict:
    return json.loads(cli("--config", str(cfg), "status", "--json").stdout)


def test_restart_ten_times_under_a_faulting_workload(tmp_path):
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    run_dir = tempfile.mkdtemp(prefix="azrs-", dir="/tmp")
    cfg = tmp_path / "config.yaml"
    write_config(cfg, run_dir, tmp_path / "disk-tier", level=3)
    cg = proc = None
    try:
        r = cli("--config", str(cfg), "up")
        assert r.returncode == 0, r.stderr
        first = status(cfg)
        device, pid = first["state"]["device"], first["state"]["nbdkit_pid"]

        cg, proc = squeezed_workload(f"azt-restart-{os.getpid()}", HEAP_WORKLOAD, ["96"],
                                     limit=32 * MiB, swapped=48 * MiB)
        area = procfs.swap_area(device)
        assert area is not None

        pids = [pid]
        t_start = time.monotonic()
        with Toucher(proc) as toucher:
            for i in range(10):
                if i == 5:  # a key a running store can change: it takes effect
                    write_config(cfg, run_dir, tmp_path / "disk-tier", level=7)
                r = cli("--config", str(cfg), "restart")
                assert r.returncode == 0, r.stderr
                assert "restarted" in r.stdout and f"restart {i + 1} " in r.stdout, r.stdout
                print(f"{time.monotonic() - t_start:.1f}s", r.stdout.strip())
                st = status(cfg)
                assert st["healthy"] is True, st
                pids.append(st["state"]["nbdkit_pid"])
                assert pids[-1] != pids[-2] and procfs.process_state(pids[-2]) in (None, "Z")  # exited
                assert st["state"]["device"] == device  # the same loop device, still swap
                assert procfs.swap_area(device) is not None
                time.sleep(0.3)  # let the workload fault through this server
        print(f"{time.monotonic() - t_start:.1f}s touched {len(toucher.results)} times")
        assert toucher.results and set(toucher.results) == {"OK"}, toucher.results
        assert toucher.verify() == "OK"

        stats = json.loads(cli("--config", str(cfg), "stats", "--json").stdout)
        assert stats["server"]["restarts"] == 10
        table = cli("--config", str(cfg), "status", "-o", "NAME,RESTARTS", "--raw", "-n").stdout
        assert table.split()[-1] == "10", table
        assert status(cfg)["server"]["restarts"] == 10
        assert stats["server"]["pid"] == pids[-1]
        shown = cli("--config", str(cfg), "config", "show").stdout
        running = Path(run_dir, "config.yaml").read_text()
        assert "level: 7" in running, running
        assert shown  # the CLI still reads the operator's config

        # a key the running store cannot change: refused by name, nothing changes
        cfg2 = tmp_path / "bigger.yaml"
        cfg2.write_text(cfg.read_text().replace("size: 512M", "size: 1G"))
        r = cli("--config", str(cfg2), "restart")
        assert r.returncode == 2 and "device.size" in r.stderr, (r.returncode, r.stderr)
        assert status(cfg)["state"]["nbdkit_pid"] == pids[-1]

        # a new server that fails its check: the old one serves on, exit 1 in one line
        bad = tmp_path / "failing_plugin.py"
        bad.write_text(FAILING_PLUGIN)
        env = {**os.environ, "AGENTZIP_PLUGIN": str(bad)}
        r = cli("--config", str(cfg), "restart", env=env)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "injected: the store's check failed" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        st = status(cfg)
        assert st["healthy"] is True and st["state"]["nbdkit_pid"] == pids[-1], st
        assert toucher.verify() == "OK"
        assert not [f for f in os.listdir(run_dir) if ".next" in f or f == "handover.sock"]
        assert "injected" in Path(run_dir, "nbdkit.restart-failed.log").read_text()

        stop_workload(proc, cg)
        proc = cg = None
        r = cli("--config", str(cfg), "down")
        assert r.returncode == 0, r.stderr
        assert "detached" in r.stdout
    finally:
        stop_workload(proc, cg)
        left = leave_nothing(run_dir)
    assert left == []
    assert [a for a in procfs.swaps() if "loop" in a.filename] == []


def test_restart_without_a_device_is_refused_in_one_line(tmp_path):
    run_dir = tempfile.mkdtemp(prefix="azrs-", dir="/tmp")
    try:
        cfg = tmp_path / "config.yaml"
        write_config(cfg, run_dir, tmp_path / "disk-tier", level=3)
        r = cli("--config", str(cfg), "restart")
        assert r.returncode == 2 and "nothing is up" in r.stderr, (r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
