"""``agentzip-blk doctor [--json]``: host checks, one pass/warn/fail line each, with fixes.

Exit status 0 when nothing failed (warnings allowed), 1 when a check failed, 4 when the
server health check failed (whatever else did): docs/JSON.md.
"""

from __future__ import annotations

import argparse


def cmd_doctor(args) -> int:
    from . import cli, doctor

    try:
        config = cli._load_config(args)
    except Exception as e:  # a broken config is a finding, not a reason to stop checking
        config = None
        config_error = str(e)
    else:
        config_error = None
    run_dir = cli._run_dir(args, config) if config is not None else (args.run_dir or "/run/agentzip")
    checks = doctor.diagnose(doctor.gather(run_dir, config, root=args.cgroup_root or "/"))
    if config_error:
        checks.append(doctor.Check("config", doctor.FAIL, config_error, "fix the named key"))
    if args.json:
        print(doctor.to_json(checks))
    else:
        print(doctor.render(checks))
    if any(c.name == "server health" and c.status == doctor.FAIL for c in checks):
        return cli.EXIT_UNHEALTHY
    return 1 if doctor.worst(checks) == doctor.FAIL else 0


def register(sub) -> None:
    s = sub.add_parser("doctor", help="check the host: kernel, cgroups, swap, zswap, attach path")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--cgroup-root", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_doctor)
