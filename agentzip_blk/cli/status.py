"""`agentzip-blk status [--json]`: server, device, swap area, health, warnings.

Exit status 0 when the device is attached and healthy, 3 when nothing is attached, 4 when
something of ours is attached or running but the chain is not healthy (docs/JSON.md).
"""

from __future__ import annotations

import json

from ..host import health
from ._common import EXIT_NOT_ATTACHED, EXIT_UNHEALTHY, fmt, run_dir_of


def register(sub) -> None:
    s = sub.add_parser("status", help="server, device, swap area, warnings")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_status)


def _status_text(st: dict) -> str:
    lines = [f"run dir   {st['run_dir']}"]
    if st["state"] is None:
        lines.append("device    not attached")
    else:
        srv = st["server"]
        if srv["alive"]:
            lines.append(f"server    nbdkit pid {srv['pid']} running, rss {fmt(srv['rss'])}, "
                         f"size {fmt(srv['size'])}, plugin {srv['plugin']}")
        else:
            lines.append(f"server    nbdkit pid {srv['pid']} NOT running")
        if st["mode"] == "fuse" and st["nbdfuse"] is None:
            mnt = st["mount"] or {}
            lines.append(f"fuse      served by nbdkit, {mnt.get('file')} "
                         f"{'mounted' if mnt.get('mounted') else 'NOT mounted'}")
        if st["mode"] == "fuse":
            fz = st["nbdfuse"] or {}
            mnt = st["mount"] or {}
            if st["nbdfuse"] is not None:
                lines.append(f"nbdfuse   pid {fz.get('pid')} "
                             f"{'running' if fz.get('alive') else 'NOT running'}"
                             f"{', memory locked' if fz.get('locked') else ''}, "
                             f"{mnt.get('file')} "
                             f"{'mounted' if mnt.get('mounted') else 'NOT mounted'}")
            lp = st["loop"]
            if lp:
                dio = {True: "on", False: "OFF", None: "?"}[lp["dio"]]
                lines.append(f"loop      {lp['device']} "
                             f"{'attached' if lp['attached'] else 'NOT attached'}, "
                             f"direct I/O {dio}")
        else:
            lines.append(f"device    {st['device']} (kernel nbd)")
        sw = st["swap"]
        if sw:
            lines.append(f"swap      {sw['filename']} size {fmt(sw['size'])} used "
                         f"{fmt(sw['used'])} priority {sw['priority']}")
        else:
            lines.append("swap      off")
    if st["health"] is not None:
        h = st["health"]
        lines.append("health    OK" if h["ok"] else "health    FAIL: " + "; ".join(h["problems"]))
    others = st["other_swaps"]
    if others:
        lines.append("other swap areas:")
        for a in others:
            lines.append(f"          {a['filename']} size {fmt(a['size'])} used "
                         f"{fmt(a['used'])} priority {a['priority']}")
    lines.append(f"zswap     {'ENABLED' if st['zswap_enabled'] else 'off'}")
    for w in st["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    run_dir = run_dir_of(args)
    st = health.status(run_dir)
    if args.json:
        print(json.dumps(st, sort_keys=True))
    else:
        print(_status_text(st))
    if st["healthy"] is False:
        return EXIT_UNHEALTHY
    return 0 if st["attached"] else EXIT_NOT_ATTACHED
