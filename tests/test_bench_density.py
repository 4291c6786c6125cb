"""`python -m bench density --quick`: the density benchmark end to end, as a smoke test.

Two N values, short agent loops, every configuration (no limit, no swap, zram lz4, agentzip-blk
at its defaults, agentzip-blk + tuner), each started the way an operator would. Asserts that the
tool ran every trial and that every round of every sandbox verified its data -- no figure (speed
goals live in BENCHMARKS.md). A fixture puts back whatever a failed run might leave: sandbox
cgroups, swap areas, zram, an attached device.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = ["-m", "bench", "density"]  # run from ROOT
CONFIGS = ("noswap", "zram", "agentzip", "agentzip-tuned")

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, swap)"),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="pandas is not installed"),
    pytest.mark.skipif(not os.path.isdir("/sys/block/zram0"), reason="no /dev/zram0"),
]


def _swaps() -> list[str]:
    with open("/proc/swaps") as f:
        return [line.split()[0] for line in f.read().splitlines()[1:] if line.strip()]


def _cli() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "agentzip_blk.cli"]


@pytest.fixture
def workdir():
    """The tool's state dir; afterwards nothing of the run may remain (cleaned up if it does)."""
    swaps_before = set(_swaps())
    tmp = tempfile.mkdtemp(prefix="azdt-", dir="/tmp")  # short: the device's run dir holds sockets
    try:
        yield pathlib.Path(tmp)
    finally:
        _clean(tmp, swaps_before)
        shutil.rmtree(tmp, ignore_errors=True)


def _clean(tmp: str, swaps_before: set) -> None:
    from agentzip_blk.cgroups.fs import MemoryCgroup

    own = MemoryCgroup.own()
    leftovers = []
    # 1. workload cgroups (kill what is in them, then remove), 2. swapoff, 3. the device
    for host in glob.glob(os.path.join(own.path, "azdens-*")):
        leftovers.append(host)
        for cg in sorted(glob.glob(os.path.join(host, "*", "")), reverse=True):
            for procs in (os.path.join(cg, "cgroup.procs"),):
                try:
                    pids = [int(x) for x in open(procs).read().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, 9)  # a sandbox of this test's run (in our own cgroup tree)
                    except ProcessLookupError:
                        pass
            MemoryCgroup(own.controller, own.rel.rstrip("/") + "/" + os.path.basename(host) + "/"
                         + os.path.basename(cg.rstrip("/"))).remove()
        MemoryCgroup(own.controller, own.rel.rstrip("/") + "/" + os.path.basename(host)).remove()
    for cfg in glob.glob(os.path.join(tmp, "azd-*", "*", "config.yaml")):
        r = subprocess.run([*_cli(), "--config", cfg, "status", "--json"], capture_output=True, text=True)
        if r.returncode == 0:
            leftovers.append(cfg)
            subprocess.run([*_cli(), "--config", cfg, "down", "--force"], capture_output=True)
    if "/dev/zram0" in set(_swaps()) - swaps_before:
        leftovers.append("/dev/zram0")
        subprocess.run(["swapoff", "/dev/zram0"])
    if "/dev/zram0" not in swaps_before:
        with open("/sys/block/zram0/initstate") as f:
            if f.read().strip() != "0":
                leftovers.append("zram0 initialized")
                with open("/sys/block/zram0/reset", "w") as f:
                    f.write("1")
    assert set(_swaps()) == swaps_before
    assert not leftovers, f"the run left these behind (now cleaned up): {leftovers}"


def test_quick_density_run_verifies_every_round(workdir):
    out = workdir / "density.json"
    p = subprocess.run([sys.executable, *TOOL, "--quick", "--workdir", str(workdir), "--json", str(out)],
                       capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["all_rounds_verified"], doc.get("verify_error")
    assert "error" not in doc, doc["error"]
    ns = [str(n) for n in doc["options"]["quick_ns"]]
    assert sorted(doc["baseline"]) == sorted(ns)
    for name in CONFIGS:
        trials = doc["configs"][name]["trials"]
        assert sorted(trials) == sorted(ns), name
        for n, r in trials.items():
            assert r["verify_error"] is None, (name, n, r["verify_error"])
            # not holding (OOM kill, thrashing past the round or build timeout, p99) is a figure;
            # a sandbox dying otherwise (SIGBUS on a swap I/O error) is the device failing
            assert r["failure_kind"] in (None, "oom", "p99", "round-timeout", "build-timeout"), \
                (name, n, r["failure"])
    for r in doc["baseline"].values():
        assert r["failure"] is None and r["rounds"] > 0
        # every round logged, with the first acts (k = 0) told apart from the later ones
        assert len(r["round_log"]) == r["rounds"]
        firsts = [x["act_s"] for x in r["round_log"] if x["k"] == 0]
        assert firsts and r["first_act_max_s"] == pytest.approx(max(firsts), abs=1e-3)
        assert all(0 <= x["at_s"] <= r["loop_s"] + 1 and x["majflt"] >= 0 for x in r["round_log"])
    assert doc["rounds_total"] > 0
