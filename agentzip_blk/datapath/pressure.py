"""Is the host short of memory? The signal the store's maintainer asks before it moves
returned copies (pages read back and kept in RAM) to the disk tier.

The kernel's own measure: PSI, /proc/pressure/memory, the machine's cumulative time that some
task stalled on memory (reclaim, refaults, swap-in), every cgroup included, so a sandbox
squeezed at its own limit counts as well as the host at its end. Pressure is a stall share
above STALL_SHARE over the last look, and it holds for HOLD seconds: a copy that waits for
the next stall is still costing the host memory it is short of. Where the kernel has no PSI
(booted with psi=0) the fallback is MemAvailable below LOW_AVAILABLE of MemTotal.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import procfs

STALL_SHARE = 0.001  # 0.1% of wall time: the tuner's default pressure_target
HOLD = 10.0  # s that pressure, once seen, is assumed to last
LOW_AVAILABLE = 0.125


class HostPressure:
    def __init__(self, stall_us: Callable[[], int | None] = procfs.memory_stall_us,
                 meminfo: Callable[[], dict[str, int]] = procfs.meminfo,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stall_us, self._meminfo, self._clock = stall_us, meminfo, clock
        self._last: tuple[float, int] | None = None
        self._until = float("-inf")
        self.seen = 0  # looks that found pressure (stats: server.host_pressure_seen)

    def __call__(self) -> bool:
        now = self._clock()
        if self._pressed(now):
            self._until = now + HOLD
            self.seen += 1
        return now < self._until

    def _pressed(self, now: float) -> bool:
        total = self._stall_us()
        if total is None:
            try:
                info = self._meminfo()
            except OSError:
                return False
            return info.get("MemAvailable", 0) < LOW_AVAILABLE * info.get("MemTotal", 0)
        last, self._last = self._last, (now, total)
        if last is None or now <= last[0]:
            return False
        return (total - last[1]) / 1e6 > STALL_SHARE * (now - last[0])
