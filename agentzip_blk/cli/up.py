"""`agentzip-blk up [--tune]`: start the server and attach it as swap; with --tune, also the
tuner in the background (logging to RUN/tuner.log) when an enabled scope exists; `down`
stops it and restores whatever it recorded. Already up with the same settings: exit 0."""

from __future__ import annotations

import argparse
import os

from ..cgroups.tuner.daemon import running_pid, start_daemon
from ..config import ConfigError, load_file
from ..host import attach, facts, health
from ..host.runstate import RunState
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
    s = sub.add_parser("up", help="start the server and attach it as swap")
    s.add_argument("--priority", type=int, metavar="N",
                   help="swap priority (default device.swap_priority)")
    s.add_argument("--size", metavar="SIZE", help="device size, e.g. 8G (default device.size)")
    s.add_argument("--allow-zswap", action="store_true",
                   help="attach even though zswap is enabled (double compression)")
    s.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    s.add_argument("--plugin", help=argparse.SUPPRESS)
    s.add_argument("--no-mlock", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--tune", action="store_true",
                   help="also start the tuner in the background (when a scope is enabled)")
    s.set_defaults(func=cmd_up)


def _device_settings(config, size: int | None, priority: int | None) -> dict:
    """What a running device cannot change: everything but the scopes (the tuner's business,
    edited while the device is up) and the exporter's address, plus the size and priority
    asked for."""
    settings = config.to_dict()
    settings.pop("scopes", None)
    settings.pop("metrics", None)
    return {"config": settings, "size": size or config.device.size,
            "priority": config.device.swap_priority if priority is None else priority}


def _already_up(args, config, run_dir: str, size: int | None) -> str | None:
    """The state `up` asks for may be there already: a healthy device from this run dir with
    the same settings. Then `up` has nothing to do and says so (exit 0), as `systemctl start`
    of a running unit does; a device with other settings cannot be changed while it is swap,
    so that is an error (exit 2). Anything else (no device, stale or unhealthy) is left to
    attach.up, which cleans up or says what is wrong."""
    state = RunState.load(run_dir)
    if state is None:
        return None
    st = health.status(run_dir)
    if not st["attached"] or st["healthy"] is not True or not state.config_path:
        return None
    try:
        # the file `up` wrote, alone: RUN/config.d is nobody's config
        running = load_file(state.config_path, sha256=state.config_sha256)
    except ConfigError:
        return None
    want = _device_settings(config, size, args.priority)
    have = _device_settings(running, state.size, state.swap_priority)
    other_plugin = args.plugin and args.plugin not in (state.plugin, os.path.basename(state.plugin or ""))
    if want != have or other_plugin:
        diff = sorted(k for k in want["config"] if want["config"][k] != have["config"][k])
        diff += [k for k in ("size", "priority") if want[k] != have[k]]
        diff += ["plugin"] if other_plugin else []
        raise CliError(f"a device is already attached from {run_dir} with other settings "
                       f"({', '.join(diff)}): `{PROG} down` first to change them")
    return (f"{state.device}: already up, {fmt(state.size)}, priority {state.swap_priority}; "
            f"nbdkit pid {state.nbdkit_pid}; run dir {run_dir}")


def cmd_up(args) -> int:
    """up, and with --tune the tuner in the background once the device is attached."""
    facts.require_root(f"{PROG} up")
    config = config_of(args)
    run_dir = run_dir_of(args, config)
    size = device_size_arg(args.size)
    same = _already_up(args, config, run_dir, size)
    if same is not None:
        print(same)
        if args.tune:
            if running_pid(run_dir):
                print(f"tuner already running, pid {running_pid(run_dir)}")
            else:
                _start_tuner(args, config, run_dir)
        return 0
    state = attach.up(config, args.config, run_dir, args.priority, size, plugin=args.plugin,
                      allow_zswap=args.allow_zswap, timeout=args.timeout,
                      mlock=not args.no_mlock)
    via = (f"kernel nbd {state.nbd_device}" if state.mode == "nbd" else
           f"nbdfuse pid {state.nbdfuse_pid} + {state.loop_device} (direct I/O)"
           if state.frontend == "nbdfuse" else
           f"its FUSE file {state.fuse_file} + {state.loop_device} (direct I/O)")
    print(f"{state.device}: swap on, {fmt(state.size)}, priority {state.swap_priority}; "
          f"nbdkit pid {state.nbdkit_pid}, {via}; run dir {run_dir}")
    if args.tune:
        _start_tuner(args, config, run_dir)
    return 0


def _start_tuner(args, config, run_dir: str) -> None:
    if not any(s.enabled for s in config.scopes):
        print(f"tuner not started: no enabled scope (`{PROG} scope add --cgroup GLOB`)")
        return
    try:
        pid = start_daemon(run_dir, args.config)
    except RuntimeError as e:
        raise CliError(f"device is up, but {e}", EXIT_RUNTIME) from None
    print(f"tuner pid {pid} started; log {os.path.join(run_dir, 'tuner.log')}")
