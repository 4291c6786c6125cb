"""`agentzip-blk serve`: only the NBD server, in the foreground (for any NBD client)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from ..errors import SetupError
from ..host import facts
from ..host.servercmd import (
    default_plugin_path,
    is_python_plugin,
    plugin_env,
    server_command,
)
from ._common import (
    EXIT_RUNTIME,
    PROG,
    CliError,
    config_of,
    device_size_arg,
    fmt,
    run_dir_of,
)


def register(sub) -> None:
    s = sub.add_parser("serve", help="run only the NBD server in the foreground")
    s.add_argument("--socket", metavar="PATH", help="NBD unix socket (default RUN_DIR/nbd.sock)")
    s.add_argument("--control", metavar="PATH",
                   help="control socket (default RUN_DIR/control.sock)")
    s.add_argument("--size", metavar="SIZE", help="device size, e.g. 8G (default device.size)")
    s.add_argument("--plugin", help=argparse.SUPPRESS)
    s.add_argument("--no-mlock", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_serve)


def _socket_in_use(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def cmd_serve(args) -> int:
    config = config_of(args)
    run_dir = run_dir_of(args, config)
    size = device_size_arg(args.size) or config.device.size
    plugin = args.plugin or default_plugin_path()
    nbdkit = facts.which("nbdkit")
    if nbdkit is None:
        facts.require_tools(["nbdkit"])
    if is_python_plugin(plugin):
        facts.require_nbdkit_plugin("python")
        if not os.path.isfile(plugin):
            raise SetupError(f"nbdkit plugin {plugin} not found: reinstall agentzip-blk "
                             f"(pip install -e .) or set AGENTZIP_PLUGIN")
    sock = os.path.abspath(args.socket or os.path.join(run_dir, "nbd.sock"))
    control = os.path.abspath(args.control or os.path.join(run_dir, "control.sock"))
    if not is_python_plugin(plugin):
        control = None
    os.makedirs(os.path.dirname(sock), mode=0o700, exist_ok=True)
    for path in filter(None, (sock, control)):
        if os.path.exists(path):
            if _socket_in_use(path):
                raise SetupError(f"{path} is in use by a running server: stop it, or pick "
                                 f"another path with --socket/--control")
            os.unlink(path)
    pidfile = os.path.join(os.path.dirname(sock), "serve.pid")
    # mlock only as root (RLIMIT_MEMLOCK stops others); a server that is not swap needs none
    argv = server_command(plugin, sock, control, pidfile, args.config, size,
                          foreground=True, mlock=facts.is_root() and not args.no_mlock,
                          nbdkit=nbdkit)
    print(f"{PROG}: serving {fmt(size)} on {sock}" +
          (f" (control {control})" if control else "") + "; Ctrl-C stops", file=sys.stderr)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=plugin_env())

    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _unlink_quiet(pidfile)
    if rc < 0 and -rc in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        return 0
    if rc != 0:
        raise CliError(f"nbdkit exited with status {rc}", EXIT_RUNTIME)
    return 0


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
