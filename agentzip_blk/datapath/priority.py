"""The scheduling class of the FUSE workers (``device.request_priority``).

A fault waits for three wake-ups on its way through the chain (the loop device's worker,
ours, then the faulting task), and on two CPUs shared with busy sandboxes each one waited
80-200 us for a CPU at the normal priority (BENCHMARKS.md "Faults answered first"): more
than our own work on a read. zram has no such wait, since it decompresses in the faulting
task. With ``realtime``, a worker that reads /dev/fuse for the native path runs SCHED_FIFO
at priority 1, the lowest real-time one: a request that arrives is taken at once, ahead of
the sandboxes' slices. Only reads run there. A write's compression is the sandboxes' kind
of work and a request handed to Python may run long, so both run at the normal priority
(the C loop lowers itself around a write it stores inline; ``normal_priority`` around
Python). The kernel's real-time throttling (sched_rt_runtime_us, 95% of each CPU by
default) bounds what a bug could take. Not the default: under `bench load` the writers, at
the normal priority, lost CPU to the readers and the load moved less (BENCHMARKS.md "Faults
answered first").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

REALTIME = "realtime"
NORMAL = "normal"
FIFO_PRIORITY = 1


def enter_realtime() -> str | None:
    """Put the calling thread in SCHED_FIFO at FIFO_PRIORITY: None, or why it was refused
    (no CAP_SYS_NICE, or a cpu cgroup without real-time time)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FIFO_PRIORITY))
    except OSError as e:
        return f"SCHED_FIFO {FIFO_PRIORITY} refused: {os.strerror(e.errno or 0)}"
    return None


@contextlib.contextmanager
def normal_priority(realtime: bool) -> Iterator[None]:
    """Run the block at the normal priority when the calling thread is a real-time one."""
    if not realtime:
        yield
        return
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FIFO_PRIORITY))
