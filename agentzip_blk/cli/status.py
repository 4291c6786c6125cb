"""`agentzip-blk status [-o COL,..] [--raw] [-n] [-b] [--json]`: our device and the other
swap areas (a table like zramctl's), then health problems and warnings.

Exit status 0 when the device is attached and healthy, 3 when nothing is attached, 4 when
something of ours is attached or running but the chain is not healthy (docs/JSON.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..host import health
from ._common import EXIT_NOT_ATTACHED, EXIT_UNHEALTHY, PROG, run_dir_of
from .table import BYTES, INT, Column, Table, key, plain


def _frontend(st: dict) -> str | None:
    if st["mode"] == "nbd":
        return "nbd"
    if st["mode"] == "fuse":
        return "nbdfuse" if st["nbdfuse"] is not None else "fuse"
    return None


def _health(st: dict) -> str | None:
    if st["health"] is not None:
        return "OK" if st["health"]["ok"] else "FAIL"
    return None if st["state"] is None else "FAIL"


def _ours(st: dict) -> dict:
    """Our device as a row: what /proc/swaps says of it, and the chain behind it."""
    srv = st["server"] or {}
    sw = st["swap"] or {}
    lp = st["loop"] or {}
    mnt = st["mount"] or {}
    fz = st["nbdfuse"] or {}
    return {
        "name": st["device"], "type": "agentzip", "size": sw.get("size", srv.get("size")),
        "used": sw.get("used"), "priority": sw.get("priority"),
        "server": srv.get("pid") if srv.get("alive") else
        (f"{srv.get('pid')}(dead)" if srv.get("pid") else None),
        "frontend": _frontend(st), "datapath": srv.get("datapath"),
        "request_priority": srv.get("request_priority"), "health": _health(st),
        "swap": "on" if st["swap"] else "off",
        "rss": srv.get("rss") if srv.get("alive") else None,
        "loop": lp.get("device"), "dio": {True: "on", False: "off"}.get(lp.get("dio")),
        "rotational": {True: "yes", False: "no"}.get(lp.get("rotational")),
        "file": mnt.get("file"), "mounted": {True: "yes", False: "no"}.get(mnt.get("mounted")),
        "nbdfuse": fz.get("pid"), "plugin": srv.get("plugin"), "run_dir": st["run_dir"],
        "version": srv.get("version"), "restarts": srv.get("restarts"),
        "recoveries": srv.get("recoveries"),
        "started": (time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(srv["started"]))
                    if isinstance(srv.get("started"), (int, float)) else None),
    }


def _other(area: dict) -> dict:
    return {"name": area["filename"], "type": area["type"], "size": area["size"],
            "used": area["used"], "priority": area["priority"], "swap": "on"}


STATUS = Table([
    Column("NAME", "swap device or file", key("name")),
    Column("TYPE", "agentzip (ours), or the kernel's type of another area", key("type")),
    Column("SIZE", "swap area size", key("size"), BYTES),
    Column("USED", "swap in use", key("used"), BYTES),
    Column("PRIO", "swap priority", key("priority"), INT),
    Column("SERVER", "nbdkit pid (ours)", key("server")),
    Column("FRONTEND", "how the kernel reaches the server: fuse, nbdfuse, nbd", key("frontend")),
    Column("DATAPATH", "who answers the device's reads: native (the C extension) or python",
           key("datapath")),
    Column("REQPRIO", "the priority the FUSE workers answer reads at: realtime (SCHED_FIFO 1) "
           "or normal (device.request_priority)", key("request_priority"), default=False),
    Column("HEALTH", "OK, or FAIL (exit status 4; the problems follow the table)", key("health")),
    Column("SWAP", "on, or off (not in /proc/swaps)", key("swap"), default=False),
    Column("RSS", "server resident memory", key("rss"), BYTES, default=False),
    Column("LOOP", "loop device over the FUSE file", key("loop"), default=False),
    Column("DIO", "direct I/O on the loop device", key("dio"), default=False),
    Column("ROTA", "loop device flagged rotational", key("rotational"), default=False),
    Column("FILE", "the FUSE file behind the loop device", key("file"), default=False),
    Column("MOUNTED", "the FUSE file is mounted", key("mounted"), default=False),
    Column("NBDFUSE", "nbdfuse pid (nbdfuse front-end)", key("nbdfuse"), default=False),
    Column("PLUGIN", "nbdkit plugin", key("plugin"), default=False),
    Column("RUNDIR", "run directory (ours)", key("run_dir"), default=False),
    Column("VERSION", "the agentzip-blk version the server runs (from its health reply)",
           key("version"), default=False),
    Column("STARTED", "when the server started (local time)", key("started"), default=False),
    Column("RESTARTS", "restarts without swapoff the device's store went through "
           "(agentzip-blk restart)", key("restarts"), INT, default=False),
    Column("RECOVERIES", "servers the holder started again after a crash, from the dead "
           "one's memory", key("recoveries"), INT, default=False),
])

EXAMPLES = f"""\
examples:
  {PROG} status                         our device and every other swap area
  {PROG} status -o NAME,USED -b --raw -n   for a script
  {PROG} status --json                  everything (docs/JSON.md)
"""


def register(sub) -> None:
    s = sub.add_parser("status", help="server, device, swap area, warnings",
                       description="Our swap device and the other swap areas as a table like "
                                   "zramctl's, then health problems and warnings. Exit status "
                                   "0 attached and healthy, 3 nothing attached, 4 FAIL.",
                       epilog=EXAMPLES + "\n" + STATUS.columns_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    STATUS.add_arguments(s, "print one JSON object (docs/JSON.md)")
    s.set_defaults(func=cmd_status)


def _notes(st: dict) -> list[str]:
    lines = []
    if st["state"] is None:
        lines.append(f"device not attached from {st['run_dir']}")
    if st["health"] is not None and not st["health"]["ok"]:
        lines.append("health FAIL: " + "; ".join(st["health"]["problems"]))
    lines.extend(f"warning: {w}" for w in st["warnings"])
    return lines


def status_text(st: dict, args: argparse.Namespace) -> tuple[str, list[str]]:
    """(the table, the notes): notes follow the table on stdout for people, go to stderr
    with --raw or -n so that stdout stays the table alone."""
    rows = ([_ours(st)] if st["state"] is not None else []) + [_other(a) for a in st["other_swaps"]]
    return STATUS.print_args(rows, args), _notes(st)


def cmd_status(args) -> int:
    STATUS.select(args.output, args.output_all)  # a bad -o is an error before any work
    run_dir = run_dir_of(args)
    st = health.status(run_dir)
    if args.json:
        print(json.dumps(st, sort_keys=True))
    else:
        table, notes = status_text(st, args)
        print(table)
        for line in notes:
            if plain(args):
                print(line)
            else:
                print(f"{PROG}: {line}", file=sys.stderr)
    if st["healthy"] is False:
        return EXIT_UNHEALTHY
    return 0 if st["attached"] else EXIT_NOT_ATTACHED
