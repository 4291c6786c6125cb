"""A bytearray behind the FUSE door's request interface (datapath.fuse.Backend, what
datapath.server.Server is): the door's protocol tested without a store."""

from __future__ import annotations


class Mem:
    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.reads = 0
        self.flushes = 0

    def pread(self, out, offset):
        self.reads += 1
        out[:] = self.buf[offset:offset + len(out)]

    def pwrite(self, data, offset):
        self.buf[offset:offset + len(data)] = data

    def trim(self, offset, length):
        self.buf[offset:offset + length] = bytes(length)

    zero = trim

    def flush(self):
        self.flushes += 1
