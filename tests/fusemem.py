"""A bytearray behind the FUSE door's request interface (datapath.fuse.Backend, what
datapath.server.Server is): the door's protocol tested without a store; and the mount
point the door's tests mount it on."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator


def mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def mount_point(prefix: str) -> Iterator[str]:
    """A fresh directory in /tmp to mount on; afterwards unmounted (lazily) if a test left
    it mounted, and removed."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    yield d
    if mounted(d):
        subprocess.run(["umount", "-l", d], check=False)
    shutil.rmtree(d, ignore_errors=True)


def kernel_max_background(mnt: str) -> int:
    """The max_background the kernel took for the FUSE mount on ``mnt``, from fusectl
    (mounted for the read if it is not, and unmounted again)."""
    conns = "/sys/fs/fuse/connections"
    ours = not mounted(conns)
    if ours:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", conns], check=True)
    try:
        dev = os.stat(mnt).st_dev
        assert os.major(dev) == 0  # an anonymous superblock: fusectl names it by its minor
        with open(os.path.join(conns, str(os.minor(dev)), "max_background")) as f:
            return int(f.read())
    finally:
        if ours:
            subprocess.run(["umount", conns], check=False)


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
