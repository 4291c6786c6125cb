"""``agentzip-blk metrics``: the Prometheus exporter's command line (logic in metrics.py;
prometheus_client is imported only when the command runs)."""

from __future__ import annotations

from ._common import (
    PROG,
    CliError,
    add_cgroup_options,
    cgroup_root_of,
    config_of,
    control_path_of,
    run_dir_of,
    serve_until_interrupted,
)


def cmd_metrics(args) -> int:
    from ..fleet.metrics import (
        BuildInfo,
        CgroupSource,
        Collector,
        HostSource,
        control_stats,
        make_server,
        parse_listen,
    )

    # --listen, else metrics.listen of the config (agentzip-blk.yaml(5)), validated there
    text = args.listen or config_of(args).metrics.listen
    try:
        listen = parse_listen(text)
    except ValueError as e:
        raise CliError(str(e)) from None

    def stats() -> dict:
        # resolved on every scrape: the exporter may start before the server (or outlive one)
        return control_stats(args.control or control_path_of(args))()

    cgroups_fn = None
    if not args.no_cgroups:
        cgroups_fn = CgroupSource(run_dir_of(args), args.config, cgroup_root_of(args),
                                  args.cgroup_interval)
    collector = Collector(stats, cgroups_fn, HostSource(run_dir_of(args), args.config),
                          BuildInfo.detect())
    server = make_server(listen, collector)
    host, port = server.server_address[:2]
    print(f"{PROG}: metrics on http://{host}:{port}/metrics", flush=True)
    return serve_until_interrupted(server)


def register(sub) -> None:
    s = sub.add_parser("metrics", help="Prometheus exporter (polls the server on each scrape)")
    s.add_argument("--listen", metavar="HOST:PORT",
                   help="address to serve /metrics on (default: metrics.listen of the "
                        "config, 127.0.0.1:9479)")
    s.add_argument("--control", metavar="PATH", help="control socket (default from run dir)")
    s.add_argument("--no-cgroups", action="store_true",
                   help="skip per-cgroup figures (they read /proc/PID/pagemap, root only)")
    s.add_argument("--cgroup-interval", type=float, default=30.0, metavar="SECONDS",
                   help="recompute per-cgroup figures at most this often (default 30)")
    add_cgroup_options(s)
    s.set_defaults(func=cmd_metrics)
