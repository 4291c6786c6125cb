"""The disk tier: compressed blobs in one file, with its own free-space map.

Space is handed out in 64-byte steps (ALLOC_STEP) from free extents (best fit; neighbours coalesce on
free) or from the end of the file, which grows with fallocate so that a full filesystem
is found before any data is written. Swap content does not outlive the server, so the
file starts empty every time.

The file's page cache would hold a second, uncompressed-on-disk copy of what we just
demoted, in memory: after each batch of writes the cached pages are written back and
dropped (fdatasync + POSIX_FADV_DONTNEED); reads drop what they pulled in.
"""

from __future__ import annotations

import errno
import fcntl
import os

from sortedcontainers import SortedDict, SortedList

ALLOC_STEP = 64  # bytes: extents are whole steps
_GROW_STEP = 1 << 20


class DiskFull(Exception):
    """The file cannot grow: its size cap or the filesystem is full."""


class DiskError(Exception):
    """Reading or writing the file failed (I/O error); the blob's data is unreachable."""


def _round(n: int) -> int:
    return -(-n // ALLOC_STEP) * ALLOC_STEP


class DiskTier:
    def __init__(self, path: str, max_size: int = 0) -> None:
        self.path = path
        self.max_size = max_size  # 0: as large as the filesystem allows
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # Two servers on one file would overwrite each other's pages.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DiskError(f"{path} is in use by another agentzip server (pool.swap_out_path)") from None
        os.ftruncate(self._fd, 0)
        self._by_offset: SortedDict = SortedDict()  # offset -> length of free extents
        self._by_size: SortedList = SortedList()  # (length, offset) for best fit
        self.end = 0  # bytes handed out from the start of the file
        self.file_size = 0  # bytes fallocated
        self.live_bytes = 0  # sum of allocated extents
        self.reads = 0
        self.writes = 0
        self._dirty = False

    # -- space -----------------------------------------------------------------------

    def alloc(self, length: int) -> int:
        need = _round(length)
        i = self._by_size.bisect_left((need, -1))
        if i < len(self._by_size):
            size, offset = self._by_size.pop(i)
            del self._by_offset[offset]
            if size > need:
                self._add_free(offset + need, size - need)
        else:
            offset = self.end
            self._grow_to(self.end + need)
            self.end += need
        self.live_bytes += need
        return offset

    def free(self, offset: int, length: int) -> None:
        size = _round(length)
        self.live_bytes -= size
        # Coalesce with the free neighbours on either side.
        i = self._by_offset.bisect_left(offset)
        if i > 0:
            prev_off = self._by_offset.keys()[i - 1]
            prev_len = self._by_offset[prev_off]
            if prev_off + prev_len == offset:
                self._remove_free(prev_off)
                offset, size = prev_off, size + prev_len
        nxt = offset + size
        if nxt in self._by_offset:
            size += self._remove_free(nxt)
        if offset + size == self.end:
            self.end = offset  # give the tail back rather than keep it as a free extent
        else:
            self._add_free(offset, size)

    def _add_free(self, offset: int, size: int) -> None:
        self._by_offset[offset] = size
        self._by_size.add((size, offset))

    def _remove_free(self, offset: int) -> int:
        size = self._by_offset.pop(offset)
        self._by_size.remove((size, offset))
        return size

    def _grow_to(self, end: int) -> None:
        if self.max_size and end > self.max_size:
            raise DiskFull(f"disk tier {self.path} at its cap of {self.max_size} bytes")
        if end <= self.file_size:
            return
        new_size = max(end, self.file_size + _GROW_STEP)
        if self.max_size:
            new_size = min(new_size, self.max_size)
        try:
            os.posix_fallocate(self._fd, self.file_size, new_size - self.file_size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFull(f"disk tier {self.path}: {exc.strerror}") from None
            raise DiskError(f"disk tier {self.path}: {exc.strerror}") from None
        self.file_size = new_size

    # -- data ------------------------------------------------------------------------

    def write(self, offset: int, data) -> None:
        try:
            written = os.pwrite(self._fd, data, offset)
        except OSError as exc:
            raise DiskError(f"write to {self.path} at {offset}: {exc.strerror}") from None
        if written != len(data):
            raise DiskError(f"short write to {self.path} at {offset}")
        self.writes += 1
        self._dirty = True

    def read(self, offset: int, length: int) -> bytes:
        try:
            data = os.pread(self._fd, length, offset)
        except OSError as exc:
            raise DiskError(f"read from {self.path} at {offset}: {exc.strerror}") from None
        if len(data) != length:
            raise DiskError(f"short read from {self.path} at {offset}")
        self.reads += 1
        self._drop_cache(offset, length)
        return data

    def drop_cache(self) -> None:
        """Write back and drop the file's cached pages (after a batch of writes)."""
        if self._dirty:
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                raise DiskError(f"fdatasync {self.path}: {exc.strerror}") from None
            self._dirty = False
            self._drop_cache(0, 0)

    def _drop_cache(self, offset: int, length: int) -> None:
        if not self._dirty:
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def meta_bytes(self) -> int:
        # A SortedDict entry plus a SortedList tuple: ~150 bytes per free extent.
        return 150 * len(self._by_offset)

    def close(self) -> None:
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
