"""Page codecs: one class per algorithm behind one interface (in the manner of borg's compress).

A codec compresses one buffer into one frame: a single 4 KiB page, or a frame of several
pages (`compression.frame_pages`, 16 by default) compressed together with a codec made for
that frame size. Compressor and decompressor objects are created once and reused: a new zstd
context per page costs more than the compression itself. The id of a codec is what the store
records per stored blob, so ids never change meaning.

The codec, not the store, decides whether compression pays: a page is kept raw, and a frame
is split into pages compressed alone, when the output is over MAX_COMPRESSED bytes a page
(3/4 of a page: above that the pool's cell would save too little to be worth a decompression).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import lz4.block
import zstandard

from ..errors import CodecError

RAW = 0
ZSTD = 1
LZ4 = 2
LZ4HC = 3

CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", LZ4: "lz4", LZ4HC: "lz4hc"}

PAGE = 4096
MAX_COMPRESSED = 3072  # bytes per page: above this compression does not pay (3/4 page)

# lz4 keeps its hash table on the C stack / in a thread-local state; there is no
# accessor for it, so we account the documented state size (LZ4_STREAMSIZE, LZ4HC ~256 KiB).
_LZ4_STATE_BYTES = 16 * 1024
_LZ4HC_STATE_BYTES = 256 * 1024


class ContextPool:
    """Contexts for many threads, one per concurrent caller. A zstd context must not be used
    by two threads at once, and requests compress and decompress in parallel outside the
    store lock: each call borrows an idle context, or makes one on first need, at most one per
    CPU plus one (more would not run in parallel, and each costs memory)."""

    def __init__(self, make: Callable[[], object], size: int | None = None) -> None:
        first = make()
        self._make = make
        self._made = [first]
        self._idle = [first]
        self._lock = threading.Lock()
        self._turns = threading.BoundedSemaphore(size or (os.cpu_count() or 1) + 1)

    @property
    def first(self):
        return self._made[0]

    def run(self, call: Callable):
        """call(context), with a context no other thread is using meanwhile."""
        with self._turns:
            with self._lock:
                ctx = self._idle.pop() if self._idle else None
            if ctx is None:
                ctx = self._make()
                with self._lock:
                    self._made.append(ctx)
            try:
                return call(ctx)
            finally:
                with self._lock:
                    self._idle.append(ctx)

    def made(self) -> list:
        with self._lock:
            return list(self._made)


class Codec:
    """Compresses and decompresses one page at a time."""

    id: int = RAW
    name: str = "raw"

    def __init__(self, page_size: int = 4096) -> None:
        self.page_size = page_size

    def compress(self, page) -> bytes:
        return bytes(page)

    def decompress(self, data, size: int | None = None) -> bytes:
        """`size`: the decoded length the store expects (a page, or a multi-page frame up to
        the codec's frame size); anything else is corruption."""
        size = size or self.page_size
        if len(data) != size:
            raise CodecError(f"raw blob of {len(data)} bytes, expected {size}")
        return bytes(data)

    def memory_bytes(self) -> int:
        """Bytes of native state this codec holds (contexts, tables)."""
        return 0


def _page_params(level: int, page_size: int) -> zstandard.ZstdCompressionParameters:
    """Magicless frames without content size or dict id: the store knows both already, and
    on a ~1 KiB compressed page those bytes are ~1% of the ratio. A multi-page frame (a
    `page_size` above a page) carries zstd's content checksum (4 bytes a frame, verified by
    every decode): what the kernel wrote is checked end to end, a dictionary or codec mix-up
    fails instead of returning other bytes. A page alone is checked by the store instead
    (its blob's checksum covers the page: store/integrity.py)."""
    return zstandard.ZstdCompressionParameters.from_level(
        level,
        source_size=page_size,
        format=zstandard.FORMAT_ZSTD1_MAGICLESS,
        write_content_size=False,
        write_checksum=page_size > PAGE,
        write_dict_id=False,
    )


class ZstdCodec(Codec):
    id = ZSTD
    name = "zstd"

    def __init__(self, level: int = 3, page_size: int = 4096) -> None:
        super().__init__(page_size)
        if not 1 <= level <= 19:
            raise ValueError(f"zstd level {level} out of range 1-19")
        self.level = level
        params = _page_params(level, page_size)
        self._cctx = zstandard.ZstdCompressor(compression_params=params)
        self._dctx: ContextPool | None = ContextPool(
            lambda: zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS))

    def compress(self, page) -> bytes:
        return self._cctx.compress(page)

    def decompress(self, data, size: int | None = None) -> bytes:
        size = size or self.page_size
        try:
            out = self._dctx.run(lambda dctx: dctx.decompress(data, max_output_size=size))
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: {exc}") from exc
        if len(out) != size:
            raise CodecError(f"zstd blob decoded to {len(out)} bytes, expected {size}")
        return out

    def memory_bytes(self) -> int:
        return self._cctx.memory_size() + sum(d.memory_size() for d in self._dctx.made())


DICT_KINDS = ("raw", "full")  # raw content only / a trained dictionary with entropy tables


def _dict_data(content: bytes, kind: str) -> zstandard.ZstdCompressionDict:
    if kind not in DICT_KINDS:
        raise ValueError(f"dictionary kind {kind!r} (raw, full)")
    dict_type = zstandard.DICT_TYPE_RAWCONTENT if kind == "raw" else zstandard.DICT_TYPE_FULLDICT
    return zstandard.ZstdCompressionDict(content, dict_type=dict_type)


class ZstdDictCodec(ZstdCodec):
    """zstd with a dictionary (shares the ZSTD codec id; the store records the dictionary
    id per blob next to it), for pages (`page_size` 4 KiB) or frames (`page_size` the frame's
    size: zstd sizes its window and tables from it).

    `kind` "raw": raw content, which gives zstd earlier matches; on 4 KiB pages the entropy
    tables of a trained dictionary made heaps worse (docs/ARCHITECTURE.md, measured again in
    tools/dicts/train.py). "full": a trained dictionary, content and entropy tables (on
    16-page frames zstd builds its own tables and the two kinds measure the same:
    tools/bench_dicts.py). The dictionary is digested once (precompute_compress) and both
    contexts are reused: loading it per page costs more than compressing.
    """

    def __init__(self, content: bytes, level: int = 3, page_size: int = 4096,
                 kind: str = "raw", shared: ZstdDictCodec | None = None) -> None:
        """`shared`: another codec of the same dictionary and sizes whose digested
        dictionary this one uses too (a pool's contexts: the tables are read-only, and for
        a frame they are ~1 MiB); such a codec compresses only (the first one decodes)."""
        ZstdCodec.__init__(self, level, page_size)
        self.content = bytes(content) if shared is None else shared.content
        self.kind = kind
        params = _page_params(level, page_size)
        if shared is None:
            cdict = _dict_data(self.content, kind)
            cdict.precompute_compress(compression_params=params)
            ddict = _dict_data(self.content, kind)  # digested once, shared by the contexts
            self._dctx = ContextPool(lambda: zstandard.ZstdDecompressor(
                dict_data=ddict, format=zstandard.FORMAT_ZSTD1_MAGICLESS))
            # The digested dictionary's match tables (zstd sizes them from these parameters;
            # python-zstandard has no accessor for a CDict's size) + its copy of the content.
            self._cdict_bytes = (4 * ((1 << params.hash_log) + (1 << params.chain_log))
                                 + len(self.content))
        else:
            cdict = shared._cdict
            self._dctx = None
            self._cdict_bytes = 0
        self._cctx = zstandard.ZstdCompressor(dict_data=cdict, compression_params=params)
        self._cdict = cdict

    def decompress(self, data, size: int | None = None) -> bytes:
        if self._dctx is None:
            raise CodecError("a pooled dictionary context does not decode")
        return super().decompress(data, size)

    def memory_bytes(self) -> int:
        # contexts + the digested dictionary + the decoder's and our copies of the content
        if self._dctx is None:
            return self._cctx.memory_size()
        return super().memory_bytes() + self._cdict_bytes + 2 * len(self.content)


def trial_compress(content: bytes, kind: str, level: int, size: int, data) -> bytes:
    """`data` compressed as a ZstdDictCodec(content, level, size, kind) would (decodable by
    one), with a context made for this call and dropped after it: a selection trial of a
    dictionary that no request has chosen yet, which must leave nothing behind (its
    digested tables are what a loaded dictionary costs)."""
    cctx = zstandard.ZstdCompressor(dict_data=_dict_data(content, kind),
                                    compression_params=_page_params(level, size))
    return cctx.compress(data)


class Lz4Codec(Codec):
    id = LZ4
    name = "lz4"

    def __init__(self, acceleration: int = 1, page_size: int = 4096) -> None:
        super().__init__(page_size)
        self.acceleration = max(1, acceleration)

    def compress(self, page) -> bytes:
        return lz4.block.compress(page, mode="fast", acceleration=self.acceleration, store_size=False)

    def decompress(self, data, size: int | None = None) -> bytes:
        size = size or self.page_size
        try:
            out = lz4.block.decompress(data, uncompressed_size=size)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4: {exc}") from exc
        if len(out) != size:
            raise CodecError(f"lz4 blob decoded to {len(out)} bytes, expected {size}")
        return out

    def memory_bytes(self) -> int:
        return _LZ4_STATE_BYTES


class Lz4HcCodec(Lz4Codec):
    id = LZ4HC
    name = "lz4hc"

    def __init__(self, level: int = 9, page_size: int = 4096) -> None:
        super().__init__(1, page_size)
        if not 1 <= level <= 12:
            raise ValueError(f"lz4hc level {level} out of range 1-12")
        self.level = level

    def compress(self, page) -> bytes:
        return lz4.block.compress(
            page, mode="high_compression", compression=self.level, store_size=False
        )

    def memory_bytes(self) -> int:
        return _LZ4HC_STATE_BYTES


class PooledCodec:
    """One codec for many threads: each compress borrows a codec of its own (ContextPool),
    since a zstd context must not be used by two threads at once (the store compresses
    frames outside its lock as well as under it)."""

    def __init__(self, make: Callable[[], Codec], size: int | None = None) -> None:
        self._pool = ContextPool(make, size)
        first = self._pool.first
        self.id, self.name, self.page_size = first.id, first.name, first.page_size

    def compress(self, data) -> bytes:
        return self._pool.run(lambda codec: codec.compress(data))

    def memory_bytes(self) -> int:
        return sum(codec.memory_bytes() for codec in self._pool.made())


def pays(length: int, pages: int = 1) -> bool:
    """Whether `length` compressed bytes for `pages` pages are worth storing compressed."""
    return length <= pages * MAX_COMPRESSED


# What a page alone must save to pay: PAGE - MAX_COMPRESSED bytes. Alone it compresses no
# better than inside a frame (no context from its neighbours, a frame header of its own),
# so a frame that saved less than that, headers allowed for, holds no page that pays alone.
_FRAME_HEADERS = 64


def alone_may_pay(length: int, pages: int, page_size: int = PAGE) -> bool:
    """Whether a page of a frame of `pages` pages that compressed to `length` bytes may pay
    compressed alone: False for a frame that did not compress at all (random bytes), whose
    pages are then stored as they are without compressing each one again, ~5x the cost of
    the frame's own try (BENCHMARKS.md, "A neighbour that writes incompressible pages")."""
    return pages * page_size - length + _FRAME_HEADERS >= page_size - MAX_COMPRESSED


def stored_size(n: int, page_size: int = PAGE) -> int:
    """Bytes the store keeps for a page compressed to n bytes (the page itself when that
    does not pay)."""
    return n if pays(n) else page_size


def make_codec(algorithm: str, level: int, page_size: int = 4096) -> Codec:
    """The codec for new writes, from `compression.algorithm` and `compression.level`."""
    if algorithm == "zstd":
        return ZstdCodec(level, page_size)
    if algorithm == "lz4":
        # For lz4 the config level is the acceleration factor (0 and 1 mean default speed).
        return Lz4Codec(max(1, level), page_size)
    if algorithm == "lz4hc":
        return Lz4HcCodec(level, page_size)
    raise ValueError(f"unknown compression algorithm {algorithm!r} (zstd, lz4, lz4hc)")


class CodecSet:
    """The codec used for new writes plus one decoder per codec id, for reading any blob.

    Blobs written under an earlier config (another algorithm or level) stay readable:
    every id has a decoder, and decoding does not depend on the level.
    """

    def __init__(self, writer: Codec, dictionaries=None) -> None:
        self.writer = writer
        # codec.dictionaries.registry.DictionaryRegistry (or None): decoders for dict ids > 0
        self.dictionaries = dictionaries
        page = writer.page_size
        self._decoders: dict[int, Codec] = {
            RAW: Codec(page),
            ZSTD: writer if writer.id == ZSTD else ZstdCodec(3, page),
            LZ4: writer if writer.id == LZ4 else Lz4Codec(1, page),
        }
        self._decoders[LZ4HC] = writer if writer.id == LZ4HC else self._decoders[LZ4]

    def encode_page(self, page, encoder: Codec | None = None, dict_id: int = 0,
                    compressed: bytes | None = None) -> tuple[bytes, int, int]:
        """(stored bytes, codec id, dictionary id) for one page: compressed by `encoder`
        (default: the writer; `compressed` when the caller already has its output), or the
        page itself (RAW) when compression does not pay."""
        encoder = encoder or self.writer
        if compressed is None:
            compressed = encoder.compress(page)
        if not pays(len(compressed)):
            return page, RAW, 0
        return compressed, encoder.id, dict_id

    def decompress(self, codec_id: int, data, dict_id: int = 0, size: int | None = None) -> bytes:
        if dict_id:
            if codec_id != ZSTD or self.dictionaries is None:
                raise CodecError(f"codec id {codec_id} with dictionary id {dict_id}")
            return self.dictionaries.decoder(dict_id).decompress(data, size)
        try:
            decoder = self._decoders[codec_id]
        except KeyError:
            raise CodecError(f"unknown codec id {codec_id}") from None
        return decoder.decompress(data, size)

    def memory_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for codec in [self.writer, *self._decoders.values()]:
            if id(codec) not in seen:
                seen.add(id(codec))
                total += codec.memory_bytes()
        if self.dictionaries is not None:
            total += self.dictionaries.memory_bytes()
        return total
