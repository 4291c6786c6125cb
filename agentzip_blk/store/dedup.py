"""Content index for deduplication: 32-bit hash key -> stored page, open addressing in numpy.

A Python dict would cost ~100 bytes per stored page (an entry plus two int objects); this
table costs 8 bytes per slot at a load of 35-70% (~16 bytes per page; it was 12 bytes at
30-60%, ~27 per page, the largest table of the store). The key is 32 bits of the page's
128-bit hash: the store compares the page bytes themselves before sharing, so a key that
matches by chance costs one comparison (about once per 4 billion / pages stored lookups)
and can never alias data.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from . import tables

SUB_BITS = 5  # index value: blob id << SUB_BITS | page in the blob (frames up to 32 pages)

_EMPTY = 0
_TOMBSTONE = 1
_MAX_LOAD = 0.7
_GROW_LOAD = 0.5


def index_key(lo: int) -> int:
    """The key of a page whose 128-bit hash has low half `lo`. Keys 0 and 1 mark empty and
    deleted entries; fold those hash values elsewhere."""
    key = lo >> 32
    return key if key > _TOMBSTONE else key + 2


def pack(blob: int, sub: int = 0) -> int:
    """The index value naming page `sub` of `blob`."""
    return blob << SUB_BITS | sub


def unpack(value: int) -> tuple[int, int]:
    return value >> SUB_BITS, value & ((1 << SUB_BITS) - 1)


class DedupIndex:
    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(max(16, 1 << (capacity - 1).bit_length()))

    def _alloc(self, capacity: int) -> None:
        self._keys = tables.zeros(capacity, np.uint32)
        self._vals = tables.zeros(capacity, np.int32)
        self._mask = capacity - 1
        self.count = 0
        self._tombstones = 0

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def arrays(self) -> list[np.ndarray]:
        return [self._keys, self._vals]

    def candidates(self, key: int) -> Iterator[int]:
        """Blob ids stored under `key` (usually zero or one)."""
        keys, mask = self._keys, self._mask
        pos = key & mask
        while True:
            k = int(keys[pos])
            if k == _EMPTY:
                return
            if k == key:
                yield int(self._vals[pos])
            pos = (pos + 1) & mask

    def insert(self, key: int, blob: int) -> None:
        if (self.count + self._tombstones + 1) > _MAX_LOAD * self.capacity:
            self._rehash()
        keys, mask = self._keys, self._mask
        pos = key & mask
        while int(keys[pos]) > _TOMBSTONE:
            pos = (pos + 1) & mask
        if int(keys[pos]) == _TOMBSTONE:
            self._tombstones -= 1
        keys[pos] = key
        self._vals[pos] = blob
        self.count += 1

    def remove(self, key: int, blob: int) -> bool:
        keys, mask = self._keys, self._mask
        pos = key & mask
        while True:
            k = int(keys[pos])
            if k == _EMPTY:
                return False
            if k == key and int(self._vals[pos]) == blob:
                keys[pos] = _TOMBSTONE
                self.count -= 1
                self._tombstones += 1
                return True
            pos = (pos + 1) & mask

    def _rehash(self) -> None:
        live = self._keys > _TOMBSTONE
        old_keys = self._keys[live]
        old_vals = self._vals[live]
        capacity = self.capacity
        # Grow (to a load of at most 35%) when live entries fill over half the table;
        # otherwise only sweep out tombstones.
        while len(old_keys) + 1 > _GROW_LOAD * capacity:
            capacity *= 2
        self._alloc(capacity)
        for key, blob in zip(old_keys.tolist(), old_vals.tolist()):
            self.insert(key, blob)
