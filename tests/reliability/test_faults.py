"""Fault injection: pool full, disk tier full, disk tier I/O errors, compressor exceptions.

Each fault must surface as the right errno, both to an NBD client and to the kernel (an
O_DIRECT write to the loop device over nbdfuse, the path swap takes), be counted in
`stats`, and lose none of the pages stored before it: they are read back byte for byte
while the fault lasts (where the fault allows reads) and after it is cleared."""

from __future__ import annotations

import errno
import fcntl
import os
import struct

import pytest

from . import support
from .conftest import skip_reason
from .support import PAGE, make_pages

pytestmark = pytest.mark.skipif(
    skip_reason("nbdkit", "nbdfuse", "losetup", "fusermount3") is not None,
    reason=str(skip_reason("nbdkit", "nbdfuse", "losetup", "fusermount3")))
pytestmark = [pytestmark, pytest.mark.slow]  # the inner loop leaves it out

SIZE = "64M"
BLKDISCARD = 0x1277  # linux/fs.h: _IO(0x12, 119)


class Device:
    """The loop device of a chain, written and read with O_DIRECT, plus a model of what it
    must hold. `write` returns the errno of a failed write, or 0."""

    def __init__(self, chain: support.LoopChain) -> None:
        self.chain = chain
        self.fd = support.direct_fd(chain.loop)
        self.buf = support.aligned(PAGE)
        self.model: dict[int, bytes] = {}
        self.verified = 0
        self.mismatched = 0  # pages found differing from the model, over every check

    def write(self, slot: int, data: bytes) -> int:
        self.buf[:] = data
        try:
            os.pwrite(self.fd, self.buf, slot * PAGE)
        except OSError as exc:
            return exc.errno
        self.model[slot] = data
        return 0

    def read(self, slot: int) -> bytes | int:
        try:
            os.preadv(self.fd, [self.buf], slot * PAGE)
        except OSError as exc:
            return exc.errno
        return bytes(self.buf)

    def lost(self, slots=None) -> list[int]:
        """Slots whose content differs from the model (an unreadable slot counts)."""
        bad = []
        for slot in sorted(self.model if slots is None else slots):
            got = self.read(slot)
            if got != self.model[slot]:
                bad.append(slot)
                self.mismatched += 1
            else:
                self.verified += PAGE
        return bad

    def counts(self, faults: int = 0) -> dict[str, int]:
        """What this device's checks verified and lost, for support.recorded."""
        return {"bytes_verified": self.verified, "faults_injected": faults,
                "data_lost": self.mismatched}

    def close(self) -> None:
        os.close(self.fd)
        self.buf.close()


def nbd_errno(sock: str, op, *args) -> str | None:
    """Run one libnbd call on a fresh connection; the error's errno name, None on success."""
    import nbd

    h = support.nbd_client(sock)
    try:
        getattr(h, op)(*args)
        return None
    except nbd.Error as exc:
        return exc.errno
    finally:
        h.shutdown()


def assert_books_balance(chain) -> None:
    """Trim the whole device: then nothing may be left in the store. A blob leaked by a
    failed request (staged but never released) would still count here."""
    h = support.nbd_client(chain.server.nbd_socket)
    try:
        h.trim(h.get_size(), 0)
    finally:
        h.shutdown()
    st = support.stats(chain.server)
    leaked = {k: st[k] for k in ("pages", "unique_blobs", "pool_live_bytes", "compressed_bytes")}
    assert leaked == dict.fromkeys(leaked, 0), f"store not empty after a full trim: {leaked}"


def fill_until(dev: Device, first: int, pages: list[bytes], expect: int) -> tuple[int, int]:
    """Write pages from slot `first` on until one fails; (slots written, errno)."""
    for i, page in enumerate(pages):
        err = dev.write(first + i, page)
        if err:
            assert err == expect, f"slot {first + i}: {errno.errorcode.get(err, err)}"
            return i, err
    pytest.fail(f"no {errno.errorcode[expect]} after {len(pages)} pages")


def test_pool_full_is_enospc_and_keeps_pages(tmp_path):
    """A 1 MiB pool over a 1 MiB size-limited disk tier file: both fill, then ENOSPC."""
    # no background packing: it would free room (frames need less) under the full store
    config = support.write_config(tmp_path, pool={"max_size": "1M", "swap_out_max_size": "1M"},
                                  policy={"recompress_cpu": 0})
    with support.loop_chain(tmp_path, size=SIZE, config=config) as chain:
        _pool_full(chain)


def _pool_full(chain) -> None:
    dev = Device(chain)
    st: dict = {}
    try:
        with support.recorded("pool_full", lambda: dev.counts(st.get("enospc", 0))):
            written, _ = fill_until(dev, 0, make_pages(2048, seed=1, mix="r"), errno.ENOSPC)
            assert written >= 256  # the pool and the disk tier each took ~1 MiB first
            st = support.stats(chain.server)
            assert st["enospc"] >= 1 and st["disk_full"] >= 1 and st["direct_to_disk"] > 0
            # a failed overwrite leaves the old page; same-filled pages need no room and still fit
            assert dev.write(0, make_pages(1, seed=99, mix="r")[0]) == errno.ENOSPC
            assert dev.write(written + 5, b"\x11" * PAGE) == 0
            assert nbd_errno(chain.server.nbd_socket, "pwrite", os.urandom(PAGE), 3 * PAGE) == "ENOSPC"
            assert dev.lost() == []
            # room comes back when the kernel frees slots (discard): then writes succeed again
            fcntl.ioctl(dev.fd, BLKDISCARD, struct.pack("QQ", 0, 64 * PAGE))
            for slot in range(64):
                dev.model[slot] = bytes(PAGE)
            assert dev.write(1, make_pages(1, seed=98, mix="r")[0]) == 0
            assert dev.lost() == []
            st = support.stats(chain.server)
            assert st["errors"] == 0, "ENOSPC is not an I/O error"
            assert_books_balance(chain)
    finally:
        dev.close()


def test_disk_tier_filesystem_full_is_enospc(tmp_path):
    """The disk tier on a 2 MiB tmpfs that fills up: the pool (1 MiB) and the filesystem
    are both full, so new pages get ENOSPC; every stored page reads back."""
    with support.small_tmpfs("2m") as fs:
        config = support.write_config(tmp_path, pool={"max_size": "1M",
                                                      "swap_out_path": f"{fs}/tier"})
        with support.loop_chain(tmp_path, size=SIZE, config=config) as chain:
            _disk_full(chain)


def _disk_full(chain) -> None:
    dev = Device(chain)
    st: dict = {}
    try:
        with support.recorded("disk_full", lambda: dev.counts(st.get("enospc", 0))):
            pages = make_pages(4096, seed=2, mix="rt")
            written, _ = fill_until(dev, 0, pages, errno.ENOSPC)
            assert written >= 300
            st = support.stats(chain.server)
            assert st["disk_full"] >= 1 and st["enospc"] >= 1
            assert st["tiers"]["disk"]["pages"] > 0
            assert nbd_errno(chain.server.nbd_socket, "pwrite", os.urandom(PAGE), 0) == "ENOSPC"
            assert dev.lost() == []
            assert_books_balance(chain)
    finally:
        dev.close()


@pytest.mark.skipif(support.failfs_skip_reason() is not None,
                    reason=str(support.failfs_skip_reason()))
def test_disk_tier_io_errors_are_eio_and_lose_nothing(tmp_path):
    """The disk tier on failfs. Write errors, fsync errors and read errors each give EIO,
    count in disk_errors; pages in the pool stay readable throughout, and once the fault
    clears every page, including those on disk, reads back."""
    with support.failfs() as fs:
        config = support.write_config(tmp_path, pool={"max_size": "1M",
                                                      "swap_out_path": f"{fs.mountpoint}/tier"},
                                      # the slots it finds on disk must stay there until
                                      # it reads them: no background packing
                                      policy={"hot_cache_size": 0, "recompress_cpu": 0})
        with support.loop_chain(tmp_path, size=SIZE, config=config) as chain:
            _disk_io_errors(chain, fs)


def _disk_io_errors(chain, fs) -> None:
    dev = Device(chain)
    faults = 0
    try:
        with support.recorded("disk_io_errors", lambda: dev.counts(faults)):
            pages = make_pages(600, seed=3, mix="rt")
            for i, page in enumerate(pages):  # past the pool's 1 MiB: the rest goes to disk
                assert dev.write(i, page) == 0
            st = support.stats(chain.server)
            assert st["tiers"]["disk"]["pages"] > 0 and st["tiers"]["pool"]["pages"] > 0
            on_disk = slots_in_tier(chain, range(len(pages)), tier=1)
            in_pool = slots_in_tier(chain, range(len(pages)), tier=0)
            assert on_disk and in_pool
            # enough raw pages to outgrow the file's fallocated 1 MiB step, for `a` to be hit
            new = make_pages(400, seed=4, mix="r")
            for letters in ("a", "w", "s", "ws"):  # fallocate (first: the file must grow), write, fsync
                fs.arm(letters)
                failed = [dev.write(i, p) for i, p in enumerate(new, start=1000)]
                overwrite = dev.write(on_disk[0], new[0])  # a stored slot: must keep its page
                fs.arm("")
                assert errno.EIO in failed, letters
                assert set(failed) <= {0, errno.EIO}, letters
                assert overwrite in (0, errno.EIO)
                faults += failed.count(errno.EIO) + (overwrite == errno.EIO)
                assert dev.lost() == [], f"pages lost after '{letters}' faults"
            # reads promote pages to the pool: ask again which slots are on disk now
            on_disk = slots_in_tier(chain, range(len(pages)), tier=1)
            in_pool = slots_in_tier(chain, range(len(pages)), tier=0)
            assert len(on_disk) >= 2
            fs.arm("r")
            assert dev.read(on_disk[0]) == errno.EIO
            assert nbd_errno(chain.server.nbd_socket, "pread", PAGE, on_disk[1] * PAGE) == "EIO"
            assert dev.lost(in_pool) == [], "pool pages must stay readable while the disk fails"
            faults += 2
            fs.arm("")
            assert dev.lost() == []
            st = support.stats(chain.server)
            assert st["disk_errors"] >= 5 and st["errors"] >= 5
            support.request(chain.server.control_socket, "reclaim")  # books still balance
            assert dev.lost() == []
            assert_books_balance(chain)
    finally:
        dev.close()


def slots_in_tier(chain, slots, tier: int) -> list[int]:
    reply = support.request(chain.server.control_socket, "slots", slots=list(slots))
    return [s for s, kind, t in zip(slots, reply["kind"], reply["tier"]) if kind == 2 and t == tier]


def test_compressor_exception_is_eio_and_changes_nothing(tmp_path):
    """An exception inside the codec (injected through a wrapper plugin): EIO, counted in
    errors, the slot keeps its old page; pages that need no compression still go through."""
    ctl = tmp_path / "fault"
    ctl.write_text("")
    # no hot cache: every read of a stored page decompresses, so `d` is seen by each read
    config = support.write_config(tmp_path, policy={"hot_cache_size": 0})
    with support.loop_chain(tmp_path, size=SIZE, config=config, plugin=support.FAULTY_PLUGIN,
                            extra=(f"fault={ctl}",)) as chain:
        _compressor_faults(chain, ctl)


def _compressor_faults(chain, ctl) -> None:
    dev = Device(chain)
    faulted = 0
    try:
        with support.recorded("compressor_exception", lambda: dev.counts(faulted)):
            pages = make_pages(300, seed=5)
            for i, page in enumerate(pages):
                assert dev.write(i, page) == 0
            ctl.write_text("c")
            fresh = make_pages(30, seed=6, mix="tr")
            failed = [dev.write(i, p) for i, p in enumerate(fresh)]  # overwrites of stored slots
            assert failed == [errno.EIO] * len(fresh)
            assert dev.write(400, b"\x42" * PAGE) == 0  # same-filled: no codec involved
            assert dev.write(401, pages[0]) == 0  # a duplicate: shares the stored blob
            assert nbd_errno(chain.server.nbd_socket, "pwrite", fresh[0], 500 * PAGE) == "EIO"
            assert dev.lost() == []
            ctl.write_text("d")
            assert dev.read(0) == errno.EIO  # text page: decompression needed
            ctl.write_text("")
            faulted = len(fresh) + 2
            assert dev.lost() == []
            st = support.stats(chain.server)
            assert st["errors"] == len(fresh) + 2
            for i, page in enumerate(fresh):  # the fault cleared: the same writes now succeed
                assert dev.write(i, page) == 0
            assert dev.lost() == []
            assert_books_balance(chain)
    finally:
        dev.close()


def test_failed_writeback_releases_the_request(tmp_path, monkeypatch):
    """In process: when the write-back (fdatasync) of a request's disk pages fails, the
    request fails and its staged blobs are released. They used to stay referenced with no
    slot pointing at them (leaked space, and dedup hits on them made later writes of the
    same pages skip the disk)."""
    from agentzip_blk.store import PageStore, Tiering
    from agentzip_blk.store.disk import DiskError

    store = PageStore(16 << 20, tiering=Tiering(max_size=1 << 20,
                                                swap_out_path=str(tmp_path / "tier")))
    try:
        pages = make_pages(400, seed=9, mix="r")
        for i, page in enumerate(pages[:300]):  # past the 1 MiB pool: on disk too
            store.write(page, i * PAGE)
        real = store.disk.drop_cache

        def failing():
            raise DiskError("injected fdatasync failure")

        monkeypatch.setattr(store.disk, "drop_cache", failing)
        for i, page in enumerate(pages[300:], start=300):
            with pytest.raises(DiskError):
                store.write(page, i * PAGE)
        monkeypatch.setattr(store.disk, "drop_cache", real)
        lost = sum(support.pages_differing(store.read(i * PAGE, PAGE), page)
                   for i, page in enumerate(pages[:300]))
        lost += support.pages_differing(store.read(300 * PAGE, 100 * PAGE), bytes(100 * PAGE))
        support.record("writeback_failure", faults_injected=100,
                       bytes_verified=(400 - lost) * PAGE, data_lost=lost)  # before any assert
        assert lost == 0, f"{lost} pages read back wrong"
        store.check()  # refcounts, blob count, disk extents: nothing leaked
        assert store.stats()["disk_errors"] == 100
    finally:
        store.close()
