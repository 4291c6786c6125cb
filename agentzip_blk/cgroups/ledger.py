"""The ledger (``RUN/cgroup-settings.json``): before the first write to any cgroup file,
   its original value is recorded (write-ahead, so a crash leaves a record). ``restore`` writes
   the originals back; ``scope disable/remove`` restore the cgroups that no enabled scope
   covers any more, and ``down`` restores everything. A cgroup removed meanwhile is dropped;
   one removed and re-created under the same name (another inode) is left alone.
   ``RUN/cgroup-settings.lock`` (flock) serialises the tuner and the CLI.

   The ledger is a file, and a file is not root's instruction: a path in it is written (at
   the first write and at every restore) only when its name is one of the cgroup files the
   tuner writes (CGROUP_FILES) and the file, opened O_WRONLY|O_NOFOLLOW without O_CREAT or
   O_TRUNC, lies on a cgroup file system (fstatfs magic: tree.Cgroupfs; the tests' trees of
   plain files are declared as such, tree.PlainTree), and the entry carries the inode of
   the cgroup directory that the tuner recorded at its first write, which the directory
   still has (an entry without one was not written by the tuner: it could name any cgroup,
   even one re-created since). Anything else is refused with a logged error and never
   written; a refused entry leaves the ledger.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator

from ..config import ConfigError, Scope
from ..errors import SetupError
from .fs import read_file
from .scopes import covered
from .tree import CGROUPFS, CgroupTree, NotACgroupFile

__all__ = ["Ledger", "LedgerEntry", "RestoreReport", "LEDGER_FILE", "release_unscoped",
           "release_all", "CGROUP_FILES", "NotACgroupFile", "write_cgroup_file"]

LEDGER_FILE = "cgroup-settings.json"
LEDGER_LOCK = "cgroup-settings.lock"

log = logging.getLogger(__name__)

# Every cgroup file the tuner and the backends write through the ledger (cgroups.backends,
# cgroups.fs): v2 then v1. A ledger entry with another name is refused.
CGROUP_FILES = frozenset({
    "memory.high", "memory.max", "memory.low", "memory.swap.max", "memory.reclaim",
    "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.soft_limit_in_bytes",
    "memory.swappiness",
})

def write_cgroup_file(path: str, value: str, tree: CgroupTree = CGROUPFS) -> None:
    """Write ``value`` in one write() to the cgroup file ``path``, only when it is one: a
    known name (CGROUP_FILES), and a control file of ``tree`` (on cgroupfs: not a symbolic
    link, on a cgroup file system; tree.Cgroupfs checks)."""
    name = os.path.basename(path)
    if name not in CGROUP_FILES:
        raise NotACgroupFile(errno.EPERM, f"{name!r} is not a cgroup file the tuner writes",
                             path)
    tree.write(path, value)


def _open_private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


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

    def __init__(self, run_dir: str, tree: CgroupTree = CGROUPFS,
                 rel_of: Callable[[str], str] | None = None):
        self.run_dir = os.path.abspath(run_dir)
        # cgroup directory -> path below its mount (a backend's rel_of); by default found by
        # climbing to the cgroupfs mount boundary
        self.rel_of = rel_of or _cgroup_rel
        self.file = os.path.join(self.run_dir, LEDGER_FILE)
        self.lock_file = os.path.join(self.run_dir, LEDGER_LOCK)
        self.tree = tree  # how the cgroup files are written (tree.Cgroupfs: checked)
        self._entries: dict[str, LedgerEntry] = {}
        self._mutex = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    # -- locking and persistence ---------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator["Ledger"]:
        with self._mutex:
            if self._depth == 0:
                _check_run_dir(self.run_dir)
                self._fd = _open_private(self.lock_file, os.O_RDWR | os.O_CREAT)
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
            with os.fdopen(_open_private(self.file, os.O_RDONLY), encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            self._entries = {}
            return
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the cgroup ledger {self.file}: {e}") from None
        self._entries = {}
        try:
            for raw in data.get("entries", []):
                e = LedgerEntry(**raw)
                self._entries[e.path] = e
        except (TypeError, AttributeError) as e:
            raise ConfigError(f"cannot read the cgroup ledger {self.file}: {e}") from None

    def _save(self) -> None:
        if not self._entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.file)
            return
        tmp = self.file + ".tmp"
        fd = _open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
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
            if os.path.basename(path) not in CGROUP_FILES:
                # refused before it is read or recorded (write_cgroup_file checks the rest)
                raise NotACgroupFile(errno.EPERM, "not a cgroup file the tuner writes", path)
            if not transient and path not in self._entries:
                cgdir = os.path.dirname(path)
                original = read_file(path).strip()
                self._entries[path] = LedgerEntry(path=path, cgroup=self.rel_of(cgdir),
                                                  original=original, ino=_ino(cgdir))
                self._save()  # write-ahead: recorded before the file changes
            write_cgroup_file(path, value, self.tree)
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
                    if not isinstance(e.ino, int) or isinstance(e.ino, bool):
                        # the tuner records it at every first write: this is not its entry
                        log.error("cgroup ledger %s: refused %s: no cgroup inode recorded",
                                  self.file, e.path)
                        report.failed.append((e, "refused: no cgroup inode recorded"))
                        del self._entries[e.path]
                        progress = True
                        continue
                    if not os.path.isdir(cgdir) or _ino(cgdir) != e.ino:
                        report.gone.append(e)
                        del self._entries[e.path]
                        progress = True
                        continue
                    try:
                        write_cgroup_file(e.path, e.original, self.tree)
                    except NotACgroupFile as exc:
                        # a planted or corrupted entry: never written, and dropped
                        log.error("cgroup ledger %s: refused %s: %s", self.file, e.path,
                                  exc.strerror)
                        report.failed.append((e, f"refused: {exc.strerror}"))
                        del self._entries[e.path]
                        progress = True
                        continue
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
                    report.failed += [(e, errors.get(e.path, "?")) for e in left]
                    break
                todo = left
        return report


def _check_run_dir(run_dir: str) -> None:
    """The ledger's directory is root's run directory (host.rundir checks it fully at
    up/down): created 0700 when missing, never a symbolic link or another uid's."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    st = os.lstat(run_dir)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SetupError(f"run directory {run_dir} is not a directory (a symbolic link?): "
                         f"refusing it")
    if st.st_uid != os.geteuid():
        raise SetupError(f"run directory {run_dir} is owned by uid {st.st_uid}, not by us: "
                         f"refusing it")


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

def release_unscoped(run_dir: str, scopes: Iterable[Scope], tree: CgroupTree = CGROUPFS,
                     rel_of: Callable[[LedgerEntry], str] | None = None) -> RestoreReport:
    """Restore the recorded cgroups that no enabled scope covers any more."""
    scopes = list(scopes)
    rel_of = rel_of or (lambda e: e.cgroup)
    return Ledger(run_dir, tree).restore(lambda e: not covered(scopes, rel_of(e)))


def release_all(run_dir: str, tree: CgroupTree = CGROUPFS) -> RestoreReport:
    """Restore every recorded cgroup file (``down``)."""
    if not os.path.exists(os.path.join(run_dir, LEDGER_FILE)):
        return RestoreReport()
    return Ledger(run_dir, tree).restore()
