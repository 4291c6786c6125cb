"""`agentzip-blk stats [--json] [--watch S]`: the store's statistics over the control socket;
with `--cgroup GLOB`, orig/stored/ratio per matching cgroup instead (cgroups.cgstats)."""

from __future__ import annotations

import argparse
import json
import time

from .. import procfs
from ..cgroups import cgstats
from ..cgroups.backends import open_backend
from ..datapath import control
from ..host import facts
from ..host.runstate import RunState
from ._common import EXIT_RUNTIME, PROG, CliError, control_path_of, fmt, run_dir_of


def register(sub) -> None:
    s = sub.add_parser("stats", help="store statistics (orig, stored, ratio, pages)")
    s.add_argument("--json", action="store_true", help="print the stats JSON object")
    s.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS")
    s.add_argument("--control", metavar="PATH", help="control socket (default from run dir)")
    s.add_argument("--cgroup", metavar="GLOB", action="append",
                   help="per cgroup matching GLOB (anywhere in the hierarchy; repeatable): "
                        "orig, stored and ratio of its swapped pages")
    s.add_argument("--cgroup-root", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_stats)


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
        return fmt(value)
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


def _fetch_stats(path: str) -> dict:
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
    if args.cgroup:
        if args.watch is not None:
            raise CliError("--cgroup and --watch cannot be combined")
        return _cmd_stats_cgroup(args)
    path = control_path_of(args)
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


def _row(name: str, r: dict) -> list[str]:
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    if r["ratio"] is None and r["pages"]:
        ratio = "inf"  # only zero / same-filled pages: nothing stored
    return [name, str(r["pids"]), fmt(r["orig_mem"]), fmt(r["stored_mem"]), ratio,
            str(r["pages"]), str(r["zero_pages"]), str(r["same_pages"]), str(r["disk_pages"]),
            fmt(r["kernel_swap"]) if r.get("kernel_swap") is not None else "-"]


def cgroup_table(res: dict) -> str:
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
                 f"orig {fmt(st['orig_mem'])}, compressed {fmt(st['compressed_bytes'])}, "
                 f"stored_mem {fmt(st['stored_mem'])} with pool slack and metadata")
    lines.append("ORIG counts kernel zero pages (ZERO), kept out of the device, as stored in 0 "
                 "bytes; STORED is compressed payload, shared blobs split between their slots")
    return "\n".join(lines)


def _cmd_stats_cgroup(args) -> int:
    facts.require_root(f"{PROG} stats --cgroup (reads /proc/PID/pagemap)")
    run_dir = run_dir_of(args)
    state = RunState.load(run_dir)
    if state is None or not state.device or procfs.swap_area(state.device) is None:
        raise CliError(f"no device attached from {run_dir}: `{PROG} up` first",
                       EXIT_RUNTIME)
    control_path = control_path_of(args)
    backend = open_backend(args.cgroup_root or "/")
    try:
        res = cgstats.collect(backend, args.cgroup, control_path, state.device)
    except ValueError as e:
        raise CliError(str(e), EXIT_RUNTIME) from None
    print(json.dumps(res, sort_keys=True) if args.json else cgroup_table(res))
    return 0
