"""`agentzip-blk stats [-o COL,..] [--raw] [-n] [-b] [--json] [--watch S]`: the store's statistics over the control socket;
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
from ._common import (
    EXIT_RUNTIME,
    PROG,
    CliError,
    add_cgroup_options,
    cgroup_root_of,
    control_path_of,
    fmt,
    run_dir_of,
)
from .table import BYTES, INT, RATIO, Column, Table, key, plain


def _dig(*path: str):
    def get(row: dict):
        for part in path:
            row = row.get(part) if isinstance(row, dict) else None
        return row
    return get


def _codecs(row: dict):
    value = row.get("codec_pages")
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in sorted(value.items())) or None
    return value


STATS = Table([
    Column("ORIG", "orig_mem: bytes of every live page (same-filled included)", key("orig_mem"), BYTES),
    Column("STORED", "stored_mem: everything the store holds for them", key("stored_mem"), BYTES),
    Column("RATIO", "orig_mem / stored_mem", key("ratio"), RATIO),
    Column("PAGES", "live pages", key("pages"), INT),
    Column("SAME", "same-filled pages (stored in 0 bytes)", key("same_pages"), INT),
    Column("RAW", "pages stored uncompressed", key("raw_pages"), INT),
    Column("SHARED", "pages sharing a blob with another (dedup)", key("shared_pages"), INT),
    Column("COMP", "compressed pages", key("compressed_pages"), INT),
    Column("UNITS", "live multi-page blobs (frames)", key("units"), INT),
    Column("WARM", "pages in the warm form (alone, fast codec)", key("warm_pages"), INT),
    Column("COLD", "pages in the cold form (dense frames) in the pool", key("cold_pages"), INT),
    Column("BACKLOG", "warm pages past the grace period, not yet packed",
           key("recompress_backlog"), INT),
    Column("POOL", "pool arena pages ever touched", key("pool_resident_bytes"), BYTES),
    Column("META", "tables, dedup index, codecs", key("meta_bytes"), BYTES),
    Column("LIMIT", "pool.max_size", key("max_size"), BYTES),
    Column("ENOSPC", "writes refused for lack of room", key("enospc"), INT),
    Column("CODECS", "pages per codec", _codecs),
    Column("SIZE", "device size", key("size"), BYTES, default=False),
    Column("ALGORITHM", "compression algorithm", key("algorithm"), default=False),
    Column("UNIQUE", "distinct blobs", key("unique_blobs"), INT, default=False),
    Column("DEDUP", "pages saved by deduplication", key("dedup_saved_pages"), INT, default=False),
    Column("COMPRESSED", "compressed payload bytes", key("compressed_bytes"), BYTES, default=False),
    Column("HOTCACHE", "hot cache bytes", key("hot_cache_bytes"), BYTES, default=False),
    Column("DISK", "disk tier bytes", key("disk_mem"), BYTES, default=False),
    Column("DISKPAGES", "pages in the disk tier", _dig("tiers", "disk", "pages"), INT, default=False),
    Column("WARMSTORED", "compressed bytes of the warm pages", key("warm_stored"), BYTES,
           default=False),
    Column("COLDSTORED", "compressed bytes of the cold pages in the pool", key("cold_stored"),
           BYTES, default=False),
    Column("RECOMP", "pages packed cold since start", key("recompressed_pages_total"), INT,
           default=False),
    Column("FRAG", "pool fragmentation (0-1)", key("fragmentation"), RATIO, default=False),
    Column("READS", "read requests", key("reads"), INT, default=False),
    Column("WRITES", "write requests", key("writes"), INT, default=False),
    Column("TRIMS", "trim requests", key("trims"), INT, default=False),
    Column("ERRORS", "failed requests", key("errors"), INT, default=False),
    Column("RSS", "server resident memory", _dig("server", "rss_bytes"), BYTES, default=False),
])


def _ratio(r: dict):
    if r["ratio"] is None and r["pages"]:
        return "inf"  # only zero / same-filled pages: nothing stored
    return r["ratio"]


CGROUPS = Table([
    Column("CGROUP", "the cgroup (or total, over several)", key("cgroup")),
    Column("PIDS", "processes read", key("pids"), INT),
    Column("ORIG", "bytes of its swapped pages", key("orig_mem"), BYTES),
    Column("STORED", "compressed payload of them (shared blobs split)", key("stored_mem"), BYTES),
    Column("RATIO", "ORIG / STORED", _ratio, RATIO),
    Column("PAGES", "its pages on our device", key("pages"), INT),
    Column("ZERO", "kernel zero pages (kept out of the device)", key("zero_pages"), INT),
    Column("SAME", "same-filled pages", key("same_pages"), INT),
    Column("DISK", "pages in the disk tier", key("disk_pages"), INT),
    Column("KSWAP", "swap the kernel charges it (memory.swap.current)", key("kernel_swap"), BYTES),
    Column("BLOB", "pages in compressed blobs", key("blob_pages"), INT, default=False),
    Column("OTHER", "its pages on other swap areas", key("other_swap_pages"), INT, default=False),
    Column("UNREADABLE", "processes whose pagemap could not be read", key("unreadable"), INT,
           default=False),
])

EXAMPLES = f"""\
examples:
  {PROG} stats                        the store in one line
  {PROG} stats -o ORIG,STORED,RATIO --raw -n -b    three numbers for a script
  {PROG} stats --watch 2              a line every 2 s
  {PROG} stats --cgroup 'agent-sandbox-*.slice'   per cgroup (as root)
"""


def register(sub) -> None:
    s = sub.add_parser("stats", help="store statistics (orig, stored, ratio, pages)",
                       description="The swap store's statistics from the server's control "
                                   "socket, as a table like zramctl's; with --cgroup, orig, "
                                   "stored and ratio per cgroup instead.",
                       epilog=EXAMPLES + "\n" + STATS.columns_help() + "\n\nwith --cgroup, "
                              + CGROUPS.columns_help().replace("available", "the"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    STATS.add_arguments(s, "print the stats JSON object (docs/JSON.md)")
    s.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS")
    s.add_argument("--control", metavar="PATH", help="control socket (default from run dir)")
    s.add_argument("--cgroup", metavar="GLOB", action="append",
                   help="per cgroup matching GLOB (anywhere in the hierarchy; repeatable): "
                        "orig, stored and ratio of its swapped pages")
    add_cgroup_options(s)
    s.set_defaults(func=cmd_stats)


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
    STATS.select(args.output, args.output_all)  # a bad -o fails before the socket is tried
    path = control_path_of(args)
    if args.watch is None:
        st = _fetch_stats(path)
        if args.json:
            print(json.dumps(st, sort_keys=True))
        else:
            print(STATS.print_args([st], args))
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
                print(STATS.print_args([st], args, headings=first and not args.noheadings),
                      flush=True)
            first = False
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def cgroup_table(res: dict, args: argparse.Namespace | None = None) -> str:
    rows = list(res["cgroups"])
    if len(rows) > 1:
        rows.append(dict(res["total"], cgroup="total"))
    if args is None:
        lines = [CGROUPS.render(rows, CGROUPS.defaults())]
    else:
        lines = [CGROUPS.print_args(rows, args)]
        if not plain(args):
            return lines[0]
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
    CGROUPS.select(args.output, args.output_all)
    facts.require_root(f"{PROG} stats --cgroup (reads /proc/PID/pagemap)")
    run_dir = run_dir_of(args)
    state = RunState.load(run_dir)
    if state is None or not state.device or procfs.swap_area(state.device) is None:
        raise CliError(f"no device attached from {run_dir}: `{PROG} up` first",
                       EXIT_RUNTIME)
    control_path = control_path_of(args)
    backend = open_backend(cgroup_root_of(args))
    try:
        res = cgstats.collect(backend, args.cgroup, control_path, state.device)
    except ValueError as e:
        raise CliError(str(e), EXIT_RUNTIME) from None
    print(json.dumps(res, sort_keys=True) if args.json else cgroup_table(res, args))
    return 0
