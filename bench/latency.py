#!/usr/bin/env python3
"""Where the time of one 4 KiB read goes: the chain measured layer by layer, with zram.

Each row reads the same 64 MiB of agent-like pages, 4 KiB at a time at random offsets, and
times every read; a layer's own cost is its row minus the row below it:

  store          PageStore.readinto in this process (Python + codec + allocator)
  nbdkit+NBD     libnbd client -> unix socket -> nbdkit -> the plugin (the store call inside
                 it is the "store" row); nbdkit's memory plugin and an empty Python plugin
                 on the same socket show what nbdkit and the embedded interpreter cost alone
  FUSE           O_DIRECT read of the nbdfuse file (kernel FUSE + nbdfuse + the rows above)
  loop           O_DIRECT read of the loop device (what swap-in goes through)
  in-process     the same two reads with device.frontend fuse: the FUSE file is served by
                 the nbdkit process itself (agentzip_blk.datapath.fuse), no NBD hop
  C floor        bench/harness/fusefloor.c: an in-memory file served in C (libfuse3), then loop;
                 the least any userspace FUSE chain costs on this machine
  zram           O_DIRECT read of /dev/zram0 (lz4) holding the same pages

Writes results/bench_latency.json and the BENCHMARKS.md section between
<!-- bench_latency:begin --> and <!-- bench_latency:end -->. Needs root; attaches no swap
(the device is attached but swap is not enabled on it). Run under the swap lock:

    flock /tmp/agentzip-swap.lock .venv/bin/python -m bench latency
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentzip_blk.config import Config
from agentzip_blk.host import attach
from agentzip_blk.store import PageStore
from bench.harness import zram
from bench.harness.blockio import (
    DATA,
    PAGE,
    READS,
    agent_pages,
    direct_reader,
    nbd_reader,
    offsets,
    time_calls,
    write_direct,
)
from bench.harness.floor import build_floor, stop_floor, wait_for_file
from bench.harness.md import write_section
from bench.harness.results import REPO, write_json

ROOT = Path(REPO)
sys.path.insert(0, str(ROOT / "tests"))  # nbdkit_server: the tests' way to start the server

NULL_PLUGIN = '''
import nbdkit
API_VERSION = 2
def thread_model(): return nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS
def open(readonly): return 1
def get_size(h): return %d
def pread(h, buf, offset, flags): pass
'''


def run() -> dict:
    data = agent_pages(DATA)
    offs = offsets()
    rows: dict[str, dict] = {}

    frames = Config().compression.frame_pages
    for label, frame_pages in (("store (in process), single pages", 1),
                              (f"store (in process), {frames}-page frames (the default)", frames)):
        # Random reads: every read of a frame decompresses all of it (no readahead neighbour
        # follows), the worst case of frames' read amplification.
        store = PageStore(1 << 30, max_size=1 << 30, frame_pages=frame_pages)
        for start in range(0, len(data), 1 << 20):  # swap-out writes are ~300 KiB-1 MiB
            store.write(data[start : start + (1 << 20)], start)
        buf = bytearray(PAGE)
        rows[label] = time_calls(lambda off: store.readinto(buf, off), offs)
        store.close()

    tmp = tempfile.mkdtemp(prefix="azlat-")
    from nbdkit_server import plugin_env

    null = Path(tmp) / "null_plugin.py"
    null.write_text(NULL_PLUGIN % (1 << 30))
    for name, argv in (("nbdkit memory plugin", ["memory", "size=1G"]),
                       ("nbdkit empty Python plugin", ["python", str(null)])):
        sock = f"{tmp}/{name.split()[1]}.sock"
        proc = subprocess.Popen(["nbdkit", "-f", "-U", sock, *argv], env=plugin_env())
        try:
            for _ in range(100):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            h, call = nbd_reader(sock)
            h.pwrite(data[: 16 << 20], 0) if "memory" in name else None
            rows[name] = time_calls(call, offs)
            h.shutdown()
        finally:
            proc.terminate()
            proc.wait()

    cfg = Config()
    cfg.pool.swap_out_path = f"{tmp}/disk-tier"
    cfg.compression.dictionary = "none"
    with attach.attached(cfg, f"{tmp}/run", size=1 << 30, frontend="nbdfuse") as st:
        # attached() made it swap; take swap off again: only the block path is measured here.
        subprocess.run(["swapoff", st.loop_device], check=True)
        h, call = nbd_reader(st.nbd_socket)
        h.pwrite(data, 0)
        rows["agentzip plugin over NBD (libnbd)"] = time_calls(call, offs)
        from agentzip_blk.datapath import control

        inside = control.request(st.control_socket, "stats").get("latency")
        h.shutdown()
        fd, call = direct_reader(st.fuse_file)
        rows["nbdfuse: + FUSE (nbdfuse file, O_DIRECT)"] = time_calls(call, offs)
        os.close(fd)
        fd, call = direct_reader(st.loop_device)
        rows[NBDFUSE_LOOP] = time_calls(call, offs)
        os.close(fd)
        subprocess.run(["mkswap", st.loop_device], check=True, capture_output=True)
        subprocess.run(["swapon", st.loop_device], check=True)  # attached() expects swap on

    with attach.attached(cfg, f"{tmp}/run2", size=1 << 30, frontend="fuse") as st:
        subprocess.run(["swapoff", st.loop_device], check=True)
        write_direct(st.fuse_file, data)  # 1 MiB requests, like swap-out's
        fd, call = direct_reader(st.fuse_file)
        rows["in-process FUSE: the server's FUSE file (O_DIRECT)"] = time_calls(call, offs)
        os.close(fd)
        fd, call = direct_reader(st.loop_device)
        rows[FUSE_LOOP] = time_calls(call, offs)
        os.close(fd)
        from agentzip_blk.datapath import control

        inside_fuse = control.request(st.control_socket, "stats").get("latency")
        subprocess.run(["mkswap", st.loop_device], check=True, capture_output=True)
        subprocess.run(["swapon", st.loop_device], check=True)

    # The warm form (compression.warm_algorithm: lz4, pages stored alone) served by each
    # request path (device.datapath): what a warm fault costs through the chain `up` builds.
    for datapath in ("python", "native"):
        warm = Config()
        warm.pool.swap_out_path = f"{tmp}/disk-tier-{datapath}"
        warm.compression.dictionary = "none"
        warm.compression.warm_algorithm = "lz4"
        warm.device.datapath = datapath
        with attach.attached(warm, f"{tmp}/run-{datapath}", size=1 << 30, frontend="fuse") as st:
            subprocess.run(["swapoff", st.loop_device], check=True)
            write_direct(st.fuse_file, data)
            fd, call = direct_reader(st.loop_device)
            rows[WARM_LOOP[datapath]] = time_calls(call, offs)
            os.close(fd)
            subprocess.run(["mkswap", st.loop_device], check=True, capture_output=True)
            subprocess.run(["swapon", st.loop_device], check=True)

    rows.update(floor_rows(data, offs, tmp))
    rows["zram lz4 (O_DIRECT)"] = zram_row(data, offs)
    return {"rows": rows, "plugin_latency": inside, "fuse_latency": inside_fuse}


NBDFUSE_LOOP = "nbdfuse: + loop device (O_DIRECT), the swap-in path"
FUSE_LOOP = "in-process FUSE: + loop device (O_DIRECT), the swap-in path"
FLOOR_LOOP = "C floor: + loop device (O_DIRECT)"
WARM_LOOP = {dp: f"in-process FUSE, warm lz4 pages, datapath {dp}: + loop device (O_DIRECT)"
             for dp in ("python", "native")}


def floor_rows(data: bytes, offs: list[int], tmp: str) -> dict:
    """The C floor: bench/harness/fusefloor.c serves DATA bytes from memory; loop on top."""
    exe = build_floor(tmp)
    mnt = tempfile.mkdtemp(prefix="azfloor-", dir=tmp)
    path = os.path.join(mnt, "device")
    proc = subprocess.Popen([exe, mnt, str(DATA)], stdin=subprocess.DEVNULL)
    loop = None
    rows = {}
    try:
        wait_for_file(path, proc)
        write_direct(path, data)
        loop = subprocess.run(["losetup", "--direct-io=on", "--show", "-f", path],
                              capture_output=True, text=True, check=True).stdout.strip()
        fd, call = direct_reader(path)
        rows["C floor: in-memory FUSE file in C (libfuse3, O_DIRECT)"] = time_calls(call, offs)
        os.close(fd)
        fd, call = direct_reader(loop)
        rows[FLOOR_LOOP] = time_calls(call, offs)
        os.close(fd)
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        stop_floor(mnt, proc)
    return rows


def zram_row(data: bytes, offs: list[int]) -> dict:
    if not zram.available():
        return {}
    try:
        with zram.raw_device("lz4", 256 << 20) as dev:
            fd = os.open(dev, os.O_WRONLY)
            os.write(fd, data)
            os.close(fd)
            fd, call = direct_reader(dev)
            row = time_calls(call, offs)
            os.close(fd)
            return row
    except zram.ZramBusy:
        return {"error": "zram0 in use"}


def render(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "## Where a 4 KiB read's time goes",
        "",
        "Command: `flock /tmp/agentzip-swap.lock .venv/bin/python -m bench latency`  ",
        f"Machine: Linux {platform.release()}, {os.cpu_count()} cores; {result['date']}",
        "",
        f"{READS} random 4 KiB reads of 64 MiB of agent-like pages (zstd 3, no dictionary, "
        "written in 1 MiB requests), one at a time, each layer measured on its own; a layer's "
        "cost is its row minus the row above it (the plugin rows run the default config, "
        "multi-page frames, so they build on the frames row). The loop row is what a swap-in "
        "fault pays for one page. Random reads are the worst case for frames: each one "
        "decompresses a whole frame, where a swap-in mostly reads a frame's neighbouring pages "
        "next (served from the frame cache).",
        "",
        "| layer | p50 us | p99 us | p99.9 us | mean us |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        if "p50_us" in r:
            lines.append(f"| {name} | {r['p50_us']} | {r['p99_us']} | {r['p999_us']} | {r['mean_us']} |")
    zram = rows.get("zram lz4 (O_DIRECT)", {})
    if zram.get("p99_us"):
        lines += ["", "Whole chain (the swap-in path) per front door, against zram in the same "
                  "run (issue 15's target: p50 <= 100 us, p99 <= 300 us; the native path's, issue 26: a "
                  "warm fault p50 <= 60 us, p99 <= 300 us):", "",
                  "| swap-in path | p50 us | p99 us | p50 / zram | p99 / zram |",
                  "|---|---:|---:|---:|---:|"]
        for label, name in (("nbdfuse -> NBD -> nbdkit (before)", NBDFUSE_LOOP),
                            ("in-process FUSE (nbdkit serves the file)", FUSE_LOOP),
                            ("warm lz4 pages, Python request path", WARM_LOOP["python"]),
                            ("warm lz4 pages, native request path", WARM_LOOP["native"]),
                            ("C floor (in-memory file in C)", FLOOR_LOOP),
                            ("zram lz4", "zram lz4 (O_DIRECT)")):
            r = rows.get(name, {})
            if r.get("p50_us"):
                lines.append(f"| {label} | {r['p50_us']} | {r['p99_us']} | "
                             f"{r['p50_us'] / zram['p50_us']:.1f}x | "
                             f"{r['p99_us'] / zram['p99_us']:.1f}x |")
    return "\n".join(lines)


def main() -> int:
    import argparse

    argparse.ArgumentParser(
        description="Where the time of one 4 KiB read goes, layer by layer, with zram. As root, "
                    "holding the swap lock: flock /tmp/agentzip-swap.lock "
                    ".venv/bin/python -m bench latency").parse_args()
    if os.geteuid() != 0:
        print("bench_latency: needs root", file=sys.stderr)
        return 2
    result = run()
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_json(ROOT / "results" / "bench_latency.json", result)
    section = render(result)
    write_section(ROOT / "BENCHMARKS.md", "bench_latency", section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
