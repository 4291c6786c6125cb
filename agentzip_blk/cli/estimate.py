"""`agentzip-blk estimate --pid PID | --cgroup PATH`: predict the ratio on live processes
(read-only: a sample of their resident anonymous pages, compressed as the store would)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from ..cgroups import procmem
from ..codec.estimate import Estimate, estimate_pages, format_estimate
from . import progress as progress_bars


def register(subparsers) -> None:
    e = subparsers.add_parser("estimate", help="predict the ratio on live processes (read-only)")
    target = e.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, action="append", metavar="PID",
                        help="process to sample (repeat for several)")
    target.add_argument("--cgroup", metavar="PATH", help="cgroup directory (v1 or v2)")
    e.add_argument("--sample", type=int, default=20000, help="pages to read at most (default 20000)")
    e.add_argument("--level", type=int, default=3, help="zstd level for the dictionary rows")
    e.add_argument("--no-dictionaries", action="store_true",
                   help="skip the rows with the shipped dictionaries (faster)")
    e.add_argument("--json", action="store_true", help="print the estimate as a JSON object")
    e.set_defaults(func=cmd_estimate)


def estimate_pids(pids: Sequence[int], *, limit: int | None = 20000, level: int = 3,
                  dictionaries: bool = True, seed: int = 0, progress: bool = True) -> Estimate:
    """The estimate for live processes: a sample of their resident anonymous pages."""
    addresses = 0
    for pid in pids:
        try:
            addresses += len(procmem.resident_anon_addresses(pid))
        except procmem.ProcMemError:
            pass
    bar = progress_bars.pages("reading memory") if progress else None
    pages = procmem.process_pages(pids, limit=limit, seed=seed, progress=bar)
    if not pages:
        raise procmem.ProcMemError(f"no resident anonymous pages readable in {list(pids)}")
    bar2 = progress_bars.pages("compressing") if progress else None
    est = estimate_pages(pages, level=level, dictionaries=dictionaries, seed=seed, progress=bar2)
    est.pids = list(pids)
    est.resident_pages = max(addresses, len(pages))
    return est


def cmd_estimate(args) -> int:
    pids = args.pid or procmem.cgroup_pids(args.cgroup)
    if not pids:
        print(f"agentzip-blk: error: no processes in {args.cgroup}", file=sys.stderr)
        return 1
    est = estimate_pids(pids, limit=args.sample, level=args.level,
                        dictionaries=not args.no_dictionaries, progress=not args.json)
    if args.json:
        print(json.dumps(est.to_dict(), indent=1))
    else:
        print(format_estimate(est))
    return 0
