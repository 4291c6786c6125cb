#!/usr/bin/env python3
"""One tenant's 4 KiB fault while another writes incompressible pages at full speed: what a
noisy neighbour costs the others through the store (issue 27, item 6).

The chain `up` builds (FUSE front door + loop device, swap off: only the block path is
measured), 64 MiB of agent-like pages written first. Then 3000 random 4 KiB O_DIRECT reads
of those pages (a swap-in fault), timed one by one: alone, and while another process writes
1 MiB of random bytes at a time (incompressible: stored raw) to another part of the device
as fast as it can. Rows per configuration:

  python / frames  device.datapath python, warm_algorithm none: the request path of main
                   before the native path (writes compressed, and what does not pay stored
                   page by page, all in Python, with the store lock taken for each write)
  native / frames  device.datapath native, warm_algorithm none (the defaults): frames and
                   the page-by-page fallback compressed by the C path before the lock
  native / warm    device.datapath native, warm_algorithm lz4: writes stored by the C path
                   (raw pages memcpy'd into pool cells under the lock), reads answered in C
  zram lz4         the reference: /dev/zram0 as a raw block device, the same reads and writer

    flock /tmp/agentzip-swap.lock .venv/bin/python -m bench neighbour [--json PATH]

Needs root (loop device, FUSE). Nothing is swapped; the device is detached at the end.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from agentzip_blk.config import Config
from agentzip_blk.host import attach
from bench.harness import zram
from bench.harness.blockio import agent_pages

PAGE = 4096
MiB = 1 << 20
DATA = 64 * MiB
READS = 3000
WRITER = r"""
import mmap, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
path, first, span, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)
written, off, start = 0, 0, time.monotonic()
try:
    while time.monotonic() < start + seconds:
        buf[:] = os.urandom(1 << 20)
        os.pwritev(fd, [buf], first + off)
        written += 1 << 20
        off = (off + (1 << 20)) % span
finally:
    print(written / (1 << 20) / (time.monotonic() - start), flush=True)
"""


def write_direct(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)
    try:
        for start in range(0, len(data), MiB):
            buf[:] = data[start:start + MiB]
            os.pwritev(fd, [buf], start)
    finally:
        os.close(fd)


def timed_reads(path: str, offs: list[int]) -> dict:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, PAGE)
    times = []
    try:
        for off in offs:
            t = time.perf_counter()
            os.preadv(fd, [buf], off)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
    a = np.array(times) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1),
            "max_us": round(float(a.max()), 1), "reads": len(times)}


# label: (device.datapath, compression.warm_algorithm)
CONFIGS = {"python / frames": ("python", "none"),
           "native / frames (the default)": ("native", "none"),
           "native / warm": ("native", "lz4")}


def measure(device: str, data: bytes, offs: list[int]) -> dict:
    """The reads on `device` alone, then while a writer fills another part of it."""
    write_direct(device, data)
    alone = timed_reads(device, offs)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, device,
                               str(256 * MiB), str(512 * MiB), "600"],
                              stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the writer at full speed
        t0 = time.monotonic()
        noisy = timed_reads(device, offs)
        seconds = time.monotonic() - t0
    finally:
        writer.terminate()
        out, _ = writer.communicate()
    noisy["neighbour_seconds"] = round(seconds, 2)
    noisy["writer_mib_s"] = round(float(out.strip() or 0), 1)
    return {"alone": alone, "with a writer": noisy}


def run(tmp: str) -> dict:
    data = agent_pages(DATA)
    rnd = random.Random(2)
    offs = [rnd.randrange(DATA // PAGE) * PAGE for _ in range(READS)]
    rows = {}
    if zram.available():  # the reference: the kernel's device, same reads, same writer
        with zram.raw_device("lz4", 1 << 30) as device:
            rows["zram lz4"] = measure(device, data, offs)
    for n, (label, (datapath, warm)) in enumerate(CONFIGS.items()):
        cfg = Config()
        cfg.pool.swap_out_path = f"{tmp}/tier-{n}"
        cfg.compression.dictionary = "none"
        cfg.compression.warm_algorithm = warm
        cfg.device.datapath = datapath
        with attach.attached(cfg, f"{tmp}/run-{n}", size=1 << 30, frontend="fuse") as st:
            subprocess.run(["swapoff", st.loop_device], check=True)
            try:
                rows[label] = measure(st.loop_device, data, offs)
            finally:
                subprocess.run(["mkswap", st.loop_device], check=True, capture_output=True)
                subprocess.run(["swapon", st.loop_device], check=True)  # attached() expects it
    return rows


def render(rows: dict) -> str:
    lines = ["| configuration | alone p50 / p99 µs | with an incompressible writer p50 / p99 / max µs | p99 × alone | the writer's MiB/s |",
             "|---|---:|---:|---:|---:|"]
    for label, r in rows.items():
        a, n = r["alone"], r["with a writer"]
        lines.append(f"| {label} | {a['p50_us']} / {a['p99_us']} | {n['p50_us']} / {n['p99_us']} / "
                     f"{n['max_us']} | {n['p99_us'] / a['p99_us']:.1f}x | {n['writer_mib_s']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_neighbour: run as root (loop device, FUSE)")
    tmp = tempfile.mkdtemp(prefix="azneigh-")
    rows = run(tmp)
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
