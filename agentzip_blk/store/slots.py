"""The slot table: one slot per 4 KiB page of the device, in preallocated numpy arrays.

Columns (14 bytes per slot, no Python object per page): `kind` (EMPTY, SAME or BLOB),
`handle` (the blob id, or the repeated 64-bit word of a same-filled page: zram's trick),
`sub` (the page within a multi-page blob) and `rtime` (the slot's last read, for ping-pong).

The chunk books count the slots in use per CHUNK_SLOTS slots and remember the chunks ever
written. The arrays are zero-filled lazily by the kernel: a chunk costs memory once written,
and a discard of the whole device (swapon, a sandbox's exit) must not write, or even read,
chunks never used.
"""

from __future__ import annotations

import numpy as np

from . import tables

EMPTY = 0
SAME = 1
BLOB = 2

CHUNK_SLOTS = 512  # slot-table bookkeeping step: one page of `handle`, one swap cluster


class SlotTable:
    def __init__(self, nslots: int) -> None:
        self.nslots = nslots
        self.kind = tables.zeros(nslots, np.uint8)
        self.handle = tables.zeros(nslots, np.uint64)
        self.sub = tables.zeros(nslots, np.uint8)  # page within a multi-page blob
        self.rtime = tables.zeros(nslots, np.uint32)  # last read, for ping-pong
        self.slot_bytes = sum(a.itemsize for a in (self.kind, self.handle, self.sub, self.rtime))
        nchunks = -(-nslots // CHUNK_SLOTS)
        self.chunk_live = np.zeros(nchunks, dtype=np.int32)  # slots in use per chunk
        self.chunk_touched = np.zeros(nchunks, dtype=bool)  # chunks ever written
        self.same_pages = 0

    @staticmethod
    def chunks(first: int, count: int) -> tuple[int, int]:
        """The chunk range [c0, c1) covering slots [first, first+count)."""
        return first // CHUNK_SLOTS, -(-(first + count) // CHUNK_SLOTS)

    def recount(self, chunk: int) -> None:
        self.chunk_live[chunk] = np.count_nonzero(
            self.kind[chunk * CHUNK_SLOTS : (chunk + 1) * CHUNK_SLOTS])

    def runs_in_use(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """(chunk, first slot, count) of the parts of [first, first+count) in chunks that
        hold something: the only ones a release has to visit."""
        c0, c1 = self.chunks(first, count)
        runs = []
        for chunk in (c0 + np.flatnonzero(self.chunk_live[c0:c1])).tolist():
            lo = max(first, chunk * CHUNK_SLOTS)
            hi = min(first + count, (chunk + 1) * CHUNK_SLOTS)
            runs.append((chunk, lo, hi - lo))
        return runs

    def clear(self, first: int, count: int) -> None:
        """Empty the slots (their blobs are released by the caller)."""
        end = first + count
        self.same_pages -= int(np.count_nonzero(self.kind[first:end] == SAME))
        self.kind[first:end] = EMPTY
        self.handle[first:end] = 0
        self.sub[first:end] = 0
        self.rtime[first:end] = 0

    def fill(self, first: int, kind: np.ndarray, handle: np.ndarray, sub: np.ndarray) -> None:
        """Set empty slots [first, first+len(kind)) and bring the chunk books up to date."""
        end = first + len(kind)
        self.kind[first:end] = kind
        self.handle[first:end] = handle
        self.sub[first:end] = sub
        self.same_pages += int(np.count_nonzero(kind == SAME))
        c0, c1 = self.chunks(first, len(kind))
        self.chunk_touched[c0:c1] = True
        for chunk in range(c0, c1):
            self.recount(chunk)

    def used(self) -> np.ndarray:
        """Indices of the non-empty slots, reading only chunks in use."""
        chunks = np.flatnonzero(self.chunk_live)
        if not len(chunks):
            return np.zeros(0, dtype=np.int64)
        idx = (chunks[:, None] * CHUNK_SLOTS + np.arange(CHUNK_SLOTS)).ravel()
        idx = idx[idx < self.nslots]
        return idx[self.kind[idx] != EMPTY]

    def blob_slots(self) -> np.ndarray:
        used = self.used()
        return used[self.kind[used] == BLOB]

    def touched_bytes(self) -> int:
        """Memory of the chunks ever written, not mincore: reading a never-written part of
        these tables maps the kernel's zero page, which mincore reports but costs nothing."""
        return int(self.chunk_touched.sum()) * CHUNK_SLOTS * self.slot_bytes

    def check(self) -> None:
        """Cross-check the chunk books and the same-filled count; raises AssertionError."""
        assert self.same_pages == int(np.count_nonzero(self.kind == SAME))
        per_chunk = np.add.reduceat((self.kind != EMPTY).astype(np.int32),
                                    np.arange(0, self.nslots, CHUNK_SLOTS))
        assert np.array_equal(per_chunk, self.chunk_live), "chunk counts disagree"
        assert not (self.chunk_live > 0)[~self.chunk_touched].any()
