"""Shared fixtures. Add, don't rewrite."""

from __future__ import annotations

import fcntl
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import lock as swaplock  # noqa: E402  (the lock's one implementation)

# Swap areas are host-wide: two test runs that attach devices at the same time share them
# (the kernel spreads every cgroup's pages over all areas of the top priority), so one run's
# kill or squeeze lands on the other's workloads. Every test that may attach swap holds this
# lock, shared with the benchmarks (bench/ takes it too), until the session ends.
SWAP_LOCK_PATH = swaplock.SWAP_LOCK  # the lock docs/CONTRIBUTING.md names
_SWAP_FILES = ("test_device.py", "test_doctor.py", "test_metrics_swap.py", "test_scoped_swap.py",
               "test_swap.py", "test_workloads.py", "test_cgstats.py", "test_protection.py",
               "test_swap_stress.py", "test_cli_survival.py")
_swap_lock_fd: int | None = None


def _hold_swap_lock() -> None:
    global _swap_lock_fd
    if _swap_lock_fd is not None or os.geteuid() != 0 or swaplock.held_by_ancestor(SWAP_LOCK_PATH):
        return  # under `flock LOCK pytest ...` the lock is already ours: taking it again would wait
    os.makedirs(os.path.dirname(SWAP_LOCK_PATH), exist_ok=True)
    fd = os.open(SWAP_LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.stderr.write(f"\nwaiting for {SWAP_LOCK_PATH} (another run attaches swap)\n")
        fcntl.flock(fd, fcntl.LOCK_EX)
    _swap_lock_fd = fd


def pytest_runtest_setup(item):
    if item.get_closest_marker("swap") is not None or item.path.name in _SWAP_FILES:
        _hold_swap_lock()


# The inner loop (`pytest -m "not slow"`, docs/CONTRIBUTING.md) leaves out what needs root,
# swap or a server, or takes more than a few seconds. A test or module marks itself slow;
# these markers and the swap files above imply it.
_SLOW_MARKERS = ("swap", "nbdkit", "long")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in _SWAP_FILES or any(item.get_closest_marker(m) is not None
                                                for m in _SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
