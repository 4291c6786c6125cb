#!/usr/bin/env python3
"""The floor of a real-swap fault behind a loop device: the same single-page faults through
zram, a loop device over a file in tmpfs, the loop device over the C FUSE floor, and
agentzip-blk as `up` builds it.

Issue 26 asks for a swap-in fault within 6x zram's p50 through real swap. zram is a
synchronous device: the faulting task decompresses the page itself, with no readahead and
no other thread woken. Everything this machine can put behind `swapon` that is not zram
goes through the loop driver (there is no nbd or ublk driver here), which hands each
request to a worker thread and completes it from there. So the rows, each the only swap
while it runs, on the same pages:

  zram lz4        the reference
  loop + tmpfs    a loop device (direct I/O) over a file in /dev/shm: the loop driver and
                  the kernel's swap-in path alone, no userspace at all
  loop + C FUSE   the loop device over bench/harness/fusefloor.c (libfuse3, in memory,
                  multi-threaded): the least any userspace FUSE swap device costs here
  agentzip-blk    `agentzip-blk up` at the defaults (its own process), as an operator runs it

Per row: one workload process in a cgroup below ours fills `--mb` MiB with agent-like text
pages, the cgroup is squeezed to 10% of its usage, then `--faults` pages drawn at random
from those in swap are read back one at a time and each read is timed (demo/scripts/
pagewalk.py `probe`, as `bench swap` probes). vm.page-cluster is left as it is (the swap-in
readahead is part of what a fault costs).

    flock /tmp/agentzip-swap.lock .venv/bin/python -m bench swapfloor

Writes results/swapfloor.json and the BENCHMARKS.md section between
<!-- swapfloor:begin --> and <!-- swapfloor:end -->. Needs root; tears down in the safe
order (workload cgroup, swapoff, loop device, FUSE mount, server) whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

from agentzip_blk.cgroups.fs import MemoryCgroup
from agentzip_blk.demo.backends import ZramSwap
from agentzip_blk.demo.scripts import pagewalk
from bench.harness.floor import build_floor, stop_floor, wait_for_file
from bench.harness.host import joiner, kill_all, set_limit_quiet
from bench.harness.md import write_section
from bench.harness.results import REPO, write_json

MiB = 1 << 20
DEVICE_BYTES = 1 << 30  # the loop rows' swap area; the workload's pages fit many times

# The workload: agent-like text, bench.harness.blockio.agent_pages's words and numbers, every
# page distinct; stdlib only (its heap is its data); it waits on stdin and exits when it closes.
WORKLOAD = r"""
import random, sys
rnd = random.Random(1)
words = [b'"role"', b'"tool"', b"result", b"\\n", b"value", b"error", b"{", b"}", b"def"]
heap = []
size = int(sys.argv[1])
while sum(map(len, heap)) < size:
    chunk = bytearray()
    while len(chunk) < 1 << 20:
        chunk += rnd.choice(words) + str(rnd.randrange(10**6)).encode() + b" "
    heap.append(chunk)
print("READY", flush=True)
sys.stdin.read()
"""


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def _swap_on(dev: str) -> Iterator[str]:
    _run("mkswap", dev)
    _run("swapon", "-p", "32767", dev)
    try:
        yield dev
    finally:
        subprocess.run(["swapoff", dev], check=False)


@contextlib.contextmanager
def _loop(path: str) -> Iterator[str]:
    try:
        dev = _run("losetup", "--direct-io=on", "--show", "-f", path)
    except subprocess.CalledProcessError:  # a backing file without O_DIRECT: buffered
        dev = _run("losetup", "--show", "-f", path)
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


@contextlib.contextmanager
def zram_row() -> Iterator[None]:
    backend = ZramSwap("lz4", size=DEVICE_BYTES)
    backend.attach()
    try:
        yield
    finally:
        backend.detach()


@contextlib.contextmanager
def tmpfs_row() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="azfloor-", dir="/dev/shm") as shm:
        path = os.path.join(shm, "swap")
        with open(path, "wb") as f:
            f.truncate(DEVICE_BYTES)
        with _loop(path) as dev, _swap_on(dev):
            yield


@contextlib.contextmanager
def fuse_row() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="azfloor-") as tmp:
        exe = build_floor(tmp)
        mnt = os.path.join(tmp, "mnt")
        os.mkdir(mnt)
        proc = subprocess.Popen([exe, mnt, str(DEVICE_BYTES), "mt"], stdin=subprocess.DEVNULL)
        try:
            wait_for_file(os.path.join(mnt, "device"), proc, size=DEVICE_BYTES)
            with _loop(os.path.join(mnt, "device")) as dev, _swap_on(dev):
                yield
        finally:
            stop_floor(mnt, proc)


@contextlib.contextmanager
def agentzip_row(config: str = "") -> Iterator[None]:
    """`agentzip-blk up` in its own process, with `config` (YAML) as its config file."""
    with tempfile.TemporaryDirectory(prefix="azfloor-run-") as run_dir:
        path = os.path.join(run_dir, "config.yaml")
        with open(path, "w") as f:
            f.write(config)
        cli = [sys.executable, "-m", "agentzip_blk.cli", "--config", path, "--run-dir", run_dir]
        subprocess.run([*cli, "up"], check=True, capture_output=True)
        try:
            yield
        finally:
            subprocess.run([*cli, "down"], check=False, capture_output=True)


ROWS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "zram lz4": zram_row,
    "loop + tmpfs": tmpfs_row,
    "loop + C FUSE floor": fuse_row,
    "agentzip-blk (up; defaults)": agentzip_row,
    "agentzip-blk (up; warm lz4)":
        lambda: agentzip_row("compression:\n  warm_algorithm: lz4\n"),
}


def probe_row(name: str, mb: int, faults: int) -> dict:
    """One row: the workload filled, squeezed to 10%, `faults` single pages read back."""
    cg = MemoryCgroup.create(f"azfloor-{os.getpid()}")
    proc = None
    try:
        cg.allow_swap()
        cg.set_swappiness(100)
        proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(mb * MiB)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                preexec_fn=joiner(cg))
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{name}: the workload did not start")
        with ROWS[name]():
            usage = cg.usage()
            target = usage // 10
            for _ in range(100):  # v1: the write reclaims; it may need a few tries
                if set_limit_quiet(cg, target):
                    break
                time.sleep(0.1)
            t0 = time.monotonic()
            swapped = cg.swap_usage()
            lat_ns = pagewalk.probe([proc.pid], faults, swapped=True, seed=3)
            cg.set_limit(None)
            seconds = time.monotonic() - t0
        a = np.array(lat_ns) / 1e3
        return {"name": name, "faults": len(a), "usage_mib": usage / MiB,
                "swapped_mib": swapped / MiB, "probe_s": round(seconds, 2),
                "p50_us": float(np.percentile(a, 50)), "p90_us": float(np.percentile(a, 90)),
                "p99_us": float(np.percentile(a, 99))}
    finally:
        with contextlib.suppress(Exception):
            cg.set_limit(None)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        kill_all(cg)
        cg.remove()


def median_row(name: str, rounds: list[dict]) -> dict:
    """A row's median over its rounds, figure by figure, with the range of its p50."""
    row = {"name": name, "faults": sum(r["faults"] for r in rounds)}
    for key in ("p50_us", "p90_us", "p99_us", "swapped_mib"):
        row[key] = float(np.median([r[key] for r in rounds]))
    row["p50_range_us"] = [min(r["p50_us"] for r in rounds), max(r["p50_us"] for r in rounds)]
    return row


def markdown(res: dict, argv: list[str]) -> str:
    rows = res["rows"]
    zram = next((r for r in rows if r["name"] == "zram lz4"), None)
    lines = [
        "## The floor of a real-swap fault",
        "",
        f"Generated by `bench/swapfloor.py` on {res['when']} in {res['minutes']:.1f} min "
        f"(vm.page-cluster {res['page_cluster']}). Command (as root):",
        "",
        "    " + " ".join(["flock /tmp/agentzip-swap.lock .venv/bin/python -m bench swapfloor", *argv]),
        "",
        f"One workload of {res['mb']} MiB of agent-like text squeezed to 10% of its cgroup "
        f"usage, then {res['faults_asked']} single pages read back at random, one at a time, "
        "with each configuration as the only swap in turn; the rows take turns for "
        f"{res['repeat']} rounds and each figure is the median over them (p50 range in "
        "brackets). "
        "Everything but zram goes through the loop driver (this kernel has no nbd or ublk "
        "driver): its rows are the floor under any userspace swap device here.",
        "",
        "| swap device | faults | p50 us (range) | p90 us | p99 us | p50 / zram | p99 / zram |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = (f"{r['p50_us'] / zram['p50_us']:.1f}x | {r['p99_us'] / zram['p99_us']:.1f}x"
                 if zram else "- | -")
        lo, hi = r["p50_range_us"]
        lines.append(f"| {r['name']} | {r['faults']} | {r['p50_us']:.0f} ({lo:.0f}-{hi:.0f}) | "
                     f"{r['p90_us']:.0f} | "
                     f"{r['p99_us']:.0f} | {ratio} |")
    if zram and zram["p99_us"] > 20 * zram["p50_us"]:
        lines += ["", f"zram's p99 is {zram['p99_us']:.0f} us here, {zram['p99_us'] / zram['p50_us']:.0f}x "
                  "its p50 (under `bench swap` it is 33-44 us): the p99 ratios of this run are not "
                  "comparable with that bench's."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench swapfloor", description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="workload heap MiB (default 64)")
    ap.add_argument("--faults", type=int, default=2000, help="pages read back per row")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of every row, in turn; the table shows each row's median")
    ap.add_argument("--md", default=os.path.join(REPO, "BENCHMARKS.md"))
    ap.add_argument("--no-md", action="store_true")
    ap.add_argument("--json", default=os.path.join(REPO, "results", "swapfloor.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench swapfloor: needs root (swapon, losetup, cgroups)")
    with open("/proc/swaps") as f:
        if len(f.read().splitlines()) > 1:
            raise SystemExit("bench swapfloor: another swap is on; each row must be the only one")
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"bench swapfloor: unknown rows {unknown}; rows: {list(ROWS)}")
    with open("/proc/sys/vm/page-cluster") as f:
        page_cluster = int(f.read())
    t0 = time.monotonic()
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(args.repeat):
        for name in names:
            row = probe_row(name, args.mb, args.faults)
            print(f"swapfloor: round {i + 1}: {name}: p50 {row['p50_us']:.0f} us, p99 "
                  f"{row['p99_us']:.0f} us ({row['faults']} faults, {row['swapped_mib']:.0f} "
                  "MiB in swap)", flush=True)
            rounds[name].append(row)
    rows = [median_row(name, rounds[name]) for name in names]
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mb": args.mb,
           "faults_asked": args.faults, "page_cluster": page_cluster, "repeat": args.repeat,
           "minutes": (time.monotonic() - t0) / 60, "rows": rows, "rounds": rounds}
    write_json(args.json, res)
    if not args.no_md:
        write_section(args.md, "swapfloor", markdown(res, argv))
    print(markdown(res, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
