"""The holder's pins on the store's memory (docs/ARCHITECTURE.md, "Recovery from a crash").

While a server runs, its mlockall(MCL_ONFAULT) keeps every page of the store it touched in
memory. When it dies, its mappings go and so do its locks: the pages of the pool and of the
books are then ordinary shmem pages, and reclaim may write them to swap, to our own device
among others. Such a write waits in the FUSE queue for a server, the page stays under
writeback, and the recovering server's first touch of it waits for that writeback: a
deadlock only an abort of the FUSE connection ends (seen on the .deb path).

So the holder maps every memfd it holds into a mapping locked on fault (its own
mlockall(MCL_FUTURE | MCL_ONFAULT), and mlock2(MLOCK_ONFAULT) besides, for a holder run
without it) and faults in the pages that are in memory and not yet mapped there (mincore and
/proc/self/pagemap): never a hole, which a read fault of shmem would fill with a new page,
and never a page in swap, whose swap-in could wait like the server's. Its lock then keeps
the page whoever else maps it or not. It does so every PERIOD while the server runs (the
server writes new pages; its own lock covers them meanwhile) and at once when it dies. A
memfd the holder no longer holds is unmapped, so that its memory can go.

What it costs: the holder's page tables (2 MiB per GiB pinned) and, per refresh, a look at
mincore and pagemap over the 128 MiB chunks that hold data (SEEK_DATA skips the rest)
(BENCHMARKS.md, "The holder's pins").
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import mman

PAGE = 4096
PERIOD = 5.0  # s between two refreshes while the server runs (each: BENCHMARKS.md, "The holder's pins")


@dataclass
class Pin:
    """One memfd mapped by the holder: (st_dev, st_ino) names it, whatever its descriptor."""
    address: int
    length: int


@dataclass
class Refresh:
    """What one refresh did: memfds pinned, the bytes they hold in memory, failures."""
    memfds: int = 0
    bytes: int = 0  # in memory (neither holes nor swapped out): pinned
    faulted: int = 0  # of which not yet mapped here: faulted in by this refresh
    unmapped: int = 0
    errors: list[str] = field(default_factory=list)


def is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False


_MAPPED = bytes(b >> 7 for b in range(256))  # pagemap: bit 63, the top byte's top bit
_RESIDENT = bytes(b & 1 for b in range(256))  # mincore: bit 0
_CHUNK = 1 << 15  # pages looked at per call: 128 MiB of address space


def chunks_with_data(fd: int, length: int) -> list[int]:
    """The first page of every _CHUNK-page chunk of the memfd's first ``length`` bytes that
    holds data (SEEK_DATA: a run of holes costs one call, where mincore would look up each of
    its pages; the pool's memfd is mostly holes past its highest arena)."""
    chunks: list[int] = []
    offset = 0
    while offset < length:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after offset
                break
            raise
        if data >= length:
            break
        first = data // PAGE // _CHUNK * _CHUNK
        chunks.append(first)
        offset = (first + _CHUNK) * PAGE
    return chunks


def to_fault(pagemap: int, address: int, length: int,
             chunks: Iterable[int]) -> tuple[list[tuple[int, int]], int]:
    """The runs [start, end) (offsets from ``address``) of pages of ``chunks`` that are in
    memory (mincore: data, neither a hole nor swapped out) and not yet mapped in our page
    tables (pagemap bit 63), and the count of pages in memory. Faulting in only these keeps a
    refresh cheap (a page already mapped costs as much to fault again as the walk that finds
    it) and never waits for a swap-in."""
    pages = length // PAGE
    vec = (ctypes.c_ubyte * min(pages, _CHUNK))()
    runs: list[tuple[int, int]] = []
    resident_pages = 0
    for first in chunks:
        n = min(_CHUNK, pages - first)
        if n <= 0:
            continue
        if mman.libc.mincore(address + first * PAGE, n * PAGE, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        resident = bytes(vec)[:n].translate(_RESIDENT)
        resident_pages += resident.count(1)
        raw = os.pread(pagemap, n * 8, (address // PAGE + first) * 8)
        mapped = raw[7::8].translate(_MAPPED)  # the top byte of each little-endian entry
        want = (int.from_bytes(resident, "big") & ~int.from_bytes(mapped, "big")).to_bytes(n, "big")
        i = 0
        while (j := want.find(1, i)) >= 0:
            k = want.find(0, j)
            k = n if k < 0 else k
            runs.append(((first + j) * PAGE, (first + k) * PAGE))
            i = k
    return runs, resident_pages


@dataclass
class Work:
    """What one refresh faults in for one memfd: its first ``length`` bytes in ``pin``, in
    the chunks that hold data; ``old``, the smaller mapping of a memfd grown since, goes once
    ``pin`` holds the pages."""
    pin: Pin
    length: int
    chunks: list[int]
    old: Pin | None = None


class Pins:
    """The holder's mappings of the memfds it holds. Not thread-safe: one thread refreshes.

    A refresh is a plan (fstat, mmap, SEEK_DATA: quick, done while the holder keeps the set from
    changing, so it needs no descriptor of its own) and a populate (the faults, done with no
    lock held: the mappings keep the memfds alive)."""

    def __init__(self) -> None:
        self.pins: dict[tuple[int, int], Pin] = {}

    def refresh(self, fds: Iterable[int]) -> Refresh:
        work, done = self.plan(fds)
        self.populate(work, done)
        return done

    def plan(self, fds: Iterable[int]) -> tuple[list[Work], Refresh]:
        """Map every memfd among ``fds`` not yet mapped (or grown); unmap what is pinned and
        no longer among them."""
        done = Refresh()
        work: list[Work] = []
        seen: set[tuple[int, int]] = set()
        for fd in fds:
            if not is_memfd(fd):  # /dev/fuse, the tier file: not shmem, never swapped
                continue
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                seen.add(key)
                length = -(-st.st_size // PAGE) * PAGE
                if length == 0:
                    continue
                old = self.pins.get(key)
                if old is None or old.length < length:  # new, or grown in place
                    pin = self.pins[key] = Pin(self.map(fd, length), length)
                else:
                    pin, old = old, None
                covered = min(length, pin.length)
                work.append(Work(pin, covered, chunks_with_data(fd, covered), old))
            except OSError as exc:
                done.errors.append(f"fd {fd}: {exc}")
        for key in [k for k in self.pins if k not in seen]:
            self.unmap(self.pins.pop(key))
            done.unmapped += 1
        return work, done

    def populate(self, work: list[Work], done: Refresh) -> None:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            for item in work:
                try:
                    runs, resident = to_fault(pagemap, item.pin.address, item.length,
                                              item.chunks)
                    done.bytes += resident * PAGE
                    for first, last in runs:
                        if mman.libc.madvise(item.pin.address + first, last - first,
                                             mman.MADV_POPULATE_READ) != 0:
                            err = ctypes.get_errno()
                            if err != errno.EFAULT:  # truncated meanwhile: nothing to keep
                                raise OSError(err, f"MADV_POPULATE_READ: {os.strerror(err)}")
                        done.faulted += last - first
                    done.memfds += 1
                except OSError as exc:
                    done.errors.append(str(exc))
                finally:
                    if item.old is not None:
                        self.unmap(item.old)
        finally:
            os.close(pagemap)

    @staticmethod
    def map(fd: int, length: int) -> int:
        address = mman.libc.mmap(None, length, mman.PROT_READ, mman.MAP_SHARED, fd, 0)
        if address in (None, mman.MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
        mman.libc.madvise(address, length, mman.MADV_DONTDUMP)  # every tenant's pages
        if mman.libc.mlock2(address, length, mman.MLOCK_ONFAULT) != 0:
            err = ctypes.get_errno()
            mman.libc.munmap(address, length)
            raise OSError(err, f"mlock2: {os.strerror(err)}")
        return address

    @staticmethod
    def unmap(pin: Pin) -> None:
        mman.libc.munmap(pin.address, pin.length)

    def close(self) -> None:
        for pin in self.pins.values():
            self.unmap(pin)
        self.pins.clear()
