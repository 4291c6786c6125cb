"""The FUSE front door: one regular file served straight from the store, by the server process.

Where the kernel has no nbd driver, the swap device is a loop device (``--direct-io=on``)
over a file. This module serves that file from the process that holds the store: no nbdfuse
process, no NBD hop. It speaks the kernel's FUSE protocol on ``/dev/fuse`` itself, in pure
Python (BENCHMARKS.md, "Front doors"), because:

- neither binding Debian ships implements ``fallocate``: python3-llfuse 1.4 (libfuse 2) and
  python3-pyfuse3 3.2 (libfuse 3) have no such operation, so the loop device's discards
  (``FALLOC_FL_PUNCH_HOLE``) would fail with EOPNOTSUPP and the store would keep every page
  the kernel freed;
- libfuse's loops install signal handlers (llfuse unless told not to; pyfuse3 runs trio)
  and llfuse runs every handler under one global lock;
- a single file needs a dozen opcodes, and the measured round trip of this loop is close to
  the C floor (tools/bench_frontdoor.py, BENCHMARKS.md "Front doors").

Threads: ``threads`` workers read the one /dev/fuse descriptor (non-blocking; each waits in
an epoll set of its own while the queue is empty, see "Pause" below); the kernel hands each
request to one of them. They release the GIL in read/write and call the backend:
in the server, `datapath.server.Server`, the request path the nbdkit plugin calls too (its
latency histograms, per-thread protection; the store has its own lock). With the native path
(`datapath.native`) a worker's read(2) happens in C, which serves what it can and hands the
rest up here. No signal handler is installed; nothing here touches signals.

Unmount (``fusermount3 -u`` or ``umount``) ends the connection: every worker's read then
fails with ENODEV and the workers exit. ``stop`` unmounts lazily if still mounted and
aborts the connection (``/sys/fs/fuse/connections/N/abort``) if workers linger.

Pause and handover (a restart, docs/ARCHITECTURE.md "Restart"): the descriptor is
non-blocking and each worker waits in an epoll set of its own that holds it (EPOLLEXCLUSIVE:
a request wakes one worker) and a wake eventfd. ``pause`` sets a stop byte and rings the
eventfd: every worker finishes the request it has read and takes no other, and the requests
the kernel sends meanwhile wait in its queue. ``resume`` starts the workers again; ``adopt``
serves a descriptor another server process mounted (received over SCM_RIGHTS), without
mounting or INIT: the connection, the mount, the loop device over the file and the swap area
never change.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import select
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..errors import errno_of
from . import priority

log = logging.getLogger(__name__)

__all__ = ["Backend", "FuseFile", "FuseStats", "FuseError", "mount_fuse", "unmount"]

# -- protocol constants (linux/fuse.h) ------------------------------------------------------

FUSE_KERNEL_VERSION = 7
FUSE_MINOR = 31  # what we speak: 7.28 added max_pages; nothing later is needed here

LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
OPEN, READ, WRITE, STATFS, RELEASE = 14, 15, 16, 17, 18
FSYNC, GETXATTR, LISTXATTR, FLUSH, INIT = 20, 22, 23, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 27, 28, 29, 30
ACCESS, INTERRUPT, DESTROY, BATCH_FORGET, FALLOCATE = 34, 36, 38, 42, 43
LSEEK = 46

FUSE_ASYNC_READ = 1 << 0
FUSE_BIG_WRITES = 1 << 5
FUSE_ASYNC_DIO = 1 << 15  # a loop device's concurrent direct I/O stays concurrent
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_MAX_PAGES = 1 << 22
WANTED_FLAGS = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_PARALLEL_DIROPS | \
    FUSE_MAX_PAGES

FUSE_NOTIFY_RESEND = 7  # a notification's code goes where a reply's error does
FOPEN_DIRECT_IO = 1 << 0  # no page cache for this file, whoever opens it

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

ROOT_ID = 1
FILE_ID = 2
MAX_IO = 1 << 20  # max_write/max_read: 256 pages per request
# The loop device's direct I/O are background requests, and past max_background the loop
# worker sleeps with reads behind it (docs/ARCHITECTURE.md "Reads before writes"). The loop
# device has at most 128 requests in flight, two FUSE requests of MAX_IO each: 512 is never
# the limit; 64 was, at 16 sandboxes.
MAX_BACKGROUND = 512
CONGESTION_THRESHOLD = MAX_BACKGROUND * 3 // 4  # unused by the kernels we run on; kept in ratio
PAGE = 4096

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
ARG = IN_HEADER.size  # where a request's own arguments start
OUT_HEADER = struct.Struct("<IiQ")        # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT = struct.Struct("<QQQQII")      # + ATTR
ATTR_OUT = struct.Struct("<QII")          # + ATTR
OPEN_OUT = struct.Struct("<QII")
RW_IN = struct.Struct("<QQIIQII")         # fuse_read_in / fuse_write_in (40 bytes)
WRITE_OUT = struct.Struct("<II")
FALLOCATE_IN = struct.Struct("<QQQII")
INIT_IN = struct.Struct("<IIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")  # 64 bytes
KSTATFS = struct.Struct("<QQQQQIIII6I")
DIRENT = struct.Struct("<QQII")
LSEEK_IN = struct.Struct("<QQII")
LSEEK_OUT = struct.Struct("<Q")
VALID_S = 365 * 24 * 3600  # attributes never change: cache them for a year

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class FuseError(OSError):
    """Mounting or serving failed."""


class NativeServe(Protocol):
    """The native request path's loop (datapath.native.NativePath.serve)."""

    def serve(self, fd: int, rbuf, wbuf, epfd: int = -1, stop=None) -> int: ...
    def serve_writes(self, fd: int, rbuf, wbuf, stop) -> int | None: ...
    def counters(self) -> dict: ...


class Backend(Protocol):
    """What the front door serves: the request interface of `datapath.server.Server` (the
    one the nbdkit plugin calls). A failed call's exception becomes its errno
    (errors.errno_of)."""

    def pread(self, buf, offset: int) -> None: ...
    def pwrite(self, buf, offset: int) -> None: ...
    def trim(self, offset: int, length: int) -> None: ...
    def zero(self, offset: int, length: int) -> None: ...
    def flush(self) -> None: ...


@dataclass
class FuseStats:
    reads: int = 0
    writes: int = 0
    trims: int = 0
    errors: int = 0
    last_error: str | None = None
    kernel_minor: int = 0
    flags: int = 0
    threads: list[int] = field(default_factory=list)
    priority_refused: str | None = None  # why device.request_priority: realtime was not had


@dataclass
class _Worker:
    """One worker's descriptor and buffers, made once: a request is read into `rbuf` and a
    read's reply built in `wbuf` (the views slice them without copies)."""
    fd: int
    rbuf: bytearray
    rview: memoryview
    wbuf: bytearray
    wview: memoryview


# -- mounting ---------------------------------------------------------------------------------

def mount_fuse(mountpoint: str, fd: int, *, max_read: int = MAX_IO,
               fsname: str = "agentzip") -> None:
    """mount(2) a FUSE file system on ``mountpoint`` served through ``fd`` (root only).

    ``default_permissions`` makes the kernel check the 0600 root-owned modes we report, so
    ``allow_other`` (root's loop device opens it from another context) admits nobody else.
    """
    opts = (f"fd={fd},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other,"
            f"max_read={max_read}")
    rc = _libc.mount(fsname.encode(), os.fsencode(mountpoint), f"fuse.{fsname}".encode(),
                     MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise FuseError(err, f"mount fuse on {mountpoint}: {os.strerror(err)}")


def unmount(mountpoint: str, lazy: bool = False) -> bool:
    """umount2(2); True when it was unmounted by this call."""
    rc = _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0)
    return rc == 0


def _is_mountpoint(path: str) -> bool:
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8",
                                            errors="surrogateescape") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and parts[4].replace("\\040", " ") == real:
                return True
    return False


# -- the file system ----------------------------------------------------------------------------

class FuseFile:
    """Serve ``name`` (``size`` bytes, mode 0600) at ``mountpoint`` from ``backend``.

    ``on_thread`` runs once in each worker before it serves (e.g. the server's per-thread
    PR_SET_IO_FLUSHER). Requests are dispatched by opcode through a table (`_handlers`);
    an opcode it does not name is answered ENOSYS.
    """

    def __init__(self, mountpoint: str, size: int, backend: Backend, *, name: str = "device",
                 threads: int = 4, on_thread: Callable[[], None] | None = None,
                 direct_io: bool = True, native: NativeServe | None = None,
                 request_priority: str = priority.NORMAL) -> None:
        if size <= 0 or size % PAGE:
            raise ValueError(f"size {size} is not a positive multiple of {PAGE}")
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"bad file name {name!r}")
        self.mountpoint = os.path.abspath(mountpoint)
        self.path = os.path.join(self.mountpoint, name)
        self.size = size
        self.backend = backend
        self.name = name.encode()
        self.threads = max(1, int(threads))
        self.on_thread = on_thread
        self.open_flags = FOPEN_DIRECT_IO if direct_io else 0
        # datapath.native.NativePath: reads requests itself and hands up what it does not serve
        self.native = native
        # datapath.priority: the workers' class while they serve the native path's reads
        self.request_priority = request_priority
        self.stats = FuseStats()
        self._stats_lock = threading.Lock()  # workers count concurrently
        self._fd: int | None = None
        self._workers: list[threading.Thread] = []
        self._conn: int | None = None  # /sys/fs/fuse/connections/N
        self._stopping = False
        self._stop = bytearray(1)  # workers take no new request while set (pause)
        self._wake: int | None = None  # an eventfd each worker's epoll set holds
        self._inited = threading.Event()
        self._handed_over = False  # the descriptor went to the next server: only close ours
        now = int(time.time())
        self._file_attr = ATTR.pack(FILE_ID, size, size // 512, now, now, now, 0, 0, 0,
                                    stat.S_IFREG | 0o600, 1, 0, 0, 0, PAGE, 0)
        self._root_attr = ATTR.pack(ROOT_ID, 0, 0, now, now, now, 0, 0, 0,
                                    stat.S_IFDIR | 0o700, 2, 0, 0, 0, PAGE, 0)
        # opcode -> handler(worker, unique, nodeid, request length)
        self._handlers: dict[int, Callable[[_Worker, int, int, int], None]] = {
            READ: self._read, WRITE: self._write, FALLOCATE: self._fallocate,
            GETATTR: self._getattr, LOOKUP: self._lookup,
            # no reply expected (an interrupted request still gets its answer)
            FORGET: self._no_reply, BATCH_FORGET: self._no_reply, INTERRUPT: self._no_reply,
            OPEN: self._open, OPENDIR: self._opendir,
            RELEASE: self._ok, RELEASEDIR: self._ok, ACCESS: self._ok, FSYNCDIR: self._ok,
            DESTROY: self._ok,
            FLUSH: self._flush, FSYNC: self._flush,
            SETATTR: self._setattr, READDIR: self._readdir, STATFS: self._statfs,
            LSEEK: self._lseek, INIT: self._init,
        }

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Mount and start the workers; returns once the kernel's INIT is answered."""
        if _is_mountpoint(self.mountpoint):
            raise FuseError(errno.EBUSY, f"{self.mountpoint} is already a mount point")
        os.makedirs(self.mountpoint, mode=0o700, exist_ok=True)
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            mount_fuse(self.mountpoint, fd)
        except BaseException:
            os.close(fd)
            raise
        self._serve_fd(fd)
        # the kernel sends INIT right after mount(2); a stat() waits for its answer
        st = os.stat(self.mountpoint)
        self._conn = (os.major(st.st_dev) << 20) | os.minor(st.st_dev)  # the kernel's s_dev
        if not self._inited.wait(10.0):
            self.stop()
            raise FuseError(errno.ETIMEDOUT, f"FUSE INIT on {self.mountpoint} not answered")

    def adopt(self, fd: int, conn: int | None = None) -> None:
        """Serve the /dev/fuse descriptor ``fd`` of a connection another process mounted
        and initialised (a restart's handover): no mount, no INIT. ``fd`` is ours to close."""
        self._inited.set()
        self._conn = conn
        self._serve_fd(fd)

    def _serve_fd(self, fd: int) -> None:
        os.set_blocking(fd, False)  # workers wait in epoll, so that a pause can wake them
        self._fd = fd
        if self._wake is None:
            self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._start_workers()

    def _start_workers(self) -> None:
        self._stop[0] = 0
        self._workers = []
        for i in range(self.threads):
            t = threading.Thread(target=self._worker, name=f"agentzip-fuse-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        for i in range(WRITERS if self.native is not None else 0):  # the write queue's
            t = threading.Thread(target=self._writer, name=f"agentzip-fuse-writer-{i}",
                                 daemon=True)
            t.start()
            self._workers.append(t)

    def pause(self, timeout: float = 10.0) -> None:
        """Finish the requests read and take no new one (they wait in the kernel's queue).
        Raises FuseError when a worker is still busy after ``timeout`` (then resume)."""
        self._stop[0] = 1
        os.eventfd_write(self._wake, 1)
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._workers):
            raise FuseError(errno.EBUSY, f"a FUSE worker is still busy after {timeout:g} s")

    def resume(self) -> None:
        """Serve again after ``pause`` (a handover that failed)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake)
        self._start_workers()

    @property
    def descriptor(self) -> int | None:
        """The /dev/fuse descriptor (for a handover, after ``pause``)."""
        return self._fd

    def hand_over(self) -> None:
        """The next server serves the connection now: from here on this object only closes
        what it holds, and ``stop`` neither unmounts nor aborts."""
        self._conn = None
        self._handed_over = True

    def resend(self) -> None:
        """Ask the kernel to queue again every request a server read and did not answer
        (FUSE_NOTIFY_RESEND, Linux 6.9): after a crash, what the dead server had taken.
        An older kernel refuses it (ENOSYS, EINVAL): those requests then wait for ever, so
        say so in the log."""
        try:
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size, FUSE_NOTIFY_RESEND, 0))
        except OSError as exc:
            print(f"agentzip: FUSE_NOTIFY_RESEND refused ({exc}): requests the dead server "
                  f"had read are lost", file=sys.stderr, flush=True)

    @property
    def connection(self) -> int | None:
        """The kernel's id of the connection (/sys/fs/fuse/connections/N)."""
        return self._conn

    def stop(self, timeout: float = 5.0) -> None:
        """Unmount (lazily when busy) and wait for the workers; abort the connection if they
        do not end. Safe to call twice and after an external unmount."""
        self._stopping = True
        if self._fd is None:
            return
        if self._handed_over:
            self._close_own()
            return
        if _is_mountpoint(self.mountpoint) and not unmount(self.mountpoint):
            unmount(self.mountpoint, lazy=True)
        # the writers end only on the stop byte (their queue has no end of file); the
        # workers end on it too, or on ENODEV
        self._stop[0] = 1
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake, 1)
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._workers):
            self.abort()
            for t in self._workers:
                t.join(1.0)
        self._close_own()

    def _close_own(self) -> None:
        fd, self._fd = self._fd, None
        wake, self._wake = self._wake, None
        for f in (fd, wake):
            if f is not None:
                with contextlib.suppress(OSError):
                    os.close(f)

    def abort(self) -> None:
        """End the connection now (in-flight and future requests fail with ENOTCONN)."""
        if self._conn is None:
            return
        with contextlib.suppress(OSError), open(f"/sys/fs/fuse/connections/{self._conn}/abort",
                                                "w") as f:
            f.write("1")

    @property
    def priority_in_effect(self) -> str:
        """What the workers run at: realtime only on the native path, and where allowed."""
        if (self.native is None or self.request_priority != priority.REALTIME
                or self.stats.priority_refused is not None):
            return priority.NORMAL
        return priority.REALTIME

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._workers)

    # -- the worker loop -------------------------------------------------------------------

    def _thread_io(self) -> _Worker:
        """What a serving thread (worker or writer) runs first: `on_thread`, its buffers."""
        if self.on_thread is not None:
            try:
                self.on_thread()
            except Exception as exc:  # best effort (PR_SET_IO_FLUSHER needs a capability)
                log.debug("on_thread: %s", exc)
        rbuf = bytearray(MAX_IO + 2 * PAGE)
        wbuf = bytearray(OUT_HEADER.size + MAX_IO)
        return _Worker(self._fd, rbuf, memoryview(rbuf), wbuf, memoryview(wbuf))

    def _worker(self) -> None:
        io = self._thread_io()
        self.stats.threads.append(threading.get_native_id())
        fd = io.fd
        native = self.native
        realtime = False
        if native is not None and self.request_priority == priority.REALTIME:
            refused = priority.enter_realtime()
            realtime = refused is None
            if refused is not None and self.stats.priority_refused is None:
                self.stats.priority_refused = refused
                log.warning("device.request_priority: %s; the FUSE workers run at the normal "
                            "priority", refused)
        stop = self._stop
        ep = select.epoll()
        try:
            # EPOLLEXCLUSIVE: a request wakes one waiting worker; the wake eventfd wakes all
            ep.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
            ep.register(self._wake, select.EPOLLIN)
            self._serve_loop(io, ep, stop, native, realtime)
        finally:
            ep.close()

    def _writer(self) -> None:
        """Serves the writes the native workers queued (docs/ARCHITECTURE.md, "Reads before
        writes"), and those of them that need Python, until a pause has emptied the queue."""
        io = self._thread_io()
        while True:
            n = self.native.serve_writes(io.fd, io.rbuf, io.wbuf, self._stop)
            if n is None or n < 0:  # no native writes, or paused with the queue empty
                return
            self._dispatch_safely(io, n)

    def _serve_loop(self, io: _Worker, ep: select.epoll, stop: bytearray,
                    native: NativeServe | None, realtime: bool) -> None:
        fd, rbuf, wbuf = io.fd, io.rbuf, io.wbuf
        epfd = ep.fileno()
        while True:
            try:
                if stop[0]:
                    return
                if native is None:
                    n = os.readv(fd, [rbuf])
                else:
                    n = native.serve(fd, rbuf, wbuf, epfd, stop)
                    if n == -errno.ECANCELED:  # paused
                        return
                    if n < 0:
                        raise OSError(-n, os.strerror(-n))
                    if n == 0:  # end of file: not /dev/fuse, which never returns 0
                        return
            except BlockingIOError:  # the queue is empty: wait for a request or a pause
                ep.poll()
                continue
            except OSError as e:
                if e.errno == errno.ENODEV:  # unmounted: the connection is gone
                    return
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                if self._stopping or e.errno == errno.EBADF:
                    return
                log.error("read /dev/fuse: %s", e)
                self.stats.last_error = str(e)
                return
            if n < IN_HEADER.size:
                continue
            with priority.normal_priority(realtime):
                self._dispatch_safely(io, n)

    def _dispatch_safely(self, io: _Worker, n: int) -> None:
        try:
            self._dispatch(io, n)
        except Exception as exc:  # a bug here must not kill the worker
            self.stats.errors += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("FUSE request failed")
            unique = IN_HEADER.unpack_from(io.rbuf, 0)[2]
            self._reply_error(io.fd, unique, errno.EIO)

    def _reply(self, fd: int, unique: int, payload: bytes = b"") -> None:
        try:
            os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(payload), 0, unique) + payload)
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: the request was interrupted; fine
                raise

    def _reply_error(self, fd: int, unique: int, err: int) -> None:
        try:
            os.write(fd, OUT_HEADER.pack(OUT_HEADER.size, -err, unique))
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                raise

    def _fail(self, fd: int, unique: int, exc: BaseException) -> None:
        """A backend call failed: count it and answer its errno (errors.errno_of)."""
        with self._stats_lock:
            self.stats.errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        self._reply_error(fd, unique, errno_of(exc))

    def _dispatch(self, io: _Worker, n: int) -> None:
        opcode, unique, nodeid = IN_HEADER.unpack_from(io.rbuf, 0)[1:4]
        handler = self._handlers.get(opcode)
        if handler is None:
            return self._reply_error(io.fd, unique, errno.ENOSYS)
        return handler(io, unique, nodeid, n)

    # -- the opcodes (each: worker, unique, nodeid, request length) ---------------------

    def _read(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        _fh, offset, size = RW_IN.unpack_from(io.rbuf, ARG)[:3]
        if nodeid != FILE_ID:
            return self._reply_error(io.fd, unique, errno.EISDIR)
        size = max(0, min(size, self.size - offset, MAX_IO))
        try:
            if size:
                self.backend.pread(io.wview[OUT_HEADER.size:OUT_HEADER.size + size], offset)
        except Exception as exc:
            return self._fail(io.fd, unique, exc)
        # counted before the reply, as the native path counts: once the reply is written,
        # the client may ask for the stats (a test saw `reads` one behind `latency`)
        with self._stats_lock:
            self.stats.reads += 1
        OUT_HEADER.pack_into(io.wbuf, 0, OUT_HEADER.size + size, 0, unique)
        try:
            os.write(io.fd, io.wview[:OUT_HEADER.size + size])
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        return None

    def _write(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        _fh, offset, size = RW_IN.unpack_from(io.rbuf, ARG)[:3]
        data = ARG + RW_IN.size
        if nodeid != FILE_ID:
            return self._reply_error(io.fd, unique, errno.EISDIR)
        if offset + size > self.size:
            return self._reply_error(io.fd, unique, errno.ENOSPC)
        try:
            self.backend.pwrite(io.rview[data:data + size], offset)
        except Exception as exc:
            return self._fail(io.fd, unique, exc)
        with self._stats_lock:  # before the reply, as reads
            self.stats.writes += 1
        self._reply(io.fd, unique, WRITE_OUT.pack(size, 0))
        return None

    def _fallocate(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        """The loop device turns discards into PUNCH_HOLE|KEEP_SIZE and write-zeroes into
        ZERO_RANGE (or PUNCH_HOLE); both drop the pages. Plain allocation is a no-op."""
        _fh, offset, length, mode = FALLOCATE_IN.unpack_from(io.rbuf, ARG)[:4]
        fd = io.fd
        if nodeid != FILE_ID:
            return self._reply_error(fd, unique, errno.EISDIR)
        if offset + length > self.size:
            return self._reply_error(fd, unique, errno.EINVAL if mode else errno.ENOSPC)
        known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE
        if mode & ~known:
            return self._reply_error(fd, unique, errno.EOPNOTSUPP)
        try:
            if mode & FALLOC_FL_PUNCH_HOLE:
                self.backend.trim(offset, length)
            elif mode & FALLOC_FL_ZERO_RANGE:
                self.backend.zero(offset, length)
        except Exception as exc:
            return self._fail(fd, unique, exc)
        with self._stats_lock:
            self.stats.trims += 1
        return self._reply(fd, unique)

    def _flush(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        try:
            self.backend.flush()
        except Exception as exc:
            return self._fail(io.fd, unique, exc)
        return self._reply(io.fd, unique)

    def _getattr(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        attr = self._attr(nodeid)
        if attr is None:
            return self._reply_error(io.fd, unique, errno.ENOENT)
        return self._reply(io.fd, unique, ATTR_OUT.pack(VALID_S, 0, 0) + attr)

    def _lookup(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        name = bytes(io.rview[ARG:n]).split(b"\0", 1)[0]
        if nodeid != ROOT_ID or name != self.name:
            return self._reply_error(io.fd, unique, errno.ENOENT)
        return self._reply(io.fd, unique, ENTRY_OUT.pack(FILE_ID, 0, VALID_S, VALID_S, 0, 0)
                           + self._file_attr)

    def _no_reply(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        return None

    def _ok(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        return self._reply(io.fd, unique)

    def _open(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        return self._opened(io.fd, unique, nodeid, self.open_flags)

    def _opendir(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        return self._opened(io.fd, unique, nodeid, 0)

    def _opened(self, fd: int, unique: int, nodeid: int, flags: int) -> None:
        if self._attr(nodeid) is None:
            return self._reply_error(fd, unique, errno.ENOENT)
        return self._reply(fd, unique, OPEN_OUT.pack(nodeid, flags, 0))

    def _setattr(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        # the size is fixed and modes are ours; answer the attributes (truncate to the
        # same size, utimes and chmod are harmless no-ops)
        valid = struct.unpack_from("<I", io.rbuf, ARG)[0]
        new_size = struct.unpack_from("<Q", io.rbuf, ARG + 16)[0]
        if valid & (1 << 3) and new_size != self.size and nodeid == FILE_ID:  # FATTR_SIZE
            return self._reply_error(io.fd, unique, errno.EPERM)
        attr = self._attr(nodeid)
        if attr is None:
            return self._reply_error(io.fd, unique, errno.ENOENT)
        return self._reply(io.fd, unique, ATTR_OUT.pack(VALID_S, 0, 0) + attr)

    def _readdir(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        offset, size = RW_IN.unpack_from(io.rbuf, ARG)[1:3]
        return self._reply(io.fd, unique, self._dirents(offset, size))

    def _statfs(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        blocks = self.size // PAGE
        return self._reply(io.fd, unique, KSTATFS.pack(blocks, 0, 0, 2, 0, PAGE, 255, PAGE,
                                                       0, 0, 0, 0, 0, 0, 0))

    def _lseek(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        _fh, offset, whence = LSEEK_IN.unpack_from(io.rbuf, ARG)[:3]
        if whence == 3:  # SEEK_DATA: all of it is data
            if offset >= self.size:
                return self._reply_error(io.fd, unique, errno.ENXIO)
            return self._reply(io.fd, unique, LSEEK_OUT.pack(offset))
        if whence == 4:  # SEEK_HOLE
            return self._reply(io.fd, unique, LSEEK_OUT.pack(self.size))
        return self._reply_error(io.fd, unique, errno.EINVAL)

    def _attr(self, nodeid: int) -> bytes | None:
        if nodeid == FILE_ID:
            return self._file_attr
        if nodeid == ROOT_ID:
            return self._root_attr
        return None

    def _dirents(self, offset: int, size: int) -> bytes:
        entries = [(ROOT_ID, b".", 4), (ROOT_ID, b"..", 4), (FILE_ID, self.name, 8)]
        out = b""
        for i in range(offset, len(entries)):
            ino, name, kind = entries[i]
            rec = DIRENT.pack(ino, i + 1, len(name), kind) + name
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return out

    def _init(self, io: _Worker, unique: int, nodeid: int, n: int) -> None:
        fd = io.fd
        major, minor, max_readahead, kflags = INIT_IN.unpack_from(io.rbuf, ARG)
        if major != FUSE_KERNEL_VERSION:
            # an older/newer major: answer ours, the kernel then fails the mount cleanly
            return self._reply(fd, unique, INIT_OUT.pack(FUSE_KERNEL_VERSION, FUSE_MINOR,
                                                         0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                         *([0] * 7)))
        flags = kflags & WANTED_FLAGS
        self.stats.kernel_minor = minor
        self.stats.flags = flags
        self._reply(fd, unique, INIT_OUT.pack(
            FUSE_KERNEL_VERSION, min(minor, FUSE_MINOR), max_readahead, flags,
            MAX_BACKGROUND, CONGESTION_THRESHOLD,
            MAX_IO, 1,           # max_write, time_gran
            MAX_IO // PAGE, 0,   # max_pages, map_alignment
            0, *([0] * 7)))
        self._inited.set()


# -- the server's front door ---------------------------------------------------------------------

DEFAULT_THREADS = 4  # >1 so that a request's store call overlaps the next one's syscalls
# threads that store the writes the native workers queue ("Reads before writes"): at 16
# sandboxes one was busy all the time and the queue was full for a quarter of the writes
WRITERS = 2


def describe(door: FuseFile | None) -> dict | None:
    """For the control socket's stats: where the file is and what it served."""
    if door is None:
        return None
    s = door.stats
    native = door.native.counters() if door.native is not None else {}
    return {"file": door.path, "alive": door.alive, "threads": len(s.threads),
            "reads": s.reads + native.get("reads", 0),
            "writes": s.writes + native.get("writes", 0), "trims": s.trims, "errors": s.errors,
            "last_error": s.last_error, "kernel_minor": s.kernel_minor,
            "request_priority": door.priority_in_effect,
            "request_priority_refused": s.priority_refused}
