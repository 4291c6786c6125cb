"""Blobs as objects: new / ref / fetch / release.

A blob is one page, or a frame of several pages compressed together, in a pool cell or in
the disk tier. `release` is the one place a reference goes away (like zram_free_page): it
keeps the per-codec page counts, and with the last reference it removes the dedup index
entries, drops cached copies, frees the pool cell or the disk extent and the blob row. Every
other module takes and drops references through here, so no book can be forgotten.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..codec import codecs
from ..codec.codecs import CodecSet
from ..errors import CodecError, StoreFull
from . import integrity
from .blobs import DISK, POOL, BlobTable
from .cache import HotCache
from .dedup import DedupIndex, index_key, pack
from .disk import DiskError, DiskFull, DiskTier
from .integrity import Corrupt
from .pool import Pool, PoolFull


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
    dedup_compares: int = 0  # stored pages compared byte for byte with a page being written
    pingpong: int = 0  # pages written again within hot_threshold_ms of being read
    demotions: int = 0
    returned_demotions: int = 0  # of those, copies of pages read back and kept in RAM
    promotions: int = 0
    direct_to_disk: int = 0  # new pages written straight to disk (pool at its cap)
    disk_full: int = 0
    disk_errors: int = 0
    # reads that found a blob's bytes not matching its checksum or AEAD tag (EIO)
    checksum_errors: int = 0
    compactions: int = 0
    pages_moved: int = 0  # cells moved by compaction
    hot_hits: int = 0
    # Multi-page frames. The stats and metrics interface (docs/JSON.md) names them by the
    # frame's old name, "unit": accounting.STATS_NAMES maps these four to it.
    frames_written: int = 0  # multi-page blobs stored
    frame_fallbacks: int = 0  # groups that compressed too poorly together: stored page by page
    # of those, groups that did not compress at all: stored raw, no page compressed alone
    frames_incompressible: int = 0
    frame_hits: int = 0  # page reads served from the decompressed-frame cache
    frames_rewritten: int = 0  # sparse frames recompressed without their dead pages
    decoded_bytes: int = 0  # bytes decompressed (a frame's whole size per miss): read amplification
    # frames compressed under the store lock: sparse-frame rewrites, and the frames of
    # writes that placement.Placer.prepare could not compress early (part already stored)
    frames_compressed_locked: int = 0
    recompressed_pages: int = 0  # warm slots the recompressor switched to the dense form
    # slots the kernel had freed without telling the device, found free in its swap map and
    # emptied (PageStore.forget_freed)
    kernel_freed_pages: int = 0


class Decoding:
    """A frame being decompressed by one request, outside the store lock. Readahead sends a
    frame's neighbouring pages in concurrent requests: the others wait for this one's bytes
    instead of decompressing the same frame again."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.done = threading.Event()
        self.data: bytes | None = None
        self.error: BaseException | None = None


class Moved(Exception):
    """A disk blob read after the store lock was freed and its extent reused meanwhile: the
    read is done again (PageStore._read_request), never answered with other bytes."""


@dataclass
class Deferred:
    """A blob to decompress after the store lock is released (`Objects.finish`), then cache
    if the row still holds it (`adopt`): a pool blob's bytes as stored, copied under the
    lock, or a disk blob's extent (`disk_off`), read and opened after it, since a disk read
    waits for the device (promoted in `adopt`, if `promote`). With `wait_for`, another
    request is decompressing the frame: `finish` takes its bytes."""
    blob: int
    gen: int
    codec: int
    dict_id: int
    stored: bytes
    size: int      # decoded bytes: a page, or a frame
    keep: bool     # cache the copy: a frame always, a page when it is hot
    csum: int = 0  # the blob's checksum, verified after the lock (`Objects.decode_checked`)
    decoding: Decoding | None = None  # this request decompresses the frame for others too
    wait_for: Decoding | None = None  # another request does
    disk_off: int | None = None  # a disk blob: its extent, read by `finish`
    length: int = 0  # its stored length
    promote: bool = False  # bring it back to the pool once read (a request's read)


class Objects:
    """The blobs of one store and every book that refers to them."""

    def __init__(self, *, blobs: BlobTable, index: DedupIndex, pool: Pool,
                 disk: DiskTier | None, codecs_: CodecSet, hot: HotCache, frames: HotCache,
                 counters: Counters, page_size: int) -> None:
        self.blobs = blobs
        self.index = index
        self.pool = pool
        self.disk = disk
        self.codecs = codecs_
        self.hot = hot  # hot one-page blobs, uncompressed
        self.frames = frames  # the last few decompressed frames
        self.counters = counters
        self.page_size = page_size
        # slot references per codec id: pages stored with each codec
        self.codec_pages = np.zeros(len(codecs.CODEC_NAMES), dtype=np.int64)
        # set by the tiering: a disk blob a request has read (bytes as stored) may move up
        self.promote: Callable[[int, bytes], None] = lambda blob, stored: None
        # frames being decompressed outside the store lock, by blob (see Decoding)
        self.decoding: dict[int, Decoding] = {}

    # -- new ---------------------------------------------------------------------------

    def new_page(self, stored, codec_id: int, dict_id: int, lo: int, hi: int, now: int,
                 page) -> int:
        """A one-page blob with one reference, under its hash in the dedup index. Its
        checksum covers `page`, the bytes the kernel wrote, not the stored ones: a codec or
        dictionary mix-up then reads as a mismatch, never as other bytes."""
        blob = self._new(stored, codec_id, dict_id, now, 1, integrity.checksum(page))
        key = index_key(lo)  # `hi` is not kept: the bytes decide equality (placement.lookup)
        self.blobs.members[blob, 0] = key
        self.index.insert(key, pack(blob))
        self.codec_pages[codec_id] += 1
        return blob

    def new_frame(self, compressed, codec_id: int, keys: list[int], now: int,
                  dict_id: int = 0) -> int:
        """A frame of len(keys) pages with one reference per page; `keys` are the pages'
        dedup index keys (a frame's pages keep only those: the bytes decide equality);
        `dict_id` the dictionary it was compressed with (0: none)."""
        # a frame: the stored bytes' checksum; its content carries zstd's own (codecs)
        blob = self._new(compressed, codec_id, dict_id, now, len(keys),
                         integrity.checksum(compressed))
        self.blobs.ref[blob] = len(keys)
        for sub, key in enumerate(keys):
            self.blobs.members[blob, sub] = key
            self.index.insert(key, pack(blob, sub))
        self.codec_pages[codec_id] += len(keys)
        return blob

    def _new(self, stored, codec_id: int, dict_id: int, now: int, pages: int, csum: int) -> int:
        """A blob row for `stored`, in a pool cell, or on disk with the pool at its cap."""
        blobs = self.blobs
        try:
            arena, cell = self.pool.alloc(len(stored))
        except PoolFull as exc:
            # The row first: a disk extent is sealed to its blob id and generation.
            blob = blobs.new(-1, 0, len(stored), codec_id, dict_id, pages, csum)
            try:
                offset = self.disk_put(stored, str(exc), blob)
            except BaseException:
                blobs.delete(blob)
                raise
            blobs.disk_off[blob] = offset
            blobs.tier[blob] = DISK
            self.counters.direct_to_disk += 1
        else:
            self.pool.put(arena, cell, stored)
            blob = blobs.new(arena, cell, len(stored), codec_id, dict_id, pages, csum)
        blobs.atime[blob] = now
        return blob

    # -- references ----------------------------------------------------------------------

    def ref(self, blob: int) -> None:
        self.blobs.ref[blob] += 1
        self.codec_pages[int(self.blobs.codec[blob])] += 1

    def release(self, blob: int) -> None:
        """Drop one reference; with the last one the blob and everything about it goes."""
        blobs = self.blobs
        self.codec_pages[int(blobs.codec[blob])] -= 1
        ref = int(blobs.ref[blob]) - 1
        if ref > 0:
            blobs.ref[blob] = ref
            return
        pages = int(blobs.pages[blob])
        for sub in range(pages):
            self.index.remove(int(blobs.members[blob, sub]), pack(blob, sub))
        if pages > 1:
            self.frames.discard(blob)
        self.hot.discard(blob)
        if blobs.tier[blob] == POOL:
            self.pool.free(int(blobs.arena[blob]), int(blobs.cell[blob]))
        else:
            self.disk.free(int(blobs.disk_off[blob]), int(blobs.length[blob]))
        blobs.delete(blob)

    def renumber(self, ids: list[int]) -> dict[int, int]:
        """Pool blobs no request has seen yet (the recompressor's new frames) moved to lower
        free rows (BlobTable.move_down), their dedup entries with them; returns {old: new}
        for those moved. Disk blobs stay: their extents are sealed to their id. The caller
        re-points the slots, then calls `blobs.relink()` (BlobTable.move_down says why)."""
        blobs = self.blobs
        moved = blobs.move_down([b for b in ids if blobs.tier[b] == POOL])
        for old, new in moved.items():
            for sub in range(int(blobs.pages[new])):
                self.index.repoint(int(blobs.members[new, sub]), pack(old, sub), pack(new, sub))
            self.frames.discard(old)
            self.hot.discard(old)
        return moved

    # -- bytes ---------------------------------------------------------------------------

    def stored_bytes(self, blob: int) -> bytes:
        """A blob's bytes as stored, from its pool cell or its disk extent (checked against
        the extent's AEAD tag); `decode_checked` verifies them against the blob's checksum."""
        blobs = self.blobs
        length = int(blobs.length[blob])
        if blobs.tier[blob] == POOL:
            return self.pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), length)
        try:
            data = self.disk.read(int(blobs.disk_off[blob]), length, blob, int(blobs.gen[blob]))
            self.disk.reads_done(1)
            return data
        except DiskError:
            self.counters.disk_errors += 1
            raise
        except Corrupt as exc:
            self.note_corrupt(exc)
            raise

    def decode_checked(self, blob: int, codec_id: int, dict_id: int, stored, size: int,
                       csum: int, where: str = "pool cell") -> bytes:
        """What the kernel wrote, from a blob's stored bytes, verified end to end (store/
        integrity.py): a frame's stored bytes against `csum`, and its content against the
        checksum zstd keeps in the frame; a page alone against `csum` after decoding.
        Corrupt when anything does not match or does not decode (no lock needed)."""
        if size > self.page_size and not integrity.matches(stored, csum):
            raise Corrupt(f"blob {blob}: checksum mismatch in its {where}")
        try:
            data = self.decode(codec_id, stored, dict_id, size)
        except CodecError as exc:
            raise Corrupt(f"blob {blob}: checksum mismatch in its {where} (it does not "
                          f"decode: {exc})") from None
        if size <= self.page_size and not integrity.matches(data, csum):
            raise Corrupt(f"blob {blob}: checksum mismatch in its {where} (the page it "
                          f"decodes to)")
        return data

    def note_corrupt(self, exc: Corrupt) -> None:
        """Count and log a mismatch (under the store lock)."""
        self.counters.checksum_errors += 1
        integrity.log_line(str(exc), self.counters.checksum_errors)

    def cached(self, blob: int) -> bytes | None:
        """The hot or frame cache's copy of a blob, if either has one."""
        gen = int(self.blobs.gen[blob])
        data = self.hot.get(blob, gen)
        if data is not None:
            self.counters.hot_hits += 1
            return data
        if self.blobs.pages[blob] > 1:
            data = self.frames.get(blob, gen)
            if data is not None:
                self.counters.frame_hits += 1
                return data
        return None

    def fetch(self, blob: int, is_hot: bool = False, touch: bool = False) -> bytes:
        """A blob's bytes (one page, or all pages of a frame): from the hot cache or the frame
        cache, or decompressed from its tier (a disk blob read by a request, `touch`, may be
        promoted)."""
        data = self.cached(blob)
        if data is not None:
            return data
        blobs = self.blobs
        pages = int(blobs.pages[blob])
        stored = self.stored_bytes(blob)
        where = "pool cell" if blobs.tier[blob] == POOL else "disk extent"
        try:
            data = self.decode_checked(blob, int(blobs.codec[blob]), int(blobs.dict_id[blob]),
                                       stored, pages * self.page_size, int(blobs.csum[blob]),
                                       where)
        except Corrupt as exc:
            self.note_corrupt(exc)
            raise
        self.counters.decoded_bytes += len(data)
        if touch and self.blobs.tier[blob] == DISK:
            self.promote(blob, stored)
        if pages > 1:
            self.frames.put(blob, int(self.blobs.gen[blob]), data)
        elif is_hot:
            self.hot.put(blob, int(self.blobs.gen[blob]), data)
        return data

    def fetch_or_defer(self, blob: int, is_hot: bool, touch: bool) -> bytes | Deferred:
        """`fetch` for a read request, except that a pool blob's decompression is left to
        the caller after the store lock (`finish`); disk blobs are fetched (and promoted)
        here, under it."""
        data = self.cached(blob)
        if data is not None:
            return data
        blobs = self.blobs
        pages = int(blobs.pages[blob])
        gen = int(blobs.gen[blob])
        size = pages * self.page_size
        if pages > 1:
            other = self.decoding.get(blob)
            if other is not None and other.gen == gen:
                self.counters.frame_hits += 1
                return Deferred(blob, gen, 0, 0, b"", size, False, wait_for=other)
        length = int(blobs.length[blob])
        if blobs.tier[blob] == POOL:
            stored = self.pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), length)
            late = Deferred(blob, gen, int(blobs.codec[blob]), int(blobs.dict_id[blob]), stored,
                            size, pages > 1 or is_hot, int(blobs.csum[blob]))
        else:
            late = Deferred(blob, gen, int(blobs.codec[blob]), int(blobs.dict_id[blob]), b"",
                            size, pages > 1 or is_hot, int(blobs.csum[blob]),
                            disk_off=int(blobs.disk_off[blob]), length=length, promote=touch)
        if pages > 1:
            late.decoding = self.decoding[blob] = Decoding(gen)
        return late

    def decode(self, codec_id: int, stored, dict_id: int, size: int) -> bytes:
        return self.codecs.decompress(codec_id, stored, dict_id, size)

    def finish(self, late: Deferred) -> bytes:
        """Without the store lock: the deferred blob verified and decompressed (or the bytes
        of the request that decompresses it). A mismatch raises Corrupt; the caller counts it
        under the lock (`note_corrupt`), then calls `settle`."""
        if late.wait_for is not None:
            late.wait_for.done.wait()
            if late.wait_for.data is None:
                raise late.wait_for.error or CodecError(f"blob {late.blob}: not decoded")
            return late.wait_for.data
        try:
            where = "pool cell"
            if late.disk_off is not None:
                late.stored = self.disk.read(late.disk_off, late.length, late.blob, late.gen)
                where = "disk extent"
            data = self.decode_checked(late.blob, late.codec, late.dict_id, late.stored,
                                       late.size, late.csum, where)
        except BaseException as exc:
            if late.decoding is not None:
                late.decoding.error = exc
                late.decoding.done.set()
            raise
        if late.decoding is not None:
            late.decoding.data = data
            late.decoding.done.set()
        return data

    def settle(self, late: Deferred) -> None:
        """Under the store lock, after `finish` (whether it decoded or failed): the frame is
        no longer being decoded."""
        if late.decoding is not None and self.decoding.get(late.blob) is late.decoding:
            del self.decoding[late.blob]

    def adopt(self, late: Deferred, data: bytes) -> None:
        """Under the store lock again: count the decoding, and cache the copy unless the blob
        was released meanwhile (its row freed, perhaps reused)."""
        self.settle(late)
        if late.wait_for is not None:
            return  # the request that decoded it counts and caches it
        self.counters.decoded_bytes += len(data)
        blobs = self.blobs
        if blobs.ref[late.blob] == 0 or int(blobs.gen[late.blob]) != late.gen:
            return
        if late.keep:
            (self.frames if late.size > self.page_size else self.hot).put(late.blob, late.gen,
                                                                           data)
        if late.disk_off is not None:
            self.disk.reads_done(1)
            if late.promote and self.unmoved(late):
                self.promote(late.blob, late.stored)

    def unmoved(self, late: Deferred) -> bool:
        """Under the store lock: a deferred disk blob is still where it was read from."""
        blobs = self.blobs
        return (blobs.ref[late.blob] > 0 and int(blobs.gen[late.blob]) == late.gen
                and blobs.tier[late.blob] == DISK and int(blobs.disk_off[late.blob]) == late.disk_off)

    def page(self, blob: int, sub: int) -> memoryview | None:
        """Page `sub` of a blob, for a comparison (no access recorded, no promotion); None
        when the blob cannot be read (corrupt, or a disk error: counted by the fetch), so
        that a write of the same content stores a fresh copy instead of failing."""
        page = self.page_size
        try:
            data = self.fetch(blob)
        except (Corrupt, DiskError, CodecError):
            return None
        return memoryview(data)[sub * page : (sub + 1) * page]

    # -- the disk tier ---------------------------------------------------------------------

    def disk_put(self, data, why_not_pool: str, blob: int) -> int:
        """An extent holding `data` for `blob` (its row already made), sealed and written."""
        if self.disk is None:
            raise StoreFull(f"{why_not_pool}; no disk tier (pool.swap_out_path: null)")
        try:
            offset = self.disk.alloc(len(data))
        except DiskFull as exc:
            self.counters.disk_full += 1
            raise StoreFull(f"{why_not_pool}; {exc}") from None
        try:
            self.disk.put(offset, data, blob, int(self.blobs.gen[blob]))
        except DiskError:
            self.disk.free(offset, len(data))
            self.counters.disk_errors += 1
            raise
        return offset

    def drop_disk_cache(self) -> None:
        try:
            self.disk.drop_cache()
        except DiskError:
            self.counters.disk_errors += 1
            raise

    def cache_bytes(self) -> int:
        return self.hot.nbytes + self.frames.nbytes
