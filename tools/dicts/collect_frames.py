#!/usr/bin/env python3
"""Collect ordered page corpora of the four benchmark workloads, for frame benchmarks.

tools/dicts/collect.py samples pages uniformly at random, which is right for one-page
compression but destroys what a 16-page frame sees: neighbouring pages of one heap. This
collector runs each of bench/swap.py's workloads (A pandas, B JSON tool calling, C headless
Chromium, D Node.js text) twice, seed 8 (the "earlier run" a host's `dictionary: auto`
learns from) and seed 7 (the held-out run), waits for READY, and reads *every* resident
private anonymous page of the process tree in address order (per process, processes in pid
order). Same-filled pages and repeats of an earlier page are dropped, as the store drops
them before compressing; the order of the rest is kept. Address order is the proxy for
swap order: the kernel writes an idle heap out from its LRU, which for a heap built once
follows allocation order, and allocators hand out ascending addresses within an arena.

    .venv/bin/python tools/dicts/collect_frames.py --out /var/tmp/agentzip-frames

Output: OUT/KEY-SEED.pages (concatenated 4 KiB pages) and OUT/runs.json. Reading
/proc/PID/mem of the workload needs root; nothing attaches swap (no swap lock).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from agentzip_blk.cgroups import procmem  # noqa: E402
from bench.harness.workloads import DIR as W, module  # noqa: E402
from collect import filter_pages  # noqa: E402  (same directory: this script's sys.path[0])

descendants = module("pagewalk").descendants
PY = sys.executable
WORKLOADS = {
    "A": ("Python data analysis", [PY, f"{W}/pandas_analysis.py"]),
    "B": ("tool calling (JSON)", [PY, f"{W}/agent_json.py"]),
    "C": ("headless browser", [PY, f"{W}/browser.py"]),
    "D": ("Node.js text", [shutil.which("node") or "node", f"{W}/node_text.js"]),
}
SEEDS = {"host": 8, "heldout": 7}


def ordered_pages(pids: list[int]) -> list[bytes]:
    pages: list[bytes] = []
    for pid in sorted(pids):
        try:
            pages.extend(procmem.read_pages(pid, procmem.resident_anon_addresses(pid)))
        except procmem.ProcMemError:
            pass  # exited meanwhile
    return pages


def run_one(argv: list[str], mb: float, seed: int) -> list[bytes]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.Popen([*argv, "--mb", str(mb), "--seed", str(seed)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"{argv}: no READY (got {line!r})")
        return ordered_pages([proc.pid, *descendants(proc.pid)])
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/var/tmp/agentzip-frames")
    ap.add_argument("--mb", type=float, default=100, help="size each workload builds")
    ap.add_argument("--workloads", default="A,B,C,D")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "runs.json")
    meta = json.load(open(path)) if os.path.exists(path) else []
    for key in a.workloads.split(","):
        name, argv = WORKLOADS[key]
        for role, seed in SEEDS.items():
            t0 = time.time()
            raw = run_one(argv, a.mb, seed)
            kept = filter_pages(raw)  # what the store compresses, in order
            file = f"{key}-{seed}.pages"
            with open(os.path.join(a.out, file), "wb") as f:
                f.write(b"".join(kept))
            meta = [m for m in meta if m["file"] != file]
            meta.append({"key": key, "workload": name, "role": role, "seed": seed, "mb": a.mb,
                         "file": file, "resident": len(raw), "kept": len(kept),
                         "seconds": round(time.time() - t0, 1)})
            with open(path, "w") as f:
                json.dump(meta, f, indent=1)
            print(f"{key} {role:8} seed {seed}: {len(raw)} resident, {len(kept)} kept", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
