"""The blob table: one row per distinct stored page, shared by every slot that holds it.

Columns are numpy arrays indexed by blob id (no Python object per blob). Free rows form an
intrusive list through the `arena` column, so freed ids cost nothing to remember.
"""

from __future__ import annotations

import numpy as np

_COLUMNS = {
    "arena": np.int32,  # pool arena id (or next free row while the row is free)
    "cell": np.uint32,  # cell index inside the arena
    "length": np.uint16,  # stored bytes (compressed, or a whole page when raw)
    "codec": np.uint8,  # codec id (agentzip_blk.codec)
    "ref": np.uint32,  # slots pointing at this blob; 0 = free row
    "hash_lo": np.uint64,  # 128-bit content hash, low and high halves
    "hash_hi": np.uint64,
}
ROW_BYTES = sum(np.dtype(t).itemsize for t in _COLUMNS.values())


class BlobTable:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = 0
        for name, dtype in _COLUMNS.items():
            setattr(self, name, np.zeros(0, dtype=dtype))
        self._grow(capacity)
        self._free_head = -1
        self._next_unused = 0
        self.count = 0  # rows in use

    @property
    def nbytes(self) -> int:
        return self.capacity * ROW_BYTES

    def new(self, arena: int, cell: int, length: int, codec: int, lo: int, hi: int) -> int:
        """A row with refcount 1."""
        if self._free_head >= 0:
            blob = self._free_head
            self._free_head = int(self.arena[blob])
        else:
            blob = self._next_unused
            if blob >= self.capacity:
                self._grow(2 * self.capacity)
            self._next_unused += 1
        self.arena[blob] = arena
        self.cell[blob] = cell
        self.length[blob] = length
        self.codec[blob] = codec
        self.ref[blob] = 1
        self.hash_lo[blob] = lo
        self.hash_hi[blob] = hi
        self.count += 1
        return blob

    def delete(self, blob: int) -> None:
        self.ref[blob] = 0
        self.arena[blob] = self._free_head
        self._free_head = blob
        self.count -= 1

    def _grow(self, capacity: int) -> None:
        for name in _COLUMNS:
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self.capacity = capacity
