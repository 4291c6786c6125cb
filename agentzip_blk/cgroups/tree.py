"""Which kind of file system holds a cgroup hierarchy, and so how its control files are
written and how a cgroup directory is removed. Said by whoever names the hierarchy
(``fs.detect(root, tree=...)``, ``Ledger(run_dir, tree)``; for the command line
``cgroup_tree_of`` in cli/_common.py, from the hidden ``--cgroup-tree``) and carried from
there by the ``MemoryController``, its backend and the ledger; never inferred from a path:

- :class:`Cgroupfs`, the kernel's cgroup file systems (v1 ``cgroup``, v2 ``cgroup2``): a
  control file is never created (a missing one means a missing controller or a wrong path,
  and a created one would hide it), never opened through a symbolic link, and written only
  once the open file is known to lie on cgroupfs (fstatfs magic); a cgroup directory goes
  with a plain rmdir, which takes its control files with it.
- :class:`PlainTree`, a directory of plain files standing in for cgroupfs (the tests: the
  cgroup files these machines lack, also for the CLI run as its own process): control files
  are created on write, a cgroup's files unlinked before its rmdir, and nothing outside the
  directory is written.

Where a hierarchy is mounted says nothing about its kind: the host's cgroupfs seen under
/host (a container) is cgroupfs all the same, with every check.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from dataclasses import dataclass
from typing import Protocol

__all__ = ["CgroupTree", "Cgroupfs", "PlainTree", "CGROUPFS", "NotACgroupFile", "fs_magic"]

CGROUP_SUPER_MAGIC = 0x27E0EB  # cgroup v1 (linux/magic.h)
CGROUP2_SUPER_MAGIC = 0x63677270  # cgroup v2
CGROUP_MAGICS = (CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC)


class NotACgroupFile(OSError):
    """A path that is not a cgroup control file (a symbolic link, a file on another file
    system, outside a plain tree, a name the tuner does not write): never written."""


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.fstatfs.restype = ctypes.c_int


def fs_magic(fd: int) -> int:
    """f_type of the file system ``fd`` lies on (fstatfs(2); Python has no binding). f_type
    is the first member of struct statfs, a long (__fsword_t) on Linux."""
    buf = ctypes.create_string_buffer(256)  # sizeof(struct statfs) is 120 on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


class CgroupTree(Protocol):
    """How the control files of a cgroup hierarchy are written and its cgroups removed."""

    def write(self, path: str, value: str) -> None:
        """Write *value* to the control file *path* in one write() (cgroupfs takes each
        write as one command). OSError as the kernel answers; NotACgroupFile for a path
        that is not a control file of this tree."""
        ...

    def rmdir(self, path: str) -> None:
        """Remove the cgroup directory *path*; OSError as rmdir(2) (EBUSY while it has
        processes, ENOENT when it is gone)."""
        ...


def _open_control(path: str, flags: int) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | flags,
                       0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotACgroupFile(errno.ELOOP, "a symbolic link, not a cgroup file", path) from None
        raise


@dataclass(frozen=True)
class Cgroupfs:
    """The kernel's cgroup file systems: the real thing."""

    def write(self, path: str, value: str) -> None:
        # neither O_CREAT (a missing control file is an error to see, not to paper over) nor
        # O_TRUNC: the file system is checked after the open, and a file that turns out not
        # to be on cgroupfs must be left as it was
        fd = _open_control(path, 0)
        try:
            st = os.fstat(fd)
            magic = fs_magic(fd)
            if not stat.S_ISREG(st.st_mode) or magic not in CGROUP_MAGICS:
                raise NotACgroupFile(errno.EPERM, f"not on a cgroup file system (magic "
                                     f"{magic:#x})", path)
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)  # the kernel removes the control files with the directory


CGROUPFS = Cgroupfs()


@dataclass(frozen=True)
class PlainTree:
    """A directory of plain files standing in for cgroupfs (the tests' trees,
    tests/cgfake.py). Control files are created on write, as if the kernel had them."""

    top: str  # the directory the stand-in lives in (its /proc/mounts, its hierarchies)

    def write(self, path: str, value: str) -> None:
        # the stand-in for cgroupfs's magic check: a path that leaves the tree is no control
        # file of it (symbolic links: the last component, as on cgroupfs)
        top = os.path.abspath(self.top)
        if os.path.commonpath([top, os.path.abspath(path)]) != top:
            raise NotACgroupFile(errno.EPERM, f"outside the plain cgroup tree {self.top}", path)
        fd = _open_control(path, os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def rmdir(self, path: str) -> None:
        # plain files do not go with the directory as control files do
        for entry in os.scandir(path):
            if entry.is_file():
                os.unlink(entry.path)
        os.rmdir(path)
