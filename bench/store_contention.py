#!/usr/bin/env python3
"""Read latency of the store while another thread writes: what the store lock costs.

    .venv/bin/python -m bench store_contention                       # this tree
    .venv/bin/python -m bench store_contention --tree OLD --tree .   # before / after

In one process (no chain, no kernel): 64 MiB of agent-like pages are written in 1 MiB
requests; then one thread reads random 4 KiB pages (a swap-in fault) alone, and again while
a second thread keeps writing fresh 1 MiB requests (a swap-out burst). Each --tree runs in a
process of its own with that tree first on sys.path, one after the other, so the figures of
two trees come from the same machine state. No swap is attached; nothing needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

PAGE = 4096
MiB = 1 << 20
WORDS = b"tool_call arguments result json path value error return def class self import".split()


def text(rnd: random.Random, n: int) -> bytearray:
    return bytearray(b" ".join(rnd.choice(WORDS) for _ in range(n // 6))[:n].ljust(n, b" "))


def measure(reads: int, tier_dir: str) -> dict:
    from agentzip_blk.config import Config
    from agentzip_blk.store.pagestore import PageStore

    cfg = Config()
    cfg.pool.swap_out_path = os.path.join(tier_dir, "tier")
    cfg.compression.dictionary = "none"
    store = PageStore.from_config(1 << 30, cfg)
    rnd = random.Random(1)
    chunks = [text(rnd, MiB) for _ in range(16)]
    for i in range(64):
        chunks[i % 16][:8] = i.to_bytes(8, "little")
        store.write(chunks[i % 16], i * MiB)
    stop = threading.Event()
    writes: list[float] = []

    def writer() -> None:
        i = 64
        while not stop.is_set():
            data = chunks[i % 16]
            data[:8] = i.to_bytes(8, "little")
            t = time.perf_counter()
            store.write(data, (64 + i % 128) * MiB)
            writes.append(time.perf_counter() - t)
            i += 1

    def read_loop(n: int) -> list[float]:
        out, buf, r = [], bytearray(PAGE), random.Random(2)
        for _ in range(n):
            off = r.randrange(64 * MiB // PAGE) * PAGE
            t = time.perf_counter()
            store.readinto(buf, off)
            out.append(time.perf_counter() - t)
            time.sleep(0.0002)  # a fault now and then, not a read storm
        return sorted(out)

    alone = read_loop(reads)
    th = threading.Thread(target=writer)
    th.start()
    busy = read_loop(reads)
    stop.set()
    th.join()
    store.close()

    def us(a: list[float], q: float) -> float:
        return round(a[min(len(a) - 1, int(len(a) * q))] * 1e6, 1)

    writes.sort()
    return {"read_alone_p50_us": us(alone, .5), "read_alone_p99_us": us(alone, .99),
            "read_busy_p50_us": us(busy, .5), "read_busy_p99_us": us(busy, .99),
            "write_1mib_p50_us": us(writes, .5), "writes": len(writes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", help="a checkout to measure (default: this one)")
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure(args.reads, tmp)))
        return 0
    trees = args.tree or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for tree in trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                              "--reads", str(args.reads)], env=env, check=True,
                             capture_output=True, text=True).stdout
        print(f"{tree}: {out.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
