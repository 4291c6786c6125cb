"""PageStore.forget_freed: the copies of slots the kernel freed without telling the device.

The kernel's swap map is given as an array here (what datapath.swapmap reads from the
running kernel; tests/datapath/test_swapmap.py and the CLI test read the real one): the
store's protocol is what is tested: only FREE slots go, never one whose cluster was written
since before the map was read (the kernel allocates a slot before it writes it), every
other page stays exact, and the books check.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentzip_blk.datapath import native
from agentzip_blk.store import PageStore
from agentzip_blk.store.slots import CHUNK_SLOTS
from nativeharness import NativeRequests, native_store

PAGE = 4096
FREE, CACHE_ONLY, IN_USE = 0x00, 0x40, 0x01


def page(rnd: random.Random, salt: int) -> bytes:
    return (b"%d:" % salt + rnd.randbytes(64)) * (PAGE // 72) + bytes(PAGE % 72 + 0)


def filled(store, pages: int, seed: int = 1) -> bytearray:
    rnd = random.Random(seed)
    model = bytearray()
    for first in range(0, pages, 16):
        data = b"".join(page(rnd, first + k)[:PAGE].ljust(PAGE, b".") for k in range(16))
        store.write(data, first * PAGE)
        model += data
    return model


def kernel_map(pages: int, free: range, cache_only: range = range(0)) -> np.ndarray:
    m = np.full(pages, IN_USE, dtype=np.uint8)
    m[0] = 0x3F  # the header slot, as the kernel marks it
    m[free.start:free.stop] = FREE
    m[cache_only.start:cache_only.stop] = CACHE_ONLY
    return m


def test_only_slots_the_kernel_calls_free_are_forgotten():
    store = PageStore(4096 * PAGE)
    model = filled(store, 2048)
    kmap = kernel_map(2048, free=range(1000, 1300), cache_only=range(1300, 1400))
    assert store.forget_freed(lambda: kmap) == 300
    s = store.stats()
    assert s["kernel_freed_pages"] == 300 and s["pages"] == 2048 - 300
    for slot in range(2048):
        got = store.read(slot * PAGE, PAGE)
        want = bytes(PAGE) if 1000 <= slot < 1300 else model[slot * PAGE:(slot + 1) * PAGE]
        assert got == want, slot
    assert store.forget_freed(lambda: kmap) == 0  # nothing left to forget there
    store.check()


def test_a_slot_written_after_the_map_was_read_keeps_its_new_bytes():
    """The kernel frees slots, reads of its map happen, and it allocates and writes some of
    them again before the store forgets: those clusters are left for the next round."""
    store = PageStore(4096 * PAGE)
    model = filled(store, 2048)
    kmap = kernel_map(2048, free=range(600, 1600))
    new = b"fresh".ljust(PAGE, b"!")

    def read_then_kernel_writes() -> np.ndarray:
        copy = kmap.copy()  # read while slot 700 was free...
        store.write(new, 700 * PAGE)  # ...then the kernel reused it, before we forget
        return copy

    done = store.forget_freed(read_then_kernel_writes)
    written_chunk = range(700 // CHUNK_SLOTS * CHUNK_SLOTS, (700 // CHUNK_SLOTS + 1) * CHUNK_SLOTS)
    skipped = len(set(range(600, 1600)) & set(written_chunk))
    assert done == 1000 - skipped
    assert store.read(700 * PAGE, PAGE) == new
    for slot in range(600, 1600):
        if slot in written_chunk and slot != 700:
            assert store.read(slot * PAGE, PAGE) == model[slot * PAGE:(slot + 1) * PAGE]
    # next round: the kernel's map now says 700 is in use; the rest of its cluster goes
    kmap[700] = IN_USE
    assert store.forget_freed(lambda: kmap) == skipped - 1
    assert store.read(700 * PAGE, PAGE) == new
    store.check()


@pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")
def test_native_writes_mark_their_clusters_too():
    store = native_store(size=4096 * PAGE, warm_algorithm="lz4")
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        model = filled(store, 1024)
        store.maintain()  # the tables grown ahead of need, as the server's maintainer does
        kmap = kernel_map(1024, free=range(1, 1024))
        new = b"native".ljust(PAGE, b"#")

        def read_then_native_write() -> np.ndarray:
            copy = kmap.copy()
            door.write(new, 5 * PAGE)
            return copy

        before = door.native_writes
        done = store.forget_freed(read_then_native_write)
        assert door.native_writes == before + 1
        assert done == 1023 - (CHUNK_SLOTS - 1)  # all but the first cluster (slot 0 in use)
        assert store.read(5 * PAGE, PAGE) == new
        assert store.read(6 * PAGE, PAGE) == model[6 * PAGE:7 * PAGE]
        store.check()
    finally:
        door.close()
        path.close()
        store.close()


def test_no_map_forgets_nothing():
    store = PageStore(1024 * PAGE)
    filled(store, 256)
    assert store.forget_freed(lambda: None) == 0
    assert store.stats()["pages"] == 256
