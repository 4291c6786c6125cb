"""A zsmalloc-like pool: size classes, cells carved from fixed-size arenas of one memfd.

Each size class (32-byte steps up to 3072 bytes, plus whole pages for raw blobs, plus
coarser classes for multi-page frames when the store makes them) owns
arenas of one fixed size, chosen per class so that cells tile the arena with little tail
waste. A cell is addressed by (arena id, cell index). Free cells of an arena form an
intrusive list threaded through the free cells themselves (the first 4 bytes hold the
next free index), so free space costs no metadata. An arena whose last cell is freed is
unmapped and its range hole-punched at once: memory goes back to the kernel, which is the
point of the exercise.

The memory outlives the process (issue 28: a restart without swapoff): every arena is a
MAP_SHARED mapping of ONE sparse memfd the pool owns (no path in any filesystem), arena id
`a` at offset `a * span`, `span` being the largest arena of the pool's classes. A new server
handed that descriptor (store.handover) maps the arenas where they are, without a copy. The
file is sized to `span` times the per-arena arrays' capacity and sealed against shrinking
(a shrink under a mapping would be a SIGBUS); a hole costs nothing, so the size does not
matter. A shared mapping's munmap frees nothing: `unmap_arena` punches the range too.

Every book is in numpy arrays indexed by arena id, and the pool's totals in one int64 array
(`state`); an arena is known by its address alone (mmap(2) and munmap(2) through libc, no
Python object per arena). The arenas of a class with a free cell form a list threaded
through two of those arrays (`_a_next`, `_a_prev`, from `class_head`), newest first, and
free arena ids a list through `_a_next`. So the native request path (datapath/nativestore.c)
allocates and frees cells, and maps and unmaps arenas, through the very same books; the
only thing it leaves to Python is growing the per-arena arrays (the maintainer does that
ahead of need: `wanted`).
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import mman
from ..codec.codecs import MAX_COMPRESSED  # above this a page is stored raw

PAGE = 4096
CLASS_STEP = 32
_MIN_ARENA_PAGES = 4
_MAX_ARENA_PAGES = 16
_NO_CLASS = -1  # the class of an arena id not in use
_NO_CELL = 0xFFFFFFFF
_NO_ARENA = -1
# _a_flags bits
PARTIAL = 1  # in its class's list of arenas with a free cell
EVACUATING = 2  # being emptied by compaction: no new cells
# `state` items: ALLOCATED arenas as mapped (what the cap limits); RESIDENT pages of arenas
# ever touched (cells are handed out from the start of an arena, and an anonymous mapping
# costs memory only where it was written, so a fresh arena holding one cell costs that
# cell's pages: what the server's RSS pays for the pool); LIVE_BYTES cell sizes in use;
# LIVE_CELLS; ARENAS mapped; IDS arena ids ever used; FREE_ID the first free arena id (-1:
# none; the rest chained through _a_next); MAX_SIZE the cap; MEMFD the arenas' memfd and SPAN
# the bytes per arena id in it (read by nativestore.c, which maps arenas too).
ALLOCATED, RESIDENT, LIVE_BYTES, LIVE_CELLS, ARENAS, IDS, FREE_ID, MAX_SIZE, MEMFD, SPAN = range(10)
STATE_ITEMS = 10
LARGE_CLASS_GROWTH = 32  # classes above MAX_COMPRESSED grow by 1/32
GROW_AHEAD = 0.75  # the maintainer doubles the per-arena arrays once this share is used

MEMFD_NAME = "agentzip-pool"


def make_memfd(size: int) -> int:
    """The pool's sparse memfd of `size` bytes, sealed against shrinking (a mapped arena
    past a shrunk end would SIGBUS), close-on-exec (it is handed over explicitly)."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_arena(fd: int, offset: int, size: int) -> int:
    """The arena at `offset` of the pool's memfd, shared (zero-filled where never written,
    no memory until written), kept out of core dumps: it holds tenants' pages in the clear
    (docs/SECURITY.md). nativestore.c maps the same way. Raises PoolFull when the kernel
    refuses."""
    addr = mman.libc.mmap(None, size, mman.PROT_RW, mman.MAP_SHARED, fd, offset)
    if addr is None or addr == mman.MAP_FAILED:
        err = ctypes.get_errno()
        raise PoolFull(f"mmap of a {size}-byte arena: {os.strerror(err)}")
    mman.libc.madvise(addr, size, mman.MADV_DONTDUMP)
    return addr


def unmap_arena(fd: int, offset: int, addr: int, size: int) -> None:
    """Unmap an arena and free its memory: the munmap of a shared mapping frees nothing,
    the memfd keeps the pages until their range is punched."""
    mman.libc.munmap(addr, size)
    mman.libc.fallocate(fd, mman.FALLOC_FL_PUNCH_HOLE | mman.FALLOC_FL_KEEP_SIZE, offset, size)


def _close_box(box: list[int]) -> None:
    if box[0] >= 0:
        os.close(box[0])
        box[0] = -1


class PoolFull(Exception):
    """Allocating one more arena would take the pool past its cap."""


def _class_sizes(page_size: int, max_blob: int) -> list[int]:
    """32-byte classes up to MAX_COMPRESSED, then a whole page (raw pages); with multi-page
    frames (`max_blob` > a page) also classes up to `max_blob`, each ~1/32 above the last:
    at most ~3% rounding on a frame, and few enough classes that their partly filled
    arenas stay small."""
    sizes = list(range(CLASS_STEP, MAX_COMPRESSED + 1, CLASS_STEP))
    if max_blob <= page_size:
        return sizes + [page_size]
    large = {page_size}
    size = MAX_COMPRESSED
    while size < max_blob:
        size = min(max_blob, -(-(size + size // LARGE_CLASS_GROWTH) // CLASS_STEP) * CLASS_STEP)
        large.add(size)
    return sizes + sorted(large)


def _arena_size(cell_size: int) -> int:
    """The arena size whose tail waste is the smallest fraction: 4-16 pages, or for cells
    above a page 2-8 cells' worth (every arena holds at least two cells, and larger arenas
    keep the number of mappings well below vm.max_map_count)."""
    lo, hi = _MIN_ARENA_PAGES, _MAX_ARENA_PAGES
    if cell_size > PAGE:
        lo, hi = -(-2 * cell_size // PAGE), max(_MAX_ARENA_PAGES, 8 * cell_size // PAGE)
    best = (1.0, 0)
    for pages in range(lo, hi + 1):
        size = pages * PAGE
        waste = (size % cell_size) / size
        if waste < best[0] - 1e-9:
            best = (waste, size)
    return best[1]


@dataclass(frozen=True)
class SizeClass:
    index: int
    cell_size: int
    arena_size: int
    cells_per_arena: int


class Pool:
    def __init__(self, max_size: int, page_size: int = PAGE, max_blob: int = PAGE,
                 memfd: int | None = None) -> None:
        """`memfd`: the arenas' memfd of a pool handed over (store.handover, which restores
        the books and maps the arenas: `adopt`); None: a new, empty one."""
        self.page_size = page_size
        self.max_blob = max(max_blob, page_size)
        self.classes: list[SizeClass] = []
        for i, size in enumerate(_class_sizes(page_size, self.max_blob)):
            arena = _arena_size(size)
            self.classes.append(SizeClass(i, size, arena, arena // size))
        self._large_sizes = [c.cell_size for c in self.classes if c.cell_size > MAX_COMPRESSED]
        self._first_large = len(self.classes) - len(self._large_sizes)
        cap = 64
        self._a_class = np.full(cap, _NO_CLASS, dtype=np.int16)  # _NO_CLASS: no arena
        self._a_used = np.zeros(cap, dtype=np.int32)
        self._a_free_head = np.zeros(cap, dtype=np.uint32)  # intrusive free list head
        self._a_bump = np.zeros(cap, dtype=np.uint32)  # cells never handed out start here
        # the class's list of arenas with room; for an id not in use, the next free id
        self._a_next = np.full(cap, _NO_ARENA, dtype=np.int32)
        self._a_prev = np.full(cap, _NO_ARENA, dtype=np.int32)
        self._a_flags = np.zeros(cap, dtype=np.uint8)  # PARTIAL, EVACUATING
        self.arena_addr = np.zeros(cap, dtype=np.uint64)  # 0: no arena
        # `on_moved` runs when the per-arena arrays are replaced (the native path reads
        # them by address)
        self.on_moved: Callable[[], None] = lambda: None
        self.class_cell = np.array([c.cell_size for c in self.classes], dtype=np.uint32)
        self.class_cells = np.array([c.cells_per_arena for c in self.classes], dtype=np.uint32)
        self.class_arena = np.array([c.arena_size for c in self.classes], dtype=np.uint32)
        # per class: the newest arena with a free cell (allocation takes it: LIFO, cache-warm)
        self.class_head = np.full(len(self.classes), _NO_ARENA, dtype=np.int32)
        self.state = np.zeros(STATE_ITEMS, dtype=np.int64)
        self._state = memoryview(self.state)
        self._state[FREE_ID] = _NO_ARENA
        self._state[MAX_SIZE] = max_size
        # every arena id has `span` bytes of the memfd, whatever its class
        span = max(c.arena_size for c in self.classes)
        self._state[SPAN] = -(-span // page_size) * page_size
        self._state[MEMFD] = make_memfd(self.span * cap) if memfd is None else memfd
        # A pool dropped without `release` (a store never closed: tests) closes its memfd
        # when collected; the box lets `release` say it is closed already (the number may
        # have been reused by then). A memfd handed in is the caller's until `adopt` (a
        # store that fails to build leaves it to the caller to close).
        self._fd_box = [self.memfd if memfd is None else -1]
        weakref.finalize(self, _close_box, self._fd_box)

    @property
    def memfd(self) -> int:
        """The descriptor of the memfd every arena maps (-1 once `release`d)."""
        return self._state[MEMFD]

    @property
    def span(self) -> int:
        """Bytes of the memfd per arena id: arena `a` is at `a * span`."""
        return self._state[SPAN]

    @property
    def max_size(self) -> int:
        return self._state[MAX_SIZE]

    @max_size.setter
    def max_size(self, value: int) -> None:
        self._state[MAX_SIZE] = value

    @property
    def allocated_bytes(self) -> int:
        return self._state[ALLOCATED]

    @property
    def resident_bytes(self) -> int:
        return self._state[RESIDENT]

    @property
    def live_bytes(self) -> int:
        return self._state[LIVE_BYTES]

    @property
    def live_cells(self) -> int:
        return self._state[LIVE_CELLS]

    @property
    def arena_count(self) -> int:
        return self._state[ARENAS]

    def fragmentation(self) -> float:
        """The share of arena bytes that holds no live cell (0 with no arena)."""
        allocated = self.allocated_bytes
        return 1 - self.live_bytes / allocated if allocated else 0.0

    def _add(self, item: int, delta: int) -> None:
        self._state[item] += delta

    # -- classes ---------------------------------------------------------------------

    def class_for(self, length: int) -> SizeClass:
        if length <= 0 or length > self.max_blob:
            raise ValueError(f"blob length {length} outside 1..{self.max_blob}")
        if length > MAX_COMPRESSED:
            return self.classes[self._first_large + bisect.bisect_left(self._large_sizes, length)]
        return self.classes[(length - 1) // CLASS_STEP]

    # -- the lists of arenas with a free cell ------------------------------------------

    def _partial_add(self, arena_id: int) -> None:
        """At the head of its class's list, unless it is there already (then it keeps its
        place)."""
        if self._a_flags[arena_id] & PARTIAL:
            return
        c = int(self._a_class[arena_id])
        head = int(self.class_head[c])
        self._a_next[arena_id] = head
        self._a_prev[arena_id] = _NO_ARENA
        if head != _NO_ARENA:
            self._a_prev[head] = arena_id
        self.class_head[c] = arena_id
        self._a_flags[arena_id] |= PARTIAL

    def _partial_remove(self, arena_id: int) -> None:
        if not self._a_flags[arena_id] & PARTIAL:
            return
        prev, nxt = int(self._a_prev[arena_id]), int(self._a_next[arena_id])
        if prev != _NO_ARENA:
            self._a_next[prev] = nxt
        else:
            self.class_head[int(self._a_class[arena_id])] = nxt
        if nxt != _NO_ARENA:
            self._a_prev[nxt] = prev
        self._a_flags[arena_id] &= ~np.uint8(PARTIAL)

    # -- allocation ------------------------------------------------------------------

    def alloc(self, length: int) -> tuple[int, int]:
        """A free cell that can hold `length` bytes, as (arena id, cell index)."""
        cls = self.class_for(length)
        arena_id = int(self.class_head[cls.index])
        if arena_id == _NO_ARENA:
            arena_id = self._new_arena(cls)
        head = int(self._a_free_head[arena_id])
        if head != _NO_CELL:
            cell = head
            self._a_free_head[arena_id] = self._next_free(arena_id, cls, cell)
        else:
            cell = int(self._a_bump[arena_id])
            self._a_bump[arena_id] = cell + 1
            self._add(RESIDENT, self._touched(cls, cell + 1) - self._touched(cls, cell))
        used = int(self._a_used[arena_id]) + 1
        self._a_used[arena_id] = used
        if used == cls.cells_per_arena:
            self._partial_remove(arena_id)
        self._add(LIVE_BYTES, cls.cell_size)
        self._add(LIVE_CELLS, 1)
        return arena_id, cell

    def free(self, arena_id: int, cell: int) -> None:
        used = int(self._a_used[arena_id])
        if used <= 0 or not self.arena_addr[arena_id]:
            raise RuntimeError(f"double free of arena {arena_id} cell {cell}")
        cls = self.classes[int(self._a_class[arena_id])]
        self._add(LIVE_BYTES, -cls.cell_size)
        self._add(LIVE_CELLS, -1)
        if used == 1:
            self._release_arena(arena_id, cls)
            return
        self._set_next_free(arena_id, cls, cell, int(self._a_free_head[arena_id]))
        self._a_free_head[arena_id] = cell
        self._a_used[arena_id] = used - 1
        if used == cls.cells_per_arena and not self._a_flags[arena_id] & EVACUATING:
            self._partial_add(arena_id)

    def _cell_addr(self, arena_id: int, cls: SizeClass, cell: int) -> int:
        return int(self.arena_addr[arena_id]) + cell * cls.cell_size

    def _next_free(self, arena_id: int, cls: SizeClass, cell: int) -> int:
        return int.from_bytes(ctypes.string_at(self._cell_addr(arena_id, cls, cell), 4), "little")

    def _set_next_free(self, arena_id: int, cls: SizeClass, cell: int, nxt: int) -> None:
        ctypes.memmove(self._cell_addr(arena_id, cls, cell), nxt.to_bytes(4, "little"), 4)

    def _new_arena(self, cls: SizeClass) -> int:
        """Map an arena for `cls`, at the head of its list."""
        if self.allocated_bytes + cls.arena_size > self.max_size:
            raise PoolFull(
                f"pool at {self.allocated_bytes} of {self.max_size} bytes, "
                f"no room for a {cls.arena_size}-byte arena"
            )
        arena_id = self._state[FREE_ID]
        if arena_id == _NO_ARENA and self._state[IDS] >= len(self._a_class):
            self._grow(self._state[IDS] + 1)
        fresh = arena_id == _NO_ARENA
        if fresh:
            arena_id = self._state[IDS]
        addr = map_arena(self.memfd, arena_id * self.span, cls.arena_size)
        if fresh:
            self._state[IDS] = arena_id + 1
        else:
            self._state[FREE_ID] = int(self._a_next[arena_id])
        self._a_class[arena_id] = cls.index
        self.arena_addr[arena_id] = addr
        self._a_used[arena_id] = 0
        self._a_free_head[arena_id] = _NO_CELL
        self._a_bump[arena_id] = 0
        self._a_flags[arena_id] = 0
        self._add(ALLOCATED, cls.arena_size)
        self._add(ARENAS, 1)
        self._partial_add(arena_id)
        return arena_id

    def _release_arena(self, arena_id: int, cls: SizeClass) -> None:
        self._partial_remove(arena_id)
        unmap_arena(self.memfd, arena_id * self.span, int(self.arena_addr[arena_id]),
                    cls.arena_size)
        self.arena_addr[arena_id] = 0
        self._a_used[arena_id] = 0
        self._a_class[arena_id] = _NO_CLASS
        self._a_flags[arena_id] = 0
        self._a_next[arena_id] = self._state[FREE_ID]
        self._state[FREE_ID] = arena_id
        self._add(ALLOCATED, -cls.arena_size)
        self._add(RESIDENT, -self._touched(cls, int(self._a_bump[arena_id])))
        self._add(ARENAS, -1)

    def _touched(self, cls: SizeClass, cells: int) -> int:
        """Bytes of whole pages covering an arena's first `cells` cells."""
        return -(-cells * cls.cell_size // self.page_size) * self.page_size

    # -- growth of the per-arena arrays: ahead of need, from the maintainer ---------------

    def wanted(self) -> int | None:
        """The capacity the maintainer should give the per-arena arrays now (arena ids
        handed out past GROW_AHEAD of them), or None: the native path cannot grow them."""
        if self._state[IDS] > GROW_AHEAD * len(self._a_class):
            return 2 * len(self._a_class)
        return None

    def grow(self, capacity: int) -> None:
        """Under the store lock (the arrays are small: 30 bytes an arena)."""
        if capacity > len(self._a_class):
            self._grow(capacity)

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * len(self._a_class))
        # the memfd first: the native path maps ids below the arrays' length (sparse: free)
        if os.fstat(self.memfd).st_size < cap * self.span:
            os.ftruncate(self.memfd, cap * self.span)
        fill = {"_a_class": _NO_CLASS, "_a_next": _NO_ARENA, "_a_prev": _NO_ARENA}
        for name in ("_a_class", "_a_used", "_a_free_head", "_a_bump", "_a_next", "_a_prev",
                     "_a_flags", "arena_addr"):
            old = getattr(self, name)
            new = np.full(cap, fill.get(name, 0), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self.on_moved()

    # -- compaction ------------------------------------------------------------------

    def _live_ids(self) -> np.ndarray:
        return np.flatnonzero(self.arena_addr[: self._state[IDS]])

    def evacuation_plan(self) -> list[int]:
        """The sparsest arenas of each class whose cells fit into the free cells of the
        rest of their class (a class of one arena keeps it), all classes in one pass."""
        ids = np.flatnonzero(self._a_class[: self._state[IDS]] != _NO_CLASS)
        if len(ids) < 2:
            return []
        cls = self._a_class[ids].astype(np.int64)
        used = self._a_used[ids].astype(np.int64)
        order = np.lexsort((-used, cls))  # by class, the fullest first within one
        ids, cls, used = ids[order], cls[order], used[order]
        starts = np.flatnonzero(np.r_[True, cls[1:] != cls[:-1]])
        counts = np.diff(np.r_[starts, len(ids)])
        per_arena = self.class_cells[cls[starts]].astype(np.int64)
        needed = -(-np.add.reduceat(used, starts) // per_arena)
        rank = np.arange(len(ids)) - np.repeat(starts, counts)
        go = (rank >= np.repeat(needed, counts)) & (np.repeat(counts, counts) >= 2)
        return ids[go].tolist()

    def evacuate(self, arena_ids: list[int]) -> None:
        """Stop allocating from these arenas; they are released when their last cell moves out."""
        for arena_id in arena_ids:
            self._partial_remove(arena_id)
            self._a_flags[arena_id] |= EVACUATING

    def still_evacuating(self, arena_ids: list[int]) -> list[int]:
        """Those of `arena_ids` still being emptied: one released meanwhile may have been
        made again, under the same id, for new cells."""
        return [a for a in arena_ids if self._a_flags[a] & EVACUATING]

    def end_evacuation(self) -> None:
        """Arenas that still hold cells (an interrupted compaction) become allocatable again."""
        n = self._state[IDS]
        for arena_id in np.flatnonzero(self._a_flags[:n] & EVACUATING).tolist():
            self._a_flags[arena_id] &= ~np.uint8(EVACUATING)
            cls = self.classes[int(self._a_class[arena_id])]
            if self.arena_addr[arena_id] and self._a_used[arena_id] < cls.cells_per_arena:
                self._partial_add(arena_id)

    def arena_size_of(self, length: int) -> int:
        return self.class_for(length).arena_size

    # -- data ------------------------------------------------------------------------

    def put(self, arena_id: int, cell: int, data) -> None:
        cls = self.classes[int(self._a_class[arena_id])]
        if not isinstance(data, bytes):
            data = bytes(data)
        ctypes.memmove(self._cell_addr(arena_id, cls, cell), data, len(data))

    def get(self, arena_id: int, cell: int, length: int) -> bytes:
        cls = self.classes[int(self._a_class[arena_id])]
        return ctypes.string_at(self._cell_addr(arena_id, cls, cell), length)

    # -- handover (store.handover): the books out, the arenas mapped again ---------------

    _BOOKS = ("_a_class", "_a_used", "_a_free_head", "_a_bump", "_a_next", "_a_prev",
              "_a_flags", "class_head", "state")

    def books(self) -> dict[str, np.ndarray]:
        """Copies of every book but the arenas' addresses (which are this process's): what
        a pool handed over needs besides its memfd. Under the store lock."""
        return {name.lstrip("_"): getattr(self, name).copy() for name in self._BOOKS}

    def adopt(self, books: dict[str, np.ndarray]) -> None:
        """Take the `books` of the pool whose memfd this one was built on, and map each of
        its arenas at its place in the memfd (no copy). Before any request."""
        for name in self._BOOKS:
            got = books[name.lstrip("_")]
            mine = getattr(self, name)
            if got.dtype != mine.dtype or (name in ("class_head", "state")
                                           and got.shape != mine.shape):
                raise ValueError(f"pool book {name}: {got.dtype}{got.shape}, "
                                 f"expected {mine.dtype}{mine.shape}")
        if len({len(books[name.lstrip("_")]) for name in self._BOOKS[:7]}) != 1:
            raise ValueError("the pool's per-arena books differ in length")
        memfd, span = self.memfd, self.span
        state = books["state"]
        if int(state[SPAN]) != span:
            raise ValueError(f"pool span {int(state[SPAN])}, expected {span}")
        cap = len(books["a_class"])
        if os.fstat(memfd).st_size < cap * span:
            raise ValueError("the pool's memfd is shorter than its arena books")
        for name in self._BOOKS:
            setattr(self, name, books[name.lstrip("_")].copy())
        self._state = memoryview(self.state)
        self._state[MEMFD] = memfd
        self._fd_box[0] = memfd  # ours from now on
        self.arena_addr = np.zeros(cap, dtype=np.uint64)
        for arena_id in np.flatnonzero(self._a_class >= 0).tolist():
            size = self.classes[int(self._a_class[arena_id])].arena_size
            addr = map_arena(memfd, arena_id * span, size)
            self.arena_addr[arena_id] = addr
            # Fault every page in now: the server's mlockall(MCL_FUTURE|MCL_ONFAULT) locks a
            # page when this process faults it, and the old server, which had them locked,
            # exits after the handover. A shared page locked by nobody could be swapped out,
            # onto the very device this process serves. (EINVAL before Linux 5.14: skipped.)
            mman.libc.madvise(addr, size, mman.MADV_POPULATE_READ)
        self.on_moved()

    def rebuild(self, arenas: np.ndarray, cells: np.ndarray, classes: np.ndarray) -> None:
        """After a crash (store.recovery): the books of a pool on the dead server's memfd,
        from the cells its live blobs use (`arenas`, `cells`, `classes`: one entry per live
        cell, each arena of one class). Every arena is mapped where it is; its free cells
        below the highest one used are linked again; whatever else the memfd holds (arenas
        of cells no live blob names) is punched. Before any request."""
        n = int(arenas.max()) + 1 if len(arenas) else 0
        if n > len(self._a_class):
            self._grow(n)
        memfd, span = self.memfd, self.span
        order = np.lexsort((cells, arenas))
        arenas, cells, classes = arenas[order], cells[order], classes[order]
        starts = np.flatnonzero(np.r_[True, arenas[1:] != arenas[:-1]]) if len(arenas) else []
        bounds = list(starts) + [len(arenas)]
        live_ids = set()
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            arena_id, cls = int(arenas[lo]), self.classes[int(classes[lo])]
            used = cells[lo:hi]
            addr = map_arena(memfd, arena_id * span, cls.arena_size)
            mman.libc.madvise(addr, cls.arena_size, mman.MADV_POPULATE_READ)  # locked from now on
            live_ids.add(arena_id)
            self.arena_addr[arena_id] = addr
            self._a_class[arena_id] = cls.index
            self._a_used[arena_id] = len(used)
            self._a_flags[arena_id] = 0
            bump = int(used[-1]) + 1
            self._a_bump[arena_id] = bump
            head = _NO_CELL
            for cell in sorted(set(range(bump)) - set(used.tolist()), reverse=True):
                self._set_next_free(arena_id, cls, cell, head)
                head = cell
            self._a_free_head[arena_id] = head
            touched = self._touched(cls, bump)
            if touched < cls.arena_size:  # cells above the last one used: dead rows' bytes
                mman.libc.fallocate(memfd, mman.FALLOC_FL_PUNCH_HOLE | mman.FALLOC_FL_KEEP_SIZE,
                                arena_id * span + touched, cls.arena_size - touched)
            self._add(ALLOCATED, cls.arena_size)
            self._add(RESIDENT, touched)
            self._add(LIVE_BYTES, len(used) * cls.cell_size)
            self._add(LIVE_CELLS, len(used))
            self._add(ARENAS, 1)
            if len(used) < cls.cells_per_arena:
                self._partial_add(arena_id)
        self._state[IDS] = n
        free_head = _NO_ARENA
        for arena_id in range(n - 1, -1, -1):
            if arena_id not in live_ids:
                self._a_class[arena_id] = _NO_CLASS
                self._a_next[arena_id] = free_head
                free_head = arena_id
        self._state[FREE_ID] = free_head
        self._punch_all_but(live_ids)
        self.on_moved()

    def _punch_all_but(self, live_ids: set[int]) -> None:
        """Punch every range of the memfd that holds data outside the arenas in use."""
        fd, span = self.memfd, self.span
        size = os.fstat(fd).st_size
        at = 0
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:  # ENXIO: no data from here on
                return
            end = os.lseek(fd, start, os.SEEK_HOLE)
            for arena_id in range(start // span, -(-end // span)):
                if arena_id not in live_ids:
                    mman.libc.fallocate(fd, mman.FALLOC_FL_PUNCH_HOLE | mman.FALLOC_FL_KEEP_SIZE,
                                    arena_id * span, span)
            at = end

    def release(self) -> None:
        """Unmap every arena and close the memfd WITHOUT freeing what it holds: after a
        handover another process holds the memfd (its last holder frees it). A pool whose
        memfd nobody else holds frees everything here too."""
        for arena_id in self._live_ids().tolist():
            size = self.classes[int(self._a_class[arena_id])].arena_size
            mman.libc.munmap(int(self.arena_addr[arena_id]), size)
            self.arena_addr[arena_id] = 0
        fd = self.memfd
        self._state[MEMFD] = -1
        self._fd_box[0] = -1
        if fd >= 0:
            os.close(fd)

    # -- accounting ------------------------------------------------------------------

    def columns(self) -> dict[str, np.ndarray]:
        """The books the native request path allocates and frees through (by address; the
        per-arena arrays are replaced when they grow: `on_moved`)."""
        return {
            "arena_addr": self.arena_addr, "arena_class": self._a_class,
            "arena_used": self._a_used, "arena_free_head": self._a_free_head,
            "arena_bump": self._a_bump, "arena_next": self._a_next, "arena_prev": self._a_prev,
            "arena_flags": self._a_flags, "class_cell": self.class_cell,
            "class_cells": self.class_cells, "class_arena": self.class_arena,
            "class_head": self.class_head, "pool_state": self.state,
        }

    def arena_classes(self) -> np.ndarray:
        """Each arena id's size class (-1: no arena), the array itself."""
        return self._a_class

    def mapped(self) -> list[tuple[int, int]]:
        """(address, size) of every arena (for tests that look at the memory itself)."""
        return [(int(self.arena_addr[a]), self.classes[int(self._a_class[a])].arena_size)
                for a in self._live_ids().tolist()]

    def meta_bytes(self) -> int:
        """Bookkeeping held for the arenas: the numpy arrays, and the kernel's VMA per
        arena (~200 bytes, a vm_area_struct)."""
        arrays = sum(
            a.nbytes for a in (self._a_class, self._a_used, self._a_free_head, self._a_bump,
                               self._a_next, self._a_prev, self._a_flags, self.arena_addr,
                               self.class_head, self.class_cells, self.class_arena)
        )
        return arrays + 200 * self.arena_count

    def class_usage(self) -> list[dict]:
        """Per size class: arenas, cells in use (for fragmentation reports)."""
        ids = self._live_ids()
        classes = self._a_class[ids].astype(np.int64)
        arenas = np.bincount(classes, minlength=len(self.classes))
        cells = np.bincount(classes, weights=self._a_used[ids], minlength=len(self.classes))
        return [
            {"cell_size": cls.cell_size, "arenas": int(arenas[i]), "cells": int(cells[i])}
            for i, cls in enumerate(self.classes)
            if arenas[i]
        ]
