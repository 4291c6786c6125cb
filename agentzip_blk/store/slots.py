"""The slot table: one slot per 4 KiB page of the device, in preallocated numpy arrays.

Columns (8 bytes per slot, no Python object per page): `kind` (EMPTY, SAME or BLOB),
`handle` (the blob id, or for a same-filled page the id of its 64-bit word in `words`),
`sub` (the page within a multi-page blob) and `rtime` (the low 16 bits of the slot's last
read tick, for ping-pong; the blob's full tick guards it, pagestore._pingpong).

Same-filled pages (zram's trick: a page that is one 64-bit word repeated stores the word)
name their word through `SameWords`: the zero page is word 0, and a bounded table holds the
others with their slot counts, so a handle is 32 bits and not 64.

The chunk books count the slots in use per CHUNK_SLOTS slots and remember the chunks ever
written. The arrays are zero-filled lazily by the kernel: a chunk costs memory once written,
and a discard of the whole device (swapon, a sandbox's exit) must not write, or even read,
chunks never used.
"""

from __future__ import annotations

import numpy as np

from . import tables
from .shared import SWITCH_HANDLE, SWITCH_ON, SWITCH_SLOT, SWITCH_SUB, SharedTables

EMPTY = 0
SAME = 1
BLOB = 2

CHUNK_SLOTS = 512  # slot-table bookkeeping step: one swap cluster
# Chunks a scan of the table in the background (the maintainer's) reads per hold of the store
# lock: ~1 ms. The whole table in one hold took 10-57 ms at 560k pages held (density, N = 16),
# and every request in flight waited it out (BENCHMARKS.md, "The store lock's long holds").
SCAN_CHUNKS = 128
# Distinct non-zero same-fill words held at once. A page with a further word is stored as a
# blob (it compresses to a few bytes): a tenant filling pages with distinct words cannot grow
# the table, and real heaps hold few such words.
MAX_WORDS = 4096
TICK_MASK = 0xFFFF  # `rtime` keeps this much of a tick (10 ms ticks: 655 s)


class SameWords:
    """The 64-bit words of same-filled slots: id 0 is the zero word (always there), ids
    1..MAX_WORDS-1 are held while some slot uses them (`refs`)."""

    def __init__(self, shared: SharedTables) -> None:
        # the words are what a crash must not lose (store.shared): all MAX_WORDS of them at
        # once, 32 KiB, so the column never moves; the counts are rebuilt from the slots
        self.words = shared.zeros("words", MAX_WORDS, np.uint64)
        self.refs = np.zeros(MAX_WORDS, dtype=np.uint32)
        self._ids: dict[int, int] = {}
        self._free: list[int] = []
        self._next = 1

    def nbytes(self) -> int:
        return self.words.nbytes + self.refs.nbytes + 100 * len(self._ids)  # ~a dict entry

    def refused(self, words: np.ndarray) -> np.ndarray:
        """Mask over `words` (same-fill words of one request) of those that would not get an
        id: the new words beyond the room left (rare: those pages are stored as blobs)."""
        refused = np.zeros(len(words), dtype=bool)
        room = len(self._free) + MAX_WORDS - self._next
        admitted: set[int] = set()
        for n, word in enumerate(words.tolist()):
            if word == 0 or word in self._ids or word in admitted:
                continue
            if len(admitted) < room:
                admitted.add(word)
            else:
                refused[n] = True
        return refused

    def take(self, words: np.ndarray) -> np.ndarray:
        """The ids of `words`, one more slot each (room checked by `refused`)."""
        ids = np.zeros(len(words), dtype=np.uint32)
        for n in np.flatnonzero(words).tolist():
            word = int(words[n])
            wid = self._ids.get(word)
            if wid is None:
                wid = self._free.pop() if self._free else self._alloc()
                self._ids[word] = wid
                self.words[wid] = word
            self.refs[wid] += 1
            ids[n] = wid
        return ids

    def _alloc(self) -> int:
        wid = self._next
        if wid >= MAX_WORDS:
            raise AssertionError("same-fill word table full (refused() not asked)")
        self._next += 1
        return wid

    def drop(self, ids: np.ndarray) -> None:
        """One slot fewer for each of `ids`; a word no slot uses any more goes."""
        for wid in ids[ids != 0].tolist():
            self.refs[wid] -= 1
            if not self.refs[wid]:
                del self._ids[int(self.words[wid])]
                self.words[wid] = 0
                self._free.append(wid)

    def handover_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Scalars and arrays for a handover (store.handover); the word -> id dict is
        rebuilt from the arrays."""
        return ({"next": self._next},
                {"words": self.words.copy(), "word_refs": self.refs.copy(),
                 "word_free": np.array(self._free, dtype=np.int64)})

    def restore(self, scalars: dict, arrays: dict[str, np.ndarray]) -> None:
        words, refs = arrays["words"], arrays["word_refs"]
        if len(words) != len(refs) or len(words) > MAX_WORDS:
            raise ValueError("same-fill words and counts disagree")
        self.words[:] = 0
        self.refs[:] = 0
        self.words[: len(words)] = words
        self.refs[: len(refs)] = refs
        self._free = [int(w) for w in arrays["word_free"].tolist()]
        self._next = int(scalars["next"])
        self._index()

    def recount(self, ids: np.ndarray) -> int:
        """After a crash (store.recovery): the counts from `ids`, the word ids of every
        same-filled slot (the words column is as the dead server left it). A word that no
        slot uses is cleared; returns the number of words kept."""
        self.refs[:] = np.bincount(ids.astype(np.int64), minlength=MAX_WORDS)[:MAX_WORDS]
        self.refs[0] = 0
        self.words[self.refs == 0] = 0
        held = np.flatnonzero(self.refs)
        self._next = int(held[-1]) + 1 if len(held) else 1
        self._free = [w for w in range(1, self._next) if not self.refs[w]]
        self._index()
        return len(held)

    def _index(self) -> None:
        held = (np.flatnonzero(self.refs[1:]) + 1).tolist()
        self._ids = {int(self.words[w]): w for w in held}

    def page(self, wid: int, page_size: int) -> bytes:
        return self.words[wid : wid + 1].tobytes() * (page_size // 8)

    def check(self, ids: np.ndarray) -> None:
        """`ids`: the handles of every same-filled slot."""
        counts = np.bincount(ids.astype(np.int64), minlength=len(self.refs))
        assert np.array_equal(counts[1:], self.refs[1:].astype(np.int64)), "word counts disagree"
        assert len(self._ids) == int(np.count_nonzero(self.refs[1:]))
        assert all(int(self.words[w]) == word for word, w in self._ids.items())


class SlotTable:
    def __init__(self, nslots: int, shared: SharedTables) -> None:
        self.nslots = nslots
        # what a page is: in memory that outlives the process (store.shared)
        self.kind = shared.zeros("slot_kind", nslots, np.uint8)
        self.handle = shared.zeros("slot_handle", nslots, np.uint32)  # blob or word id
        self.sub = shared.zeros("slot_sub", nslots, np.uint8)  # page within a multi-page blob
        self.rtime = tables.zeros(nslots, np.uint16)  # last read (low bits), for ping-pong
        self.words = SameWords(shared)
        # the slot being switched outside a request, for recovery to finish (store.shared)
        self.switching = shared.zeros("slot_switch", 4, np.int64)
        self.slot_bytes = sum(a.itemsize for a in (self.kind, self.handle, self.sub, self.rtime))
        nchunks = -(-nslots // CHUNK_SLOTS)
        self.chunk_live = np.zeros(nchunks, dtype=np.int32)  # slots in use per chunk
        self.chunk_touched = np.zeros(nchunks, dtype=bool)  # chunks ever written
        # chunks written since the last `forget` round cleared them (PageStore.forget_freed:
        # a copy the kernel's swap map calls free is forgotten only if its chunk saw no write
        # since before the map was read)
        self.chunk_written = np.zeros(nchunks, dtype=np.uint8)
        # same-filled slots, in an array the native request path counts in too
        self.state = np.zeros(1, dtype=np.int64)
        self._state = memoryview(self.state)

    @property
    def same_pages(self) -> int:
        return self._state[0]

    @same_pages.setter
    def same_pages(self, value: int) -> None:
        self._state[0] = value

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
        same = self.kind[first:end] == SAME
        if same.any():
            self.same_pages -= int(np.count_nonzero(same))
            self.words.drop(self.handle[first:end][same])
        self.kind[first:end] = EMPTY
        self.handle[first:end] = 0
        self.sub[first:end] = 0
        self.rtime[first:end] = 0

    def fill(self, first: int, kind: np.ndarray, handle: np.ndarray, sub: np.ndarray) -> None:
        """Set empty slots [first, first+len(kind)) and bring the chunk books up to date.
        `handle`: blob ids, and for SAME slots their 64-bit words (SameWords.refused has
        been asked)."""
        end = first + len(kind)
        same = kind == SAME
        ids = handle.astype(np.uint32)
        if same.any():
            ids[same] = self.words.take(handle[same])
        self.kind[first:end] = kind
        self.handle[first:end] = ids
        self.sub[first:end] = sub
        self.same_pages += int(np.count_nonzero(kind == SAME))
        c0, c1 = self.chunks(first, len(kind))
        self.chunk_touched[c0:c1] = True
        self.chunk_written[c0:c1] = 1
        for chunk in range(c0, c1):
            self.recount(chunk)

    def switch(self, slot: int, handle: int, sub: int) -> None:
        """Point a BLOB slot at another page (`handle`, `sub`) outside a request (the
        recompressor, a frame split): the two stores are announced first, so a crash
        between them is finished by recovery instead of leaving the slot on a wrong page.
        A request's own switches need no announcement: the kernel sends an unanswered
        request again (FUSE_NOTIFY_RESEND)."""
        sw = self.switching
        sw[SWITCH_SLOT], sw[SWITCH_HANDLE], sw[SWITCH_SUB] = slot, handle, sub
        sw[SWITCH_ON] = 1
        self.handle[slot], self.sub[slot] = handle, sub
        sw[SWITCH_ON] = 0

    def ids_of(self, chunks: np.ndarray) -> np.ndarray:
        """Every slot id of ``chunks``, chunk after chunk (the last one cut at nslots)."""
        if not len(chunks):
            return np.zeros(0, dtype=np.int64)
        idx = (chunks[:, None] * CHUNK_SLOTS + np.arange(CHUNK_SLOTS)).ravel()
        return idx[idx < self.nslots]

    def used(self) -> np.ndarray:
        """Indices of the non-empty slots, reading only chunks in use."""
        idx = self.ids_of(np.flatnonzero(self.chunk_live))
        return idx[self.kind[idx] != EMPTY]

    def touched(self) -> np.ndarray:
        """Every slot id of the chunks ever written. The rest is never read: the columns are
        memfds (they outlive the process), and a read of shmem never written allocates a
        page, where a private mapping would have mapped the zero page."""
        return self.ids_of(np.flatnonzero(self.chunk_touched))

    def blob_slots(self) -> np.ndarray:
        used = self.used()
        return used[self.kind[used] == BLOB]

    def touched_bytes(self) -> int:
        """Memory of the chunks ever written (the rest is never read: `touched`)."""
        return int(self.chunk_touched.sum()) * CHUNK_SLOTS * self.slot_bytes + self.words.nbytes()

    def check(self) -> None:
        """Cross-check the chunk books and the same-filled count over the chunks ever
        written (`touched`); raises AssertionError."""
        idx = self.touched()
        kind = self.kind[idx]
        assert self.same_pages == int(np.count_nonzero(kind == SAME))
        self.words.check(self.handle[idx[kind == SAME]])
        assert not (self.chunk_live > 0)[~self.chunk_touched].any()
        if len(idx):
            per_chunk = np.add.reduceat((kind != EMPTY).astype(np.int32),
                                        np.arange(0, len(idx), CHUNK_SLOTS))
            assert np.array_equal(per_chunk, self.chunk_live[self.chunk_touched]), \
                "chunk counts disagree"
