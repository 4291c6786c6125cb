"""PageStore: the device as an array of 4 KiB slots, each empty, same-filled or a blob.

Write path for a request: split into whole pages (read-modify-write for unaligned edges);
find same-filled pages for the whole request at once with numpy; for the rest, hash
(128-bit xxh3), share an existing blob when the bytes are equal, else compress, store raw
when compression does not pay, and put the result in a pool cell. All new blobs are staged
first; only when every page of the request has a home are the slots switched over and the
old blobs released, so a full pool or a codec failure leaves the device exactly as it was.

The slot table is two preallocated numpy arrays (kind, handle): 9 bytes per slot and no
Python object per page. `handle` is the blob id, or the repeated 64-bit word of a
same-filled page (zram's trick).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from . import codec as codecs
from .blobs import BlobTable
from .codec import CodecError, CodecSet, make_codec
from .dedup import DedupIndex, index_key
from .pool import MAX_COMPRESSED, Pool, PoolFull

EMPTY = 0
SAME = 1
BLOB = 2

_MASK64 = (1 << 64) - 1


class StoreError(Exception):
    """Base of the errors a request can end in; the device is unchanged after each."""


class OutOfRange(StoreError):
    """The byte range is negative or runs past the end of the device (EINVAL)."""


class StoreFull(StoreError):
    """No room for the request's pages (ENOSPC); the kernel keeps them."""


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


class PageStore:
    def __init__(
        self,
        size: int,
        *,
        algorithm: str = "zstd",
        level: int = 3,
        max_size: int = 8 << 30,
        page_size: int = 4096,
    ) -> None:
        if page_size != 4096:
            raise ValueError("only 4096-byte pages are supported")
        if size <= 0 or size % page_size:
            raise ValueError(f"device size {size} must be a positive multiple of {page_size}")
        self.size = size
        self.page_size = page_size
        self.nslots = size // page_size
        self.kind = np.zeros(self.nslots, dtype=np.uint8)
        self.handle = np.zeros(self.nslots, dtype=np.uint64)
        self.codecs = CodecSet(make_codec(algorithm, level, page_size))
        self.pool = Pool(max_size, page_size)
        self.blobs = BlobTable()
        self.index = DedupIndex()
        self.counters = Counters()
        self.same_pages = 0
        self.shared_pages = 0  # slots whose blob has refcount > 1
        self.codec_pages = np.zeros(len(codecs.CODEC_NAMES), dtype=np.int64)
        self._zero_page = bytes(page_size)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, size: int, config) -> PageStore:
        return cls(
            size,
            algorithm=config.compression.algorithm,
            level=config.compression.level,
            max_size=config.pool.max_size,
            page_size=config.compression.page_size,
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
        # Everything lives in memory; there is nothing to make durable (swap is not durable).
        with self._lock:
            self.counters.flushes += 1

    # -- ranges ----------------------------------------------------------------------

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutOfRange(
                f"range {offset}+{length} outside the device (0..{self.size})"
            )

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
        self._readinto_pages(memoryview(whole), first, count)
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
        words = np.frombuffer(data, dtype=np.uint64).reshape(count, page // 8)
        same = (words == words[:, :1]).all(axis=1)
        new_kind = np.where(same, SAME, BLOB).astype(np.uint8)
        new_handle = np.where(same, words[:, 0], 0).astype(np.uint64)
        staged: list[int] = []
        try:
            for i in np.flatnonzero(~same).tolist():
                blob = self._intern(data[i * page : (i + 1) * page])
                staged.append(blob)
                new_handle[i] = blob
        except BaseException:
            for blob in staged:
                self._unref(blob)
            raise
        if staged:
            self.codec_pages += np.bincount(
                self.blobs.codec[staged], minlength=len(self.codec_pages)
            )
        self.same_pages += int(same.sum())
        self._release_slots(first, count)
        self.kind[first : first + count] = new_kind
        self.handle[first : first + count] = new_handle

    def _intern(self, page: memoryview) -> int:
        """A blob holding `page`, with one more reference: shared if present, else new."""
        digest = xxhash.xxh3_128_intdigest(page)
        lo, hi = digest & _MASK64, digest >> 64
        key = index_key(lo)
        blobs = self.blobs
        for blob in self.index.candidates(key):
            if int(blobs.hash_hi[blob]) == hi and self._blob_bytes(blob) == page:
                self._ref(blob)
                self.counters.dedup_hits += 1
                return blob
            self.counters.hash_collisions += 1
        compressed = self.codecs.writer.compress(page)
        codec_id = self.codecs.writer.id
        if len(compressed) > MAX_COMPRESSED:
            compressed, codec_id = page, codecs.RAW
        try:
            arena, cell = self.pool.alloc(len(compressed))
        except PoolFull as exc:
            raise StoreFull(str(exc)) from None
        self.pool.put(arena, cell, compressed)
        blob = blobs.new(arena, cell, len(compressed), codec_id, lo, hi)
        self.index.insert(key, blob)
        return blob

    def _ref(self, blob: int) -> None:
        ref = int(self.blobs.ref[blob]) + 1
        self.blobs.ref[blob] = ref
        self.shared_pages += 2 if ref == 2 else 1

    def _unref(self, blob: int) -> None:
        blobs = self.blobs
        ref = int(blobs.ref[blob]) - 1
        if ref > 0:
            blobs.ref[blob] = ref
            self.shared_pages -= 2 if ref == 1 else 1
            return
        self.index.remove(index_key(int(blobs.hash_lo[blob])), blob)
        self.pool.free(int(blobs.arena[blob]), int(blobs.cell[blob]))
        blobs.delete(blob)

    def _release_slots(self, first: int, count: int) -> None:
        """Drop what the slots hold (before they are overwritten or emptied)."""
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

    def _blob_bytes(self, blob: int) -> bytes:
        blobs = self.blobs
        stored = self.pool.get(int(blobs.arena[blob]), int(blobs.cell[blob]), int(blobs.length[blob]))
        return self.codecs.decompress(int(blobs.codec[blob]), stored)

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

    def _readinto_pages(self, out: memoryview, first: int, count: int) -> None:
        page = self.page_size
        kinds = self.kind[first : first + count]
        handles = self.handle[first : first + count]
        for i in np.flatnonzero(kinds != BLOB).tolist():
            if kinds[i] == EMPTY:
                out[i * page : (i + 1) * page] = self._zero_page
            else:
                out[i * page : (i + 1) * page] = handles[i : i + 1].tobytes() * (page // 8)
        for i in np.flatnonzero(kinds == BLOB).tolist():
            out[i * page : (i + 1) * page] = self._blob_bytes(int(handles[i]))

    # -- accounting ------------------------------------------------------------------

    def meta_bytes(self) -> int:
        """Everything held besides pool arenas: slot table, blob table, index, codecs, pool books."""
        return (
            self.kind.nbytes
            + self.handle.nbytes
            + self.blobs.nbytes
            + self.index.nbytes
            + self.codecs.memory_bytes()
            + self.pool.meta_bytes()
        )

    def stored_mem(self) -> int:
        return self.pool.allocated_bytes + self.meta_bytes()

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        blob_pages = int(self.codec_pages.sum())
        pages = self.same_pages + blob_pages
        orig = pages * self.page_size
        stored = self.stored_mem()
        codec_pages = {
            name: int(self.codec_pages[cid])
            for cid, name in codecs.CODEC_NAMES.items()
            if self.codec_pages[cid]
        }
        return {
            "size": self.size,
            "slots": self.nslots,
            "page_size": self.page_size,
            "algorithm": self.codecs.writer.name,
            "orig_mem": orig,
            "stored_mem": stored,
            "ratio": round(orig / stored, 4) if stored else 0.0,
            "pages": pages,
            "same_pages": self.same_pages,
            "raw_pages": int(self.codec_pages[codecs.RAW]),
            "compressed_pages": blob_pages - int(self.codec_pages[codecs.RAW]),
            "shared_pages": self.shared_pages,
            "unique_blobs": self.blobs.count,
            "dedup_saved_pages": blob_pages - self.blobs.count,
            "codec_pages": codec_pages,
            "pool_bytes": self.pool.allocated_bytes,
            "pool_live_bytes": self.pool.live_bytes,
            "pool_arenas": self.pool.arena_count,
            "compressed_bytes": int(
                self.blobs.length[: self.blobs.capacity][self.blobs.ref > 0].astype(np.int64).sum()
            ),
            "meta_bytes": self.meta_bytes(),
            "max_size": self.pool.max_size,
            **asdict(self.counters),
        }

    def check(self) -> None:
        """Cross-check every invariant of the books; raises AssertionError. For tests."""
        with self._lock:
            blob_slots = self.handle[self.kind == BLOB].astype(np.int64)
            refs = np.bincount(blob_slots, minlength=self.blobs.capacity)[: self.blobs.capacity]
            assert np.array_equal(refs, self.blobs.ref.astype(np.int64)), "refcounts disagree"
            assert self.blobs.count == int(np.count_nonzero(refs)), "blob count disagrees"
            assert self.index.count == self.blobs.count, "index and blob table disagree"
            assert self.same_pages == int(np.count_nonzero(self.kind == SAME))
            assert int(self.codec_pages.sum()) == len(blob_slots)
            assert self.shared_pages == int(refs[refs > 1].sum())
            assert self.pool.live_cells == self.blobs.count, "pool cells leak"
            live = self.blobs.ref > 0
            cells = sum(self.pool.class_for(int(n)).cell_size for n in self.blobs.length[live])
            assert self.pool.live_bytes == cells

    def close(self) -> None:
        with self._lock:
            self._release_slots(0, self.nslots)


__all__ = ["PageStore", "StoreError", "StoreFull", "OutOfRange", "CodecError"]
