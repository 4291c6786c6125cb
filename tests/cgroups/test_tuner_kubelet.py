"""The tuner leaves memory.swap.max of kubelet Pod cgroups to the kubelet (its
memorySwap.swapBehavior owns it) unless told otherwise, and says so; on a fake v2 tree."""

from __future__ import annotations

import pytest

from agentzip_blk.cgroups.backends import open_backend
from agentzip_blk.cgroups.ledger import Ledger
from agentzip_blk.cgroups.tree import PlainTree
from agentzip_blk.cgroups.tuner.controller import TunerSettings
from agentzip_blk.cgroups.tuner.loop import Tuner, kubelet_managed
from agentzip_blk.config import Scope
from cgfake import fake_v2, plain, r

MiB = 1 << 20
POD = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod7a3c2f10_1b2d.slice"
SANDBOX = "/agent.slice/agent-sandbox-1.slice"


@pytest.mark.parametrize("rel, managed", [
    (POD, True), ("/kubepods/burstable/pod7a3c", True), ("/kubepods/pod7a3c", True),
    ("/kind.slice/kubepods.slice/kubepods-pod1.slice", True),
    (SANDBOX, False), ("/system.slice/kubepodsfoo.service", False), ("/", False),
])
def test_kubelet_managed(rel, managed):
    assert kubelet_managed(rel) is managed


@pytest.mark.parametrize("pod_swap_max", [False, True])
def test_pod_swap_max_is_opt_in(tmp_path, pod_swap_max):
    root, mnt = fake_v2(tmp_path / "fs", {
        POD: {"cgroup.procs": "100\n", "memory.current": str(1000 * MiB)},
        SANDBOX: {"cgroup.procs": "200\n", "memory.current": str(1000 * MiB)},
    })
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    backend = open_backend(writer=ledger, controller=plain(root))
    ledger.rel_of = backend.rel_of
    lines: list[str] = []
    s = TunerSettings(interval=1.0, floor=64 * MiB, grace=0.0, pod_swap_max=pod_swap_max)
    tuner = Tuner(backend, ledger, lambda: [Scope("*pod7a3c2f10_1b2d.slice"),
                                            Scope("agent-sandbox-*.slice")],
                  s, clock=lambda: 1000.0, pressure=lambda rel, now: 0.0, log=lines.append)
    tuner.step()
    assert r(f"{mnt}{SANDBOX}/memory.swap.max").strip() == "max"  # ours: prepared as before
    assert r(f"{mnt}{POD}/memory.swap.max").strip() == ("max" if pod_swap_max else "0")
    said = [ln for ln in lines if "left to the kubelet" in ln]
    assert len(said) == (0 if pod_swap_max else 1) and (not said or POD in said[0])
    tuner.step()
    assert len([ln for ln in lines if "left to the kubelet" in ln]) == len(said)  # once
