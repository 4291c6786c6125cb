"""Native writes (datapath/nativestore.c) against the Python path and a model.

The same requests go to a store served through the native loop and to a store served by
Python alone, with the same keyed hash: every read answers the model's bytes on both, both
pass store.check(), and their books agree (pages by kind and codec, distinct blobs, pages
shared). What the native side cannot store (a same-filled word other than zero, a dedup
candidate on disk, no arena with room) it hands up intact, and the Python path stores it;
a write over a disk blob is native, and the extent it frees reaches the tier's books.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentzip_blk.datapath import native
from agentzip_blk.store import PageStore
from agentzip_blk.store.dedup import PageHasher
from agentzip_blk.store.tiering import Tiering
from nativeharness import (
    IN_HEADER,
    MAX_REPLY,
    OUT_HEADER,
    WRITE,
    NativeRequests,
    PerThread,
    differing_pages,
    native_store,
    write_request,
)

PAGE = 4096

pytestmark = pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")


def text_page(rnd: random.Random, salt: int) -> bytes:
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % salt,
             b"%d" % rnd.randrange(99999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b".")


def some_pages(rnd: random.Random, n: int, library: list[bytes]) -> bytes:
    """n pages: text (lz4), noise (raw), zero, a same-fill word, repeats within the request
    and of pages written before (the library)."""
    out = []
    for k in range(n):
        kind = rnd.random()
        if kind < 0.40:
            page = text_page(rnd, rnd.randrange(1000))
        elif kind < 0.50:
            page = rnd.randbytes(PAGE)
        elif kind < 0.62:
            page = bytes(PAGE)
        elif kind < 0.635:
            page = struct.pack("<Q", rnd.getrandbits(64)) * (PAGE // 8)
        elif kind < 0.8 and out:
            page = rnd.choice(out)
        elif library:
            page = rnd.choice(library)
        else:
            page = text_page(rnd, k)
        out.append(page)
    library.extend(out[:4])
    del library[:-64]
    return b"".join(out)


class Twin:
    """A native-served store and a Python-only store of the same configuration and hash
    seed, and the model of what the device holds."""

    def __init__(self, pages: int, seed: int = 1234, **kw) -> None:
        self.pages = pages
        size = pages * PAGE
        kw.setdefault("warm_algorithm", "lz4")
        self.store = native_store(size=size, hasher=PageHasher(seed), **kw)
        self.plain = PageStore(size, hasher=PageHasher(seed),
                               tiering=Tiering(max_size=64 << 20), **kw)
        self.path = native.NativePath(self.store)
        self.door = NativeRequests(self.store, self.path)
        self.model = bytearray(size)

    def write(self, data: bytes, first: int) -> None:
        self.door.write(data, first * PAGE)
        self.plain.write(data, first * PAGE)
        self.model[first * PAGE:first * PAGE + len(data)] = data

    def trim(self, first: int, n: int) -> None:
        self.store.trim(first * PAGE, n * PAGE)
        self.plain.trim(first * PAGE, n * PAGE)
        self.model[first * PAGE:(first + n) * PAGE] = bytes(n * PAGE)

    def verify(self) -> None:
        for first in range(0, self.pages, 16):
            n = min(16, self.pages - first)
            want = bytes(self.model[first * PAGE:(first + n) * PAGE])
            assert self.door.read(first * PAGE, n * PAGE) == want, first
            assert self.plain.read(first * PAGE, n * PAGE) == want, first
        self.store.check()
        self.plain.check()

    def close(self) -> None:
        self.door.close()
        self.path.close()
        self.store.close()
        self.plain.close()


BOOKS = ("pages", "same_pages", "raw_pages", "compressed_pages", "codec_pages",
         "dedup_saved_pages", "shared_pages", "unique_blobs", "warm_pages", "cold_pages",
         "pool_pages", "orig_mem")


@pytest.mark.parametrize("dedup,warm,frame_pages", [(True, "lz4", 1), (False, "lz4", 1),
                                                    (True, "none", 16), (False, "none", 16),
                                                    (True, "none", 4)])
def test_native_writes_match_the_python_path_and_the_model(dedup, warm, frame_pages):
    """Warm pages (lz4 alone) and frames at once (warm_algorithm none: zstd frames, pages a
    frame does not hold compressed alone)."""
    twin = Twin(1024, dedup=dedup, warm_algorithm=warm, frame_pages=frame_pages,
                dictionary="none")
    try:
        rnd = random.Random(17)
        library: list[bytes] = []
        for step in range(400):
            first = rnd.randrange(twin.pages - 16)
            n = rnd.choice([1, 1, 2, 4, 4, 8, 16])
            twin.write(some_pages(rnd, n, library), first)
            if rnd.random() < 0.05:
                twin.trim(rnd.randrange(twin.pages - 64), 64)
            if step % 100 == 99:
                twin.verify()
        twin.verify()
        door = twin.door
        assert door.native_writes > 200 and door.python_writes > 0  # words are Python's
        ours, theirs = twin.store.stats(), twin.plain.stats()
        for key in BOOKS + ("units",):
            assert ours[key] == theirs[key], key
        assert (ours["units"] > 0) == (warm == "none")
        # python-lz4 and the system's liblz4 (both 1.9.4) may differ by a byte or two a page,
        # libzstd and python-zstandard's by a few bytes a frame
        assert abs(ours["compressed_bytes"] - theirs["compressed_bytes"]) < 0.02 * theirs["compressed_bytes"]
        assert ours["writes"] == theirs["writes"] == 400
        assert ours["bytes_written"] == theirs["bytes_written"]
        assert ours["dedup_hits"] == theirs["dedup_hits"]
        assert (ours["dedup_hits"] > 0) == dedup
        counters = twin.path.counters()
        assert counters["writes"] == door.native_writes
        assert counters["handed_up_by"]["write_word"] > 0
    finally:
        twin.close()


@pytest.mark.parametrize("frame_pages", [4, 16])
def test_a_frame_of_random_bytes_is_stored_raw_and_a_mixed_one_page_by_page(frame_pages):
    """A frame that does not compress at all is stored raw without compressing each page
    again (codecs.alone_may_pay: the noisy neighbour's cost, issue 27 item 6); one that
    only fails to pay as a whole still has its compressible pages compressed alone. Both
    paths decide the same way."""
    twin = Twin(256, warm_algorithm="none", frame_pages=frame_pages, dictionary="none")
    try:
        rnd = random.Random(3)
        noise = b"".join(rnd.randbytes(PAGE) for _ in range(frame_pages))
        twin.write(noise, 0)
        mixed = b"".join(rnd.randbytes(PAGE) for _ in range(frame_pages - 1)) + text_page(rnd, 1)
        twin.write(mixed, 64)
        twin.verify()
        ours, theirs = twin.store.stats(), twin.plain.stats()
        for key in BOOKS + ("units", "unit_fallbacks", "units_incompressible"):
            assert ours[key] == theirs[key], key
        assert ours["unit_fallbacks"] == 2 and ours["units_incompressible"] == 1
        assert ours["raw_pages"] == 2 * frame_pages - 1 and ours["compressed_pages"] == 1
        assert twin.path.counters()["units_incompressible"] == 1
    finally:
        twin.close()


def test_writes_over_disk_blobs_and_frames_are_stored_natively(tmp_path):
    """A write over disk blobs is native: the last reference's extent goes to the queue
    Python empties into the tier's books (DiskTier.settle). A page equal to one inside a
    frame is compared with the frame natively (decoded once, then from the frame cache) and
    shares it."""
    tiering = Tiering(max_size=64 << 20, swap_out_path=str(tmp_path / "tier"),
                      swap_out_max_size=64 << 20, cold_grace_period=0.0, recompress_cpu=1.0)
    store = native_store(size=256 * PAGE, warm_algorithm="lz4", frame_pages=16, tiering=tiering)
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        rnd = random.Random(5)
        pages = [text_page(rnd, k) for k in range(64)]
        for first in range(0, 64, 16):
            door.write(b"".join(pages[first:first + 16]), first * PAGE)
        assert door.native_writes == 4
        time.sleep(0.05)
        while store.recompressor.pass_once():  # the pages packed into frames
            pass
        assert store.stats()["cold_pages"] == 64
        door.write(pages[3], 100 * PAGE)  # equal to page 3, in a frame: shared
        assert path.counters()["handed_up_by"]["write_dedup"] == 0
        assert int(store.slots.handle[100]) == int(store.slots.handle[3])
        assert int(store.slots.sub[100]) == int(store.slots.sub[3])
        store.demote_cold(limit=100)
        assert store.stats()["disk_pages"] > 0
        disk_slot = next(s for s in range(64) if store.blobs.tier[store.slots.handle[s]] == 1)
        blob = int(store.slots.handle[disk_slot])
        holders = [s for s in range(256) if store.slots.kind[s] == 2
                   and int(store.slots.handle[s]) == blob]
        extent = store.disk.extent_size(int(store.blobs.length[blob]))
        store.check()
        live = store.disk.live_bytes
        written = door.native_writes
        model = {s: pages[s] for s in range(64)} | {100: pages[3]}
        for s in holders:  # over every page of a disk frame: its last reference goes
            model[s] = text_page(rnd, 999 + s)
            door.write(model[s], s * PAGE)
        assert path.counters()["handed_up_by"]["write_disk"] == 0
        assert door.native_writes == written + len(holders)
        store.check()  # settles the queue: "disk extents leak" otherwise
        assert store.disk.live_bytes == live - extent
        for s, want in model.items():
            assert store.read(s * PAGE, PAGE) == want, s
        store.check()
    finally:
        door.close()
        path.close()
        store.close()


def test_native_writes_map_and_unmap_arenas_in_the_pools_books():
    store = native_store(size=256 * PAGE, warm_algorithm="lz4")
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    pool = store.pool
    try:
        rnd = random.Random(3)
        door.write(rnd.randbytes(PAGE), 0)  # stored raw: the raw class's first arena
        door.write(text_page(rnd, 1), PAGE)  # lz4: another class's
        assert door.native_writes == 2 and pool.arena_count == 2
        raw = pool.class_for(PAGE)
        assert pool.allocated_bytes >= raw.arena_size and pool.live_cells == 2
        store.check()
        door.write(bytes(2 * PAGE), 0)  # both replaced by zero pages: both arenas go
        assert door.native_writes == 3
        assert pool.arena_count == 0 and pool.allocated_bytes == 0 and pool.resident_bytes == 0
        store.check()
        door.write(rnd.randbytes(PAGE), 2 * PAGE)  # an arena id freed above, mapped again
        assert pool.arena_count == 1
        store.write(rnd.randbytes(PAGE), 3 * PAGE)  # Python allocates in the native arena
        assert pool.arena_count == 1 and pool.live_cells == 2
        store.trim(2 * PAGE, 2 * PAGE)  # and Python unmaps it
        assert pool.arena_count == 0
        store.check()
    finally:
        door.close()
        path.close()
        store.close()


def test_a_full_pool_or_full_books_hand_up_and_python_goes_on(tmp_path):
    """At the pool's cap a new page goes to the disk tier, which is Python's; with the arena
    books full until the maintainer grows them, the write is Python's too."""
    tiering = Tiering(max_size=64 * 1024, swap_out_path=str(tmp_path / "tier"),
                      swap_out_max_size=64 << 20)
    store = native_store(size=1024 * PAGE, warm_algorithm="lz4", tiering=tiering)
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    try:
        rnd = random.Random(8)
        model = {}
        for slot in range(40):
            page = rnd.randbytes(PAGE)  # raw: 4 KiB cells, the 64 KiB cap fills fast
            door.write(page, slot * PAGE)
            model[slot] = page
        assert path.counters()["handed_up_by"]["write_room"] > 0
        assert door.native_writes > 0 and door.python_writes > 0
        assert store.stats()["disk_pages"] > 0
        for slot, page in model.items():
            assert door.read(slot * PAGE, PAGE) == page
        store.check()
    finally:
        door.close()
        path.close()
        store.close()


# -- hostile writes ----------------------------------------------------------------------------

writes = st.builds(
    lambda unique, nodeid, offset, size, pages, cut: write_request(
        unique, offset, b"".join(pages)[:size] if size < 4 * PAGE else b"".join(pages),
        nodeid)[:cut] if cut else write_request(unique, offset, b"".join(pages), nodeid),
    st.integers(0, 2**64 - 1), st.sampled_from([1, 2, 2, 2, 3]),
    st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 70).map(lambda p: p * PAGE),
              st.integers(0, 64 * PAGE)),
    st.integers(0, 8 * PAGE),
    st.lists(st.sampled_from([bytes(PAGE), b"\x01" * PAGE, b"ab" * (PAGE // 2),
                              bytes(range(256)) * 16]), min_size=1, max_size=4),
    st.one_of(st.just(0), st.integers(1, 5 * PAGE)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(writes, min_size=1, max_size=8))
def test_hostile_writes_are_answered_once_or_handed_up_intact(batch, write_fuzz):
    store, path = write_fuzz
    model = bytearray(store.read(0, store.size))  # the answered writes land here, in order
    ours, loop_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    rbuf, wbuf = bytearray(6 * PAGE), bytearray(OUT_HEADER.size + 8)
    handed = []
    try:
        for message in batch:
            ours.send(message)
        ours.shutdown(socket.SHUT_WR)
        while True:
            n = path.serve(loop_end.fileno(), rbuf, wbuf)
            if n == 0:
                break
            assert n > 0
            handed.append(bytes(rbuf[:n]))
        loop_end.shutdown(socket.SHUT_WR)
        replies = []
        while True:
            reply = ours.recv(OUT_HEADER.size + MAX_REPLY)
            if not reply:
                break
            replies.append(reply)
    finally:
        ours.close()
        loop_end.close()
    # the loop takes the messages in order: each was handed up (the next one handed, byte
    # for byte up to the buffer) or answered (the next reply); identical messages are
    # interchangeable
    answered, h = [], 0
    for message in batch:
        if h < len(handed) and message[:len(rbuf)] == handed[h]:
            h += 1
        else:
            answered.append(message)
    assert h == len(handed) and len(answered) == len(replies)
    for message, reply in zip(answered, replies):
        opcode, unique, nodeid = IN_HEADER.unpack_from(message, 0)[1:4]
        offset, size = struct.unpack_from("<QI", message, IN_HEADER.size + 8)
        assert opcode == WRITE and nodeid == 2 and offset % PAGE == 0 and size % PAGE == 0
        data = message[IN_HEADER.size + 40:IN_HEADER.size + 40 + size]
        assert len(data) == size > 0 and offset + size <= store.size
        length, error, got = OUT_HEADER.unpack_from(reply, 0)
        assert (error, got, length) == (0, unique, OUT_HEADER.size + 8)
        assert struct.unpack_from("<II", reply, OUT_HEADER.size) == (size, 0)
        model[offset:offset + size] = data
    # handed-up writes are nobody's here
    assert differing_pages(store.read(0, store.size), model) == []
    store.check()


@pytest.fixture(scope="module")
def write_fuzz():
    store = native_store(size=64 * PAGE, warm_algorithm="lz4")
    for k in range(4):  # arenas for the classes the fuzz writes, so that writes serve
        store.write(bytes(range(256)) * 16 if k == 0 else (b"\x01\x02" * (PAGE // 2)), k * PAGE)
    store.write(b"ab" * (PAGE // 2), 8 * PAGE)
    path = native.NativePath(store)
    yield store, path
    path.close()
    store.close()


# -- interleaved with Python's maintenance --------------------------------------------------

@pytest.mark.slow
def test_native_writes_and_reads_interleaved_with_recompression_compaction_demotion(tmp_path):
    """Writers rewrite their own ranges through the native loop (each thread its own pages,
    its model exact), readers read them natively, while Python packs warm pages into frames,
    demotes to disk, compacts the pool and runs the maintainer. At the end every page is
    its last written bytes, and the books check."""
    tiering = Tiering(max_size=64 << 20, swap_out_path=str(tmp_path / "tier"),
                      swap_out_max_size=256 << 20, cold_grace_period=0.0, recompress_cpu=1.0)
    store = native_store(size=32 << 20, warm_algorithm="lz4", frame_pages=16, tiering=tiering)
    path = native.NativePath(store)
    doors = PerThread(store, path)
    writers, span = 3, 1024
    models = [bytearray(span * PAGE) for _ in range(writers)]
    locks = [threading.Lock() for _ in range(writers)]
    failures: list[str] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        r = random.Random(100 + w)
        library: list[bytes] = []
        try:
            door = doors.get()
            base = w * span
            while not stop.is_set():
                first = r.randrange(span - 16)
                n = r.choice([1, 2, 4, 8, 16])
                data = some_pages(r, n, library)
                with locks[w]:
                    door.write(data, (base + first) * PAGE)
                    models[w][first * PAGE:(first + n) * PAGE] = data
                if r.random() < 0.05:
                    with locks[w]:
                        store.trim((base + first) * PAGE, 4 * PAGE)
                        models[w][first * PAGE:(first + 4) * PAGE] = bytes(4 * PAGE)
                if r.random() < 0.3:
                    with locks[w]:
                        got = door.read((base + first) * PAGE, n * PAGE)
                        if got != models[w][first * PAGE:(first + n) * PAGE]:
                            failures.append(f"writer {w}: read {first}+{n}: wrong bytes")
        except Exception as exc:
            failures.append(f"writer {w}: {type(exc).__name__}: {exc}")

    def maintainer() -> None:
        try:
            while not stop.is_set():
                store.recompressor.pass_once()
                store.recompressor.pass_once(pressure=True)
                store.demote_cold(limit=64)
                store.compact()
                store.maintain()
        except Exception as exc:
            failures.append(f"maintainer: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    threads.append(threading.Thread(target=maintainer))
    for t in threads:
        t.start()
    time.sleep(10)
    stop.set()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        assert sum(d.native_writes for d in doors.all) > 100
        assert sum(d.native for d in doors.all) > 50
        stats = store.stats()
        assert stats["recompressed_pages_total"] > 0 and stats["disk_pages"] > 0
        assert stats["compactions"] > 0
        for w in range(writers):
            assert differing_pages(store.read(w * span * PAGE, span * PAGE), models[w]) == [], w
        store.check()
    finally:
        doors.close()
        path.close()
        store.close()
