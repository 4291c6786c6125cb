"""What every subcommand's `--help` has: a description, an example, and the global options.

A command module may set its own ``description=`` and ``epilog=`` (an ``example:`` block);
`finish` fills in those it leaves out from the tables below, so that the man page and the
shell completion generated from `build_parser()` (argparse-manpage, shtab) describe every
command. It also gives each subcommand ``--config``, ``--run-dir`` and ``--progress``: operators type
``agentzip-blk up --config X`` as often as ``agentzip-blk --config X up``.
"""

from __future__ import annotations

import argparse
import textwrap

from ._common import PROG

CONFIG_HELP = "config file (default /etc/agentzip/config.yaml if it exists); the drop-ins " \
              "of config.d/ next to it are merged over it in name order"
RUN_DIR_HELP = "state directory (default: device.run_dir, /run/agentzip)"
PROGRESS_HELP = "draw progress bars on stderr even when it is not a terminal"

# command path -> (description, example lines)
TEXTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("Run only the NBD server (nbdkit with the agentzip-blk plugin) in the "
              "foreground, for any NBD client; Ctrl-C stops it.",
              (f"{PROG} serve --socket /run/agentzip/nbd.sock --size 4G",)),
    "up": ("Start the server, attach it as a swap area (mkswap, swapon --discard=pages) and "
           "return once swap is on; the server lives on until `down`. With --tune, also the "
           "tuner in the background.",
           (f"{PROG} up --size 8G --priority 100", f"{PROG} up --config /etc/agentzip/config.yaml --tune")),
    "restart": ("Start a new server from the installed code and config and hand it the "
                "running one's FUSE connection and store: no swapoff, no page moves; requests "
                "wait in the kernel's queue meanwhile. On any failure the old server serves on "
                "(exit 1). Keys a running store cannot change (device.size, the page and frame "
                "layout) are refused by name.",
                (f"{PROG} restart", f"{PROG} restart --config /etc/agentzip/config.yaml")),
    "demo": ("Bring the device up, build an agent-like heap in a cgroup below our own, squeeze "
             "it into swap, read it back, verify it and report what the host got back.",
             (f"{PROG} demo --mb 300", f"{PROG} demo --swap zram-lz4")),
    "estimate": ("Predict the compression ratio on live processes without attaching anything: "
                 "a sample of their resident anonymous pages, compressed as the store would.",
                 (f"{PROG} estimate --pid 1234", f"{PROG} estimate --cgroup /agent-sandbox-1.slice --json")),
    "tune": ("Run the tuner in the foreground: squeeze the scoped cgroups' cold pages into the "
             "device, one line per decision; on exit put back every setting it changed.",
             (f"{PROG} tune --interval 5",)),
    "doctor": ("Check the host: kernel, cgroups, swap, zswap, the attach path and the server's "
               "health; one pass/warn/fail line each, with the fix.",
               (f"{PROG} doctor", f"{PROG} doctor --json")),
    "metrics": ("Serve Prometheus metrics (agentzip_*), polling the server's control socket on "
                "each scrape.",
                (f"{PROG} metrics --listen 127.0.0.1:9479",)),
    "install-units": ("Install the systemd units (the service, the metrics service, the "
                      "sandbox slice drop-in) under a prefix.",
                      (f"{PROG} install-units --prefix /", )),
    "webhook": ("The Kubernetes mutating admission webhook (HTTPS): validates the "
                "agentzip.io annotations of Pods that opt in.",
                (f"{PROG} webhook --tls-cert tls.crt --tls-key tls.key",)),
    "node-agent": ("Keep the scopes in step with this node's Pods annotated "
                   "agentzip.io/enable: one scope per Pod cgroup.",
                   (f"{PROG} node-agent --source kubelet --cgroup-driver systemd",
                    f"{PROG} node-agent --once --json")),
}


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:  # argparse has no public accessor for these
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, helps.get(name)


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser, its one-line help) of every subcommand, depth first."""
    for name, sub, help_ in _subparsers(parser):
        yield path + (name,), sub, help_
        yield from walk(sub, path + (name,))


def add_global_options(parser: argparse.ArgumentParser, sub: bool = False) -> None:
    """--config, --run-dir, --progress; on a subcommand with default SUPPRESS, so that one
    given before the subcommand is kept when it is not repeated after it."""
    parser.add_argument("--config", metavar="PATH", help=CONFIG_HELP,
                        **({"default": argparse.SUPPRESS} if sub else {}))
    parser.add_argument("--run-dir", metavar="DIR", help=RUN_DIR_HELP,
                        **({"default": argparse.SUPPRESS} if sub else {}))
    parser.add_argument("--progress", action="store_true", help=PROGRESS_HELP,
                        **({"default": argparse.SUPPRESS} if sub else {}))


def finish(parser: argparse.ArgumentParser) -> None:
    for path, sub, help_ in walk(parser):
        add_global_options(sub, sub=True)
        name = " ".join(path)
        description, examples = TEXTS.get(name, (None, ()))
        if not sub.description:
            sub.description = description or help_
        if not sub.epilog and examples:
            label = "example:" if len(examples) == 1 else "examples:"
            sub.epilog = "\n".join([label] + [f"  {e}" for e in examples])
        if sub.epilog and sub.formatter_class is argparse.HelpFormatter:
            sub.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the example lines
        if sub.description and "\n" not in sub.description:
            sub.description = textwrap.fill(sub.description, 79)  # raw: not wrapped by argparse
