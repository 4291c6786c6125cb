"""The READY / CHECK / TOUCH / VERIFY protocol every workload in tools/workloads speaks.

A driver (``agentzip_blk.demo``, ``tools/bench.py``) starts a workload in a memory cgroup,
waits until it has built its data, squeezes it while it is idle, then makes it read
everything back and compare:

    stdout  READY <bytes>                  data built, checksum taken; <bytes>: the memory
                                           of the workload (its process tree's PSS)
    stdin   CHECK                          re-read everything now, stay alive
    stdout  CHECK ok|FAIL <checksum> <checksum_s> <touch_s> <pages>
    stdin   TOUCH                          re-read everything, compare, exit
    stdout  VERIFY ok <checksum> <checksum_s> <touch_s> <pages>    (exit 0)
            VERIFY FAIL <got> <want>                                (exit 1)

Both first read every page the workload's processes hold in RAM or in swap (``pagewalk.touch``,
timed: touch_s, the swap-in when they were swapped out), then recompute the checksum over all
of the data (checksum_s) and compare it with the one taken at build time. EOF on stdin exits
with status 2; diagnostics go to stderr. ``tools/workloads/node_text.js`` implements the same
protocol in JavaScript.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

import pagewalk


def serve(name: str, want: str, checksum: Callable[[], str], *,
          size: Callable[[], int] = pagewalk.rss_bytes,
          pids: Callable[[], Iterable] = lambda: ("self",),
          corrupt: Callable[[], None] | None = None,
          stdin=None, stdout=None) -> int:
    """Announce READY, then answer CHECK / TOUCH until TOUCH or EOF; returns the exit status.

    *checksum* recomputes the checksum over all data (compared with *want*); *pids* names the
    processes whose pages TOUCH reads (default: this one); *corrupt*, if given, is called
    before the TOUCH pass (tests of VERIFY FAIL).
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    print(f"READY {size()}", file=stdout, flush=True)
    for line in stdin:
        cmd = line.strip()
        if cmd not in ("TOUCH", "CHECK"):
            if cmd:
                print(f"{name}: unknown command {cmd!r}", file=sys.stderr, flush=True)
            continue
        if corrupt is not None and cmd == "TOUCH":
            corrupt()
        pages, dt_touch = pagewalk.touch(list(pids()))
        t = time.monotonic()
        got = checksum()
        dt = time.monotonic() - t
        ok = got == want
        if cmd == "CHECK":
            print(f"CHECK {'ok' if ok else 'FAIL'} {got} {dt:.3f} {dt_touch:.4f} {pages}",
                  file=stdout, flush=True)
            continue
        if ok:
            print(f"VERIFY ok {got} {dt:.3f} {dt_touch:.4f} {pages}", file=stdout, flush=True)
            return 0
        print(f"VERIFY FAIL {got} {want}", file=stdout, flush=True)
        return 1
    print(f"{name}: stdin closed before TOUCH", file=sys.stderr, flush=True)
    return 2
