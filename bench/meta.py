#!/usr/bin/env python3
"""Metadata per stored page (issue 19, item 3): what the store's books cost, by part.

A PageStore in this process (no swap, no root) with the default config (16-page frames,
dedup on, zstd 3, `dictionary: auto`; no disk tier) is filled with each of the four bench
workloads' page corpora (tools/dicts/collect_frames.py: every resident anonymous page of the
workload's processes in address order, same-filled pages and repeats within a run dropped),
the workload's earlier run (seed 8) and then its held-out run (seed 7) at the next offsets,
in 1 MiB write requests as the kernel's swap-out sends them. It prints `stats()["meta"]` per
part, meta bytes per stored page, and the device ratio (orig_mem / stored_mem).

Speed: the writes of both runs (MiB/s of wall time, and process CPU seconds per GiB, which
other load on the machine does not move), then `--reads` random 4 KiB reads of stored pages
(p50 wall time per read and process CPU per read; the store's own caches stay as they are,
the requests are built before the clock starts). With
several --tree, each round runs every tree once, in a process of its own with that tree
first on sys.path, alternating, so the trees' figures come from the same machine state;
the speed figures are medians over --rounds rounds, the meta figures come from round 1.

    .venv/bin/python -m bench meta --corpus /var/tmp/agentzip-frames
    .venv/bin/python -m bench meta --tree /tmp/meta-before --tree . --rounds 3

Writes results/bench_meta.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 4096
MiB = 1 << 20
REQUEST = MiB // PAGE  # pages per write request: the kernel's swap-out writes 1 MiB
WORKLOADS = {"A": "Python data analysis", "B": "tool calling (JSON)", "C": "headless browser",
             "D": "Node.js text"}
RUNS = (8, 7)  # the earlier run, then the held-out run (tools/dicts/collect_frames.py)


def load_pages(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        data = f.read()
    return [data[i:i + PAGE] for i in range(0, len(data) - PAGE + 1, PAGE)]


def child(corpus: str, key: str, reads: int, seed: int) -> dict:
    """One workload in this process, with whatever agentzip_blk is first on sys.path."""
    import numpy as np

    from agentzip_blk.config import Config
    from agentzip_blk.store import PageStore

    pages: list[bytes] = []
    for run in RUNS:
        pages.extend(load_pages(os.path.join(corpus, f"{key}-{run}.pages")))
    config = Config()
    config.pool.swap_out_path = None
    size = -(-len(pages) * PAGE // MiB) * MiB
    store = PageStore.from_config(size, config)
    trainer = store.dicts.trainer
    if trainer is not None:
        trainer.background = False  # the same work in every run: training inside the write
    requests = [b"".join(pages[i:i + REQUEST]) for i in range(0, len(pages), REQUEST)]
    t0, c0 = time.perf_counter(), time.process_time()
    for n, request in enumerate(requests):
        store.write(request, n * REQUEST * PAGE)
    write_s, write_cpu = time.perf_counter() - t0, time.process_time() - c0
    rnd = random.Random(seed)
    lat = []
    c0 = time.process_time()
    for _ in range(reads):
        slot = rnd.randrange(len(pages))
        t0 = time.perf_counter_ns()
        got = store.read(slot * PAGE, PAGE)
        lat.append(time.perf_counter_ns() - t0)
        if got != pages[slot]:
            raise AssertionError(f"{key}: slot {slot} read back wrong")
    read_cpu = time.process_time() - c0
    st = store.stats()
    store.check()
    blobs = store.blobs
    live = blobs.live()
    out = {
        "pages": st["pages"],
        "meta": st["meta"],
        "meta_bytes": st["meta_bytes"],
        "meta_per_page": st["meta_bytes"] / st["pages"],
        "ratio": st["ratio"],
        "orig_mem": st["orig_mem"],
        "stored_mem": st["stored_mem"],
        "blobs": int(np.count_nonzero(live)),
        "frames": int(np.count_nonzero(live & (blobs.pages > 1))),
        "index_entries": int(store.index.count),
        "index_capacity": int(store.index.capacity),
        "write_mib_s": len(pages) * PAGE / MiB / write_s,
        # process CPU: what the store's work costs, whatever else the machine runs
        "write_cpu_s_per_gib": write_cpu / (len(pages) * PAGE / (1 << 30)),
        "read_cpu_us": read_cpu / reads * 1e6,
        "read_mean_us": statistics.fmean(lat) / 1e3,
        "read_p50_us": float(np.percentile(lat, 50)) / 1e3,
    }
    store.close()
    return out


def run_child(tree: str, corpus: str, key: str, reads: int, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", key, "--corpus", corpus,
           "--reads", str(reads), "--seed", str(seed)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tree} {key}: exit {out.returncode}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="/var/tmp/agentzip-frames",
                    help="tools/dicts/collect_frames.py's output directory")
    ap.add_argument("--tree", action="append", help="a checkout to measure (default: this one)")
    ap.add_argument("--workloads", default="ABCD")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--reads", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench_meta.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.corpus, args.child, args.reads, args.seed)))
        return 0
    trees = args.tree or [ROOT]
    runs: dict[str, dict[str, list[dict]]] = {t: {k: [] for k in args.workloads} for t in trees}
    for rnd in range(args.rounds):
        for key in args.workloads:
            for tree in trees if rnd % 2 == 0 else list(reversed(trees)):
                r = run_child(tree, args.corpus, key, args.reads, args.seed + rnd)
                runs[tree][key].append(r)
                print(f"round {rnd + 1} {key} {tree}: {r['meta_per_page']:.1f} B/page, ratio "
                      f"{r['ratio']:.3f}, write {r['write_mib_s']:.1f} MiB/s "
                      f"({r['write_cpu_s_per_gib']:.2f} CPU s/GiB), read p50 "
                      f"{r['read_p50_us']:.1f} us ({r['read_cpu_us']:.1f} CPU us)", flush=True)
    summary: dict[str, dict[str, dict]] = {}
    for tree in trees:
        summary[tree] = {}
        for key, rs in runs[tree].items():
            first = dict(rs[0])
            for k in ("write_mib_s", "write_cpu_s_per_gib", "read_mean_us", "read_p50_us",
                      "read_cpu_us"):
                first[k] = statistics.median(r[k] for r in rs)
                first[k + "_rounds"] = [round(r[k], 2) for r in rs]
            summary[tree][key] = first
    print()
    parts = list(next(iter(next(iter(summary.values())).values()))["meta"])
    head = ["tree", "wl", "pages", *parts, "B/page", "ratio", "write MiB/s", "write CPU s/GiB",
            "read us p50", "read CPU us"]
    print(" | ".join(head))
    for tree, per in summary.items():
        for key, s in per.items():
            print(" | ".join([os.path.basename(os.path.abspath(tree)), key, str(s["pages"]),
                              *(str(s["meta"].get(p, 0)) for p in parts),
                              f"{s['meta_per_page']:.1f}", f"{s['ratio']:.3f}",
                              f"{s['write_mib_s']:.1f}", f"{s['write_cpu_s_per_gib']:.2f}",
                              f"{s['read_p50_us']:.1f}", f"{s['read_cpu_us']:.1f}"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "host": platform.node(), "python": platform.python_version(),
                   "command": " ".join(sys.argv), "rounds": args.rounds, "reads": args.reads,
                   "trees": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
