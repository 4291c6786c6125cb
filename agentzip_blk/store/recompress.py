"""The recompressor: warm pages nobody read for `policy.cold_grace_period` packed cold.

The two forms (docs/ARCHITECTURE.md, "Two forms"): a page the kernel writes is stored
alone with the fast codec (`compression.warm_algorithm`), so a fault decodes one page. A
page that stays out is worth the dense form: frames of `compression.frame_pages` pages at
`compression.algorithm`/`level`, with the dictionary where it pays. Like zram's
`recompress` of idle pages, this is background work, in three steps per pass:

1. under the store lock: pick up to CHUNK_PAGES warm blobs past the grace period, or
   returned (read back since written: the page is in RAM again, and its copy is needed only
   if the kernel evicts it clean); under pool pressure the oldest warm blobs whatever their
   age; in the order of the slots
   that hold them, so that pages written together (one request, neighbouring slots) land
   in one frame and a re-touch of a cold run decodes each frame once; copy their bytes;
2. without it: verify and decode the copies, compress the frames;
3. under it again: switch each group whose blobs are all unchanged (same generation,
   still warm, in the pool, held by exactly the slots seen in step 1) to its new frame,
   and release the warm blobs. A group that changed meanwhile (a slot rewritten, trimmed,
   shared by a new write, demoted) is left as it is and picked again later, so a
   rewritten slot keeps its new bytes and a stop in the middle loses nothing.

With the native request path (datapath/nativestore.c) the blobs held by one slot each (all
but the warm pages dedup shares) are packed by `native_pack`, steps 1-3 in C with the GIL
released: the same checks, frames of the same size and level, no dictionary. The shared
ones, and every blob without the native path, go the Python way below.

The budget: at most `policy.recompress_cpu` CPUs of this thread's CPU time (a pass that
took d seconds of CPU is followed by d * (1 / budget - 1) seconds of rest), and a pass
waits while requests are in flight (requests first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CodecError, StoreFull
from .blobs import DENSE, POOL, WARM
from .disk import DiskError
from .integrity import Corrupt
from .slots import BLOB

if TYPE_CHECKING:
    from .parts import StoreParts


CHUNK_PAGES = 256  # warm blobs per pass: ~15-25 ms of zstd, one short lock hold each side
QUEUE_PAGES = 16 * CHUNK_PAGES  # under pool pressure: the oldest this many per scan
ROUND_SECONDS = 0.5  # wall time one maintenance round gives the recompressor at most
YIELD_SLICE = 0.0005  # s: the wait while requests are in flight
YIELD_MAX = 0.02  # s: at most this much waiting per pass, so a busy store still drains


@dataclass
class _Picked:
    """A warm blob copied out under the lock: what step 3 checks it against."""
    blob: int
    gen: int
    slots: list[int]
    stored: bytes
    codec: int
    csum: int
    atime: int
    rtime: int


class Recompressor:
    def __init__(self, parts: StoreParts, cpu_budget: float, *,
                 in_flight: Callable[[], int],
                 cpu_clock: Callable[[], float] = time.thread_time,
                 wall_clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """`in_flight`: the store's requests in flight (PageStore.requests_in_flight), which
        a pass waits out (`_give_way`)."""
        self.parts = parts
        self._in_flight = in_flight
        self.cpu_budget = cpu_budget
        self._cpu_clock, self._wall, self._sleep = cpu_clock, wall_clock, sleep
        self._next_pass = 0.0  # wall time before which the budget says rest
        self.pages_total = 0  # warm slots switched to the dense form
        self.cpu_seconds = 0.0
        # the last pass's CPU: run() rests after a pass, not before, so over any stretch the
        # CPU spent is at most budget x wall time plus (1 - budget) x this
        self.last_pass_cpu = 0.0
        self.raced = 0  # groups left as they were: changed while being packed
        # Candidates found by the last scan, in slot order, with the generation and the
        # first slot each had then (checked again at the pick and at the switch), and how
        # many slots hold it; the slots of the few held by several (dedup) in a dict. In
        # numpy, not Python objects: a scan finds hundreds of thousands, and a dict of lists
        # for them cost ~300 B each of server memory that the allocator kept.
        self._q_blob = np.zeros(0, dtype=np.uint32)
        self._q_gen = np.zeros(0, dtype=np.uint32)
        self._q_slot = np.zeros(0, dtype=np.uint64)
        self._q_count = np.zeros(0, dtype=np.uint32)
        self._q_pos = 0
        self._slots_of: dict[int, list[int]] = {}
        self._queue_pressure = False
        # datapath.native.NativePath.pack when the native path packs: (blobs, gens, slots)
        # -> (switched, raced, kept, bad, room)
        self.native_pack: Callable[[np.ndarray, np.ndarray, np.ndarray],
                                   tuple[int, int, int, int, bool]] | None = None

    @property
    def enabled(self) -> bool:
        return self.parts.warm_codec is not None and self.cpu_budget > 0

    def backlog(self) -> int:
        """Warm pages (slot references) to pack now: older than the grace period, or
        returned. Under the store lock."""
        blobs = self.parts.blobs
        due = self._warm_mask(False)
        return int(blobs.ref[: len(due)][due].astype(np.int64).sum())

    def run(self, pressure: bool = False, seconds: float = ROUND_SECONDS,
            stopping: Callable[[], bool] = lambda: False) -> int:
        """Passes for up to `seconds` of wall time within the CPU budget; slots packed."""
        if not self.enabled:
            return 0
        deadline = self._wall() + seconds
        packed = 0
        while not stopping():
            rest = self._next_pass - self._wall()
            if rest > 0:
                if self._wall() + rest > deadline:
                    break
                self._sleep(rest)
            self._give_way()
            started = self._cpu_clock()
            done = self.pass_once(pressure)
            spent = self._cpu_clock() - started
            self.cpu_seconds += spent
            self.last_pass_cpu = spent
            self._next_pass = self._wall() + spent * (1 / self.cpu_budget - 1)
            packed += done
            if not done or self._wall() >= deadline:
                break
        return packed

    def _give_way(self) -> None:
        waited = 0.0
        while self._in_flight() and waited < YIELD_MAX:
            self._sleep(YIELD_SLICE)
            waited += YIELD_SLICE

    def pass_once(self, pressure: bool = False) -> int:
        """One pick / pack / switch; returns the slots switched to the dense form."""
        alone, picked = self._pick(pressure)
        switched = 0
        if alone is not None:
            done, raced, _kept, _bad, _room = self.native_pack(*alone)
            self.raced += raced
            switched += done
            with self.parts.lock:
                self.pages_total += done
                self.parts.counters.recompressed_pages += done
        if picked:
            switched += self._pack(picked)
        return switched

    def _pack(self, picked: list[_Picked]) -> int:
        """Steps 2 and 3 for blobs picked with their bytes."""
        pages, groups, bad = self._decode(picked)
        parts = self.parts
        frames = self._compress(pages, groups)
        hashes = parts.placer.hashes(pages)
        with parts.lock:
            for p in bad:  # unreadable: leave it to the reads (EIO), stop picking it
                if self._unchanged(p):
                    parts.blobs.form[p.blob] = DENSE
            switched = 0
            made: set[int] = set()  # the blobs this pass stores
            for group in groups:
                try:
                    switched += self._switch([picked[n] for n in group], group, pages,
                                             hashes, frames, made)
                except (StoreFull, DiskError, CodecError):
                    break  # no room: the pages stay warm
            # The new blobs may have taken rows at the top of the table (before the warm rows
            # were free): moved down into those, the top empties and goes back (release_tail).
            moved = parts.objects.renumber(sorted(made))
            if moved:
                for p in picked:
                    for slot in p.slots:
                        old = int(parts.slots.handle[slot])
                        parts.slots.handle[slot] = moved.get(old, old)
                parts.blobs.relink()
            self.pages_total += switched
            parts.counters.recompressed_pages += switched
            return switched

    def _pick(self, pressure: bool
              ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray] | None, list[_Picked]]:
        """Up to CHUNK_PAGES candidates, under the store lock: those the native path packs
        (held by one slot: their ids, generations and slots), and the others with their
        bytes copied. The slot table is scanned once per queue (in slot order), not once per
        pass: a scan costs ~10-20 µs per page held, as much as the packing itself
        (BENCHMARKS.md, "Two speeds")."""
        parts, blobs = self.parts, self.parts.blobs
        with parts.lock:
            if pressure != self._queue_pressure:
                self._q_pos = len(self._q_blob)
            if self._q_pos >= len(self._q_blob):
                self._scan(pressure)
            end = self._q_pos + CHUNK_PAGES
            ids = self._q_blob[self._q_pos:end].astype(np.int64)
            gens, first = self._q_gen[self._q_pos:end], self._q_slot[self._q_pos:end]
            count = self._q_count[self._q_pos:end]
            self._q_pos = end
            keep = self._candidates(ids, gens, pressure)
            ids, gens, first, count = ids[keep], gens[keep], first[keep], count[keep]
            alone = (count == 1) & (blobs.ref[ids] == 1)
            if self.native_pack is None:
                alone[:] = False
            native = None
            if alone.any():
                native = (ids[alone].astype(np.uint32), gens[alone].astype(np.uint32),
                          first[alone].astype(np.uint64))
            pool = parts.pool
            picked = []
            for blob, slot, n in zip(ids[~alone].tolist(), first[~alone].tolist(),
                                     count[~alone].tolist()):
                picked.append(_Picked(
                    blob, int(blobs.gen[blob]),
                    self._slots_of.get(blob, [slot]) if n > 1 else [slot],
                    pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]),
                             int(blobs.length[blob])),
                    int(blobs.codec[blob]), int(blobs.csum[blob]),
                    int(blobs.atime[blob]), int(blobs.rtime[blob])))
            if self._q_pos >= len(self._q_blob):
                self._slots_of.clear()
            return native, picked

    def _warm_mask(self, pressure: bool) -> np.ndarray:
        parts, blobs = self.parts, self.parts.blobs
        n = blobs.capacity
        warm = (blobs.ref[:n] > 0) & (blobs.form[:n] == WARM) & (blobs.tier[:n] == POOL)
        if not pressure:
            # Past the grace period, or returned: read back since written (a warm blob's read
            # tick is set by reads only). A returned page is in RAM again; its copy is needed
            # only if the kernel evicts the page clean (docs/ARCHITECTURE.md, "What the kernel
            # tells the device"), so it is kept dense at once.
            warm &= ((parts.now() - blobs.atime[:n].astype(np.int64) >= parts.cold_ticks)
                     | (blobs.rtime[:n] > 0))
        return warm

    def _candidates(self, ids: np.ndarray, gens: np.ndarray, pressure: bool) -> np.ndarray:
        """Which queued blobs are still ones to pack (they may have gone or been read)."""
        blobs, parts = self.parts.blobs, self.parts
        ok = ((blobs.ref[ids] > 0) & (blobs.form[ids] == WARM) & (blobs.tier[ids] == POOL)
              & (blobs.gen[ids] == gens))
        if not pressure:
            ok &= ((blobs.rtime[ids] > 0)
                   | (parts.now() - blobs.atime[ids].astype(np.int64) >= parts.cold_ticks))
        return ok

    def _scan(self, pressure: bool) -> None:
        """The queue: every candidate blob in the order of the slots that hold them (under
        pool pressure the oldest QUEUE_PAGES first), with its generation, first slot and
        slot count (and, for the few held by several slots, those slots)."""
        blobs, slots = self.parts.blobs, self.parts.slots
        self._queue_pressure = pressure
        self._slots_of.clear()
        self._q_pos = 0
        empty = np.zeros(0, dtype=np.uint32)
        self._q_blob, self._q_gen, self._q_count = empty, empty, empty
        self._q_slot = np.zeros(0, dtype=np.uint64)
        warm = self._warm_mask(pressure)
        if not warm.any():
            return
        held = slots.blob_slots()
        owners = slots.handle[held].astype(np.int64)
        mine = warm[owners]
        held, owners = held[mine], owners[mine]
        if pressure:  # the oldest warm blobs first, then packed in slot order
            uniq = np.unique(owners)
            oldest = uniq[np.argsort(blobs.atime[uniq], kind="stable")][:QUEUE_PAGES]
            keep = np.isin(owners, oldest)
            held, owners = held[keep], owners[keep]
        uniq, first, count = np.unique(owners, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")  # by the first slot holding each
        self._q_blob = uniq[order].astype(np.uint32)
        self._q_gen = blobs.gen[uniq[order]].astype(np.uint32)
        self._q_slot = held[first[order]].astype(np.uint64)
        self._q_count = count[order].astype(np.uint32)
        shared = uniq[count > 1]
        if len(shared):  # rare: warm pages dedup shares
            for slot, blob in zip(held[np.isin(owners, shared)].tolist(),
                                  owners[np.isin(owners, shared)].tolist()):
                self._slots_of.setdefault(blob, []).append(slot)

    def _decode(self, picked: list[_Picked]) -> tuple[list[bytes], list[list[int]], list[_Picked]]:
        """The pages, the groups of positions to pack together (runs of frame_pages in slot
        order), and the blobs whose bytes did not verify or decode."""
        parts = self.parts
        pages: list[bytes] = []
        good: list[int] = []
        bad: list[_Picked] = []
        for n, p in enumerate(picked):
            try:
                pages.append(parts.objects.decode_checked(p.blob, p.codec, 0, p.stored,
                                                          parts.page_size, p.csum))
                good.append(n)
            except (Corrupt, CodecError):
                pages.append(b"")
                bad.append(p)
        step = parts.frame_pages
        groups = [good[i : i + step] for i in range(0, len(good), step)]
        return pages, groups, bad

    def _compress(self, pages: list[bytes], groups: list[list[int]]) -> dict:
        """The frames, compressed here, outside the lock (keyed as placement expects)."""
        parts = self.parts
        multi = [g for g in groups if len(g) > 1]
        if not multi or parts.frame_codec is None:
            return {}
        joined = [b"".join(pages[n] for n in g) for g in multi]
        choice = parts.dicts.choose_frames(joined)
        frames = {}
        for k, group in enumerate(multi):
            out = choice.sample_out if k == choice.sample else choice.codec.compress(joined[k])
            frames[tuple(group)] = (out, choice.dict_id)
        return frames

    def _unchanged(self, p: _Picked) -> bool:
        """Whether `p`'s blob is as step 1 saw it: the same row generation, still warm in the
        pool, and held by exactly the slots seen then (no new sharer, none rewritten)."""
        blobs, slots = self.parts.blobs, self.parts.slots
        if blobs.ref[p.blob] == 0 or int(blobs.gen[p.blob]) != p.gen:
            return False
        if blobs.form[p.blob] != WARM or blobs.tier[p.blob] != POOL:
            return False
        still = [s for s in p.slots if slots.kind[s] == BLOB and int(slots.handle[s]) == p.blob]
        return len(still) == len(p.slots) == int(blobs.ref[p.blob])

    def _switch(self, group: list[_Picked], positions: list[int], pages: list[bytes],
                hashes: list[tuple[int, int]], frames: dict, made: set[int]) -> int:
        """Under the store lock: the group's slots moved to their new dense blob(s), which
        are added to `made`."""
        if not all(self._unchanged(p) for p in group):
            self.raced += 1
            return 0
        parts, objects, slots = self.parts, self.parts.objects, self.parts.slots
        views = [memoryview(page) for page in pages]
        placed: list[tuple[int, int]] = [(0, 0)] * len(pages)
        staged: list[int] = []
        atime = max(p.atime for p in group)  # the pages keep their age and last read
        try:
            parts.placer.store_group(positions, views, hashes, atime, None, placed, staged,
                                     frames)
        except BaseException:
            for blob in staged:
                objects.release(blob)
            raise
        rtime = max(p.rtime for p in group)
        for blob in set(staged):
            objects.blobs.rtime[blob] = rtime
        switched = 0
        for p, n in zip(group, positions):
            new, sub = placed[n]
            for k, slot in enumerate(p.slots):
                if k:  # the staged reference covers the first slot; the others share it
                    objects.ref(new)
                slots.switch(slot, new, sub)
                objects.release(p.blob)
                switched += 1
        made.update(staged)
        return switched
