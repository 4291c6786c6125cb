"""The native packer and the native reads of dense blobs (datapath/nativestore.c:
native_pack, native_read / finish_read / cache_frames) against the Python path.

- packing: the same warm pages packed by the native packer and by the Python recompressor
  give the same books (pages by form and codec, frames) and every page reads back exact,
  through either path; a page rewritten while its group is being packed keeps its new
  bytes;
- reads: pages of dense frames and dense pages alone are answered natively, exact, and a
  frame is decoded once for the reads of its neighbours (the native frame cache), whose
  memory counts in stored_mem and goes when idle.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from agentzip_blk.datapath import native
from agentzip_blk.store import PageStore
from agentzip_blk.store.dedup import PageHasher
from agentzip_blk.store.tiering import Tiering
from nativeharness import NativeRequests, native_store

PAGE = 4096

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")]


def text_page(rnd: random.Random, salt: int) -> bytes:
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % salt,
             b"%d" % rnd.randrange(99999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b".")


def cold_tiering(**kw) -> Tiering:
    return Tiering(max_size=64 << 20, cold_grace_period=0.0, recompress_cpu=1.0, **kw)


def fill(store, door, rnd: random.Random, pages: int) -> bytearray:
    """Text pages (packable), noise (raw: packs into nothing), zero pages, in runs."""
    model = bytearray(pages * PAGE)
    for first in range(0, pages, 8):
        kind = rnd.random()
        if kind < 0.75:
            data = b"".join(text_page(rnd, first + k) for k in range(8))
        elif kind < 0.9:
            data = rnd.randbytes(8 * PAGE)
        else:
            data = bytes(8 * PAGE)
        (door.write if door is not None else store.write)(data, first * PAGE)
        model[first * PAGE:(first + 8) * PAGE] = data
    return model


def drain(store) -> int:
    time.sleep(0.03)  # past the grace period by a few ticks
    packed = 0
    while done := store.recompressor.pass_once():
        packed += done
    return packed


FORMS = ("pages", "warm_pages", "cold_pages", "same_pages", "units", "recompress_backlog",
         "unique_blobs", "codec_pages")


@pytest.mark.parametrize("frame_pages", [16, 4, 1])
def test_native_packing_matches_the_python_recompressor(frame_pages):
    seed = 99
    ours = native_store(size=2048 * PAGE, warm_algorithm="lz4", frame_pages=frame_pages,
                        dictionary="none", hasher=PageHasher(seed), tiering=cold_tiering())
    theirs = PageStore(2048 * PAGE, warm_algorithm="lz4", frame_pages=frame_pages,
                       dictionary="none", hasher=PageHasher(seed), tiering=cold_tiering())
    path = native.NativePath(ours)
    door = NativeRequests(ours, path)
    try:
        assert ours.recompressor.native_pack is not None
        model = fill(ours, door, random.Random(4), 1024)
        assert fill(theirs, None, random.Random(4), 1024) == model
        assert drain(ours) == drain(theirs) > 0
        a, b = ours.stats(), theirs.stats()
        for key in FORMS:
            assert a[key] == b[key], key
        assert a["recompressed_pages_total"] == b["recompressed_pages_total"]
        assert a["warm_pages"] < 200 and a["recompress_backlog"] == 0
        assert path.counters()["packed_pages"] == a["recompressed_pages_total"]
        for first in range(0, 1024, 16):
            want = bytes(model[first * PAGE:(first + 16) * PAGE])
            assert door.read(first * PAGE, 16 * PAGE) == want
            assert ours.read(first * PAGE, 16 * PAGE) == want
            assert theirs.read(first * PAGE, 16 * PAGE) == want
        # the compressed bytes of the two packers are within a few per cent (same level,
        # same frames; libzstd and python-zstandard may differ in a block or two)
        assert abs(a["compressed_bytes"] - b["compressed_bytes"]) < 0.03 * b["compressed_bytes"]
        ours.check()
        theirs.check()
    finally:
        door.close()
        path.close()
        ours.close()
        theirs.close()


def test_dense_pages_are_read_natively_and_a_frame_decodes_once_for_its_neighbours():
    store = native_store(size=1024 * PAGE, warm_algorithm="lz4", frame_pages=16,
                         dictionary="none", tiering=cold_tiering())
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        rnd = random.Random(6)
        model = bytearray()
        for first in range(0, 256, 16):
            data = b"".join(text_page(rnd, first + k) for k in range(16))
            door.write(data, first * PAGE)
            model += data
        assert drain(store) == 256
        assert store.stats()["units"] == 16
        before = path.counters()
        for slot in range(256):  # a swap-in in address order, one page a request
            assert door.read(slot * PAGE, PAGE) == model[slot * PAGE:(slot + 1) * PAGE]
        after = path.counters()
        assert door.python == 0 and after["reads"] - before["reads"] == 256
        assert after["frame_cache_misses"] - before["frame_cache_misses"] == 16  # once a frame
        assert after["frame_cache_hits"] - before["frame_cache_hits"] == 240
        cached = after["frame_cache_bytes"]
        assert cached > 0 and store.stats()["hot_cache_bytes"] >= cached
        time.sleep(0.6)  # FRAME_CACHE_IDLE
        store.maintain()
        assert path.counters()["frame_cache_bytes"] == 0
        store.check()
    finally:
        door.close()
        path.close()
        store.close()


def test_a_corrupt_frame_is_handed_up_and_answers_eio():
    store = native_store(size=256 * PAGE, warm_algorithm="lz4", frame_pages=16,
                         dictionary="none", tiering=cold_tiering())
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        rnd = random.Random(2)
        door.write(b"".join(text_page(rnd, k) for k in range(16)), 0)
        assert drain(store) == 16
        blob = int(store.slots.handle[3])
        pool = store.pool
        arena, cell = int(store.blobs.arena[blob]), int(store.blobs.cell[blob])
        cls = pool.classes[int(pool.arena_classes()[arena])]
        data = bytearray(pool.get(arena, cell, int(store.blobs.length[blob])))
        data[len(data) // 2] ^= 0xFF
        pool.put(arena, cell, bytes(data))
        with pytest.raises(Exception, match="checksum"):
            door.read(3 * PAGE, PAGE)
        assert door.python == 1 and store.counters.checksum_errors == 1
        assert path.counters()["handed_up_by"]["corrupt"] == 1
        del cls
    finally:
        door.close()
        path.close()
        store.close()


def test_a_page_rewritten_while_its_group_is_packed_keeps_its_new_bytes():
    """Writers rewrite warm pages natively while the packer runs passes over them: a group
    with a page rewritten since the pick is left as it is (raced), and every page reads back
    its last written bytes."""
    store = native_store(size=4096 * PAGE, warm_algorithm="lz4", frame_pages=16,
                         dictionary="none", tiering=cold_tiering())
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    lock = threading.Lock()
    rnd = random.Random(8)
    pages = 2048
    model = bytearray(pages * PAGE)
    for first in range(0, pages, 16):
        data = b"".join(text_page(rnd, first + k) for k in range(16))
        door.write(data, first * PAGE)
        model[first * PAGE:(first + 16) * PAGE] = data
    stop = threading.Event()
    failures: list[str] = []

    def writer() -> None:
        r = random.Random(9)
        mine = NativeRequests(store, path)
        try:
            while not stop.is_set():
                first = r.randrange(pages - 4)
                data = b"".join(text_page(r, 10_000 + first + k) for k in range(4))
                with lock:
                    mine.write(data, first * PAGE)
                    model[first * PAGE:(first + 4) * PAGE] = data
        except Exception as exc:
            failures.append(f"writer: {type(exc).__name__}: {exc}")
        finally:
            mine.close()

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            store.recompressor.pass_once()
    finally:
        stop.set()
        t.join(30)
    try:
        assert not t.is_alive() and failures == []
        assert path.counters()["packed_pages"] > 0
        assert door.read(0, 16 * PAGE) == model[:16 * PAGE]
        for first in range(0, pages, 16):
            assert store.read(first * PAGE, 16 * PAGE) == model[first * PAGE:(first + 16) * PAGE]
        store.check()
    finally:
        door.close()
        path.close()
        store.close()


def test_concurrent_reads_of_one_frame_decode_it_once():
    """Readahead sends a frame's neighbouring pages in concurrent requests: one request
    decodes the frame, the others wait for its copy (FrameCache.dec_*), every page exact."""
    store = native_store(size=1024 * PAGE, warm_algorithm="lz4", frame_pages=16,
                         dictionary="none", tiering=cold_tiering())
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        rnd = random.Random(12)
        model = b"".join(text_page(rnd, k) for k in range(256))
        for first in range(0, 256, 16):
            door.write(model[first * PAGE:(first + 16) * PAGE], first * PAGE)
        assert drain(store) == 256 and store.stats()["units"] == 16
        before = path.counters()
        failures: list[str] = []
        doors: list[NativeRequests] = []

        def reader(seed: int) -> None:
            mine = NativeRequests(store, path)
            doors.append(mine)
            order = list(range(256))
            random.Random(seed).shuffle(order)
            for slot in order:
                if mine.read(slot * PAGE, PAGE) != model[slot * PAGE:(slot + 1) * PAGE]:
                    failures.append(f"slot {slot}")

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        after = path.counters()
        assert failures == [] and not any(t.is_alive() for t in threads)
        served = sum(d.native for d in doors)
        handed = sum(d.python for d in doors)
        assert served + handed == 4 * 256
        # each frame decoded natively at most once: the others waited for it, or (a wait
        # that ran out under load) were handed to Python
        assert after["frame_cache_misses"] - before["frame_cache_misses"] <= 16
        store.check()
        for d in doors:
            d.close()
    finally:
        door.close()
        path.close()
        store.close()


def test_the_rows_of_pages_the_native_packer_packed_go_back():
    """Warm pages take a blob row each, their frames one per 16 wherever the free rows were:
    the maintainer moves the live rows down (their slots re-pointed) and gives the free top
    of the table back (Tiers.compact_rows), every page exact."""
    store = native_store(size=8192 * PAGE, warm_algorithm="lz4", frame_pages=16,
                         dictionary="none", tiering=cold_tiering())
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        rnd = random.Random(21)
        model = bytearray()
        for first in range(0, 6000, 16):
            n = min(16, 6000 - first)
            data = b"".join(text_page(rnd, first + k) for k in range(n))
            door.write(data, first * PAGE)
            model += data
        warm_rows = store.blobs.rows
        before = store.stats()["meta"]["blob_table"]
        time.sleep(0.03)  # past the grace period
        for _ in range(6):
            store.maintain()  # packs (natively), then moves rows down and gives the top back
        s = store.stats()
        assert s["warm_pages"] == 0 and path.counters()["packed_pages"] == 6000
        assert store.blobs.rows <= s["unique_blobs"] + 64 < warm_rows // 8
        assert s["meta"]["blob_table"] < before / 4
        for first in range(0, 6000, 16):
            n = min(16, 6000 - first)
            want = bytes(model[first * PAGE:(first + n) * PAGE])
            assert door.read(first * PAGE, n * PAGE) == want
        store.check()
    finally:
        door.close()
        path.close()
        store.close()
