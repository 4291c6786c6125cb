"""The native request path (datapath.native, datapath/nativeloop.c) against the Python path.

- every read it answers is byte for byte the Python path's answer and the model's, over
  stores holding every kind of slot (empty, zero, same-filled, warm lz4 and raw, dense
  frames, disk blobs, trimmed); what it cannot serve it hands up unchanged;
- malformed and hostile requests (hypothesis): each is answered once or handed up intact,
  and the loop never writes outside its buffers (the ASan build in CI runs this too);
- native reads interleaved with Python writes, recompression, compaction and demotion:
  every page exact, then store.check();
- the lock: Python and native threads exclude each other.
"""

from __future__ import annotations

import ctypes
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentzip_blk.codec.dictionaries.trainer import as_kind
from agentzip_blk.datapath import native
from agentzip_blk.store import disk
from agentzip_blk.store.tiering import Tiering
from nativeharness import (
    IN_HEADER,
    MAX_REPLY,
    OUT_HEADER,
    READ,
    NativeRequests,
    PerThread,
    differing_pages,
    native_store,
    read_request,
)
from tests.store import test_dict_frames as dict_frames

PAGE = 4096

pytestmark = pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")


def text_page(rnd: random.Random, salt: int) -> bytes:
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % salt,
             b"%d" % rnd.randrange(99999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b".")


def noise_page(rnd: random.Random) -> bytes:
    return rnd.randbytes(PAGE)  # stored raw: compression does not pay


def fill_mixed(store, rnd: random.Random, pages: int) -> bytearray:
    """Every kind of slot, in runs: text (warm lz4), noise (raw), zero, same-filled, empty."""
    model = bytearray(pages * PAGE)
    slot = 0
    while slot < pages:
        n = min(rnd.randint(1, 12), pages - slot)
        kind = rnd.random()
        if kind < 0.5:
            data = b"".join(text_page(rnd, slot + k) for k in range(n))
        elif kind < 0.65:
            data = b"".join(noise_page(rnd) for _ in range(n))
        elif kind < 0.75:
            data = bytes(n * PAGE)
        elif kind < 0.85:
            data = struct.pack("<Q", rnd.getrandbits(64)) * (n * PAGE // 8)
        else:
            slot += n  # left empty
            continue
        store.write(data, slot * PAGE)
        model[slot * PAGE:(slot + n) * PAGE] = data
        slot += n
    return model


@pytest.fixture
def served():
    made = []

    def make(**kw):
        store = native_store(**kw)
        path = native.NativePath(store)
        reads = NativeRequests(store, path)
        made.append((store, path, reads))
        return store, path, reads

    yield make
    for store, path, reads in made:
        reads.close()
        path.close()


def test_native_reads_match_the_python_path_and_the_model(served):
    store, path, reads = served(warm_algorithm="lz4", frame_pages=16)
    rnd = random.Random(7)
    pages = 2048
    model = fill_mixed(store, rnd, pages)
    for _ in range(1500):
        first = rnd.randrange(pages)
        n = min(rnd.choice([1, 1, 1, 2, 4, 8, 16]), pages - first)
        got = reads.read(first * PAGE, n * PAGE)
        assert got == model[first * PAGE:(first + n) * PAGE], (first, n)
        assert got == store.read(first * PAGE, n * PAGE)
    assert reads.native == 1500 and reads.python == 0  # raw, lz4 and same-fill words natively
    counters = path.counters()
    assert counters["reads"] == reads.native and counters["handed_up"] == 2 * 1500 - reads.native
    assert store.stats()["reads"] >= counters["reads"] + reads.python
    store.check()


def test_same_fill_words_are_read_natively_as_their_ids_change(served):
    # A word's id is freed when its last slot is rewritten and handed to the next new word:
    # a native read must fill the page with the word the slot holds now.
    store, path, reads = served(warm_algorithm="lz4", frame_pages=16)
    first, second = struct.pack("<Q", 0x0123456789ABCDEF), struct.pack("<Q", 0xFEDCBA9876543210)
    store.write(first * (4 * PAGE // 8), 0)
    assert reads.read(0, 4 * PAGE) == first * (4 * PAGE // 8)
    store.write(bytes(4 * PAGE), 0)  # the word's last slots: its id is free again
    store.write(second * (PAGE // 8), 8 * PAGE)  # the next new word takes that id
    assert reads.read(0, PAGE) == bytes(PAGE)
    assert reads.read(8 * PAGE, PAGE) == second * (PAGE // 8)
    assert reads.read(7 * PAGE, 2 * PAGE) == bytes(PAGE) + second * (PAGE // 8)
    assert reads.python == 0 and path.counters()["handed_up_by"]["read_blob"] == 0
    store.check()


def test_dense_frames_and_disk_blobs_are_read_right(served, tmp_path):
    tiering = Tiering(max_size=64 << 20, swap_out_path=str(tmp_path / "tier"),
                      swap_out_max_size=64 << 20, cold_grace_period=0.0, recompress_cpu=1.0)
    store, path, reads = served(warm_algorithm="lz4", frame_pages=16, tiering=tiering)
    rnd = random.Random(3)
    model = fill_mixed(store, rnd, 1024)
    time.sleep(0.05)  # past the grace period by a few ticks
    while store.recompressor.pass_once():
        pass
    store.demote_cold(limit=200)
    stats = store.stats()
    assert stats["recompressed_pages_total"] > 0 and stats["disk_pages"] > 0
    for first in range(0, 1024, 3):
        assert reads.read(first * PAGE, PAGE) == model[first * PAGE:(first + 1) * PAGE]
    assert path.counters()["disk_reads"] > 0
    # what the native path read stays on disk; the Python path promotes below the demotion
    # target (Tiers.promote)
    assert store.stats()["promotions"] == 0
    store.read(0, 1024 * PAGE)
    assert store.stats()["promotions"] > 0
    store.check()


def tier_at_its_cap(tmp_path) -> Tiering:
    """A 1 MiB pool over a disk tier: most of a few MiB written goes straight to disk."""
    return Tiering(max_size=1 << 20, swap_out_path=str(tmp_path / "tier"),
                   swap_out_max_size=64 << 20, cold_grace_period=0.0, recompress_cpu=1.0)


@pytest.mark.parametrize("warm", ["none", "lz4"])
@pytest.mark.parametrize("sealed", [True, False], ids=["encrypted", "clear"])
def test_disk_blobs_are_read_natively_when_the_pool_is_at_its_cap(served, tmp_path,
                                                                  monkeypatch, warm, sealed):
    monkeypatch.setattr(disk, "ENCRYPT", sealed)
    store, path, reads = served(size=32 << 20, warm_algorithm=warm, frame_pages=16,
                                tiering=tier_at_its_cap(tmp_path))
    rnd = random.Random(5)
    model = fill_mixed(store, rnd, 4096)  # past the cap, straight to disk
    assert store.stats()["disk_pages"] > 1000
    assert (store.disk.key() is not None) == sealed
    for first in range(0, 4096, 4):
        n = rnd.choice([1, 2, 4])
        got = reads.read(first * PAGE, n * PAGE)
        assert got == model[first * PAGE:(first + n) * PAGE], (first, n)
    counters = path.counters()
    assert counters["disk_reads"] > 300 and reads.native > 500
    assert store.stats()["promotions"] == 0
    assert differing_pages(store.read(0, 4096 * PAGE), model) == []  # the Python path agrees
    store.check()


@pytest.mark.parametrize("kind", ["raw", "full"])
def test_frames_with_a_dictionary_are_read_natively_from_the_pool_and_the_disk(served, tmp_path,
                                                                             kind):
    store, path, reads = served(size=32 << 20, warm_algorithm="none", frame_pages=4,
                                dictionary="none", tiering=tier_at_its_cap(tmp_path))
    # registered after the native path started: the registry's hook tells it
    entry = store.dicts.registry.add(f"test-{kind}", as_kind(dict_frames.trained(4), kind),
                                     "host", kind=kind)
    sel = store.dicts.frame_selector
    sel.budget = sel.max_budget = sel.min_budget = 10.0
    sel.margin = 0.0
    pages = 2048
    data = b"".join(dict_frames.text_page(i) for i in range(pages))
    for first in range(0, pages, 16):  # the Python path: its writes choose the dictionary
        store.write(data[first * PAGE:(first + 16) * PAGE], first * PAGE)
    live = np.flatnonzero(store.blobs.live())
    with_dict = live[store.blobs.dict_id[live] == entry.id]
    assert set(store.blobs.tier[with_dict].tolist()) == {0, 1}  # in the pool and on disk
    for first in range(0, pages, 2):
        assert reads.read(first * PAGE, 2 * PAGE) == data[first * PAGE:(first + 2) * PAGE], first
    assert reads.python == 0 and path.counters()["disk_reads"] > 0
    store.check()


def test_a_disk_extent_that_does_not_open_is_handed_up_and_answers_eio(served, tmp_path):
    store, path, reads = served(size=32 << 20, warm_algorithm="none", frame_pages=16,
                                tiering=tier_at_its_cap(tmp_path))
    rnd = random.Random(6)
    model = fill_mixed(store, rnd, 4096)
    on_disk = [s for s in range(4096) if store.slots.kind[s] == 2
               and store.blobs.tier[int(store.slots.handle[s])] == 1]
    first = on_disk[len(on_disk) // 2]
    assert reads.read(first * PAGE, PAGE) == model[first * PAGE:(first + 1) * PAGE]
    assert path.counters()["disk_reads"] == 1
    blob = int(store.slots.handle[first])
    offset = int(store.blobs.disk_off[blob]) + 20  # inside the ciphertext
    with open(tmp_path / "tier", "r+b") as f:  # the test corrupts the extent
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with store.lock:  # the native frame cache keeps the frame the first read decoded
        store.outside_drop_idle(0.0)
    with pytest.raises(Exception, match="AEAD tag mismatch"):
        reads.read(first * PAGE, PAGE)
    assert reads.python >= 1 and path.counters()["disk_reads"] == 1
    assert path.counters()["handed_up_by"]["read_blob"] >= 1


def test_a_native_read_records_the_access_as_the_python_path_does(served):
    store, path, reads = served(warm_algorithm="lz4")
    rnd = random.Random(1)
    store.write(text_page(rnd, 1), 0)
    blob = int(store.slots.handle[0])
    assert store.blobs.rtime[blob] == 0 and store.slots.rtime[0] == 0
    reads.read(0, PAGE)
    assert reads.native == 1
    now = store.now()
    assert 0 < store.blobs.rtime[blob] <= now and store.blobs.atime[blob] == store.blobs.rtime[blob]
    assert store.slots.rtime[0] == (int(store.blobs.rtime[blob]) & 0xFFFF or 1)
    # a read, then a write of the same slot within hot_threshold_ms: the Python path's count
    store.write(text_page(rnd, 2), 0)
    assert store.counters.pingpong == 1


def test_a_corrupt_cell_is_handed_up_and_answers_eio(served):
    store, path, reads = served(warm_algorithm="lz4")
    rnd = random.Random(2)
    store.write(text_page(rnd, 1), 0)
    blob = int(store.slots.handle[0])
    arena, cell = int(store.blobs.arena[blob]), int(store.blobs.cell[blob])
    size = store.pool.classes[int(store.pool.arena_classes()[arena])].cell_size
    at = ctypes.c_ubyte.from_address(int(store.pool.arena_addr[arena]) + cell * size)
    at.value ^= 0xFF  # the test corrupts a cell
    with pytest.raises(Exception, match="checksum"):
        reads.read(0, PAGE)
    assert reads.python == 1 and store.counters.checksum_errors == 1


# -- malformed requests -------------------------------------------------------------------

def _drain(path, loop_end, rbuf, wbuf) -> list[bytes]:
    handed = []
    while True:
        n = path.serve(loop_end.fileno(), rbuf, wbuf)
        if n == 0:
            return handed
        assert n > 0
        handed.append(bytes(rbuf[:n]))


requests = st.one_of(
    st.binary(max_size=120),  # anything at all, short headers included
    st.builds(  # READs with hostile fields
        lambda unique, nodeid, offset, size, cut: read_request(unique, offset, size, nodeid)[:cut],
        st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2, 3, 2**64 - 1]),
        st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 64).map(lambda p: p * PAGE),
                  st.integers(0, 64 * PAGE)),
        st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 16).map(lambda p: p * PAGE)),
        st.integers(0, 80)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests, min_size=1, max_size=12))
def test_malformed_requests_are_answered_once_or_handed_up_intact(batch, fuzz_store):
    store, path, model = fuzz_store
    ours, loop_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # a buffer smaller than some replies: such a READ must be handed up, not overrun
    rbuf, wbuf = bytearray(256), bytearray(OUT_HEADER.size + 8 * PAGE)
    try:
        sent = [m for m in batch if m]  # an empty seqpacket message reads as end of file
        for message in sent:
            ours.send(message)
        ours.shutdown(socket.SHUT_WR)
        handed = _drain(path, loop_end, rbuf, wbuf)
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
    # each message either handed up byte for byte (truncated to the buffer) or answered
    answered = [m for m in sent if m[:len(rbuf)] not in handed]
    assert len(handed) + len(replies) == len(sent)
    assert len(replies) == len(answered)
    for message, reply in zip(answered, replies):
        assert len(message) >= IN_HEADER.size + 40
        opcode, unique, nodeid = IN_HEADER.unpack_from(message, 0)[1:4]
        offset, size = struct.unpack_from("<QI", message, IN_HEADER.size + 8)
        assert opcode == READ and nodeid == 2 and offset % PAGE == 0
        length, error, got = OUT_HEADER.unpack_from(reply, 0)
        assert (error, got, length) == (0, unique, len(reply))
        end = min(offset + size, store.size, offset + (1 << 20))
        assert reply[OUT_HEADER.size:] == model[offset:end]


@pytest.fixture(scope="module")
def fuzz_store():
    store = native_store(size=256 * PAGE, warm_algorithm="lz4")
    model = fill_mixed(store, random.Random(5), 256)
    path = native.NativePath(store)
    yield store, path, model
    path.close()


# -- interleaved with Python's maintenance --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("pool", [64 << 20, 1 << 20], ids=["pool-64M", "pool-at-cap"])
def test_native_reads_interleaved_with_writes_recompression_compaction_and_demotion(tmp_path,
                                                                                   pool):
    """Readers read pages whose bytes never change, while Python rewrites them with the
    same bytes (new blobs, slot switches), writes other pages, packs warm pages into frames,
    compacts the pool and demotes to disk. Every native read is exact. With the pool at its
    cap the readers read disk extents natively while the rewrites free them and new blobs
    take their place (an extent reused under a read fails to open: Python reads it again)."""
    tiering = Tiering(max_size=pool, swap_out_path=str(tmp_path / "tier"),
                      swap_out_max_size=256 << 20, cold_grace_period=0.0, recompress_cpu=1.0)
    store = native_store(size=32 << 20, warm_algorithm="lz4", frame_pages=16, tiering=tiering)
    path = native.NativePath(store)
    reads = PerThread(store, path)
    rnd = random.Random(11)
    stable_pages, churn_first, churn_pages = 1024, 2048, 4096
    model = fill_mixed(store, rnd, stable_pages)
    failures: list[str] = []
    stop = threading.Event()

    def reader(seed: int) -> None:
        r = random.Random(seed)
        try:
            mine = reads.get()
            while not stop.is_set():
                first = r.randrange(stable_pages)
                n = min(r.choice([1, 1, 2, 8]), stable_pages - first)
                if mine.read(first * PAGE, n * PAGE) != model[first * PAGE:(first + n) * PAGE]:
                    failures.append(f"read {first}+{n}: wrong bytes")
        except Exception as exc:
            failures.append(f"reader: {type(exc).__name__}: {exc}")

    def rewriter() -> None:
        r = random.Random(12)
        try:
            while not stop.is_set():
                first = r.randrange(stable_pages - 8)
                store.write(bytes(model[first * PAGE:(first + 8) * PAGE]), first * PAGE)
                other = churn_first + r.randrange(churn_pages - 16)
                store.write(b"".join(text_page(r, other + k) for k in range(16)), other * PAGE)
                if r.random() < 0.2:
                    store.trim(other * PAGE, 8 * PAGE)
        except Exception as exc:
            failures.append(f"rewriter: {type(exc).__name__}: {exc}")

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

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=rewriter), threading.Thread(target=maintainer)]
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        native_reads = sum(r.native for r in reads.all)
        assert native_reads > 100
        stats = store.stats()
        assert stats["recompressed_pages_total"] > 0 and stats["disk_pages"] > 0
        assert stats["compactions"] > 0
        if pool < 64 << 20:
            assert path.counters()["disk_reads"] > 100
        assert differing_pages(store.read(0, stable_pages * PAGE), model) == []
        store.check()
    finally:
        reads.close()
        path.close()


def test_the_lock_excludes_native_threads_while_python_holds_it(served):
    store, path, reads = served(warm_algorithm="lz4")
    store.write(text_page(random.Random(4), 1), 0)
    done = threading.Event()

    def read() -> None:
        reads.read(0, PAGE)
        done.set()

    with store.lock:
        t = threading.Thread(target=read)
        t.start()
        assert not done.wait(0.3)  # the native read waits for the lock, without the GIL
        assert store.lock.locked()
    assert done.wait(10)
    t.join()
    assert reads.native == 1
    assert store.lock.acquire(False) and not store.lock.acquire(False)
    store.lock.release()
    with pytest.raises(RuntimeError):
        store.lock.release()


def test_python_threads_take_turns_for_the_lock_while_a_loop_retakes_it():
    """A Python thread that waits for the store lock gets it while another Python thread
    releases and retakes it in a loop (the maintainer's holds in shares): `down`'s health
    check once timed out behind such a loop. And a native thread never waits for the GIL
    of a Python thread that is still waiting its turn."""
    if native.nativeloop is None:
        pytest.skip(native.MISSING)
    lock = native.nativeloop.StoreLock()
    stop = threading.Event()
    holds = [0]

    def loop() -> None:
        while not stop.is_set():
            with lock:
                holds[0] += 1
                sum(range(300))  # a hold long enough to lose the GIL in

    waited: list[float] = []

    def wait_once() -> None:
        t = time.monotonic()
        with lock:
            waited.append(time.monotonic() - t)

    looper = threading.Thread(target=loop)
    looper.start()
    try:
        time.sleep(0.2)
        waiters = [threading.Thread(target=wait_once) for _ in range(3)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(10)
        assert len(waited) == 3 and max(waited) < 2.0, waited
        assert holds[0] > 0
    finally:
        stop.set()
        looper.join(10)
    assert not lock.locked()


def test_datapath_native_without_the_extension_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(native, "nativeloop", None)
    monkeypatch.setattr(native, "MISSING", "the native request path is not built (test)")
    with pytest.raises(native.NativeUnavailable, match="device.datapath: python"):
        native.choose("native")
    choice = native.choose("auto")
    assert choice.path == "python" and "not built" in choice.reason
    assert native.choose("python").path == "python"
