"""PageStore: the device as an array of 4 KiB slots, each empty, same-filled or a blob.

Write path for a request: split into whole pages (read-modify-write for unaligned edges);
find same-filled pages for the whole request at once with numpy; for the rest, hash
(128-bit xxh3), share an existing blob when the bytes are equal, else compress, store raw
when compression does not pay, and put the result in a pool cell (or, with the pool at its
cap, straight in the disk tier). All new blobs are staged first; only when every page of
the request has a home are the slots switched over and the old blobs released, so a full
store or a codec failure leaves the device exactly as it was.

The slot table is preallocated numpy arrays (kind, handle, page in unit, last read): 14
bytes per slot and no Python object per page. `handle` is the blob id, or the repeated
64-bit word of a same-filled page (zram's trick).

Multi-page units (`compression.unit_pages` > 1): the pages of a request that are neither
same-filled nor duplicates are compressed together, `unit_pages` at a time, into one blob;
each slot names the blob and its page in it. The unit lives while any slot holds one of its
pages: an overwrite or trim of one page drops that slot's reference and leaves the others
readable. A read decompresses the whole unit once and keeps the copy in a small cache, since
the kernel reads the neighbouring pages right after (swap readahead, the next fault).

Tiers: blobs live in the pool (memory) or the disk tier. Each blob carries its last access
and last read tick; the maintenance worker (`maintain`) demotes the coldest to disk when
the pool passes `reclaim_threshold`, and compacts the pool when it is fragmented. A read
of a disk blob promotes it while the pool is below the threshold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from . import codec as codecs
from . import tables
from .blobs import DISK, POOL, BlobTable
from .codec import CodecError, CodecSet, make_codec
from .config import MAX_UNIT_PAGES
from .dedup import DedupIndex, index_key
from .dictionaries import Choice, StoreDictionaries
from .disk import DiskError, DiskFull, DiskTier
from .hotcache import HotCache
from .pool import MAX_COMPRESSED, Pool, PoolFull
from .protect import array_resident_bytes

EMPTY = 0
SAME = 1
BLOB = 2

TICKS_PER_SECOND = 100  # 10 ms ticks: uint32 lasts 497 days, then ticks are rebased
_TICK_REBASE = 1 << 31
HYSTERESIS_PERCENT = 5  # demotion stops this many points below reclaim_threshold
FRAGMENTATION_TRIGGER = 0.20  # compact when this share of arena bytes holds no live cell
_MIN_COMPACT_BYTES = 1 << 20
_DEMOTE_CHUNK = 512  # blobs moved per lock hold, so requests wait at most one chunk
_FEW_PAGES = 8  # requests up to this many pages take the scalar read path
_SUB_BITS = 5  # dedup index value: blob id << _SUB_BITS | page in the blob
_UNIT_CACHE_UNITS = 8  # decompressed units kept for the reads of their other pages
CHUNK_SLOTS = 512  # slot-table bookkeeping unit: one page of `handle`, one swap cluster
# Sparse units rewritten per lock hold: each costs a scan share, a decompression and a
# compression (measured: 64 units of 16 pages in 36 ms), so requests wait ~10 ms at most.
_REWRITE_CHUNK = 16
_REWRITE_ROUNDS = 8  # lock holds per maintenance round

_MASK64 = (1 << 64) - 1


class StoreError(Exception):
    """Base of the errors a request can end in; the device is unchanged after each."""


class OutOfRange(StoreError):
    """The byte range is negative or runs past the end of the device (EINVAL)."""


class StoreFull(StoreError):
    """No room for the request's pages in any tier (ENOSPC); the kernel keeps them."""


@dataclass
class Counters:
    reads: int = 0
    writes: int = 0
    trims: int = 0
    zeroes: int = 0
    flushes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    enospc: int = 0
    errors: int = 0
    dedup_hits: int = 0
    hash_collisions: int = 0
    pingpong: int = 0  # pages written again within hot_threshold_ms of being read
    demotions: int = 0
    promotions: int = 0
    direct_to_disk: int = 0  # new pages written straight to disk (pool at its cap)
    disk_full: int = 0
    disk_errors: int = 0
    compactions: int = 0
    pages_moved: int = 0  # cells moved by compaction
    hot_hits: int = 0
    units_written: int = 0  # multi-page blobs stored
    unit_fallbacks: int = 0  # groups that compressed too poorly together: stored page by page
    unit_hits: int = 0  # page reads served from the decompressed-unit cache
    units_rewritten: int = 0  # sparse units recompressed without their dead pages
    decoded_bytes: int = 0  # bytes decompressed (a unit's whole size per miss): read amplification


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
        )


def _ticks(seconds: float) -> int:
    return int(seconds * TICKS_PER_SECOND)


class _Chooser:
    """The request's encoder for pages compressed alone (a dictionary or none), picked from
    a sample page of the request, and only when the first such page comes: a request whose
    pages all go into units pays no selection trials."""

    def __init__(self, dicts: StoreDictionaries, pages: list[memoryview]) -> None:
        self._dicts, self._pages = dicts, pages
        self._choice: Choice | None = None

    def get(self) -> Choice:
        if self._choice is None:
            self._choice = self._dicts.choose(self._pages)
        return self._choice


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
        unit_pages: int = 1,
    ) -> None:
        if page_size != 4096:
            raise ValueError("only 4096-byte pages are supported")
        if not 1 <= unit_pages <= MAX_UNIT_PAGES:
            raise ValueError(f"unit_pages {unit_pages} outside 1..{MAX_UNIT_PAGES}")
        if size <= 0 or size % page_size:
            raise ValueError(f"device size {size} must be a positive multiple of {page_size}")
        tiering = tiering or Tiering()
        if max_size is not None:
            tiering.max_size = max_size
        self.tiering = tiering
        self.size = size
        self.page_size = page_size
        self.nslots = size // page_size
        self.kind = tables.zeros(self.nslots, np.uint8)
        self.handle = tables.zeros(self.nslots, np.uint64)
        self.sub = tables.zeros(self.nslots, np.uint8)  # page within a multi-page blob
        self.slot_rtime = tables.zeros(self.nslots, np.uint32)  # for ping-pong
        self._slot_bytes = sum(a.itemsize for a in (self.kind, self.handle, self.sub, self.slot_rtime))
        # Slots in use per chunk, and chunks ever written. The tables above are zero-filled
        # lazily by the kernel: a chunk costs memory once written, and a discard of the whole
        # device (swapon, a sandbox's exit) must not write, or even read, chunks never used.
        nchunks = -(-self.nslots // CHUNK_SLOTS)
        self._chunk_live = np.zeros(nchunks, dtype=np.int32)
        self._chunk_touched = np.zeros(nchunks, dtype=bool)
        self.unit_pages = unit_pages
        writer = make_codec(algorithm, level, page_size)
        # Units get their own compressor: zstd sizes its window from the frame size it is
        # told, and a 4 KiB window could not see the unit's earlier pages.
        self.unit_codec = (
            make_codec(algorithm, level, unit_pages * page_size) if unit_pages > 1 else None
        )
        # compression.dictionary: loads (and checks) the dictionaries now, so a missing or
        # corrupt file stops the server at startup; picks one per write request later.
        self.dicts = StoreDictionaries(writer, dictionary, level, page_size, clock=clock)
        self.codecs = CodecSet(writer, self.dicts.registry)
        max_blob = unit_pages * MAX_COMPRESSED if unit_pages > 1 else page_size
        self.pool = Pool(tiering.max_size, page_size, max_blob)
        self.disk = (
            DiskTier(tiering.swap_out_path, tiering.swap_out_max_size)
            if tiering.swap_out_path
            else None
        )
        self.hot = HotCache(tiering.hot_cache_size)
        self.units = HotCache(_UNIT_CACHE_UNITS * unit_pages * page_size if unit_pages > 1 else 0)
        self.blobs = BlobTable(unit_pages=unit_pages)
        self.index = DedupIndex()
        self.counters = Counters()
        self.same_pages = 0
        self.codec_pages = np.zeros(len(codecs.CODEC_NAMES), dtype=np.int64)
        self._zero_page = bytes(page_size)
        self._lock = threading.Lock()
        self._clock = clock
        self._t0 = clock()
        self._tick_base = 0
        self.reclaim_bytes = tiering.max_size * tiering.reclaim_threshold // 100
        self.reclaim_target = max(
            0, tiering.max_size * (tiering.reclaim_threshold - HYSTERESIS_PERCENT) // 100
        )
        self._hot_ticks = _ticks(tiering.hot_threshold_ms / 1000)
        self._warm_ticks = _ticks(tiering.warm_threshold_ms / 1000)
        self._cold_ticks = _ticks(tiering.cold_grace_period)
        self.wake: Callable[[], None] = lambda: None  # set by the maintenance worker

    @classmethod
    def from_config(cls, size: int, config, **kwargs) -> PageStore:
        return cls(
            size,
            algorithm=config.compression.algorithm,
            level=config.compression.level,
            tiering=Tiering.from_config(config),
            page_size=config.compression.page_size,
            dictionary=config.compression.dictionary,
            unit_pages=config.compression.unit_pages,
            **kwargs,
        )

    # -- public requests -------------------------------------------------------------

    def write(self, buf, offset: int) -> None:
        data = memoryview(buf).cast("B")
        with self._lock:
            self._check_range(offset, len(data))
            self.counters.writes += 1
            try:
                self._write(data, offset)
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
        out = memoryview(buf).cast("B")
        with self._lock:
            self._check_range(offset, len(out))
            self.counters.reads += 1
            try:
                self._readinto(out, offset)
            except Exception:
                self.counters.errors += 1
                raise
            self.counters.bytes_read += len(out)

    def read(self, offset: int, length: int) -> bytearray:
        if length < 0:
            raise OutOfRange(f"negative length {length}")
        buf = bytearray(length)
        self.readinto(buf, offset)
        return buf

    def trim(self, offset: int, length: int) -> None:
        with self._lock:
            self._check_range(offset, length)
            self.counters.trims += 1
            self._discard(offset, length)

    def zero(self, offset: int, length: int) -> None:
        with self._lock:
            self._check_range(offset, length)
            self.counters.zeroes += 1
            self._discard(offset, length)

    def flush(self) -> None:
        # Swap is not durable across a restart; the disk tier is written back per request.
        with self._lock:
            self.counters.flushes += 1

    def health(self) -> dict:
        """Proof of life for `status`: answered only once the store lock is free, so a
        wedged request path shows up as a timeout, not as a healthy server."""
        with self._lock:
            return {"reads": self.counters.reads, "writes": self.counters.writes}

    # -- clock -----------------------------------------------------------------------

    def _now(self) -> int:
        """The current tick, >= 1 (0 means "never")."""
        tick = _ticks(self._clock() - self._t0) + 1 - self._tick_base
        if tick >= _TICK_REBASE:
            self._rebase(tick - _TICK_REBASE // 2)
            tick -= _TICK_REBASE // 2
        return tick

    def _rebase(self, shift: int) -> None:
        for times in (self.blobs.atime, self.blobs.rtime, self.slot_rtime):
            times[:] = np.maximum(times.astype(np.int64) - shift, 0).astype(np.uint32)
        self._tick_base += shift

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

    def _write(self, data: memoryview, offset: int) -> None:
        if not data:
            return
        page = self.page_size
        if offset % page == 0 and len(data) % page == 0:
            self._write_pages(offset // page, data)
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

    def _write_pages(self, first: int, data: memoryview) -> None:
        page = self.page_size
        count = len(data) // page
        now = self._now()
        words = np.frombuffer(data, dtype=np.uint64).reshape(count, page // 8)
        same = (words == words[:, :1]).all(axis=1)
        new_kind = np.where(same, SAME, BLOB).astype(np.uint8)
        new_handle = np.where(same, words[:, 0], 0).astype(np.uint64)
        new_sub = np.zeros(count, dtype=np.uint8)
        staged: list[int] = []  # one entry per blob reference taken for this request
        disk_before = self.disk.writes if self.disk else 0
        todo = np.flatnonzero(~same).tolist()
        pages = [data[i * page : (i + 1) * page] for i in todo]
        self.dicts.maybe_collect(self.blobs)
        placed: list[tuple[int, int]] = [(0, 0)] * len(pages)  # (blob, page in blob)
        try:
            self._place(pages, now, placed, staged)
            if self.disk and self.disk.writes != disk_before:
                # Inside the try: a failed write-back fails the request and releases its
                # staged blobs (they used to leak, with no slot referring to them).
                self._drop_disk_cache()
        except BaseException:
            for blob in staged:
                self._unref(blob)
            raise
        for n, i in enumerate(todo):
            new_handle[i], new_sub[i] = placed[n]
        if staged:
            self.codec_pages += np.bincount(
                self.blobs.codec[staged], minlength=len(self.codec_pages)
            )
        rtimes = self.slot_rtime[first : first + count].astype(np.int64)
        self.counters.pingpong += int(
            np.count_nonzero((rtimes > 0) & (now - rtimes <= self._hot_ticks))
        )
        self.same_pages += int(same.sum())
        self._release_slots(first, count)  # also clears the slots' last-read ticks
        self.kind[first : first + count] = new_kind
        self.handle[first : first + count] = new_handle
        self.sub[first : first + count] = new_sub
        c0, c1 = first // CHUNK_SLOTS, -(-(first + count) // CHUNK_SLOTS)
        self._chunk_touched[c0:c1] = True
        for chunk in range(c0, c1):
            self._chunk_live[chunk] = np.count_nonzero(
                self.kind[chunk * CHUNK_SLOTS : (chunk + 1) * CHUNK_SLOTS])

    def _used_slots(self) -> np.ndarray:
        """Indices of the non-empty slots, reading only chunks in use."""
        chunks = np.flatnonzero(self._chunk_live)
        if not len(chunks):
            return np.zeros(0, dtype=np.int64)
        idx = (chunks[:, None] * CHUNK_SLOTS + np.arange(CHUNK_SLOTS)).ravel()
        idx = idx[idx < self.nslots]
        return idx[self.kind[idx] != EMPTY]

    def _blob_slots(self) -> np.ndarray:
        used = self._used_slots()
        return used[self.kind[used] == BLOB]

    def _place(self, pages: list[memoryview], now: int,
               placed: list[tuple[int, int]], staged: list[int]) -> None:
        """Find or store a home for each page: an equal page already stored (any blob, any
        page of a unit), an equal page earlier in this request, or a new blob. Fills
        `placed` and appends every reference taken to `staged`."""
        hashes: list[tuple[int, int]] = []
        fresh: list[int] = []  # positions of pages to store
        first_of: dict[int, int] = {}  # digest -> position of its first fresh page
        repeats: list[tuple[int, int]] = []
        for n, page in enumerate(pages):
            digest = xxhash.xxh3_128_intdigest(page)
            lo, hi = digest & _MASK64, digest >> 64
            hashes.append((lo, hi))
            found = self._lookup(page, lo, hi, now)
            if found is not None:
                placed[n] = found
                staged.append(found[0])
            elif digest in first_of:
                repeats.append((n, first_of[digest]))
            else:
                first_of[digest] = n
                fresh.append(n)
        step = self.unit_pages
        chooser = _Chooser(self.dicts, pages)
        for start in range(0, len(fresh), step):
            self._store_group(fresh[start : start + step], pages, hashes, now, chooser,
                              placed, staged)
        for n, earlier in repeats:
            blob = placed[earlier][0]
            self._ref(blob)
            staged.append(blob)
            placed[n] = placed[earlier]
            self.counters.dedup_hits += 1

    def _lookup(self, page: memoryview, lo: int, hi: int, now: int) -> tuple[int, int] | None:
        """(blob, page in blob) of a stored page equal to `page`, with one more reference."""
        key = index_key(lo)
        blobs = self.blobs
        for ref in self.index.candidates(key):
            blob, sub = ref >> _SUB_BITS, ref & ((1 << _SUB_BITS) - 1)
            if blobs.pages[blob] == 1:
                equal = int(blobs.hash_hi[blob]) == hi and self._blob_bytes(blob) == page
            else:  # unit pages keep only the index key; the bytes decide
                equal = self._unit_page(blob, sub) == page
            if equal:
                self._ref(blob)
                blobs.atime[blob] = now
                self.counters.dedup_hits += 1
                if int(blobs.rtime[blob]) and now - int(blobs.rtime[blob]) <= self._hot_ticks:
                    self.counters.pingpong += 1  # the same content came back right after a read
                return blob, sub
            self.counters.hash_collisions += 1
        return None

    def _store_group(self, group: list[int], pages: list[memoryview],
                     hashes: list[tuple[int, int]], now: int, chooser: _Chooser | None,
                     placed: list[tuple[int, int]], staged: list[int]) -> None:
        """Store the pages at positions `group`: as one unit when there are several and
        they compress well enough together, else one blob per page."""
        if len(group) > 1:
            # No dictionary for units: their own earlier pages are a better one, so the
            # dictionary trainer only sees pages compressed alone.
            compressed = self.unit_codec.compress(b"".join(pages[n] for n in group))
            if len(compressed) <= len(group) * MAX_COMPRESSED:
                blob = self._new_blob(compressed, self.unit_codec.id, 0, 0, 0, now, len(group))
                self.blobs.ref[blob] = len(group)
                for sub, n in enumerate(group):
                    lo = hashes[n][0]
                    key = index_key(lo)
                    self.blobs.members[blob, sub] = key
                    self.index.insert(key, blob << _SUB_BITS | sub)
                    placed[n] = (blob, sub)
                    staged.append(blob)
                self.counters.units_written += 1
                return
            self.counters.unit_fallbacks += 1
        for n in group:
            choice = chooser.get() if chooser is not None else None
            sample = choice.sample_out if choice is not None and n == choice.sample else None
            blob = self._store_page(pages[n], hashes[n], now, choice, sample)
            placed[n] = (blob, 0)
            staged.append(blob)

    def _store_page(self, page: memoryview, digest: tuple[int, int], now: int,
                    choice: Choice | None, compressed: bytes | None = None) -> int:
        """A new one-page blob holding `page`. `choice` is the request's encoder;
        `compressed` the page already compressed by it."""
        encoder = choice.codec if choice is not None else self.codecs.writer
        dict_id = choice.dict_id if choice is not None else 0
        if compressed is None:
            compressed = encoder.compress(page)
        codec_id = encoder.id
        self.dicts.observe(page)
        if len(compressed) > MAX_COMPRESSED:
            compressed, codec_id, dict_id = page, codecs.RAW, 0
        lo, hi = digest
        blob = self._new_blob(compressed, codec_id, dict_id, lo, hi, now)
        self.index.insert(index_key(lo), blob << _SUB_BITS)
        return blob

    def _new_blob(self, compressed, codec_id: int, dict_id: int, lo: int, hi: int, now: int,
                  pages: int = 1) -> int:
        """A blob row for `compressed`, in a pool cell, or on disk with the pool at its cap."""
        blobs = self.blobs
        try:
            arena, cell = self.pool.alloc(len(compressed))
        except PoolFull as exc:
            offset = self._disk_put(compressed, str(exc))
            blob = blobs.new(-1, 0, len(compressed), codec_id, lo, hi, dict_id, pages)
            blobs.tier[blob] = DISK
            blobs.disk_off[blob] = offset
            self.counters.direct_to_disk += 1
        else:
            self.pool.put(arena, cell, compressed)
            blob = blobs.new(arena, cell, len(compressed), codec_id, lo, hi, dict_id, pages)
        blobs.atime[blob] = now
        return blob

    def _disk_put(self, data, why_not_pool: str) -> int:
        if self.disk is None:
            raise StoreFull(why_not_pool)
        try:
            offset = self.disk.alloc(len(data))
        except DiskFull as exc:
            self.counters.disk_full += 1
            raise StoreFull(f"{why_not_pool}; {exc}") from None
        try:
            self.disk.write(offset, data)
        except DiskError:
            self.disk.free(offset, len(data))
            self.counters.disk_errors += 1
            raise
        return offset

    def _drop_disk_cache(self) -> None:
        try:
            self.disk.drop_cache()
        except DiskError:
            self.counters.disk_errors += 1
            raise

    def _ref(self, blob: int) -> None:
        self.blobs.ref[blob] += 1

    def _unref(self, blob: int) -> None:
        blobs = self.blobs
        ref = int(blobs.ref[blob]) - 1
        if ref > 0:
            blobs.ref[blob] = ref
            return
        pages = int(blobs.pages[blob])
        if pages == 1:
            self.index.remove(index_key(int(blobs.hash_lo[blob])), blob << _SUB_BITS)
        else:
            for sub in range(pages):
                self.index.remove(int(blobs.members[blob, sub]), blob << _SUB_BITS | sub)
            self.units.discard(blob)
        self.hot.discard(blob)
        if blobs.tier[blob] == POOL:
            self.pool.free(int(blobs.arena[blob]), int(blobs.cell[blob]))
        else:
            self.disk.free(int(blobs.disk_off[blob]), int(blobs.length[blob]))
        blobs.delete(blob)

    def _release_slots(self, first: int, count: int) -> None:
        """Drop what the slots hold (before they are overwritten or emptied), visiting only
        chunks that hold something."""
        c0, c1 = first // CHUNK_SLOTS, -(-(first + count) // CHUNK_SLOTS)
        for chunk in (c0 + np.flatnonzero(self._chunk_live[c0:c1])).tolist():
            lo = max(first, chunk * CHUNK_SLOTS)
            hi = min(first + count, (chunk + 1) * CHUNK_SLOTS)
            self._release_run(lo, hi - lo)
            self._chunk_live[chunk] = np.count_nonzero(
                self.kind[chunk * CHUNK_SLOTS : (chunk + 1) * CHUNK_SLOTS])

    def _release_run(self, first: int, count: int) -> None:
        kinds = self.kind[first : first + count]
        self.same_pages -= int(np.count_nonzero(kinds == SAME))
        held = np.flatnonzero(kinds == BLOB)
        if len(held):
            ids = self.handle[first : first + count][held].astype(np.int64)
            self.codec_pages -= np.bincount(
                self.blobs.codec[ids], minlength=len(self.codec_pages)
            )
            for blob in ids.tolist():
                self._unref(blob)
        kinds[:] = EMPTY
        self.handle[first : first + count] = 0
        self.sub[first : first + count] = 0
        self.slot_rtime[first : first + count] = 0

    def _stored_bytes(self, blob: int) -> bytes:
        blobs = self.blobs
        length = int(blobs.length[blob])
        if blobs.tier[blob] == POOL:
            return self.pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), length)
        try:
            return self.disk.read(int(blobs.disk_off[blob]), length)
        except DiskError:
            self.counters.disk_errors += 1
            raise

    def _blob_bytes(self, blob: int) -> bytes:
        return self._fetch(blob, is_hot=False, touch=False)

    def _unit_page(self, blob: int, sub: int) -> memoryview:
        page = self.page_size
        return memoryview(self._fetch(blob, is_hot=False, touch=False))[sub * page : (sub + 1) * page]

    def _page_of(self, data: bytes, slot: int) -> bytes | memoryview:
        """A slot's page out of its blob's decompressed bytes."""
        if len(data) == self.page_size:
            return data
        page, sub = self.page_size, int(self.sub[slot])
        return memoryview(data)[sub * page : (sub + 1) * page]

    def _readinto(self, out: memoryview, offset: int) -> None:
        if not out:
            return
        page = self.page_size
        if offset % page == 0 and len(out) % page == 0:
            self._readinto_pages(out, offset // page, len(out) // page)
            return
        first, count = self._span(offset, len(out))
        whole = bytearray(count * page)
        self._readinto_pages(memoryview(whole), first, count)
        start = offset - first * page
        out[:] = whole[start : start + len(out)]

    def _readinto_pages(self, out: memoryview, first: int, count: int, touch: bool = True) -> None:
        if count <= _FEW_PAGES:
            self._readinto_few(out, first, count, touch)
            return
        page = self.page_size
        kinds = self.kind[first : first + count]
        handles = self.handle[first : first + count]
        for i in np.flatnonzero(kinds != BLOB).tolist():
            if kinds[i] == EMPTY:
                out[i * page : (i + 1) * page] = self._zero_page
            else:
                out[i * page : (i + 1) * page] = handles[i : i + 1].tobytes() * (page // 8)
        held = np.flatnonzero(kinds == BLOB)
        if not len(held):
            return
        ids = handles[held].astype(np.int64)
        hot = np.zeros(len(held), dtype=bool)
        if touch:
            now = self._now()
            last = self.blobs.rtime[ids].astype(np.int64)
            hot = (last > 0) & (now - last <= self._hot_ticks)
            self.blobs.rtime[ids] = now
            self.blobs.atime[ids] = now
            self.slot_rtime[first : first + count][held] = now
        for i, blob, is_hot in zip(held.tolist(), ids.tolist(), hot.tolist()):
            data = self._fetch(blob, is_hot, touch)
            out[i * page : (i + 1) * page] = self._page_of(data, first + i)

    def _readinto_few(self, out: memoryview, first: int, count: int, touch: bool) -> None:
        """The same as the vectorized path, page by page: a swap-in fault reads 1-8 pages,
        and for those numpy's per-call overhead costs more than it saves."""
        page = self.page_size
        blobs = self.blobs
        now = self._now() if touch else 0
        for i in range(count):
            slot = first + i
            kind = self.kind[slot]
            if kind == EMPTY:
                out[i * page : (i + 1) * page] = self._zero_page
            elif kind == SAME:
                out[i * page : (i + 1) * page] = self.handle[slot : slot + 1].tobytes() * (page // 8)
            else:
                blob = int(self.handle[slot])
                is_hot = False
                if touch:
                    last = int(blobs.rtime[blob])
                    is_hot = last > 0 and now - last <= self._hot_ticks
                    blobs.rtime[blob] = now
                    blobs.atime[blob] = now
                    self.slot_rtime[slot] = now
                out[i * page : (i + 1) * page] = self._page_of(self._fetch(blob, is_hot, touch), slot)

    def _fetch(self, blob: int, is_hot: bool, touch: bool) -> bytes:
        """A blob's bytes (one page, or all pages of a unit): from the hot cache or the unit
        cache, or decompressed from its tier (a disk blob read by a request is promoted
        when the pool has room)."""
        data = self.hot.get(blob)
        if data is not None:
            self.counters.hot_hits += 1
            return data
        pages = int(self.blobs.pages[blob])
        if pages > 1:
            data = self.units.get(blob)
            if data is not None:
                self.counters.unit_hits += 1
                return data
        stored = self._stored_bytes(blob)
        data = self.codecs.decompress(
            int(self.blobs.codec[blob]), stored, int(self.blobs.dict_id[blob]),
            pages * self.page_size,
        )
        self.counters.decoded_bytes += len(data)
        if touch and self.blobs.tier[blob] == DISK:
            self._promote(blob, stored)
        if pages > 1:
            self.units.put(blob, data)
        elif is_hot:
            self.hot.put(blob, data)
        return data

    # -- tiers -----------------------------------------------------------------------

    def _promote(self, blob: int, data: bytes) -> None:
        """Bring a disk blob back to the pool while the pool is below the demotion target.

        Not up to the reclaim threshold: between the target and the threshold promotions
        would refill what the last demotion round emptied, and the two would chase each
        other (measured under load: 940k demotions against 795k promotions in 4 minutes).
        """
        blobs = self.blobs
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

    def demote_cold(self, limit: int = _DEMOTE_CHUNK) -> int:
        """Demote up to `limit` of the oldest cold pool blobs to disk; returns blobs moved.

        Copies are written and synced first; only then are the pool cells freed and the blobs
        switched to disk, so a failing disk leaves every page in the pool."""
        if self.disk is None:
            return 0
        with self._lock:
            blobs = self.blobs
            now = self._now()
            n = blobs.capacity
            candidates = np.flatnonzero(
                (blobs.ref[:n] > 0)
                & (blobs.tier[:n] == POOL)
                & (now - blobs.atime[:n].astype(np.int64) >= self._cold_ticks)
            )
            if not len(candidates):
                return 0
            oldest = candidates[np.argsort(blobs.atime[candidates], kind="stable")][:limit]
            copies: list[tuple[int, int]] = []
            for blob in oldest.tolist():
                try:
                    copies.append((blob, self._disk_put(self._stored_bytes(blob), "demotion")))
                except (StoreFull, DiskError):
                    break
            try:
                if copies:
                    self._drop_disk_cache()
            except DiskError:
                for blob, offset in copies:
                    self.disk.free(offset, int(blobs.length[blob]))
                return 0
            for blob, offset in copies:
                self.pool.free(int(blobs.arena[blob]), int(blobs.cell[blob]))
                blobs.arena[blob], blobs.tier[blob], blobs.disk_off[blob] = -1, DISK, offset
            self.counters.demotions += len(copies)
            return len(copies)

    def rewrite_sparse_units(self, limit: int = _REWRITE_CHUNK) -> int:
        """Recompress units that at most half of their pages are still used by, keeping only
        those pages; returns units rewritten. A unit stays whole while any page of it is
        held, so without this, overwrites and trims scattered over units would keep dead
        pages in memory indefinitely."""
        if self.unit_pages == 1:
            return 0
        with self._lock:
            blobs = self.blobs
            n = blobs.capacity
            ref = blobs.ref[:n].astype(np.int64)
            sparse = np.flatnonzero((ref > 0) & (blobs.pages[:n] > 1)
                                    & (2 * ref <= blobs.pages[:n]))[:limit]
            if not len(sparse):
                return 0
            held = self._blob_slots()
            held = held[np.isin(self.handle[held], sparse.astype(np.uint64))]
            slots_of: dict[int, list[int]] = {}
            for slot in held.tolist():
                slots_of.setdefault(int(self.handle[slot]), []).append(slot)
            done = 0
            for blob, slots in slots_of.items():
                try:
                    done += self._rewrite_unit(blob, slots)
                except (StoreFull, DiskError, CodecError):
                    break  # no room or a bad read: the unit stays as it is
            self.counters.units_rewritten += done
            return done

    def _rewrite_unit(self, blob: int, slots: list[int]) -> int:
        page = self.page_size
        data = memoryview(self._fetch(blob, is_hot=False, touch=False))
        subs = sorted({int(self.sub[slot]) for slot in slots})
        pages = [data[sub * page : (sub + 1) * page] for sub in subs]
        hashes = []
        for p in pages:
            digest = xxhash.xxh3_128_intdigest(p)
            hashes.append((digest & _MASK64, digest >> 64))
        placed: list[tuple[int, int]] = [(0, 0)] * len(pages)
        staged: list[int] = []
        now = int(self.blobs.atime[blob])  # the pages keep their age
        try:
            self._store_group(list(range(len(pages))), pages, hashes, now, None, placed, staged)
        except BaseException:
            for new in staged:
                self._unref(new)
            raise
        home = dict(zip(subs, placed))
        taken = set()
        codec = self.blobs.codec
        for slot in slots:
            new, new_sub = home[int(self.sub[slot])]
            if (new, new_sub) in taken:
                self._ref(new)  # a second slot sharing that page
            taken.add((new, new_sub))
            self.codec_pages[int(codec[blob])] -= 1
            self.codec_pages[int(codec[new])] += 1
            self.handle[slot], self.sub[slot] = new, new_sub
            self._unref(blob)
        return 1

    def fragmentation(self) -> float:
        allocated = self.pool.allocated_bytes
        return 1 - self.pool.live_bytes / allocated if allocated else 0.0

    def needs_compaction(self) -> bool:
        wasted = self.pool.allocated_bytes - self.pool.live_bytes
        return wasted >= _MIN_COMPACT_BYTES and self.fragmentation() >= FRAGMENTATION_TRIGGER

    def compact(self) -> int:
        """Move live cells out of the sparsest arenas of each class; returns cells moved."""
        moved = 0
        for cls in self.pool.classes:
            with self._lock:
                moved += self._compact_class(cls.index)
        with self._lock:
            self.counters.compactions += 1
        return moved

    def _compact_class(self, class_index: int) -> int:
        sources = self.pool.evacuation_plan(class_index)
        if not sources:
            return 0
        blobs, pool = self.blobs, self.pool
        n = blobs.capacity
        movers = np.flatnonzero(
            (blobs.ref[:n] > 0) & (blobs.tier[:n] == POOL) & np.isin(blobs.arena[:n], sources)
        )
        pool.evacuate(sources)
        try:
            for blob in movers.tolist():
                length = int(blobs.length[blob])
                data = pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), length)
                arena, cell = pool.alloc(length)
                pool.put(arena, cell, data)
                pool.free(int(blobs.arena[blob]), int(blobs.cell[blob]))
                blobs.arena[blob], blobs.cell[blob] = arena, cell
        finally:
            pool.end_evacuation()
        self.counters.pages_moved += len(movers)
        return len(movers)

    def maintain(self) -> dict:
        """One round of background work: drop the dead pages of sparse units, demote while
        above the threshold, then compact."""
        rewritten = 0
        for _ in range(_REWRITE_ROUNDS):
            done = self.rewrite_sparse_units()
            rewritten += done
            if done < _REWRITE_CHUNK:
                break
        demoted = 0
        reclaiming = self.pool.allocated_bytes >= self.reclaim_bytes
        while reclaiming and self.pool.allocated_bytes > self.reclaim_target:
            moved = self.demote_cold()
            if not moved:
                break
            demoted += moved
            # Demotion frees cells all over the pool; arenas only go back once compacted.
            if self.tiering.defrag and self.pool.allocated_bytes > self.reclaim_target:
                self.compact()
        compacted = 0
        if self.tiering.defrag and self.needs_compaction():
            compacted = self.compact()
        return {"demoted": demoted, "compacted": compacted, "units_rewritten": rewritten}

    # -- accounting ------------------------------------------------------------------

    def meta_bytes(self) -> int:
        """Everything held in memory besides pool arenas. The big preallocated tables count
        their resident pages (mincore): a slot table for 8 GiB of device costs only the part
        the kernel's swap allocator has used."""
        return sum(self.meta_parts().values())

    def meta_parts(self) -> dict[str, int]:
        def resident(arrays) -> int:
            return sum(array_resident_bytes(a) for a in arrays)

        return {
            # chunks ever written, not mincore: reading a never-written part of these tables
            # maps the kernel's zero page, which mincore reports but costs nothing
            "slot_table": int(self._chunk_touched.sum()) * CHUNK_SLOTS * self._slot_bytes,
            "blob_table": self.blobs.used_bytes,
            "dedup_index": resident(self.index.arrays()),
            "codecs": self.codecs.memory_bytes()
            + (self.unit_codec.memory_bytes() if self.unit_codec else 0),
            "pool_books": self.pool.meta_bytes(),
            "disk_books": self.disk.meta_bytes() if self.disk else 0,
        }

    def stored_mem(self, meta_bytes: int | None = None) -> int:
        if meta_bytes is None:
            meta_bytes = self.meta_bytes()
        return self.pool.resident_bytes + meta_bytes + self._cache_bytes()

    def _cache_bytes(self) -> int:
        return self.hot.nbytes + self.units.nbytes

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        page = self.page_size
        blob_pages = int(self.codec_pages.sum())
        pages = self.same_pages + blob_pages
        orig = pages * page
        meta = self.meta_parts()
        meta_bytes = sum(meta.values())
        stored = self.stored_mem(meta_bytes)
        blobs = self.blobs
        held = self._blob_slots()
        slot_blobs = self.handle[held].astype(np.int64)
        pages_held = self._pages_held(slot_blobs, self.sub[held])
        tier_pages = np.bincount(blobs.tier[slot_blobs], minlength=2)
        live = blobs.live()
        lengths = blobs.length.astype(np.int64)
        disk_stored = int(lengths[live & (blobs.tier == DISK)].sum())
        codec_pages = {
            name: int(self.codec_pages[cid])
            for cid, name in codecs.CODEC_NAMES.items()
            if self.codec_pages[cid]
        }
        return {
            "size": self.size,
            "slots": self.nslots,
            "page_size": page,
            "algorithm": self.codecs.writer.name,
            "orig_mem": orig,
            "stored_mem": stored,
            "ratio": round(orig / stored, 4) if stored else 0.0,
            "pages": pages,
            "same_pages": self.same_pages,
            "raw_pages": int(self.codec_pages[codecs.RAW]),
            "compressed_pages": blob_pages - int(self.codec_pages[codecs.RAW]),
            "shared_pages": pages_held["shared"],
            "unique_blobs": blobs.count,
            "dedup_saved_pages": blob_pages - pages_held["distinct"],
            "unit_pages": self.unit_pages,
            "units": int(np.count_nonzero(live & (blobs.pages > 1))),
            "unit_dead_pages": pages_held["dead"],
            "codec_pages": codec_pages,
            "dictionaries": self.dicts.stats(blobs, slot_blobs, page),
            "pool_bytes": self.pool.allocated_bytes,
            "pool_resident_bytes": self.pool.resident_bytes,
            "pool_live_bytes": self.pool.live_bytes,
            "pool_arenas": self.pool.arena_count,
            "fragmentation": round(self.fragmentation(), 4),
            "compressed_bytes": int(lengths[live].sum()),
            "meta_bytes": meta_bytes,
            "meta": meta,
            "hot_cache_bytes": self._cache_bytes(),
            "max_size": self.pool.max_size,
            "reclaim_bytes": self.reclaim_bytes,
            "disk_mem": self.disk.file_size if self.disk else 0,
            "tiers": {
                "pool": {
                    "pages": int(tier_pages[POOL]) + self.same_pages,
                    "orig_bytes": (int(tier_pages[POOL]) + self.same_pages) * page,
                    "stored_bytes": stored,
                },
                "disk": {
                    "pages": int(tier_pages[DISK]),
                    "orig_bytes": int(tier_pages[DISK]) * page,
                    "stored_bytes": disk_stored,
                    "file_bytes": self.disk.file_size if self.disk else 0,
                    "reads": self.disk.reads if self.disk else 0,
                    "writes": self.disk.writes if self.disk else 0,
                },
            },
            "temperature": self._temperature(slot_blobs),
            **asdict(self.counters),
        }

    def _pages_held(self, slot_blobs: np.ndarray, subs: np.ndarray) -> dict:
        """Distinct stored pages the slots use, slots sharing one with another slot, and
        pages of live units no slot uses any more (overwritten or trimmed: memory a unit
        holds until its last page goes)."""
        pairs = slot_blobs << _SUB_BITS | subs.astype(np.int64)
        distinct, counts = np.unique(pairs, return_counts=True)
        live = self.blobs.live()
        stored = int(self.blobs.pages[live].astype(np.int64).sum())
        return {"distinct": len(distinct), "shared": int(counts[counts > 1].sum()),
                "dead": stored - len(distinct)}

    def _temperature(self, slot_blobs: np.ndarray) -> dict:
        """Pages by temperature: hot (in the hot cache), warm (accessed within
        warm_threshold_ms), cold (untouched for cold_grace_period), idle (in between)."""
        if not len(slot_blobs):
            return {"hot": 0, "warm": 0, "idle": 0, "cold": 0}
        age = self._now() - self.blobs.atime[slot_blobs].astype(np.int64)
        in_cache = np.isin(slot_blobs, np.array(self.hot.keys(), dtype=np.int64))
        warm = ~in_cache & (age <= self._warm_ticks)
        cold = ~in_cache & (age >= self._cold_ticks)
        hot = int(in_cache.sum())
        return {
            "hot": hot,
            "warm": int(warm.sum()),
            "idle": len(slot_blobs) - hot - int(warm.sum()) - int(cold.sum()),
            "cold": int(cold.sum()),
        }

    def slot_sizes(self, slots) -> dict:
        """What the given slots cost, for per-cgroup accounting: per slot the stored bytes
        (a shared blob's length divided by its refcount; 0 for same-filled and empty slots),
        whether it holds data, and its tier. Slots outside the device are reported as empty."""
        slots = np.asarray(slots, dtype=np.int64)
        valid = (slots >= 0) & (slots < self.nslots)
        idx = np.where(valid, slots, 0)
        with self._lock:
            kinds = np.where(valid, self.kind[idx], EMPTY)
            blob_ids = np.where(kinds == BLOB, self.handle[idx].astype(np.int64), 0)
            lengths = self.blobs.length[blob_ids].astype(np.float64)
            refs = np.maximum(self.blobs.ref[blob_ids].astype(np.float64), 1)
            stored = np.where(kinds == BLOB, lengths / refs, 0.0)
            tiers = np.where(kinds == BLOB, self.blobs.tier[blob_ids], POOL)
        return {
            "kind": kinds.astype(int).tolist(),
            "stored": np.round(stored, 1).tolist(),
            "tier": tiers.astype(int).tolist(),
        }

    def check(self) -> None:
        """Cross-check every invariant of the books; raises AssertionError. For tests."""
        with self._lock:
            blobs = self.blobs
            held = self.kind == BLOB
            blob_slots = self.handle[held].astype(np.int64)
            refs = np.bincount(blob_slots, minlength=blobs.capacity)[: blobs.capacity]
            assert np.array_equal(refs, blobs.ref.astype(np.int64)), "refcounts disagree"
            assert blobs.count == int(np.count_nonzero(refs)), "blob count disagrees"
            live = blobs.live()
            assert self.index.count == int(blobs.pages[live].astype(np.int64).sum()), \
                "index and blob table disagree"
            assert (self.sub[held] < blobs.pages[blob_slots]).all(), "slot names a missing page"
            assert not self.sub[~held].any()
            assert self.same_pages == int(np.count_nonzero(self.kind == SAME))
            per_chunk = np.add.reduceat((self.kind != EMPTY).astype(np.int32),
                                        np.arange(0, self.nslots, CHUNK_SLOTS))
            assert np.array_equal(per_chunk, self._chunk_live), "chunk counts disagree"
            assert not (self._chunk_live > 0)[~self._chunk_touched].any()
            assert int(self.codec_pages.sum()) == len(blob_slots)
            in_pool = live & (blobs.tier == POOL)
            assert self.pool.live_cells == int(in_pool.sum()), "pool cells leak"
            cells = sum(self.pool.class_for(int(n)).cell_size for n in blobs.length[in_pool])
            assert self.pool.live_bytes == cells
            assert self.pool.allocated_bytes <= self.pool.max_size, "pool over its cap"
            assert self.pool.live_bytes <= self.pool.resident_bytes <= self.pool.allocated_bytes
            on_disk = live & (blobs.tier == DISK)
            if self.disk is not None:
                units = (-(-blobs.length[on_disk].astype(np.int64) // 64) * 64).sum()
                assert self.disk.live_bytes == int(units), "disk extents leak"
            else:
                assert not on_disk.any()

    def close(self) -> None:
        with self._lock:
            self._release_slots(0, self.nslots)
            if self.disk is not None:
                self.disk.close()


__all__ = ["PageStore", "Tiering", "StoreError", "StoreFull", "OutOfRange", "CodecError"]
