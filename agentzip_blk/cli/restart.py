"""`agentzip-blk restart`: a new server from the installed code and config takes over the
running one's FUSE connection and store (host.restart): no swapoff, no page moves."""

from __future__ import annotations

import argparse
import sys

from ..host import facts, restart
from ._common import PROG, config_of, run_dir_of


def register(sub) -> None:
    s = sub.add_parser("restart", help="run new code or config without swapoff")
    s.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_restart)


def cmd_restart(args) -> int:
    facts.require_root(f"{PROG} restart")
    config = config_of(args)
    run_dir = run_dir_of(args, config)
    res = restart.restart(config, run_dir, timeout=args.timeout)
    print(f"restarted: server pid {res.old_pid} -> {res.new_pid}, every page kept; requests "
          f"paused {res.paused_ms:.0f} ms ({res.seconds:.1f}s in all; restart {res.restarts} "
          f"of this store); run dir {run_dir}")
    if res.holder_problem:
        print(f"{PROG}: warning: {res.holder_problem}: a crash of the new server would not be "
              f"recovered", file=sys.stderr)
    return 0
