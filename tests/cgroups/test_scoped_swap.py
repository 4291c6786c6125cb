"""End to end: scopes + tuner + per-cgroup stats on the real device and the real controller.

Two agent workloads in two cgroups below our own memory cgroup: ``azt-scoped-PID`` is in
scope, ``azt-unscoped-PID`` is not. The tuner runs against the real hierarchy (it walks all
of it and must pick out only the scoped cgroup). Checked:

- only the scoped cgroup's pages reach the device: the unscoped cgroup's swap usage stays 0
  (memory.stat *and* its processes' pagemap). On v1, ``memory.swappiness=0`` would not be
  enough (global reclaim still swaps such a cgroup); the guarantee here is that nothing
  squeezes it: the tuner never writes an unscoped cgroup, and the host has no global memory
  pressure during the test. We do not write the unscoped cgroup at all, so nothing of it
  needs restoring.
- per-cgroup stats match the device when one cgroup holds all swapped pages. Tolerance:
  the pages the device holds may exceed the cgroup's by up to 2 % + 64 pages (slots the
  kernel freed but has not discarded yet, swap-cache pages brought back by readahead), and the
  cgroup's compressed bytes may fall short of the device's payload by the same fraction; the
  cgroup's orig_mem (its swap entries, zero pages included) must match the slots the kernel
  has allocated on our swap area (/proc/swaps "Used") and, on v1, memory.stat's swap +
  swapcached, within 2 % + 64 pages. Measured a second after the last reclaim: right after
  it, pages whose write is still in flight look like zero pages (empty slots).
- both workloads' data verifies byte for byte after being read back (checksum of the heap).
- restoring: after ``scope disable`` and after ``down``, every file the tool wrote holds its
  original value, and the cgroups' tunables equal a snapshot taken before anything ran.

Run under the swap lock: ``flock /tmp/agentzip-swap.lock .venv/bin/pytest -q tests/test_scoped_swap.py``.
"""

from __future__ import annotations

import os
import time

import pytest

from agentzip_blk import cli, procfs
from agentzip_blk.cgroups import cgstats, scopes
from agentzip_blk.cgroups.backends import open_backend
from agentzip_blk.cgroups.fs import CgroupError, MemoryCgroup, detect
from agentzip_blk.cgroups.ledger import Ledger
from agentzip_blk.cgroups.tuner.controller import TunerSettings
from agentzip_blk.cgroups.tuner.loop import Tuner
from agentzip_blk.config import load_config
from agentzip_blk.datapath import control
from agentzip_blk.demo.workload import Workload
from agentzip_blk.host import attach, facts, procs

pytestmark = pytest.mark.swap

MiB = 1 << 20
PAGE = 4096
TOOLS = ["nbdkit", "nbdfuse", "fusermount3", "losetup", "mkswap", "swapon", "swapoff"]
V1_TUNABLES = ("memory.limit_in_bytes", "memory.soft_limit_in_bytes", "memory.memsw.limit_in_bytes",
               "memory.swappiness", "memory.move_charge_at_immigrate", "memory.use_hierarchy",
               "memory.oom_control")
V2_TUNABLES = ("memory.high", "memory.max", "memory.low", "memory.min", "memory.swap.max",
               "memory.swap.high", "memory.oom.group")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    missing = facts.missing_tools(TOOLS)
    if missing:
        return f"missing tools: {', '.join(missing)}"
    if facts.zswap_enabled():
        return "zswap is enabled"
    if procfs.swaps():
        return "another swap area is active: this test needs the device to be the only swap"
    try:
        detect()
    except CgroupError as e:
        return str(e)
    return None


def _snapshot(cg: MemoryCgroup) -> dict[str, str]:
    names = V1_TUNABLES if cg.version == 1 else V2_TUNABLES
    out = {}
    for n in names:
        try:
            text = cg.read(n)
        except OSError:
            continue
        # oom_control also reports the live under_oom/oom_kill counters: keep the setting
        out[n] = text.splitlines()[0] if n == "memory.oom_control" else text
    return out


def _tuner(backend, ledger, config_path, state, lines) -> Tuner:
    s = TunerSettings(interval=0.5, floor=12 * MiB, max_probe=0.6, grace=0.0, hold=2.0,
                      pressure_target=0.05, mode="reclaim")

    return Tuner(backend, ledger, lambda: scopes.list_scopes(config_path), s,
                 pingpong=lambda: control.request(state.control_socket, "stats")["pingpong"],
                 device_ok=lambda: procfs.swap_area(state.device) is not None,
                 protected_pids=lambda: [p for p in (state.nbdkit_pid, state.nbdfuse_pid) if p],
                 log=lines.append)


def _check_restored(entries, label):
    for e in entries:
        with open(e.path) as f:
            assert f.read().strip() == e.original, f"{label}: {e.path} not restored"


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_scoped_and_unscoped(tmp_path):
    pid = os.getpid()
    glob = f"azt-scoped-{pid}"
    run_dir = str(tmp_path / "run")
    config_path = str(tmp_path / "config.yaml")
    with open(config_path, "w") as f:
        f.write(f"# end-to-end test config\npool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n"
                f"device:\n  size: 1G\n  run_dir: {run_dir}\nscopes:\n"
                f"  - cgroup: {glob}   # the scoped workload\n    enabled: true\n")
    cfg = load_config(config_path)
    controller = detect()
    scoped = MemoryCgroup.create(glob, controller=controller)
    unscoped = MemoryCgroup.create(f"azt-unscoped-{pid}", controller=controller)
    snap = {"scoped": _snapshot(scoped), "unscoped": _snapshot(unscoped)}
    workloads: list[Workload] = []
    lines: list[str] = []
    try:
        w_scoped = Workload(scoped, 96, seed=11)
        workloads.append(w_scoped)
        w_unscoped = Workload(unscoped, 48, seed=12)
        workloads.append(w_unscoped)
        w_scoped.expect("READY", 120)
        w_unscoped.expect("READY", 120)

        with attach.attached(cfg, run_dir, size=1 << 30) as state:
            ledger = Ledger(run_dir)
            backend = open_backend(controller=controller, writer=ledger)
            ledger.rel_of = backend.rel_of
            tuner = _tuner(backend, ledger, config_path, state, lines)
            start_usage = scoped.usage()
            decided = set()
            for _ in range(30):
                decided.update(d.cgroup for d in tuner.step())
                if scoped.swap_usage() >= start_usage // 2:
                    break
                time.sleep(0.5)
            time.sleep(1.5)  # let the last writes land (in flight they look like zero pages)
            assert decided == {scoped.rel}, lines  # the only cgroup the tuner ever decided on
            assert scoped.swap_usage() >= start_usage // 2, "\n".join(lines)

            # only the scoped cgroup's pages are on the device
            assert unscoped.swap_usage() == 0
            assert cgstats.swap_entries(unscoped.pids()).by_type == {}

            # per-cgroup stats against the device totals (one cgroup holds all swapped pages)
            res = cgstats.collect(backend, [glob], state.control_socket, state.device)
            [row] = res["cgroups"]
            st = res["store"]
            slack = 0.02
            print(f"\ncgroup: {row}\nstore: {st}\nkernel swap {scoped.swap_usage()}")
            assert row["pages"] > 0 and row["other_swap_pages"] == 0
            assert row["device_pages"] <= st["pages"]
            assert st["pages"] - row["device_pages"] <= st["pages"] * slack + 64
            assert row["stored_mem"] <= st["compressed_bytes"] + 1
            assert st["compressed_bytes"] - row["stored_mem"] <= st["compressed_bytes"] * slack + 64 * PAGE
            # the kernel's view: slots allocated on our swap area (zero pages included), and
            # the cgroup's swap + swap cache (v1 memory.stat counts a page written out but
            # still in the swap cache as swapcached, not as swap)
            used = procfs.swap_area(state.device).used
            assert abs(row["orig_mem"] - used) <= used * slack + 64 * PAGE
            if scoped.version == 1:
                ms = scoped.stat()
                kernel = ms.get("total_swap", 0) + ms.get("total_swapcached", 0)
                assert abs(row["orig_mem"] - kernel) <= kernel * slack + 64 * PAGE
            # the CLI view of the same
            assert cli.main(["--config", config_path, "--run-dir", run_dir, "stats", "--cgroup",
                             glob, "--json"]) == 0

            # the data: every page read back, checksums equal
            for wl in workloads:
                wl.send("TOUCH")
                assert wl.expect("VERIFY", 180)[1] == "ok"

            # scope disable: everything written is back, the unscoped cgroup was never touched
            written = ledger.entries()
            assert written and {e.cgroup for e in written} == {scoped.rel}
            assert cli.main(["--config", config_path, "--run-dir", run_dir, "scope", "disable",
                             "--cgroup", glob]) == 0
            _check_restored(written, "scope disable")
            assert ledger.entries() == []
            assert _snapshot(scoped) == snap["scoped"]
            assert _snapshot(unscoped) == snap["unscoped"]
            assert "# the scoped workload" in open(config_path).read()

            # enable again, tune in limit mode (writes the limit itself), then `down`
            assert cli.main(["--config", config_path, "--run-dir", run_dir, "scope", "enable",
                             "--cgroup", glob]) == 0
            tuner2 = _tuner(backend, ledger, config_path, state, lines)
            tuner2.s.mode = "limit"
            tuner2.step()
            tuner2.step()
            written = ledger.entries()
            assert any(os.path.basename(e.path) in ("memory.limit_in_bytes", "memory.high")
                       for e in written)
            assert _snapshot(scoped) != snap["scoped"]
        # attached() ran `down`: stop tuner, restore, swapoff, detach
        _check_restored(written, "down")
        assert Ledger(run_dir).entries() == []
        assert _snapshot(scoped) == snap["scoped"]
        assert _snapshot(unscoped) == snap["unscoped"]
    finally:
        for wl in workloads:
            wl.stop()
        for cg in (scoped, unscoped):
            try:
                cg.set_limit(None)
            except (CgroupError, OSError):
                pass
            cg.remove()
    assert procfs.swaps() == []


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_up_tune_starts_the_tuner_and_down_restores(tmp_path):
    """The CLI path: `up --tune` starts the tuner in the background (an enabled scope exists),
    `down` stops it and every setting it wrote is back before swapoff."""
    import subprocess
    import sys

    from agentzip_blk.cgroups.tuner.daemon import running_pid

    glob = f"azt-uptune-{os.getpid()}"
    run_dir = str(tmp_path / "run")
    config_path = str(tmp_path / "config.yaml")
    with open(config_path, "w") as f:
        f.write(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\ndevice:\n  size: 256M\n"
                f"  run_dir: {run_dir}\npolicy:\n  cold_grace_period: 1s\n"
                f"scopes:\n  - cgroup: {glob}\n")
    cg = MemoryCgroup.create(glob)
    snap = _snapshot(cg)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=lambda: cg.add_pid(os.getpid()))
    base = ["--config", config_path, "--run-dir", run_dir]
    written = []
    try:
        assert cli.main(base + ["up", "--tune"]) == 0
        pid = running_pid(run_dir)
        assert pid is not None
        deadline = time.monotonic() + 20
        while not written and time.monotonic() < deadline:
            written = Ledger(run_dir).entries()
            time.sleep(0.2)
        assert written and {e.cgroup for e in written} == {cg.rel}
        assert _snapshot(cg) != snap
    finally:
        try:
            assert cli.main(base + ["down", "--force"]) == 0
            _check_restored(written, "down")
            after = _snapshot(cg)
        finally:
            p.kill()
            p.wait()
            cg.remove()
    assert running_pid(run_dir) is None and not procs.pid_alive(pid)
    assert after == snap
    assert Ledger(run_dir).entries() == []
    log = open(os.path.join(run_dir, "tuner.log")).read()
    assert f"{cg.rel}: prepared" in log and "stopped:" in log
    assert procfs.swaps() == []
