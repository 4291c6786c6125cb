"""agentzip-blk command line: one module per command (``register(sub)`` and its handler)
over `_common`; this module builds the parser and maps errors to exit statuses.

Expected errors print one line ``agentzip-blk: error: ...`` on stderr, no traceback:
exit status 2 for setup problems (non-root, missing tools, zswap, already attached,
bad config), 1 for runtime failures (a tool failed, swapoff refused, control socket
unreachable). ``status`` exits 0 when the device is attached and healthy, 3 when nothing
is attached, 4 when something of ours is attached or running but the chain is not healthy
(a server dead, stopped or not answering: docs/JSON.md).
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..errors import ConfigError, DeviceError, SetupError
from . import (
    config_show,
    demo,
    dicts,
    doctor,
    down,
    estimate,
    helptext,
    install_units,
    metrics,
    node_agent,
    progress,
    restart,
    scope,
    serve,
    stats,
    status,
    tune,
    up,
    webhook,
)
from ._common import EXIT_NOT_ATTACHED, EXIT_RUNTIME, EXIT_SETUP, PROG, CliError, error

__all__ = ["main", "build_parser", "PROG", "EXIT_NOT_ATTACHED", "CliError"]

# the order of `agentzip-blk --help`
COMMANDS = (serve, up, down, restart, status, stats, demo, dicts, estimate, scope, config_show, tune, doctor,
            metrics, install_units, webhook, node_agent)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (the man page and shell completion are generated from it)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compressed, deduplicating userspace swap device for agent sandboxes.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    helptext.add_global_options(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", help="one of:")
    sub.required = True
    for command in COMMANDS:
        command.register(sub)
    helptext.finish(p)  # descriptions, examples, --config/--run-dir after the subcommand
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    progress.force(args.progress)
    try:
        return args.func(args)
    except CliError as e:
        error(str(e))
        return e.code
    except (SetupError, ConfigError) as e:
        error(str(e).splitlines()[0] if str(e) else type(e).__name__)
        return EXIT_SETUP
    except DeviceError as e:
        msg = str(e)
        first, _, rest = msg.partition("\n")
        error(first)
        if rest:  # e.g. the server's log tail: useful, but after the one error line
            print(rest, file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        error(f"{e.filename + ': ' if getattr(e, 'filename', None) else ''}"
             f"{e.strerror or e}")
        return EXIT_RUNTIME
