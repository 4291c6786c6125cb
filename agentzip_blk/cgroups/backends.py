"""Memory cgroup backends: cgroup v1 and v2 behind one interface, for scopes, tuner and stats.

``open_backend(root)`` finds where the memory controller lives (``cgroup_memory.detect``) and
returns a :class:`V1Backend` or :class:`V2Backend`. Both speak in cgroup paths relative to the
hierarchy's mount ("/", "/system.slice/x.scope") and give the same operations:

- read: ``walk``, ``usage``, ``swap_usage``, ``stat``, ``pids``, ``counters`` (PSI / refault
  and major-fault totals for the tuner), ``cap`` (the resident cap the tuner moves);
- write (through a :class:`Writer`, so that a ledger can record the original value first):
  ``prepare`` (let the cgroup swap into our device), ``set_cap`` and ``reclaim``.

Which files each version writes (``SETTINGS``):

- v2: ``memory.swap.max`` (prepare), ``memory.high`` (cap), ``memory.reclaim`` (proactive
  reclaim, write-only: nothing to restore).
- v1: ``memory.memsw.limit_in_bytes`` and ``memory.swappiness`` (prepare),
  ``memory.soft_limit_in_bytes`` (set to the floor: under host-wide pressure the kernel
  reclaims cgroups above their soft limit first, so scoped cgroups go before anybody else),
  ``memory.limit_in_bytes`` (cap; v1 has no memory.reclaim, so ``reclaim`` lowers the limit,
  which reclaims synchronously in the writer's context, and puts it back).

Mixed ("hybrid") hosts are normal: the memory controller on a v1 hierarchy, a cgroup2 mount for
the rest. PSI is tracked on the cgroup2 tree whether or not the memory controller is bound
there, so a v1 cgroup whose processes sit in a v2 cgroup of their own (systemd's hybrid mode
mirrors the slice tree on both) has per-cgroup memory pressure after all: ``psi_file`` finds it.

Everything goes through a *root* directory like cgroup_memory, and the controller's ``tree``
says how files are written: tests pass a fake tree of plain files (``tree.PlainTree``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Iterator, Protocol

from .fs import (
    V1_UNLIMITED,
    CgroupError,
    MemoryController,
    detect,
    join_rel,
    parse_kv,
    read_file,
    under_root,
    unescape_mount,
)
from .tree import CgroupTree

__all__ = [
    "Writer", "DirectWriter", "Counters", "MemoryBackend", "V1Backend", "V2Backend",
    "open_backend", "find_unified", "parse_psi", "V1_UNLIMITED", "CgroupError",
]

SCOPED_SWAPPINESS = 100  # our device is memory, not disk: anon pages cost no more than file pages


class Writer(Protocol):
    """Writes one cgroupfs file. ``transient`` marks a write-only trigger (v2 memory.reclaim)
    with no setting behind it, so nothing needs recording or restoring."""

    def write(self, path: str, value: str, *, transient: bool = False) -> None: ...


class DirectWriter:
    """Writes straight through, as the hierarchy's tree writes (nothing recorded)."""

    def __init__(self, tree: CgroupTree):
        self.tree = tree

    def write(self, path: str, value: str, *, transient: bool = False) -> None:
        self.tree.write(path, value)


@dataclass
class Counters:
    """Cumulative counters the tuner turns into a pressure figure (differences over time)."""

    psi_some_us: int | None  # PSI "some" total (microseconds); None where there is no PSI
    refaults: int  # workingset_refault_anon + workingset_refault_file
    majfaults: int  # pgmajfault
    swap_usage: int
    usage: int


def parse_psi(text: str, line: str = "some") -> int | None:
    """The ``total=`` microseconds of the *line* ("some"/"full") of a PSI file."""
    for row in text.splitlines():
        parts = row.split()
        if parts and parts[0] == line:
            for p in parts[1:]:
                if p.startswith("total="):
                    return int(p[6:])
    return None


def find_unified(root: str = "/") -> str | None:
    """The cgroup2 mount point (ROOT applied), or None."""
    try:
        mounts = read_file(under_root(root, "/proc/mounts"))
    except OSError:
        return None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return under_root(root, unescape_mount(parts[1]))
    return None


class MemoryBackend:
    """Common part of both versions. Paths ``rel`` are relative to the hierarchy mount."""

    version = 0
    SETTINGS: tuple[str, ...] = ()
    USAGE = ""

    def __init__(self, controller: MemoryController, writer: Writer | None = None,
                 unified: str | None = None):
        self.controller = controller
        self.mount = controller.mount
        self.root = controller.root
        self.writer: Writer = writer or DirectWriter(controller.tree)
        self.unified = unified  # a cgroup2 mount (== mount on v2), for PSI

    @property
    def kind(self) -> str:
        if self.version == 2:
            return "v2"
        return "hybrid" if self.unified else "v1"

    # -- paths ----------------------------------------------------------------------------

    def path(self, rel: str) -> str:
        return join_rel(self.mount, rel)

    def file(self, rel: str, name: str) -> str:
        return os.path.join(self.path(rel), name)

    def rel_of(self, path: str) -> str:
        """The hierarchy-relative path of an absolute cgroup directory."""
        r = os.path.relpath(path, self.mount)
        return "/" if r == "." else "/" + r

    def exists(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def walk(self) -> Iterator[str]:
        """Every cgroup of the hierarchy, parents before children."""
        for dirpath, dirnames, _ in os.walk(self.mount):
            dirnames.sort()
            yield self.rel_of(dirpath)

    def own(self) -> str:
        return self.controller.own

    def read(self, rel: str, name: str) -> str:
        return read_file(self.file(rel, name)).strip()

    def write(self, rel: str, name: str, value, *, transient: bool = False) -> None:
        path = self.file(rel, name)
        try:
            self.writer.write(path, str(value), transient=transient)
        except OSError as e:
            raise CgroupError(f"cannot write {value!r} to {path}: {e.strerror}") from e

    # -- reads ------------------------------------------------------------------------------

    def usage(self, rel: str) -> int:
        return int(self.read(rel, self.USAGE))

    def stat(self, rel: str) -> dict[str, int]:
        return parse_kv(read_file(self.file(rel, "memory.stat")))

    def pids(self, rel: str, recursive: bool = True) -> list[int]:
        """Processes of the cgroup (and, by default, of its descendants)."""
        out: list[int] = []
        dirs = [self.path(rel)]
        if recursive:
            dirs = [d for d, _, _ in os.walk(self.path(rel))]
        for d in dirs:
            try:
                out += [int(x) for x in read_file(os.path.join(d, "cgroup.procs")).split()]
            except (OSError, ValueError):
                continue
        return sorted(set(out))

    def psi_file(self, rel: str) -> str | None:
        raise NotImplementedError

    def counters(self, rel: str) -> Counters:
        st = self.stat(rel)
        psi = None
        f = self.psi_file(rel)
        if f is not None:
            try:
                psi = parse_psi(read_file(f))
            except OSError:
                psi = None
        return Counters(psi_some_us=psi, refaults=self._refaults(st), majfaults=self._majfaults(st),
                        swap_usage=self.swap_usage(rel), usage=self.usage(rel))

    # -- version specific -------------------------------------------------------------------

    def swap_usage(self, rel: str) -> int:
        raise NotImplementedError

    def cap(self, rel: str) -> int | None:
        raise NotImplementedError

    def set_cap(self, rel: str, value: int | None) -> None:
        raise NotImplementedError

    def prepare(self, rel: str, floor: int) -> list[str]:
        raise NotImplementedError

    def reclaim(self, rel: str, nbytes: int) -> int:
        raise NotImplementedError

    def _refaults(self, st: dict[str, int]) -> int:
        raise NotImplementedError

    def _majfaults(self, st: dict[str, int]) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mount!r}, unified={self.unified!r})"


class V2Backend(MemoryBackend):
    version = 2
    SETTINGS = ("memory.swap.max", "memory.high")
    USAGE = "memory.current"

    def psi_file(self, rel: str) -> str | None:
        # the root cgroup's memory.pressure is the whole machine's: never a cgroup's figure
        if rel.strip("/") == "":
            return None
        f = self.file(rel, "memory.pressure")
        return f if os.path.exists(f) else None

    def swap_usage(self, rel: str) -> int:
        try:
            return int(self.read(rel, "memory.swap.current"))
        except FileNotFoundError:
            return int(self.stat(rel).get("swap", 0))

    def cap(self, rel: str) -> int | None:
        v = self.read(rel, "memory.high")
        return None if v == "max" else int(v)

    def set_cap(self, rel: str, value: int | None) -> None:
        self.write(rel, "memory.high", "max" if value is None else int(value))

    def prepare(self, rel: str, floor: int) -> list[str]:
        """memory.swap.max = max, so that the cgroup may swap at all."""
        done = []
        f = self.file(rel, "memory.swap.max")
        if os.path.exists(f) and self.read(rel, "memory.swap.max") != "max":
            self.write(rel, "memory.swap.max", "max")
            done.append("memory.swap.max")
        return done

    def has_reclaim(self, rel: str) -> bool:
        return os.path.exists(self.file(rel, "memory.reclaim"))

    def reclaim(self, rel: str, nbytes: int) -> int:
        """memory.reclaim (5.19+): proactive reclaim without a lasting limit. Falls back to a
        memory.high pulse where the kernel has no memory.reclaim."""
        if nbytes <= 0:
            return 0
        before = self.usage(rel)
        if self.has_reclaim(rel):
            try:
                self.write(rel, "memory.reclaim", int(nbytes), transient=True)
            except CgroupError as e:
                # EAGAIN: could not reclaim all of it; what it did reclaim still counts
                if not (isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EAGAIN):
                    raise
        else:
            old = self.read(rel, "memory.high")
            try:
                self.write(rel, "memory.high", max(before - nbytes, 0))
            finally:
                self.write(rel, "memory.high", old)
        return max(0, before - self.usage(rel))

    def _refaults(self, st: dict[str, int]) -> int:
        if "workingset_refault_anon" in st or "workingset_refault_file" in st:
            return st.get("workingset_refault_anon", 0) + st.get("workingset_refault_file", 0)
        return st.get("workingset_refault", 0)

    def _majfaults(self, st: dict[str, int]) -> int:
        return st.get("pgmajfault", 0)


class V1Backend(MemoryBackend):
    version = 1
    SETTINGS = ("memory.memsw.limit_in_bytes", "memory.swappiness", "memory.soft_limit_in_bytes",
                "memory.limit_in_bytes")
    USAGE = "memory.usage_in_bytes"

    def psi_file(self, rel: str) -> str | None:
        """Per-cgroup PSI on a hybrid host: the cgroup2 cgroup at the same path, if it exists
        and holds the same processes (v1 itself has no per-cgroup PSI)."""
        if not self.unified or rel.strip("/") == "":
            return None
        d = join_rel(self.unified, rel)
        f = os.path.join(d, "memory.pressure")
        if not os.path.exists(f):
            return None
        mine = set(self.pids(rel))
        if not mine:
            return None
        theirs: set[int] = set()
        for dirpath, _, _ in os.walk(d):
            try:
                theirs.update(int(x) for x in read_file(os.path.join(dirpath, "cgroup.procs")).split())
            except (OSError, ValueError):
                continue
        return f if mine <= theirs else None

    def swap_usage(self, rel: str) -> int:
        st = self.stat(rel)
        if "total_swap" in st:
            return st["total_swap"]
        if "swap" in st:
            return st["swap"]
        try:
            return max(0, int(self.read(rel, "memory.memsw.usage_in_bytes")) - self.usage(rel))
        except FileNotFoundError:
            return 0

    @staticmethod
    def _limit_value(text: str) -> int | None:
        n = int(text)
        return None if n >= V1_UNLIMITED else n

    def cap(self, rel: str) -> int | None:
        return self._limit_value(self.read(rel, "memory.limit_in_bytes"))

    def set_cap(self, rel: str, value: int | None) -> None:
        """memory.limit_in_bytes; lowering reclaims synchronously and raises LimitBusy-like
        CgroupError (errno EBUSY in __cause__) when the kernel cannot get usage under it."""
        self.write(rel, "memory.limit_in_bytes", -1 if value is None else int(value))

    def prepare(self, rel: str, floor: int) -> list[str]:
        done = []
        f = self.file(rel, "memory.memsw.limit_in_bytes")
        if os.path.exists(f) and self._limit_value(self.read(rel, "memory.memsw.limit_in_bytes")) is not None:
            # memory+swap limited (possibly to the memory limit: no swap at all): lift it, or
            # every page pushed out would count twice against it
            self.write(rel, "memory.memsw.limit_in_bytes", -1)
            done.append("memory.memsw.limit_in_bytes")
        if os.path.exists(self.file(rel, "memory.swappiness")) and \
                self.read(rel, "memory.swappiness") != str(SCOPED_SWAPPINESS):
            self.write(rel, "memory.swappiness", SCOPED_SWAPPINESS)
            done.append("memory.swappiness")
        soft = self.file(rel, "memory.soft_limit_in_bytes")
        if os.path.exists(soft) and self._limit_value(self.read(rel, "memory.soft_limit_in_bytes")) != floor:
            self.write(rel, "memory.soft_limit_in_bytes", int(floor))
            done.append("memory.soft_limit_in_bytes")
        return done

    def reclaim(self, rel: str, nbytes: int) -> int:
        """v1 has no memory.reclaim: lower memory.limit_in_bytes to usage - nbytes (the write
        reclaims synchronously, here in the tuner, not in the workload) and put it back."""
        if nbytes <= 0:
            return 0
        before = self.usage(rel)
        old = self.read(rel, "memory.limit_in_bytes")
        try:
            self.write(rel, "memory.limit_in_bytes", max(before - nbytes, 0))
        except CgroupError as e:
            # EBUSY: not everything could be reclaimed (unswappable, or swap full); take what
            # was; EINTR: a signal (stop) arrived meanwhile
            cause = e.__cause__
            if not (isinstance(cause, OSError) and cause.errno in (errno.EBUSY, errno.EINTR)):
                raise
        finally:
            self.write(rel, "memory.limit_in_bytes", old)
        return max(0, before - self.usage(rel))

    def _refaults(self, st: dict[str, int]) -> int:
        keys = ("total_workingset_refault_anon", "total_workingset_refault_file")
        if any(k in st for k in keys):
            return sum(st.get(k, 0) for k in keys)
        return st.get("workingset_refault_anon", 0) + st.get("workingset_refault_file", 0)

    def _majfaults(self, st: dict[str, int]) -> int:
        return st.get("total_pgmajfault", st.get("pgmajfault", 0))


def open_backend(root: str = "/", writer: Writer | None = None,
                 controller: MemoryController | None = None) -> MemoryBackend:
    """The backend for wherever the memory controller lives (v1 wins: see cgroup_memory)."""
    c = controller or detect(root)
    unified = find_unified(c.root)
    if c.version == 2:
        return V2Backend(c, writer, unified=c.mount)
    if unified is not None and os.path.realpath(unified) == os.path.realpath(c.mount):
        unified = None
    return V1Backend(c, writer, unified=unified)
