"""The ledger (``RUN/cgroup-settings.json``): before the first write to any cgroup file,
   its original value is recorded (write-ahead, so a crash leaves a record). ``restore`` writes
   the originals back; ``scope disable/remove`` restore the cgroups that no enabled scope
   covers any more, and ``down`` restores everything. A cgroup removed meanwhile is dropped;
   one removed and re-created under the same name (another inode) is left alone.
   ``RUN/cgroup-settings.lock`` (flock) serialises the tuner and the CLI.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator

from ..config import ConfigError, Scope
from .fs import read_file, write_file
from .scopes import covered

__all__ = ["Ledger", "LedgerEntry", "RestoreReport", "LEDGER_FILE", "release_unscoped",
           "release_all"]

LEDGER_FILE = "cgroup-settings.json"
LEDGER_LOCK = "cgroup-settings.lock"


@dataclass
class LedgerEntry:
    path: str  # absolute path of the cgroup file
    cgroup: str  # the cgroup's path relative to its hierarchy mount
    original: str  # the value before our first write
    last: str = ""  # the last value we wrote
    ino: int | None = None  # the cgroup directory's inode at the first write
    time: float = field(default_factory=time.time)


@dataclass
class RestoreReport:
    restored: list[LedgerEntry] = field(default_factory=list)
    gone: list[LedgerEntry] = field(default_factory=list)  # cgroup removed (or re-created)
    failed: list[tuple[LedgerEntry, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"restored": [asdict(e) for e in self.restored],
                "gone": [asdict(e) for e in self.gone],
                "failed": [{"entry": asdict(e), "error": m} for e, m in self.failed]}

    def summary(self) -> str:
        parts = [f"{len(self.restored)} setting(s) restored"]
        if self.gone:
            parts.append(f"{len(self.gone)} of removed cgroups dropped")
        if self.failed:
            parts.append(f"{len(self.failed)} FAILED: " +
                         "; ".join(f"{e.path}: {m}" for e, m in self.failed))
        return ", ".join(parts)


class Ledger:
    """Original values of every cgroup file written, in RUN/cgroup-settings.json.

    Also a :class:`cgroup_backends.Writer`: ``write(path, value)`` records, then writes.
    Every public method takes the ledger's file lock (re-entrant within a process).
    """

    def __init__(self, run_dir: str, fake: bool = False,
                 rel_of: Callable[[str], str] | None = None):
        self.run_dir = os.path.abspath(run_dir)
        # cgroup directory -> path below its mount (a backend's rel_of); by default found by
        # climbing to the cgroupfs mount boundary
        self.rel_of = rel_of or _cgroup_rel
        self.file = os.path.join(self.run_dir, LEDGER_FILE)
        self.lock_file = os.path.join(self.run_dir, LEDGER_LOCK)
        self.fake = fake  # fake cgroup trees (tests): plain files, created on write
        self._entries: dict[str, LedgerEntry] = {}
        self._mutex = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    # -- locking and persistence ---------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator["Ledger"]:
        with self._mutex:
            if self._depth == 0:
                os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
                self._fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                self._load()
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
                if self._depth == 0:
                    os.close(self._fd)  # closing releases the flock
                    self._fd = None

    def _load(self) -> None:
        try:
            with open(self.file, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            self._entries = {}
            return
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the cgroup ledger {self.file}: {e}") from None
        self._entries = {}
        for raw in data.get("entries", []):
            e = LedgerEntry(**raw)
            self._entries[e.path] = e

    def _save(self) -> None:
        if not self._entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.file)
            return
        tmp = self.file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"entries": [asdict(e) for e in self._entries.values()]}, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.file)

    # -- reads --------------------------------------------------------------------------------

    def entries(self) -> list[LedgerEntry]:
        with self.locked():
            return list(self._entries.values())

    def original(self, path: str) -> str | None:
        with self.locked():
            e = self._entries.get(path)
            return e.original if e else None

    def cgroups(self) -> list[str]:
        with self.locked():
            seen: list[str] = []
            for e in self._entries.values():
                if e.cgroup not in seen:
                    seen.append(e.cgroup)
            return seen

    # -- the Writer ---------------------------------------------------------------------------

    def write(self, path: str, value: str, *, transient: bool = False) -> None:
        with self.locked():
            if not transient and path not in self._entries:
                cgdir = os.path.dirname(path)
                original = read_file(path).strip()
                self._entries[path] = LedgerEntry(path=path, cgroup=self.rel_of(cgdir),
                                                  original=original, ino=_ino(cgdir))
                self._save()  # write-ahead: recorded before the file changes
            write_file(path, value, self.fake)
            if not transient:
                self._entries[path].last = value
                self._save()

    # -- restore ------------------------------------------------------------------------------

    def restore(self, select: Callable[[LedgerEntry], bool] | None = None) -> RestoreReport:
        """Write the originals back (entries chosen by *select*; all by default).

        Later writes first, and repeated passes until nothing more succeeds: v1 refuses a
        memory limit above memsw (and memsw below the limit) until the other one moved.
        """
        report = RestoreReport()
        with self.locked():
            todo = [e for e in reversed(list(self._entries.values())) if select is None or select(e)]
            errors: dict[str, str] = {}
            while todo:
                progress = False
                left = []
                for e in todo:
                    cgdir = os.path.dirname(e.path)
                    if not os.path.isdir(cgdir) or (e.ino is not None and _ino(cgdir) != e.ino):
                        report.gone.append(e)
                        del self._entries[e.path]
                        progress = True
                        continue
                    try:
                        write_file(e.path, e.original, self.fake)
                    except OSError as exc:
                        if exc.errno == errno.ENOENT and not os.path.isdir(cgdir):
                            report.gone.append(e)
                            del self._entries[e.path]
                            progress = True
                            continue
                        errors[e.path] = exc.strerror or str(exc)
                        left.append(e)
                        continue
                    report.restored.append(e)
                    del self._entries[e.path]
                    progress = True
                self._save()
                if not progress:
                    report.failed = [(e, errors.get(e.path, "?")) for e in left]
                    break
                todo = left
        return report


def _ino(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _cgroup_rel(cgdir: str) -> str:
    """A cgroup directory's path below its mount point (for messages and matching)."""
    mount = cgdir
    # climb while the parent is still on the same filesystem (cgroupfs mount boundary)
    try:
        dev = os.stat(cgdir).st_dev
        while True:
            parent = os.path.dirname(mount)
            if parent == mount or os.stat(parent).st_dev != dev:
                break
            mount = parent
    except OSError:
        return cgdir
    rel = os.path.relpath(cgdir, mount)
    return "/" if rel == "." else "/" + rel


# --- what `scope disable/remove` and `down` call -------------------------------------------

def release_unscoped(run_dir: str, scopes: Iterable[Scope], fake: bool = False,
                     rel_of: Callable[[LedgerEntry], str] | None = None) -> RestoreReport:
    """Restore the recorded cgroups that no enabled scope covers any more."""
    scopes = list(scopes)
    rel_of = rel_of or (lambda e: e.cgroup)
    return Ledger(run_dir, fake).restore(lambda e: not covered(scopes, rel_of(e)))


def release_all(run_dir: str, fake: bool = False) -> RestoreReport:
    """Restore every recorded cgroup file (``down``)."""
    if not os.path.exists(os.path.join(run_dir, LEDGER_FILE)):
        return RestoreReport()
    return Ledger(run_dir, fake).restore()
