"""Scopes: which cgroups the tool may touch, and the ledger that puts them back.

Three parts:

1. **Matching.** A scope glob matches cgroup paths anywhere in the hierarchy, one path
   component at a time (``*`` never crosses ``/``):

   - ``agent-sandbox-*.slice`` (no ``/``): any cgroup whose *name* matches;
   - ``sandboxes/job-*``: any cgroup whose *last components* match, at any depth;
   - ``/sandboxes/job-*`` (leading ``/``): anchored at the hierarchy root.

   ``scoped_cgroups`` returns the outermost matches of the enabled scopes: a match's
   descendants are part of it (memory limits are hierarchical), never a second controller.

2. **The config file.** ``add/remove/enable/disable`` edit the ``scopes:`` list of the YAML
   config with ruamel.yaml's round-trip mode, so comments, key order and quoting elsewhere in
   the file survive. The result is validated with ``config.load_config`` before it replaces
   the file (atomically, same mode and owner). A file without a ``scopes:`` key means the
   default scope list: the first edit writes the defaults out and then applies the change.

3. **The ledger** (``RUN/cgroup-settings.json``): before the first write to any cgroup file,
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
import fnmatch
import io
import json
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator

from .cgroup_memory import _read, _write
from .config import DEFAULT_CONFIG_PATH, ConfigError, Scope, _default_scopes, _glob_problem, load_config

__all__ = [
    "ScopeError", "match", "scoped_cgroups", "covered", "list_scopes", "add", "remove",
    "enable", "disable", "Ledger", "LedgerEntry", "RestoreReport", "LEDGER_FILE",
    "release_unscoped", "release_all",
]

LEDGER_FILE = "cgroup-settings.json"
LEDGER_LOCK = "cgroup-settings.lock"


class ScopeError(ValueError):
    """A scope edit that cannot be done (unknown glob, duplicate, bad glob)."""


# --- matching ------------------------------------------------------------------------------

def match(pattern: str, rel: str) -> bool:
    """Does cgroup *rel* ("/a/b/c", relative to the hierarchy mount) match scope *pattern*?"""
    comps = [c for c in rel.strip("/").split("/") if c]
    anchored = pattern.startswith("/")
    pats = [p for p in pattern.strip("/").split("/") if p]
    if not pats or not comps or len(pats) > len(comps):
        return False
    if anchored and len(pats) != len(comps):
        return False
    tail = comps[-len(pats):]
    return all(fnmatch.fnmatchcase(c, p) for c, p in zip(tail, pats))


def covered(scopes: Iterable[Scope], rel: str) -> bool:
    """Is *rel* inside (or equal to) a cgroup matched by an enabled scope?"""
    comps = [c for c in rel.strip("/").split("/") if c]
    enabled = [s.cgroup for s in scopes if s.enabled]
    for i in range(1, len(comps) + 1):
        prefix = "/" + "/".join(comps[:i])
        if any(match(p, prefix) for p in enabled):
            return True
    return False


def scoped_cgroups(paths: Iterable[str], scopes: Iterable[Scope]) -> list[str]:
    """The outermost of *paths* (parents listed before children) matched by an enabled scope."""
    enabled = [s.cgroup for s in scopes if s.enabled]
    out: list[str] = []
    if not enabled:
        return out
    for rel in paths:
        if any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in out):
            continue
        if any(match(p, rel) for p in enabled):
            out.append(rel)
    return out


# --- the config file ----------------------------------------------------------------------

def _config_path(path: str | None) -> str:
    return os.path.abspath(path or DEFAULT_CONFIG_PATH)


def list_scopes(path: str | None = None) -> list[Scope]:
    """The scopes of the config (defaults when it has none, or no file exists)."""
    path = _config_path(path)
    if not os.path.exists(path):
        return _default_scopes()
    return load_config(path).scopes


def _guess_indent(text: str) -> tuple[int, int]:
    """(mapping indent, block sequence offset) as the file already uses them."""
    from ruamel.yaml.util import load_yaml_guess_indent

    mapping = 2
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if stripped and not stripped.startswith(("#", "-")) and line != stripped:
            mapping = len(line) - len(stripped)
            break
    offset = 2  # DESIGN.md's style: "  - cgroup: ..."
    if text.strip():
        try:
            _, _, bsi = load_yaml_guess_indent(text)
        except Exception:  # the strict load below reports real YAML errors
            bsi = None
        if bsi is not None:
            offset = bsi
    return mapping, offset


def _edit(path: str | None, change: Callable[[object], str]) -> str:
    """Load the config round-trip, apply *change* to its scopes list, validate, replace.

    *change(seq)* mutates the ruamel sequence and returns a message for the user.
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    path = _config_path(path)
    exists = os.path.exists(path)
    text = ""
    if exists:
        load_config(path)  # refuse to edit a file that is already invalid: say why first
        with open(path, encoding="utf-8") as f:
            text = f.read()
    mapping, offset = _guess_indent(text)
    yaml = YAML()  # round-trip: comments, order, quoting survive
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines
    yaml.indent(mapping=mapping, sequence=offset + 2, offset=offset)
    data = yaml.load(text) if text.strip() else None
    if data is None:
        data = CommentedMap()
        if not exists:
            data.yaml_set_start_comment("agentzip-blk configuration (created by `agentzip-blk scope`)")
    if not isinstance(data, CommentedMap):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    if "scopes" not in data:
        # no key = the default list: make it explicit so the edit keeps it
        data["scopes"] = CommentedSeq(
            [CommentedMap([("cgroup", s.cgroup), ("enabled", s.enabled)]) for s in _default_scopes()])
    seq = data["scopes"]
    if not isinstance(seq, CommentedSeq):
        raise ConfigError(f"{path}: scopes: must be a list")
    if not seq:
        seq.fa.set_block_style()  # `scopes: []` grows into a block list, not a flow one
    message = change(seq)

    buf = io.StringIO()
    yaml.dump(data, buf)
    new_text = buf.getvalue()
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".agentzip-config-", suffix=".yaml", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new_text)
        try:
            load_config(tmp)
        except ConfigError as e:
            raise ConfigError(str(e).replace(tmp, path)) from None
        if exists:
            st = os.stat(path)
            os.chmod(tmp, st.st_mode & 0o7777)
            with contextlib.suppress(PermissionError):
                os.chown(tmp, st.st_uid, st.st_gid)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return message


def _find(seq, glob: str) -> int | None:
    for i, item in enumerate(seq):
        if hasattr(item, "get") and item.get("cgroup") == glob:
            return i
    return None


def _check_glob(glob: str) -> None:
    problem = _glob_problem(glob) if isinstance(glob, str) else "must be a string glob"
    if problem:
        raise ScopeError(f"--cgroup {glob!r} {problem}")


def add(path: str | None, glob: str, enabled: bool = True) -> str:
    from ruamel.yaml.comments import CommentedMap

    _check_glob(glob)

    def change(seq):
        i = _find(seq, glob)
        if i is not None:
            state = "enabled" if seq[i].get("enabled", True) else "disabled"
            raise ScopeError(f"scope {glob!r} is already in the config ({state}): "
                             f"use `scope {'disable' if state == 'enabled' else 'enable'}`")
        seq.append(CommentedMap([("cgroup", glob), ("enabled", enabled)]))
        return f"added scope {glob} ({'enabled' if enabled else 'disabled'})"

    return _edit(path, change)


def _need(seq, glob: str) -> int:
    i = _find(seq, glob)
    if i is None:
        known = ", ".join(str(item.get("cgroup")) for item in seq if hasattr(item, "get")) or "none"
        raise ScopeError(f"no scope {glob!r} in the config (scopes: {known})")
    return i


def remove(path: str | None, glob: str) -> str:
    def change(seq):
        del seq[_need(seq, glob)]
        return f"removed scope {glob}"

    return _edit(path, change)


def _set_enabled(path: str | None, glob: str, enabled: bool) -> str:
    def change(seq):
        item = seq[_need(seq, glob)]
        if item.get("enabled", True) == enabled:
            return f"scope {glob} already {'enabled' if enabled else 'disabled'}"
        item["enabled"] = enabled
        return f"{'enabled' if enabled else 'disabled'} scope {glob}"

    return _edit(path, change)


def enable(path: str | None, glob: str) -> str:
    return _set_enabled(path, glob, True)


def disable(path: str | None, glob: str) -> str:
    return _set_enabled(path, glob, False)


# --- the ledger ---------------------------------------------------------------------------

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
                original = _read(path).strip()
                self._entries[path] = LedgerEntry(path=path, cgroup=self.rel_of(cgdir),
                                                  original=original, ino=_ino(cgdir))
                self._save()  # write-ahead: recorded before the file changes
            _write(path, value, self.fake)
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
                        _write(e.path, e.original, self.fake)
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
