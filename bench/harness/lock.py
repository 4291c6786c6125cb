"""The machine-wide swap lock every benchmark takes (docs/CONTRIBUTING.md).

Two runs that each attach a swap device share each other's swap areas, and /dev/zram0 is one
device, so every tool that attaches swap or squeezes a cgroup holds /tmp/agentzip-swap.lock.
A tool started under ``flock LOCK tool.py`` (or by a test that holds it) must not take it
again: flock(2) locks belong to open file descriptions, so a second open would wait on itself.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator

SWAP_LOCK = "/tmp/agentzip-swap.lock"


def held_by_ancestor(path: str = SWAP_LOCK) -> bool:
    """True when a process above us holds the flock on *path* (from /proc/locks)."""
    try:
        ino = str(os.stat(path).st_ino)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    holders = {int(p[4]) for p in (line.split() for line in lines)
               if len(p) >= 6 and p[1] == "FLOCK" and p[5].rsplit(":", 1)[-1] == ino}
    pid = os.getppid()
    while pid > 1:
        if pid in holders:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


@contextlib.contextmanager
def swap_lock(log: Callable[[str], None] = print, path: str = SWAP_LOCK) -> Iterator[float]:
    """Hold the swap lock for the block; yields the seconds spent waiting for it."""
    if held_by_ancestor(path):
        yield 0.0  # the caller ran us under flock(1): the lock is already ours
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    waited = 0.0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {path} (another run has swap attached or squeezes cgroups)")
            t = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - t
            log(f"got {path} after {waited:.0f}s")
        yield waited
    finally:
        os.close(fd)  # releases the lock
