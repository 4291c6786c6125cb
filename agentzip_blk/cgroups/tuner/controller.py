"""One cgroup's resident target (Controller) and the pressure it is steered by (PressureMeter)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...config.quantities import format_bytes
from ..backends import Counters

__all__ = ["TunerSettings", "Controller", "Decision", "PressureMeter", "MODES"]

MODES = ("reclaim", "limit")
MiB = 1 << 20


@dataclass
class TunerSettings:
    interval: float = 2.0  # seconds between decisions
    pressure_target: float = 0.001  # fraction of wall time (config: percent)
    floor: int = 64 * MiB  # never push a cgroup's resident memory below this
    max_probe: float = 0.05  # at zero pressure, push out this fraction of usage per interval
    min_backoff: float = 0.05  # on pressure, raise the target by at least this fraction...
    max_backoff: float = 1.0  # ...and at most this one
    backoff_coeff: float = 0.1  # fraction per unit of relative overshoot (p/target - 1)
    grace: float = 30.0  # seconds a new cgroup is left alone (policy.cold_grace_period)
    hold: float = 10.0  # seconds without probing after a backoff (policy.warm_threshold_ms)
    mode: str = "reclaim"
    fault_cost_us: float = 200.0  # stall per major fault / refault, for the v1 estimate
    min_step: int = 1 * MiB  # do not bother the kernel for less
    # v2 memory.swap.max of kubelet Pod cgroups (kubepods*): the kubelet's
    # memorySwap.swapBehavior owns it, so the tuner leaves it alone unless told (tune
    # --pod-swap-max); docs/KUBERNETES.md
    pod_swap_max: bool = False

    @classmethod
    def from_config(cls, config, **overrides) -> "TunerSettings":
        p = config.policy
        s = cls(pressure_target=p.pressure_target / 100.0, grace=p.cold_grace_period,
                hold=p.warm_threshold_ms / 1000.0)
        return replace(s, **{k: v for k, v in overrides.items() if v is not None})

    def check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.interval <= 0:
            raise ValueError(f"interval {self.interval}: must be > 0")
        if not 0 < self.pressure_target <= 1:
            raise ValueError(f"pressure target {self.pressure_target}: must be in (0, 1]")
        if not 0 < self.max_probe < 1:
            raise ValueError(f"max probe {self.max_probe}: must be in (0, 1)")
        if self.floor < 0:
            raise ValueError(f"floor {self.floor}: must be >= 0")


@dataclass
class Decision:
    cgroup: str
    action: str  # grace | hold | probe | backoff | floor | ceiling | wait
    usage: int
    target: int | None  # resident target after this decision
    previous: int | None
    pressure: float | None
    swap: int = 0
    pressure_kind: str = ""
    reason: str = ""
    reclaimed: int = 0  # bytes the kernel pushed out for this decision
    seconds: float = 0.0  # time the kernel action took
    error: str | None = None

    def line(self, target_p: float) -> str:
        def b(n):
            return "-" if n is None else format_bytes(int(n))

        p = "-" if self.pressure is None else f"{self.pressure * 100:.3f}%"
        parts = [f"{self.cgroup}: {self.action}", f"usage {b(self.usage)}", f"swap {b(self.swap)}",
                 f"pressure {p}/{target_p * 100:.3f}%" + (f" ({self.pressure_kind})" if self.pressure_kind else ""),
                 f"target {b(self.previous)} -> {b(self.target)}"]
        if self.reclaimed or self.action == "probe":
            parts.append(f"reclaimed {b(self.reclaimed)} in {self.seconds:.2f}s")
        if self.reason:
            parts.append(self.reason)
        if self.error:
            parts.append(f"ERROR {self.error}")
        return ", ".join(parts)


class Controller:
    """The decision rule for one cgroup: pure, so tests drive it with made-up numbers."""

    def __init__(self, settings: TunerSettings, ceiling: int | None = None,
                 started: float | None = None, name: str = ""):
        self.s = settings
        self.ceiling = ceiling
        self.started = started
        self.name = name
        self.target: int | None = None
        self.hold_until = float("-inf")

    def _clamp(self, n: float) -> int:
        n = max(int(n), self.s.floor)
        if self.ceiling is not None:
            n = min(n, self.ceiling)
        return n

    def decide(self, now: float, usage: int, pressure: float | None, footprint: int | None = None,
               swap: int = 0, kind: str = "") -> Decision:
        """*footprint*: resident + swapped (the most a backoff can usefully give back)."""
        s = self.s
        if self.started is None:
            self.started = now
        footprint = usage + swap if footprint is None else footprint
        prev = self.target
        d = Decision(self.name, "hold", usage, prev, prev, pressure, swap, kind)
        if now - self.started < s.grace:
            d.action, d.reason = "grace", f"new cgroup, first probe in {s.grace - (now - self.started):.0f}s"
            return d
        if pressure is None:
            d.reason = "no pressure sample yet"
            return d
        if pressure > s.pressure_target:
            over = pressure / s.pressure_target - 1
            frac = min(s.max_backoff, max(s.min_backoff, s.backoff_coeff * over))
            base = max(usage, prev or 0)
            upper = self.ceiling if self.ceiling is not None else max(footprint, s.floor)
            new = min(self._clamp(base * (1 + frac)), max(upper, s.floor))
            self.hold_until = now + s.hold
            d.action, d.target = "backoff", new
            d.reason = f"+{frac:.0%}, no probing for {s.hold:g}s"
            if self.ceiling is not None and new >= self.ceiling:
                d.action = "ceiling"
            self.target = new
            return d
        if now < self.hold_until:
            d.reason = f"after backoff, {self.hold_until - now:.0f}s left"
            return d
        headroom = 1 - pressure / s.pressure_target
        frac = s.max_probe * headroom
        # limit mode: never probe from above the cap we set; reclaim mode is stateless like
        # TMO (a fraction of what is resident now): a workload that grew new hot data since
        # the last probe must not lose all of it in one pulse back to an old target
        base = min(usage, prev) if prev is not None and s.mode == "limit" else usage
        new = self._clamp(base * (1 - frac))
        d.action, d.target = "probe", new
        d.reason = f"-{frac:.1%}"
        if new <= s.floor and usage <= s.floor + s.min_step:
            d.action, d.reason = "floor", f"at the floor {format_bytes(s.floor)}"
        self.target = new
        return d


class PressureMeter:
    """Cumulative counters in, stall fraction out (per cgroup, since its previous sample)."""

    def __init__(self, fault_cost_us: float):
        self.fault_cost_us = fault_cost_us
        self._prev: dict[str, tuple[float, Counters]] = {}

    def forget(self, rel: str) -> None:
        self._prev.pop(rel, None)

    def majfault_delta(self, rel: str, c: Counters) -> int:
        prev = self._prev.get(rel)
        return max(0, c.majfaults - prev[1].majfaults) if prev else 0

    def update(self, rel: str, now: float, c: Counters, pingpong: float = 0.0) -> tuple[float | None, str]:
        prev = self._prev.get(rel)
        self._prev[rel] = (now, c)
        if prev is None:
            return None, ""
        dt = now - prev[0]
        if dt <= 0:
            return None, ""
        if c.psi_some_us is not None and prev[1].psi_some_us is not None:
            stall = max(0, c.psi_some_us - prev[1].psi_some_us) / 1e6
            return min(1.0, stall / dt), "psi"
        faults = max(0, c.majfaults - prev[1].majfaults)
        refaults = max(0, c.refaults - prev[1].refaults)
        stall = (faults + pingpong) * self.fault_cost_us / 1e6
        kind = f"est: {faults / dt:.0f} majflt/s, {refaults / dt:.0f} refault/s"
        if pingpong:
            kind += f", pingpong {pingpong:.0f}"
        return min(1.0, stall / dt), kind


