"""``agentzip-blk scope add|remove|enable|disable|list --cgroup GLOB``.

Writes the scopes drop-in ``config.d/90-scopes.yaml`` next to the config file (``--config``,
default /etc/agentzip/config.yaml), never the config file itself (cgroups.scopes). Asking for
the state that is already there exits 0 and says so. ``disable`` and ``remove`` also put back
the original settings of every cgroup that no enabled scope covers any more (from the ledger
in the run directory).
"""

from __future__ import annotations

import argparse
import json
import os

from ._common import (
    PROG,
    CliError,
    add_cgroup_options,
    cgroup_root_of,
    cgroup_tree_of,
    run_dir_of,
)
from .table import Column, Table, key

ACTIONS = ("add", "remove", "enable", "disable", "list")


def _matching(row: dict) -> str:
    m = row["matches"]
    shown = ", ".join(m[:4]) + (f" (+{len(m) - 4})" if len(m) > 4 else "")
    return f"{len(m)}{': ' + shown if m else ''}"


SCOPES = Table([
    Column("GLOB", "the scope's cgroup glob", key("cgroup")),
    Column("ENABLED", "whether the tuner may touch its cgroups", key("enabled")),
    Column("MATCHING CGROUPS", "how many cgroups it matches now, and the first few", _matching),
])


def _backend(args):
    from ..cgroups.backends import open_backend
    from ..cgroups.fs import CgroupError

    try:
        return open_backend(cgroup_root_of(args))
    except CgroupError:
        return None


def _rel_of_under(backend):
    """A ledger entry's cgroup relative to the backend's mount (its recorded name when the
    entry lies outside it)."""
    mount = backend.mount.rstrip("/") + "/"

    def rel_of(e):
        d = e.path.rsplit("/", 1)[0]
        return backend.rel_of(d) if d.startswith(mount) or d == backend.mount else e.cgroup

    return rel_of


def _release(args, run_dir: str) -> str:
    from ..cgroups import ledger, scopes

    backend = _backend(args)
    rel_of = _rel_of_under(backend) if backend is not None else None
    report = ledger.release_unscoped(run_dir, scopes.list_scopes(args.config),
                                     tree=cgroup_tree_of(args), rel_of=rel_of)
    if not (report.restored or report.gone or report.failed):
        return ""
    cgs = sorted({e.cgroup for e in report.restored})
    return f"; {report.summary()}" + (f" ({', '.join(cgs)})" if cgs else "")


def cmd_scope(args) -> int:
    from ..cgroups import scopes
    from ..config import DEFAULT_CONFIG_PATH

    path = args.config or DEFAULT_CONFIG_PATH
    if args.action == "list":
        return _list(args, path)
    if not args.cgroup:
        raise CliError(f"scope {args.action}: --cgroup GLOB is required")
    target = scopes.dropin_path(args.config)
    if not _writable(target):
        raise CliError(f"scope {args.action}: cannot write {target}: run as root")
    try:
        if args.action == "add":
            msg = scopes.add(args.config, args.cgroup, enabled=not args.disabled)
        elif args.action == "remove":
            msg = scopes.remove(args.config, args.cgroup)
        elif args.action == "enable":
            msg = scopes.enable(args.config, args.cgroup)
        else:
            msg = scopes.disable(args.config, args.cgroup)
    except scopes.ScopeError as e:
        raise CliError(str(e)) from None
    if args.action in ("remove", "disable"):
        msg += _release(args, run_dir_of(args))
    print(f"{msg} ({target})")
    return 0


def _writable(path: str) -> bool:
    target = os.path.dirname(os.path.abspath(path))  # the rename needs the directory
    while not os.path.exists(target):
        target = os.path.dirname(target)
    return os.access(target, os.W_OK)


def _list(args, path: str) -> int:
    from ..cgroups import scopes
    from ..cgroups.ledger import Ledger

    scope_list = scopes.list_scopes(args.config)
    backend = _backend(args)
    paths = list(backend.walk()) if backend is not None else []
    rows = []
    for s in scope_list:
        matches = scopes.scoped_cgroups(paths, [type(s)(s.cgroup, True)]) if paths else []
        rows.append({"cgroup": s.cgroup, "enabled": s.enabled, "matches": matches})
    try:
        ledger = Ledger(run_dir_of(args)).entries()
    except Exception:
        ledger = []
    tuned: dict[str, list[str]] = {}
    for e in ledger:
        tuned.setdefault(e.cgroup, []).append(e.path.rsplit("/", 1)[-1])
    if args.json:
        print(json.dumps({"config": path, "scopes": rows, "tuned": tuned,
                          "hierarchy": backend.kind if backend else None}, sort_keys=True))
        return 0
    print(SCOPES.render(rows, SCOPES.columns))
    if not rows:
        print("(no scopes: the tuner touches no cgroup)")
    dropin = scopes.dropin_path(args.config)
    if os.path.exists(dropin):
        print(f"(from {dropin}, written by `scope add/remove/enable/disable`)")
    elif not os.path.exists(path):
        print(f"({path} does not exist: these are the defaults; `scope add` writes {dropin})")
    for cg, files in tuned.items():
        print(f"tuned now: {cg} ({', '.join(files)}; restored on disable/remove/down)")
    return 0


EXAMPLES = f"""\
examples:
  {PROG} scope add --cgroup 'agent-sandbox-*.slice'
  {PROG} scope disable --cgroup 'batch-*'
  {PROG} scope list --json
"""


def register(sub) -> None:
    s = sub.add_parser("scope", help="cgroups the tuner may touch (globs in the config file)",
                       description="The cgroups the tuner may touch: globs matched anywhere in "
                                   "the hierarchy. Edits go to config.d/90-scopes.yaml next to "
                                   "the config file, never to the file itself; asking for the "
                                   "state that is already there exits 0.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("action", choices=ACTIONS, help="add | remove | enable | disable | list")
    s.add_argument("--cgroup", metavar="GLOB",
                   help="cgroup glob, matched anywhere in the hierarchy (e.g. 'agent-sandbox-*.slice')")
    s.add_argument("--disabled", action="store_true", help="add: add the scope disabled")
    s.add_argument("--json", action="store_true", help="list: print JSON")
    add_cgroup_options(s)
    s.set_defaults(func=cmd_scope)
