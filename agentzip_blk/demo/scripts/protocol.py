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
    stdin   ROUND <seed> <ws_fraction> <transient_mib>   one agent "act" (tools/bench_density.py)
    stdout  ROUND ok <act_s> <items> <bytes>             items verified, bytes they hold
            ROUND FAIL <item> <got> <want>               a touched item no longer matches

ROUND is answered by workloads started with ``--agent-loop`` (they take one digest per item of
their retained data at build time): it touches a seeded, skewed choice of those items
(``skewed_picks``: mostly the most recent ones, sometimes any), recomputes and compares their
digests, allocates and processes a transient buffer of about ``transient_mib`` MiB derived from
them, then frees it. A workload without ``--agent-loop`` answers ``ROUND FAIL - unsupported``.

Both first read every page the workload's processes hold in RAM or in swap (``pagewalk.touch``,
timed: touch_s, the swap-in when they were swapped out), then recompute the checksum over all
of the data (checksum_s) and compare it with the one taken at build time. EOF on stdin exits
with status 2; diagnostics go to stderr. ``tools/workloads/node_text.js`` implements the same
protocol in JavaScript.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable

import pagewalk

RECENT = 0.2  # the most recent fifth of a workload's items...
RECENT_SHARE = 0.8  # ...gets four picks in five; the rest go to any item


def skewed_picks(rng: random.Random, n: int, k: int) -> list[int]:
    """*k* item indices out of *n* (0 = oldest), distinct, in pick order: each pick is one of
    the newest RECENT*n items with probability RECENT_SHARE, else any item."""
    k = max(1, min(n, k))
    recent = max(1, int(n * RECENT))
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < k:
        i = n - 1 - rng.randrange(recent) if rng.random() < RECENT_SHARE else rng.randrange(n)
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


# one act: (rng, ws_fraction, transient_mib) -> (None, items, bytes) or (failed item, got, want)
RoundFn = Callable[[random.Random, float, float], tuple]


def _round(stdout, fn: RoundFn | None, args: list[str]) -> None:
    if fn is None:
        print("ROUND FAIL - unsupported (start the workload with --agent-loop)", file=stdout, flush=True)
        return
    seed, frac, mib = int(args[0]), float(args[1]), float(args[2])
    t = time.monotonic()
    res = fn(random.Random(seed), frac, mib)
    dt = time.monotonic() - t
    if res[0] is None:
        print(f"ROUND ok {dt:.4f} {res[1]} {res[2]}", file=stdout, flush=True)
    else:
        print(f"ROUND FAIL {res[0]} {res[1]} {res[2]}", file=stdout, flush=True)


def serve(name: str, want: str, checksum: Callable[[], str], *,
          size: Callable[[], int] = pagewalk.rss_bytes,
          pids: Callable[[], Iterable] = lambda: ("self",),
          corrupt: Callable[[], None] | None = None,
          act: RoundFn | None = None,
          stdin=None, stdout=None) -> int:
    """Announce READY, then answer CHECK / TOUCH / ROUND until TOUCH or EOF; returns the exit status.

    *checksum* recomputes the checksum over all data (compared with *want*); *pids* names the
    processes whose pages TOUCH reads (default: this one); *corrupt*, if given, is called
    before the TOUCH pass (tests of VERIFY FAIL); *act* answers ROUND (``RoundFn``).
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    print(f"READY {size()}", file=stdout, flush=True)
    for line in stdin:
        cmd = line.strip()
        if cmd.startswith("ROUND"):
            _round(stdout, act, cmd.split()[1:])
            continue
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
