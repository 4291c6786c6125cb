"""Content index for deduplication: keyed page hash -> stored page, open addressing in numpy.

A Python dict would cost ~100 bytes per stored page (an entry plus two int objects); this
table costs 8 bytes per slot at a load of 35-70% (~16 bytes per page). The key is 32 bits of
the page's 128-bit hash, which is keyed with a random seed per store (`PageHasher`), so a
tenant cannot pick pages that land on one key or one run of the table.

Nothing here decides equality: the store compares page bytes before every share, so a key
that matches by chance (or by a crafted collision) costs one comparison and can never alias
data. What the index bounds is the cost of a flood of collisions, whatever the hash:

- at most `MAX_CANDIDATES` entries per key: a further page with that key is simply not
  indexed (it is stored, and not deduplicated against);
- every entry sits within `MAX_PROBE` positions of its home, so a lookup, insert or remove
  looks at `MAX_PROBE` positions at most; an entry that does not fit is not indexed either.

Entries not indexed are counted (`unindexed`), so the books still add up (accounting.check).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from . import tables

SUB_BITS = 5  # index value: blob id << SUB_BITS | page in the blob (frames up to 32 pages)
MAX_CANDIDATES = 4  # entries (and so byte comparisons) per key
# Positions a probe looks at. At the maximum load of 70%, 1 random key in ~15000 needs more
# than 64 (simulated); such an entry is left out of the index (one missed dedup chance).
MAX_PROBE = 64

_EMPTY = 0
_TOMBSTONE = 1
_MAX_LOAD = 0.7
_GROW_LOAD = 0.5
_MASK64 = (1 << 64) - 1

HashFn = Callable[[memoryview], tuple[int, int]]


class PageHasher:
    """The store's page hash: xxh3-128 seeded with a random 64-bit value drawn at start.

    Seeded xxh3 is not a MAC (blake2b with a key is, at 11 us per page against 0.5 us on
    this machine: more than compressing the page). It does not need to be one: equality is
    decided by comparing bytes, and the caps above bound what a collision can cost. The seed
    only keeps a tenant from aiming pages at one key without work."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed

    def __call__(self, page) -> tuple[int, int]:
        """The page's keyed 128-bit hash as (low, high) 64-bit halves."""
        digest = xxhash.xxh3_128_intdigest(page, self._seed)
        return digest & _MASK64, digest >> 64


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
    def __init__(self, capacity: int = 1024, enabled: bool = True) -> None:
        # disabled (compression.dedup: off): nothing is indexed, every entry is `unindexed`
        self.enabled = enabled
        self.unindexed = 0  # entries refused (cap, probe limit, disabled) and still live
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
        """Index values stored under `key`: at most MAX_CANDIDATES, usually zero or one."""
        keys, mask = self._keys, self._mask
        pos = key & mask
        for _ in range(MAX_PROBE):
            k = int(keys[pos])
            if k == _EMPTY:
                return
            if k == key:
                yield int(self._vals[pos])
            pos = (pos + 1) & mask

    def insert(self, key: int, value: int) -> bool:
        """Index `value` under `key`; False (and counted in `unindexed`) when dedup is off,
        the key has MAX_CANDIDATES entries already, or no free position is near enough."""
        if not self.enabled:
            self.unindexed += 1
            return False
        if (self.count + self._tombstones + 1) > _MAX_LOAD * self.capacity:
            self._rehash()
        if not self._place(key, value):
            self.unindexed += 1
            return False
        return True

    def _place(self, key: int, value: int) -> bool:
        keys, mask = self._keys, self._mask
        pos = key & mask
        free = -1
        same = 0
        for _ in range(MAX_PROBE):
            k = int(keys[pos])
            if k == key:
                same += 1
                if same >= MAX_CANDIDATES:
                    return False
            elif k <= _TOMBSTONE and free < 0:
                free = pos
            if k == _EMPTY:
                break
            pos = (pos + 1) & mask
        if free < 0:
            return False
        if int(keys[free]) == _TOMBSTONE:
            self._tombstones -= 1
        keys[free] = key
        self._vals[free] = value
        self.count += 1
        return True

    def remove(self, key: int, value: int) -> bool:
        """Drop the entry; False if it was never indexed (then it leaves `unindexed`)."""
        keys, mask = self._keys, self._mask
        pos = key & mask
        for _ in range(MAX_PROBE):
            k = int(keys[pos])
            if k == _EMPTY:
                break
            if k == key and int(self._vals[pos]) == value:
                keys[pos] = _TOMBSTONE
                self.count -= 1
                self._tombstones += 1
                return True
            pos = (pos + 1) & mask
        self.unindexed -= 1
        return False

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
        for key, value in zip(old_keys.tolist(), old_vals.tolist()):
            if not self._place(key, value):  # a new layout may leave one too far from home
                self.unindexed += 1
