"""Drive the native request path (datapath.native) without a FUSE mount.

The extension's loop reads whole requests from a descriptor and writes whole replies:
a SOCK_SEQPACKET socket pair keeps message boundaries as /dev/fuse does. `NativeRequests`
sends a READ or a WRITE and then a request the loop always hands up (GETATTR), so one
`serve` call answers the request natively (or hands it up) and returns; a handed-up request
is served by the Python path, as the FUSE door does.
"""

from __future__ import annotations

import socket
import struct
import threading

from agentzip_blk.datapath import native
from agentzip_blk.store import PageStore
from agentzip_blk.store.tiering import Tiering

PAGE = 4096
IN_HEADER = struct.Struct("<IIQQIIIHH")
RW_IN = struct.Struct("<QQIIQII")
OUT_HEADER = struct.Struct("<IiQ")
WRITE_OUT = struct.Struct("<II")
READ, WRITE, GETATTR, FILE_ID = 15, 16, 3, 2
MAX_REPLY = 16 * PAGE  # a seqpacket message must fit the socket buffer (~208 KiB)


def native_store(size: int = 16 << 20, **kw) -> PageStore:
    """A store with the native path's lock (what the server builds for datapath: native)."""
    lock = native.make_lock(native.Choice("native", "test"))
    tiering = kw.pop("tiering", None) or Tiering(max_size=kw.pop("max_size", 64 << 20))
    return PageStore(size, lock=lock, tiering=tiering, **kw)


def differing_pages(got: bytes, want: bytes, page: int = 4096) -> list[int]:
    """The pages (by index) where ``got`` and ``want`` differ, and "length" when their
    lengths do: a byte-for-byte check whose failure names the pages instead of printing
    megabytes of both sides."""
    out: list = [] if len(got) == len(want) else ["length"]
    mv_got, mv_want = memoryview(got), memoryview(want)
    for k in range(0, min(len(got), len(want)), page):
        if mv_got[k:k + page] != mv_want[k:k + page]:
            out.append(k // page)
    return out


def read_request(unique: int, offset: int, size: int, nodeid: int = FILE_ID) -> bytes:
    body = RW_IN.pack(0, offset, size, 0, 0, 0, 0)
    return IN_HEADER.pack(IN_HEADER.size + len(body), READ, unique, nodeid, 0, 0, 0, 0, 0) + body


def write_request(unique: int, offset: int, data: bytes, nodeid: int = FILE_ID) -> bytes:
    body = RW_IN.pack(0, offset, len(data), 0, 0, 0, 0) + data
    return IN_HEADER.pack(IN_HEADER.size + len(body), WRITE, unique, nodeid, 0, 0, 0, 0, 0) + body


def sentinel(unique: int) -> bytes:
    return IN_HEADER.pack(IN_HEADER.size + 16, GETATTR, unique, FILE_ID, 0, 0, 0, 0, 0) + bytes(16)


class NativeRequests:
    """store.readinto and store.write through the native loop: served natively where it
    can, else by Python. One instance per thread (its own socket pair and buffers)."""

    def __init__(self, store: PageStore, path: native.NativePath) -> None:
        self.store = store
        self.path = path
        self.ours, self.loop_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.rbuf = bytearray(MAX_REPLY + 2 * PAGE)
        self.wbuf = bytearray(OUT_HEADER.size + MAX_REPLY)
        self.unique = 0
        self.native = 0  # reads answered by the native path
        self.python = 0  # reads handed up
        self.native_writes = 0
        self.python_writes = 0

    def close(self) -> None:
        self.ours.close()
        self.loop_end.close()

    def readinto(self, buf, offset: int) -> None:
        out = memoryview(buf).cast("B")
        assert len(out) <= MAX_REPLY
        self.unique += 2
        self.ours.send(read_request(self.unique, offset, len(out)))
        self.ours.send(sentinel(self.unique + 1))
        n = self.path.serve(self.loop_end.fileno(), self.rbuf, self.wbuf)
        assert n > 0, n
        opcode, unique = IN_HEADER.unpack_from(self.rbuf, 0)[1:3]
        if opcode == READ:  # handed up: the Python path serves it; the sentinel is next
            assert unique == self.unique
            self.python += 1
            self.store.readinto(out, offset)
            n = self.path.serve(self.loop_end.fileno(), self.rbuf, self.wbuf)
            opcode, unique = IN_HEADER.unpack_from(self.rbuf, 0)[1:3]
            assert (opcode, unique) == (GETATTR, self.unique + 1)
            return
        assert (opcode, unique) == (GETATTR, self.unique + 1)
        reply = self.ours.recv(OUT_HEADER.size + MAX_REPLY)
        length, error, got = OUT_HEADER.unpack_from(reply, 0)
        assert (length, error, got) == (len(reply), 0, self.unique), (length, error, got)
        out[:] = reply[OUT_HEADER.size:]
        self.native += 1

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.readinto(buf, offset)
        return bytes(buf)

    def write(self, data, offset: int) -> None:
        data = bytes(data)
        assert len(data) <= MAX_REPLY
        self.unique += 2
        self.ours.send(write_request(self.unique, offset, data))
        self.ours.send(sentinel(self.unique + 1))
        n = self.path.serve(self.loop_end.fileno(), self.rbuf, self.wbuf)
        assert n > 0, n
        opcode, unique = IN_HEADER.unpack_from(self.rbuf, 0)[1:3]
        if opcode == WRITE:  # handed up, intact: the Python path serves it
            assert unique == self.unique
            assert bytes(self.rbuf[IN_HEADER.size + RW_IN.size:n]) == data
            self.python_writes += 1
            self.store.write(data, offset)
            n = self.path.serve(self.loop_end.fileno(), self.rbuf, self.wbuf)
            opcode, unique = IN_HEADER.unpack_from(self.rbuf, 0)[1:3]
            assert (opcode, unique) == (GETATTR, self.unique + 1)
            return
        assert (opcode, unique) == (GETATTR, self.unique + 1)
        reply = self.ours.recv(OUT_HEADER.size + MAX_REPLY)
        length, error, got = OUT_HEADER.unpack_from(reply, 0)
        assert (length, error, got) == (OUT_HEADER.size + WRITE_OUT.size, 0, self.unique)
        assert WRITE_OUT.unpack_from(reply, OUT_HEADER.size) == (len(data), 0)
        self.native_writes += 1


class PerThread:
    """A NativeRequests per calling thread."""

    def __init__(self, store: PageStore, path: native.NativePath) -> None:
        self.store, self.path = store, path
        self._local = threading.local()
        self.all: list[NativeRequests] = []
        self._lock = threading.Lock()

    def get(self) -> NativeRequests:
        reads = getattr(self._local, "reads", None)
        if reads is None:
            reads = self._local.reads = NativeRequests(self.store, self.path)
            with self._lock:
                self.all.append(reads)
        return reads

    def close(self) -> None:
        for reads in self.all:
            reads.close()
