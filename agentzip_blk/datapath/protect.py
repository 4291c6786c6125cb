"""Keep the swap server itself out of reach of memory reclaim and the OOM killer.

A swap server that gets swapped out, or killed, takes every swapped page with it. Each
measure is best effort: it reports whether it took, and the caller puts that in `status`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

MCL_CURRENT = 1
MCL_FUTURE = 2
MCL_ONFAULT = 4
PR_SET_IO_FLUSHER = 57
PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def lock_memory() -> str | None:
    """mlockall(CURRENT|FUTURE|ONFAULT); None on success, else the reason.

    ONFAULT matters: without it every mapping is populated at once, and reserved but
    unused address space (glibc arenas, thread stacks, numpy's BLAS buffers) made the
    server 380 MB resident before it stored a page. With it a page is locked when first
    touched, which is all that swap safety needs: untouched pages hold no data.
    """
    if _libc.mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT) != 0:
        return os.strerror(ctypes.get_errno())
    return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt(3)


def bound_malloc() -> bool:
    """Fixed malloc thresholds and two arenas, before the server's threads start; False if
    glibc refused one. With mlockall every page malloc keeps is locked, and glibc's dynamic
    mmap threshold (raised to the largest block freed, up to 32 MiB: numpy's temporaries)
    and a trim threshold twice that left freed memory in per-thread arenas: 131 MiB of
    anonymous memory at density N = 16 where the store's own columns were 34 MiB; with
    these, 53 MiB, and the server's RSS 870 -> 778 MiB (BENCHMARKS.md, "Server memory")."""
    ok = _libc.mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
    ok &= _libc.mallopt(M_TRIM_THRESHOLD, 1 << 20) == 1
    ok &= _libc.mallopt(M_ARENA_MAX, 2) == 1
    return bool(ok)


class MemoryNotLocked(RuntimeError):
    """mlockall failed while the disk tier is on: the server does not start."""


def require_locked(why: str | None, disk_tier: str | None) -> None:
    """The mlockall policy. With the disk tier on, an unlocked server is refused: its
    memory holds the tier's key (and every tenant's pages in the clear), and reclaim could
    write them to another swap area, in the clear, where no key protects them. Without it,
    the server runs and says so (its log; status and doctor). ``why``: lock_memory()'s
    reason, None when locked."""
    if why is None or not disk_tier:
        return
    raise MemoryNotLocked(
        f"mlockall failed ({why}): with the disk tier on (pool.swap_out_path {disk_tier}) the "
        "server will not run with memory that can be swapped out (the tier's key, every "
        "tenant's pages); raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in the unit, "
        "`ulimit -l unlimited`) or keep CAP_IPC_LOCK, or set pool.swap_out_path: null")


def lower_oom_score(value: int = -1000) -> str | None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def set_io_flusher() -> str | None:
    """PR_SET_IO_FLUSHER for the calling thread: its allocations may not recurse into I/O."""
    if _libc.prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


PR_SET_PDEATHSIG = 1


def clear_parent_death_signal() -> str | None:
    """Undo the PR_SET_PDEATHSIG(SIGTERM) that nbdkit 1.32 sets on itself.

    nbdkit 1.32's main() calls set_exit_with_parent() unconditionally (server/main.c:575,
    not only for --exit-with-parent), so an ``nbdkit -f`` receives SIGTERM the moment the
    thread that started it exits: the `up` process. The plugin is loaded after that call,
    in the same thread, so clearing it here is enough. None on success, else the reason.
    """
    if _libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def forbid_core_dumps() -> str | None:
    """No core dump of the server, ever: it would hold the whole pool in the clear and the
    disk tier's key (docs/SECURITY.md). RLIMIT_CORE 0 and PR_SET_DUMPABLE 0 (which also
    keeps ptrace and /proc/PID/mem from processes that are not root with
    CAP_SYS_PTRACE); the pool's arenas are MADV_DONTDUMP as well (store.pool), for a
    kernel set to dump regardless (suid_dumpable 2 with a core pipe). None on success."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError) as exc:
        return f"RLIMIT_CORE: {exc}"
    if _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return "PR_SET_DUMPABLE: " + os.strerror(ctypes.get_errno())
    return None


def dumpable() -> bool:
    """PR_GET_DUMPABLE of this process."""
    return _libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0
