"""The store's own books in memory that outlives the process (issue 28: a crash of the server
loses nothing the store had committed).

The pool's arenas are one memfd already (store.pool). The books that say which page is
where live here: each is a numpy column on a memfd of its own, mapped MAP_SHARED, named
(`slot_kind`, `blob_cell`, ...). A process that holds the descriptors (the holder,
docs/ARCHITECTURE.md "The holder") keeps them alive when the server dies, and a new server
maps them and rebuilds everything else from them (store.recovery). Only what cannot be
derived is here: the slot table's kind, handle and sub, the blob table's rows, the
same-fill words, the disk tier's key, the dictionaries, and the one switch in flight
(`SWITCH`). Reference counts, the pool's free lists, the dedup index, the chunk books and
the counters are rebuilt.

A column grows in place (ftruncate, then a larger mapping of the same memfd): its holder
never needs a new descriptor for it, and what the old mapping wrote is what the new one
reads. `on_new` tells the holder about each new memfd (a column, a dictionary) before the
store uses it: the server sets it once the holder is connected (`attach`).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import mman

_PAGE = mmap.PAGESIZE
PREFIX = "agentzip-"  # every memfd's name starts so (/proc/PID/fd shows it)

# `switch`: a slot switched outside a request (the recompressor, a frame split), written
# before the slot's handle and sub and cleared after: a crash between the two stores leaves
# them half-switched, and recovery finishes the switch (the new blob is whole by then).
SWITCH_SLOT, SWITCH_HANDLE, SWITCH_SUB, SWITCH_ON = range(4)

# (name, fd, meta): a memfd the holder must keep from now on; (name): one it may let go
NewFn = Callable[[str, int, dict], None]
DropFn = Callable[[str], None]


@dataclass
class Column:
    name: str
    fd: int
    dtype: np.dtype
    width: int  # elements per row
    matrix: bool  # rows of `width` (2-D), or a plain column (1-D, width 1)
    rows: int
    map: mmap.mmap | None

    def meta(self) -> dict:
        return {"kind": "column", "dtype": self.dtype.str, "width": self.width,
                "matrix": self.matrix}


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class SharedTables:
    """Named columns on memfds of their own, and sealed blobs (the disk tier's key, the
    dictionaries). Descriptors are close-on-exec; they leave the process only through the
    holder's socket."""

    def __init__(self) -> None:
        self.columns: dict[str, Column] = {}
        self.blobs: dict[str, tuple[int, dict]] = {}
        self._lock = threading.Lock()
        self._on_new: NewFn | None = None
        self._on_drop: DropFn | None = None
        self._fds: list[int] = []
        weakref.finalize(self, _close_all, self._fds)

    # -- columns -----------------------------------------------------------------------

    def zeros(self, name: str, rows: int, dtype, width: int | None = None) -> np.ndarray:
        """A zero-filled column of `rows` elements, or with `width` a (rows, width) matrix,
        on a new memfd."""
        dtype = np.dtype(dtype)
        if name in self.columns:
            raise ValueError(f"column {name} exists")
        fd = os.memfd_create(PREFIX + name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._fds.append(fd)
        column = Column(name, fd, dtype, width or 1, width is not None, 0, None)
        array = self._map(column, rows)
        with self._lock:
            self.columns[name] = column
            if self._on_new is not None:
                self._on_new(name, fd, column.meta())
        return array

    def grow(self, name: str, rows: int) -> np.ndarray:
        """The column with room for `rows` rows: the same memfd, a larger mapping. The old
        array stays valid (another mapping of the same pages) until it is dropped."""
        column = self.columns[name]
        return self._map(column, max(rows, column.rows))

    def _map(self, column: Column, rows: int) -> np.ndarray:
        nbytes = rows * column.width * column.dtype.itemsize
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        if os.fstat(column.fd).st_size < size:
            os.ftruncate(column.fd, size)
        m = mmap.mmap(column.fd, size, flags=mmap.MAP_SHARED)
        # the books name no page content, but no core dump needs them either
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        mman.libc.madvise(address, size, mman.MADV_DONTDUMP)
        column.rows, column.map = rows, m
        array = np.frombuffer(m, dtype=column.dtype, count=rows * column.width)
        return array.reshape(rows, column.width) if column.matrix else array

    def punch_from(self, name: str, first_row: int) -> int:
        """Give back the whole pages of the column from row `first_row` on (they read as
        zeros afterwards): a shared mapping's MADV_DONTNEED frees nothing, the memfd keeps
        the pages until their range is punched. Returns the bytes given back."""
        column = self.columns[name]
        row = column.width * column.dtype.itemsize
        start = -(-first_row * row // _PAGE) * _PAGE
        end = column.rows * row // _PAGE * _PAGE
        if end <= start:
            return 0
        if mman.libc.fallocate(column.fd, mman.FALLOC_FL_PUNCH_HOLE | mman.FALLOC_FL_KEEP_SIZE, start,
                           end - start):
            return 0  # cannot: the pages stay (counted as they are)
        return end - start

    # -- sealed blobs ------------------------------------------------------------------

    def put_bytes(self, name: str, data: bytes, meta: dict) -> None:
        """`data` in a new memfd sealed against any change, kept under `name` (a second one
        of the same name replaces the first)."""
        fd = os.memfd_create(PREFIX + name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._fds.append(fd)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        meta = {"kind": "bytes", **meta}
        with self._lock:
            old = self.blobs.get(name)
            if self._on_new is not None:
                try:
                    self._on_new(name, fd, meta)
                except BaseException:
                    self._close(fd)
                    raise
            self.blobs[name] = (fd, meta)
            if old is not None:
                self._close(old[0])

    def drop(self, name: str) -> None:
        """Let go of a sealed blob (a dictionary no blob uses any more)."""
        with self._lock:
            old = self.blobs.pop(name, None)
            if old is None:
                return
            self._close(old[0])
            if self._on_drop is not None:
                self._on_drop(name)

    def _close(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.remove(fd)
            os.close(fd)

    # -- the holder ----------------------------------------------------------------------

    def attach(self, on_new: NewFn, on_drop: DropFn) -> None:
        """Call `on_new` for every memfd there is, then for each new one, and `on_drop` for
        each one let go, in order (one lock: none is missed between the two)."""
        with self._lock:
            for name, column in self.columns.items():
                on_new(name, column.fd, column.meta())
            for name, (fd, meta) in self.blobs.items():
                on_new(name, fd, meta)
            self._on_new, self._on_drop = on_new, on_drop

    def detach(self) -> None:
        with self._lock:
            self._on_new = self._on_drop = None

    def close(self) -> None:
        """Close every descriptor: the memory goes once no other process holds it."""
        with self._lock:
            self._on_new = self._on_drop = None
            for column in self.columns.values():
                column.map = None
            _close_all(self._fds)


def read_bytes(fd: int) -> bytes:
    """The whole content of a sealed blob's memfd."""
    size = os.fstat(fd).st_size
    out = bytearray()
    while len(out) < size:
        chunk = os.pread(fd, size - len(out), len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def map_column(fd: int, dtype: str, width: int, matrix: bool) -> np.ndarray:
    """A held column mapped read-only, whole (its rows: the memfd's size over a row)."""
    dt = np.dtype(dtype)
    if dt.kind not in "biuf" or dt.hasobject or width < 1:
        raise ValueError(f"a column of {dtype} x {width}: not plain numbers")
    size = os.fstat(fd).st_size
    row = dt.itemsize * width
    rows = size // row
    if not rows:
        return np.zeros((0, width) if matrix else 0, dtype=dt)
    m = mmap.mmap(fd, rows * row, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    array = np.frombuffer(m, dtype=dt, count=rows * width)
    return array.reshape(rows, width) if matrix else array
