"""``agentzip-blk tune``: the tuner in the foreground (``up --tune`` starts it in the
background: cli.up).

``tune`` logs one line per decision on stdout and, when it stops (Ctrl-C, SIGTERM), puts back
every cgroup setting it changed unless ``--keep``; ``down`` stops a background tuner and
restores whatever is still recorded.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ._common import PROG, CliError, config_of, run_dir_of, size_arg


def _settings(args, config):
    from ..cgroups.tuner.controller import TunerSettings

    floor = size_arg(args.floor) if args.floor else None
    target = args.pressure_target / 100.0 if args.pressure_target is not None else None
    s = TunerSettings.from_config(config, interval=args.interval, floor=floor, mode=args.mode,
                                  max_probe=args.max_probe, pressure_target=target,
                                  grace=args.grace, hold=args.hold, fault_cost_us=args.fault_cost_us,
                                  pod_swap_max=args.pod_swap_max or None)
    try:
        s.check()
    except ValueError as e:
        raise CliError(f"tune: {e}") from None
    return s


def _scopes_reader(config_path: str | None, config, log):
    """Scopes re-read from the file every step, so `scope` edits apply at once; a broken
    edit keeps the last good list (and says so once)."""
    from ..cgroups.scopes import list_scopes
    from ..config import ConfigError

    last = {"scopes": list(config.scopes), "error": None}

    def read():
        if config_path is None or not os.path.exists(config_path):
            return last["scopes"]
        try:
            last["scopes"] = list_scopes(config_path)
            last["error"] = None
        except ConfigError as e:
            if str(e) != last["error"]:
                log(f"tune: config unreadable, keeping the previous scopes: {e}")
            last["error"] = str(e)
        return last["scopes"]

    return read


def cmd_tune(args) -> int:
    from .. import procfs
    from ..cgroups.backends import open_backend
    from ..cgroups.ledger import Ledger
    from ..cgroups.tuner.daemon import TunerBusy, acquire_instance, release_instance
    from ..cgroups.tuner.loop import Tuner
    from ..config import DEFAULT_CONFIG_PATH
    from ..config.quantities import format_bytes
    from ..datapath import control
    from ..host import facts
    from ..host.heartbeat import write as write_heartbeat
    from ..host.runstate import RunState

    root = args.cgroup_root or "/"
    if root == "/":
        facts.require_root(f"{PROG} tune")
    config = config_of(args)
    run_dir = run_dir_of(args, config)
    settings = _settings(args, config)
    try:
        fd = acquire_instance(run_dir)
    except TunerBusy as e:
        raise CliError(str(e)) from None

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        ledger = Ledger(run_dir, fake=root != "/")
        backend = open_backend(root, writer=ledger)
        ledger.rel_of = backend.rel_of
        config_path = args.config or (DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)

        def state():
            try:
                return RunState.load(run_dir)
            except Exception:
                return None

        def device_ok() -> bool:
            st = state()
            return st is not None and procfs.swap_area(st.device) is not None

        def pingpong():
            st = state()
            if st is None or not st.control_socket:
                return None
            return control.request(st.control_socket, "stats", timeout=2.0).get("pingpong")

        def protected():
            st = state()
            return [p for p in ((st.nbdkit_pid, st.nbdfuse_pid) if st else ()) if p]

        tuner = Tuner(backend, ledger, _scopes_reader(config_path, config, log), settings,
                      pingpong=pingpong, device_ok=None if args.without_device else device_ok,
                      protected_pids=protected, log=log)
        log(f"tune: {backend.kind} memory hierarchy at {backend.mount}; mode {settings.mode}, "
            f"interval {settings.interval:g}s, pressure target {settings.pressure_target * 100:g}%, "
            f"floor {format_bytes(settings.floor)}, max probe {settings.max_probe:.0%}, "
            f"grace {settings.grace:g}s, hold {settings.hold:g}s; config {config_path or '(defaults)'}, "
            f"ledger {ledger.file}")
        stop = threading.Event()

        def on_signal(signum, frame):
            # raise, so that a long synchronous reclaim write is interrupted too (v1 limit
            # writes give up on a pending signal); the ledger is write-ahead, so stopping
            # anywhere leaves a record that restores correctly
            stop.set()
            raise KeyboardInterrupt(f"signal {signum}")

        def beat() -> None:
            # ready while the device is swap (or --without-device): the tuner has work then
            if args.heartbeat:
                ok = args.without_device or device_ok()
                try:
                    write_heartbeat(args.heartbeat, ok, "" if ok else
                                    f"no swap device attached from {run_dir}")
                except OSError as e:
                    log(f"tune: heartbeat {args.heartbeat}: {e.strerror or e}")

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            tuner.run(stop, steps=args.steps, after_step=beat)
        except KeyboardInterrupt:
            pass
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            # no signal may cut the restore short
            ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGHUP,
                                                                      signal.SIGINT)}
            try:
                if args.keep:
                    log(f"tune: stopped; settings kept (recorded in {ledger.file}; "
                        f"`{PROG} down` restores them)")
                else:
                    tuner.restore()
            finally:
                for s, h in ignored.items():
                    signal.signal(s, h)
    finally:
        release_instance(run_dir, fd)
    return 0


def _add_tuning_options(s) -> None:
    s.add_argument("--interval", type=float, metavar="SECONDS", help="seconds between decisions (2)")
    s.add_argument("--floor", metavar="SIZE", help="never push a cgroup below this resident size (64M)")
    s.add_argument("--mode", choices=("reclaim", "limit"),
                   help="reclaim: push out once per decision (default); limit: keep a cap")
    s.add_argument("--pressure-target", type=float, metavar="PERCENT",
                   help="stall time to aim for (default policy.pressure_target, 0.1)")
    s.add_argument("--max-probe", type=float, metavar="FRACTION",
                   help="most of a cgroup's usage pushed out per interval (0.05)")
    s.add_argument("--grace", type=float, metavar="SECONDS",
                   help="leave a new cgroup alone this long (policy.cold_grace_period)")
    s.add_argument("--hold", type=float, metavar="SECONDS",
                   help="no probing this long after a backoff (policy.warm_threshold_ms)")
    s.add_argument("--fault-cost-us", type=float, metavar="US",
                   help="stall per major fault for the v1 pressure estimate (200)")


def register(sub) -> None:
    s = sub.add_parser("tune", help="push scoped cgroups' cold pages into the device (foreground)")
    _add_tuning_options(s)
    s.add_argument("--steps", type=int, metavar="N", help="stop after N decisions per cgroup")
    s.add_argument("--keep", action="store_true",
                   help="on exit keep the settings (down restores them) instead of restoring")
    s.add_argument("--heartbeat", metavar="FILE",
                   help="write FILE after every step, for Kubernetes probes "
                        "(python -m agentzip_blk.host.heartbeat FILE --max-age S [--ready])")
    s.add_argument("--pod-swap-max", action="store_true",
                   help="also write memory.swap.max = max on kubelet Pod cgroups (kubepods*), "
                        "which the kubelet's memorySwap.swapBehavior manages otherwise")
    s.add_argument("--cgroup-root", help=argparse.SUPPRESS)  # tests: fake cgroupfs tree
    s.add_argument("--without-device", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_tune)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as `agentzip-blk tune`")
