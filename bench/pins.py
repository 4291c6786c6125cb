"""What the holder's pins cost per refresh (host/pinning.py), against faulting every page again.

    .venv/bin/python -m bench pins [--data-mib 1024] [--span-gib 4] [--repeat 5]

A memfd of SPAN with DATA written in it, once in one piece and once in 64 KiB extents 128 KiB
apart (the pool: an arena is a window of the memfd, written from its start). Times, in one run:
the first refresh (maps and faults in every page), a steady refresh (nothing new: mincore and
pagemap find every page mapped already), a refresh after 1% of the data is new, and the naive
refresh for reference (MADV_POPULATE_READ over every data range, SEEK_DATA/SEEK_HOLE, the
holder's first design). Prints milliseconds (median) and the holder's page tables (VmPTE).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from agentzip_blk import mman
from agentzip_blk.host import pinning

MiB = 1 << 20
EXTENT = 64 << 10
FALLOC_PUNCH = mman.FALLOC_FL_PUNCH_HOLE | mman.FALLOC_FL_KEEP_SIZE


def vm_pte_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmPTE:"))


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    out, offset = [], 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, end))
        offset = end
    return out


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(data: int, span: int, gap: int, repeat: int) -> dict:
    fd = os.memfd_create("bench-pins", os.MFD_CLOEXEC)
    pins = pinning.Pins()
    try:
        os.ftruncate(fd, span)
        chunk = os.urandom(EXTENT)
        offsets = [i * (EXTENT + gap) for i in range(data // EXTENT)]
        for off in offsets:
            os.pwrite(fd, chunk, off)
        pte0 = vm_pte_kib()
        t0 = time.perf_counter()
        first = pins.refresh([fd])
        first_ms = (time.perf_counter() - t0) * 1e3
        steady = timed(lambda: pins.refresh([fd]), repeat)
        fresh = offsets[::100]  # 1% of the extents punched and written again: new pages

        def new_pages_then_refresh() -> float:
            for off in fresh:
                mman.libc.fallocate(fd, FALLOC_PUNCH, off, EXTENT)
                os.pwrite(fd, chunk, off)
            t = time.perf_counter()
            pins.refresh([fd])
            return time.perf_counter() - t

        new_1pct = statistics.median(new_pages_then_refresh() for _ in range(repeat)) * 1e3
        (pin,) = pins.pins.values()
        naive = timed(lambda: [mman.libc.madvise(pin.address + s, e - s, mman.MADV_POPULATE_READ)
                               for s, e in data_ranges(fd, span)], repeat)
        return {"pinned_mib": first.bytes / MiB, "first": first_ms, "steady": steady,
                "new_1pct": new_1pct, "naive": naive, "pte_kib": vm_pte_kib() - pte0,
                "extents": len(data_ranges(fd, span))}
    finally:
        pins.close()
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench pins", description=__doc__.splitlines()[0])
    ap.add_argument("--data-mib", type=int, default=1024)
    ap.add_argument("--span-gib", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    data, span = args.data_mib * MiB, args.span_gib << 30
    print(f"memfd of {args.span_gib} GiB holding {args.data_mib} MiB; milliseconds, median of "
          f"{args.repeat}")
    print(f"{'layout':>22} {'extents':>8} {'first':>8} {'steady':>8} {'1% new':>8} "
          f"{'naive':>8} {'naive/steady':>13} {'VmPTE KiB':>10}")
    for name, gap in (("one piece", 0), ("64 KiB every 128 KiB", EXTENT)):
        r = run(data, span, gap, args.repeat)
        print(f"{name:>22} {r['extents']:8d} {r['first']:8.1f} {r['steady']:8.1f} "
              f"{r['new_1pct']:8.1f} {r['naive']:8.1f} {r['naive'] / r['steady']:13.2f} "
              f"{r['pte_kib']:10d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
