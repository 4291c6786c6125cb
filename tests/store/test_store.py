"""PageStore against a plain bytearray model: every byte, every invariant, every operation."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentzip_blk.errors import OutOfRange, StoreFull
from agentzip_blk.store import PageStore

PAGE = 4096
DEVICE = 64 * PAGE


def page_content(kind: str, seed: int) -> bytes:
    """Pages of the kinds the store treats differently."""
    rnd = random.Random(seed)
    if kind == "zero":
        return bytes(PAGE)
    if kind == "same":
        return rnd.randbytes(8) * (PAGE // 8)
    if kind == "random":
        return rnd.randbytes(PAGE)
    if kind == "text":
        words = [b"tool", b"call", b'"json"', b"result", b"\\n", b"value", b"42", b"{", b"}"]
        out = b" ".join(rnd.choice(words) for _ in range(PAGE))
        return out[:PAGE]
    # A few fixed pages, so that dedup gets exercised.
    return bytes([seed % 4]) * 100 + b"dup" * 1332


kinds = st.sampled_from(["zero", "same", "random", "text", "dup"])


@st.composite
def payloads(draw) -> bytes:
    npages = draw(st.integers(1, 4))
    data = b"".join(page_content(draw(kinds), draw(st.integers(0, 5))) for _ in range(npages))
    length = draw(st.integers(1, len(data)))
    return data[:length]


class StoreModel(RuleBasedStateMachine):
    UNIT_PAGES = 1

    def __init__(self) -> None:
        super().__init__()
        self.store = PageStore(DEVICE, max_size=64 << 20, frame_pages=self.UNIT_PAGES)
        self.model = bytearray(DEVICE)

    offsets = st.one_of(
        st.integers(0, DEVICE - 1),
        st.integers(0, DEVICE // PAGE - 1).map(lambda p: p * PAGE),
    )

    @rule(offset=offsets, data=payloads())
    def write(self, offset: int, data: bytes) -> None:
        data = data[: DEVICE - offset]
        self.store.write(data, offset)
        self.model[offset : offset + len(data)] = data

    @rule(offset=offsets, length=st.integers(0, 6 * PAGE))
    def read(self, offset: int, length: int) -> None:
        length = min(length, DEVICE - offset)
        assert self.store.read(offset, length) == self.model[offset : offset + length]

    @rule(offset=offsets, length=st.integers(0, 6 * PAGE))
    def trim(self, offset: int, length: int) -> None:
        length = min(length, DEVICE - offset)
        self.store.trim(offset, length)
        self.model[offset : offset + length] = bytes(length)

    @rule(offset=offsets, length=st.integers(0, 6 * PAGE))
    def zero(self, offset: int, length: int) -> None:
        length = min(length, DEVICE - offset)
        self.store.zero(offset, length)
        self.model[offset : offset + length] = bytes(length)

    @rule()
    def maintain(self) -> None:
        self.store.maintain()  # compaction; with units, rewriting sparse ones

    @rule(offset=st.integers(-PAGE, DEVICE + PAGE), length=st.integers(0, 2 * PAGE))
    def out_of_range(self, offset: int, length: int) -> None:
        if 0 <= offset and offset + length <= DEVICE:
            return
        with pytest.raises(OutOfRange):
            self.store.write(bytes(length), offset)
        with pytest.raises(OutOfRange):
            self.store.read(offset, length)

    @invariant()
    def books_balance(self) -> None:
        self.store.check()
        stats = self.store.stats()
        assert stats["stored_mem"] == (stats["pool_resident_bytes"] + stats["meta_bytes"]
                                       + stats["hot_cache_bytes"])
        assert stats["pool_bytes"] == self.store.pool.allocated_bytes

    @precondition(lambda self: True)
    @rule()
    def whole_device_matches(self) -> None:
        assert self.store.read(0, DEVICE) == self.model


class UnitStoreModel(StoreModel):
    """The same with 3-page units: units form from 2-4 page writes, partial groups and all,
    and overwrites, trims and duplicates land inside them."""

    UNIT_PAGES = 3


TestStoreModel = StoreModel.TestCase
TestUnitStoreModel = UnitStoreModel.TestCase
for case in (TestStoreModel, TestUnitStoreModel):
    case.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def test_everything_returns_to_zero_after_trim():
    store = PageStore(DEVICE, max_size=64 << 20)
    rnd = random.Random(7)
    for i in range(200):
        kind = rnd.choice(["zero", "same", "random", "text", "dup"])
        store.write(page_content(kind, rnd.randrange(6)), rnd.randrange(DEVICE // PAGE) * PAGE)
    assert store.stats()["pages"] > 0
    store.trim(0, DEVICE)
    store.check()
    stats = store.stats()
    assert stats["pages"] == stats["orig_mem"] == 0
    assert stats["unique_blobs"] == stats["shared_pages"] == stats["same_pages"] == 0
    assert stats["pool_bytes"] == stats["pool_live_bytes"] == 0
    assert store.pool.arena_count == 0
    assert store.index.count == 0


def test_page_kinds_are_counted():
    store = PageStore(DEVICE, max_size=64 << 20)
    store.write(page_content("same", 1), 0)
    store.write(page_content("random", 1), PAGE)
    store.write(page_content("text", 1), 2 * PAGE)
    store.write(page_content("text", 1), 3 * PAGE)  # duplicate of slot 2
    stats = store.stats()
    assert stats["same_pages"] == 1
    assert stats["raw_pages"] == 1
    assert stats["compressed_pages"] == 2
    assert stats["shared_pages"] == 2
    assert stats["unique_blobs"] == 2
    assert stats["codec_pages"] == {"raw": 1, "zstd": 2}
    assert stats["orig_mem"] == 4 * PAGE
    # The shared text page is stored once: its blob is much smaller than a page.
    assert stats["compressed_bytes"] < PAGE + PAGE // 2


@pytest.mark.parametrize("algorithm,level", [("zstd", 1), ("zstd", 19), ("lz4", 1), ("lz4hc", 9)])
def test_codecs_round_trip(algorithm: str, level: int):
    store = PageStore(DEVICE, algorithm=algorithm, level=level, max_size=64 << 20)
    data = b"".join(page_content(k, 3) for k in ["text", "random", "same", "dup", "zero"])
    store.write(data, PAGE)
    assert store.read(PAGE, len(data)) == data
    assert store.stats()["codec_pages"].get(algorithm, 0) >= 2


def test_full_pool_raises_and_keeps_everything():
    store = PageStore(DEVICE, max_size=64 * 1024)  # room for a handful of arenas
    written = {}
    rnd = random.Random(3)
    with pytest.raises(StoreFull):
        for slot in range(DEVICE // PAGE):
            data = rnd.randbytes(PAGE)  # raw pages fill the pool fast
            store.write(data, slot * PAGE)
            written[slot] = data
    assert store.stats()["enospc"] == 1
    for slot, data in written.items():
        assert store.read(slot * PAGE, PAGE) == data
    # A multi-page request that cannot fit is refused whole: no slot of it changes.
    before = store.read(0, 8 * PAGE)
    with pytest.raises(StoreFull):
        store.write(os.urandom(8 * PAGE), 0)
    assert store.read(0, 8 * PAGE) == before
    store.check()
    # Freeing space makes writes possible again.
    store.trim(0, DEVICE)
    store.write(os.urandom(PAGE), 0)
    store.check()


def test_overwrite_releases_old_blob():
    store = PageStore(DEVICE, max_size=64 << 20)
    for i in range(50):
        store.write(page_content("random", i), 0)
    store.check()
    assert store.stats()["unique_blobs"] == 1
    assert store.pool.live_cells == 1


def test_stored_mem_tracks_the_allocator():
    store = PageStore(DEVICE, max_size=64 << 20)
    empty = store.stats()["stored_mem"]
    store.write(os.urandom(16 * PAGE), 0)
    stats = store.stats()
    # 16 raw pages of 4 KiB live in arenas the pool really mapped.
    assert stats["pool_bytes"] >= 16 * PAGE
    assert stats["pool_bytes"] == sum(
        cls["arenas"] * store.pool.classes[-1].arena_size for cls in store.pool.class_usage()
    )
    assert stats["stored_mem"] - empty >= stats["pool_bytes"]


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        PageStore(PAGE + 1)
    with pytest.raises(ValueError):
        PageStore(DEVICE, page_size=8192)
    with pytest.raises(ValueError):
        PageStore(DEVICE, algorithm="gzip")


@pytest.mark.parametrize("frame_pages", [1, 8])
def test_pool_memory_is_counted_as_the_kernel_sees_it(frame_pages: int):
    """stored_mem counts the pages of arenas actually touched; mincore on every arena must
    agree (a fresh arena holding one cell costs that cell's pages, not the whole arena), or
    count at most one page per arena more (a blob shorter than its cell leaves the cell's
    last page untouched): never less than the kernel holds."""
    from agentzip_blk.store.tables import resident_bytes

    store = PageStore(DEVICE, max_size=64 << 20, frame_pages=frame_pages)
    rnd = random.Random(3)
    for slot in range(0, 60, 3):  # scattered sizes: many classes with one partial arena each
        data = b"".join(page_content(rnd.choice(["text", "random", "dup"]), rnd.randrange(99))
                        for _ in range(3))
        store.write(data, slot * PAGE)
    store.trim(6 * PAGE, 9 * PAGE)
    seen = sum(resident_bytes(addr, size) for addr, size in store.pool.mapped())
    stats = store.stats()
    arenas = stats["pool_arenas"]
    assert seen <= stats["pool_resident_bytes"] <= seen + arenas * PAGE
    assert stats["pool_live_bytes"] <= stats["pool_resident_bytes"] < stats["pool_bytes"]
    store.check()


def test_the_slot_table_costs_only_the_chunks_in_use():
    """A 4 GiB device has 8 MiB of slot table; pages written at a few places cost a few
    table pages, and neither a whole-device discard (what swapon and a sandbox's exit send)
    nor stats may fault in the rest."""
    from agentzip_blk.store.slots import CHUNK_SLOTS
    from agentzip_blk.store.tables import array_resident_bytes

    size = 4 << 30
    store = PageStore(size, max_size=64 << 20)
    slots = [0, 5000, 700000, 1048574]
    for slot in slots:
        store.write(page_content("text", slot) + page_content("same", slot), slot * PAGE)
    store.trim(0, size)
    store.write(page_content("text", 1), 123456 * PAGE)
    stats = store.stats()
    touched = {s // CHUNK_SLOTS for s in slots} | {(s + 1) // CHUNK_SLOTS for s in slots} | {123456 // CHUNK_SLOTS}
    assert store.slots.slot_bytes == 8  # kind, 32-bit handle, sub, 16-bit read tick
    assert stats["meta"]["slot_table"] == (len(touched) * CHUNK_SLOTS * 8
                                           + store.slots.words.nbytes())
    # a chunk's handles fill half a page; these chunks all lie on different pages
    assert array_resident_bytes(store.slots.handle) == len({c // 2 for c in touched}) * PAGE
    assert stats["pages"] == 1
    assert store.read(123456 * PAGE, PAGE) == page_content("text", 1)
    assert store.read(5000 * PAGE, 2 * PAGE) == bytes(2 * PAGE)
