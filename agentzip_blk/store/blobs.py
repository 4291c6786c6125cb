"""The blob table: one row per stored blob (a page, or a frame of several pages compressed
together), shared by every slot that holds one of its pages.

Columns are numpy arrays indexed by blob id (no Python object per blob). Free rows form an
intrusive list through the `arena` column, so freed ids cost nothing to remember.
`members` holds the dedup index key of each page of a blob (a row of `frame_pages` keys per
blob; a one-page blob uses the first), so the index entries of its pages can be removed with
it, and the index can be resized (dedup.DedupIndex.key_of). No full page hash is kept: the
index key finds candidates, the bytes decide (placement.Placer.lookup).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import StoreFull
from .dedup import MAX_BLOBS
from .shared import SharedTables

POOL = 0
DISK = 1

# The two speeds (docs/ARCHITECTURE.md, "Two forms"): a page the kernel writes is stored
# alone with the fast codec (WARM), so that a fault decodes one page; the recompressor
# packs warm pages nobody read for policy.cold_grace_period into frames (DENSE).
DENSE = 0
WARM = 1

_COLUMNS = {
    "arena": np.int32,  # pool arena id (or next free row while the row is free)
    "cell": np.uint32,  # cell index inside the arena
    "tier": np.uint8,  # POOL or DISK
    "disk_off": np.uint64,  # offset in the disk tier file while on DISK
    "length": np.uint16,  # stored bytes (compressed, or a whole page when raw)
    "pages": np.uint8,  # pages in the blob: 1, or a multi-page frame's count
    "codec": np.uint8,  # codec id (agentzip_blk.codec.codecs)
    "dict_id": np.uint8,  # zstd dictionary id (agentzip_blk.codec.dictionaries), 0 = none
    "ref": np.uint32,  # slots pointing at this blob; 0 = free row
    "atime": np.uint32,  # last access (read or write), in store ticks; 0 = never
    "rtime": np.uint32,  # last read, for the hot test (two reads within hot_threshold_ms)
    # bumped when the row is freed: a read that decompressed a blob outside the store lock
    # caches the copy only if the row still holds that blob (objects.Objects.adopt)
    "gen": np.uint32,
    # the stored bytes' checksum (store.integrity: low 32 bits of xxh3_64), verified by every
    # read: 4 bytes per blob, a frame of 16 pages pays it once
    "csum": np.uint32,
    "form": np.uint8,  # WARM or DENSE
}
ROW_BYTES = sum(np.dtype(t).itemsize for t in _COLUMNS.values())
GROW_AHEAD = 0.75  # the maintainer doubles the table once this share of its rows is used
# Free rows above the last live one worth giving back (`release_tail`): the warm form takes
# a row per page, the dense form one per frame, so after the recompressor most rows of a
# burst are free (~100 B each: 16 members of 4 B and the columns).
TAIL_RELEASE_ROWS = 4096

MOVE_BLOB, MOVE_ARENA, MOVE_CELL, MOVE_ON = range(4)  # BlobTable.moving

# The table's scalars, in one int64 array (`state`) rather than attributes: the native
# request path (datapath/nativeloop.c) hands out and frees rows too, through the same
# numbers. FREE_HEAD: the first free row (-1: none); NEXT_UNUSED: rows ever handed out;
# COUNT: rows in use.
FREE_HEAD, NEXT_UNUSED, COUNT = 0, 1, 2


class BlobTable:
    """Every column lives on a memfd of its own (store.shared, `blob_<column>`): a new
    server maps them after a crash. They grow in place."""

    def __init__(self, shared: SharedTables, capacity: int = 1024, frame_pages: int = 1) -> None:
        # runs when the columns are replaced (growth): the native request path reads them
        # by address (datapath.native)
        self.on_moved: Callable[[], None] = lambda: None
        self.shared = shared
        self.capacity = capacity
        self.frame_pages = frame_pages
        for name, dtype in _COLUMNS.items():
            setattr(self, name, shared.zeros(f"blob_{name}", capacity, dtype))
        self.members = shared.zeros("blob_members", capacity, np.uint32, width=frame_pages)
        self.state = shared.zeros("blob_state", 3, np.int64)
        # a row moved to another cell (compaction), for recovery to finish: MOVE_* items
        self.moving = shared.zeros("blob_move", 4, np.int64)
        self._state = memoryview(self.state)  # item access yields a Python int, fast
        self._state[FREE_HEAD] = -1

    @property
    def count(self) -> int:
        """Rows in use."""
        return self._state[COUNT]

    @count.setter
    def count(self, value: int) -> None:
        self._state[COUNT] = value

    @property
    def _free_head(self) -> int:
        return self._state[FREE_HEAD]

    @_free_head.setter
    def _free_head(self, value: int) -> None:
        self._state[FREE_HEAD] = value

    @property
    def _next_unused(self) -> int:
        return self._state[NEXT_UNUSED]

    @_next_unused.setter
    def _next_unused(self, value: int) -> None:
        self._state[NEXT_UNUSED] = value

    @property
    def used_bytes(self) -> int:
        """Bytes of the rows ever handed out: the columns are zero-filled lazily, so rows
        above that cost nothing (even when a full-table scan has read them)."""
        return self._next_unused * (ROW_BYTES + self.members.shape[1] * self.members.itemsize)

    def arrays(self) -> list[np.ndarray]:
        return [getattr(self, name) for name in _COLUMNS] + [self.members]

    def live(self) -> np.ndarray:
        """Mask over all rows of the ones in use."""
        return self.ref > 0

    def new(
        self, arena: int, cell: int, length: int, codec: int, dict_id: int = 0,
        pages: int = 1, csum: int = 0,
    ) -> int:
        """A row with refcount 1, in the pool tier."""
        if self._free_head >= 0:
            blob = self._free_head
            self._free_head = int(self.arena[blob])
        else:
            blob = self._next_unused
            if blob >= MAX_BLOBS:  # config.MAX_DEVICE_SIZE keeps a device well below this
                raise StoreFull(f"blob table full ({MAX_BLOBS} rows: the dedup index's ids)")
            if blob >= self.capacity:
                self._grow(2 * self.capacity)
            self._next_unused += 1
        self.arena[blob] = arena
        self.cell[blob] = cell
        self.length[blob] = length
        self.pages[blob] = pages
        self.codec[blob] = codec
        self.dict_id[blob] = dict_id
        self.ref[blob] = 1
        self.tier[blob] = POOL
        self.disk_off[blob] = 0
        self.atime[blob] = 0
        self.rtime[blob] = 0
        self.csum[blob] = csum
        self.form[blob] = DENSE
        self.count += 1
        return blob

    def move_cell(self, blob: int, arena: int, cell: int) -> None:
        """Point a pool row at another cell holding the same bytes (compaction). The two
        stores are announced first, so a crash between them is finished by recovery
        (store.shared) instead of leaving the row on a cell that is neither; the caller
        frees the old cell after this."""
        mv = self.moving
        mv[MOVE_BLOB], mv[MOVE_ARENA], mv[MOVE_CELL] = blob, arena, cell
        mv[MOVE_ON] = 1
        self.arena[blob], self.cell[blob] = arena, cell
        mv[MOVE_ON] = 0

    def delete(self, blob: int) -> None:
        self.ref[blob] = 0
        self.gen[blob] += 1
        self.arena[blob] = self._free_head
        self._free_head = blob
        self.count -= 1

    # -- the tail: rows handed out, then freed --------------------------------------------

    def move_down(self, rows: list[int]) -> dict[int, int]:
        """Under the store lock: the contents of `rows` moved to the lowest free rows below
        them; returns {old row: new row} for those moved. The caller re-points every
        reference (slots, dedup index, caches), then calls `relink`: until then the moved
        rows keep every column, so a crash in between leaves two whole copies of each and no
        slot on a freed row (store.recovery keeps the one the slots name)."""
        used = self._next_unused
        free = np.flatnonzero(self.ref[:used] == 0).tolist()
        moved: dict[int, int] = {}
        k = 0
        for src in sorted(rows, reverse=True):
            if k >= len(free) or free[k] >= src:
                break
            dst = free[k]
            k += 1
            for name in _COLUMNS:
                if name != "gen":  # each row keeps counting its own generations
                    column = getattr(self, name)
                    column[dst] = column[src]
            self.members[dst] = self.members[src]
            self.ref[src] = 0
            self.gen[src] += 1
            moved[src] = dst
        return moved

    def relink(self) -> None:
        """The free list rebuilt, lowest row at its head: new rows come from the bottom."""
        free = np.flatnonzero(self.ref[: self._next_unused] == 0)
        self.arena[free[:-1]] = free[1:]
        if len(free):
            self.arena[free[-1]] = -1
        self._free_head = int(free[0]) if len(free) else -1

    def release_tail(self) -> int:
        """Under the store lock, from the maintainer: relink the free rows lowest first (new
        rows come from the bottom, so the top empties), and once TAIL_RELEASE_ROWS rows
        above the last live one are free, give their pages back (every column but `gen`,
        which must keep counting: a row reused with an old generation would pass the
        checks of stale readers and the disk tier's sealing). Returns rows released."""
        used = self._next_unused
        if self.count == used:
            return 0  # no free row
        live_top = int(np.flatnonzero(self.ref[:used])[-1]) + 1 if self.count else 0
        released = used - live_top  # every row above the last live one is free
        if released >= TAIL_RELEASE_ROWS:
            for name in _COLUMNS:
                if name != "gen":
                    self.shared.punch_from(f"blob_{name}", live_top)
            self.shared.punch_from("blob_members", live_top)
            self._next_unused = live_top
        else:
            released = 0
        self.relink()
        return released

    # -- handover (store.handover) ----------------------------------------------------

    def handover_arrays(self) -> dict[str, np.ndarray]:
        """Views (valid under the store lock) of the rows ever handed out (the others are
        zeros), `gen` whole: a released tail keeps counting its generations (release_tail),
        across a handover too."""
        rows = self._next_unused
        out = {f"blob_{name}": getattr(self, name)[:rows] for name in _COLUMNS
               if name != "gen"}
        out["blob_gen"] = self.gen
        out["blob_members"] = self.members[:rows]
        out["blob_state"] = self.state
        return out

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """The rows of a table handed over (before any request)."""
        state = arrays["blob_state"]
        rows = int(state[NEXT_UNUSED])
        capacity = len(arrays["blob_gen"])
        if arrays["blob_members"].shape != (rows, self.members.shape[1]):
            raise ValueError(f"blob members {arrays['blob_members'].shape}, expected "
                             f"({rows}, {self.members.shape[1]})")
        if capacity > self.capacity:
            self._grow(capacity)
        for name, dtype in _COLUMNS.items():
            got = arrays[f"blob_{name}"]
            if got.dtype != np.dtype(dtype) or len(got) != (capacity if name == "gen" else rows):
                raise ValueError(f"blob column {name}: {got.dtype}[{len(got)}]")
            getattr(self, name)[: len(got)] = got
        self.members[:rows] = arrays["blob_members"]
        self.state[:] = state
        self.on_moved()

    # -- growth: ahead of need from the maintainer, inline only when it fell behind ------

    def wanted(self) -> int | None:
        """The capacity the maintainer should give the table now (rows handed out past
        GROW_AHEAD of it), or None."""
        if self._next_unused > GROW_AHEAD * self.capacity:
            return 2 * self.capacity
        return None

    @property
    def rows(self) -> int:
        """Rows ever handed out (the others have never been written)."""
        return self._next_unused

    def prepare(self, capacity: int, rows: int) -> dict[str, np.ndarray]:
        """The columns with room for `capacity` rows (the same memfds, larger mappings):
        the maintainer calls this without the store lock (issue 15: no allocation that can
        wait for reclaim on the swap-out path), `adopt` switches to them under it. Nothing
        is copied: the new mappings show the rows the old ones hold."""
        arrays = {name: self.shared.grow(f"blob_{name}", capacity) for name in _COLUMNS}
        arrays["members"] = self.shared.grow("blob_members", capacity)
        return arrays

    def adopt(self, arrays: dict[str, np.ndarray]) -> bool:
        """Switch to the `prepare`d columns (under the store lock); False if the table has
        grown meanwhile."""
        capacity = len(arrays["members"])
        if capacity <= self.capacity:
            return False
        for name, new in arrays.items():
            setattr(self, name, new)
        self.capacity = capacity
        self.on_moved()
        return True

    def _grow(self, capacity: int) -> None:
        """On the write path: only when the maintainer has not grown the table in time (or
        there is none: a store used in-process)."""
        self.adopt(self.prepare(capacity, self._next_unused))
