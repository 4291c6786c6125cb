"""Real swap: the whole chain (nbdkit + plugin, nbdfuse, loop --direct-io, swapon) under a
real Python workload squeezed in a memory cgroup below our own; every byte verified."""

from __future__ import annotations

import os
import shutil

import pytest

from agentzip_blk import procfs
from agentzip_blk.config import Config
from agentzip_blk.demo import driver as demo
from agentzip_blk.host import attach, facts

MiB = 1 << 20

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, cgroups)"),
    pytest.mark.skipif(
        bool(facts.missing_tools(["nbdkit", "nbdfuse", "losetup", "mkswap", "swapon"])),
        reason="nbdkit/nbdfuse/util-linux missing (./setup.sh installs them)",
    ),
]


def leftovers(run_dir: str) -> list[str]:
    """Anything of this run still attached: swap areas, loop devices, mounts, processes."""
    found = [f"swap {a.filename}" for a in procfs.swaps()]
    with open("/proc/mounts") as f:
        found += [f"mount {line.split()[1]}" for line in f if run_dir in line]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if run_dir.encode() in f.read():
                        found.append(f"process {pid}")
            except OSError:
                pass
    loops = "/sys/block"
    for dev in os.listdir(loops):
        backing = os.path.join(loops, dev, "loop", "backing_file")
        if os.path.exists(backing):
            with open(backing) as f:
                if run_dir in f.read():
                    found.append(f"loop /dev/{dev}")
    return found


@pytest.fixture
def run_dir(tmp_path_factory):
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    path = str(tmp_path_factory.mktemp("swaprun"))
    yield path
    # run_squeeze tears down itself; this is the belt to its braces.

    try:
        attach.down(path, force=True)
    except Exception:
        pass
    left = leftovers(path)
    assert not left, f"left behind: {left}"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["fuse", "nbdfuse"])
def frontend(request) -> str:
    """Each front end a host without kernel nbd has: the server's own FUSE file, nbdfuse."""
    if facts.nbd_kernel_available():
        pytest.skip("kernel nbd host: the FUSE front ends are not what up picks")
    return request.param


def config_for(tmp_path, frontend="auto", **pool) -> Config:
    cfg = Config()
    cfg.device.size = 2 << 30
    cfg.device.frontend = frontend
    cfg.pool.swap_out_path = str(tmp_path / "disk-tier")
    for key, value in pool.items():
        setattr(cfg.pool, key, value)
    return cfg


def test_workload_swaps_100mb_through_the_device_and_verifies(tmp_path, run_dir, frontend):
    cfg = config_for(tmp_path, frontend)
    result = demo.run_squeeze("agentzip", 200, config=cfg, run_dir=run_dir,
                              progress=demo.Progress(quiet=True))
    assert result.get("error") is None, result.get("error")
    assert result["verify"] == "ok"  # the workload's checksum over all its data
    assert result["oom_kills"] == 0
    assert result["swapped_cgroup"] >= 100 * MiB
    stats = result["after"]["device"]
    assert stats["pages"] * stats["page_size"] >= result["swapped_cgroup"]
    assert stats["orig_mem"] == stats["pages"] * stats["page_size"]
    assert 0 < stats["stored_mem"] < stats["orig_mem"]
    assert stats["errors"] == stats["enospc"] == 0
    if frontend == "fuse":  # every swap request came through the server's own FUSE file
        door = result["after"]["device"]["server"]["fuse"]
        assert door["writes"] > 0 and door["reads"] > 0 and door["errors"] == 0
    # The server's memory grew by about what the store says it holds (honest accounting).
    growth = result["server_rss_growth"]
    assert growth <= stats["stored_mem"] + 32 * MiB
    assert result["swaps_after_teardown"] == []


def test_pool_cap_spills_cold_pages_to_the_disk_tier(tmp_path, run_dir, frontend):
    cap = 16 * MiB
    cfg = config_for(tmp_path, frontend, max_size=cap, reclaim_threshold=75)
    cfg.policy.cold_grace_period = 0.5
    result = demo.run_squeeze("agentzip", 160, config=cfg, run_dir=run_dir,
                              progress=demo.Progress(quiet=True))
    assert result.get("error") is None, result.get("error")
    assert result["verify"] == "ok"
    stats = result["after"]["device"]
    tiers = stats["tiers"]
    assert stats["pool_bytes"] <= cap
    assert tiers["disk"]["pages"] > 0
    assert tiers["pool"]["pages"] + tiers["disk"]["pages"] == stats["pages"]
    assert stats["pages"] * stats["page_size"] >= result["swapped_cgroup"]
    assert stats["errors"] == stats["enospc"] == 0
    # Memory stays bounded by the cap: RSS growth within the pool cap, the tables and the
    # hot cache, plus 32 MiB for the interpreter's own allocations during the run.
    bound = cap + stats["meta_bytes"] + stats["hot_cache_bytes"] + 32 * MiB
    assert result["server_rss_growth"] <= bound
