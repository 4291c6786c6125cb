"""Scopes: which cgroups the tool may touch (the ledger that puts them back is `ledger`).

Two parts:

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
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import tempfile
from typing import Callable, Iterable

from ..config import (DEFAULT_CONFIG_PATH, ConfigError, Scope, default_scopes, glob_problem,
                      load_config)

__all__ = [
    "ScopeError", "match", "scoped_cgroups", "covered", "list_scopes", "add", "remove",
    "enable", "disable",
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


# --- the config file ----------------------------------------------------------------------

def _config_path(path: str | None) -> str:
    return os.path.abspath(path or DEFAULT_CONFIG_PATH)


def list_scopes(path: str | None = None) -> list[Scope]:
    """The scopes of the config (defaults when it has none, or no file exists)."""
    path = _config_path(path)
    if not os.path.exists(path):
        return default_scopes()
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
    offset = 2  # the README's style: "  - cgroup: ..."
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
            [CommentedMap([("cgroup", s.cgroup), ("enabled", s.enabled)]) for s in default_scopes()])
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
    problem = glob_problem(glob) if isinstance(glob, str) else "must be a string glob"
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
