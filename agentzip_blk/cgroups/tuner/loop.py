"""The Tuner: every interval, one step of every scoped cgroup's controller, through the ledger."""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ...config import Scope
from ..backends import CgroupError, Counters, MemoryBackend
from ..ledger import Ledger
from ..scopes import covered, scoped_cgroups
from .controller import Controller, Decision, PressureMeter, TunerSettings

__all__ = ["Tuner", "kubelet_managed"]


@dataclass
class _Tracked:
    controller: Controller
    prepared: list[str] = field(default_factory=list)


def kubelet_managed(rel: str) -> bool:
    """A cgroup at or below the kubelet's kubepods tree (both cgroup drivers)."""
    return any(part == "kubepods" or part.startswith(("kubepods.", "kubepods-"))
               for part in rel.split("/"))


class Tuner:
    """Runs the controllers of every scoped cgroup against a backend, one step per interval.

    Injectable: ``clock`` (monotonic seconds), ``pressure`` (``f(rel, now) -> fraction|None``,
    replaces the PSI/fault meter), ``pingpong`` (the device's cumulative counter),
    ``device_ok`` (our swap area is active), ``protected_pids`` (the server's processes: a
    cgroup holding one is never squeezed), ``log`` (one line per decision).
    """

    def __init__(self, backend: MemoryBackend, ledger: Ledger,
                 scopes: Callable[[], Iterable[Scope]], settings: TunerSettings, *,
                 clock: Callable[[], float] = time.monotonic,
                 pressure: Callable[[str, float], float | None] | None = None,
                 pingpong: Callable[[], int | None] | None = None,
                 device_ok: Callable[[], bool] | None = None,
                 protected_pids: Callable[[], Iterable[int]] | None = None,
                 log: Callable[[str], None] | None = None):
        settings.check()
        self.backend = backend
        self.ledger = ledger
        self.scopes = scopes
        self.s = settings
        self.clock = clock
        self.pressure_fn = pressure
        self.pingpong_fn = pingpong
        self.device_ok = device_ok
        self.protected_pids = protected_pids
        self.log = log or (lambda line: print(line, flush=True))
        self.meter = PressureMeter(settings.fault_cost_us)
        self.tracked: dict[str, _Tracked] = {}
        self._pingpong_prev: int | None = None
        self._skipped: set[str] = set()
        self.steps = 0

    # -- helpers ----------------------------------------------------------------------------

    def _stamp(self, line: str) -> None:
        self.log(time.strftime("%Y-%m-%dT%H:%M:%S ") + "tune " + line)

    def _ceiling(self, rel: str) -> int | None:
        """The cgroup's own limit before we touched it (the ledger knows, if we did)."""
        b = self.backend
        names = ("memory.limit_in_bytes",) if b.version == 1 else ("memory.high", "memory.max")
        limits = []
        for name in names:
            path = b.file(rel, name)
            raw = self.ledger.original(path)
            if raw is None:
                try:
                    raw = b.read(rel, name)
                except OSError:
                    continue
            if raw == "max":
                continue
            n = int(raw)
            if b.version == 1 and n >= 9223372036854771712:
                continue
            limits.append(n)
        return min(limits) if limits else None

    def _pingpong_delta(self) -> int:
        if self.pingpong_fn is None:
            return 0
        try:
            now = self.pingpong_fn()
        except Exception:  # the server is optional for the tuner: no counter, no signal
            now = None
        if now is None:
            return 0
        prev, self._pingpong_prev = self._pingpong_prev, now
        return max(0, now - prev) if prev is not None else 0

    def _candidates(self, scopes: list[Scope]) -> list[str]:
        found = scoped_cgroups(self.backend.walk(), scopes)
        if not self.protected_pids:
            return found
        protected = set(self.protected_pids() or ())
        out = []
        for rel in found:
            if protected & set(self.backend.pids(rel)):
                if rel not in self._skipped:
                    self._skipped.add(rel)
                    self._stamp(f"{rel}: skipped: it holds the swap server's own processes "
                                "(squeezing them could deadlock the device); narrow the scope")
                continue
            out.append(rel)
        return out

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Decision]:
        """One decision per scoped cgroup (applied and logged)."""
        self.steps += 1
        decisions: list[Decision] = []
        with self.ledger.locked():
            scopes = list(self.scopes())
            # a config edited by hand (not via `scope disable`) still gets its cgroups back
            released = self.ledger.restore(
                lambda e: e.path.startswith(self.backend.mount + "/") and
                not covered(scopes, self.backend.rel_of(os.path.dirname(e.path))))
            for e in released.restored:
                self._stamp(f"{e.cgroup}: out of scope, restored {os.path.basename(e.path)} = {e.original}")
            rels = self._candidates(scopes)
            for rel in list(self.tracked):
                if rel not in rels:
                    del self.tracked[rel]
                    self.meter.forget(rel)
            now = self.clock()
            device = self.device_ok() if self.device_ok else True
            counters: dict[str, Counters] = {}
            for rel in rels:
                try:
                    counters[rel] = self.backend.counters(rel)
                except (OSError, ValueError):
                    continue  # removed between walk and read
            ping = self._pingpong_delta()
            faults = {rel: self.meter.majfault_delta(rel, c) for rel, c in counters.items()}
            total_faults = sum(faults.values())
            for rel, c in counters.items():
                tr = self.tracked.get(rel)
                if tr is None:
                    tr = self.tracked[rel] = _Tracked(
                        Controller(self.s, self._ceiling(rel), started=now, name=rel))
                share = ping * faults[rel] / total_faults if total_faults else 0.0
                if self.pressure_fn is not None:
                    pressure, kind = self.pressure_fn(rel, now), "injected"
                else:
                    pressure, kind = self.meter.update(rel, now, c, share)
                if not device:
                    d = Decision(rel, "wait", c.usage, tr.controller.target, tr.controller.target,
                                 pressure, c.swap_usage, kind, "our swap device is not attached")
                else:
                    if not tr.prepared:
                        tr.prepared = self._prepare(rel) or ["-"]
                    d = tr.controller.decide(now, c.usage, pressure, swap=c.swap_usage, kind=kind)
                    self._apply(rel, d)
                decisions.append(d)
                self._stamp(d.line(self.s.pressure_target))
        return decisions

    def _prepare(self, rel: str) -> list[str]:
        if self.backend.version == 2 and kubelet_managed(rel) and not self.s.pod_swap_max:
            # v2 prepare writes memory.swap.max only; the kubelet sets it per container from
            # memorySwap.swapBehavior, and we do not override that behind its back
            self._stamp(f"{rel}: memory.swap.max left to the kubelet (a Pod cgroup: "
                        "memorySwap.swapBehavior decides; tune --pod-swap-max to write it)")
            return ["kubelet"]
        try:
            done = self.backend.prepare(rel, self.s.floor)
        except CgroupError as e:
            self._stamp(f"{rel}: prepare failed: {e}")
            return []
        if done:
            self._stamp(f"{rel}: prepared ({', '.join(done)})")
        return done

    def _apply(self, rel: str, d: Decision) -> None:
        if d.target is None or d.action in ("grace", "hold", "wait"):
            return
        t = time.monotonic()
        try:
            if self.s.mode == "limit":
                cur = self.backend.cap(rel)
                if cur != d.target:
                    self.backend.set_cap(rel, d.target)
                d.reclaimed = max(0, d.usage - self.backend.usage(rel))
            elif d.usage - d.target >= self.s.min_step:
                d.reclaimed = self.backend.reclaim(rel, d.usage - d.target)
        except CgroupError as e:
            cause = e.__cause__
            if isinstance(cause, OSError) and cause.errno == errno.EBUSY:
                # v1 limit mode: the kernel could not get under it; settle where it is
                d.error = "EBUSY: nothing more to reclaim"
                usage = self.backend.usage(rel)
                try:
                    self.backend.set_cap(rel, max(usage, d.target))
                except CgroupError:
                    pass
            else:
                d.error = str(e)
        d.seconds = time.monotonic() - t

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event, steps: int | None = None,
            after_step: Callable[[], None] | None = None) -> None:
        """Step every interval until *stop* is set (or *steps* steps were made);
        *after_step* (a heartbeat for probes) runs after each."""
        n = 0
        while not stop.is_set():
            t = self.clock()
            self.step()
            if after_step is not None:
                after_step()
            n += 1
            if steps is not None and n >= steps:
                return
            stop.wait(max(0.0, self.s.interval - (self.clock() - t)))

    def restore(self):
        """Put back every setting recorded in the ledger (the tuner is stopping)."""
        report = self.ledger.restore()
        self._stamp(f"stopped: {report.summary()}")
        self.tracked.clear()
        return report


