"""The FUSE workers' scheduling class (device.request_priority, datapath/priority.py).

- realtime: the workers that read /dev/fuse for the native path run SCHED_FIFO 1, while a
  request they hand to Python runs at the normal priority, and every byte comes back;
- refused (no CAP_SYS_NICE, a cpu cgroup without real-time time): the workers run normal,
  say why, and serve the same;
- normal, and the Python request path: no worker is real-time.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import struct
import threading
import time

import pytest

from agentzip_blk.datapath import native, priority
from agentzip_blk.datapath.fuse import FuseFile
from fusemem import mount_point
from nativeharness import native_store

PAGE = 4096

pytestmark = pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")


class StoreBackend:
    """What the door hands up, served by the store the native path binds; it notes the
    scheduling class of each thread that serves one."""

    def __init__(self, store) -> None:
        self.store = store
        self.policies: list[int] = []
        self._lock = threading.Lock()

    def _note(self) -> None:
        with self._lock:
            self.policies.append(os.sched_getscheduler(0))

    def pread(self, buf, offset: int) -> None:
        self._note()
        buf[:] = self.store.read(offset, len(buf))

    def pwrite(self, buf, offset: int) -> None:
        self._note()
        self.store.write(bytes(buf), offset)

    def trim(self, offset: int, length: int) -> None:
        self.store.trim(offset, length)

    def zero(self, offset: int, length: int) -> None:
        self.store.zero(offset, length)

    def flush(self) -> None:
        pass


@pytest.fixture
def mnt():
    yield from mount_point("azpr-")


def text_page(rnd: random.Random) -> bytes:
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % rnd.randrange(99999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b".")


def serve_and_check(mnt: str, request_priority: str, datapath_native: bool = True):
    """A door over a warm-lz4 store: text pages (stored and read natively) and a non-zero
    same-fill word (a write the native side hands up), every byte read back."""
    store = native_store(warm_algorithm="lz4", frame_pages=16)
    path = native.NativePath(store) if datapath_native else None
    backend = StoreBackend(store)
    door = FuseFile(mnt, 16 << 20, backend, threads=3, native=path,
                    request_priority=request_priority)
    door.start()
    try:
        rnd = random.Random(5)
        data = b"".join(text_page(rnd) for _ in range(32))
        data += struct.pack("<Q", 0x5A5A_0101_A5A5_7E7E) * (8 * PAGE // 8)
        buf = mmap.mmap(-1, len(data))
        buf.write(data)
        fd = os.open(door.path, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwritev(fd, [buf], 0) == len(data)
            out = mmap.mmap(-1, len(data))
            for first in range(0, len(data) // PAGE, 3):  # single pages, then all at once
                one = mmap.mmap(-1, PAGE)
                assert os.preadv(fd, [one], first * PAGE) == PAGE
                assert one[:] == data[first * PAGE:(first + 1) * PAGE], first
            assert os.preadv(fd, [out], 0) == len(data) and out[:] == data
        finally:
            os.close(fd)
        # a worker serving a handed-up request (the RELEASE of that close) is normal until
        # it is done: the classes once the door is idle
        deadline = time.monotonic() + 5
        while True:
            workers = [os.sched_getscheduler(tid) for tid in door.stats.threads]
            if len(set(workers)) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(workers) == 3 and door.stats.errors == 0
        return door, workers, backend, path
    finally:
        door.stop()
        if path is not None:
            path.close()


def test_realtime_workers_answer_reads_and_hand_up_at_the_normal_priority(mnt):
    door, workers, backend, path = serve_and_check(mnt, priority.REALTIME)
    assert workers == [os.SCHED_FIFO] * 3
    assert door.priority_in_effect == priority.REALTIME and door.stats.priority_refused is None
    assert path.counters()["reads"] > 0  # reads answered natively, by the FIFO workers
    # the same-fill word's write was handed up: Python served it at the normal priority
    assert backend.policies and set(backend.policies) == {os.SCHED_OTHER}


def test_refused_realtime_runs_normal_and_says_why(mnt, monkeypatch):
    real = os.sched_setscheduler

    def refuse(pid, policy, param):
        if policy == os.SCHED_FIFO:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        return real(pid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    door, workers, backend, _ = serve_and_check(mnt, priority.REALTIME)
    assert workers == [os.SCHED_OTHER] * 3
    assert door.priority_in_effect == priority.NORMAL
    assert door.stats.priority_refused == "SCHED_FIFO 1 refused: Operation not permitted"


@pytest.mark.parametrize("request_priority,datapath_native", [(priority.NORMAL, True),
                                                              (priority.REALTIME, False)])
def test_no_realtime_worker_when_normal_or_on_the_python_path(mnt, request_priority,
                                                               datapath_native):
    door, workers, backend, _ = serve_and_check(mnt, request_priority, datapath_native)
    assert workers == [os.SCHED_OTHER] * 3 and door.priority_in_effect == priority.NORMAL
    assert set(backend.policies) == {os.SCHED_OTHER}
