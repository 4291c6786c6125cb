"""PageStore: the device as an array of 4 KiB slots, each empty, same-filled or a blob.

The facade: it holds the lock, checks ranges, turns unaligned requests into whole pages
(read-modify-write) and keeps the request counters; the work is done by its parts:

- `slots`: the slot table (kind, handle, page in frame, last read) and its chunk books;
- `placement`: same-filled pages, dedup lookup, grouping of new pages into frames;
- `objects`: blobs (new / ref / fetch / release) over the pool, the disk tier and caches;
- `tiering`: demotion, promotion, rewriting sparse frames, compaction, the maintainer;
- `accounting`: stats, metadata bytes, per-slot sizes, check().

The last two, and the recompressor, get the store's parts (`parts.StoreParts`), never the
store: none of them calls back into it, and `maintain` alone orders a maintenance round.

Write path for a request: find same-filled pages for the whole request at once with numpy;
place the rest (share an equal stored page, else compress into frames or single pages, in a
pool cell or, with the pool at its cap, straight in the disk tier). All new blobs are staged
first; only when every page of the request has a home are the slots switched over and the
old blobs released, so a full store or a codec failure leaves the device exactly as it was.

A read decompresses a frame once and keeps the copy in a small cache, since the kernel reads
the neighbouring pages right after (swap readahead, the next fault). A read of a disk blob
promotes it while the pool is below the demotion target.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import ContextManager, TypeAlias

import numpy as np

from ..codec.codecs import MAX_COMPRESSED, Codec, CodecSet, PooledCodec, make_codec
from ..codec.dictionaries import StoreDictionaries
from ..codec.dictionaries.registry import LoadedDict
from ..config import MAX_DEVICE_SIZE, MAX_FRAME_PAGES
from ..errors import OutOfRange, StoreFull
from . import accounting, handover, recovery
from .blobs import BlobTable
from .cache import HotCache
from .dedup import SUB_BITS, DedupIndex, HashFn
from .disk import DiskError, DiskTier
from .doorbell import Doorbell
from .handover import Exported
from .integrity import Corrupt
from .objects import Counters, Deferred, Moved, Objects
from .parts import StoreParts
from .placement import Placer, Prepared
from .pool import Pool
from .recompress import Recompressor
from .shared import DropFn, NewFn, SharedTables
from .slots import BLOB, CHUNK_SLOTS, EMPTY, SAME, SCAN_CHUNKS, TICK_MASK, SlotTable
from .tiering import DEMOTE_CHUNK, REWRITE_CHUNK, Tiering, Tiers

# threading.Lock, or the native path's StoreLock (datapath.nativeloop), which behaves the same
StoreLock: TypeAlias = ContextManager

TICKS_PER_SECOND = 100  # 10 ms ticks: uint32 lasts 497 days, then ticks are rebased
_TICK_REBASE = 1 << 31
_FEW_PAGES = 8  # requests up to this many pages take the scalar read path
_MOVED_RETRIES = 3  # reads done again when a disk blob moved under them (objects.Moved)
# Decompressed frames kept for the reads of their other pages. Readahead reads a frame's
# pages over a whole swap-in pass, not in one burst (the kernel reclaimed them together but
# they are faulted back in address order): on the demo 8 frames decoded each frame 2.8 times
# on average, 32 frames 2.3, 128 frames 2.0 (BENCHMARKS.md, "Frame decodes").
_FRAME_CACHE_FRAMES = 32
# s: a frame copy not read for this long is dropped by the maintainer: its readahead burst is
# over, the kernel holds the pages it read, and the copy would count in stored_mem at rest
FRAME_CACHE_IDLE = 0.5
# slots emptied per hold of the store lock (forget_freed, and the whole pages of a trim or
# zero): each is a release in Python (~25 us), so 1024 held the lock ~30 ms and a 2 MiB
# discard ~13 ms (BENCHMARKS.md, "The store lock's long holds")
RELEASE_CHUNK = 256
_SNAPSHOT_READERS_WITHIN = 60.0  # s: the maintainer refreshes cached stats read this recently
# s: and at most this often. The scan holds the store lock (~40 ms per 64Ki pages stored,
# BENCHMARKS.md): at most once per 2 s however many scrapes come, instead of once per scrape.
SNAPSHOT_REFRESH_EVERY = 2.0


def make_warm_codec(algorithm: str, page_size: int) -> Codec | PooledCodec | None:
    """The warm form's codec (compression.warm_algorithm); None for "none" (frames at once).
    Pooled: request threads compress warm pages before they take the lock."""
    if algorithm == "none":
        return None
    level = 1  # the fast end: lz4's default acceleration, zstd's fastest regular level
    if algorithm == "lz4":  # no state between calls: one codec for every thread, no pool lock
        return make_codec(algorithm, level, page_size)
    return PooledCodec(lambda: make_codec(algorithm, level, page_size))


def _ticks(seconds: float) -> int:
    return int(seconds * TICKS_PER_SECOND)


class PageStore:
    def __init__(
        self,
        size: int,
        *,
        algorithm: str = "zstd",
        level: int = 3,
        max_size: int | None = None,
        tiering: Tiering | None = None,
        page_size: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        dictionary: str | list[str] = "none",
        frame_pages: int = 1,
        dedup: bool = True,
        hasher: HashFn | None = None,
        warm_algorithm: str = "none",
        lock: StoreLock | None = None,
        pool_memfd: int | None = None,
        disk_tier: DiskTier | None = None,
    ) -> None:
        """`pool_memfd` and `disk_tier`: the pool's memfd and the disk tier of a store handed
        over (`adopt`, store.handover), which restores their books; otherwise a new pool,
        and a new tier file at `tiering.swap_out_path`."""
        if page_size != 4096:
            raise ValueError("only 4096-byte pages are supported")
        if not 1 <= frame_pages <= MAX_FRAME_PAGES:
            raise ValueError(f"frame_pages {frame_pages} outside 1..{MAX_FRAME_PAGES}")
        if size <= 0 or size % page_size:
            raise ValueError(f"device size {size} must be a positive multiple of {page_size}")
        if size > MAX_DEVICE_SIZE:  # the slot and index columns name blobs with 32 bits
            raise ValueError(f"device size {size} above the maximum {MAX_DEVICE_SIZE}")
        tiering = tiering or Tiering()
        if max_size is not None:
            tiering.max_size = max_size
        self.tiering = tiering
        self.size = size
        self.page_size = page_size
        self.nslots = size // page_size
        # the books a crash must not lose, on memfds another process can hold (store.shared)
        self.shared = SharedTables()
        self.slots = SlotTable(self.nslots, self.shared)
        # the slot columns, for reading (tests, accounting)
        self.frame_pages = frame_pages
        writer = make_codec(algorithm, level, page_size)
        # Pooled: request threads compress their frames before they take the lock.
        self.frame_codec = (
            PooledCodec(lambda: make_codec(algorithm, level, frame_pages * page_size))
            if frame_pages > 1 else None
        )
        # compression.dictionary: loads (and checks) the dictionaries now, so a missing or
        # corrupt file stops the server at startup; picks one per write request later.
        self.dicts = StoreDictionaries(writer, dictionary, level, page_size, clock=clock,
                                       frame_writer=self.frame_codec, frame_pages=frame_pages)
        self.codecs = CodecSet(writer, self.dicts.registry)
        # every dictionary where a crash does not lose it, before a writer may take it
        self.share_dictionaries()
        self.dicts.registry.on_added = self._share_dictionary
        self.dicts.registry.on_unloaded = lambda dict_id: self.shared.drop(f"dict_{dict_id}")
        max_blob = frame_pages * MAX_COMPRESSED if frame_pages > 1 else page_size
        self.pool = Pool(tiering.max_size, page_size, max_blob, memfd=pool_memfd)
        self.disk = disk_tier
        if disk_tier is None and tiering.swap_out_path:
            self.disk = DiskTier(tiering.swap_out_path, tiering.swap_out_max_size)
        if self.disk is not None and self.disk.key() is not None:
            self.shared.put_bytes("disk_key", self.disk.key(), {"path": self.disk.path})
        self.blobs = BlobTable(self.shared, frame_pages=frame_pages)
        sub_mask = (1 << SUB_BITS) - 1
        # a resize re-places entries by their full keys, which the blob table keeps
        self.index = DedupIndex(enabled=dedup, key_of=lambda values: self.blobs.members[
            (values >> SUB_BITS).astype(np.int64), (values & sub_mask).astype(np.int64)])
        self.counters = Counters()
        self.hot = HotCache(tiering.hot_cache_size)
        frames = HotCache(_FRAME_CACHE_FRAMES * frame_pages * page_size if frame_pages > 1 else 0)
        self.objects = Objects(blobs=self.blobs, index=self.index, pool=self.pool,
                               disk=self.disk, codecs_=self.codecs, hot=self.hot,
                               frames=frames, counters=self.counters, page_size=page_size)
        self._zero_page = bytes(page_size)
        # The one lock of the store's books; the native request path (datapath.native)
        # passes its own, which its threads take without the GIL. Fixed once the store is
        # built (the parts hold it): to wrap it, pass the wrapper here.
        self.lock: StoreLock = lock if lock is not None else threading.Lock()
        # Reads served from these tables by another request path (the native one):
        # {"reads", "bytes_read", "in_flight"}, for the stats and the recompressor.
        self.outside: Callable[[], dict[str, int]] = dict
        # Runs under the lock when a table the native path reads by address is replaced.
        self.on_tables_moved: Callable[[], None] = lambda: None
        # That path's own cache of decoded frames, trimmed with ours (under the lock).
        self.outside_drop_idle: Callable[[float], None] = lambda seconds: None
        self.blobs.on_moved = self.pool.on_moved = self.index.on_moved = self._tables_moved
        self._clock = clock
        self._t0 = clock()
        self._tick_base = 0
        self.hot_ticks = _ticks(tiering.hot_threshold_ms / 1000)
        self.warm_ticks = _ticks(tiering.warm_threshold_ms / 1000)
        self.cold_ticks = _ticks(tiering.cold_grace_period)
        self.warm_codec = make_warm_codec(warm_algorithm, page_size)
        self.placer = Placer(objects=self.objects, codecs=self.codecs,
                             frame_codec=self.frame_codec, dicts=self.dicts,
                             counters=self.counters, frame_pages=frame_pages,
                             hot_ticks=self.hot_ticks, dedup=dedup, hasher=hasher,
                             warm_codec=self.warm_codec)
        # requests started and finished (next() on a count is atomic under the GIL): the
        # recompressor gives way while the difference is not 0
        self._started, self._finished = itertools.count(), itertools.count()
        self._started_n = self._finished_n = 0
        # rung when the store needs its maintainer now (tiering.Maintainer waits on it)
        self.doorbell = Doorbell()
        # What the background work and the accounting get of this store, instead of the
        # store itself (store.parts). The request paths below use the attributes above
        # directly: the parts add no step to a request.
        self.parts = StoreParts(
            page_size=page_size, frame_pages=frame_pages, slots=self.slots, blobs=self.blobs,
            index=self.index, pool=self.pool, disk=self.disk, objects=self.objects,
            placer=self.placer, codecs=self.codecs, frame_codec=self.frame_codec,
            warm_codec=self.warm_codec, dicts=self.dicts, counters=self.counters,
            lock=self.lock, now=self.now, warm_ticks=self.warm_ticks,
            cold_ticks=self.cold_ticks, doorbell=self.doorbell)
        self.recompressor = Recompressor(self.parts, tiering.recompress_cpu,
                                         in_flight=self.requests_in_flight)
        self.tiers = Tiers(self.parts, tiering)
        self.objects.promote = self.tiers.promote
        self.reclaim_bytes = self.tiers.reclaim_bytes
        self.reclaim_target = self.tiers.reclaim_target
        # A copy of the kernel's swap map of our area, or None (datapath.freed.FreedSlots,
        # device.swap_map): the maintainer forgets the slots it calls free (forget_freed).
        self.kernel_map: Callable[[], np.ndarray | None] | None = None
        # Whether the host is short of memory (the server's datapath.pressure.HostPressure):
        # returned copies then go to the disk tier (policy.returned_to_disk: pressure).
        self.pressure: Callable[[], bool] = lambda: False
        # stats for the server's `stats` verb, refreshed by the maintainer (accounting.StatsCache)
        self.snapshots = accounting.StatsCache(self.stats, time.monotonic)

    @classmethod
    def from_config(cls, size: int, config, **kwargs) -> PageStore:
        return cls(
            size,
            algorithm=config.compression.algorithm,
            level=config.compression.level,
            tiering=Tiering.from_config(config),
            page_size=config.compression.page_size,
            dictionary=config.compression.dictionary,
            frame_pages=config.compression.frame_pages,
            dedup=config.compression.dedup == "on",
            warm_algorithm=config.compression.warm_algorithm,
            **kwargs,
        )

    # -- handover: the store to another process without copying the pool (issue 28) -----

    def export(self) -> Exported:
        """This store as another process adopts it (store.handover): the header, and the
        descriptors [pool memfd, tables memfd, disk tier fd (if any)]. The store must be
        quiesced: no request in flight, the maintainer stopped, no other holder of the
        lock (a native path bound to it closed first: `release` unmaps what it reads).
        The descriptors are the caller's (duplicates): it closes them once sent. Exporting
        changes nothing: a store whose successor failed goes on serving; one that was
        taken over is `release()`d, never closed."""
        return handover.export(self)

    @classmethod
    def adopt(cls, size: int, config, exported: Exported, *, lock: StoreLock | None = None,
              **kwargs) -> PageStore:
        """The store another process `export`ed, built for `config` (from_config's
        arguments): its pool mapped from the memfd (no copy), every book restored. Raises
        StoreError naming the config key when the config cannot take it
        (handover.LAYOUT_KEYS, or a pool or tier cap below what is held). Takes ownership
        of the descriptors."""
        return handover.adopt(cls, size, config, exported, lock=lock, **kwargs)

    @classmethod
    def recover(cls, size: int, config, held: recovery.Held, *, lock: StoreLock | None = None,
                **kwargs) -> tuple[PageStore, recovery.Repair]:
        """The store of a server that died, rebuilt from what its holder kept
        (store.recovery), and what the repair found. The descriptors stay the caller's."""
        return recovery.recover(cls, size, config, held, lock=lock, **kwargs)

    def attach_holder(self, on_new: NewFn, on_drop: DropFn) -> None:
        """Hand a holder every descriptor a recovery needs (store.recovery names them):
        the pool's memfd, the disk tier's file, then the shared tables, now and as they
        come (SharedTables.attach)."""
        on_new(recovery.POOL_NAME, self.pool.memfd, {"kind": "pool", "span": self.pool.span})
        if self.disk is not None:
            on_new(recovery.DISK_NAME, self.disk.fd, {"kind": "disk", "path": self.disk.path})
        self.shared.attach(on_new, on_drop)

    def release(self) -> None:
        """After `export`: let go of the store without freeing anything another process
        may have adopted: the arenas are unmapped, the pool memfd and the tier file's
        descriptor closed; no arena is punched, the tier file is neither truncated nor
        removed. The store is unusable afterwards."""
        with self.lock:
            self.pool.release()
            if self.disk is not None:
                self.disk.release()
            self.hot.clear()
            self.objects.frames.clear()
        self.shared.close()
        self.doorbell.close()

    def share_dictionaries(self) -> None:
        """Every registered dictionary into the shared tables (store.shared), again: after
        a handover restored the registry as it was."""
        for entry in self.dicts.registry.loaded():
            self._share_dictionary(entry)

    def _share_dictionary(self, entry: LoadedDict) -> None:
        self.shared.put_bytes(f"dict_{entry.id}", entry.content, {
            "id": entry.id, "name": entry.name, "source": entry.source,
            "dict_kind": entry.kind, "frames": entry.frames, "candidate": entry.candidate,
            "info": json.loads(json.dumps(entry.info, default=str)),
            "setting": json.loads(json.dumps(self.dicts.setting))})

    @property
    def frames(self) -> HotCache:
        """The cache of decompressed frames."""
        return self.objects.frames

    # -- public requests -------------------------------------------------------------

    def requests_in_flight(self) -> int:
        """Requests between their start and their end (a moment's view, lock-free)."""
        outside = self.outside().get("in_flight", 0)
        return max(0, self._started_n - self._finished_n) + outside

    def wake(self) -> None:
        """Ask the maintainer to come now."""
        self.doorbell.ring()

    def _tables_moved(self) -> None:
        self.on_tables_moved()

    def columns(self) -> dict[str, np.ndarray]:
        """Under the lock: the books a request path outside Python reads and writes by
        address (datapath.native), valid until `on_tables_moved` runs. Its rows of `members`
        are `frame_pages` wide."""
        slots, blobs, pool, index = self.slots, self.blobs, self.pool, self.index
        fps, vals = index.arrays()
        return {
            "kind": slots.kind, "handle": slots.handle, "sub": slots.sub,
            "slot_rtime": slots.rtime, "chunk_live": slots.chunk_live,
            "chunk_touched": slots.chunk_touched, "chunk_written": slots.chunk_written,
            "slot_state": slots.state, "slot_switch": slots.switching, "words": slots.words.words,
            "arena": blobs.arena, "cell": blobs.cell, "tier": blobs.tier,
            "length": blobs.length, "pages": blobs.pages, "codec": blobs.codec,
            "dict_id": blobs.dict_id, "ref": blobs.ref, "atime": blobs.atime,
            "rtime": blobs.rtime, "csum": blobs.csum, "gen": blobs.gen, "form": blobs.form,
            "disk_off": blobs.disk_off,
            "members": blobs.members, "blob_state": blobs.state,
            "index_fps": fps, "index_vals": vals, "index_state": index.state,
            **pool.columns(),
            "codec_pages": self.objects.codec_pages,
        }

    @property
    def tick_base(self) -> int:
        """What `now` subtracts (moved by a rebase, which calls on_tables_moved)."""
        return self._tick_base

    @property
    def clock_origin(self) -> float:
        """The clock reading of tick 1 (`now`)."""
        return self._t0

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def _begin(self) -> None:
        self._started_n = next(self._started) + 1

    def _end(self) -> None:
        self._finished_n = next(self._finished) + 1

    def write(self, buf, offset: int) -> None:
        self._begin()
        try:
            self._write_request(buf, offset)
        finally:
            self._end()

    def _write_request(self, buf, offset: int) -> None:
        data = memoryview(buf).cast("B")
        # The expensive part, compressing the request's frames, happens before the lock, so
        # that reads and other writes do not wait behind it (placement.Placer.prepare).
        in_range = 0 <= offset and offset + len(data) <= self.size
        early = self.placer.prepare(data, offset) if in_range else None
        with self.lock:
            self._check_range(offset, len(data))
            self.counters.writes += 1
            try:
                self._write(data, offset, early)
            except StoreFull:
                self.counters.enospc += 1
                raise
            except Exception:
                self.counters.errors += 1
                raise
            self.counters.bytes_written += len(data)
        if self.pool.allocated_bytes >= self.reclaim_bytes:
            self.wake()

    def readinto(self, buf, offset: int) -> None:
        self._begin()
        try:
            for _ in range(_MOVED_RETRIES):
                try:
                    self._read_request(buf, offset)
                    return
                except Moved:  # a disk blob freed and its extent reused meanwhile: again
                    continue
            self._read_request(buf, offset)
        finally:
            self._end()

    def _read_request(self, buf, offset: int) -> None:
        out = memoryview(buf).cast("B")
        # Blobs are decompressed after the lock (objects.Deferred), and disk blobs read after
        # it, so that a read's decompression or disk wait does not hold up other requests.
        late: dict[int, tuple[Deferred, list[tuple[int, int]]]] = {}
        with self.lock:
            self._check_range(offset, len(out))
            self.counters.reads += 1
            try:
                self._readinto(out, offset, late)
            except Exception:
                self.counters.errors += 1
                raise
            self.counters.bytes_read += len(out)
        if late:
            self._finish_reads(out, late)

    def _finish_reads(self, out: memoryview,
                      late: dict[int, tuple[Deferred, list[tuple[int, int]]]]) -> None:
        """Decompress each deferred blob once, copy its pages out, then cache the copies.
        Frames this request decodes come first, then those it waits for (another request
        decodes them): a request never waits while others wait for it."""
        page = self.page_size
        done: list[tuple[Deferred, bytes]] = []
        failed: list[tuple[Deferred, BaseException]] = []
        order = sorted(late.values(), key=lambda entry: entry[0].wait_for is not None)
        for blob_late, places in order:
            try:
                data = memoryview(self.objects.finish(blob_late))
            except BaseException as exc:  # every deferred blob is finished, or others wait
                failed.append((blob_late, exc))
                continue
            for i, sub in places:
                out[i * page : (i + 1) * page] = data[sub * page : (sub + 1) * page]
            done.append((blob_late, data.obj))
        moved = False
        with self.lock:
            for blob_late, data in done:
                self.objects.adopt(blob_late, data)
            for blob_late, exc in failed:
                self.objects.settle(blob_late)
                if (blob_late.disk_off is not None and blob_late.wait_for is None
                        and not self.objects.unmoved(blob_late)):
                    moved = True  # freed since the lock: its extent may hold another blob
                elif isinstance(exc, Corrupt) and blob_late.wait_for is None:
                    self.objects.note_corrupt(exc)  # once, by the request that found it
                elif isinstance(exc, DiskError) and blob_late.wait_for is None:
                    self.counters.disk_errors += 1
            if failed and not moved:
                self.counters.errors += 1
        if moved:
            raise Moved()
        if failed:
            raise failed[0][1]

    def read(self, offset: int, length: int) -> bytearray:
        if length < 0:
            raise OutOfRange(f"negative length {length}")
        buf = bytearray(length)
        self.readinto(buf, offset)
        return buf

    def trim(self, offset: int, length: int) -> None:
        self._check_range(offset, length)
        with self.lock:
            self.counters.trims += 1
        self._discard_in_holds(offset, length)

    def zero(self, offset: int, length: int) -> None:
        self._check_range(offset, length)
        with self.lock:
            self.counters.zeroes += 1
        self._discard_in_holds(offset, length)

    def _discard_in_holds(self, offset: int, length: int) -> None:
        """RELEASE_CHUNK pages per hold of the store lock: a read beside a trim waits for a
        share of it, not all of it (the kernel discards a whole 2 MiB cluster at once). A
        request that overlaps a trim in flight gets no promise from a block device about the
        order, and each page still ends either before or after."""
        step = RELEASE_CHUNK * self.page_size
        end = offset + length
        while True:
            part = min(end, (offset // step + 1) * step) - offset
            with self.lock:
                self._discard(offset, part)
            offset += part
            if offset >= end:
                return

    def flush(self) -> None:
        # Swap is not durable across a restart; the disk tier is written back per request.
        with self.lock:
            self.counters.flushes += 1

    def health(self) -> dict:
        """Proof of life for `status`: answered only once the store lock is free, so a
        wedged request path shows up as a timeout, not as a healthy server."""
        with self.lock:
            return {"reads": self.counters.reads, "writes": self.counters.writes}

    # -- clock -----------------------------------------------------------------------

    def now(self) -> int:
        """The current tick, >= 1 (0 means "never")."""
        tick = _ticks(self._clock() - self._t0) + 1 - self._tick_base
        if tick >= _TICK_REBASE:
            self._rebase(tick - _TICK_REBASE // 2)
            tick -= _TICK_REBASE // 2
        return tick

    def _rebase(self, shift: int) -> None:
        # The slots' 16-bit read ticks are left as they are (rewriting them would touch the
        # whole table): the blobs' rebased ticks guard them (_pingpong), so at worst the
        # writes of one hot window after a rebase (every 248 days) go uncounted.
        for times in (self.blobs.atime, self.blobs.rtime):
            times[:] = np.maximum(times.astype(np.int64) - shift, 0).astype(np.uint32)
        self._tick_base += shift
        self._tables_moved()

    # -- ranges ----------------------------------------------------------------------

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutOfRange(f"range {offset}+{length} outside the device (0..{self.size})")

    def _span(self, offset: int, length: int) -> tuple[int, int]:
        """First slot and slot count covering the byte range."""
        page = self.page_size
        first = offset // page
        end = -(-(offset + length) // page)
        return first, end - first

    def _write(self, data: memoryview, offset: int, early: Prepared | None = None) -> None:
        if not data:
            return
        page = self.page_size
        if offset % page == 0 and len(data) % page == 0:
            self._write_pages(offset // page, data, early)
            return
        first, count = self._span(offset, len(data))
        whole = bytearray(count * page)
        self._readinto_pages(memoryview(whole), first, count, touch=False)
        start = offset - first * page
        whole[start : start + len(data)] = data
        self._write_pages(first, memoryview(whole))

    def _discard(self, offset: int, length: int) -> None:
        """Whole pages inside the range become empty; partial edges are rewritten with zeros."""
        if not length:
            return
        page = self.page_size
        end = offset + length
        inner_first = -(-offset // page)
        inner_end = end // page
        if inner_end <= inner_first:
            self._write(memoryview(bytes(length)), offset)
            return
        zeros = memoryview(self._zero_page)
        if offset % page:
            self._write(zeros[: inner_first * page - offset], offset)
        self._release_slots(inner_first, inner_end - inner_first)
        if end % page:
            self._write(zeros[: end - inner_end * page], inner_end * page)

    # -- pages -----------------------------------------------------------------------

    def _write_pages(self, first: int, data: memoryview, early: Prepared | None = None) -> None:
        page = self.page_size
        count = len(data) // page
        now = self.now()
        if early is None:
            early = self.placer.split(data, count)
        if early.same.any():
            refused = self.slots.words.refused(early.handle[early.same])
            if refused.any():  # no room for their words: those pages are stored as blobs
                not_same = np.zeros(count, dtype=bool)
                not_same[np.flatnonzero(early.same)[refused]] = True
                early = self.placer.split(data, count, not_same)
        new_kind, new_handle = early.kind, early.handle
        new_sub = np.zeros(count, dtype=np.uint8)
        staged: list[int] = []  # one entry per blob reference taken for this request
        disk_before = self.disk.writes if self.disk else 0
        todo, pages = early.todo, early.pages
        self.dicts.maybe_collect(self.blobs)
        placed: list[tuple[int, int]] = [(0, 0)] * len(pages)  # (blob, page in blob)
        try:
            self.placer.place(pages, now, placed, staged, early.hashes, early.frames, early.copies,
                              early.warm)
            if self.disk and self.disk.writes != disk_before:
                # Inside the try: a failed write-back fails the request and releases its
                # staged blobs (they used to leak, with no slot referring to them).
                self.objects.drop_disk_cache()
        except BaseException:
            for blob in staged:
                self.objects.release(blob)
            raise
        for n, i in enumerate(todo):
            new_handle[i], new_sub[i] = placed[n]
        self.counters.pingpong += self._pingpong(first, count, now)
        self._release_slots(first, count)  # also clears the slots' last-read ticks
        self.slots.fill(first, new_kind, new_handle, new_sub)

    def _pingpong(self, first: int, count: int, now: int) -> int:
        """Slots of [first, first+count) read within hot_threshold_ms: the low 16 bits of
        the slot's last read say so, and its blob's full last-read tick (a read of this
        slot or of another page of its blob) rules out a wrapped 16-bit tick."""
        rt = self.slots.rtime[first : first + count]
        read = np.flatnonzero(rt)
        if not len(read):
            return 0
        hot = self.hot_ticks
        recent = np.ones(len(read), dtype=bool)
        if hot <= TICK_MASK // 2:  # else the low bits cannot tell: the blob's tick decides
            recent = ((now - rt[read].astype(np.int64)) & TICK_MASK) <= hot
        blob_rt = self.blobs.rtime[self.slots.handle[first : first + count][read]].astype(np.int64)
        return int(np.count_nonzero(recent & (blob_rt > 0) & (now - blob_rt <= hot)))

    def _release_slots(self, first: int, count: int) -> None:
        """Drop what the slots hold (before they are overwritten or emptied), visiting only
        chunks that hold something."""
        slots = self.slots
        for chunk, lo, n in slots.runs_in_use(first, count):
            kinds = slots.kind[lo : lo + n]
            held = np.flatnonzero(kinds == BLOB)
            if len(held):
                for blob in slots.handle[lo : lo + n][held].astype(np.int64).tolist():
                    self.objects.release(blob)
            slots.clear(lo, n)
            slots.recount(chunk)

    def _page_of(self, data: bytes, slot: int) -> bytes | memoryview:
        """A slot's page out of its blob's decompressed bytes."""
        if len(data) == self.page_size:
            return data
        page, sub = self.page_size, int(self.slots.sub[slot])
        return memoryview(data)[sub * page : (sub + 1) * page]

    def _readinto(self, out: memoryview, offset: int, late: dict | None = None) -> None:
        """`late`: where pool blobs left to decompress after the lock go (aligned reads only;
        the unaligned path copies out of a bounce buffer before that)."""
        if not out:
            return
        page = self.page_size
        if offset % page == 0 and len(out) % page == 0:
            self._readinto_pages(out, offset // page, len(out) // page, late=late)
            return
        first, count = self._span(offset, len(out))
        whole = bytearray(count * page)
        self._readinto_pages(memoryview(whole), first, count)
        start = offset - first * page
        out[:] = whole[start : start + len(out)]

    def _readinto_pages(self, out: memoryview, first: int, count: int, touch: bool = True,
                        late: dict | None = None) -> None:
        if count <= _FEW_PAGES:
            self._readinto_few(out, first, count, touch, late)
            return
        page = self.page_size
        kinds = self.slots.kind[first : first + count]
        handles = self.slots.handle[first : first + count]
        for i in np.flatnonzero(kinds != BLOB).tolist():
            if kinds[i] == EMPTY:
                out[i * page : (i + 1) * page] = self._zero_page
            else:
                out[i * page : (i + 1) * page] = self.slots.words.page(int(handles[i]), page)
        held = np.flatnonzero(kinds == BLOB)
        if not len(held):
            return
        ids = handles[held].astype(np.int64)
        hot = np.zeros(len(held), dtype=bool)
        if touch:
            now = self.now()
            last = self.blobs.rtime[ids].astype(np.int64)
            hot = (last > 0) & (now - last <= self.hot_ticks)
            self.blobs.rtime[ids] = now
            self.blobs.atime[ids] = now
            self.slots.rtime[first : first + count][held] = (now & TICK_MASK) or 1
        for i, blob, is_hot in zip(held.tolist(), ids.tolist(), hot.tolist()):
            self._read_blob(out, i, first + i, blob, is_hot, touch, late)

    def _read_blob(self, out: memoryview, i: int, slot: int, blob: int, is_hot: bool,
                   touch: bool, late: dict | None) -> None:
        """Page `i` of `out` from `blob`, now, or noted in `late` for after the lock."""
        if late is None:
            data = self.objects.fetch(blob, is_hot, touch)
        elif blob in late:
            late[blob][1].append((i, int(self.slots.sub[slot])))
            return
        else:
            data = self.objects.fetch_or_defer(blob, is_hot, touch)
            if isinstance(data, Deferred):
                late[blob] = (data, [(i, int(self.slots.sub[slot]))])
                return
        page = self.page_size
        out[i * page : (i + 1) * page] = self._page_of(data, slot)

    def _readinto_few(self, out: memoryview, first: int, count: int, touch: bool,
                      late: dict | None = None) -> None:
        """The same as the vectorized path, page by page: a swap-in fault reads 1-8 pages,
        and for those numpy's per-call overhead costs more than it saves."""
        page = self.page_size
        blobs = self.blobs
        now = self.now() if touch else 0
        for i in range(count):
            slot = first + i
            kind = self.slots.kind[slot]
            if kind == EMPTY:
                out[i * page : (i + 1) * page] = self._zero_page
            elif kind == SAME:
                out[i * page : (i + 1) * page] = self.slots.words.page(int(self.slots.handle[slot]), page)
            else:
                blob = int(self.slots.handle[slot])
                is_hot = False
                if touch:
                    last = int(blobs.rtime[blob])
                    is_hot = last > 0 and now - last <= self.hot_ticks
                    blobs.rtime[blob] = now
                    blobs.atime[blob] = now
                    self.slots.rtime[slot] = (now & TICK_MASK) or 1
                self._read_blob(out, i, slot, blob, is_hot, touch, late)

    # -- what the kernel freed without telling us -----------------------------------------

    def forget_freed(self, read_map: Callable[[], np.ndarray | None]) -> int:
        """Empty the slots the kernel has freed without a discard (docs/ARCHITECTURE.md,
        "What the kernel tells the device"). `read_map` returns a copy of the kernel's swap
        map of our area, one byte per slot, 0 = free (datapath.swapmap), or None. A slot's
        copy goes only if the map calls it free and its chunk (one swap cluster) saw no write
        since before the map was read: the kernel allocates a slot before it writes it, so
        a slot read as free and written since is skipped, and one written after the copy is
        gone holds the new bytes. Returns the slots emptied."""
        with self.lock:
            self.slots.chunk_written[:] = 0
        kernel = read_map()
        if kernel is None:
            return 0
        slots = self.slots
        n = min(len(kernel), self.nslots)
        with self.lock:
            chunks = np.flatnonzero((slots.chunk_live > 0) & (slots.chunk_written == 0))
        chunks = chunks[chunks * CHUNK_SLOTS < n]
        done = 0
        for first in range(0, len(chunks), SCAN_CHUNKS):  # a share of the table per hold
            with self.lock:
                share = chunks[first : first + SCAN_CHUNKS]
                idx = slots.ids_of(share[slots.chunk_written[share] == 0])
                idx = idx[idx < n]
                freed = idx[(slots.kind[idx] != EMPTY) & (kernel[idx] == 0)]
            for start in range(0, len(freed), RELEASE_CHUNK):
                with self.lock:  # a chunk's cluster may have been written meanwhile: skip those
                    part = freed[start : start + RELEASE_CHUNK]
                    part = part[(slots.chunk_written[part // CHUNK_SLOTS] == 0)
                                & (slots.kind[part] != EMPTY)]
                    for run in np.split(part, np.flatnonzero(np.diff(part) != 1) + 1):
                        if len(run):
                            self._release_slots(int(run[0]), len(run))
                    self.counters.kernel_freed_pages += len(part)
                    done += len(part)
        return done

    # -- tiers, accounting (the work is in `tiering` and `accounting`) -----------------

    def demote_cold(self, limit: int = DEMOTE_CHUNK) -> int:
        return self.tiers.demote_cold(limit)

    def rewrite_sparse_frames(self, limit: int = REWRITE_CHUNK) -> int:
        return self.tiers.rewrite_sparse_frames(limit)

    def needs_compaction(self) -> bool:
        return self.tiers.needs_compaction()

    def compact(self) -> int:
        return self.tiers.compact()

    def maintain(self) -> dict:
        """One round of background work (the maintainer's, and the control socket's
        `reclaim`). The order of its steps is here and nowhere else: forget the slots the
        kernel freed; grow the tables ahead of need (dedup index, blob table, arena
        books); drop the dead pages of sparse frames; pack warm pages (before anything
        is demoted: under pool pressure the oldest first, whatever their age, since a
        dense frame is what should go to disk, if anything); give back the blob table's
        top; move returned copies to disk (policy.returned_to_disk); demote while the
        pool is above its reclaim threshold; compact; punch freed disk extents; drop idle
        frame copies; refresh the stats a scraper reads."""
        forgotten = self.forget_freed(self.kernel_map) if self.kernel_map is not None else 0
        tiers = self.tiers
        tiers.resize_index()
        tiers.grow_blob_table()
        tiers.grow_arena_books()
        rewritten = tiers.rewrite_sparse_rounds()
        recompressed = self.recompressor.run(pressure=tiers.reclaiming())
        tiers.compact_rows()  # 16 warm rows became one frame's: the top of the table goes back
        demoted = 0
        if tiers.returned_go_to_disk(self.pressure):
            demoted += tiers.demote_returned()
        demoted += tiers.reclaim()
        compacted = tiers.compact_if_fragmented()
        tiers.punch_freed()
        with self.lock:
            self.objects.frames.drop_idle(FRAME_CACHE_IDLE)
            self.outside_drop_idle(FRAME_CACHE_IDLE)
        # one scan per round, and only while someone reads the cached stats (a scraper)
        self.snapshots.refresh_if_read(_SNAPSHOT_READERS_WITHIN, SNAPSHOT_REFRESH_EVERY)
        # the control socket's `reclaim` answer: frames keep the interface's name, "units"
        return {"demoted": demoted, "compacted": compacted, "units_rewritten": rewritten,
                "recompressed": recompressed, "kernel_freed": forgotten}

    def meta_bytes(self) -> int:
        """Everything held in memory besides pool arenas (accounting.meta_parts)."""
        return sum(accounting.meta_parts(self.parts).values())

    def stored_mem(self) -> int:
        return accounting.stored_mem(self.parts, self.meta_bytes(), self.outside)

    def stats(self) -> dict:
        """Exact stats: the books copied under the store lock, counted after it."""
        return accounting.stats(self.parts, recompressor=self.recompressor,
                                reclaim_bytes=self.reclaim_bytes, outside=self.outside)

    def cached_stats(self, max_age: float = 0.0) -> tuple[dict, float]:
        """Stats at most `max_age` seconds old, and their age (accounting.StatsCache)."""
        return self.snapshots.get(max_age)

    def slot_sizes(self, slots) -> dict:
        with self.lock:
            return accounting.slot_sizes(self.parts, slots)

    def check(self) -> None:
        """Cross-check every invariant of the books; raises AssertionError. For tests."""
        with self.lock:
            accounting.check(self.parts)

    def close(self) -> None:
        with self.lock:
            self._release_slots(0, self.nslots)
            if self.disk is not None:
                self.disk.close()
            self.pool.release()  # empty by now: every arena punched
        self.shared.close()
        self.doorbell.close()
