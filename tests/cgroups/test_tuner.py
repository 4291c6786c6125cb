"""agentzip_blk.cgroups.tuner: the controller with injected pressure and clock, the pressure meter,
and the Tuner loop on a fake cgroup v2 tree (files, ledger, one log line per decision)."""

from __future__ import annotations

import os
import re

import pytest

from agentzip_blk.cgroups.backends import Counters, open_backend
from agentzip_blk.cgroups.ledger import Ledger
from agentzip_blk.cgroups.tree import PlainTree
from agentzip_blk.cgroups.tuner.controller import (
    Controller,
    PressureMeter,
    TunerSettings,
)
from agentzip_blk.cgroups.tuner.loop import Tuner
from agentzip_blk.config import Scope, parse_config
from cgfake import fake_v2, plain, r, w

MiB = 1 << 20
TARGET = 0.001  # 0.1 %


def settings(**kw) -> TunerSettings:
    base = dict(interval=1.0, pressure_target=TARGET, floor=64 * MiB, max_probe=0.05,
                min_backoff=0.05, max_backoff=0.5, backoff_coeff=0.1, grace=0.0, hold=3.0)
    base.update(kw)
    return TunerSettings(**base)


def test_settings_from_config():
    cfg = parse_config({"policy": {"pressure_target": 0.5, "cold_grace_period": "45s",
                                   "warm_threshold_ms": 20000}})
    s = TunerSettings.from_config(cfg, floor=32 * MiB, interval=None)
    assert (s.pressure_target, s.grace, s.hold, s.floor, s.interval) == (0.005, 45.0, 20.0, 32 * MiB, 2.0)
    with pytest.raises(ValueError, match="mode"):
        TunerSettings(mode="squeeze").check()


def test_converges_to_the_floor_under_steady_low_pressure():
    """Pressure constantly at a quarter of the target: the target falls every interval (in
    proportion to the headroom), reaches the floor and stays there."""
    c = Controller(settings(), started=0.0)
    usage = 1000 * MiB
    targets = []
    for t in range(200):
        d = c.decide(float(t), usage, TARGET / 4)
        targets.append(d.target)
        usage = min(usage, d.target)  # the kernel did what was asked
    assert all(b <= a for a, b in zip(targets, targets[1:]))
    # each probe removes max_probe * headroom = 3.75 % of the usage
    assert targets[0] == int(1000 * MiB * (1 - 0.05 * 0.75))
    assert targets[-1] == 64 * MiB
    first_floor = targets.index(64 * MiB)
    assert first_floor < 80  # 1000M * 0.9625^n <= 64M after ~72 steps
    assert c.decide(300.0, 64 * MiB, 0.0).action == "floor"


def test_settles_at_the_working_set():
    """A workload whose pressure jumps when its resident memory drops below a working set of
    300 MiB: the target ends up oscillating just around it, never far below."""
    ws = 300 * MiB
    c = Controller(settings(hold=3.0), started=0.0)
    usage = 1000 * MiB
    seen = []
    for t in range(600):
        pressure = 0.0 if usage >= ws else 0.02  # 20x the target: thrashing
        d = c.decide(float(t), usage, pressure, swap=1000 * MiB - usage)
        usage = d.target  # limit mode: resident memory follows the cap
        seen.append(d.target)
    late = seen[300:]
    assert min(late) >= ws * 0.94  # one probe step below the working set at most
    assert max(late) <= ws * 1.6  # one backoff above it at most
    below = sum(1 for x in late if x < ws)
    assert below < len(late) * 0.2  # and rarely under it


def test_backs_off_within_one_interval_on_a_spike():
    c = Controller(settings(hold=5.0), started=0.0)
    usage = 800 * MiB
    for t in range(10):
        d = c.decide(float(t), usage, 0.0)
        usage = d.target
    before = c.target
    spike = c.decide(10.0, usage, 0.05, swap=800 * MiB - usage)  # 50x the target
    assert spike.action == "backoff"
    assert spike.target >= before * 1.5 - 1  # the largest step (max_backoff)
    # no probing while holding, then probing again
    assert c.decide(11.0, usage, 0.0).action == "hold"
    assert c.decide(14.9, usage, 0.0).action == "hold"
    assert c.decide(15.0, usage, 0.0).action == "probe"
    # a small overshoot backs off by a small step
    small = Controller(settings(), started=0.0)
    d = small.decide(0.0, 500 * MiB, TARGET * 1.2, swap=100 * MiB)
    assert d.action == "backoff" and d.target == int(500 * MiB * 1.05)


def test_respects_floor_and_ceiling():
    c = Controller(settings(floor=100 * MiB), ceiling=400 * MiB, started=0.0)
    d = c.decide(0.0, 90 * MiB, 0.0)  # already below the floor: the target is the floor
    assert d.target == 100 * MiB
    for t in range(1, 50):  # steady heavy pressure: up, but never past the ceiling
        d = c.decide(float(t), 380 * MiB, 0.5)
        assert 100 * MiB <= d.target <= 400 * MiB
    assert d.action == "ceiling" and d.target == 400 * MiB
    # without a ceiling, a backoff gives back at most what the cgroup has (resident + swap)
    c2 = Controller(settings(), started=0.0)
    d = c2.decide(0.0, 200 * MiB, 0.5, swap=20 * MiB)
    assert d.target == 220 * MiB


def test_grace_and_missing_samples():
    c = Controller(settings(grace=30.0), started=100.0)
    assert c.decide(110.0, 500 * MiB, 0.0).action == "grace"
    assert c.decide(129.9, 500 * MiB, 0.0).target is None
    assert c.decide(130.0, 500 * MiB, None).action == "hold"
    assert c.decide(131.0, 500 * MiB, 0.0).action == "probe"


def test_pressure_meter_psi_and_estimate():
    m = PressureMeter(fault_cost_us=200.0)
    c0 = Counters(psi_some_us=1_000_000, refaults=0, majfaults=0, swap_usage=0, usage=0)
    assert m.update("/a", 10.0, c0) == (None, "")
    p, kind = m.update("/a", 12.0, Counters(1_040_000, 0, 0, 0, 0))
    assert kind == "psi" and p == pytest.approx(0.02)  # 40 ms stalled in 2 s
    # no PSI: (majfaults + pingpong share) x fault cost; refaults are shown, not added
    e0 = Counters(None, refaults=100, majfaults=1000, swap_usage=0, usage=0)
    m.update("/b", 0.0, e0)
    p, kind = m.update("/b", 2.0, Counters(None, 150, 1100, 0, 0), pingpong=10)
    assert p == pytest.approx((100 + 10) * 200e-6 / 2.0)
    assert kind.startswith("est: 50 majflt/s, 25 refault/s, pingpong 10")
    # counters that went backwards (a cgroup re-created under the same name) are not negative
    p, _ = m.update("/b", 4.0, Counters(None, 0, 0, 0, 0))
    assert p == 0.0


# --- the Tuner on a fake v2 tree -------------------------------------------------------------

SANDBOX = "/agents/agent-sandbox-1.slice"
OTHER = "/agents/other.slice"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _tree(tmp_path):
    return fake_v2(tmp_path / "fs", {
        SANDBOX: {"cgroup.procs": "100\n", "memory.current": str(1000 * MiB)},
        OTHER: {"cgroup.procs": "200\n", "memory.current": str(1000 * MiB)},
    })


def _files(mnt, rel):
    d = f"{mnt}{rel}"
    return {n: r(f"{d}/{n}").strip() for n in sorted(os.listdir(d))}


def _tuner(tmp_path, root, scope_list, pressure, clock, lines, **kw):
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    backend = open_backend(writer=ledger, controller=plain(root))
    ledger.rel_of = backend.rel_of
    return Tuner(backend, ledger, lambda: scope_list, settings(**kw), clock=clock,
                 pressure=pressure, log=lines.append), ledger


def test_tuner_reclaim_mode_writes_only_scoped_and_restores(tmp_path):
    root, mnt = _tree(tmp_path)
    other_before = _files(mnt, OTHER)
    sandbox_before = _files(mnt, SANDBOX)
    clock, lines, pressures = Clock(), [], []
    pressure = lambda rel, now: pressures[-1] if pressures else 0.0  # noqa: E731
    tuner, ledger = _tuner(tmp_path, root, [Scope("agent-sandbox-*.slice")], pressure, clock, lines)

    pressures.append(0.0)
    d = tuner.step()
    assert [x.cgroup for x in d] == [SANDBOX] and d[0].action == "probe"
    assert r(f"{mnt}{SANDBOX}/memory.reclaim") == str(int(1000 * MiB * 0.05))
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "max"
    # the fake kernel obliges: usage follows
    w(f"{mnt}{SANDBOX}/memory.current", str(d[0].target))
    clock.t += 1
    pressures.append(0.05)  # spike: no reclaim this interval
    w(f"{mnt}{SANDBOX}/memory.reclaim", "")
    d = tuner.step()
    assert d[0].action == "backoff" and r(f"{mnt}{SANDBOX}/memory.reclaim") == ""
    clock.t += 1
    pressures.append(0.0)
    assert tuner.step()[0].action == "hold"

    # one log line per decision, each naming the cgroup, action, pressure and target
    decisions = [l for l in lines if "prepared" not in l]
    assert len(decisions) == 3
    assert re.search(rf"tune {SANDBOX}: probe, usage 1000M, .*pressure 0\.000%/0\.100% \(injected\), "
                     r"target - -> 950M, reclaimed", decisions[0])
    assert "backoff" in decisions[1] and "hold" in decisions[2]

    assert _files(mnt, OTHER) == other_before  # never written
    assert [os.path.basename(e.path) for e in ledger.entries()] == ["memory.swap.max"]
    tuner.restore()
    after = _files(mnt, SANDBOX)
    after.pop("memory.reclaim"), sandbox_before.pop("memory.reclaim")
    after.pop("memory.current"), sandbox_before.pop("memory.current")
    assert after == sandbox_before


def test_tuner_limit_mode_and_scope_disabled_in_the_config(tmp_path):
    root, mnt = _tree(tmp_path)
    clock, lines = Clock(), []
    scope_list = [Scope("agent-sandbox-*.slice")]
    tuner, ledger = _tuner(tmp_path, root, scope_list, lambda rel, now: 0.0, clock, lines, mode="limit")
    tuner.step()
    assert r(f"{mnt}{SANDBOX}/memory.high") == str(int(1000 * MiB * 0.95))
    clock.t += 1
    scope_list[0] = Scope("agent-sandbox-*.slice", enabled=False)  # edited by hand
    assert tuner.step() == []
    assert r(f"{mnt}{SANDBOX}/memory.high") == "max"
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "0"
    assert ledger.entries() == []
    assert any("out of scope, restored memory.high = max" in l for l in lines)


def test_tuner_honours_the_ceiling_from_before_it_came(tmp_path):
    root, mnt = _tree(tmp_path)
    w(f"{mnt}{SANDBOX}/memory.high", str(1100 * MiB))
    clock, lines = Clock(), []
    p = [0.0]
    tuner, _ = _tuner(tmp_path, root, [Scope("agent-sandbox-*.slice")], lambda rel, now: p[0], clock,
                      lines, mode="limit", max_backoff=1.0, hold=0.0)
    tuner.step()
    assert r(f"{mnt}{SANDBOX}/memory.high") == str(int(1000 * MiB * 0.95))
    # a new Tuner (restarted) still knows the original limit from the ledger
    tuner2, _ = _tuner(tmp_path, root, [Scope("agent-sandbox-*.slice")], lambda rel, now: 0.9, clock,
                       lines, mode="limit", max_backoff=1.0)
    for _ in range(3):
        clock.t += 1
        d = tuner2.step()
    assert d[0].action == "ceiling" and r(f"{mnt}{SANDBOX}/memory.high") == str(1100 * MiB)


def test_tuner_skips_cgroups_holding_the_server(tmp_path):
    root, mnt = _tree(tmp_path)
    clock, lines = Clock(), []
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    backend = open_backend(writer=ledger, controller=plain(root))
    tuner = Tuner(backend, ledger, lambda: [Scope("*.slice")], settings(), clock=clock,
                  pressure=lambda rel, now: 0.0, protected_pids=lambda: [200], log=lines.append)
    d = tuner.step()
    assert [x.cgroup for x in d] == [SANDBOX]
    assert sum("skipped" in l and OTHER in l for l in lines) == 1
    tuner.step()
    assert sum("skipped" in l for l in lines) == 1  # said once


def test_tuner_waits_while_the_device_is_detached(tmp_path):
    root, mnt = _tree(tmp_path)
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    backend = open_backend(writer=ledger, controller=plain(root))
    lines = []
    tuner = Tuner(backend, ledger, lambda: [Scope("agent-sandbox-*.slice")], settings(),
                  clock=Clock(), pressure=lambda rel, now: 0.0, device_ok=lambda: False,
                  log=lines.append)
    assert tuner.step()[0].action == "wait"
    assert ledger.entries() == [] and r(f"{mnt}{SANDBOX}/memory.reclaim") == ""
    assert "not attached" in lines[-1]


def test_pingpong_is_shared_by_major_faults(tmp_path):
    """No PSI (v2 file removed): the estimate uses faults and the device's ping-pong counter,
    attributed to the cgroups by their share of major faults."""
    root, mnt = _tree(tmp_path)
    for rel in (SANDBOX, OTHER):
        os.unlink(f"{mnt}{rel}/memory.pressure")
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    backend = open_backend(writer=ledger, controller=plain(root))
    ping = [0]
    clock = Clock()
    tuner = Tuner(backend, ledger, lambda: [Scope("*.slice")], settings(fault_cost_us=100.0),
                  clock=clock, pingpong=lambda: ping[0], log=lambda l: None)
    tuner.step()  # first samples
    stat = "pgmajfault {}\nworkingset_refault_anon 0\nworkingset_refault_file 0\n"
    w(f"{mnt}{SANDBOX}/memory.stat", stat.format(30))
    w(f"{mnt}{OTHER}/memory.stat", stat.format(10))
    ping[0] = 40
    clock.t += 1
    tuner._pingpong_prev = 0
    d = {x.cgroup: x for x in tuner.step()}
    assert d[SANDBOX].pressure == pytest.approx((30 + 30) * 100e-6)  # 3/4 of the ping-pong
    assert d[OTHER].pressure == pytest.approx((10 + 10) * 100e-6)


def test_reclaim_mode_probes_from_current_usage_limit_mode_from_its_cap():
    """A workload that grew since the last probe: reclaim mode takes a fraction of what is
    resident now, not everything above the old target; limit mode keeps its cap."""
    r = Controller(settings(mode="reclaim"), started=0.0)
    r.decide(0.0, 500 * MiB, 0.0)
    assert r.decide(1.0, 900 * MiB, 0.0).target == int(900 * MiB * 0.95)
    lim = Controller(settings(mode="limit"), started=0.0)
    first = lim.decide(0.0, 500 * MiB, 0.0).target
    assert lim.decide(1.0, 900 * MiB, 0.0).target == int(first * 0.95)
