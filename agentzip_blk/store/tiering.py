"""Tiers: demote cold blobs to disk, promote read ones back, rewrite sparse frames, compact
the pool; and the maintainer thread that does all but promotion off the request path.

Each blob carries its last access and last read tick. When the pool passes
`reclaim_threshold` the coldest blobs move to the disk tier (copies written and synced
before the pool cells are freed) until it is `HYSTERESIS_PERCENT` below; a read of a disk
blob promotes it while the pool is below that target. Frames at most half used are
recompressed without their dead pages; the pool is compacted when fragmented. A blob whose
pages were all read back and stayed in RAM (returned) moves to disk under the host's memory
pressure, whatever the pool's size: only a clean eviction by the kernel reads it again.

The store wakes the maintainer when a write leaves the pool above its reclaim threshold;
otherwise it looks every `interval` seconds. Each round works in chunks that take the store
lock briefly, so requests interleave with it. The round's steps are Tiers methods (and the
recompressor's); their order is the store's (PageStore.maintain), which the maintainer runs.
Tiers gets the store's parts (parts.StoreParts), never the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CodecError, StoreFull
from .blobs import DISK, POOL, TAIL_RELEASE_ROWS, WARM
from .disk import DiskError, DiskFull
from .integrity import Corrupt
from .pool import PoolFull
from .slots import BLOB, SCAN_CHUNKS

if TYPE_CHECKING:
    from .parts import StoreParts


HYSTERESIS_PERCENT = 5  # demotion stops this many points below reclaim_threshold
FRAGMENTATION_TRIGGER = 0.20  # compact when this share of arena bytes holds no live cell
MIN_COMPACT_BYTES = 1 << 20
DEMOTE_CHUNK = 512  # blobs moved per lock hold, so requests wait at most one chunk
# cells compaction moves per lock hold: a whole class at once held the lock for tens of ms
# under churn, which every request in flight waited out (BENCHMARKS.md, "Compaction chunks");
# 256 still held it up to 18 ms at density N = 16 ("The store lock's long holds")
COMPACT_CHUNK = 64
# blob rows a background scan of the blob table reads per hold of the store lock (~1 ms)
SCAN_ROWS = 1 << 16
# Sparse frames switched per lock hold (each decoded and compressed again before, without
# the lock), and chunks of them per maintenance round, all picked in one scan of the slots.
REWRITE_CHUNK = 16
REWRITE_ROUNDS = 8
# chunks of returned blobs demoted per maintenance round, from one scan of the slot table
# (under the lock): a round does a bounded share and the next round goes on
RETURNED_ROUNDS = 8
BACKLOG_INTERVAL = 0.05  # s between rounds while the recompressor has work
# compact_rows: live rows moved down per scan of the slots, per hold of the store lock (each
# row's pages re-pointed in the dedup index: 1024 rows held it up to 38 ms), scans per round,
# and the share of rows handed out over rows in use below which the table is left as it is
ROW_CHUNK = 1024
ROW_HOLD = 256
ROW_ROUNDS = 8
ROW_SLACK = 1.25


@dataclass
class _Sparse:
    """A sparse frame picked for rewriting, as it was under the lock."""
    blob: int
    gen: int
    slots: list[int]
    subs: list[int]  # each slot's page in the frame
    stored: bytes
    codec: int
    dict_id: int
    pages: int
    csum: int
    atime: int
    rtime: int


@dataclass
class Tiering:
    """The `pool` and `policy` settings the store acts on."""

    max_size: int = 8 << 30
    reclaim_threshold: int = 80
    swap_out_path: str | None = None  # None: no disk tier
    swap_out_max_size: int = 0
    defrag: bool = True
    hot_threshold_ms: int = 1000
    warm_threshold_ms: int = 10000
    cold_grace_period: float = 30.0
    hot_cache_size: int = 4 << 20
    recompress_cpu: float = 0.25  # CPUs of thread time for packing warm pages (recompress)
    returned_to_disk: str = "never"  # pressure | always | never (policy.returned_to_disk)

    @classmethod
    def from_config(cls, config) -> Tiering:
        pool, policy = config.pool, config.policy
        return cls(
            max_size=pool.max_size,
            reclaim_threshold=pool.reclaim_threshold,
            swap_out_path=pool.swap_out_path,
            swap_out_max_size=pool.swap_out_max_size,
            defrag=pool.defrag,
            hot_threshold_ms=policy.hot_threshold_ms,
            warm_threshold_ms=policy.warm_threshold_ms,
            cold_grace_period=policy.cold_grace_period,
            hot_cache_size=policy.hot_cache_size,
            recompress_cpu=policy.recompress_cpu,
            returned_to_disk=policy.returned_to_disk,
        )


class Tiers:
    """The moves between tiers of one store, and the steps of a maintenance round that are
    not the recompressor's. Those that touch the books take the store lock, but `promote`
    (its caller holds it)."""

    def __init__(self, parts: StoreParts, tiering: Tiering) -> None:
        self.parts = parts
        self.objects = parts.objects
        self.pool = parts.pool
        self.disk = parts.disk
        self.counters = parts.counters
        self.defrag = tiering.defrag
        self.returned_to_disk = tiering.returned_to_disk
        self.reclaim_bytes = tiering.max_size * tiering.reclaim_threshold // 100
        self._demoting = threading.Lock()
        self._compacting = threading.Lock()  # the maintainer's and `defrag`'s, one at a time
        self.reclaim_target = max(
            0, tiering.max_size * (tiering.reclaim_threshold - HYSTERESIS_PERCENT) // 100
        )

    def promote(self, blob: int, data: bytes) -> None:
        """Bring a disk blob back to the pool while the pool is below the demotion target
        (the caller holds the store lock).

        Not up to the reclaim threshold: between the target and the threshold promotions
        would refill what the last demotion round emptied, and the two would chase each
        other (measured under load: 940k demotions against 795k promotions in 4 minutes).
        """
        blobs = self.objects.blobs
        length = int(blobs.length[blob])
        if self.pool.allocated_bytes + self.pool.arena_size_of(length) > self.reclaim_target:
            return
        try:
            arena, cell = self.pool.alloc(length)
        except PoolFull:
            return
        self.pool.put(arena, cell, data)
        self.disk.free(int(blobs.disk_off[blob]), length)
        blobs.arena[blob], blobs.cell[blob], blobs.tier[blob] = arena, cell, POOL
        self.counters.promotions += 1

    def demote_cold(self, limit: int = DEMOTE_CHUNK) -> int:
        """Demote up to `limit` of the oldest cold pool blobs to disk; returns blobs moved.

        Nothing slow under the store lock: the blobs' bytes are copied out and their extents
        reserved under it; sealing, writing and syncing happen without it; then, under it
        again, each blob still alive in its generation (`blobs.gen`: not freed, not reused)
        is switched to its extent and its pool cell freed, and the extents of the others are
        freed. Copies are on disk before any cell goes, so a failing disk leaves every page
        in the pool."""
        return self._demote(self._cold, limit)

    def demote_returned(self, limit: int = DEMOTE_CHUNK) -> int:
        """Demote up to RETURNED_ROUNDS chunks of `limit` pool blobs whose every page was read back and has stayed in
        RAM for warm_threshold_ms; returns blobs moved. Such a copy is read again only if
        the kernel evicts its page clean (swap cache), so it waits on disk, not in memory;
        it is never dropped: the kernel may still read it (docs/ARCHITECTURE.md, "What the
        kernel tells the device")."""
        blobs = self.objects.blobs
        # One scan of the slot table for the round, then chunks: a chunk keeps only the
        # blobs whose references are still the returned slots counted then (a write since
        # took or added one) and still unread for warm_threshold_ms.
        with self.parts.lock:
            candidates, back = self._returned(self.parts.now())
        moved = 0
        for start in range(0, min(len(candidates), limit * RETURNED_ROUNDS), limit):
            ids, refs = candidates[start : start + limit], back[start : start + limit]

            def still(now: int, ids: np.ndarray = ids, refs: np.ndarray = refs) -> np.ndarray:
                return ids[(blobs.ref[ids] == refs) & (blobs.tier[ids] == POOL)
                           & (now - blobs.rtime[ids].astype(np.int64) >= self.parts.warm_ticks)]

            done = self._demote(still, limit)
            moved += done
            if not done:  # the disk is full or failing: the next round tries again
                break
        with self.parts.lock:
            self.counters.returned_demotions += moved
        return moved

    def _cold(self, now: int) -> np.ndarray:
        """Live pool blobs unaccessed for cold_grace_period, oldest first (under the lock)."""
        blobs = self.objects.blobs
        n = blobs.capacity
        candidates = np.flatnonzero(
            (blobs.ref[:n] > 0)
            & (blobs.tier[:n] == POOL)
            & (now - blobs.atime[:n].astype(np.int64) >= self.parts.cold_ticks)
        )
        return candidates[np.argsort(blobs.atime[candidates], kind="stable")]

    def _returned(self, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Live pool blobs all of whose references are slots read since their last write,
        the last read warm_threshold_ms ago or more, least recently read first (under the
        lock), and their reference counts. A blob with one slot not read back (its page is
        out, a fault will come) stays."""
        blobs, slots = self.objects.blobs, self.parts.slots
        n = blobs.capacity
        held = slots.blob_slots()
        owners = slots.handle[held].astype(np.int64)
        back = np.bincount(owners[slots.rtime[held] != 0], minlength=n)[:n]
        last_read = blobs.rtime[:n].astype(np.int64)
        candidates = np.flatnonzero(
            (back > 0)
            & (back == blobs.ref[:n])
            & (blobs.tier[:n] == POOL)
            & (last_read > 0)
            & (now - last_read >= self.parts.warm_ticks)
        )
        candidates = candidates[np.argsort(last_read[candidates], kind="stable")]
        return candidates, back[candidates]

    def _demote(self, pick: Callable[[int], np.ndarray], limit: int) -> int:
        if self.disk is None:
            return 0
        # One demotion at a time (the maintainer, and `reclaim` from the control thread):
        # two would pick the same candidates, and the loser's empty round would end its
        # caller's loop early. Taken before the store lock, never inside it.
        with self._demoting:
            return self._demote_picked(pick, limit)

    def _demote_picked(self, pick: Callable[[int], np.ndarray], limit: int) -> int:
        parts, objects, disk = self.parts, self.objects, self.disk
        blobs = objects.blobs
        batch: list[tuple[int, int, int, bytes]] = []  # blob, generation, extent, bytes
        with parts.lock:
            for blob in pick(parts.now())[:limit].tolist():
                length = int(blobs.length[blob])
                try:
                    offset = disk.alloc(length)
                except DiskFull:
                    self.counters.disk_full += 1
                    break
                # a copy (bytes), not a view of the cell: the cell may go meanwhile
                data = self.pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), length)
                batch.append((blob, int(blobs.gen[blob]), offset, data))
        if not batch:
            return 0
        try:
            for blob, gen, offset, data in batch:
                disk.put(offset, data, blob, gen, batch=True)
            disk.sync_written()
        except DiskError:
            with parts.lock:
                for _blob, _gen, offset, data in batch:
                    disk.free(offset, len(data))
                self.counters.disk_errors += 1
            return 0
        moved = 0
        with parts.lock:
            disk.writes += len(batch)
            for blob, gen, offset, data in batch:
                if blobs.ref[blob] > 0 and int(blobs.gen[blob]) == gen and blobs.tier[blob] == POOL:
                    old_arena, old_cell = int(blobs.arena[blob]), int(blobs.cell[blob])
                    # the offset, then the tier, then the cell's free: at any point of a
                    # crash the row names a whole copy (store.shared)
                    blobs.disk_off[blob], blobs.tier[blob], blobs.arena[blob] = offset, DISK, -1
                    self.pool.free(old_arena, old_cell)
                    moved += 1
                else:  # freed (perhaps reused) or moved by another round meanwhile
                    disk.free(offset, len(data))
            self.counters.demotions += moved
        return moved

    def punch_freed(self) -> int:
        """Make the disk extents freed since the last round reusable: as they are while the
        file's free space stays within its slack (store.disk), else hole-punched first,
        without the store lock; returns extents punched."""
        if self.disk is None:
            return 0
        with self.parts.lock:
            pending = self.disk.take_pending()
            punch = bool(pending) and self.disk.over_slack(pending)
        if not pending:
            return 0
        if punch:
            self.disk.punch(pending)
        with self.parts.lock:  # a second hold, as short as the first: requests run between
            self.disk.reuse(pending)
        return len(pending) if punch else 0

    def rewrite_sparse_frames(self, limit: int = REWRITE_CHUNK) -> int:
        """Recompress frames that at most half of their pages are still used by, keeping only
        those pages; returns frames rewritten. A frame stays whole while any page of it is
        held, so without this, overwrites and trims scattered over frames would keep dead
        pages in memory indefinitely.

        Nothing slow under the store lock (issue 27: no tenant slows the others through it):
        up to `limit` frames are picked (their slots found a share of the table per hold) and
        their stored bytes copied under it, decoded and compressed again without it, and
        switched under it again, REWRITE_CHUNK per hold, only if each is still as picked (the
        same generation, held by exactly the slots seen, each still naming the same page)."""
        parts = self.parts
        if parts.frame_pages == 1:
            return 0
        picked = self._pick_sparse(limit)
        done = 0
        for start in range(0, len(picked), REWRITE_CHUNK):
            chunk = picked[start : start + REWRITE_CHUNK]
            rebuilt = [self._rebuild_sparse(p) for p in chunk]
            with parts.lock:
                switched = 0
                for p, new in zip(chunk, rebuilt):
                    if new is None or not self._sparse_unchanged(p):
                        continue
                    try:
                        switched += self._switch_sparse(p, *new)
                    except (StoreFull, DiskError, CodecError):
                        self.counters.frames_rewritten += switched
                        return done + switched  # no room: the frames stay as they are
                self.counters.frames_rewritten += switched
            done += switched
        return done

    def _pick_sparse(self, limit: int) -> list[_Sparse]:
        """Up to `limit` sparse pool frames, with their slots and bytes, as they were under
        the lock at the end. A frame whose slots changed while the table was scanned is left
        for a later round."""
        parts, slots, blobs = self.parts, self.parts.slots, self.objects.blobs
        with parts.lock:
            n = blobs.capacity
            ref = blobs.ref[:n].astype(np.int64)
            sparse = np.flatnonzero((ref > 0) & (blobs.pages[:n] > 1) & (blobs.tier[:n] == POOL)
                                    & (2 * ref <= blobs.pages[:n]))[:limit]
            if not len(sparse):
                return []
            gens = dict(zip(sparse.tolist(), blobs.gen[sparse].tolist()))
        slots_of = self._slots_of(sparse)
        picked = []
        with parts.lock:
            for blob, seen in slots_of.items():
                if (int(blobs.gen[blob]) != gens[blob] or blobs.tier[blob] != POOL
                        or 2 * int(blobs.ref[blob]) > int(blobs.pages[blob])
                        or not self._named_only_by(blob, seen)):
                    continue
                picked.append(_Sparse(
                    blob, gens[blob], seen, [int(slots.sub[s]) for s in seen],
                    self.pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]),
                                  int(blobs.length[blob])),
                    int(blobs.codec[blob]), int(blobs.dict_id[blob]), int(blobs.pages[blob]),
                    int(blobs.csum[blob]), int(blobs.atime[blob]), int(blobs.rtime[blob])))
        return picked

    def _slots_of(self, rows: np.ndarray) -> dict[int, list[int]]:
        """The slots that name each of the blob `rows`, the table read SCAN_CHUNKS chunks per
        hold of the store lock. Requests run between holds, so a slot may have moved to or
        from one of the rows meanwhile: what this returns is a candidate, checked under the
        lock by the caller."""
        parts, slots = self.parts, self.parts.slots
        with parts.lock:
            chunks = np.flatnonzero(slots.chunk_live)
        wanted = np.zeros(int(rows.max()) + 1, dtype=bool)
        wanted[rows] = True
        found: dict[int, list[int]] = {}
        for start in range(0, len(chunks), SCAN_CHUNKS):
            with parts.lock:
                idx = slots.ids_of(chunks[start : start + SCAN_CHUNKS])
                idx = idx[slots.kind[idx] == BLOB]
                handles = slots.handle[idx].astype(np.int64)
            inside = handles < len(wanted)
            hit = np.zeros(len(idx), dtype=bool)
            hit[inside] = wanted[handles[inside]]
            for slot, blob in zip(idx[hit].tolist(), handles[hit].tolist()):
                found.setdefault(blob, []).append(slot)
        return found

    def _rebuild_sparse(self, p: _Sparse):
        """Without the lock: the frame's live pages, their hashes and their new frame (None
        when the frame does not read back: the reads will say so)."""
        parts = self.parts
        page = parts.page_size
        try:
            data = memoryview(self.objects.decode_checked(
                p.blob, p.codec, p.dict_id, p.stored, p.pages * page, p.csum))
        except (Corrupt, CodecError):
            return None
        subs = sorted(set(p.subs))
        pages = [data[sub * page : (sub + 1) * page] for sub in subs]
        frames = {}
        if len(pages) > 1 and parts.frame_codec is not None:
            frames[tuple(range(len(pages)))] = (parts.frame_codec.compress(b"".join(pages)), 0)
        return subs, pages, parts.placer.hashes(pages), frames

    def _sparse_unchanged(self, p: _Sparse) -> bool:
        slots = self.parts.slots
        return (int(self.objects.blobs.gen[p.blob]) == p.gen
                and self._named_only_by(p.blob, p.slots)
                and all(int(slots.sub[s]) == sub for s, sub in zip(p.slots, p.subs)))

    def _switch_sparse(self, p: _Sparse, subs: list[int], pages: list, hashes: list,
                       frames: dict) -> int:
        """Under the lock: the frame's live pages stored anew (Placer.store_group, with the
        frame compressed already), its slots switched to them, the old frame released."""
        parts, objects, slots = self.parts, self.objects, self.parts.slots
        placed: list[tuple[int, int]] = [(0, 0)] * len(pages)
        staged: list[int] = []
        try:  # the pages keep their age
            parts.placer.store_group(list(range(len(pages))), pages, hashes, p.atime, None,
                                     placed, staged, frames)
        except BaseException:
            for new in staged:
                objects.release(new)
            raise
        for new in set(staged):
            objects.blobs.rtime[new] = p.rtime  # and their last read (ping-pong)
        home = dict(zip(subs, placed))
        taken = set()
        for slot, sub in zip(p.slots, p.subs):
            new, new_sub = home[sub]
            if (new, new_sub) in taken:
                objects.ref(new)  # a second slot sharing that page
            taken.add((new, new_sub))
            slots.switch(slot, new, new_sub)
            objects.release(p.blob)
        return 1

    def needs_compaction(self) -> bool:
        wasted = self.pool.allocated_bytes - self.pool.live_bytes
        return wasted >= MIN_COMPACT_BYTES and self.pool.fragmentation() >= FRAGMENTATION_TRIGGER

    def compact(self) -> int:
        """Move live cells out of the sparsest arenas of every class; returns cells moved.
        The classes are planned together and their blobs found in one scan of the blob
        table: a scan per class (~130 classes) cost 0.16 CPU under `bench load`."""
        with self._compacting:
            with self.parts.lock:
                sources = self.pool.evacuation_plan()
                if sources:
                    self.pool.evacuate(sources)
            moved = self._evacuate(sources) if sources else 0
            with self.parts.lock:
                self.counters.compactions += 1
        return moved

    def _evacuate(self, sources: list[int]) -> int:
        """Empty the arenas `sources` (evacuating: they take no allocations),
        COMPACT_CHUNK cells per hold of the store lock. The blobs to move are found once;
        between holds requests run, so each chunk keeps only those still live in a source
        arena (nothing new lands in one). Requests also take free cells, so a move may find
        no room left; the rest then stays where it is."""
        lock = self.parts.lock
        blobs, pool = self.objects.blobs, self.pool
        moved = 0
        try:
            found, start = [], 0
            while True:  # SCAN_ROWS rows per hold: the blobs in the sources only go, none come
                with lock:
                    end = min(start + SCAN_ROWS, blobs.capacity)
                    if start >= end:
                        break
                    found.append(self._in_arenas(np.arange(start, end), sources))
                start = end
            movers = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
            for start in range(0, len(movers), COMPACT_CHUNK):
                with lock:
                    sources = pool.still_evacuating(sources)
                    if not sources:
                        break
                    chunk = self._in_arenas(movers[start : start + COMPACT_CHUNK], sources)
                    done = self._move_cells(chunk.tolist())
                    moved += done
                    self.counters.pages_moved += done
                    if done < len(chunk):
                        break  # no room: the pool filled meanwhile
        finally:
            with lock:
                pool.end_evacuation()
        return moved

    def _in_arenas(self, ids: np.ndarray, arenas: list[int]) -> np.ndarray:
        """Those of blob rows `ids` that are live pool blobs in one of `arenas`."""
        blobs = self.objects.blobs
        member = np.zeros(max(arenas) + 1, dtype=bool)
        member[arenas] = True
        arena = blobs.arena[ids].astype(np.int64)
        keep = (blobs.ref[ids] > 0) & (blobs.tier[ids] == POOL) & (arena >= 0) & (arena < len(member))
        keep[keep] = member[arena[keep]]
        return ids[keep]

    def _move_cells(self, movers: list[int]) -> int:
        """Each blob's cell copied to a cell outside the evacuated arenas (under the lock)."""
        blobs, pool = self.objects.blobs, self.pool
        for done, blob in enumerate(movers):
            length = int(blobs.length[blob])
            data = pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), length)
            try:
                arena, cell = pool.alloc(length)
            except PoolFull:
                return done
            pool.put(arena, cell, data)
            old_arena, old_cell = int(blobs.arena[blob]), int(blobs.cell[blob])
            # the row first, then the old cell's free: a crash in between leaves the row on
            # a whole copy (a freed cell's first bytes link the free list)
            blobs.move_cell(blob, arena, cell)
            pool.free(old_arena, old_cell)
        return len(movers)

    def resize_index(self) -> bool:
        """Give the dedup index the capacity it wants (dedup.DedupIndex.wanted): the new
        table is laid out without the store lock from a copy of the old, then what changed
        since the copy is replayed into it under the lock."""
        parts = self.parts
        with parts.lock:
            capacity = parts.index.wanted()
            if capacity is None:
                return False
            seen = parts.index.seen()
        resize = parts.index.plan(capacity, seen)
        with parts.lock:
            return parts.index.adopt(resize)

    def grow_blob_table(self) -> bool:
        """Grow the blob table ahead of need, the same way (blobs.BlobTable.wanted), so that
        a write request seldom has to."""
        parts, blobs = self.parts, self.objects.blobs
        with parts.lock:
            capacity, rows = blobs.wanted(), blobs.rows
        if capacity is None:
            return False
        arrays = blobs.prepare(capacity, rows)
        with parts.lock:
            return blobs.adopt(arrays)

    def compact_rows(self) -> int:
        """Give back the blob table's top: live pool rows above the rows in use are moved
        down into free ones (Objects.renumber; their slots re-pointed), ROW_CHUNK per scan
        of the slots (`_slots_of`) and ROW_HOLD per hold of the store lock, then the free
        top is released (BlobTable.release_tail). Warm
        pages take a row each and their frames one per 16, wherever the free rows were, so
        without this the table keeps the rows of a burst long after it was packed."""
        parts, blobs, slots = self.parts, self.objects.blobs, self.parts.slots
        moved_total = 0
        for _ in range(ROW_ROUNDS):
            with parts.lock:
                rows, live = blobs.rows, blobs.count
                if rows < TAIL_RELEASE_ROWS or rows <= ROW_SLACK * live:
                    break
                above = live + np.flatnonzero(blobs.ref[live:rows] > 0)
                # dense pool blobs: warm ones are packed soon (and moving them would
                # invalidate the recompressor's queue, which names them by row)
                above = above[(blobs.tier[above] == POOL) & (blobs.form[above] != WARM)]
                above = above[-ROW_CHUNK:]
                if not len(above):
                    break
                gens = dict(zip(above.tolist(), blobs.gen[above].tolist()))
            slots_of = self._slots_of(above)  # without one long hold (SCAN_CHUNKS)
            candidates = list(gens.items())
            moved_round = 0
            for first in range(0, len(candidates), ROW_HOLD):
                with parts.lock:
                    # a row whose slots changed during the scan stays where it is this round
                    ready = [row for row, gen in candidates[first : first + ROW_HOLD]
                             if int(blobs.gen[row]) == gen and int(blobs.ref[row]) > 0
                             and self._named_only_by(row, slots_of.get(row, []))]
                    moved = self.objects.renumber(ready)
                    for old, new in moved.items():
                        slots.handle[slots_of[old]] = new
                    blobs.relink()
                moved_round += len(moved)
            if not moved_round:
                break
            moved_total += moved_round
        with parts.lock:
            blobs.release_tail()
        return moved_total

    def _named_only_by(self, blob: int, seen: list[int]) -> bool:
        """Under the lock: `seen` are exactly the slots that name `blob` (its `ref` counts
        them), as `_slots_of` found them."""
        slots = self.parts.slots
        return (int(self.objects.blobs.ref[blob]) == len(seen)
                and all(slots.kind[s] == BLOB and int(slots.handle[s]) == blob for s in seen))

    def grow_arena_books(self) -> bool:
        """The pool's per-arena arrays, ahead of need (pool.Pool.wanted): the native request
        path maps arenas itself, but cannot grow the arrays that name them."""
        with self.parts.lock:
            capacity = self.pool.wanted()
            if capacity is None:
                return False
            self.pool.grow(capacity)
            return True

    def returned_go_to_disk(self, pressure: Callable[[], bool]) -> bool:
        """Whether returned copies move to disk this round (policy.returned_to_disk);
        `pressure` (the host is short of memory) is asked only in mode "pressure"."""
        mode = self.returned_to_disk
        if self.disk is None or mode == "never":
            return False
        return mode == "always" or pressure()

    def reclaiming(self) -> bool:
        """Whether the pool is at or above its reclaim threshold."""
        return self.pool.allocated_bytes >= self.reclaim_bytes

    def rewrite_sparse_rounds(self) -> int:
        """Up to REWRITE_ROUNDS chunks of sparse frames rewritten, picked in one scan; returns
        frames rewritten."""
        return self.rewrite_sparse_frames(REWRITE_CHUNK * REWRITE_ROUNDS)

    def reclaim(self) -> int:
        """Demote the coldest blobs while the pool is above its reclaim threshold, down to
        the demotion target (or until nothing moves: the disk is full or failing); returns
        blobs moved."""
        demoted = 0
        reclaiming = self.reclaiming()
        while reclaiming and self.pool.allocated_bytes > self.reclaim_target:
            moved = self.demote_cold()
            if not moved:
                break
            demoted += moved
            # Demotion frees cells all over the pool; arenas only go back once compacted.
            if self.defrag and self.pool.allocated_bytes > self.reclaim_target:
                self.compact()
        return demoted

    def compact_if_fragmented(self) -> int:
        """Compact the pool when `pool.defrag` is on and it needs it; returns cells moved."""
        if self.defrag and self.needs_compaction():
            return self.compact()
        return 0


class Maintainer:
    """The thread that runs a store's maintenance rounds (`maintain`, PageStore.maintain)
    when its doorbell rings, else every `interval` seconds."""

    def __init__(self, parts: StoreParts, maintain: Callable[[], dict],
                 interval: float = 1.0, log=None) -> None:
        self.parts = parts
        self.maintain = maintain
        self.interval = interval
        self.log = log or (lambda msg: None)
        self.rounds = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentzip-maintain", daemon=True)

    def start(self) -> None:
        parts = self.parts
        with parts.lock:  # index growth off the write path from now on
            parts.index.hand_growth_to(parts.doorbell.ring)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.parts.doorbell.ring()
        self._thread.join(timeout=10)
        with self.parts.lock:
            self.parts.index.hand_growth_to(None)

    def _run(self) -> None:
        wait = self.interval
        while not self._stop.is_set():
            self.parts.doorbell.wait(wait)
            if self._stop.is_set():
                return
            try:
                result = self.maintain()
            except Exception as exc:  # keep serving; the error shows in stats
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.log(f"agentzip: maintenance failed: {self.last_error}")
                continue
            self.rounds += 1
            # a backlog of warm pages: come back soon (the recompressor paces itself)
            wait = BACKLOG_INTERVAL if result["recompressed"] else self.interval
            if result["demoted"] or result["compacted"] or result["units_rewritten"]:
                self.log(f"agentzip: demoted {result['demoted']} blobs, compacted "
                         f"{result['compacted']}, rewrote {result['units_rewritten']} sparse frames")
