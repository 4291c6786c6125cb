"""Scopes: which cgroups the tool may touch (the ledger that puts them back is `ledger`).

Two parts:

1. **Matching.** A scope glob matches cgroup paths anywhere in the hierarchy, one path
   component at a time (``*`` never crosses ``/``):

   - ``agent-sandbox-*.slice`` (no ``/``): any cgroup whose *name* matches;
   - ``sandboxes/job-*``: any cgroup whose *last components* match, at any depth;
   - ``/sandboxes/job-*`` (leading ``/``): anchored at the hierarchy root.

   ``scoped_cgroups`` returns the outermost matches of the enabled scopes: a match's
   descendants are part of it (memory limits are hierarchical), never a second controller.

2. **The drop-in.** ``add/remove/enable/disable`` never write the operator's config.yaml:
   they write the whole effective ``scopes:`` list to ``config.d/90-scopes.yaml`` next to it
   (config.dropins: a list in a later drop-in replaces the earlier one), under an flock of
   the directory, validated with every other file before an atomic rename. The first edit
   starts from the effective list (config.yaml's, or the defaults). Asking for the state that
   is already there (adding a scope that is in, removing one that is not) changes nothing and
   is no error: the CLI and the node agent converge, they do not fail on a repeat.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
from typing import Callable, Iterable

from ..config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    Scope,
    dropin_dir,
    glob_problem,
    load_layers,
)

__all__ = [
    "ScopeError", "match", "scoped_cgroups", "covered", "list_scopes", "add", "remove",
    "enable", "disable", "dropin_path", "SCOPES_DROPIN",
]


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


# --- the drop-in ---------------------------------------------------------------------------

SCOPES_DROPIN = "90-scopes.yaml"
_HEADER = ("# Written by `agentzip-blk scope` and the node agent: the whole scopes: list, which\n"
           "# replaces the one of config.yaml (lists are not merged). Edit it with the tool.\n")


def _config_path(path: str | None) -> str:
    return os.path.abspath(path or DEFAULT_CONFIG_PATH)


def dropin_path(path: str | None = None) -> str:
    """The drop-in the scope edits write: ``config.d/90-scopes.yaml`` next to the config."""
    return os.path.join(dropin_dir(_config_path(path)), SCOPES_DROPIN)


def list_scopes(path: str | None = None) -> list[Scope]:
    """The effective scopes (config file and drop-ins; defaults when none sets them)."""
    return load_layers(path, missing_ok=True).config.scopes


@contextlib.contextmanager
def _locked_dir(directory: str):
    """The drop-in directory, open (no symlink followed) and flock'ed: the CLI and the node
    agent may edit at the same time, and a read-modify-write must not lose an edit."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{directory}: cannot open the drop-in directory: "
                          f"{e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def _write_atomic(dir_fd: int, name: str, text: str) -> None:
    """Write *name* in the directory *dir_fd* as a whole or not at all: a temp file created
    with O_EXCL | O_NOFOLLOW (never through a planted symlink), fsync'ed, renamed over."""
    tmp = f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o644)  # whatever the umask
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _edit(path: str | None, change: Callable[[list[dict]], str | None]) -> str:
    """Apply *change* to the effective scopes list and write it to the scopes drop-in.

    *change(items)* mutates a list of ``{"cgroup", "enabled"}`` dicts and returns a message
    for the user; it returns None when the state asked for is already there (nothing is
    written). The operator's config.yaml is never written.
    """
    import yaml

    target = dropin_path(path)
    if path is not None and not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    with _locked_dir(os.path.dirname(target)) as dir_fd:
        # refuse to edit a config that is already invalid: say why first
        loaded = load_layers(path)
        owner = loaded.sources.get("scopes")
        if owner is not None and os.path.basename(owner) > SCOPES_DROPIN \
                and os.path.dirname(owner) == os.path.dirname(target):
            raise ScopeError(f"{owner} sets scopes: and comes after {target}: an edit would have "
                             f"no effect; move its scopes into {SCOPES_DROPIN} or remove them")
        items = [{"cgroup": s.cgroup, "enabled": s.enabled} for s in loaded.config.scopes]
        message = change(items)
        if message is None:
            raise _Unchanged()
        data = {"scopes": items}
        load_layers(path, replace={target: data})  # validate first
        text = _HEADER + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        _write_atomic(dir_fd, SCOPES_DROPIN, text)
    return message


class _Unchanged(Exception):
    """The edit asked for the state that is already there."""


def _edit_or_same(path: str | None, change, same: str) -> str:
    try:
        return _edit(path, change)
    except _Unchanged:
        return same


def _find(items: list[dict], glob: str) -> int | None:
    for i, item in enumerate(items):
        if item["cgroup"] == glob:
            return i
    return None


def _check_glob(glob: str) -> None:
    problem = glob_problem(glob) if isinstance(glob, str) else "must be a string glob"
    if problem:
        raise ScopeError(f"--cgroup {glob!r} {problem}")


def _state(enabled: bool) -> str:
    return "enabled" if enabled else "disabled"


def add(path: str | None, glob: str, enabled: bool = True) -> str:
    """Make *glob* a scope in state *enabled*: a scope already there in that state is no
    error (the state asked for is reached); one there in the other state is switched."""
    _check_glob(glob)

    def change(items):
        i = _find(items, glob)
        if i is None:
            items.append({"cgroup": glob, "enabled": enabled})
            return f"added scope {glob} ({_state(enabled)})"
        if items[i]["enabled"] == enabled:
            return None
        items[i]["enabled"] = enabled
        return f"scope {glob} was {_state(not enabled)}: {_state(enabled)} it"

    return _edit_or_same(path, change, f"scope {glob} already in the config ({_state(enabled)})")


def _need(items: list[dict], glob: str) -> int:
    i = _find(items, glob)
    if i is None:
        known = ", ".join(item["cgroup"] for item in items) or "none"
        raise ScopeError(f"no scope {glob!r} in the config (scopes: {known})")
    return i


def remove(path: str | None, glob: str) -> str:
    """Make sure *glob* is not a scope (an absent one is no error)."""
    def change(items):
        i = _find(items, glob)
        if i is None:
            return None
        del items[i]
        return f"removed scope {glob}"

    return _edit_or_same(path, change, f"scope {glob} is not in the config: nothing to remove")


def _set_enabled(path: str | None, glob: str, enabled: bool) -> str:
    def change(items):
        item = items[_need(items, glob)]
        if item["enabled"] == enabled:
            return None
        item["enabled"] = enabled
        return f"{'enabled' if enabled else 'disabled'} scope {glob}"

    return _edit_or_same(path, change, f"scope {glob} already {_state(enabled)}")


def enable(path: str | None, glob: str) -> str:
    return _set_enabled(path, glob, True)


def disable(path: str | None, glob: str) -> str:
    return _set_enabled(path, glob, False)
