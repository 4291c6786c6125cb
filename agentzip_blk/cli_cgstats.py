"""``agentzip-blk stats --cgroup GLOB``: orig/stored/ratio per cgroup (see cgstats).

Adds ``--cgroup`` to the existing ``stats`` subcommand; without it ``stats`` is unchanged.
"""

from __future__ import annotations

import argparse
import json


def _row(name: str, r: dict) -> list[str]:
    from .cli import _fmt

    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    if r["ratio"] is None and r["pages"]:
        ratio = "inf"  # only zero / same-filled pages: nothing stored
    return [name, str(r["pids"]), _fmt(r["orig_mem"]), _fmt(r["stored_mem"]), ratio,
            str(r["pages"]), str(r["zero_pages"]), str(r["same_pages"]), str(r["disk_pages"]),
            _fmt(r["kernel_swap"]) if r.get("kernel_swap") is not None else "-"]


def table(res: dict) -> str:
    from .cli import _fmt

    heads = ["CGROUP", "PIDS", "ORIG", "STORED", "RATIO", "PAGES", "ZERO", "SAME", "DISK", "KSWAP"]
    rows = [_row(r["cgroup"], r) for r in res["cgroups"]]
    if len(res["cgroups"]) > 1:
        rows.append(_row("total", res["total"]))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join([heads[0].ljust(widths[0])] + [h.rjust(w) for h, w in zip(heads[1:], widths[1:])])]
    for r in rows:
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
    if not res["cgroups"]:
        lines.append("(no cgroup matches)")
    st = res["store"]
    lines.append(f"device {res['device']} (swap type {res['swap_type']}): {st['pages']} pages, "
                 f"orig {_fmt(st['orig_mem'])}, compressed {_fmt(st['compressed_bytes'])}, "
                 f"stored_mem {_fmt(st['stored_mem'])} with pool slack and metadata")
    lines.append("ORIG counts kernel zero pages (ZERO), kept out of the device, as stored in 0 "
                 "bytes; STORED is compressed payload, shared blobs split between their slots")
    return "\n".join(lines)


def cmd_stats_cgroup(args) -> int:
    from . import cli, system
    from .cgroups import cgstats
    from .cgroups.backends import open_backend
    from .device import RunState

    system.require_root(f"{cli.PROG} stats --cgroup (reads /proc/PID/pagemap)")
    run_dir = cli._run_dir(args)
    state = RunState.load(run_dir)
    if state is None or not state.device or system.swap_area(state.device) is None:
        raise cli.CliError(f"no device attached from {run_dir}: `{cli.PROG} up` first",
                           cli.EXIT_RUNTIME)
    control_path = cli._control_path(args)
    backend = open_backend(args.cgroup_root or "/")
    try:
        res = cgstats.collect(backend, args.cgroup, control_path, state.device)
    except ValueError as e:
        raise cli.CliError(str(e), cli.EXIT_RUNTIME) from None
    print(json.dumps(res, sort_keys=True) if args.json else table(res))
    return 0


def register(sub) -> None:
    stats = sub.choices["stats"]
    stats.add_argument("--cgroup", metavar="GLOB", action="append",
                       help="per cgroup matching GLOB (anywhere in the hierarchy; repeatable): "
                            "orig, stored and ratio of its swapped pages")
    stats.add_argument("--cgroup-root", help=argparse.SUPPRESS)
    orig = stats.get_default("func")

    def cmd_stats(args) -> int:
        if args.cgroup:
            if args.watch is not None:
                from .cli import CliError
                raise CliError("--cgroup and --watch cannot be combined")
            return cmd_stats_cgroup(args)
        return orig(args)

    stats.set_defaults(func=cmd_stats)
