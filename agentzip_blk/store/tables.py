"""Zero-filled numpy tables on private anonymous mappings of their own.

numpy asks for transparent huge pages (MADV_HUGEPAGE) on every large array it allocates, so
with THP in `madvise` mode (the default on these hosts) writing one slot of a big table
faults in a whole 2 MiB page: a slot table for a 2 GiB device cost ~2 MiB per array as soon
as a few pages were swapped (measured: 2.1 MiB resident for one written chunk). A mapping
of our own gets 4 KiB pages, so a table costs the pages actually written; mincore says
which pages those are (`resident_bytes`), for the accounting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

_SMALL = 1 << 16  # below this numpy's own allocation is fine (no huge pages, no mapping)


def zeros(shape: int | tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    if nbytes < _SMALL:
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


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
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * _PAGE


def array_resident_bytes(array) -> int:
    """Resident bytes of a numpy array's buffer, never more than its size plus a page."""
    if array.nbytes < 16 * _PAGE:  # small arrays live in malloc'd pages shared with others
        return array.nbytes
    return min(resident_bytes(array.ctypes.data, array.nbytes), array.nbytes + _PAGE)
