"""Keep the swap server itself out of reach of memory reclaim and the OOM killer.

A swap server that gets swapped out, or killed, takes every swapped page with it. Each
measure is best effort: it reports whether it took, and the caller puts that in `status`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MCL_CURRENT = 1
MCL_FUTURE = 2
MCL_ONFAULT = 4
PR_SET_IO_FLUSHER = 57

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


_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address+length) backed by memory now (mincore), page-rounded.

    Large numpy arrays come from calloc'd mmaps: pages never written are not resident and
    cost nothing, so a preallocated slot table for an 8 GiB device costs what is used.
    """
    if length <= 0:
        return 0
    start = address - address % _PAGE
    end = address + length
    pages = -(-(end - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        return length  # cannot tell: count it all
    import numpy as np

    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * _PAGE


def array_resident_bytes(array) -> int:
    """Resident bytes of a numpy array's buffer, never more than its size plus a page."""
    if array.nbytes < 16 * _PAGE:  # small arrays live in malloc'd pages shared with others
        return array.nbytes
    return min(resident_bytes(array.ctypes.data, array.nbytes), array.nbytes + _PAGE)


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
