"""Walk the swappable pages of live processes through /proc/PID/{maps,pagemap,mem}.

Standard library only: the workloads import it, and a workload must not grow its own heap
(numpy, the project) just to look at it. Used for

- the TOUCH of the workload protocol (``touch``): read every page a process has in RAM or in
  swap, so that what was swapped out comes back; the timed part of a swap-in;
- the bench's swap-in latency probe (``probe``): fault single pages back one at a time and
  time each read, or time the same read on resident pages for the baseline.

What swap can take from a process is its private memory that no file backs: anonymous
mappings, and the copied-on-write pages of private file mappings. ``pagemap`` tells per
virtual page: bit 63 present, bit 62 in swap, bit 61 file page or shared anonymous. A page
is ours when it is in swap, or present and not a file page. Shared mappings (shmem, memfd)
are left out: pagemap cannot tell which of their pages are in swap, and reading a hole of
one would allocate it. Reads go through ``/proc/PID/mem`` (allowed on ourselves and, as root
or as an ancestor, on the process tree we started), which faults swapped pages in exactly
as the owner's own access would.
"""

from __future__ import annotations

import os
import random
import time
from array import array

PAGE = os.sysconf("SC_PAGE_SIZE")
PRESENT = 1 << 63
SWAPPED = 1 << 62
FILE_OR_SHARED = 1 << 61
_RUN_PAGES = 256  # one pread covers at most 1 MiB of adjacent pages
_SPECIAL = ("[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]", "[uprobes]")


def private_spans(pid: int | str = "self") -> list[tuple[int, int]]:
    """(start, end) of the readable private mappings of *pid* that can hold swappable pages."""
    spans = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 5:
                    continue
                perms = parts[1]
                name = parts[5].strip() if len(parts) > 5 else ""
                if perms[0] != "r" or perms[3] != "p" or name in _SPECIAL:
                    continue
                lo, _, hi = parts[0].partition("-")
                spans.append((int(lo, 16), int(hi, 16)))
    except (FileNotFoundError, ProcessLookupError):
        return []  # exited meanwhile
    return spans


def swappable_pages(pid: int | str = "self", *, swapped_only: bool = False,
                    resident_only: bool = False) -> list[int]:
    """Addresses of *pid*'s pages that are in swap or are resident anonymous memory."""
    out: list[int] = []
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return out
    try:
        for lo, hi in private_spans(pid):
            try:
                raw = os.pread(fd, (hi - lo) // PAGE * 8, lo // PAGE * 8)
            except OSError:
                continue
            entries = array("Q")
            entries.frombytes(raw[: len(raw) // 8 * 8])
            for i, e in enumerate(entries):
                if not e:
                    continue
                if e & SWAPPED:
                    if not resident_only:
                        out.append(lo + i * PAGE)
                elif e & PRESENT and not e & FILE_OR_SHARED and not swapped_only:
                    out.append(lo + i * PAGE)
    finally:
        os.close(fd)
    return out


def _runs(addrs: list[int]):
    """(first address, pages) of each run of adjacent pages, capped at _RUN_PAGES."""
    i, n = 0, len(addrs)
    while i < n:
        j = i + 1
        while j < n and j - i < _RUN_PAGES and addrs[j] == addrs[j - 1] + PAGE:
            j += 1
        yield addrs[i], j - i
        i = j


def touch(pids=("self",)) -> tuple[int, float]:
    """Read every swappable page of each of *pids*; returns (pages read, seconds)."""
    t = time.monotonic()
    pages = 0
    for pid in pids:
        addrs = swappable_pages(pid)
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError):
            continue
        try:
            for addr, n in _runs(addrs):
                try:
                    pages += len(os.pread(fd, n * PAGE, addr)) // PAGE
                except OSError:
                    pass  # unmapped since pagemap was read
        finally:
            os.close(fd)
    return pages, time.monotonic() - t


def probe(pids, samples: int, *, swapped: bool = True, seed: int = 0) -> list[int]:
    """Nanoseconds of each of up to *samples* single-page reads, one page at a time.

    ``swapped``: pages now in swap (each read is a swap-in, with whatever readahead the kernel
    does, as a process would see it); else resident anonymous pages (the baseline: the cost of
    the read path alone). Pages are drawn at random across all *pids*, seeded.
    """
    pool = [(pid, a) for pid in pids
            for a in swappable_pages(pid, swapped_only=swapped, resident_only=not swapped)]
    rng = random.Random(seed)
    pick = rng.sample(pool, min(samples, len(pool)))
    fds: dict = {}
    out = []
    try:
        for pid, addr in pick:
            if pid not in fds:
                try:
                    fds[pid] = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
                except (FileNotFoundError, ProcessLookupError):
                    fds[pid] = None
            fd = fds[pid]
            if fd is None:
                continue
            t = time.perf_counter_ns()
            try:
                os.pread(fd, 1, addr)
            except OSError:
                continue
            out.append(time.perf_counter_ns() - t)
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    return out


def descendants(pid: int) -> list[int]:
    """*pid*'s child processes, their children, and so on (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def rss_bytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def pss_bytes(pid: int | str = "self") -> int:
    """Proportional set size: shared pages split among their users (a tree's sum is honest)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss_bytes(pid)
