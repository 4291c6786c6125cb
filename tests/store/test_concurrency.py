"""Requests from many threads at once: compression and decompression run outside the store
lock (placement.Placer.prepare, objects.Deferred), so the books must stay right under
interleaving. Each writer thread owns a region and checks every read of it against its own
model, byte for byte; reader threads read everything meanwhile; at the end the whole device
is compared and the books cross-checked."""

from __future__ import annotations

import random
import threading

import pytest

from agentzip_blk.store.pagestore import PageStore

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

PAGE = 4096
REGION = 96  # pages per writer thread
WRITERS = 4


def page_bytes(rnd: random.Random, pool: list[bytes]) -> bytes:
    r = rnd.random()
    if r < 0.15:
        return bytes([rnd.randrange(3)]) * PAGE  # same-filled
    if r < 0.35:
        return rnd.choice(pool)  # a duplicate of a page other threads write too
    words = [b"tool_call", b"arguments", b"result", b"json", b"%d" % rnd.randrange(999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b".")


@pytest.mark.parametrize("frame_pages", [1, 16])
def test_threads_interleave_writes_trims_and_reads(tmp_path, frame_pages):
    st = PageStore(WRITERS * REGION * PAGE, frame_pages=frame_pages, max_size=64 << 20)
    shared = [(b"shared page %d " % i) * (PAGE // 15) for i in range(8)]
    shared = [p[:PAGE].ljust(PAGE, b"-") for p in shared]
    models = [bytearray(REGION * PAGE) for _ in range(WRITERS)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(t: int) -> None:
        rnd = random.Random(100 + t)
        base = t * REGION
        model = models[t]
        try:
            for _ in range(300):
                op = rnd.random()
                first = rnd.randrange(REGION)
                count = min(rnd.randint(1, 40), REGION - first)
                lo, hi = first * PAGE, (first + count) * PAGE
                if op < 0.55:
                    data = b"".join(page_bytes(rnd, shared) for _ in range(count))
                    st.write(data, (base + first) * PAGE)
                    model[lo:hi] = data
                elif op < 0.7:
                    st.trim((base + first) * PAGE, count * PAGE)
                    model[lo:hi] = bytes(hi - lo)
                else:
                    got = st.read((base + first) * PAGE, count * PAGE)
                    assert got == model[lo:hi], f"thread {t} pages {first}+{count}"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def reader() -> None:
        rnd = random.Random(7)
        try:
            while not stop.is_set():
                first = rnd.randrange(WRITERS * REGION)
                st.read(first * PAGE, min(rnd.randint(1, 32), WRITERS * REGION - first) * PAGE)
                if rnd.random() < 0.02:
                    st.stats()
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(t,)) for t in range(WRITERS)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for th in writers + readers:
        th.start()
    for th in writers:
        th.join()
    stop.set()
    for th in readers:
        th.join()
    assert not errors, errors[0]
    for t in range(WRITERS):
        assert st.read(t * REGION * PAGE, REGION * PAGE) == models[t], f"region {t}"
    st.check()
    st.close()
