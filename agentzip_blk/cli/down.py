"""`agentzip-blk down [--force]`: swapoff, detach and stop the server (host.attach.down)."""

from __future__ import annotations

import argparse
import sys

from ..host import attach, facts
from ._common import PROG, fmt, run_dir_of


def register(sub) -> None:
    s = sub.add_parser("down", help="swapoff, detach and stop the server")
    s.add_argument("--force", action="store_true",
                   help="swapoff even when available memory looks too small")
    s.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_down)


def cmd_down(args) -> int:
    facts.require_root(f"{PROG} down")
    run_dir = run_dir_of(args)
    try:
        res = attach.down(run_dir, force=args.force, timeout=args.timeout)
    except attach.NotAttached as e:
        print(f"{PROG}: nothing to do: {e}", file=sys.stderr)
        return 0
    if res.get("server_lost"):
        print(f"{PROG}: warning: the swap server was dead or did not answer: the pages it held "
              f"are lost (processes that touch them get SIGBUS)", file=sys.stderr)
    print(f"{res['device'] or 'device'}: detached, {fmt(res['swapped_in'])} swapped back in "
          f"({res['seconds']:.1f}s); server stopped")
    if res.get("cgroups"):
        print(f"scoped cgroups: {res['cgroups']}")
    return 0
