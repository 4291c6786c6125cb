"""What the commands share: exit statuses, CliError, the config and run directory of a
command line, the cgroup hierarchy it works on, sizes, byte formatting, serving until Ctrl-C
(progress bars: cli.progress)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from ..codec.dictionaries import known_names
from ..config import ConfigError, check_device_size, load_config
from ..config.quantities import format_bytes, parse_size
from ..host.runstate import RunState, resolve_run_dir

if TYPE_CHECKING:
    from ..cgroups.tree import CgroupTree

PROG = "agentzip-blk"
EXIT_RUNTIME = 1
EXIT_SETUP = 2
EXIT_NOT_ATTACHED = 3
EXIT_UNHEALTHY = 4


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_SETUP):
        super().__init__(message)
        self.code = code


def serve_until_interrupted(server) -> int:
    """Run an HTTP(S) server of a foreground subcommand until Ctrl-C; returns exit status 0."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def fmt(n) -> str:
    return "-" if n is None else format_bytes(int(n))


def size_arg(text: str | None) -> int | None:
    """A --size value in bytes (None when not given)."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as e:
        raise CliError(f"--size: {e}") from None


def device_size_arg(text: str | None) -> int | None:
    """A device --size: `size_arg`, and no larger than the store can name (32-bit ids)."""
    size = size_arg(text)
    if size is not None:
        try:
            check_device_size(size, "--size", text)
        except ConfigError as e:
            raise CliError(str(e)) from None
    return size


def config_of(args):
    """The Config named by --config (None: /etc/agentzip/config.yaml or defaults)."""
    # known_dictionaries: an unknown compression.dictionary name is a config error here too
    return load_config(args.config, known_dictionaries=known_names())


def run_dir_of(args, config=None) -> str:
    if args.run_dir:
        return os.path.abspath(args.run_dir)
    if config is None:
        config = config_of(args)
    return resolve_run_dir(config, None)


def add_cgroup_options(parser) -> None:
    """The hidden options that name a cgroup hierarchy other than the host's at /, one or the
    other, so that its kind is said, never guessed from the path: ``--cgroup-root DIR``, the
    host's cgroup file systems seen under DIR (a container with the host's / at /host), with
    every cgroupfs check; ``--cgroup-tree DIR``, a tree of plain files at DIR standing in for
    them (the tests of a command run as its own process: tests/cgfake.py)."""
    # not an argparse mutually exclusive group: with suppressed members, wrapping a long
    # usage line trips an assertion in argparse (Python 3.11); _one_cgroup_option checks
    parser.add_argument("--cgroup-root", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--cgroup-tree", metavar="DIR", help=argparse.SUPPRESS)


def _one_cgroup_option(args) -> None:
    if args.cgroup_root and args.cgroup_tree:
        raise CliError("--cgroup-root (cgroupfs seen under DIR) and --cgroup-tree (a tree of "
                       "plain files at DIR) exclude each other")


def cgroup_root_of(args) -> str:
    """Where the cgroup hierarchies are found (/proc/mounts below it): --cgroup-root or
    --cgroup-tree, else /."""
    _one_cgroup_option(args)
    return args.cgroup_tree or args.cgroup_root or "/"


def cgroup_tree_of(args) -> CgroupTree:
    """How the hierarchy's files are written: a tree of plain files for --cgroup-tree,
    cgroupfs otherwise (at / or under --cgroup-root alike)."""
    from ..cgroups.tree import CGROUPFS, PlainTree

    _one_cgroup_option(args)
    return PlainTree(args.cgroup_tree) if args.cgroup_tree else CGROUPFS


def control_path_of(args) -> str:
    """The control socket: --control, else the one the run directory's state names."""
    if args.control:
        return args.control
    run_dir = run_dir_of(args)
    state = RunState.load(run_dir)
    if state is not None and state.control_socket:
        return state.control_socket
    path = os.path.join(run_dir, "control.sock")
    if not os.path.exists(path):
        raise CliError(f"no server in {run_dir} (no control socket): start one with "
                       f"`{PROG} up` or `{PROG} serve`, or pass --control PATH", EXIT_RUNTIME)
    return path


def error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
