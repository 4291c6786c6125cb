"""`agentzip-blk down [--force]`: swapoff, detach and stop the server (host.attach.down),
with a progress bar of the pages swapoff brings back (cli.progress.SwapoffWatch)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from .. import procfs
from ..config import ConfigError
from ..errors import DeviceError, SetupError
from ..host import attach, facts
from ..host.rundir import secure_run_dir
from ..host.runstate import RunState
from . import progress
from ._common import PROG, config_of, fmt, run_dir_of

EXAMPLES = f"""\
examples:
  {PROG} down                 swapoff (refused if memory cannot take the pages back), stop
  {PROG} down --progress      a progress bar on stderr even when it is not a terminal
  {PROG} down --force         when the server died: give up its pages, leave nothing behind
"""


def register(sub) -> None:
    s = sub.add_parser("down", help="swapoff, detach and stop the server",
                       description="Swap off our device (every page comes back into RAM: a "
                                   "progress bar on a terminal shows it), detach it and stop "
                                   "the server; restore the cgroups the tuner changed first.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--force", action="store_true",
                   help="swapoff even when available memory looks too small")
    s.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    # seconds between swapoff progress lines when stderr is no terminal (ExecStop: the journal)
    s.add_argument("--log-every", type=float, default=10.0, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_down)


def _watch(run_dir: str, log_every: float = 10.0):
    """A SwapoffWatch of our swap area (a no-op context when there is none to watch)."""
    # The run directory is checked (root's, no symlink) before its state file is read, as
    # `attach.down` does: the watch must not read through a planted link either.
    secure_run_dir(run_dir, keep_group=True)
    try:
        state = RunState.load(run_dir)
    except (DeviceError, SetupError):
        return contextlib.nullcontext()  # attach.down reports a bad state file itself
    device = state.device if state is not None else None
    if not device or procfs.swap_area(device) is None:
        return contextlib.nullcontext()
    # state.json is no proof (docs/SECURITY.md): report on no swap area that is not shown to
    # be ours, since `down` refuses to swap it off and a report would say it did
    if not attach.device_is_ours(state):
        return contextlib.nullcontext()
    if progress.enabled():
        report = progress.swapoff_bar(device)
        watch = progress.SwapoffWatch(device, report)
    else:  # a log (the journal under ExecStop): lines with pages left and the rate
        report = progress.SwapoffLog(device, every=log_every)
        watch = progress.SwapoffWatch(device, report, every_poll=True)
    stack = contextlib.ExitStack()
    stack.callback(report.close)  # also when swapoff is refused or fails
    stack.enter_context(watch)
    return stack


def _operator_config(args):
    """The operator's config (--config, else /etc/agentzip/config.yaml, and its drop-ins):
    where a dead server's disk tier lies. A broken one must not keep `down` from taking the
    device down when the run directory is named: that leftover is then only reported."""
    try:
        return config_of(args)
    except ConfigError as e:
        if not args.run_dir:
            raise
        print(f"{PROG}: warning: {e}: a disk tier left by a dead server is not looked for",
              file=sys.stderr)
        return None


def cmd_down(args) -> int:
    facts.require_root(f"{PROG} down")
    config = _operator_config(args)
    run_dir = run_dir_of(args, config) if config is not None else run_dir_of(args)
    # systemd's TimeoutStopSec ends in SIGTERM: stop as Ctrl-C does, which kills the swapoff
    # child (the kernel leaves the area on, the rest still in it) and says so, exit 130
    old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with _watch(run_dir, args.log_every):
            res = attach.down(run_dir, force=args.force, config=config, timeout=args.timeout)
    except attach.NotAttached as e:
        print(f"{PROG}: nothing to do: {e}", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, old_term)
    if res.get("server_lost"):
        print(f"{PROG}: warning: the swap server was dead or did not answer: the pages it held "
              f"are lost (processes that touch them get SIGBUS)", file=sys.stderr)
    if res.get("tier_left"):
        print(f"{PROG}: warning: disk tier file left in place: {res['tier_left']}",
              file=sys.stderr)
    if "orphans" in res:  # --force without a state file (attach._sweep_orphans)
        held = res.get("holder_stopped")
        print(f"no state.json in {res['run_dir']}; detached "
              f"{res['device'] or 'no loop device'} over its FUSE file"
              f"{'; the server on its control socket stopped' if res['server_stopped'] else ''}"
              + (f"; its holder (pid {held}) stopped" if held else ""))
        return 0
    print(f"{res['device'] or 'device'}: detached, {fmt(res['swapped_in'])} swapped back in "
          f"({res['seconds']:.1f}s); server stopped")
    if res.get("cgroups"):
        print(f"scoped cgroups: {res['cgroups']}")
    return 0
