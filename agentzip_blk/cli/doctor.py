"""``agentzip-blk doctor [--json]``: host checks, one pass/warn/fail line each, with fixes.

Exit status 0 when nothing failed (warnings allowed), 1 when a check failed, 4 when the
server health check failed (whatever else did): docs/JSON.md.
"""

from __future__ import annotations

from ._common import (
    EXIT_UNHEALTHY,
    add_cgroup_options,
    cgroup_root_of,
    config_of,
    run_dir_of,
)


def cmd_doctor(args) -> int:
    from ..host import doctor

    try:
        config = config_of(args)
    except Exception as e:  # a broken config is a finding, not a reason to stop checking
        config = None
        config_error = str(e)
    else:
        config_error = None
    run_dir = run_dir_of(args, config) if config is not None else (args.run_dir or "/run/agentzip")
    checks = doctor.diagnose(doctor.gather(run_dir, config, root=cgroup_root_of(args),
                                          config_path=args.config,
                                          kubelet_config=args.kubelet_config))
    if config_error:
        checks.append(doctor.Check("config", doctor.FAIL, config_error, "fix the named key"))
    if args.json:
        print(doctor.to_json(checks))
    else:
        print(doctor.render(checks))
    if any(c.name == "server health" and c.status == doctor.FAIL for c in checks):
        return EXIT_UNHEALTHY
    return 1 if doctor.worst(checks) == doctor.FAIL else 0


def register(sub) -> None:
    s = sub.add_parser("doctor", help="check the host: kernel, cgroups, swap, zswap, attach path")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    add_cgroup_options(s)
    s.add_argument("--kubelet-config", metavar="PATH",
                   help="the kubelet's config file, for its swap settings (default: the file "
                        "the running kubelet's --config names, with its --config-dir drop-ins "
                        "and --fail-swap-on; else /var/lib/kubelet/config.yaml; absent: not a "
                        "Kubernetes node)")
    s.set_defaults(func=cmd_doctor)
