"""agentzip-blk command line: serve, up, down, status, stats, demo.

Expected errors print one line ``agentzip-blk: error: ...`` on stderr, no traceback:
exit status 2 for setup problems (non-root, missing tools, zswap, already attached,
bad config), 1 for runtime failures (a tool failed, swapoff refused, control socket
unreachable). ``status`` exits 0 when the device is attached and healthy, 3 when nothing
is attached, 4 when something of ours is attached or running but the chain is not healthy
(a server dead, stopped or not answering: docs/JSON.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from . import __version__, cli_dict, system
from . import cli_cgstats, cli_doctor, cli_scope, cli_tune
from . import cli_metrics, units_install
from .k8s import cli as cli_k8s
from .system import SetupError

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


# --- helpers --------------------------------------------------------------------------

def _fmt(n) -> str:
    if n is None:
        return "-"
    try:
        from .units import format_bytes
        return format_bytes(int(n))
    except Exception:
        return str(n)


def _parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    from .units import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise CliError(f"--size: {e}") from None


def _load_config(args):
    """The Config named by --config (None: /etc/agentzip/config.yaml or defaults)."""
    from .config import load_config
    from .dictionaries import publish_names
    publish_names()  # so an unknown compression.dictionary name is a config error here too
    return load_config(args.config)


def _run_dir(args, config=None) -> str:
    from .device import resolve_run_dir
    if args.run_dir:
        return os.path.abspath(args.run_dir)
    if config is None:
        config = _load_config(args)
    return resolve_run_dir(config, None)


def _err(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


# --- serve ------------------------------------------------------------------------------

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
    from .server_cmd import default_plugin_path, is_python_plugin, plugin_env, server_command
    config = _load_config(args)
    run_dir = _run_dir(args, config)
    size = _parse_size(args.size) or config.device.size
    plugin = args.plugin or default_plugin_path()
    nbdkit = system.which("nbdkit")
    if nbdkit is None:
        system.require_tools(["nbdkit"])
    if is_python_plugin(plugin):
        system.require_nbdkit_plugin("python")
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
                          foreground=True, mlock=system.is_root() and not args.no_mlock,
                          nbdkit=nbdkit)
    print(f"{PROG}: serving {_fmt(size)} on {sock}" +
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


# --- up / down --------------------------------------------------------------------------

def cmd_up(args) -> int:
    from . import device
    system.require_root(f"{PROG} up")
    config = _load_config(args)
    run_dir = _run_dir(args, config)
    size = _parse_size(args.size)
    state = device.up(config, args.config, run_dir, args.priority, size, plugin=args.plugin,
                      allow_zswap=args.allow_zswap, timeout=args.timeout,
                      mlock=not args.no_mlock)
    via = (f"nbdfuse pid {state.nbdfuse_pid} + {state.loop_device} (direct I/O)"
           if state.mode == "fuse" else f"kernel nbd {state.nbd_device}")
    print(f"{state.device}: swap on, {_fmt(state.size)}, priority {state.swap_priority}; "
          f"nbdkit pid {state.nbdkit_pid}, {via}; run dir {run_dir}")
    return 0


def cmd_down(args) -> int:
    from . import device
    system.require_root(f"{PROG} down")
    run_dir = _run_dir(args)
    try:
        res = device.down(run_dir, force=args.force, timeout=args.timeout)
    except device.NotAttached as e:
        print(f"{PROG}: nothing to do: {e}", file=sys.stderr)
        return 0
    if res.get("server_lost"):
        print(f"{PROG}: warning: the swap server was dead or did not answer: the pages it held "
              f"are lost (processes that touch them get SIGBUS)", file=sys.stderr)
    print(f"{res['device'] or 'device'}: detached, {_fmt(res['swapped_in'])} swapped back in "
          f"({res['seconds']:.1f}s); server stopped")
    if res.get("cgroups"):
        print(f"scoped cgroups: {res['cgroups']}")
    return 0


# --- status -------------------------------------------------------------------------------

def _status_text(st: dict) -> str:
    lines = [f"run dir   {st['run_dir']}"]
    if st["state"] is None:
        lines.append("device    not attached")
    else:
        srv = st["server"]
        if srv["alive"]:
            lines.append(f"server    nbdkit pid {srv['pid']} running, rss {_fmt(srv['rss'])}, "
                         f"size {_fmt(srv['size'])}, plugin {srv['plugin']}")
        else:
            lines.append(f"server    nbdkit pid {srv['pid']} NOT running")
        if st["mode"] == "fuse":
            fz = st["nbdfuse"] or {}
            mnt = st["mount"] or {}
            lines.append(f"nbdfuse   pid {fz.get('pid')} "
                         f"{'running' if fz.get('alive') else 'NOT running'}"
                         f"{', memory locked' if fz.get('locked') else ''}, "
                         f"{mnt.get('file')} {'mounted' if mnt.get('mounted') else 'NOT mounted'}")
            lp = st["loop"]
            if lp:
                dio = {True: "on", False: "OFF", None: "?"}[lp["dio"]]
                lines.append(f"loop      {lp['device']} "
                             f"{'attached' if lp['attached'] else 'NOT attached'}, "
                             f"direct I/O {dio}")
        else:
            lines.append(f"device    {st['device']} (kernel nbd)")
        sw = st["swap"]
        if sw:
            lines.append(f"swap      {sw['filename']} size {_fmt(sw['size'])} used "
                         f"{_fmt(sw['used'])} priority {sw['priority']}")
        else:
            lines.append("swap      off")
    if st["health"] is not None:
        h = st["health"]
        lines.append("health    OK" if h["ok"] else "health    FAIL: " + "; ".join(h["problems"]))
    others = st["other_swaps"]
    if others:
        lines.append("other swap areas:")
        for a in others:
            lines.append(f"          {a['filename']} size {_fmt(a['size'])} used "
                         f"{_fmt(a['used'])} priority {a['priority']}")
    lines.append(f"zswap     {'ENABLED' if st['zswap_enabled'] else 'off'}")
    for w in st["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    from . import device
    run_dir = _run_dir(args)
    st = device.status(run_dir)
    if args.json:
        print(json.dumps(st, sort_keys=True))
    else:
        print(_status_text(st))
    if st["healthy"] is False:
        return EXIT_UNHEALTHY
    return 0 if st["attached"] else EXIT_NOT_ATTACHED


# --- stats -----------------------------------------------------------------------------------

STATS_COLUMNS = [
    # header, key, kind
    ("ORIG", "orig_mem", "bytes"),
    ("STORED", "stored_mem", "bytes"),
    ("RATIO", "ratio", "ratio"),
    ("PAGES", "pages", "int"),
    ("SAME", "same_pages", "int"),
    ("RAW", "raw_pages", "int"),
    ("SHARED", "shared_pages", "int"),
    ("COMP", "compressed_pages", "int"),
    ("UNITS", "units", "int"),
    ("POOL", "pool_resident_bytes", "bytes"),
    ("META", "meta_bytes", "bytes"),
    ("LIMIT", "max_size", "bytes"),
    ("ENOSPC", "enospc", "int"),
    ("CODECS", "codec_pages", "codecs"),
]


def _stats_cell(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return _fmt(value)
    if kind == "ratio":
        try:
            return f"{float(value):.2f}"
        except (TypeError, ValueError):
            return str(value)
    if kind == "codecs":
        if isinstance(value, dict):
            return ",".join(f"{k}:{v}" for k, v in sorted(value.items())) or "-"
        return str(value)
    return str(value)


def stats_table(rows: list[dict], header: bool = True) -> str:
    cells = [[_stats_cell(r.get(key), kind) for _, key, kind in STATS_COLUMNS] for r in rows]
    heads = [h for h, _, _ in STATS_COLUMNS]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    widths = [max(w, 6) for w in widths]
    out = []

    def line(vals):
        # numbers right-aligned like zramctl/free; the last (text) column left-aligned
        parts = [v.rjust(w) for v, w in zip(vals[:-1], widths[:-1])] + [vals[-1]]
        return " ".join(parts).rstrip()

    if header:
        out.append(line(heads))
    out.extend(line(c) for c in cells)
    return "\n".join(out)


def _control_path(args) -> str:
    if args.control:
        return args.control
    from .device import RunState
    run_dir = _run_dir(args)
    state = RunState.load(run_dir)
    if state is not None and state.control_socket:
        return state.control_socket
    path = os.path.join(run_dir, "control.sock")
    if not os.path.exists(path):
        raise CliError(f"no server in {run_dir} (no control socket): start one with "
                       f"`{PROG} up` or `{PROG} serve`, or pass --control PATH", EXIT_RUNTIME)
    return path


def _fetch_stats(path: str) -> dict:
    from . import control
    try:
        reply = control.request(path, "stats")
    except control.ControlError as e:
        raise CliError(f"stats from {path}: {e}", EXIT_RUNTIME) from None
    except OSError as e:
        raise CliError(f"cannot reach the control socket {path}: {e.strerror or e}; "
                       f"is the server running?", EXIT_RUNTIME) from None
    reply = dict(reply)
    reply.pop("ok", None)
    return reply


def cmd_stats(args) -> int:
    path = _control_path(args)
    if args.watch is None:
        st = _fetch_stats(path)
        if args.json:
            print(json.dumps(st, sort_keys=True))
        else:
            print(stats_table([st]))
        return 0
    if args.watch <= 0:
        raise CliError("--watch: SECONDS must be > 0")
    first = True
    try:
        while True:
            st = _fetch_stats(path)
            if args.json:
                print(json.dumps(st, sort_keys=True), flush=True)
            else:
                print(stats_table([st], header=first), flush=True)
            first = False
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


# --- demo ------------------------------------------------------------------------------

def cmd_demo(args) -> int:
    from . import demo  # lazy: pulls in the workload machinery
    return int(demo.main(args) or 0)


# --- parser ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compressed, deduplicating userspace swap device for agent sandboxes.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config", metavar="PATH",
                   help="config file (default /etc/agentzip/config.yaml if it exists)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="state directory (default: device.run_dir, /run/agentzip)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("serve", help="run only the NBD server in the foreground")
    s.add_argument("--socket", metavar="PATH", help="NBD unix socket (default RUN_DIR/nbd.sock)")
    s.add_argument("--control", metavar="PATH",
                   help="control socket (default RUN_DIR/control.sock)")
    s.add_argument("--size", metavar="SIZE", help="device size, e.g. 8G (default device.size)")
    s.add_argument("--plugin", help=argparse.SUPPRESS)
    s.add_argument("--no-mlock", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("up", help="start the server and attach it as swap")
    s.add_argument("--priority", type=int, metavar="N",
                   help="swap priority (default device.swap_priority)")
    s.add_argument("--size", metavar="SIZE", help="device size, e.g. 8G (default device.size)")
    s.add_argument("--allow-zswap", action="store_true",
                   help="attach even though zswap is enabled (double compression)")
    s.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    s.add_argument("--plugin", help=argparse.SUPPRESS)
    s.add_argument("--no-mlock", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("down", help="swapoff, detach and stop the server")
    s.add_argument("--force", action="store_true",
                   help="swapoff even when available memory looks too small")
    s.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_down)

    s = sub.add_parser("status", help="server, device, swap area, warnings")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("stats", help="store statistics (orig, stored, ratio, pages)")
    s.add_argument("--json", action="store_true", help="print the stats JSON object")
    s.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS")
    s.add_argument("--control", metavar="PATH", help="control socket (default from run dir)")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("demo", help="bring the device up, squeeze a workload into it, report")
    s.add_argument("--mb", type=float, default=None, help="workload size in MB (default 300)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--swap", default="agentzip",
                   help="agentzip | zram-lz4 | zram-lzo-rle (comparison)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_demo)
    cli_dict.register(sub)
    cli_scope.register(sub)
    cli_tune.register(sub)  # also adds `up --tune`
    cli_doctor.register(sub)
    cli_cgstats.register(sub)  # adds `stats --cgroup`
    cli_metrics.register(sub)
    units_install.register(sub)
    cli_k8s.register(sub)  # webhook, node-agent
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from .config import ConfigError
    except ImportError:  # pragma: no cover - config module missing
        ConfigError = ValueError  # noqa: N806
    try:
        from .device import DeviceError
    except ImportError:  # pragma: no cover
        DeviceError = RuntimeError  # noqa: N806
    try:
        return args.func(args)
    except CliError as e:
        _err(str(e))
        return e.code
    except (SetupError, ConfigError) as e:
        _err(str(e).splitlines()[0] if str(e) else type(e).__name__)
        return EXIT_SETUP
    except DeviceError as e:
        msg = str(e)
        first, _, rest = msg.partition("\n")
        _err(first)
        if rest:  # e.g. the server's log tail: useful, but after the one error line
            print(rest, file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        _err(f"{e.filename + ': ' if getattr(e, 'filename', None) else ''}"
             f"{e.strerror or e}")
        return EXIT_RUNTIME


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
