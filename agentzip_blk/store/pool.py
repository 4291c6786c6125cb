"""A zsmalloc-like pool: size classes, cells carved from fixed-size mmap arenas.

Each size class (32-byte steps up to 3072 bytes, plus whole pages for raw blobs, plus
coarser classes for multi-page frames when the store makes them) owns
arenas of one fixed size, chosen per class so that cells tile the arena with little tail
waste. A cell is addressed by (arena id, cell index). Free cells of an arena form an
intrusive list threaded through the free cells themselves (the first 4 bytes hold the
next free index), so free space costs no metadata. An arena whose last cell is freed is
unmapped at once: memory goes back to the kernel, which is the point of the exercise.

Per-arena bookkeeping lives in numpy arrays indexed by arena id; the only Python object
per arena is its mmap.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..codec.codecs import MAX_COMPRESSED  # above this a page is stored raw

PAGE = 4096
CLASS_STEP = 32
_MIN_ARENA_PAGES = 4
_MAX_ARENA_PAGES = 16
_NO_CLASS = -1  # the class of an arena id not in use
_NO_CELL = 0xFFFFFFFF
LARGE_CLASS_GROWTH = 32  # classes above MAX_COMPRESSED grow by 1/32


def _address(arena: mmap.mmap) -> int:
    """An arena's address. The ctypes view is dropped at once: an exported mmap could not
    be closed, and the address stays valid until the arena is (under the store lock)."""
    view = ctypes.c_char.from_buffer(arena)
    try:
        return ctypes.addressof(view)
    finally:
        del view


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
    def __init__(self, max_size: int, page_size: int = PAGE, max_blob: int = PAGE) -> None:
        self.max_size = max_size
        self.page_size = page_size
        self.max_blob = max(max_blob, page_size)
        self.classes: list[SizeClass] = []
        for i, size in enumerate(_class_sizes(page_size, self.max_blob)):
            arena = _arena_size(size)
            self.classes.append(SizeClass(i, size, arena, arena // size))
        self._large_sizes = [c.cell_size for c in self.classes if c.cell_size > MAX_COMPRESSED]
        self._first_large = len(self.classes) - len(self._large_sizes)
        # Per class: arena ids with at least one free cell. A dict is an ordered set with
        # O(1) removal; allocation takes the most recently added arena (LIFO, cache-warm).
        self._partial: list[dict[int, None]] = [{} for _ in self.classes]
        self._arenas: list[mmap.mmap | None] = []
        self._free_ids: list[int] = []  # arena ids to reuse (bounded by the peak arena count)
        cap = 64
        self._a_class = np.full(cap, _NO_CLASS, dtype=np.int16)  # _NO_CLASS: no arena
        self._a_used = np.zeros(cap, dtype=np.int32)
        self._a_free_head = np.zeros(cap, dtype=np.uint32)  # intrusive free list head
        self._a_bump = np.zeros(cap, dtype=np.uint32)  # cells never handed out start here
        # Each arena's address (0: none), for the native request path, which reads cells
        # without Python (datapath.native); `on_moved` runs when these arrays are replaced.
        self.arena_addr = np.zeros(cap, dtype=np.uint64)
        self.class_cell = np.array([c.cell_size for c in self.classes], dtype=np.uint32)
        self.on_moved: Callable[[], None] = lambda: None
        self._evacuating: set[int] = set()  # arenas being emptied by compaction
        self.allocated_bytes = 0  # arenas as mapped (what the cap limits)
        # Pages of arenas ever touched: cells are handed out from the start of an arena (free
        # list, then the never-used rest), and an anonymous mapping costs memory only where
        # it was written, so a fresh arena holding one cell costs that cell's pages, not the
        # arena. This is what the server's RSS pays for the pool.
        self.resident_bytes = 0
        self.live_bytes = 0  # sum of cell sizes in use
        self.live_cells = 0

    # -- classes ---------------------------------------------------------------------

    def class_for(self, length: int) -> SizeClass:
        if length <= 0 or length > self.max_blob:
            raise ValueError(f"blob length {length} outside 1..{self.max_blob}")
        if length > MAX_COMPRESSED:
            return self.classes[self._first_large + bisect.bisect_left(self._large_sizes, length)]
        return self.classes[(length - 1) // CLASS_STEP]

    # -- allocation ------------------------------------------------------------------

    def alloc(self, length: int) -> tuple[int, int]:
        """A free cell that can hold `length` bytes, as (arena id, cell index)."""
        cls = self.class_for(length)
        partial = self._partial[cls.index]
        if not partial:
            partial[self._new_arena(cls)] = None
        arena_id = next(reversed(partial))
        head = int(self._a_free_head[arena_id])
        if head != _NO_CELL:
            arena = self._arenas[arena_id]
            off = head * cls.cell_size
            self._a_free_head[arena_id] = int.from_bytes(arena[off : off + 4], "little")
            cell = head
        else:
            cell = int(self._a_bump[arena_id])
            self._a_bump[arena_id] = cell + 1
            self.resident_bytes += self._touched(cls, cell + 1) - self._touched(cls, cell)
        used = int(self._a_used[arena_id]) + 1
        self._a_used[arena_id] = used
        if used == cls.cells_per_arena:
            del partial[arena_id]
        self.live_bytes += cls.cell_size
        self.live_cells += 1
        return arena_id, cell

    def free(self, arena_id: int, cell: int) -> None:
        cls = self.classes[int(self._a_class[arena_id])]
        used = int(self._a_used[arena_id])
        if used <= 0 or self._arenas[arena_id] is None:
            raise RuntimeError(f"double free of arena {arena_id} cell {cell}")
        self.live_bytes -= cls.cell_size
        self.live_cells -= 1
        if used == 1:
            self._release_arena(arena_id, cls)
            return
        arena = self._arenas[arena_id]
        off = cell * cls.cell_size
        arena[off : off + 4] = int(self._a_free_head[arena_id]).to_bytes(4, "little")
        self._a_free_head[arena_id] = cell
        self._a_used[arena_id] = used - 1
        if used == cls.cells_per_arena and arena_id not in self._evacuating:
            self._partial[cls.index][arena_id] = None

    def _new_arena(self, cls: SizeClass) -> int:
        if self.allocated_bytes + cls.arena_size > self.max_size:
            raise PoolFull(
                f"pool at {self.allocated_bytes} of {self.max_size} bytes, "
                f"no room for a {cls.arena_size}-byte arena"
            )
        arena = mmap.mmap(-1, cls.arena_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # tenants' pages in the clear: never in a core dump (docs/SECURITY.md)
        arena.madvise(mmap.MADV_DONTDUMP)
        if self._free_ids:
            arena_id = self._free_ids.pop()
            self._arenas[arena_id] = arena
        else:
            arena_id = len(self._arenas)
            self._arenas.append(arena)
            if arena_id >= len(self._a_class):
                self._grow(arena_id + 1)
        self._a_class[arena_id] = cls.index
        self.arena_addr[arena_id] = _address(arena)
        self._a_used[arena_id] = 0
        self._a_free_head[arena_id] = _NO_CELL
        self._a_bump[arena_id] = 0
        self.allocated_bytes += cls.arena_size
        return arena_id

    def _release_arena(self, arena_id: int, cls: SizeClass) -> None:
        # Every class has several cells per arena, so an arena about to empty is partial.
        self._partial[cls.index].pop(arena_id, None)
        arena = self._arenas[arena_id]
        self._arenas[arena_id] = None
        self.arena_addr[arena_id] = 0
        arena.close()
        self._a_used[arena_id] = 0
        self._a_class[arena_id] = _NO_CLASS
        self._evacuating.discard(arena_id)
        self._free_ids.append(arena_id)
        self.allocated_bytes -= cls.arena_size
        self.resident_bytes -= self._touched(cls, int(self._a_bump[arena_id]))

    def _touched(self, cls: SizeClass, cells: int) -> int:
        """Bytes of whole pages covering an arena's first `cells` cells."""
        return -(-cells * cls.cell_size // self.page_size) * self.page_size

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * len(self._a_class))
        for name in ("_a_class", "_a_used", "_a_free_head", "_a_bump", "arena_addr"):
            old = getattr(self, name)
            new = np.full(cap, _NO_CLASS if name == "_a_class" else 0, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self.on_moved()

    # -- compaction ------------------------------------------------------------------

    def arenas_of(self, class_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Live arena ids of a class and their used cell counts."""
        ids = np.flatnonzero(self._a_class[: len(self._arenas)] == class_index)
        return ids, self._a_used[ids].astype(np.int64)

    def evacuation_plan(self, class_index: int) -> list[int]:
        """The sparsest arenas of a class whose cells fit into the free cells of the rest."""
        ids, used = self.arenas_of(class_index)
        if len(ids) < 2:
            return []
        per_arena = self.classes[class_index].cells_per_arena
        needed = -(-int(used.sum()) // per_arena)
        order = np.argsort(-used, kind="stable")
        return ids[order[needed:]].tolist()

    def evacuate(self, arena_ids: list[int]) -> None:
        """Stop allocating from these arenas; they are released when their last cell moves out."""
        for arena_id in arena_ids:
            self._evacuating.add(arena_id)
            self._partial[int(self._a_class[arena_id])].pop(arena_id, None)

    def still_evacuating(self, arena_ids: list[int]) -> list[int]:
        """Those of `arena_ids` still being emptied: one released meanwhile may have been
        made again, under the same id, for new cells."""
        return [a for a in arena_ids if a in self._evacuating]

    def end_evacuation(self) -> None:
        """Arenas that still hold cells (an interrupted compaction) become allocatable again."""
        for arena_id in list(self._evacuating):
            cls = self.classes[int(self._a_class[arena_id])]
            if self._arenas[arena_id] is not None and self._a_used[arena_id] < cls.cells_per_arena:
                self._partial[cls.index][arena_id] = None
        self._evacuating.clear()

    def arena_size_of(self, length: int) -> int:
        return self.class_for(length).arena_size

    # -- data ------------------------------------------------------------------------

    def put(self, arena_id: int, cell: int, data) -> None:
        cls = self.classes[int(self._a_class[arena_id])]
        off = cell * cls.cell_size
        self._arenas[arena_id][off : off + len(data)] = data

    def get(self, arena_id: int, cell: int, length: int) -> bytes:
        cls = self.classes[int(self._a_class[arena_id])]
        off = cell * cls.cell_size
        return self._arenas[arena_id][off : off + length]

    # -- accounting ------------------------------------------------------------------

    def arena_classes(self) -> np.ndarray:
        """Each arena id's size class (-1: no arena), the array itself."""
        return self._a_class

    @property
    def arena_count(self) -> int:
        return len(self._arenas) - len(self._free_ids)

    def meta_bytes(self) -> int:
        """Bookkeeping held for the arenas: numpy arrays, id lists, mmap objects."""
        arrays = sum(
            a.nbytes for a in (self._a_class, self._a_used, self._a_free_head, self._a_bump,
                               self.arena_addr)
        )
        # List slots are 8 bytes; a dict entry with its index is ~40 bytes.
        pointers = 8 * (len(self._arenas) + len(self._free_ids))
        pointers += 40 * sum(map(len, self._partial))
        # A Python mmap object is ~80 bytes (CPython 3.11 mmap_object) plus its VMA in the kernel.
        objects = 80 * self.arena_count
        return arrays + pointers + objects

    def class_usage(self) -> list[dict]:
        """Per size class: arenas, cells in use (for fragmentation reports)."""
        arenas = np.zeros(len(self.classes), dtype=np.int64)
        cells = np.zeros(len(self.classes), dtype=np.int64)
        for arena_id, arena in enumerate(self._arenas):
            if arena is not None:
                c = int(self._a_class[arena_id])
                arenas[c] += 1
                cells[c] += int(self._a_used[arena_id])
        return [
            {"cell_size": cls.cell_size, "arenas": int(arenas[i]), "cells": int(cells[i])}
            for i, cls in enumerate(self.classes)
            if arenas[i]
        ]
