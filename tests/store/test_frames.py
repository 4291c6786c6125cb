"""Multi-page compression frames (`compression.frame_pages`): a frame holds the new pages of a
request compressed together; every slot stays independently readable, writable and
trimmable, and the unit is freed with its last page. Every read is compared byte for byte."""

from __future__ import annotations

import random
import threading

import pytest

from agentzip_blk.store import PageStore, Tiering
from agentzip_blk.store.blobs import DISK
from agentzip_blk.store.integrity import Corrupt

PAGE = 4096
DEVICE = 256 * PAGE


def text_page(seed: int) -> bytes:
    """Compressible, unique per seed, and similar to its neighbours (what units exploit)."""
    rnd = random.Random(seed)
    words = [b'{"role": "tool",', b'"content":', b'"result"', b"value", b"42,", b"\\n", str(seed).encode()]
    return b" ".join(rnd.choice(words) for _ in range(PAGE))[:PAGE]


def pages(first_seed: int, n: int) -> bytes:
    return b"".join(text_page(first_seed + i) for i in range(n))


def store(frame_pages: int = 4, **kw) -> PageStore:
    return PageStore(DEVICE, max_size=64 << 20, frame_pages=frame_pages, **kw)


def read_pages(st: PageStore, slot: int, n: int) -> bytes:
    return bytes(st.read(slot * PAGE, n * PAGE))


def test_a_request_becomes_units_and_reads_back():
    st = store(4)
    data = pages(0, 10)
    st.write(data, 0)
    stats = st.stats()
    assert stats["units"] == 3  # 4 + 4, and the last 2 pages as a 2-page unit
    assert stats["units_written"] == 3
    assert stats["unique_blobs"] == 3
    assert stats["pages"] == 10
    for i in range(10):  # page by page, in an order that crosses unit boundaries
        j = (i * 7) % 10
        assert read_pages(st, j, 1) == data[j * PAGE : (j + 1) * PAGE]
    assert read_pages(st, 0, 10) == data
    st.check()


def test_units_store_less_than_single_pages():
    data = pages(0, 64)
    single, unit = store(1), store(8)
    single.write(data, 0)
    unit.write(data, 0)
    assert unit.stats()["compressed_bytes"] < single.stats()["compressed_bytes"]
    assert read_pages(unit, 0, 64) == data


def test_overwrite_inside_a_unit_keeps_the_others_and_the_last_page_frees_it():
    st = store(4)
    data = bytearray(pages(0, 4))
    st.write(bytes(data), 0)
    blob = int(st.slots.handle[0])
    new = text_page(1000)
    st.write(new, 2 * PAGE)
    data[2 * PAGE : 3 * PAGE] = new
    assert read_pages(st, 0, 4) == data
    stats = st.stats()
    assert stats["unit_dead_pages"] == 1  # the overwritten page still sits in the unit
    assert int(st.blobs.ref[blob]) == 3
    st.check()
    for slot in (0, 1, 3):
        st.write(text_page(2000 + slot), slot * PAGE)
    assert st.blobs.ref[blob] == 0  # freed with its last page
    stats = st.stats()
    assert stats["units"] == 0 and stats["unit_dead_pages"] == 0
    st.check()


def test_unaligned_write_into_a_unit_is_read_modify_write():
    st = store(4)
    data = bytearray(pages(0, 4))
    st.write(bytes(data), 0)
    st.write(b"X" * 100, PAGE + 4000)  # crosses from page 1 into page 2
    data[PAGE + 4000 : PAGE + 4100] = b"X" * 100
    assert read_pages(st, 0, 4) == data
    st.check()


def test_trim_inside_a_unit_then_everything_returns_to_zero():
    st = store(4)
    data = bytearray(pages(0, 8))
    st.write(bytes(data), 0)
    st.trim(PAGE, 2 * PAGE)
    data[PAGE : 3 * PAGE] = bytes(2 * PAGE)
    assert read_pages(st, 0, 8) == data
    st.check()
    st.trim(0, 8 * PAGE)
    stats = st.stats()
    assert stats["pages"] == stats["unique_blobs"] == stats["units"] == 0
    assert stats["pool_bytes"] == 0
    st.check()


def test_a_page_equal_to_one_inside_a_unit_shares_it_and_keeps_it_alive():
    st = store(4)
    data = pages(0, 4)
    st.write(data, 0)
    twin = data[2 * PAGE : 3 * PAGE]
    st.write(twin, 100 * PAGE)
    stats = st.stats()
    assert stats["dedup_hits"] == 1
    assert stats["shared_pages"] == 2
    assert stats["dedup_saved_pages"] == 1
    assert st.slots.handle[100] == st.slots.handle[2] and st.slots.sub[100] == st.slots.sub[2] == 2
    st.trim(0, 4 * PAGE)  # the unit's own slots go; the twin keeps it
    assert read_pages(st, 100, 1) == twin
    assert st.stats()["unit_dead_pages"] == 3
    st.check()
    st.trim(100 * PAGE, PAGE)
    assert st.stats()["pool_bytes"] == 0
    st.check()


def test_equal_pages_within_one_request_are_stored_once():
    st = store(4)
    a, b = text_page(1), text_page(2)
    data = a + b + a + a + b + text_page(3)
    st.write(data, 0)
    stats = st.stats()
    assert stats["dedup_hits"] == 3
    assert stats["unique_blobs"] == 1 and stats["units"] == 1
    assert int(st.blobs.pages[int(st.slots.handle[0])]) == 3
    assert read_pages(st, 0, 6) == data
    st.check()


def test_pages_that_do_not_compress_together_are_stored_alone():
    st = store(4)
    data = random.Random(5).randbytes(4 * PAGE)
    st.write(data, 0)
    stats = st.stats()
    assert stats["unit_fallbacks"] == 1
    assert stats["units"] == 0 and stats["raw_pages"] == 4
    assert read_pages(st, 0, 4) == data
    st.check()


def test_a_units_other_pages_are_read_from_the_unit_cache():
    st = store(8)
    data = pages(0, 8)
    st.write(data, 0)
    for i in range(8):
        assert read_pages(st, i, 1) == data[i * PAGE : (i + 1) * PAGE]
    assert st.stats()["unit_hits"] == 7  # one decompression for the eight reads


@pytest.mark.parametrize("algorithm,level", [("lz4", 1), ("lz4hc", 9), ("zstd", 19)])
def test_units_with_every_codec(algorithm: str, level: int):
    st = store(4, algorithm=algorithm, level=level)
    data = pages(0, 9)
    st.write(data, 0)
    assert st.stats()["units"] == 2  # 4 + 4; the ninth page alone
    st.objects.frames = type(st.frames)(0)  # no cached copies: decode from the pool every time
    assert read_pages(st, 0, 9) == data
    st.check()


def test_a_unit_decoded_to_the_wrong_size_is_an_error():
    st = store(4)
    st.write(pages(0, 4), 0)
    blob = int(st.slots.handle[0])
    st.blobs.pages[blob] = 3  # the books now disagree with the stored frame
    st.objects.frames = type(st.frames)(0)
    with pytest.raises(Corrupt, match="does not decode"):  # EIO, counted, never other bytes
        st.read(0, PAGE)
    assert st.counters.checksum_errors == 1


def test_units_in_the_disk_tier_read_back_and_come_home(tmp_path):
    now = [100.0]
    tiering = Tiering(max_size=96 * 1024, reclaim_threshold=50,
                      swap_out_path=str(tmp_path / "disk-tier"), cold_grace_period=1.0)
    st = PageStore(DEVICE, tiering=tiering, clock=lambda: now[0], frame_pages=4)
    data = pages(0, 200)  # more than the pool: later units go straight to disk
    st.write(data, 0)
    stats = st.stats()
    assert stats["direct_to_disk"] > 0 and stats["tiers"]["disk"]["pages"] > 0
    now[0] += 5
    st.maintain()  # demotes cold units
    assert st.stats()["demotions"] > 0
    st.check()
    st.objects.frames = type(st.frames)(0)
    assert read_pages(st, 0, 200) == data
    on_disk = [s for s in range(200) if st.blobs.tier[int(st.slots.handle[s])] == DISK]
    in_pool = [s for s in range(200) if st.blobs.tier[int(st.slots.handle[s])] != DISK]
    assert on_disk and in_pool
    for slot in in_pool:  # room in the pool: reads of disk units now bring them back
        st.trim(slot * PAGE, PAGE)
    promotions = st.stats()["promotions"]
    for slot in on_disk:
        assert read_pages(st, slot, 1) == data[slot * PAGE : (slot + 1) * PAGE]
    assert st.stats()["promotions"] > promotions
    st.check()
    st.close()


def test_bad_unit_sizes_rejected():
    for bad in (0, 17):
        with pytest.raises(ValueError):
            PageStore(DEVICE, frame_pages=bad)


def test_sparse_units_are_rewritten_without_their_dead_pages():
    st = store(8)
    data = bytearray(pages(0, 16))
    st.write(bytes(data), 0)
    st.write(data[3 * PAGE : 4 * PAGE], 200 * PAGE)  # a second slot on page 3 of unit 1
    data += bytes(0)
    for slot in (0, 1, 2, 4, 5):  # unit 1 keeps pages 3, 6, 7 (and the twin of 3)
        st.trim(slot * PAGE, PAGE)
        data[slot * PAGE : (slot + 1) * PAGE] = bytes(PAGE)
    st.write(text_page(999), 9 * PAGE)  # unit 2 loses one page: not sparse, left alone
    data[9 * PAGE : 10 * PAGE] = text_page(999)
    before = st.stats()
    assert before["unit_dead_pages"] == 5 + 1
    assert st.maintain()["units_rewritten"] == 1
    after = st.stats()
    assert after["unit_dead_pages"] == 1
    assert after["compressed_bytes"] < before["compressed_bytes"]
    assert after["shared_pages"] == 2  # slots 3 and 200 still share one page
    assert read_pages(st, 0, 16) == data[: 16 * PAGE]
    assert read_pages(st, 200, 1) == data[3 * PAGE : 4 * PAGE]
    st.check()
    assert st.maintain()["units_rewritten"] == 0


def test_a_sparse_frame_is_compressed_again_without_the_store_lock_and_a_race_loses_nothing():
    """Issue 27 item 6: the rewrite decodes and compresses without the store lock; a frame
    whose slot changes meanwhile is left as it is (picked again later), its pages exact."""
    st = store(8)
    data = bytearray(pages(0, 16))
    st.write(bytes(data), 0)
    for slot in (0, 1, 2, 4, 5, 8, 9, 10, 11, 12):  # both units sparse
        st.trim(slot * PAGE, PAGE)
        data[slot * PAGE:(slot + 1) * PAGE] = bytes(PAGE)
    real = st.frame_codec.compress
    raced = []

    def compress(frame):
        assert not st.lock.locked()  # the expensive part, off the lock
        if not raced:  # a request rewrites a page of the first frame meanwhile
            raced.append(1)
            st.write(text_page(777), 3 * PAGE)
            data[3 * PAGE:4 * PAGE] = text_page(777)
        return real(frame)

    st.frame_codec.compress = compress
    assert st.rewrite_sparse_frames() == 1  # the other frame; the raced one stays
    assert raced
    assert read_pages(st, 0, 16) == data
    st.check()
    st.frame_codec.compress = real
    assert st.rewrite_sparse_frames() == 1  # picked again: now it goes
    assert read_pages(st, 0, 16) == data
    st.check()


class _LockWithARequestBetweenHolds:
    """The store's lock; `request` runs once, without the lock, before the first hold that
    follows the first call of `slots.ids_of` (a scan's first share of the slot table): a
    request served between two holds of a chunked scan."""

    def __init__(self) -> None:
        self.inner = threading.Lock()
        self.request = None
        self.shares = 0
        self.done = False

    def __enter__(self):
        if self.shares and not self.done and self.request is not None:
            self.done = True
            self.request()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def locked(self) -> bool:
        return self.inner.locked()


def _scanned_in_shares(st: PageStore, lock: _LockWithARequestBetweenHolds, monkeypatch) -> None:
    monkeypatch.setattr("agentzip_blk.store.tiering.SCAN_CHUNKS", 1)  # one 512-slot chunk per hold
    ids_of = st.slots.ids_of

    def counted(chunks):
        lock.shares += 1
        return ids_of(chunks)

    monkeypatch.setattr(st.slots, "ids_of", counted)


@pytest.mark.parametrize("race", ["a slot joins a scanned chunk", "a slot leaves a scanned chunk"])
def test_the_slots_of_sparse_frames_are_found_a_share_per_hold_and_a_change_between_holds_waits(
        race, monkeypatch):
    """The maintainer finds a sparse frame's slots one share of the table per hold of the
    store lock (a whole-table scan held it 10-57 ms). A frame whose slots change in a chunk
    already scanned is left for the next round; every page reads back exact."""
    lock = _LockWithARequestBetweenHolds()
    st = PageStore(4 * 512 * PAGE, max_size=64 << 20, frame_pages=8, lock=lock)
    data = bytearray(pages(0, 16))
    st.write(bytes(data), 0)
    twin = 600  # chunk 1: a second slot on page 3 of frame 1
    st.write(data[3 * PAGE:4 * PAGE], twin * PAGE)
    for slot in (0, 1, 2, 4, 5, 7, 8, 9, 10, 11, 12):  # both frames sparse, and stay so
        st.trim(slot * PAGE, PAGE)
        data[slot * PAGE:(slot + 1) * PAGE] = bytes(PAGE)
    expected = {slot: bytes(data[slot * PAGE:(slot + 1) * PAGE]) for slot in range(16)}
    expected[twin] = bytes(data[3 * PAGE:4 * PAGE])

    def request():
        if race == "a slot joins a scanned chunk":  # a dedup hit on page 3, in chunk 0
            st.write(expected[3], 20 * PAGE)
            expected[20] = expected[3]
        else:
            st.trim(6 * PAGE, PAGE)
            expected[6] = bytes(PAGE)

    lock.request = request
    _scanned_in_shares(st, lock, monkeypatch)
    assert st.rewrite_sparse_frames() == 1  # frame 2; frame 1 changed during the scan
    assert lock.done and lock.shares >= 2
    for slot, page in expected.items():
        assert read_pages(st, slot, 1) == page, slot
    st.check()
    assert st.rewrite_sparse_frames() == 1  # the next round takes frame 1
    for slot, page in expected.items():
        assert read_pages(st, slot, 1) == page, slot
    assert st.stats()["unit_dead_pages"] == 0
    st.check()


def test_rows_move_down_a_hold_at_a_time_and_a_row_whose_slots_change_stays(monkeypatch):
    """compact_rows finds the slots of the rows it moves a share of the table per hold; a row
    that gains a slot in a chunk already scanned stays where it is this round, and every
    slot still reads its page."""
    lock = _LockWithARequestBetweenHolds()
    st = PageStore(16 * 512 * PAGE, max_size=64 << 20, frame_pages=4, lock=lock)
    n = 4096 + 64  # TAIL_RELEASE_ROWS rows and more: single pages, one row each
    content = {}
    for slot in range(n):
        content[slot] = text_page(10_000 + slot)
    for slot in range(n):  # one request per page: a row each
        st.write(content[slot], slot * PAGE)
    top = n - 1
    for slot in range(0, n - 64):  # free the bottom rows: the top 64 are the ones to move
        st.trim(slot * PAGE, PAGE)
        content[slot] = bytes(PAGE)

    def request():  # a dedup hit on the top row's page, in chunk 0 (already scanned)
        st.write(content[top], 5 * PAGE)
        content[5] = content[top]

    lock.request = request
    _scanned_in_shares(st, lock, monkeypatch)
    top_row = int(st.slots.handle[top])
    renumbered = []
    renumber = st.objects.renumber

    def spied(ids):
        renumbered.append(list(ids))
        return renumber(ids)

    monkeypatch.setattr(st.objects, "renumber", spied)
    rows_before = st.blobs.rows
    assert st.tiers.compact_rows() == 64
    assert lock.done
    assert len(renumbered[0]) == 63 and top_row not in renumbered[0]  # left for this round
    assert any(top_row in ids for ids in renumbered[1:])  # and moved by the next scan
    assert st.blobs.rows < rows_before
    for slot, page in content.items():
        assert read_pages(st, slot, 1) == page, slot
    st.check()
