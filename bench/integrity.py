#!/usr/bin/env python3
"""What blob checksums and disk-tier encryption cost, measured in one run.

    .venv/bin/python -m bench integrity [--mib 128] [--rounds 3]
    .venv/bin/python -m bench integrity --lock-tree OLD --lock-tree . [--mib 64]

In one process (no chain, no kernel, nothing needs root), on the store itself:

1. Checksums on vs off (`store.integrity.CHECKSUMS`, a switch for this benchmark only):
   CPU seconds per GiB to write agent-like pages in 1 MiB requests (the default config:
   zstd frames of 16 pages) and to read them back in 1 MiB requests; and the latency of
   random 4 KiB reads (a swap-in fault: one frame decompressed per read, the frame cache
   emptied first) as p50/p99.
2. Encryption on vs off (`store.disk.ENCRYPT`, the same kind of switch): demotion of every
   page to the disk tier (MiB of pages per second of wall time, fdatasync included, and
   CPU per GiB), 4 KiB reads of disk pages, which promote them (wall MiB/s, p50/p99), and
   the release of disk pages (trim: hole punching).

3. `--lock-tree`: instead, per tree (each in a process of its own, alternating), the
   latency of 4 KiB reads of warm pool pages while demotion rounds move the cold half of
   the pages to disk: what a round holds the store lock for.

Configurations alternate within each round (on, off, on, off, ...) so that both see the same
machine state; each figure is the median over rounds, and the report gives on/off ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

if __name__ == "__main__" and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAGE = 4096
MiB = 1 << 20
WORDS = (b"tool_call arguments result json path value error return def class self import "
         b"{ } [ ] 0.5 true null \\n").split()


def chunks(total_mib: int, seed: int = 1) -> list[bytes]:
    rnd = random.Random(seed)
    out = []
    for i in range(total_mib):
        text = b" ".join(rnd.choice(WORDS) for _ in range(MiB // 5))[:MiB].ljust(MiB, b" ")
        body = bytearray(text)
        for page in range(0, MiB, PAGE):  # every page distinct (no dedup), some entropy
            body[page : page + 64] = rnd.randbytes(64)
        body[:8] = i.to_bytes(8, "little")
        out.append(bytes(body))
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(tier_dir: str, max_size: int = 4 << 30, threshold: int = 80, **kwargs):
    from agentzip_blk.config import Config
    from agentzip_blk.store.pagestore import PageStore
    from agentzip_blk.store.tiering import Tiering

    cfg = Config()
    cfg.pool.swap_out_path = os.path.join(tier_dir, "tier")
    cfg.pool.max_size = max_size
    cfg.pool.reclaim_threshold = threshold
    cfg.compression.dictionary = "none"
    clock = Clock()
    store = PageStore(4 << 30, algorithm=cfg.compression.algorithm, level=cfg.compression.level,
                      tiering=Tiering.from_config(cfg), dictionary="none",
                      frame_pages=cfg.compression.frame_pages, clock=clock, **kwargs)
    return store, clock


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def checksum_round(data: list[bytes], on: bool, reads: int, tier_dir: str) -> dict:
    from agentzip_blk.store import integrity

    integrity.CHECKSUMS = on
    store, _clock = make_store(tier_dir)
    try:
        gib = len(data) * MiB / (1 << 30)
        c0 = time.process_time()
        for i, chunk in enumerate(data):
            store.write(chunk, i * MiB)
        write_cpu = (time.process_time() - c0) / gib
        buf = bytearray(MiB)
        c0 = time.process_time()
        for i in range(len(data)):
            store.readinto(buf, i * MiB)
        read_cpu = (time.process_time() - c0) / gib
        # The checks' own cost, without the noise of the rest: every stored blob's bytes
        # checksummed once (what a write computes and a full read verifies).
        blobs = store.blobs
        live = blobs.live().nonzero()[0].tolist()
        stored = [store.objects.pool.get(int(blobs.arena[b]), int(blobs.cell[b]),
                                         int(blobs.length[b])) for b in live]
        c0 = time.perf_counter()
        for data_ in stored:
            integrity.checksum(data_)
        sum_cpu = (time.perf_counter() - c0) / gib
        rnd = random.Random(7)
        page = bytearray(PAGE)
        lat = []
        slots = len(data) * MiB // PAGE
        for _ in range(reads):
            for cache in (store.frames, store.hot):
                for blob in cache.keys():
                    cache.discard(blob)
            slot = rnd.randrange(slots)
            t = time.perf_counter()
            store.readinto(page, slot * PAGE)
            lat.append(time.perf_counter() - t)
        return {"checksum_all_blobs_s_per_gib": sum_cpu, "write_cpu_s_per_gib": write_cpu, "read_cpu_s_per_gib": read_cpu,
                "read4k_p50_us": pct(lat, 0.5) * 1e6, "read4k_p99_us": pct(lat, 0.99) * 1e6}
    finally:
        store.close()
        integrity.CHECKSUMS = True


def tier_round(data: list[bytes], on: bool, tier_dir: str) -> dict:
    from agentzip_blk.store import disk

    disk.ENCRYPT = on
    store, clock = make_store(tier_dir)
    try:
        for i, chunk in enumerate(data):
            store.write(chunk, i * MiB)
        mib = len(data)
        clock.now += 3600  # everything cold
        t0, c0 = time.perf_counter(), time.process_time()
        blobs = 0
        while True:
            moved = store.tiers.demote_cold()
            if not moved:
                break
            blobs += moved
        demote_wall, demote_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert store.stats()["tiers"]["pool"]["pages"] == 0, "not everything was demoted"
        # Promotion: reads of disk pages while the pool has room, one 4 KiB read per frame
        # (its first page), as a swap-in fault would.
        frame = store.frame_pages
        page = bytearray(PAGE)
        lat = []
        t0 = time.perf_counter()
        for slot in range(0, mib * MiB // PAGE, frame):
            t = time.perf_counter()
            store.readinto(page, slot * PAGE)
            lat.append(time.perf_counter() - t)
        promote_wall = time.perf_counter() - t0
        promoted = store.counters.promotions
        clock.now += 3600
        while store.tiers.demote_cold():
            pass
        store.tiers.punch_freed()
        t0 = time.perf_counter()
        store.trim(0, mib * MiB)  # every blob on disk: released under the lock
        trim_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        punched = store.tiers.punch_freed()  # the maintainer's punch, outside the lock
        punch_wall = time.perf_counter() - t0
        return {
            "demote_mib_s": mib / demote_wall, "demote_cpu_s_per_gib": demote_cpu / (mib / 1024),
            "demoted_blobs": blobs,
            "promote_mib_s": mib / promote_wall, "promoted_blobs": promoted,
            "disk_read4k_p50_us": pct(lat, 0.5) * 1e6, "disk_read4k_p99_us": pct(lat, 0.99) * 1e6,
            "trim_disk_us_per_blob": trim_wall / max(1, blobs) * 1e6,
            "punch_ms_per_round": punch_wall * 1e3, "punched_ranges": punched,
        }
    finally:
        store.close()
        disk.ENCRYPT = True


def demotion_contention(mib: int, tier_dir: str) -> dict:
    """4 KiB reads of pool pages (one thread) while the main thread demotes the other half
    of the pages, 512 blobs per round: what a demotion round makes a read wait. Uses only
    the API every tree has (`--lock-tree`)."""
    import inspect
    import threading

    from agentzip_blk.store.pagestore import PageStore

    holds: list[float] = []
    demoter = threading.get_ident()

    class TimedLock:
        """The store lock, timing each hold by the demoting thread while `on`."""

        def __init__(self, lock) -> None:
            self.lock, self.t, self.on = lock, 0.0, False

        def __enter__(self):
            self.lock.acquire()
            if self.on and threading.get_ident() == demoter:
                self.t = time.perf_counter()
            return self

        def __exit__(self, *exc) -> None:
            if self.on and threading.get_ident() == demoter:
                holds.append(time.perf_counter() - self.t)
            self.lock.release()

        def locked(self) -> bool:
            return self.lock.locked()

    # A tree whose store takes its lock when built (its parts hold it from then on) gets
    # the timed one then; an older tree's is swapped in for the demotion rounds.
    built_with = "lock" in inspect.signature(PageStore).parameters
    timed = TimedLock(threading.Lock())
    store, clock = make_store(tier_dir, **({"lock": timed} if built_with else {}))
    try:
        data = chunks(mib, seed=3)
        for i, chunk in enumerate(data):
            store.write(chunk, i * MiB)
        half = mib // 2 * MiB // PAGE
        clock.now += 3600  # all cold; reads of the upper half keep those warm
        for slot in range(half, mib * MiB // PAGE, store.frame_pages):
            store.read(slot * PAGE, PAGE)
        stop = threading.Event()
        lat: list = []

        def reader() -> None:
            rnd = random.Random(5)
            page = bytearray(PAGE)
            while not stop.is_set():
                slot = rnd.randrange(half, mib * MiB // PAGE)
                t = time.perf_counter()
                store.readinto(page, slot * PAGE)
                lat.append((t, time.perf_counter() - t))
                time.sleep(0.0002)

        thread = threading.Thread(target=reader)
        thread.start()
        time.sleep(0.2)
        if not built_with:
            timed.lock, store.lock = store.lock, timed
        timed.on = True
        t0 = time.perf_counter()
        moved = 0
        while True:
            done = store.demote_cold()
            if not done:
                break
            moved += done
        t1 = time.perf_counter()
        wall = t1 - t0
        stop.set()
        thread.join()
        timed.on = False
        if not built_with:
            store.lock = timed.lock
        lat = [d for t, d in lat if t0 <= t < t1]  # the reads that met a demotion round
        return {"demoted_blobs": moved, "demote_wall_s": round(wall, 3), "reads": len(lat),
                "read4k_p50_us": round(pct(lat, 0.5) * 1e6, 1),
                "read4k_p99_us": round(pct(lat, 0.99) * 1e6, 1),
                "read4k_max_us": round(max(lat) * 1e6, 1),
                "lock_holds": len(holds), "lock_hold_max_ms": round(max(holds) * 1e3, 2),
                "lock_held_total_ms": round(sum(holds) * 1e3, 1)}
    finally:
        store.close()


def lock_trees(trees: list[str], mib: int, rounds: int, tier_dir: str | None) -> int:
    """Each tree in a process of its own, alternating, `rounds` times."""
    import subprocess

    # the tree first on sys.path (PYTHONPATH), this bench's directory last
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys, tempfile; sys.argv = ['x']; "
            f"sys.path.append({bench_dir!r}); import integrity as b; "
            f"d = tempfile.mkdtemp(dir={tier_dir!r}); "
            f"print(json.dumps(b.demotion_contention({mib}, d)))")
    for r in range(rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout
            print(f"round {r + 1} {tree}: {out.strip()}", flush=True)
    return 0


def median_of(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="MiB of pages per configuration")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=3000, help="random 4 KiB reads per round")
    ap.add_argument("--dir", help="directory for the disk tier (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--lock-tree", action="append", metavar="TREE",
                    help="instead: read latency during demotion rounds, per tree "
                         "(e.g. --lock-tree OLD --lock-tree .), each in its own process")
    args = ap.parse_args()
    if args.lock_tree:
        return lock_trees(args.lock_tree, args.mib, args.rounds, args.dir)
    data = chunks(args.mib)
    results: dict[str, dict[str, list[dict]]] = {"checksums": {"on": [], "off": []},
                                                 "encryption": {"on": [], "off": []}}
    with tempfile.TemporaryDirectory(dir=args.dir) as tier_dir:
        checksum_round(data[:8], True, 100, tier_dir)  # warm-up, not counted
        tier_round(data[:8], True, tier_dir)
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                key = "on" if on else "off"
                results["checksums"][key].append(checksum_round(data, on, args.reads, tier_dir))
                results["encryption"][key].append(tier_round(data, on, tier_dir))
    report = {"mib": args.mib, "rounds": args.rounds}
    for what, runs in results.items():
        on, off = median_of(runs["on"]), median_of(runs["off"])
        report[what] = {"on": on, "off": off,
                        "on_over_off": {k: round(on[k] / off[k], 3) if off[k] else None for k in on}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.mib} MiB of agent-like pages per configuration, median of {args.rounds} rounds")
    for what in ("checksums", "encryption"):
        print(f"\n{what}: on / off (ratio)")
        block = report[what]
        for key in block["on"]:
            print(f"  {key:24} {block['on'][key]:>10} / {block['off'][key]:<10} "
                  f"({block['on_over_off'][key]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
