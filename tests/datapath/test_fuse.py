"""The in-process FUSE front door (agentzip_blk.datapath.fuse).

- the protocol on its own, over a bytearray backend: attributes, O_DIRECT reads and writes,
  punch-hole and zero-range fallocate, short reads at the end, refused growth, unmount;
- the real server: nbdkit with the agentzip plugin and ``fuse=MNT``, N threads issuing
  overlapping O_DIRECT reads, writes, punches and zero-ranges through the FUSE file, checked
  byte for byte against a bytearray model;
- what the operator runs: ``agentzip-blk up``, a workload through swap and
  ``agentzip-blk down`` as three separate processes with ``device.frontend: fuse``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agentzip_blk import procfs
from agentzip_blk.datapath import control, native
from agentzip_blk.datapath.fuse import MAX_BACKGROUND, FuseFile
from agentzip_blk.errors import OutOfRange, StoreFull
from agentzip_blk.host import facts
from cliswap import HEAP_WORKLOAD, leave_nothing, squeezed_workload, stop_workload
from fusemem import Mem, kernel_max_background, mount_point, mounted
from nbdkit_server import nbdkit_available, start_server

PAGE = 4096
MiB = 1 << 20
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def aligned(data: bytes) -> mmap.mmap:
    m = mmap.mmap(-1, max(PAGE, len(data)))
    m.write(data)
    return m


@pytest.fixture
def mnt():
    yield from mount_point("azfd-")


def test_protocol_over_a_bytearray(mnt):
    size = 4 * MiB
    mem = Mem(size)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    door = FuseFile(mnt, size, mem, threads=3)
    door.start()
    try:
        # no signal handler of its own: the server's refusal of signals stays in charge
        assert {s: signal.getsignal(s) for s in handlers} == handlers
        assert os.listdir(mnt) == ["device"]
        st = os.stat(door.path)
        assert st.st_size == size and oct(st.st_mode & 0o777) == "0o600"
        assert not os.path.exists(os.path.join(mnt, "other"))
        fd = os.open(door.path, os.O_RDWR | os.O_DIRECT)
        try:
            data = os.urandom(3 * PAGE)
            assert os.pwritev(fd, [aligned(data)], 5 * PAGE) == len(data)
            assert mem.buf[5 * PAGE:8 * PAGE] == data
            out = mmap.mmap(-1, 3 * PAGE)
            assert os.preadv(fd, [out], 5 * PAGE) == len(data) and out[:] == data
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 6 * PAGE, PAGE)
            assert mem.buf[6 * PAGE:7 * PAGE] == bytes(PAGE)
            assert mem.buf[5 * PAGE:6 * PAGE] == data[:PAGE]
            fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 7 * PAGE, PAGE)
            assert mem.buf[5 * PAGE:8 * PAGE] == data[:PAGE] + bytes(2 * PAGE)
            # the end of the file: a short read, and no growth
            last = mmap.mmap(-1, 2 * PAGE)
            assert os.preadv(fd, [last], size - PAGE) == PAGE
            with pytest.raises(OSError) as ei:
                os.pwritev(fd, [aligned(b"x" * 2 * PAGE)], size - PAGE)
            assert ei.value.errno in (errno.ENOSPC, errno.EFBIG)
            with pytest.raises(OSError):
                os.ftruncate(fd, size // 2)
            os.fsync(fd)
            assert mem.flushes >= 1
        finally:
            os.close(fd)
        assert door.stats.errors == 0 and door.stats.trims == 2
    finally:
        door.stop()
    assert not mounted(mnt) and not door.alive
    door.stop()  # twice is fine


def test_external_unmount_ends_the_workers(mnt):
    door = FuseFile(mnt, MiB, Mem(MiB), threads=2)
    door.start()
    try:
        assert door.alive
        subprocess.run(["fusermount3", "-u", mnt], check=True)
        deadline = time.monotonic() + 10
        while door.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not door.alive
    finally:
        door.stop()
    assert not mounted(mnt)


def test_the_kernel_lets_max_background_requests_in_flight(mnt):
    """The loop device's direct I/O reaches the door as background requests, and the kernel
    holds back any beyond the max_background that INIT answered (its own default is 12): with
    64, reads waited in the kernel behind the writes the write queue held. fusectl shows what
    the kernel took."""
    door = FuseFile(mnt, MiB, Mem(MiB), threads=2)
    door.start()
    try:
        assert kernel_max_background(mnt) == MAX_BACKGROUND >= 256  # 2x the loop's 128
    finally:
        door.stop()
    assert not mounted(mnt)


class Failing(Mem):
    """A backend whose reads, writes and punches fail as the store's do."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.raise_on: dict[str, BaseException] = {}

    def pread(self, out, offset):
        if "pread" in self.raise_on:
            raise self.raise_on["pread"]
        super().pread(out, offset)

    def pwrite(self, data, offset):
        if "pwrite" in self.raise_on:
            raise self.raise_on["pwrite"]
        super().pwrite(data, offset)

    def trim(self, offset, length):
        if "trim" in self.raise_on:
            raise self.raise_on["trim"]
        super().trim(offset, length)


def test_a_failed_request_answers_the_errno_of_its_exception(mnt):
    """errors.errno_of, the plugin's mapping too: StoreFull is ENOSPC, OutOfRange EINVAL,
    anything else EIO; each failure is counted and the worker goes on serving."""
    backend = Failing(MiB)
    door = FuseFile(mnt, MiB, backend, threads=1)
    door.start()
    try:
        fd = os.open(door.path, os.O_RDWR | os.O_DIRECT)
        try:
            backend.raise_on["pwrite"] = StoreFull("no room")
            with pytest.raises(OSError) as ei:
                os.pwritev(fd, [aligned(b"x" * PAGE)], 0)
            assert ei.value.errno == errno.ENOSPC
            backend.raise_on["pread"] = OutOfRange("past the end")
            with pytest.raises(OSError) as ei:
                os.preadv(fd, [mmap.mmap(-1, PAGE)], 0)
            assert ei.value.errno == errno.EINVAL
            backend.raise_on["trim"] = RuntimeError("a bug")
            with pytest.raises(OSError) as ei:
                fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, PAGE)
            assert ei.value.errno == errno.EIO
            backend.raise_on.clear()
            assert os.pwritev(fd, [aligned(b"y" * PAGE)], 0) == PAGE
        finally:
            os.close(fd)
        assert door.stats.errors == 3 and door.stats.last_error == "RuntimeError: a bug"
        assert backend.buf[:PAGE] == b"y" * PAGE
    finally:
        door.stop()


# -- the real server ------------------------------------------------------------------------------

needs_nbdkit = pytest.mark.skipif(nbdkit_available() is not None,
                                  reason=nbdkit_available() or "")


def agentish_page(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return bytes([rng.randrange(256)]) * PAGE  # same-filled
    if kind < 0.3:
        return os.urandom(PAGE)  # stored raw
    words = [b"tool_call", b"result", b'"role": "assistant"', b"def f(x):", b"{\"id\": %d}"]
    out = bytearray()
    while len(out) < PAGE:
        w = rng.choice(words)
        out += (w % rng.randrange(1000)) if b"%d" in w else w
        out += b" "
    return bytes(out[:PAGE])


@needs_nbdkit
@pytest.mark.nbdkit
@pytest.mark.parametrize("datapath,warm", [("python", "none"), ("python", "lz4"),
                                           ("native", "none"), ("native", "lz4")])
def test_concurrent_overlapping_requests_match_a_model(tmp_path, datapath, warm):
    """6 threads, 3000 requests on 128 pages (8 units of 16): reads, writes of 1-8 pages,
    punches and zero-ranges. Requests on the same pages are ordered by page locks (so the
    model is exact); everything else runs at once, inside the same units. Both request
    paths (device.datapath), pages framed at once or stored warm."""
    if datapath == "native" and not native.available():
        pytest.skip(native.MISSING)
    pages, threads, ops = 128, 6, 500
    size = 16 * MiB
    mnt = str(tmp_path / "mnt")
    config = tmp_path / "config.yaml"
    config.write_text(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n"
                      f"compression:\n  warm_algorithm: {warm}\n"
                      f"device:\n  datapath: {datapath}\n")
    server = start_server(tmp_path, size="16M", config=config,
                          extra_keys=(f"fuse={mnt}", "fuse_threads=4"),
                          wait_for=(os.path.join(mnt, "device"),))
    path = os.path.join(mnt, "device")
    model = bytearray(size)
    locks = [threading.Lock() for _ in range(pages)]
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            for _ in range(ops):
                first = rng.randrange(pages)
                n = min(rng.randint(1, 8), pages - first)
                off, length = first * PAGE, n * PAGE
                held = locks[first:first + n]
                for lk in held:
                    lk.acquire()
                try:
                    op = rng.random()
                    if op < 0.4:
                        out = mmap.mmap(-1, length)
                        got = os.preadv(fd, [out], off)
                        if got != length or out[:] != model[off:off + length]:
                            failures.append(f"read {first}+{n}: wrong bytes")
                    elif op < 0.8:
                        data = b"".join(agentish_page(rng) for _ in range(n))
                        if os.pwritev(fd, [aligned(data)], off) != length:
                            failures.append(f"write {first}+{n}: short")
                        model[off:off + length] = data
                    elif op < 0.9:
                        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length)
                        model[off:off + length] = bytes(length)
                    else:
                        fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, off, length)
                        model[off:off + length] = bytes(length)
                finally:
                    for lk in held:
                        lk.release()
        except Exception as exc:  # a failed request fails the test, not just the thread
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            os.close(fd)

    try:
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert not any(t.is_alive() for t in ts)
        assert failures == []
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            out = mmap.mmap(-1, pages * PAGE)
            assert os.preadv(fd, [out], 0) == pages * PAGE
            assert out[:] == model[:pages * PAGE]
        finally:
            os.close(fd)
        stats = control.request(server.control_socket, "stats")
        door = stats["server"]["fuse"]
        assert door["errors"] == 0 and stats["errors"] == 0
        assert door["threads"] == 4 and door["reads"] > 0 and door["writes"] > 0
        assert door["trims"] > 0 and stats["trims"] + stats["zeroes"] == door["trims"]
        served = stats["server"]["datapath"]
        assert served["path"] == datapath
        if datapath == "native":  # empty and zero pages at least, warm pages too with lz4
            assert served["native_reads"] > 0 and served["native_handed_up"] > 0
            assert served["native_reply_errors"] == 0
            # writes of whole pages too: warm pages alone with lz4, frames at once without
            assert served["native_writes_served"] and served["native_writes"] > 0
            # the workers queued writes for the writer thread (reads before writes), and
            # the writes it could not serve went up to Python like the workers' do
            assert served["native_writes_queued"] > 0
        assert stats["latency"]["read"]["count"] == door["reads"]
        # the door's punches and zero-ranges go through Server.trim/zero, timed like the rest
        latency = stats["latency"]
        assert latency["trim"]["count"] + latency["zero"]["count"] == door["trims"]
    finally:
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", mnt], check=False)
        server.stop()
    assert server.proc.returncode == 0, server.log_text()
    assert not mounted(mnt)


@needs_nbdkit
@pytest.mark.nbdkit
def test_server_stop_unmounts(tmp_path):
    """SIGTERM to a server with no loop device on its file: cleanup unmounts it."""
    mnt = str(tmp_path / "mnt")
    server = start_server(tmp_path, size="8M", extra_keys=(f"fuse={mnt}",),
                          wait_for=(os.path.join(mnt, "device"),))
    try:
        assert os.stat(os.path.join(mnt, "device")).st_size == 8 * MiB
    finally:
        server.stop()
    assert not mounted(mnt), server.log_text()


@needs_nbdkit
@pytest.mark.nbdkit
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio missing (apt-get install fio)")
def test_loop_device_over_the_door_passes_fio_verify(tmp_path):
    """The swap path without swap: loop (--direct-io=on, as up attaches it) over the server's
    FUSE file, fio at queue depth 32 with mixed request sizes, every block verified; then a
    discard reaches the store as a trim."""
    mnt = str(tmp_path / "mnt")
    server = start_server(tmp_path, size="256M", extra_keys=(f"fuse={mnt}",),
                          wait_for=(os.path.join(mnt, "device"),))
    loop = None
    try:
        loop = subprocess.run(["losetup", "--direct-io=on", "--show", "-f",
                               os.path.join(mnt, "device")], capture_output=True, text=True,
                              check=True).stdout.strip()
        with open(f"/sys/block/{os.path.basename(loop)}/loop/dio") as f:
            assert f.read().strip() == "1"
        r = subprocess.run(["fio", "--name=swaplike", f"--filename={loop}", "--direct=1",
                            "--ioengine=libaio", "--iodepth=32", "--rw=randrw",
                            "--bssplit=4k/60:16k/20:64k/15:256k/5", "--size=96M",
                            "--verify=crc32c", "--verify_fatal=1", "--do_verify=1"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        before = control.request(server.control_socket, "stats")["trims"]
        subprocess.run(["blkdiscard", "-o", "0", "-l", str(16 * MiB), loop], check=True)
        stats = control.request(server.control_socket, "stats")
        assert stats["trims"] > before and stats["errors"] == 0
        assert stats["server"]["fuse"]["errors"] == 0
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", mnt], check=False)
        server.stop()
    assert not mounted(mnt)


# -- what the operator runs: three processes --------------------------------------------------


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("agentzip-blk")
    return subprocess.run([str(exe), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.swap
@needs_nbdkit
@pytest.mark.skipif(not Path(sys.executable).with_name("agentzip-blk").exists(),
                    reason="agentzip-blk is not installed in this venv (./setup.sh)")
@pytest.mark.skipif(facts.nbd_kernel_available(), reason="kernel nbd host")
def _fifo_threads(pid: int) -> int:
    """The server's SCHED_FIFO threads, once none is serving a handed-up request (those
    run at the normal priority for a moment)."""
    deadline = time.monotonic() + 5
    while True:
        fifo = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                fifo += os.sched_getscheduler(int(tid)) == os.SCHED_FIFO
        if fifo in (0, 4) or time.monotonic() > deadline:
            return fifo
        time.sleep(0.05)


@pytest.mark.parametrize("datapath,warm,request_priority", [("auto", "none", None),
                                                            ("native", "lz4", "realtime")])
def test_cli_up_swap_down_in_separate_processes_with_fuse(tmp_path, datapath, warm,
                                                          request_priority):
    """The defaults, and the native request path serving warm pages with its workers at
    SCHED_FIFO (device.request_priority: realtime): every byte back."""
    if datapath == "native" and not native.available():
        pytest.skip(native.MISSING)
    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    run_dir = tempfile.mkdtemp(prefix="azfc-", dir="/tmp")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n"
                   f"compression:\n  warm_algorithm: {warm}\n"
                   f"device:\n  size: 512M\n  run_dir: {run_dir}\n  frontend: fuse\n"
                   f"  swap_priority: 77\n  datapath: {datapath}\n"
                   + (f"  request_priority: {request_priority}\n" if request_priority else ""))
    cg = proc = None
    try:
        r = _cli("--config", str(cfg), "up")
        assert r.returncode == 0, r.stderr
        assert "FUSE file" in r.stdout
        time.sleep(1.0)  # the up process is gone; the server must not follow it
        r = _cli("--config", str(cfg), "status", "--json")
        st = json.loads(r.stdout)
        assert st["attached"] and st["state"]["frontend"] == "fuse", r.stdout
        assert st["nbdfuse"] is None and st["mount"]["mounted"]
        expected = "native" if native.available() else "python"
        assert st["server"]["datapath"] == expected, r.stdout
        table = _cli("--config", str(cfg), "status", "-o", "NAME,DATAPATH", "--raw", "-n").stdout
        assert expected in table
        # device.request_priority (normal by default): realtime puts the native path's FUSE
        # workers at SCHED_FIFO (datapath.priority); the Python path's stay normal
        wanted = "realtime" if expected == "native" and request_priority == "realtime" else "normal"
        assert st["server"]["request_priority"] == wanted, r.stdout
        assert _fifo_threads(st["server"]["pid"]) == (4 if wanted == "realtime" else 0)
        checks = json.loads(_cli("--config", str(cfg), "doctor", "--json").stdout)["checks"]
        assert [c["status"] for c in checks if c["name"] == "request priority"] == ["pass"]

        cg, proc = squeezed_workload(f"azt-fusecli-{os.getpid()}", HEAP_WORKLOAD, ["96"],
                                     limit=32 * MiB, swapped=48 * MiB)
        proc.stdin.write("VERIFY\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "OK"  # every byte back through swap
        assert cg.oom_kills() == 0
        stop_workload(proc, cg)
        proc = cg = None
        stats = json.loads(_cli("--config", str(cfg), "stats", "--json").stdout)
        door = stats["server"]["fuse"]
        assert door["writes"] > 0 and door["reads"] > 0 and door["errors"] == 0
        served = stats["server"]["datapath"]
        assert served["path"] == expected
        if expected == "native":  # swap-outs stored and swap-ins answered without Python
            assert served["native_pages_read"] > 0 and served["native_reply_errors"] == 0
            assert served["native_writes_served"] and served["native_pages_written"] > 0
            assert stats["writes"] >= served["native_writes"] > 0
        r = _cli("--config", str(cfg), "down")
        assert r.returncode == 0, r.stderr
        assert "detached" in r.stdout
    finally:
        stop_workload(proc, cg)
        left = leave_nothing(run_dir)
    assert left == []
    assert [a for a in procfs.swaps() if "loop" in a.filename] == []


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.skipif(not os.path.exists("/usr/include/fuse3/fuse_lowlevel.h"),
                    reason="libfuse3-dev missing")
def test_c_floor_serves_what_it_is_given(tmp_path, mnt):
    """bench/harness/fusefloor.c (the benchmarks' floor) is a correct file server, or its
    figure would mean nothing."""
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from bench.harness.floor import build_floor

    exe = build_floor(str(tmp_path))
    proc = subprocess.Popen([exe, mnt, str(MiB)], stdin=subprocess.DEVNULL)
    try:
        path = os.path.join(mnt, "device")
        deadline = time.monotonic() + 20
        while not os.path.exists(path) and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            data = os.urandom(2 * PAGE)
            os.pwritev(fd, [aligned(data)], 3 * PAGE)
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 4 * PAGE, PAGE)
            out = mmap.mmap(-1, 2 * PAGE)
            assert os.preadv(fd, [out], 3 * PAGE) == 2 * PAGE
            assert out[:] == data[:PAGE] + bytes(PAGE)
        finally:
            os.close(fd)
    finally:
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", mnt], check=False)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and not mounted(mnt)
