"""The FUSE front door's pause, resume and adoption of a descriptor (a restart's handover).

While paused, a request waits in the kernel's queue and is answered by whoever serves the
connection next: the same door resumed, or another door that adopted the descriptor (here in
the same process; tests/host/test_restart_cli.py does it across processes). Both request
paths: Python's and the native loop's (its serve() waits in epoll and stops on the byte).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from agentzip_blk.datapath import native
from agentzip_blk.datapath.fuse import FuseFile
from fusemem import Mem, mount_point, mounted

PAGE = 4096
MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")


@pytest.fixture
def mnt():
    yield from mount_point("azfh-")


def read_page(path: str, page: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, PAGE, page * PAGE)
    finally:
        os.close(fd)


class StoreDoor:
    """A store behind the door's request interface (what datapath.server.Server is)."""

    def __init__(self, store) -> None:
        self.store = store

    def pread(self, out, offset):
        self.store.readinto(out, offset)

    def pwrite(self, data, offset):
        self.store.write(data, offset)

    def trim(self, offset, length):
        self.store.trim(offset, length)

    def zero(self, offset, length):
        self.store.zero(offset, length)

    def flush(self):
        self.store.flush()


def backend(path: str, data: bytes):
    """(backend, native loop or None) holding ``data``: a bytearray for Python's path, a
    store with the native path's lock for the native loop."""
    if path == "python":
        mem = Mem(len(data))
        mem.buf[:] = data
        return mem, None
    if not native.available():
        pytest.skip(native.MISSING)
    from nativeharness import native_store

    store = native_store(size=len(data))
    store.write(data, 0)
    return StoreDoor(store), native.NativePath(store)


def close(backend_and_loop) -> None:
    door, loop = backend_and_loop
    if loop is not None:
        loop.close()
        door.store.close()


PATHS = ["python", "native"]


@pytest.mark.parametrize("path", PATHS)
def test_a_paused_door_queues_requests_and_a_resumed_one_answers_them(mnt, path):
    data = os.urandom(MiB)
    be = backend(path, data)
    door = FuseFile(mnt, MiB, be[0], threads=3, native=be[1])
    door.start()
    try:
        assert read_page(door.path, 3) == data[3 * PAGE:4 * PAGE]
        door.pause()
        assert not door.alive
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(read_page(door.path, 3)), daemon=True)
        t.start()
        time.sleep(0.5)
        assert got == [] and t.is_alive()  # waiting in the kernel's queue, not failed
        door.resume()
        t.join(10)
        assert got == [data[3 * PAGE:4 * PAGE]]
        assert door.stats.errors == 0
    finally:
        door.stop()
        close(be)
    assert not mounted(mnt)


@pytest.mark.parametrize("path", PATHS)
def test_another_door_adopts_the_descriptor_and_answers_the_queue(mnt, path):
    old_data, new_data = os.urandom(MiB), os.urandom(MiB)
    old_be, new_be = backend(path, old_data), backend(path, new_data)
    old = FuseFile(mnt, MiB, old_be[0], threads=2, native=old_be[1])
    old.start()
    new = None
    try:
        assert read_page(old.path, 7) == old_data[7 * PAGE:8 * PAGE]
        old.pause()
        got: dict[int, bytes] = {}
        readers = [threading.Thread(target=lambda p=p: got.update({p: read_page(old.path, p)}),
                                    daemon=True) for p in range(8)]
        for t in readers:
            t.start()
        time.sleep(0.3)
        assert got == {}
        fd = os.dup(old.descriptor)
        conn = old.connection
        old.hand_over()
        old.stop()  # closes only its own descriptor: no unmount, no abort
        assert mounted(mnt)
        # the next server, with other bytes, so that the answers say who gave them
        new = FuseFile(mnt, MiB, new_be[0], threads=2, native=new_be[1])
        new.adopt(fd, conn)
        for t in readers:
            t.join(10)
        assert got == {p: new_data[p * PAGE:(p + 1) * PAGE] for p in range(8)}
        assert read_page(new.path, 200) == new_data[200 * PAGE:201 * PAGE]
        assert new.stats.errors == 0
    finally:
        if new is not None:
            new.stop()
        old.stop()
        close(old_be)
        close(new_be)
    assert not mounted(mnt)


def test_a_pause_answers_every_write_the_native_workers_queued(mnt):
    """Reads before writes (docs/ARCHITECTURE.md): native workers queue writes for the writer
    thread. A pause (a restart's handover) must leave none of them read and unanswered: the
    writer empties the queue before it stops, and the writes made meanwhile wait in the
    kernel's queue for the resumed door. Every page reads back what was written last."""
    import mmap

    data = bytes(MiB)
    be = backend("native", data)
    if not be[1].writes:
        close(be)
        pytest.skip("this store's writes are not served natively")
    door = FuseFile(mnt, MiB, be[0], threads=3, native=be[1])
    door.start()
    written: dict[int, bytes] = {}
    stop = threading.Event()
    errors: list[str] = []

    def writer(first: int) -> None:
        fd = os.open(door.path, os.O_WRONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4 * PAGE)
        try:
            round_ = 0
            while not stop.is_set():
                page = first + (round_ % 8) * 4
                content = (f"{first}:{round_}:".encode() * 4 * PAGE)[: 4 * PAGE]
                buf[:] = content
                if os.pwrite(fd, buf, page * PAGE) != 4 * PAGE:
                    errors.append("short write")
                for i in range(4):
                    written[page + i] = content[i * PAGE:(i + 1) * PAGE]
                round_ += 1
        except OSError as exc:
            errors.append(str(exc))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=writer, args=(w * 64,), daemon=True) for w in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        door.pause()
        assert not door.alive
        assert be[1].counters()["in_flight"] == 0  # nothing read is left unanswered
        time.sleep(0.2)
        door.resume()
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(10)
        assert errors == [] and not any(t.is_alive() for t in threads)
        assert be[1].counters()["writes_queued"] > 0
        for page, content in written.items():
            assert read_page(door.path, page) == content, page
        assert door.stats.errors == 0
    finally:
        stop.set()
        door.stop()
        close(be)
    assert not mounted(mnt)


@pytest.mark.parametrize("path", PATHS)
def test_stop_ends_every_thread_the_writers_too_without_an_abort(mnt, path):
    """The writer threads of the native path's write queue wait on the stop byte, not on
    /dev/fuse: `stop` (the server's shutdown, after `down`'s swapoff) sets it, so every
    thread ends and the connection needs no abort."""
    be = backend(path, os.urandom(MiB))
    door = FuseFile(mnt, MiB, be[0], threads=2, native=be[1])
    aborts: list[int] = []
    door.abort = lambda: aborts.append(1)
    door.start()
    try:
        assert read_page(door.path, 1)
        door.stop()
        assert not door.alive, [t.name for t in door._workers if t.is_alive()]
        assert aborts == []
    finally:
        door.stop()
        close(be)
    assert not mounted(mnt)
