"""The exporter during a real swap run: the device attached as swap, an agent workload in a
scoped memory cgroup squeezed into it by the tuner, then a scrape of ``agentzip-blk
metrics``' collector over HTTP, compared with ``stats --json`` and with ``cgstats`` directly.

The workload is idle and the tuner stopped while we compare, but the kernel may still touch
a few pages (readahead, kswapd): so the test scrapes, takes ``stats --json``, scrapes again,
and requires every gauge to equal one of the two scrapes and every counter to lie between.
Per-cgroup figures must match ``cgstats.collect`` within the slack test_scoped_swap uses.

Run under the swap lock: ``flock /tmp/agentzip-swap.lock .venv/bin/pytest -q tests/test_metrics_swap.py``.
"""

from __future__ import annotations

import os
import time

import pytest

from agentzip_blk import procfs
from agentzip_blk.cgroups import cgstats, scopes
from agentzip_blk.cgroups.backends import open_backend
from agentzip_blk.cgroups.fs import MemoryCgroup, detect
from agentzip_blk.cgroups.ledger import Ledger
from agentzip_blk.cgroups.tuner.controller import TunerSettings
from agentzip_blk.cgroups.tuner.loop import Tuner
from agentzip_blk.config import load_config
from agentzip_blk.datapath import control
from agentzip_blk.demo.workload import Workload
from agentzip_blk.fleet import metrics
from agentzip_blk.host import attach
from cgroups.test_scoped_swap import _skip_reason
from fleet.test_metrics import exporter, scrape, stats_json

pytestmark = pytest.mark.swap
MiB = 1 << 20
PAGE = 4096


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_scrape_during_real_swap(tmp_path):
    glob = f"azt-metrics-{os.getpid()}"
    run_dir = str(tmp_path / "run")
    config_path = str(tmp_path / "config.yaml")
    with open(config_path, "w") as f:
        f.write(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\ndevice:\n  size: 512M\n"
                f"  run_dir: {run_dir}\nscopes:\n  - cgroup: {glob}\n    enabled: true\n")
    cfg = load_config(config_path)
    controller = detect()
    cg = MemoryCgroup.create(glob, controller=controller)
    wl = None
    try:
        wl = Workload(cg, 64, seed=21)
        wl.expect("READY", 120)
        with attach.attached(cfg, run_dir, size=512 * MiB) as state:
            ledger = Ledger(run_dir)
            backend = open_backend(controller=controller, writer=ledger)
            ledger.rel_of = backend.rel_of
            tuner = Tuner(backend, ledger, lambda: scopes.list_scopes(config_path),
                          TunerSettings(interval=0.5, floor=12 * MiB, max_probe=0.6, grace=0.0,
                                        hold=2.0, pressure_target=0.05, mode="reclaim"),
                          pingpong=lambda: control.request(state.control_socket, "stats")["pingpong"],
                          device_ok=lambda: procfs.swap_area(state.device) is not None,
                          protected_pids=lambda: [p for p in (state.nbdkit_pid, state.nbdfuse_pid) if p],
                          log=lambda _l: None)
            start = cg.usage()
            for _ in range(30):
                tuner.step()
                if cg.swap_usage() >= start // 2:
                    break
                time.sleep(0.5)
            time.sleep(1.5)  # in-flight writes land
            assert cg.swap_usage() >= start // 2

            col = metrics.Collector(
                metrics.control_stats(state.control_socket),
                metrics.CgroupSource(run_dir, config_path, "/", interval=0.0),
                metrics.HostSource(run_dir, config_path))
            with exporter(col) as url:
                m1 = scrape(url)
                st = stats_json(state.control_socket)
                m2 = scrape(url)
            direct = cgstats.collect(backend, [glob], state.control_socket, state.device)

            # swap-in some pages so the read histogram has swap-in observations
            wl.send("TOUCH")
            assert wl.expect("VERIFY", 180)[1] == "ok"  # every byte back
            st_after = control.request(state.control_socket, "stats")
        assert procfs.swaps() == []
    finally:
        if wl is not None:
            wl.stop()
        cg.remove()

    def both(name, **labels):
        k = (name, tuple(sorted(labels.items())))
        return m1[k], m2[k]

    assert both("agentzip_up") == (1, 1)
    assert both("agentzip_swap_attached") == (1, 1)  # the device is in /proc/swaps
    print(f"\norig {st['orig_mem']} stored {st['stored_mem']} ratio {st['ratio']} "
          f"pages {st['pages']} reads {st['reads']} writes {st['writes']}")
    assert st["orig_mem"] >= 16 * MiB
    for name, key in [("agentzip_orig_bytes", "orig_mem"), ("agentzip_stored_bytes", "stored_mem"),
                      ("agentzip_pool_bytes", "pool_bytes"), ("agentzip_disk_bytes", "disk_mem"),
                      ("agentzip_hot_cache_bytes", "hot_cache_bytes")]:
        assert st[key] in both(name), name
    for kind in ("same", "raw", "compressed"):
        assert st[f"{kind}_pages"] in both("agentzip_pages", kind=kind)
    for name, key in [("reads", "reads"), ("writes", "writes"), ("trims", "trims"),
                      ("demotions", "demotions"), ("promotions", "promotions"),
                      ("pingpong", "pingpong")]:
        a, b = both(f"agentzip_{name}_total")
        assert a <= st[key] <= b, name
    for op in ("read", "write"):
        a, b = both("agentzip_request_duration_seconds_count", op=op)
        assert a <= st["latency"][op]["count"] <= b
    assert st["latency"]["write"]["count"] == st["writes"] > 0
    assert st_after["latency"]["read"]["count"] == st_after["reads"] > st["reads"]

    # per cgroup: the scraped row is the cgstats row (taken a moment later)
    [row] = direct["cgroups"]
    got_orig = m1[("agentzip_cgroup_orig_bytes", (("cgroup", row["cgroup"]),))]
    got_stored = m1[("agentzip_cgroup_stored_bytes", (("cgroup", row["cgroup"]),))]
    assert m1[("agentzip_cgroup_stats_available", ())] == 1
    assert row["orig_mem"] > 0 and got_orig > 0
    assert abs(got_orig - row["orig_mem"]) <= row["orig_mem"] * 0.02 + 64 * PAGE
    assert abs(got_stored - row["stored_mem"]) <= row["stored_mem"] * 0.02 + 64 * PAGE
    # and the cgroup holds (nearly) all the device's pages: it is the only one swapping
    assert got_orig <= st["orig_mem"] + st["orig_mem"] * 0.02 + 64 * PAGE
