"""The tuner: push scoped cgroups' cold pages into the device, in the manner of senpai/TMO.

One :class:`Controller` per scoped cgroup keeps a *resident target*. Every interval:

- **pressure above target** -> back off at once: the target rises by a fraction that grows
  with the overshoot (``min_backoff``..``max_backoff``), and probing pauses for ``hold``
  seconds (``policy.warm_threshold_ms``: pages that were just faulted back are warm, not cold);
- **pressure below target** -> probe: the target drops below current usage by up to
  ``max_probe`` of it, scaled by how far below target the pressure is (TMO's rule: reclaim in
  proportion to the headroom, never in big steps);
- never below ``floor``, never above ``ceiling`` (the cgroup's own limit before we came);
- a newly seen cgroup is left alone for ``grace`` seconds (``policy.cold_grace_period``):
  nothing of it can be cold before then.

Pressure (fraction of wall time some task stalled on memory):

- **PSI** ``some`` where the cgroup has it: v2, or a v1 cgroup mirrored on the cgroup2 tree of
  a hybrid host (see cgroup_backends.V1Backend.psi_file);
- otherwise **estimated** from ``memory.stat``: major faults x ``fault_cost_us`` per second,
  plus the device's ``pingpong`` counter (pages written again within
  ``policy.hot_threshold_ms`` of being read: hot pages we evicted and had to take again),
  shared out over the cgroups by their major faults. The refault rate is logged next to it
  but not added: on v1 ``workingset_refault_*`` also counts pages that swap readahead
  brought in and nobody waited for (measured: 1585 refaults/s against 436 major faults/s),
  and every refault a task does wait for is a major fault already. Unlike PSI, which counts
  only refaults of recently active pages, the estimate also counts the first read of a
  long-cold page, so a v1 target is a budget for all fault stalls (set it higher than a PSI
  target; 1 % of wall time costs a single-threaded workload at most about 1 %).

The target becomes kernel action in one of two modes:

- ``reclaim`` (default, like TMO): push out ``usage - target`` once (v2 ``memory.reclaim``, v1
  a pulse of ``memory.limit_in_bytes``); the cgroup may grow again freely, and the workload
  never stalls in direct reclaim because of us.
- ``limit`` (like senpai): keep the target as the cgroup's cap (v2 ``memory.high``, v1
  ``memory.limit_in_bytes``).

Every write goes through the ledger (scopes.Ledger): originals are restored on exit, on
``scope disable/remove`` and on ``down``. Each decision is one log line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from .cgroup_backends import CgroupError, Counters, MemoryBackend
from .config import Scope
from .scopes import Ledger, covered, scoped_cgroups
from .units import format_bytes

__all__ = ["TunerSettings", "Controller", "Decision", "PressureMeter", "Tuner", "MODES"]

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


@dataclass
class _Tracked:
    controller: Controller
    prepared: list[str] = field(default_factory=list)


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

    def run(self, stop: threading.Event, steps: int | None = None) -> None:
        """Step every interval until *stop* is set (or *steps* steps were made)."""
        n = 0
        while not stop.is_set():
            t = self.clock()
            self.step()
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


# --- the tuner as a background process (`up --tune`, stopped by `down`) ----------------------

TUNER_PID = "tuner.pid"
TUNER_LOG = "tuner.log"
TUNER_LOCK = "tuner.lock"


class TunerBusy(RuntimeError):
    """Another tuner already runs on this run directory."""


def acquire_instance(run_dir: str) -> int:
    """Hold RUN/tuner.lock for the life of this process (one tuner per run directory: it
    restores every ledger entry when it stops). Returns the fd to keep open."""
    import fcntl

    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(run_dir, TUNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = running_pid(run_dir)
        raise TunerBusy(f"a tuner already runs on {run_dir}" + (f" (pid {pid})" if pid else "") +
                        ": stop it first (Ctrl-C, or `agentzip-blk down`)") from None
    with open(os.path.join(run_dir, TUNER_PID), "w") as f:
        f.write(f"{os.getpid()}\n")
    return fd


def release_instance(run_dir: str, fd: int) -> None:
    try:
        with open(os.path.join(run_dir, TUNER_PID)) as f:
            mine = int(f.read().strip() or 0) == os.getpid()
    except (OSError, ValueError):
        mine = False
    if mine:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(run_dir, TUNER_PID))
    os.close(fd)


def _is_tuner(pid: int, run_dir: str) -> bool:
    from . import system

    argv = system.process_cmdline(pid)
    return "tune" in argv and any(run_dir in a for a in argv)


def running_pid(run_dir: str) -> int | None:
    """The pid of the tuner of *run_dir* if it runs."""
    from . import system

    try:
        with open(os.path.join(run_dir, TUNER_PID)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if system.pid_alive(pid) and _is_tuner(pid, run_dir) else None


def start_daemon(run_dir: str, config_path: str | None, extra: list[str] | None = None,
                 timeout: float = 3.0) -> int:
    """Start ``agentzip-blk tune`` in the background (own session), logging to RUN/tuner.log."""
    import subprocess
    import sys

    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    argv = [sys.executable, "-m", "agentzip_blk.cli"]
    if config_path:
        argv += ["--config", os.path.abspath(config_path)]
    argv += ["--run-dir", run_dir, "tune"] + list(extra or [])
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    log = open(os.path.join(run_dir, TUNER_LOG), "ab")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)
    finally:
        log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the tuner exited at once (status {proc.returncode}); see "
                               f"{os.path.join(run_dir, TUNER_LOG)}")
        if running_pid(run_dir) == proc.pid:
            return proc.pid
        time.sleep(0.05)
    return proc.pid


def stop_daemon(run_dir: str, timeout: float = 30.0) -> int | None:
    """SIGTERM the tuner of *run_dir* (it restores what it wrote), SIGKILL after *timeout*."""
    import signal

    from . import system

    pid = running_pid(os.path.abspath(run_dir))
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while system.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if system.pid_alive(pid) and _is_tuner(pid, os.path.abspath(run_dir)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pid
