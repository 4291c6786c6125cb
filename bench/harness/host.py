"""The cgroup host model: the memory cgroups a bench creates below its own (a host's RAM, the
sandboxes in it), a process started inside one, and their teardown."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable


def child_cgroup(parent, name: str):
    """Create cgroup *name* below *parent* (a MemoryCgroup), v1 or v2."""
    from agentzip_blk.cgroups.fs import MemoryCgroup

    if parent.version == 2:
        parent._v2_enable_memory()
    cg = MemoryCgroup(parent.controller, parent.rel.rstrip("/") + "/" + name)
    os.mkdir(cg.path)
    return cg


def joiner(cg) -> Callable[[], None]:
    """A preexec_fn that moves the child into *cg* before exec: every allocation of the
    program is charged there."""
    procs = cg.file("cgroup.procs")

    def join() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    return join


def kill_all(cg) -> None:
    """Kill what is left in our own cgroup (processes the workload started), by pid."""
    for _ in range(50):
        pids = cg.pids()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.1)


def oom_kills(cg) -> int:
    try:
        return cg.oom_kills()
    except (OSError, ValueError):
        return 0


def set_limit_quiet(cg, limit: int | None) -> bool:
    from agentzip_blk.cgroups.fs import CgroupError

    try:
        cg.set_limit(limit)
        return True
    except CgroupError:  # LimitBusy (v1 could not reclaim that far yet): the next tick retries
        return False
