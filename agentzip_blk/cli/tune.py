"""``agentzip-blk tune``: the tuner in the foreground (``up --tune`` starts it in the
background: cli.up). The options become TunerSettings; cgroups.tuner.daemon.run does the rest.

``tune`` logs one line per decision on stdout and, when it stops (Ctrl-C, SIGTERM), puts back
every cgroup setting it changed unless ``--keep``; ``down`` stops a background tuner and
restores whatever is still recorded.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._common import (
    PROG,
    CliError,
    add_cgroup_options,
    cgroup_root_of,
    cgroup_tree_of,
    config_of,
    run_dir_of,
    size_arg,
)


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


def cmd_tune(args) -> int:
    from ..cgroups.tuner import daemon
    from ..config import DEFAULT_CONFIG_PATH
    from ..host import facts

    if args.cgroup_tree is None:
        # cgroupfs, wherever it is mounted, takes root's writes only; a tree of plain files
        # (the tests') belongs to whoever made it
        facts.require_root(f"{PROG} tune")
    config = config_of(args)
    run_dir = run_dir_of(args, config)
    settings = _settings(args, config)
    config_path = args.config or (DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)
    try:
        return daemon.run(run_dir, config, config_path, settings,
                          cgroup_root=cgroup_root_of(args), cgroup_tree=cgroup_tree_of(args),
                          steps=args.steps, keep=args.keep, heartbeat=args.heartbeat,
                          without_device=args.without_device)
    except daemon.TunerBusy as e:
        raise CliError(str(e)) from None


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
    add_cgroup_options(s)
    s.add_argument("--without-device", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_tune)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as `agentzip-blk tune`")
