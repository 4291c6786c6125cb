"""Zero-filled numpy tables on private anonymous mappings of their own.

numpy asks for transparent huge pages (MADV_HUGEPAGE) on every large array it allocates, so
with THP in `madvise` mode (the default on these hosts) writing one slot of a big table
faults in a whole 2 MiB page: a slot table for a 2 GiB device cost ~2 MiB per array as soon
as a few pages were swapped (measured: 2.1 MiB resident for one written chunk). A mapping
of our own gets 4 KiB pages, so a table costs the pages actually written.
"""

from __future__ import annotations

import mmap

import numpy as np

_SMALL = 1 << 16  # below this numpy's own allocation is fine (no huge pages, no mapping)


def zeros(shape: int | tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    if nbytes < _SMALL:
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
