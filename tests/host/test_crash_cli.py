"""A crash of the server loses nothing (issue 28, item 3), as the operator meets it: each
command its own process of the installed CLI, the FUSE front door, a real swap area.

`up`; a workload whose heap is mostly in the device re-reads and checks every byte of it
from a thread while the server is SIGKILLed, twice (the second time a server the holder had
started), then `restart`ed and SIGKILLed again (the holder starts the restarted server's
command line). Each time the holder (host/holder.py) starts a new server from the dead one's
memory; `status` names it, healthy, with the count of recoveries; `down` stops the server
and the holder and leaves nothing. The dead server's memory, squeezed out of its cgroup while
no server runs, stays out of swap (the holder's pins); a connection no server answers is
aborted by `down --force`'s last resort.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from agentzip_blk import procfs
from agentzip_blk.cgroups.fs import MemoryCgroup
from agentzip_blk.datapath.holding import HolderClient
from agentzip_blk.host import chain, facts
from agentzip_blk.host.procs import tail
from cliswap import HEAP_WORKLOAD, leave_nothing, squeezed_workload, stop_workload
from host.test_restart_cli import CLI, Toucher, cli, status, write_config
from nbdkit_server import nbdkit_available

MiB = 1 << 20

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                       reason="needs root and /dev/fuse"),
    pytest.mark.skipif(nbdkit_available() is not None, reason=nbdkit_available() or ""),
    pytest.mark.skipif(facts.nbd_kernel_available(), reason="kernel nbd host"),
]


def device_config(tmp_path: Path, prefix: str) -> tuple[str, Path]:
    """A run directory and the config of a 512 MiB device (FUSE front door, disk tier); the
    test is skipped while another swap area is active: it must own swap."""
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    run_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    cfg = tmp_path / "config.yaml"
    write_config(cfg, run_dir, tmp_path / "disk-tier", level=3)
    return run_dir, cfg


def no_holder_left(holder_pid: int | None) -> None:
    """Fails the test if the holder outlived `down` (and kills it: only then)."""
    if holder_pid and procfs.process_state(holder_pid) not in (None, "Z"):
        os.kill(holder_pid, signal.SIGKILL)
        pytest.fail(f"the holder (pid {holder_pid}) outlived down")


def recovered(cfg: Path, run_dir: str, dead: int, count: int, timeout: float = 120.0) -> dict:
    """`status` once a server other than ``dead`` serves, healthy, after ``count``
    recoveries."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(cfg)
        if (st["state"] and st["state"]["nbdkit_pid"] != dead and st["healthy"] is True
                and st["server"]["recoveries"] == count):
            return st
        assert time.monotonic() < deadline, (st, tail(os.path.join(run_dir, "holder.log")),
                                             tail(os.path.join(run_dir, "nbdkit.log")))
        time.sleep(0.2)


def test_a_killed_server_is_recovered_under_a_faulting_workload(tmp_path):
    run_dir, cfg = device_config(tmp_path, "azcr-")
    cg = proc = None
    holder_pid = None
    try:
        r = cli("--config", str(cfg), "up")
        assert r.returncode == 0, r.stderr
        st = status(cfg)
        device, pid = st["state"]["device"], st["state"]["nbdkit_pid"]
        holder_pid = st["state"]["holder_pid"]
        assert {k: st["server"]["holder"][k] for k in ("pid", "alive", "committed")} == \
            {"pid": holder_pid, "alive": True, "committed": True}

        cg, proc = squeezed_workload(f"azt-crash-{os.getpid()}", HEAP_WORKLOAD, ["96"],
                                     limit=32 * MiB, swapped=48 * MiB)
        with Toucher(proc) as toucher:
            for count in (1, 2, 3):
                if count == 3:  # the holder then starts the restarted server's command
                    r = cli("--config", str(cfg), "restart")
                    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
                    pid = status(cfg)["state"]["nbdkit_pid"]
                os.kill(pid, signal.SIGKILL)
                st = recovered(cfg, run_dir, pid, count)
                assert procfs.process_state(pid) in (None, "Z")
                pid = st["state"]["nbdkit_pid"]
                assert st["state"]["holder_pid"] == holder_pid and st["server"]["holder"]["alive"]
                assert st["state"]["device"] == device and procfs.swap_area(device) is not None
                time.sleep(0.3)  # let the workload fault through this server
        assert toucher.results and set(toucher.results) == {"OK"}, toucher.results
        assert toucher.verify() == "OK"
        log = Path(run_dir, "holder.log").read_text()
        assert log.count("done: pid") == 3, log
        stats = json.loads(cli("--config", str(cfg), "stats", "--json").stdout)
        assert stats["server"]["recoveries"] == 3 and stats["server"]["restarts"] == 1
        table = cli("--config", str(cfg), "status", "-o", "NAME,RECOVERIES", "--raw", "-n").stdout
        assert table.split()[-1] == "3", table

        stop_workload(proc, cg)
        proc = cg = None
        r = cli("--config", str(cfg), "down")
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(os.path.join(run_dir, "holder.sock"))
        assert "stopped on purpose" in Path(run_dir, "holder.log").read_text()
    finally:
        stop_workload(proc, cg)
        left = leave_nothing(run_dir)
        no_holder_left(holder_pid)
    assert left == []
    assert [a for a in procfs.swaps() if "loop" in a.filename] == []


def test_a_dead_servers_memory_stays_out_of_swap(tmp_path):
    """Once the server is killed nothing of it locks the store's pages any more: the holder
    does (host/pinning.py). The dead server's cgroup, where those pages are charged, is then
    emptied (memory.force_empty: the kernel reclaims all it can, to swap where it can): none
    of them goes to swap, our own device included, where its write would wait for a server
    and the recovering one would wait for it. The recovery then finds every byte."""
    run_dir, cfg = device_config(tmp_path, "azcp-")
    server_cg = MemoryCgroup.create(f"azt-server-{os.getpid()}")
    cg = proc = None
    holder_pid = None
    try:
        r = subprocess.run([str(CLI), "--config", str(cfg), "up"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=180,
                           preexec_fn=lambda: server_cg.add_pid(os.getpid()))
        assert r.returncode == 0, r.stderr
        st = status(cfg)
        pid, holder_pid = st["state"]["nbdkit_pid"], st["state"]["holder_pid"]
        assert sorted(server_cg.pids()) == sorted([holder_pid, pid])
        MemoryCgroup.own().add_pid(holder_pid)  # it and the servers it starts: not squeezed

        cg, proc = squeezed_workload(f"azt-pins-{os.getpid()}", HEAP_WORKLOAD, ["96"],
                                     limit=32 * MiB, swapped=48 * MiB)
        holder = HolderClient(os.path.join(run_dir, "holder.sock"))
        try:  # two refreshes after the workload stopped writing: every page it wrote pinned
            first = holder.status()["pin_refreshes"]
            deadline = time.monotonic() + 60
            while (pins := holder.status())["pin_refreshes"] < first + 2:
                assert time.monotonic() < deadline, pins
                time.sleep(0.2)
        finally:
            holder.close()
        assert pins["pin_errors"] == [] and pins["pinned_bytes"] > 0, pins
        shown = status(cfg)["server"]["holder"]  # what the operator sees
        assert shown["pin_errors"] == [] and shown["pinned_bytes"] > 0, shown

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procfs.process_state(pid) not in (None, "Z"):
            assert time.monotonic() < deadline, procfs.process_state(pid)
            time.sleep(0.05)
        before = server_cg.usage()
        server_cg.write("memory.force_empty", "0")
        assert server_cg.swap_usage() == 0, (before, server_cg.usage(), server_cg.stat())
        assert server_cg.usage() >= pins["pinned_bytes"] // 2, (before, server_cg.usage(), pins)

        st = recovered(cfg, run_dir, pid, 1)
        assert Toucher(proc).verify() == "OK"
        stop_workload(proc, cg)
        proc = cg = None
        r = cli("--config", str(cfg), "down")
        assert r.returncode == 0, r.stderr
    finally:
        stop_workload(proc, cg)
        left = leave_nothing(run_dir)
        server_cg.remove()
        no_holder_left(holder_pid)
    assert left == []


def test_down_force_aborts_a_connection_no_server_answers(tmp_path):
    """`down --force`'s last resort (chain.abort_fuse) on a real connection: a read waiting
    on a server that cannot answer (SIGSTOPped here: the same wait as behind a server in D
    state) fails at once when the connection is aborted through fusectl, which is left as
    it was found; `down --force` then leaves nothing."""
    run_dir, cfg = device_config(tmp_path, "azca-")
    pid = reader = None
    try:
        r = cli("--config", str(cfg), "up")
        assert r.returncode == 0, r.stderr
        state = status(cfg)["state"]
        pid, fuse_file, mountpoint = state["nbdkit_pid"], state["fuse_file"], state["mountpoint"]
        fusectl = chain.is_mounted(chain.FUSECTL)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # every worker thread stopped, not only signalled
        while set(procfs.thread_states(pid)) != {"T"}:
            assert time.monotonic() < deadline, procfs.thread_states(pid)
            time.sleep(0.02)
        reader = subprocess.Popen(["dd", f"if={fuse_file}", "of=/dev/null", "bs=4096",
                                   "count=1", "skip=1000", "iflag=direct"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert reader.poll() is None, reader.stderr.read()  # it waits for the server
        assert chain.abort_fuse(mountpoint)
        assert reader.wait(10) != 0
        assert chain.is_mounted(chain.FUSECTL) == fusectl
        os.kill(pid, signal.SIGCONT)
        r = cli("--config", str(cfg), "down", "--force")
        assert r.returncode == 0, r.stderr
        assert procfs.process_state(pid) in (None, "Z")
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
        if pid and procfs.process_state(pid) == "T":
            os.kill(pid, signal.SIGCONT)
        left = leave_nothing(run_dir)
    assert left == []
