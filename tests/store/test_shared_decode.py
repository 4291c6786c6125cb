"""Concurrent reads of one frame decode it once (objects.Decoding): readahead sends a frame's
neighbouring pages in parallel requests, and each of them decompressing the whole frame
again was most of the read amplification. The decode is held open until every reader has
arrived, so the sharing is forced, not left to timing; the bytes are checked one by one."""

from __future__ import annotations

import threading

import pytest

from agentzip_blk.store import integrity
from agentzip_blk.store.integrity import Corrupt
from agentzip_blk.store.pagestore import PageStore

PAGE = 4096
FRAME = 16
READERS = 6


def frame_pages(seed: int) -> list[bytes]:
    return [(b"frame %d page %d; " % (seed, i) * 300)[:PAGE] for i in range(FRAME)]


def held_decode(store: PageStore, arrivals: int):
    """Make the first decode wait until `arrivals` more reads have started, and count the
    decodes (requests that decode a blob themselves): with sharing, the others wait for
    that one instead of decoding."""
    objects = store.objects
    real = objects.finish
    started = threading.Semaphore(0)
    decodes: list[int] = []

    def finish(late):
        if late.wait_for is None:
            decodes.append(late.size)
            if len(decodes) == 1:
                for _ in range(arrivals):
                    assert started.acquire(timeout=10), "the other readers never arrived"
        return real(late)

    objects.finish = finish
    return started, decodes


def read_in_threads(store: PageStore, started: threading.Semaphore, pages: list[int]):
    results: dict[int, bytes | BaseException] = {}

    def read(i: int) -> None:
        try:
            results[i] = bytes(store.read(pages[i] * PAGE, PAGE))
        except BaseException as exc:
            results[i] = exc

    first = threading.Thread(target=read, args=(0,))
    first.start()
    others = []
    for i in range(1, len(pages)):
        th = threading.Thread(target=read, args=(i,))
        th.start()
        others.append(th)
        # a reader has taken its place (under the store lock) once its request is counted
        deadline = threading.Event()
        while store.counters.reads < i + 1 and not deadline.wait(0.001):
            pass
        started.release()
    for th in [first, *others]:
        th.join(timeout=20)
        assert not th.is_alive(), "a reader hung"
    return results


def test_parallel_reads_of_one_frame_decode_it_once(tmp_path):
    store = PageStore(64 * PAGE, frame_pages=FRAME, max_size=8 << 20)
    pages = frame_pages(1)
    store.write(b"".join(pages), 0)
    assert store.stats()["units"] == 1
    started, decodes = held_decode(store, READERS - 1)
    wanted = [(3 * i) % FRAME for i in range(READERS)]
    results = read_in_threads(store, started, wanted)
    for i, page in enumerate(wanted):
        assert results[i] == pages[page], f"reader {i}, page {page}"
    assert decodes == [FRAME * PAGE]  # one decode of the whole frame, shared by all
    assert store.counters.decoded_bytes == FRAME * PAGE
    assert not store.objects.decoding  # nothing left in flight
    # the frame is cached now: another read decodes nothing
    assert bytes(store.read(5 * PAGE, PAGE)) == pages[5]
    assert len(decodes) == 1
    store.close()


def test_a_corrupt_frame_fails_every_waiting_reader_and_is_counted_once(tmp_path):
    store = PageStore(64 * PAGE, frame_pages=FRAME, max_size=8 << 20)
    pages = frame_pages(2)
    store.write(b"".join(pages), 0)
    store.write(b"".join(frame_pages(3)), FRAME * PAGE)  # a second, intact frame
    blob = int(store.slots.handle[0])
    blobs, pool = store.blobs, store.pool
    arena, cell, length = int(blobs.arena[blob]), int(blobs.cell[blob]), int(blobs.length[blob])
    data = bytearray(pool.get(arena, cell, length))
    data[length // 2] ^= 0x40
    pool.put(arena, cell, bytes(data))
    assert not integrity.matches(bytes(data), int(blobs.csum[blob]))
    started, decodes = held_decode(store, READERS - 1)
    results = read_in_threads(store, started, list(range(READERS)))
    for i in range(READERS):
        assert isinstance(results[i], Corrupt), f"reader {i} got {results[i]!r}"
    assert store.counters.checksum_errors == 1  # found once, by the reader that decoded
    assert decodes == [FRAME * PAGE]  # one request tried; the others took its verdict
    assert not store.objects.decoding
    # the other frame reads back exact, and the bad one still fails (no stale cache)
    assert bytes(store.read((FRAME + 4) * PAGE, PAGE)) == frame_pages(3)[4]
    with pytest.raises(Corrupt):
        store.read(2 * PAGE, PAGE)
    store.close()


def test_a_request_over_two_frames_shares_both_and_never_deadlocks(tmp_path):
    """Requests that each span the end of one frame and the start of the next: every
    request that decodes something finishes its own decodes before it waits for others."""
    store = PageStore(64 * PAGE, frame_pages=FRAME, max_size=8 << 20)
    a, b = frame_pages(4), frame_pages(5)
    store.write(b"".join(a + b), 0)
    model = b"".join(a + b)
    errors: list[BaseException] = []
    barrier = threading.Barrier(READERS)

    def read(t: int) -> None:
        try:
            for round_ in range(40):
                barrier.wait(timeout=10)
                store.objects.frames.clear()  # every round misses the frame cache
                first = FRAME - 1 - (t + round_) % 4
                count = 2 + (t % 3)
                got = bytes(store.read(first * PAGE, count * PAGE))
                assert got == model[first * PAGE : (first + count) * PAGE]
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=read, args=(t,)) for t in range(READERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        assert not th.is_alive(), "a reader hung"
    assert not errors, errors[0]
    assert not store.objects.decoding
    store.close()


def test_idle_frame_copies_are_dropped_by_the_maintainer(monkeypatch):
    from agentzip_blk.store import pagestore

    store = PageStore(64 * PAGE, frame_pages=FRAME, max_size=8 << 20)
    for f in range(3):
        store.write(b"".join(frame_pages(10 + f)), f * FRAME * PAGE)
    for f in range(3):
        assert bytes(store.read((f * FRAME + 1) * PAGE, PAGE)) == frame_pages(10 + f)[1]
    assert len(store.objects.frames) == 3
    held = store.stats()["stored_mem"]
    store.maintain()  # the copies were used just now: kept
    assert len(store.objects.frames) == 3
    monkeypatch.setattr(pagestore, "FRAME_CACHE_IDLE", 0.0)
    store.maintain()
    assert len(store.objects.frames) == 0
    assert store.objects.cache_bytes() == store.hot.nbytes
    assert store.stats()["stored_mem"] <= held - 3 * FRAME * PAGE  # counted no more
    assert bytes(store.read(2 * PAGE, PAGE)) == frame_pages(10)[2]  # decoded again
    store.close()


def test_hot_cache_drop_idle_keeps_recent_entries_in_lru_order():
    from agentzip_blk.store.cache import ENTRY_OVERHEAD, HotCache

    now = [100.0]
    cache = HotCache(1 << 20, clock=lambda: now[0])
    for blob in range(4):
        cache.put(blob, 7, bytes(PAGE))
        now[0] += 1.0
    assert cache.get(0, 8) is None  # another generation of the row: not this copy
    assert cache.get(0, 7) is not None  # used again at t=104: the most recent now
    now[0] = 105.5
    assert cache.drop_idle(2.0) == 3  # blobs 1, 2, 3: last used at 101-103, before 103.5
    assert cache.keys() == [0]
    assert cache.nbytes == PAGE + ENTRY_OVERHEAD
    now[0] = 106.5
    assert cache.drop_idle(2.0) == 1 and len(cache) == 0 and cache.nbytes == 0
