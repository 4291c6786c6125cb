#!/usr/bin/env python3
"""Pool fragmentation under churn, with and without compaction (issue: tiered store).

A device full of agent-like pages of mixed compressibility is rewritten and trimmed at random,
round after round, the way swap slots are reused for days. The same seeded churn runs twice in
one process: once with `pool.defrag: false`, once with `true` (the maintenance round, which
compacts when >= 20% of arena bytes hold no live cell). Reports per round: arena bytes as
allocated, live cell bytes, fragmentation; compaction time. Writes results/bench_churn.json and
the BENCHMARKS.md section between <!-- bench_churn:begin --> and <!-- bench_churn:end -->.

    .venv/bin/python -m bench churn [--pages 65536] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

from agentzip_blk.store import PageStore, Tiering
from bench.harness.md import write_section
from bench.harness.results import REPO, write_json

ROOT = Path(REPO)

PAGE = 4096
SANDBOXES = 4


def page_maker(seed: int):
    """Pages whose compressed sizes spread over the size classes, like a real heap; `center`
    moves the spread, as the mix of what sandboxes swap drifts over time."""
    rnd = random.Random(seed)
    vocab = [w.encode() for w in "the tool call result json value error id name path user".split()]

    def make(center: float = 0.5) -> bytes:
        entropy = min(1.0, max(0.0, rnd.gauss(center, 0.2)))
        out = bytearray()
        while len(out) < PAGE:
            if rnd.random() < entropy:
                out += rnd.randbytes(rnd.randrange(4, 32))
            else:
                out += rnd.choice(vocab) + b" "
        return bytes(out[:PAGE])

    return make


def run(pages: int, rounds: int, refill: float, defrag: bool, seed: int) -> dict:
    tiering = Tiering(max_size=4 << 30, reclaim_threshold=100, defrag=defrag)
    store = PageStore(pages * PAGE, tiering=tiering)
    make = page_maker(seed)
    rnd = random.Random(seed + 1)
    # Four sandboxes share the device; the kernel hands out swap slots as pages arrive, so
    # each sandbox's pages are scattered over every arena.
    owner = [rnd.randrange(SANDBOXES) for _ in range(pages)]
    for slot in range(0, pages, 64):
        store.write(b"".join(make() for _ in range(64)), slot * PAGE)
    series = []
    compact_seconds = 0.0
    for r in range(rounds):
        # One sandbox exits: all its slots are freed (swap discards). Its successor swaps out
        # fewer pages, with another size mix (center drifts), into some of those slots.
        victim = r % SANDBOXES
        center = 0.15 + 0.7 * (r % 6) / 5
        mine = [slot for slot in range(pages) if owner[slot] == victim]
        for slot in mine:
            store.trim(slot * PAGE, PAGE)
        for slot in rnd.sample(mine, int(len(mine) * refill)):
            store.write(make(center), slot * PAGE)
        if defrag:
            t = time.perf_counter()
            store.maintain()
            compact_seconds += time.perf_counter() - t
        st = store.stats()
        series.append({
            "round": r + 1,
            "pool_bytes": st["pool_bytes"],
            "live_bytes": st["pool_live_bytes"],
            "fragmentation": st["fragmentation"],
            "pages": st["pages"],
            "orig_mem": st["orig_mem"],
            "stored_mem": st["stored_mem"],
        })
    st = store.stats()
    store.close()
    return {
        "defrag": defrag,
        "series": series,
        "final": series[-1],
        "pages_moved": st["pages_moved"],
        "compactions": st["compactions"],
        "compact_seconds": round(compact_seconds, 3),
        "max_fragmentation": max(p["fragmentation"] for p in series),
        "mean_fragmentation": sum(p["fragmentation"] for p in series) / len(series),
        "max_excess_bytes": max(p["pool_bytes"] - p["live_bytes"] for p in series),
    }


def render(result: dict) -> str:
    off, on = result["runs"]["off"], result["runs"]["on"]
    lines = [
        "## Pool fragmentation under churn (tiered store)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: Linux {result['machine']['kernel']}, {result['machine']['nproc']} cores; {result['date']}",
        "",
        f"{result['pages']} slots of agent-like pages (mixed compressibility, so every size class "
        f"is used), owned by {SANDBOXES} sandboxes whose pages are scattered over the pool; then "
        f"{result['rounds']} rounds, in each of which one sandbox exits (all its slots are "
        f"trimmed) and its successor swaps out {result['refill']:.0%} as many pages, of a size mix "
        "that drifts from round to round. Same seed for both runs.",
        "",
        "| defrag | fragmentation: mean | worst | end | most arena bytes over live | pages moved | compaction time |",
        "|---|---|---|---|---|---|---|",
    ]
    for run_ in (off, on):
        f = run_["final"]
        lines.append(
            f"| {'on' if run_['defrag'] else 'off'} | {run_['mean_fragmentation']:.1%} "
            f"| {run_['max_fragmentation']:.1%} | {f['fragmentation']:.1%} "
            f"| {run_['max_excess_bytes'] / 2**20:.1f} MiB | {run_['pages_moved']} "
            f"| {run_['compact_seconds']:.2f} s |"
        )
    lines += ["", "Fragmentation after each round:", "",
              "| defrag | " + " | ".join(str(p["round"]) for p in off["series"]) + " |",
              "|---|" + "---|" * len(off["series"])]
    for run_ in (off, on):
        lines.append(f"| {'on' if run_['defrag'] else 'off'} | "
                     + " | ".join(f"{p['fragmentation']:.0%}" for p in run_["series"]) + " |")
    lines += [
        "",
        "Fragmentation = 1 - live cell bytes / arena bytes. Without compaction, arenas that hold "
        "a few live cells of sandboxes still running stay mapped until the last of them exits; "
        "with it, the maintenance round moves cells out of the sparsest arenas of each class "
        "and unmaps them whenever fragmentation passes 20% (so it can sit just under 20%).",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--refill", type=float, default=0.5,
                    help="a new sandbox swaps out this share of what the one that exited held")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    result = {
        "command": " ".join([".venv/bin/python", "-m", "bench", "churn", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"kernel": platform.release(), "nproc": os.cpu_count()},
        "pages": args.pages, "rounds": args.rounds, "refill": args.refill,
        "runs": {},
    }
    for key, defrag in (("off", False), ("on", True)):
        print(f"churn with defrag {key} ...", flush=True)
        result["runs"][key] = run(args.pages, args.rounds, args.refill, defrag, args.seed)
        f = result["runs"][key]["final"]
        print(f"  arenas {f['pool_bytes'] >> 20} MiB, live {f['live_bytes'] >> 20} MiB, "
              f"fragmentation {f['fragmentation']:.1%}", flush=True)
    write_json(ROOT / "results" / "bench_churn.json", result)
    write_section(ROOT / "BENCHMARKS.md", "bench_churn", render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
