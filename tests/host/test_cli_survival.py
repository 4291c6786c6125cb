"""The swap server survives everything but `down`, driven the way an operator drives it.

Every step is its own process of the installed CLI: `agentzip-blk up` starts the chain and
exits; a workload in a memory cgroup (another process) is squeezed into the device at once;
`agentzip-blk status`/`doctor`/`down` run as further processes. Before issue 13, nbdkit got
SIGTERM the moment `up` exited (nbdkit -f sets PR_SET_PDEATHSIG on itself) and the device
failed its first write after that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentzip_blk import procfs
from agentzip_blk.cgroups.fs import LimitBusy, MemoryCgroup
from agentzip_blk.demo.workload import Workload
from agentzip_blk.host import facts, procs
from demo.test_swap import leftovers

MiB = 1 << 20
AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
WORKLOAD_MB = 200

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, cgroups)"),
    pytest.mark.skipif(
        bool(facts.missing_tools(["nbdkit", "nbdfuse", "losetup", "mkswap", "swapon"])),
        reason="nbdkit/nbdfuse/util-linux missing (./setup.sh installs them)",
    ),
    pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed"),
]


class Operator:
    """One run dir and config; every CLI call a separate process, as a shell would make it."""

    def __init__(self, root: Path, pool: dict | None = None, policy: dict | None = None,
                 frontend: str = "auto", compression: dict | None = None):
        self.root = root
        self.run_dir = str(root / "run")
        self.config = str(root / "config.yaml")
        cfg = {"device": {"size": "2G", "run_dir": self.run_dir, "frontend": frontend},
               "pool": {"swap_out_path": str(root / "tier"), **(pool or {})}}
        if policy:
            cfg["policy"] = policy
        if compression:
            cfg["compression"] = compression
        with open(self.config, "w") as f:
            yaml.safe_dump(cfg, f)
        self.workloads: list[Workload] = []
        self.cgroups: list[MemoryCgroup] = []

    def run(self, *args: str, timeout: float = 180.0, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([AZ, "--config", self.config, *args], capture_output=True,
                              text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"agentzip-blk {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}\n{self.log_tail()}")
        return proc

    def status(self) -> tuple[int, dict]:
        proc = self.run("status", "--json", check=False, timeout=60)
        return proc.returncode, json.loads(proc.stdout)

    def log_tail(self) -> str:
        out = []
        for name in ("nbdkit.log", "nbdfuse.log"):
            path = os.path.join(self.run_dir, name)
            if os.path.exists(path):
                out.append(f"--- {name}\n" + Path(path).read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def pids(self) -> tuple[int, int | None]:
        _, st = self.status()
        return st["state"]["nbdkit_pid"], st["state"]["nbdfuse_pid"]

    def workload(self, name: str, mb: int = WORKLOAD_MB, seed: int = 7) -> Workload:
        cg = MemoryCgroup.create(f"azt-{name}-{os.getpid()}")
        self.cgroups.append(cg)
        cg.allow_swap()
        wl = Workload(cg, mb, seed)
        self.workloads.append(wl)
        wl.expect("READY", timeout=300)
        return wl

    def squeeze(self, wl: Workload, fraction: float = 0.25) -> int:
        """The limit set at once to ``fraction`` of the usage; returns bytes in swap."""
        target = int(wl.cg.usage() * fraction)
        for _ in range(20):  # v1 answers EBUSY while reclaim has not got there yet
            try:
                wl.cg.set_limit(target)
                break
            except LimitBusy:
                time.sleep(0.2)
        else:
            raise AssertionError(f"could not squeeze {wl.cg} to {target}")
        return wl.cg.swap_usage()

    def cleanup(self) -> None:
        """The safe order: workloads and their cgroups, then swapoff and the rest (down)."""
        for wl in self.workloads:
            wl.stop()
        for cg in self.cgroups:
            try:
                cg.remove(timeout=60)
            except Exception:
                pass
        if os.path.exists(os.path.join(self.run_dir, "state.json")):
            self.run("down", "--force", check=False, timeout=300)


@pytest.fixture
def operator(tmp_path_factory):
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    made: list[Operator] = []

    def make(**kw) -> Operator:
        op = Operator(tmp_path_factory.mktemp("azcli"), **kw)
        made.append(op)
        return op

    yield make
    for op in made:
        op.cleanup()
        left = leftovers(op.run_dir)
        assert not left, f"left behind: {left}"
        assert not os.path.exists(op.root / "tier"), "the disk tier file was left behind"
        shutil.rmtree(op.root, ignore_errors=True)


def lift(wl: Workload) -> None:
    """Reads come back with the limit lifted, as in the demo: re-touching a workload under a
    v1 hard limit of 25% can end in a memcg OOM kill whatever the device (BENCHMARKS.md)."""
    wl.cg.set_limit(None)


def verify(wl: Workload) -> None:
    lift(wl)
    wl.send("TOUCH")
    parts = wl.expect("VERIFY", timeout=600)
    assert parts[1] == "ok", parts


@pytest.mark.parametrize("spill,frontend", [(False, "auto"), (True, "auto"), (False, "nbdfuse")],
                         ids=["default", "pool-cap-spills-to-disk", "nbdfuse"])
def test_up_exits_workload_squeezed_down_separately(operator, spill, frontend):
    pool = {"max_size": "16M", "reclaim_threshold": 75} if spill else None
    policy = {"cold_grace_period": "0.5s"} if spill else None
    op = operator(pool=pool, policy=policy, frontend=frontend)
    up = op.run("up")
    assert "swap on" in up.stdout
    nbdkit_pid, nbdfuse_pid = op.pids()
    wl = op.workload("cli")
    swapped = op.squeeze(wl)
    assert swapped >= 100 * MiB, f"only {swapped >> 20} MiB went to swap"
    if spill:
        op.run("stats", "--json")  # a maintenance round runs meanwhile; give it a moment
        deadline = time.monotonic() + 30
        while True:
            stats = json.loads(op.run("stats", "--json").stdout)
            if stats["tiers"]["disk"]["pages"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert stats["tiers"]["disk"]["pages"] > 0, "nothing spilled to the disk tier"
    verify(wl)
    stats = json.loads(op.run("stats", "--json").stdout)
    assert stats["errors"] == 0
    datapath = stats["server"]["datapath"]
    if spill and datapath["path"] == "native":  # the re-touch read the disk tier in C
        assert datapath["native_disk_reads"] > 0, datapath
    code, st = op.status()
    assert code == 0 and st["healthy"] is True, st["health"]
    # the very processes `up` started are still the ones serving
    assert (st["state"]["nbdkit_pid"], st["state"]["nbdfuse_pid"]) == (nbdkit_pid, nbdfuse_pid)
    wl.stop()
    op.workloads.clear()
    for cg in op.cgroups:
        cg.remove(timeout=60)
    op.cgroups.clear()
    down = op.run("down")
    assert "detached" in down.stdout
    assert not leftovers(op.run_dir)
    assert not procs.pid_alive(nbdkit_pid) and not procs.pid_alive(nbdfuse_pid)


@pytest.mark.parametrize("frontend", ["auto", "nbdfuse"])
def test_polite_signals_are_refused_during_swap_traffic(operator, frontend):
    op = operator(frontend=frontend)
    op.run("up")
    nbdkit_pid, nbdfuse_pid = op.pids()
    assert (nbdfuse_pid is not None) == (frontend == "nbdfuse")  # auto: no helper process
    wl = op.workload("signals", mb=160)
    assert op.squeeze(wl) >= 64 * MiB
    lift(wl)
    wl.send("CHECK")  # swap-in traffic while the signals arrive
    time.sleep(0.3)
    for pid in (p for p in (nbdkit_pid, nbdfuse_pid) if p):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
            os.kill(pid, sig)
            time.sleep(0.05)
    parts = wl.expect("CHECK", timeout=600)
    assert parts[1] == "ok", parts
    assert procs.pid_alive(nbdkit_pid) and (not nbdfuse_pid or procs.pid_alive(nbdfuse_pid))
    code, st = op.status()
    assert code == 0 and st["healthy"], st["health"]
    stats = json.loads(op.run("stats", "--json").stdout)
    refused = stats["server"]["signals_refused"]
    assert all(refused.get(name, 0) >= 1 for name in ("SIGTERM", "SIGHUP", "SIGINT")), refused
    if nbdfuse_pid:
        fuse_log = Path(op.run_dir, "nbdfuse.log").read_text()
        assert fuse_log.count("nbdfuse refused a signal") >= 3
    verify(wl)


def test_sigkill_without_the_holder_fails_health_and_down_force_cleans_up(operator):
    """The holder recovers a SIGKILLed server (tests/host/test_crash_cli.py); without it
    (killed first: as a chain without one, nbdfuse's or an older `up`'s) the pages are lost,
    `status` and `doctor` say so at once, and `down --force` cleans up."""
    op = operator()
    op.run("up")
    nbdkit_pid, _ = op.pids()
    holder_pid = op.status()[1]["state"].get("holder_pid")
    wl = op.workload("kill", mb=160)
    assert op.squeeze(wl) >= 64 * MiB
    lift(wl)
    wl.send("CHECK")
    time.sleep(0.3)
    if holder_pid:
        os.kill(holder_pid, signal.SIGKILL)
        assert procs.wait_gone(holder_pid, 10.0)
    os.kill(nbdkit_pid, signal.SIGKILL)  # the workload is sacrificed
    t0 = time.monotonic()
    code, st = op.status()
    doctor = op.run("doctor", "--json", check=False, timeout=60)
    assert time.monotonic() - t0 < 5.0 + 2.0  # both answered within the health timeout
    assert code == 4 and st["healthy"] is False, st
    assert any("nbdkit" in p for p in st["health"]["problems"])
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 4, doctor.stdout
    assert any(c["status"] == "fail" and c["name"] == "server health" for c in report["checks"])
    op.cleanup()  # kills the workload, removes its cgroup, `down --force`
    assert not leftovers(op.run_dir)
    assert not os.path.exists(op.root / "tier")
    # a fresh chain on the same run dir works, and holds data
    op.workloads.clear()
    op.cgroups.clear()
    op.run("up")
    wl = op.workload("after-kill", mb=160)
    assert op.squeeze(wl) >= 64 * MiB
    verify(wl)


def test_sigstop_reads_unhealthy_then_traffic_resumes(operator):
    op = operator()
    op.run("up")
    nbdkit_pid, _ = op.pids()
    wl = op.workload("stop", mb=160)
    assert op.squeeze(wl) >= 64 * MiB
    lift(wl)
    os.kill(nbdkit_pid, signal.SIGSTOP)
    try:
        wl.send("CHECK")  # blocks in swap-in until SIGCONT
        t0 = time.monotonic()
        code, st = op.status()
        assert time.monotonic() - t0 < 10.0
        assert code == 4 and st["healthy"] is False, st["health"]
        assert any("stopped" in p for p in st["health"]["problems"]), st["health"]
        time.sleep(max(0.0, 30.0 - (time.monotonic() - t0)))
    finally:
        os.kill(nbdkit_pid, signal.SIGCONT)
    parts = wl.expect("CHECK", timeout=600)
    assert parts[1] == "ok", parts
    code, st = op.status()
    assert code == 0 and st["healthy"], st["health"]
    verify(wl)


def test_up_with_a_foreign_python3_first_on_path(operator, tmp_path):
    """An activated venv without Debian's dist-packages ahead of /usr/bin: nbdkit's embedded
    interpreter took its prefix from it and lost PyYAML (from python3-yaml)."""
    foreign = tmp_path / "foreign-venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(foreign)], check=True)
    env = dict(os.environ, PATH=f"{foreign}/bin:{os.environ.get('PATH', '')}",
               VIRTUAL_ENV=str(foreign), PYTHONPATH=str(tmp_path / "nothing-here"))
    op = operator()
    op.run("up", env=env)
    wl = op.workload("foreign", mb=120)
    assert op.squeeze(wl) >= 32 * MiB
    verify(wl)


def test_warm_pages_are_packed_cold_over_the_cli(operator):
    """Two speeds, as an operator sees them: pages arrive warm (lz4, one page each), the
    backlog drains once the grace period is over, the ratio rises, and every page of the
    workload comes back exact."""
    op = operator(policy={"cold_grace_period": "10s"}, compression={"warm_algorithm": "lz4"})
    op.run("up")
    wl = op.workload("speeds", mb=160)
    assert op.squeeze(wl) >= 64 * MiB
    first = json.loads(op.run("stats", "--json").stdout)
    assert first["warm_pages"] > 0, "nothing arrived warm"
    assert first["warm_pages"] + first["cold_pages"] + first["same_pages"] + first["disk_pages"] \
        == first["pages"]
    deadline = time.monotonic() + 180
    while True:
        time.sleep(2)
        last = json.loads(op.run("stats", "--json").stdout)
        if last["recompress_backlog"] == 0 and last["warm_pages"] < first["warm_pages"] // 10:
            break
        assert time.monotonic() < deadline, f"backlog did not drain: {last['recompress_backlog']}"
    assert last["recompressed_pages_total"] > 0 and last["recompress_cpu_seconds_total"] > 0
    assert last["cold_stored"] > 0 and last["ratio"] > first["ratio"], (first["ratio"], last["ratio"])
    verify(wl)
    assert json.loads(op.run("stats", "--json").stdout)["errors"] == 0
