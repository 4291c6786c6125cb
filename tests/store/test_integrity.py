"""Blob checksums, the sealed disk tier and its file, and demotion outside the store lock,
on the store itself (tests/datapath/test_integrity.py does the same through nbdkit)."""

from __future__ import annotations

import ctypes
import mmap
import os
import pwd
import stat

import pytest

from agentzip_blk.store import PageStore, Tiering
from agentzip_blk.store.blobs import DISK, POOL
from agentzip_blk.store.disk import TIER_HEADER, DiskError, DiskTier
from agentzip_blk.store.integrity import Corrupt

PAGE = 4096
TEXT = (b"tool_call result {\"arguments\": 0.5} " * 200)[: 3 * PAGE // 4]


def page_of(seed: int) -> bytes:
    return os.urandom(1024) + TEXT[: PAGE - 1024 - 2] + seed.to_bytes(2, "little")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(tmp_path, algorithm="zstd", frame_pages=1, max_size=4 << 20, path="tier",
               reclaim_threshold=50) -> PageStore:
    tiering = Tiering(max_size=max_size, reclaim_threshold=reclaim_threshold,
                      swap_out_path=str(tmp_path / path) if path else None,
                      cold_grace_period=1.0)
    return PageStore(8 << 20, algorithm=algorithm, tiering=tiering, frame_pages=frame_pages,
                     clock=Clock(), dictionary="none")


def flip_cell(store: PageStore, blob: int, at: int) -> None:
    blobs, pool = store.blobs, store.pool
    arena, cell, length = int(blobs.arena[blob]), int(blobs.cell[blob]), int(blobs.length[blob])
    data = bytearray(pool.get(arena, cell, length))
    data[at % length] ^= 0x10
    pool.put(arena, cell, bytes(data))


def codec_name(store: PageStore, blob: int) -> str:
    from agentzip_blk.codec.codecs import CODEC_NAMES

    return CODEC_NAMES[int(store.blobs.codec[blob])]


@pytest.mark.parametrize("algorithm,kind,frame_pages", [
    ("zstd", "zstd", 1), ("lz4", "lz4", 1), ("zstd", "raw", 1), ("zstd", "frame", 4),
    ("lz4", "frame", 4),
])
def test_a_flipped_byte_in_a_pool_cell_is_corrupt_never_wrong_bytes(tmp_path, algorithm, kind,
                                                                     frame_pages):
    store = make_store(tmp_path, algorithm, frame_pages)
    pages = {}
    step = 4 if kind == "frame" else 1
    for slot in range(0, 16, step):
        run = [os.urandom(PAGE) if kind == "raw" else page_of(slot + i) for i in range(step)]
        store.write(b"".join(run), slot * PAGE)
        pages.update({slot + i: p for i, p in enumerate(run)})
    blob = int(store.slots.handle[4])
    assert int(store.blobs.pages[blob]) == step
    if kind != "frame":
        assert codec_name(store, blob).startswith(kind)
    for at in (0, 7, 1000, int(store.blobs.length[blob]) - 1):  # header, body, last byte
        flip_cell(store, blob, at)
        before = store.counters.checksum_errors
        # A page alone is checked end to end: against the bytes it decodes to (frames also
        # against their stored bytes). A flip that changes nothing it decodes to (a flag in
        # a zstd page's frame header) is then no corruption of the data: it reads back
        # exact. Every other flip is EIO.
        if kind == "zstd" and at == 0 and store.read(4 * PAGE, PAGE) == pages[4]:
            flip_cell(store, blob, at)
            continue
        for slot, page in pages.items():
            if 4 <= slot < 4 + step:
                with pytest.raises(Corrupt):
                    store.read(slot * PAGE, PAGE)
                with pytest.raises(Corrupt):  # the long read path too
                    store.read(0, 16 * PAGE)
            else:
                assert store.read(slot * PAGE, PAGE) == page
        assert store.counters.checksum_errors - before == 2 * step
        flip_cell(store, blob, at)  # back as it was
    for slot, page in pages.items():  # readable again
        assert store.read(slot * PAGE, PAGE) == page
    store.check()
    store.close()


def test_a_corrupt_dedup_candidate_is_not_shared_and_the_write_succeeds(tmp_path):
    store = make_store(tmp_path)
    page = page_of(1)
    store.write(page, 0)
    flip_cell(store, int(store.slots.handle[0]), 100)
    store.write(page, PAGE)  # the same content: the corrupt copy is not shared
    assert int(store.slots.handle[1]) != int(store.slots.handle[0])
    assert store.read(PAGE, PAGE) == page
    with pytest.raises(Corrupt):
        store.read(0, PAGE)
    store.check()


def demote_all(store: PageStore) -> None:
    store._clock.now += 60  # noqa: SLF001 - the injected clock
    while store.demote_cold():
        pass


def test_disk_extents_are_sealed_to_their_place(tmp_path):
    store = make_store(tmp_path, max_size=1 << 20)
    pages = {slot: os.urandom(PAGE) for slot in range(8)}
    for slot, page in pages.items():
        store.write(page, slot * PAGE)
    demote_all(store)
    blobs = store.blobs
    ids = [int(store.slots.handle[slot]) for slot in range(8)]
    assert all(blobs.tier[b] == DISK for b in ids)
    size = store.disk.extent_size(PAGE)
    with open(tmp_path / "tier", "r+b") as f:
        raw = f.read()
        # swap the extents of slots 0 and 1: each decrypts only where it was written
        a, b = int(blobs.disk_off[ids[0]]), int(blobs.disk_off[ids[1]])
        f.seek(a)
        f.write(raw[b : b + size])
        f.seek(b)
        f.write(raw[a : a + size])
    for slot in (0, 1):
        with pytest.raises(Corrupt, match="AEAD tag mismatch"):
            store.read(slot * PAGE, PAGE)
    for slot in range(2, 8):
        assert store.read(slot * PAGE, PAGE) == pages[slot]
    assert store.counters.checksum_errors == 2
    for needle in (pages[3][:32], pages[3][2000:2032]):
        assert needle not in raw


def test_an_extent_from_another_server_start_does_not_open(tmp_path):
    one = DiskTier(str(tmp_path / "one"))
    two = DiskTier(str(tmp_path / "two"))
    data = os.urandom(1000)
    off = len(TIER_HEADER)  # the first extent follows the header
    for tier in (one, two):
        assert tier.alloc(len(data)) == off
    one.put(off, data, blob=5, gen=2)
    assert one.read(off, len(data), 5, 2) == data
    with pytest.raises(Corrupt):
        one.read(off, len(data), 5, 3)  # the row's next generation: a replay
    extent = (tmp_path / "one").read_bytes()[off:off + one.extent_size(len(data))]
    two.write(off, extent)  # same offset, blob and generation; another key
    with pytest.raises(Corrupt):
        two.read(off, len(data), 5, 2)
    one.close()
    two.close()
    assert not (tmp_path / "one").exists()


def test_freed_extents_are_hole_punched(tmp_path):
    tier = DiskTier(str(tmp_path / "tier"))
    offsets = []
    for i in range(64):
        offsets.append(tier.alloc(PAGE))
        tier.put(offsets[-1], os.urandom(PAGE), blob=i, gen=0)
    tier.drop_cache()
    full = os.stat(tmp_path / "tier").st_blocks
    for off in offsets[:-1]:  # the last one keeps the end where it is
        tier.free(off, PAGE)
    # not reusable before its punch (which the maintainer does without the store lock)
    assert tier.alloc(PAGE) == offsets[-1] + tier.extent_size(PAGE)
    pending = tier.take_pending()
    assert pending == [(len(TIER_HEADER), 63 * tier.extent_size(PAGE))]
    assert not tier.take_pending()
    tier.punch(pending)
    tier.reuse(pending)
    after = os.stat(tmp_path / "tier").st_blocks
    assert after * 512 <= full * 512 - 60 * PAGE
    assert tier.punch_errors == 0
    with open(tmp_path / "tier", "rb") as f:
        # nothing left of the first extent; the header stays
        assert f.read(PAGE) == TIER_HEADER + bytes(PAGE - len(TIER_HEADER))
    again = tier.alloc(PAGE)  # a reused extent is allocated again before the write
    tier.put(again, b"x" * PAGE, blob=99, gen=0)
    assert tier.read(again, PAGE, 99, 0) == b"x" * PAGE
    tier.close()


def cached_pages(path) -> int:
    """Pages of the file in the page cache: mincore(2) over a mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_a_disk_read_reads_only_its_extent(tmp_path):
    """No readahead on the tier file: extents read in a row made the kernel read ahead
    what the read then dropped unread."""
    tier = DiskTier(str(tmp_path / "tier"))
    length = 2 * PAGE
    offsets = []
    for i in range(256):
        offsets.append(tier.alloc(length))
        tier.put(offsets[-1], os.urandom(length), blob=i, gen=0)
    tier.drop_cache()
    assert cached_pages(tmp_path / "tier") == 0
    extent = tier.extent_size(length)
    for i in range(100, 104):  # neighbours in a row: readahead's pattern
        os.pread(tier.fd, extent, offsets[i])  # as the native path reads them
    assert cached_pages(tmp_path / "tier") <= -(-4 * extent // PAGE) + 1
    tier.close()


@pytest.mark.parametrize("plant", ["symlink", "dangling", "mode", "hardlink", "fifo", "owner",
                                   "directory", "no-header"])
def test_a_planted_tier_path_is_refused_and_left_alone(tmp_path, plant):
    target = tmp_path / "target"
    target.write_bytes(b"someone's data\n" * 300)
    os.chmod(target, 0o600)
    before = target.read_bytes()
    path = tmp_path / "tier"
    expect = {"symlink": "symbolic link", "dangling": "symbolic link", "mode": "mode 0644",
              "hardlink": "2 hard links", "fifo": "not a regular file",
              "owner": "owned by uid", "directory": "refusing",
              "no-header": "not an agentzip disk tier"}[plant]
    if plant == "symlink":
        path.symlink_to(target)
    elif plant == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    elif plant == "mode":
        path.write_bytes(b"x")
        os.chmod(path, 0o644)
    elif plant == "hardlink":
        os.link(target, path)
    elif plant == "fifo":
        os.mkfifo(path, 0o600)
    elif plant == "owner":
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        path.write_bytes(b"x")
        os.chmod(path, 0o600)
        nobody = pwd.getpwnam("nobody")
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    elif plant == "directory":
        path.mkdir(mode=0o700)
    elif plant == "no-header":  # right owner, mode and links: still not a tier of ours
        path.write_bytes(b"the operator's own file\n" * 300)
        os.chmod(path, 0o600)
        target = path
        before = target.read_bytes()
    with pytest.raises(DiskError, match=expect):
        PageStore(4 << 20, tiering=Tiering(swap_out_path=str(path)))
    assert target.read_bytes() == before
    assert not (tmp_path / "nowhere").exists()
    if plant == "symlink":
        assert path.is_symlink()


def test_a_new_tier_file_is_ours_and_0600(tmp_path):
    old = os.umask(0o002)
    try:
        store = make_store(tmp_path)
    finally:
        os.umask(old)
    st = os.stat(tmp_path / "tier")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    store.close()
    assert not (tmp_path / "tier").exists()


def test_an_old_tier_file_of_ours_is_emptied_at_start(tmp_path):
    path = tmp_path / "tier"
    path.write_bytes(TIER_HEADER + b"last run's extents" * 1000)
    os.chmod(path, 0o600)
    store = make_store(tmp_path)
    assert path.read_bytes() == TIER_HEADER  # emptied: the header alone
    store.close()


def test_no_tier_with_a_null_path(tmp_path):
    store = make_store(tmp_path, max_size=64 << 10, path=None)
    assert store.disk is None
    written = {}
    from agentzip_blk.errors import StoreFull

    with pytest.raises(StoreFull, match="no disk tier"):
        for slot in range(64):
            page = os.urandom(PAGE)
            store.write(page, slot * PAGE)
            written[slot] = page
    assert store.demote_cold() == 0
    for slot, page in written.items():
        assert store.read(slot * PAGE, PAGE) == page
    assert list(tmp_path.iterdir()) == []
    store.check()


def test_the_maintainer_punches_freed_extents_outside_the_lock(tmp_path, monkeypatch):
    store = make_store(tmp_path, max_size=1 << 20)
    store.disk.punch_slack = 0  # every freed byte beyond the slack: punched
    pages = {slot: os.urandom(PAGE) for slot in range(16)}
    for slot, page in pages.items():
        store.write(page, slot * PAGE)
    demote_all(store)
    store.trim(0, 8 * PAGE)
    seen = []
    punch = DiskTier.punch

    def spy(tier, extents):
        seen.append((store.lock.locked(), len(extents)))
        punch(tier, extents)

    monkeypatch.setattr(DiskTier, "punch", spy)
    store.maintain()
    assert seen == [(False, 1)]  # one range: the eight extents side by side
    with open(tmp_path / "tier", "rb") as f:
        f.seek(len(TIER_HEADER))  # the extents follow the header
        data = f.read(8 * store.disk.extent_size(PAGE))
    assert data == bytes(len(data))  # the freed extents hold zeros now
    for slot in range(8, 16):
        assert store.read(slot * PAGE, PAGE) == pages[slot]
    store.check()


def test_demotion_writes_outside_the_lock_and_skips_blobs_freed_meanwhile(tmp_path, monkeypatch):
    store = make_store(tmp_path, max_size=1 << 20)
    pages = {slot: page_of(slot) for slot in range(12)}
    for slot, page in pages.items():
        store.write(page, slot * PAGE)
    freed = int(store.slots.handle[3])
    seen = {}
    sync = DiskTier.sync_written

    def meanwhile(tier):
        # A request runs while the batch is being written: the lock is free. Slot 3 is
        # trimmed (its blob freed) and slot 5 rewritten, which may reuse the freed row
        # (a new generation).
        seen["locked"] = store.lock.locked()
        store.trim(3 * PAGE, PAGE)
        pages[5] = page_of(500)
        store.write(pages[5], 5 * PAGE)
        seen["reused"] = int(store.slots.handle[5]) == freed
        sync(tier)

    monkeypatch.setattr(DiskTier, "sync_written", meanwhile)
    store._clock.now += 60  # noqa: SLF001 - the injected clock
    moved = store.demote_cold()
    assert seen["locked"] is False
    assert moved == 10  # 12 copied, slot 3's and slot 5's old blobs gone meanwhile
    assert store.blobs.tier[int(store.slots.handle[5])] == POOL  # the new blob stays in the pool
    store.check()  # the two orphan extents were freed (disk books agree)
    assert store.read(3 * PAGE, PAGE) == bytes(PAGE)
    for slot, page in pages.items():
        if slot != 3:
            assert store.read(slot * PAGE, PAGE) == page
    store.close()


def test_freed_extents_within_the_slack_are_reused_without_a_punch(tmp_path, monkeypatch):
    """Under load extents are freed and taken again ~1000 times a second: while the file's
    free space stays within its slack they go back to the free map as they are (a punch
    and the refill of its hole cost ~50 us of CPU each); past it, they are punched."""
    store = make_store(tmp_path, max_size=1 << 20)
    pages = {slot: os.urandom(PAGE) for slot in range(32)}
    for slot, page in pages.items():
        store.write(page, slot * PAGE)
    demote_all(store)
    disk = store.disk
    punched = []
    punch = DiskTier.punch

    def spy(tier, extents):
        punched.append(len(extents))
        punch(tier, extents)

    monkeypatch.setattr(DiskTier, "punch", spy)
    extent = disk.extent_size(PAGE)
    store.trim(0, 8 * PAGE)
    assert store.tiers.punch_freed() == 0 and punched == []
    assert disk.free_bytes == 8 * extent  # reusable at once, not punched
    with open(tmp_path / "tier", "rb") as f:
        f.seek(len(TIER_HEADER))
        assert f.read(extent) != bytes(extent)  # its (sealed) bytes stay until reused
    end = disk.end
    for slot in range(8):  # written again and demoted: into the freed extents
        pages[slot] = os.urandom(PAGE)
        store.write(pages[slot], slot * PAGE)
    demote_all(store)
    assert disk.end == end and disk.free_bytes == 0
    disk.punch_slack = 8 * extent  # now 16 freed extents are past the slack
    store.trim(8 * PAGE, 16 * PAGE)
    assert store.tiers.punch_freed() == 1 and punched == [1]  # one range, side by side
    assert disk.free_bytes == 16 * extent
    for slot, page in pages.items():
        if not 8 <= slot < 24:
            assert store.read(slot * PAGE, PAGE) == page
    store.check()
    store.close()


def test_a_disk_read_waits_without_the_lock_and_a_blob_freed_meanwhile_is_read_again(tmp_path):
    """Issue 27 item 6: a disk blob's extent is read and opened after the store lock (the
    device's wait holds up no other request). If the blob is freed and its extent punched
    while the read waits, the AEAD check fails: the read is done again and answers the
    slot's new bytes, never EIO and never the old extent's."""
    store = make_store(tmp_path, max_size=1 << 20)
    store.disk.punch_slack = 0
    old, new, other = os.urandom(PAGE), os.urandom(PAGE), os.urandom(PAGE)
    store.write(old, 0)
    store.write(other, PAGE)
    demote_all(store)
    assert store.blobs.tier[int(store.slots.handle[0])] == DISK
    real_read = store.disk.read
    raced = []

    def racing_read(offset, length, blob, gen):
        assert not store.lock.locked()  # the device is waited for without the store lock
        if not raced:
            raced.append(blob)
            store.write(new, 0)  # the slot rewritten: its disk blob freed...
            assert store.tiers.punch_freed() >= 1  # ...and the extent punched
        return real_read(offset, length, blob, gen)

    store.disk.read = racing_read
    assert store.read(0, PAGE) == new
    assert raced and store.counters.checksum_errors == 0 and store.counters.errors == 0
    store.disk.read = real_read
    assert store.read(PAGE, PAGE) == other  # the other disk page reads back its own bytes
    store.check()
