"""Read a live process's resident anonymous pages, read-only: /proc/PID/maps + pagemap + mem.

What swap would take from a process is its private anonymous memory (heap, anonymous mmaps,
stacks). This module finds those pages without disturbing the process:

- ``maps`` lists the mappings; anonymous ones have no backing file (or a ``[heap]``,
  ``[stack]``, ``[anon:...]`` name) and are private and writable.
- ``pagemap`` has one 64-bit entry per virtual page: bit 63 present in RAM, bit 62 swapped,
  bit 61 file-backed or shared-anonymous. We keep present pages that are not bit 61.
  Swapped pages are skipped on purpose: reading them through ``mem`` would fault them back
  in, i.e. change the very thing being measured.
- ``mem`` is read with ``pread`` (root, or ptrace rights over the target). Runs of adjacent
  present pages are read with one call.

Nothing is written to the target and no signal is sent; the target keeps running, so a
page may change between pagemap and mem (harmless for sampling and estimates).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

PAGE = 4096
_PRESENT = np.uint64(1 << 63)
_SWAPPED = np.uint64(1 << 62)
_FILE_OR_SHARED = np.uint64(1 << 61)
_MAX_RUN = 256  # pages per pread: 1 MiB


class ProcMemError(OSError):
    """The process is gone, or we may not read its memory (the message says which)."""


@dataclass(frozen=True)
class Region:
    start: int
    end: int
    perms: str
    path: str

    @property
    def pages(self) -> int:
        return (self.end - self.start) // PAGE


def _is_anonymous(perms: str, path: str) -> bool:
    if len(perms) < 4 or perms[1] != "w" or perms[3] != "p":
        return False  # read-only or shared mappings are not swap's business (shmem is not ours)
    if not path:
        return True
    return path in ("[heap]", "[stack]") or path.startswith("[anon:") or path.startswith("[stack:")


def anon_regions(pid: int) -> list[Region]:
    """The private, writable, anonymous mappings of `pid`."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ProcMemError(f"process {pid} does not exist") from None
    except PermissionError:
        raise ProcMemError(f"/proc/{pid}/maps: permission denied (run as root)") from None
    regions = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5].strip() if len(parts) == 6 else ""
        if _is_anonymous(parts[1], path):
            regions.append(Region(lo, hi, parts[1], path))
    return regions


def _pagemap(fd: int, region: Region) -> np.ndarray:
    raw = os.pread(fd, region.pages * 8, (region.start // PAGE) * 8)
    return np.frombuffer(raw, dtype=np.uint64)


def resident_anon_addresses(pid: int) -> np.ndarray:
    """Virtual addresses (uint64, ascending) of `pid`'s resident private anonymous pages."""
    regions = anon_regions(pid)
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except FileNotFoundError:
        raise ProcMemError(f"process {pid} does not exist") from None
    except PermissionError:
        raise ProcMemError(f"/proc/{pid}/pagemap: permission denied (run as root)") from None
    chunks = []
    try:
        for region in regions:
            try:
                entries = _pagemap(fd, region)
            except OSError:
                continue  # the mapping went away meanwhile
            keep = ((entries & _PRESENT) != 0) & ((entries & _FILE_OR_SHARED) == 0)
            idx = np.flatnonzero(keep).astype(np.uint64)
            chunks.append(np.uint64(region.start) + idx * np.uint64(PAGE))
    finally:
        os.close(fd)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint64)


def _runs(addresses: np.ndarray) -> Iterator[tuple[int, int]]:
    """(first address, page count) for each run of adjacent pages, at most _MAX_RUN long."""
    if not len(addresses):
        return
    breaks = np.flatnonzero(np.diff(addresses.astype(np.int64)) != PAGE) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(addresses)]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        for off in range(s, e, _MAX_RUN):
            yield int(addresses[off]), min(_MAX_RUN, e - off)


def read_pages(
    pid: int,
    addresses: np.ndarray,
    progress: Callable[[int], None] | None = None,
) -> Iterator[bytes]:
    """The pages at `addresses` (ascending), one `bytes` each; pages that cannot be read
    (unmapped meanwhile) are skipped. `progress(n)` is called with pages done so far."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except FileNotFoundError:
        raise ProcMemError(f"process {pid} does not exist") from None
    except PermissionError:
        raise ProcMemError(f"/proc/{pid}/mem: permission denied (run as root)") from None
    done = 0
    try:
        for addr, count in _runs(np.asarray(addresses, dtype=np.uint64)):
            try:
                data = os.pread(fd, count * PAGE, addr)
            except OSError:
                data = b""
            for i in range(len(data) // PAGE):
                yield data[i * PAGE : (i + 1) * PAGE]
            done += count
            if progress is not None:
                progress(done)
    finally:
        os.close(fd)


def sample_addresses(addresses: np.ndarray, limit: int | None, seed: int = 0) -> np.ndarray:
    """At most `limit` of `addresses`, chosen uniformly at random, kept in ascending order."""
    if limit is None or len(addresses) <= limit:
        return addresses
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(len(addresses), size=limit, replace=False))
    return addresses[pick]


def process_pages(
    pids: Iterable[int],
    limit: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> list[bytes]:
    """Resident anonymous pages of several processes (a uniform sample of at most `limit`
    across all of them). `progress(done, total)` reports pages read."""
    targets = []
    last_error: ProcMemError | None = None
    for pid in pids:
        try:
            targets.append((pid, resident_anon_addresses(pid)))
        except ProcMemError as exc:
            last_error = exc  # a process of a cgroup may exit while we look
    if not targets and last_error is not None:
        raise last_error
    total = sum(len(a) for _, a in targets)
    if limit is not None and total > limit:
        # Share the sample in proportion to each process's resident size.
        owner = np.concatenate([np.full(len(a), i) for i, (_, a) in enumerate(targets)])
        pick = np.random.default_rng(seed).choice(total, limit, replace=False)
        counts = np.bincount(owner[pick], minlength=len(targets))
        targets = [(pid, sample_addresses(a, int(c), seed)) for (pid, a), c in zip(targets, counts)]
        total = limit
    pages: list[bytes] = []
    base = 0
    for pid, addrs in targets:
        cb = (lambda n, b=base: progress(b + n, total)) if progress else None
        try:
            pages.extend(read_pages(pid, addrs, cb))
        except ProcMemError:
            pass  # exited meanwhile
        base += len(addrs)
    if progress:
        progress(total, total)
    return pages


def cgroup_pids(path: str) -> list[int]:
    """PIDs in a cgroup directory and all its descendants (v1 or v2: `cgroup.procs`)."""
    if not os.path.isdir(path):
        raise ProcMemError(f"{path}: no such cgroup directory")
    pids: list[int] = []
    for dirpath, _dirs, files in os.walk(path):
        if "cgroup.procs" in files:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                pids.extend(int(x) for x in f.read().split())
    return sorted(set(pids))
