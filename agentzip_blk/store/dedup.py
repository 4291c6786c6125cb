"""Content index for deduplication: keyed page hash -> stored page, open addressing in numpy.

A Python dict would cost ~100 bytes per stored page (an entry plus two int objects); this
table costs 6 bytes per position (a 16-bit fingerprint and a 32-bit value) at a load of
50-70%: ~10 bytes per stored page. The key is 32 bits of the page's 128-bit hash, which is
keyed with a random seed per store (`PageHasher`), so a tenant cannot pick pages that land on
one key or one run of the table. The key's high bits pick its home position (any capacity,
not only powers of two: the table is sized to the pages stored, within a load band), its
low 16 bits are the fingerprint kept in the table; the full key of an entry is the blob
table's (`members`), which is what a resize re-places entries by.

Nothing here decides equality: the store compares page bytes before every share, so a key
that matches by chance (or by a crafted collision) costs one comparison and can never alias
data. What the index bounds is the cost of a flood of collisions, whatever the hash:

- at most `MAX_CANDIDATES` entries per fingerprint in a probe run: a further page with that
  key is simply not indexed (it is stored, and not deduplicated against);
- every entry sits within `MAX_PROBE` positions of its home, so a lookup, insert or remove
  looks at `MAX_PROBE` positions at most; an entry that does not fit is not indexed either.

Entries not indexed are counted (`unindexed`), so the books still add up (accounting.check).

Resizing allocates a new table. With a maintainer running (`hand_growth_to`), the write path
never does (issue 15: no allocation that can wait for reclaim on the swap-out path): the
maintainer grows the table ahead of need (`wanted`, `prepare` without the store lock,
`adopt`), and a write that finds the table at its maximum load leaves its entry out of the
index instead. Without one (a store used in-process), an insert grows the table itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from . import tables

SUB_BITS = 4  # index value: blob id << SUB_BITS | page in the blob (frames up to 16 pages)
# Blob ids an index value can name (32-bit values): config.MAX_DEVICE_SIZE keeps a device's
# slots to half of this, so the rows staged by requests in flight always fit too.
MAX_BLOBS = 1 << (32 - SUB_BITS)
MAX_CANDIDATES = 4  # entries (and so byte comparisons) per key
# Positions a probe looks at. At the maximum load of 70%, 1 random key in ~15000 needs more
# than 64 (simulated); such an entry is left out of the index (one missed dedup chance).
MAX_PROBE = 64

_EMPTY = 0
_TOMBSTONE = 1
_MAX_LOAD = 0.7  # an insert above this grows the table (inline) or is left out (maintainer)
_AHEAD_LOAD = 0.6  # the maintainer grows the table from this load...
_TARGET_LOAD = 0.5  # ...to this one; a resize always lands here
_SHRINK_LOAD = 0.2  # the maintainer shrinks a table this empty (pages freed)
_TOMBSTONE_SHARE = 0.2  # or sweeps one with this many deleted positions
# 24 KiB: room for ~10 write requests of 1 MiB before the first resize, so that the first
# swap-out burst does not outrun a maintainer that cannot resize in the middle of a request
_MIN_CAPACITY = 4096
_MASK64 = (1 << 64) - 1
# The index's scalars, in one int64 array (`state`): the native request path inserts and
# removes entries too (datapath/nativeloop.c), through the same numbers.
COUNT, TOMBSTONES, UNINDEXED, STARVED = 0, 1, 2, 3

HashFn = Callable[[memoryview], tuple[int, int]]


@dataclass
class Resize:
    """A new table laid out without the store lock (`DedupIndex.plan`), for `adopt`."""
    fps: np.ndarray
    vals: np.ndarray
    seen_fps: np.ndarray  # the table it was laid out from, as copied under the lock
    seen_vals: np.ndarray
    moved_to: np.ndarray  # each seen position's entry's position in the new table, or -1
    left_out: int  # seen entries too far from their home in the new table (not indexed)
    table: int  # which arrays of the index were seen (DedupIndex._set counts them)


class PageHasher:
    """The store's page hash: xxh3-128 seeded with a random 64-bit value drawn at start.

    Seeded xxh3 is not a MAC (blake2b with a key is, at 11 us per page against 0.5 us on
    this machine: more than compressing the page). It does not need to be one: equality is
    decided by comparing bytes, and the caps above bound what a collision can cost. The seed
    only keeps a tenant from aiming pages at one key without work."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed

    @property
    def seed(self) -> int:
        """For the native request path, which hashes the same way (datapath/nativestore.c)."""
        return self._seed

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




def fingerprint(key: int) -> int:
    """What the table keeps of a key: its low 16 bits, 0 and 1 folded (empty, deleted)."""
    fp = key & 0xFFFF
    return fp if fp > _TOMBSTONE else fp + 2


def _target(count: int) -> int:
    """The capacity that holds `count` entries at the target load."""
    return max(_MIN_CAPACITY, int(count / _TARGET_LOAD) + 1)


class DedupIndex:
    def __init__(self, capacity: int = _MIN_CAPACITY, enabled: bool = True,
                 key_of: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        # disabled (compression.dedup: off): nothing is indexed, every entry is `unindexed`
        self.enabled = enabled
        self.state = np.zeros(4, dtype=np.int64)
        self._state = memoryview(self.state)
        # runs when the arrays are replaced (a resize): the native path reads them by address
        self.on_moved: Callable[[], None] = lambda: None
        # the full 32-bit keys of index values (the blob table's `members`): what a resize
        # re-places entries by; None: the table never resizes
        self.key_of = key_of
        self.inline_growth = True
        self.wake: Callable[[], None] = lambda: None
        self._table = 0  # which arrays a `Resize` was seen from: _set counts them
        self._set(*self._arrays(max(16, capacity)))

    @property
    def count(self) -> int:
        """Entries in the table."""
        return self._state[COUNT]

    @count.setter
    def count(self, value: int) -> None:
        self._state[COUNT] = value

    @property
    def unindexed(self) -> int:
        """Entries refused (cap, probe limit, disabled, full) and still live."""
        return self._state[UNINDEXED]

    @unindexed.setter
    def unindexed(self, value: int) -> None:
        self._state[UNINDEXED] = value

    @property
    def _tombstones(self) -> int:
        return self._state[TOMBSTONES]

    @_tombstones.setter
    def _tombstones(self, value: int) -> None:
        self._state[TOMBSTONES] = value

    @property
    def _starved(self) -> bool:
        """The write path left entries out for want of room since the last resize: the
        maintainer did not keep up with a burst, so the next growth leaves twice the room."""
        return bool(self._state[STARVED])

    @_starved.setter
    def _starved(self, value: bool) -> None:
        self._state[STARVED] = int(value)

    @staticmethod
    def _arrays(capacity: int) -> tuple[np.ndarray, np.ndarray]:
        return tables.zeros(capacity, np.uint16), tables.zeros(capacity, np.uint32)

    def _set(self, fps: np.ndarray, vals: np.ndarray) -> None:
        self._fps, self._vals = fps, vals
        self._table += 1
        # Probes go through memoryviews: indexing one yields a Python int (~30 ns), indexing
        # the numpy array a numpy scalar (~100 ns), and a probe is a Python loop.
        self._fpv, self._valv = memoryview(fps), memoryview(vals)
        self._cap = len(fps)
        self.on_moved()

    @property
    def capacity(self) -> int:
        return self._cap

    def arrays(self) -> list[np.ndarray]:
        return [self._fps, self._vals]

    def home(self, key: int) -> int:
        """The key's home position: its high bits scaled to the capacity."""
        return (key * self._cap) >> 32

    def hand_growth_to(self, wake: Callable[[], None] | None) -> None:
        """A maintainer resizes the table from now on (`wake` asks it to); None: inserts
        grow it again themselves."""
        self.inline_growth = wake is None
        self.wake = wake or (lambda: None)

    def candidates(self, key: int) -> Iterator[int]:
        """Index values stored under `key`'s fingerprint in its probe run: at most
        MAX_CANDIDATES get compared (placement), usually zero or one is there."""
        fps, cap = self._fpv, self._cap
        fp = fingerprint(key)
        pos = (key * cap) >> 32
        for _ in range(MAX_PROBE):
            k = fps[pos]
            if k == _EMPTY:
                return
            if k == fp:
                yield self._valv[pos]
            pos += 1
            if pos == cap:
                pos = 0

    def insert(self, key: int, value: int) -> bool:
        """Index `value` under `key`; False (and counted in `unindexed`) when dedup is off,
        the key has MAX_CANDIDATES entries already, no free position is near enough, or the
        table is full and its maintainer has not grown it yet."""
        if not self.enabled:
            self.unindexed += 1
            return False
        used = self.count + self._tombstones + 1
        if used > _AHEAD_LOAD * self._cap and not self.inline_growth:
            self.wake()
        if used > _MAX_LOAD * self._cap:
            if not (self.inline_growth and self.key_of is not None):
                self.unindexed += 1
                self._starved = True
                return False
            self._resize(max(self._cap, _target(self.count + 1)))
        if not self._place(key, value):
            self.unindexed += 1
            return False
        return True

    def _place(self, key: int, value: int) -> bool:
        fps, cap = self._fpv, self._cap
        fp = fingerprint(key)
        pos = (key * cap) >> 32
        free = -1
        same = 0
        for _ in range(MAX_PROBE):
            k = fps[pos]
            if k == fp:
                same += 1
                if same >= MAX_CANDIDATES:
                    return False
            elif k <= _TOMBSTONE and free < 0:
                free = pos
            if k == _EMPTY:
                break
            pos += 1
            if pos == cap:
                pos = 0
        if free < 0:
            return False
        if fps[free] == _TOMBSTONE:
            self._tombstones -= 1
        fps[free] = fp
        self._valv[free] = value
        self.count += 1
        return True

    def _find(self, key: int, value: int) -> int:
        """The position of the entry of `key` naming `value`, or -1."""
        fps, cap = self._fpv, self._cap
        fp = fingerprint(key)
        pos = (key * cap) >> 32
        for _ in range(MAX_PROBE):
            k = fps[pos]
            if k == _EMPTY:
                return -1
            if k == fp and self._valv[pos] == value:
                return pos
            pos += 1
            if pos == cap:
                pos = 0
        return -1

    def remove(self, key: int, value: int) -> bool:
        """Drop the entry; False if it was never indexed (then it leaves `unindexed`)."""
        pos = self._find(key, value)
        if pos < 0:
            self.unindexed -= 1
            return False
        self._fpv[pos] = _TOMBSTONE
        self.count -= 1
        self._tombstones += 1
        return True

    def repoint(self, key: int, old: int, new: int) -> None:
        """The entry of `key` naming `old` names `new` from now on (a blob moved to another
        row, Objects.renumber). Same key, same position: nothing is removed or added, so an
        entry that was never indexed stays counted in `unindexed`."""
        pos = self._find(key, old)
        if pos >= 0:
            self._valv[pos] = new

    # -- resizing --------------------------------------------------------------------

    def wanted(self) -> int | None:
        """The capacity the maintainer should give the table now, or None: grown ahead of
        need, shrunk once most of its pages are gone, swept when tombstones pile up."""
        if self.key_of is None or not self.enabled:
            return None
        cap, count = self._cap, self.count
        if count + 1 > _AHEAD_LOAD * cap:
            return _target(2 * count if self._starved else count)
        if count < _SHRINK_LOAD * cap and cap > _MIN_CAPACITY:
            return _target(count)
        if self._tombstones > _TOMBSTONE_SHARE * cap or count + self._tombstones > _AHEAD_LOAD * cap:
            return cap  # a sweep
        return None

    def restore(self, fps: np.ndarray, vals: np.ndarray, state: np.ndarray) -> None:
        """The table of a store handed over (store.handover), before any request: its
        positions as they were (homes depend on the capacity, which comes with them)."""
        if len(fps) != len(vals) or fps.dtype != np.uint16 or vals.dtype != np.uint32:
            raise ValueError("dedup index arrays do not match")
        new_fps, new_vals = self._arrays(len(fps))
        new_fps[:] = fps
        new_vals[:] = vals
        self.state[:] = state
        self._set(new_fps, new_vals)

    @classmethod
    def prepare(cls, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """New, empty arrays, their pages written now (before anyone holds the store lock
        for them)."""
        fps, vals = cls._arrays(capacity)
        fps.fill(0)
        vals.fill(0)
        return fps, vals

    def seen(self) -> tuple[int, np.ndarray, np.ndarray]:
        """Under the store lock: a copy of the table, for `plan`."""
        return self._table, self._fps.copy(), self._vals.copy()

    def plan(self, capacity: int, seen: tuple[int, np.ndarray, np.ndarray]) -> Resize:
        """Without the store lock: the `seen` entries laid out in a new table of `capacity`
        positions. Requests change the table meanwhile, and an entry removed since may even
        read a wrong key (its blob row reused); `adopt` replays every position that changed,
        so neither reaches the table it installs. (Left: a row freed and reused, its new
        entry landing on the old one's position with the same value and 16-bit fingerprint
        in this window, would keep the old key's home: a missed dedup, never wrong bytes.)"""
        table, seen_fps, seen_vals = seen
        where = np.flatnonzero(seen_fps > _TOMBSTONE)
        if len(where) + 1 > _MAX_LOAD * capacity:
            # too small for what was seen (adopt would refuse it, and more entries than
            # positions cannot be laid out at all): the capacity that holds them
            capacity = _target(len(where))
        fps, vals = self.prepare(capacity)
        pos, near = self._lay_out(seen_vals[where], fps, vals)
        moved_to = np.full(len(seen_fps), -1, dtype=np.int64)
        moved_to[where[near]] = pos[near]
        return Resize(fps, vals, seen_fps, seen_vals, moved_to,
                      left_out=int(len(where) - near.sum()), table=table)

    def adopt(self, resize: Resize) -> bool:
        """Under the store lock: the planned table, with what changed since `seen` replayed
        (the positions that differ: an entry gone is removed from the new table, an entry
        come is inserted), becomes the index. False, and nothing changed, if it could not
        hold the entries there are by now. The hold costs a compare of the two tables and a
        few probes (a rebuild in one hold took up to 132 ms: BENCHMARKS.md, "The store
        lock's long holds")."""
        fps, vals = resize.fps, resize.vals
        if resize.table != self._table or self.count + 1 > _MAX_LOAD * len(fps):
            return False  # resized meanwhile (inline growth), or too small by now
        changed = np.flatnonzero((self._fps != resize.seen_fps) | (self._vals != resize.seen_vals))
        count = int(np.count_nonzero(resize.moved_to >= 0))
        tombstones = resize.left_out  # positions of entries too far from home (_lay_out)
        left_out = resize.left_out
        gone = changed[resize.seen_fps[changed] > _TOMBSTONE]
        placed = resize.moved_to[gone]
        fps[placed[placed >= 0]] = _TOMBSTONE
        count -= int(np.count_nonzero(placed >= 0))
        tombstones += int(np.count_nonzero(placed >= 0))
        left_out -= int(np.count_nonzero(placed < 0))
        come = self._vals[changed[self._fps[changed] > _TOMBSTONE]]
        keys = self.key_of(come)  # entries in the table now: their rows are theirs
        self._set(fps, vals)  # the new table from here (the native path rebinds to it)
        self.count, self._tombstones = count, tombstones
        for key, value in zip(keys.tolist(), come.tolist()):
            if not self._place(key, value):
                left_out += 1
        self.unindexed += left_out
        self._starved = False
        return True

    def _resize(self, capacity: int) -> None:
        """Inline (no maintainer, under the lock): nothing changes between the plan and the
        adopt, so the plan reads the table itself, not a copy."""
        self.adopt(self.plan(capacity, (self._table, self._fps, self._vals)))

    def _lay_out(self, values: np.ndarray, new_fps: np.ndarray,
                 new_vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Place entries `values` into empty arrays, all at once with numpy: sorted by home,
        each takes the first position at or after both its home and the previous entry's
        (linear probing's layout); those run past the end wrap to the first free positions
        from 0. An entry left more than MAX_PROBE from its home is not indexed; its position
        becomes a tombstone, not empty: entries placed after it (a later home, so nearer
        theirs) probe through it, and an empty position would end their run. Returns each
        entry's position and whether it is indexed there."""
        cap = len(new_fps)
        keys = self.key_of(values).astype(np.uint64)
        homes = ((keys * np.uint64(cap)) >> np.uint64(32)).astype(np.int64)
        order = np.argsort(homes, kind="stable")
        homes, keys = homes[order], keys[order]
        n = len(homes)
        ranks = np.arange(n, dtype=np.int64)
        pos = np.maximum.accumulate(homes - ranks) + ranks if n else homes
        over = pos >= cap
        if over.any():  # wrapped: the first free positions from 0, in order
            taken = np.zeros(cap, dtype=bool)
            taken[pos[~over]] = True
            free = np.flatnonzero(~taken)[: int(over.sum())]
            pos[over] = free
        near = ((pos - homes) % cap) < MAX_PROBE
        fps = (keys & np.uint64(0xFFFF)).astype(np.int64)
        fps = np.where(fps > _TOMBSTONE, fps, fps + 2)
        new_fps[pos[near]] = fps[near]
        new_vals[pos[near]] = values[order][near]
        new_fps[pos[~near]] = _TOMBSTONE  # keeps the runs through it unbroken (docstring)
        unsorted = np.empty_like(pos)
        unsorted[order] = pos
        was_near = np.empty_like(near)
        was_near[order] = near
        return unsorted, was_near
