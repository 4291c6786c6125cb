"""Which FUSE binding serves the swap file fastest: the same in-memory file, each binding.

    .venv/bin/python -m bench frontdoor [--reads 4000] [--threads 2]
        [--backends rawpy,llfuse,pyfuse3,cfloor,cfloor-mt]
    .venv/bin/python -m bench frontdoor --chain   # the real server, each front door

Each backend serves one file (``device``, 64 MiB, a bytearray or a calloc'd buffer) in a
process of its own; this process attaches a loop device to it with ``--direct-io=on`` (as
``agentzip-blk up`` does) and times O_DIRECT 4 KiB random reads and writes on the loop
device, one at a time, plus reads on the FUSE file itself. Backends:

- ``rawpy``: agentzip_blk.datapath.fuse, our pure-Python loop on /dev/fuse (the front door)
- ``llfuse``: Debian's python3-llfuse 1.4 (libfuse 2), ``llfuse.main(workers=N)``
- ``pyfuse3``: Debian's python3-pyfuse3 3.2 (libfuse 3, trio)
- ``cfloor`` / ``cfloor-mt``: bench/harness/fusefloor.c, libfuse 3 low level, built here with cc;
  single-threaded / ``fuse_session_loop_mt``: the floor for any userspace FUSE chain

No swap is attached; loop devices and mounts are undone in a finally.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.harness.floor import build_floor, stop_floor, wait_for_file  # noqa: E402

SIZE = 64 << 20
PAGE = 4096
BACKENDS = ("rawpy", "llfuse", "pyfuse3", "cfloor", "cfloor-mt")


# -- servers (run in the child) -------------------------------------------------------------

class MemBackend:
    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)

    def pread(self, out, offset: int) -> None:
        out[:] = self.buf[offset:offset + len(out)]

    def pwrite(self, data, offset: int) -> None:
        self.buf[offset:offset + len(data)] = data

    def trim(self, offset: int, length: int) -> None:
        self.buf[offset:offset + length] = bytes(length)

    zero = trim

    def flush(self) -> None:
        pass


def serve_rawpy(mnt: str, size: int, threads: int) -> None:
    from agentzip_blk.datapath.fuse import FuseFile

    f = FuseFile(mnt, size, MemBackend(size), threads=threads)
    f.start()
    signal.signal(signal.SIGTERM, lambda *a: f.stop())
    while f.alive:
        time.sleep(0.2)
    f.stop()


def serve_llfuse(mnt: str, size: int, threads: int) -> None:
    import llfuse

    data = bytearray(size)

    class Ops(llfuse.Operations):
        def _attr(self, inode):
            a = llfuse.EntryAttributes()
            a.st_ino = inode
            a.st_mode = (0o40700 if inode == llfuse.ROOT_INODE else 0o100600)
            a.st_nlink = 1
            a.st_size = size if inode != llfuse.ROOT_INODE else 0
            a.st_blksize = PAGE
            a.attr_timeout = a.entry_timeout = 1e6
            return a

        def getattr(self, inode, ctx=None):
            return self._attr(inode)

        def lookup(self, parent, name, ctx=None):
            if parent != llfuse.ROOT_INODE or name != b"device":
                raise llfuse.FUSEError(2)
            return self._attr(2)

        def open(self, inode, flags, ctx=None):
            return inode

        def read(self, fh, off, n):
            return bytes(data[off:off + n])

        def write(self, fh, off, buf):
            data[off:off + len(buf)] = buf
            return len(buf)

    llfuse.init(Ops(), mnt, ["fsname=llfuse-bench", "allow_other", "max_read=1048576"])
    try:
        llfuse.main(workers=threads, handle_signals=False)
    finally:
        llfuse.close(unmount=False)


def serve_pyfuse3(mnt: str, size: int, threads: int) -> None:
    import pyfuse3
    import trio

    data = bytearray(size)

    class Ops(pyfuse3.Operations):
        def _attr(self, inode):
            a = pyfuse3.EntryAttributes()
            a.st_ino = inode
            a.st_mode = (0o40700 if inode == pyfuse3.ROOT_INODE else 0o100600)
            a.st_nlink = 1
            a.st_size = size if inode != pyfuse3.ROOT_INODE else 0
            a.st_blksize = PAGE
            a.attr_timeout = a.entry_timeout = 1e6
            return a

        async def getattr(self, inode, ctx=None):
            return self._attr(inode)

        async def lookup(self, parent, name, ctx=None):
            if parent != pyfuse3.ROOT_INODE or name != b"device":
                raise pyfuse3.FUSEError(2)
            return self._attr(2)

        async def open(self, inode, flags, ctx):
            return pyfuse3.FileInfo(fh=inode, direct_io=True)

        async def read(self, fh, off, n):
            return bytes(data[off:off + n])

        async def write(self, fh, off, buf):
            data[off:off + len(buf)] = buf
            return len(buf)

    opts = set(pyfuse3.default_options) | {"fsname=pyfuse3-bench", "allow_other"}
    pyfuse3.init(Ops(), mnt, opts)
    try:
        trio.run(pyfuse3.main, threads)
    finally:
        pyfuse3.close(unmount=False)


# -- the client ---------------------------------------------------------------------------------

def pct(sorted_us: list[float], p: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(p / 100 * len(sorted_us)))]


def time_io(path: str, n: int, write: bool, seed: int = 1) -> dict:
    """n O_DIRECT 4 KiB random reads (or writes) on ``path``, one at a time, in microseconds."""
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
    buf = mmap.mmap(-1, PAGE)
    buf.write(os.urandom(PAGE))
    rng = random.Random(seed)
    pages = SIZE // PAGE
    lat = []
    try:
        for _ in range(200):  # warm-up
            os.preadv(fd, [buf], rng.randrange(pages) * PAGE)
        for _ in range(n):
            off = rng.randrange(pages) * PAGE
            t0 = time.perf_counter()
            if write:
                os.pwritev(fd, [buf], off)
            else:
                os.preadv(fd, [buf], off)
            lat.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(fd)
    lat.sort()
    return {"p50": pct(lat, 50), "p99": pct(lat, 99), "mean": sum(lat) / len(lat)}


def is_mounted(mnt: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mnt for line in f)


def run_backend(name: str, threads: int, reads: int, floor_exe: str | None) -> dict:
    mnt = tempfile.mkdtemp(prefix=f"azfront-{name}-")
    path = os.path.join(mnt, "device")
    if name.startswith("cfloor"):
        argv = [floor_exe, mnt, str(SIZE)] + (["mt"] if name == "cfloor-mt" else [])
    else:
        argv = [sys.executable, os.path.abspath(__file__), "--serve", name, mnt,
                "--threads", str(threads)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    loop = None
    try:
        wait_for_file(path, proc)
        loop = subprocess.run(["losetup", "--direct-io=on", "--show", "-f", path],
                              capture_output=True, text=True, check=True).stdout.strip()
        dio = open(f"/sys/block/{os.path.basename(loop)}/loop/dio").read().strip() == "1"
        row = {"backend": name, "dio": dio,
               "loop_read": time_io(loop, reads, False),
               "loop_write": time_io(loop, reads, True),
               "file_read": time_io(path, reads, False)}
        return row
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        stop_floor(mnt, proc)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


def chain_rows(reads: int, unit_pages: int = 16) -> list[tuple[str, dict]]:
    """One agentzip server (nbdkit + plugin + fuse=), one store, one copy of the data; each
    front door in turn: NBD (libnbd), nbdfuse's file and loop over it, the server's own FUSE
    file and loop over it. No swap is attached."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from pathlib import Path

    from bench.harness import blockio as bl
    from nbdkit_server import start_server

    tmp = Path(tempfile.mkdtemp(prefix="azchain-"))
    cfg = tmp / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp / 'tier'}\ncompression:\n  dictionary: none\n"
                   f"  unit_pages: {unit_pages}\n")
    mnt = str(tmp / "mnt")
    data, offs = bl.agent_pages(bl.DATA), bl.offsets()[:reads]
    server = start_server(tmp, size=str(1 << 30), config=cfg, extra_keys=(f"fuse={mnt}",),
                          wait_for=(os.path.join(mnt, "device"),))
    rows: list[tuple[str, dict]] = []
    loops: list[str] = []
    nbdfuse = None
    from agentzip_blk.datapath import control

    def store_reads() -> tuple[int, float]:
        r = control.request(server.control_socket, "stats")["latency"]["read"]
        return r["count"], r["sum_s"]

    def timed(call) -> dict:
        """The reads, plus the mean time the server spent in store.readinto for them."""
        c0, s0 = store_reads()
        row = bl.time_calls(call, offs)
        c1, s1 = store_reads()
        row["store_mean_us"] = round((s1 - s0) / max(1, c1 - c0) * 1e6, 1)
        return row

    nmnt = str(tmp / "nbdfuse")
    try:
        fuse_file = os.path.join(mnt, "device")
        bl.write_direct(fuse_file, data)
        h, call = bl.nbd_reader(server.nbd_socket)
        rows.append(("NBD: libnbd -> nbdkit -> plugin", timed(call)))
        h.shutdown()
        os.makedirs(nmnt)
        nfile = os.path.join(nmnt, "nbd")
        nbdfuse = subprocess.Popen(["nbdfuse", nfile, "--unix", server.nbd_socket],
                                   stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not os.path.exists(nfile) and time.monotonic() < deadline:
            time.sleep(0.05)
        for label, path in (("nbdfuse", nfile), ("in-process FUSE", fuse_file)):
            fd, call = bl.direct_reader(path)
            rows.append((f"{label}: the FUSE file (O_DIRECT)", timed(call)))
            os.close(fd)
            loop = subprocess.run(["losetup", "--direct-io=on", "--show", "-f", path],
                                  capture_output=True, text=True, check=True).stdout.strip()
            loops.append(loop)
            fd, call = bl.direct_reader(loop)
            rows.append((f"{label}: + loop device (O_DIRECT), the swap-in path", timed(call)))
            os.close(fd)
    finally:
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], check=False)
        for m in (nmnt, mnt):
            if os.path.isdir(m) and is_mounted(m):
                subprocess.run(["fusermount3", "-u", m], check=False)
        if nbdfuse is not None:
            try:
                nbdfuse.wait(10)
            except subprocess.TimeoutExpired:
                nbdfuse.kill()
                nbdfuse.wait()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", nargs=2, metavar=("BACKEND", "MNT"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reads", type=int, default=4000)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--chain", action="store_true",
                    help="the real server instead: one store behind each front door in turn")
    ap.add_argument("--unit-pages", type=int, default=16, help="with --chain: compression.unit_pages")
    args = ap.parse_args()
    if args.serve:
        backend, mnt = args.serve
        {"rawpy": serve_rawpy, "llfuse": serve_llfuse,
         "pyfuse3": serve_pyfuse3}[backend](mnt, SIZE, args.threads)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_frontdoor: run as root (mount, losetup)")
    if args.chain:
        rows = chain_rows(args.reads, args.unit_pages)
        print(f"agentzip server, 64 MiB of agent-like pages (zstd 3, {args.unit_pages}-page units, no "
              f"dictionary), {args.reads} O_DIRECT 4 KiB random reads, one at a time; "
              f"{os.uname().release}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print("| front door | p50 us | p99 us | p99.9 us | mean us | of which store.readinto, "
              "mean us |\n|---|---:|---:|---:|---:|---:|")
        for name, r in rows:
            print(f"| {name} | {r['p50_us']} | {r['p99_us']} | {r['p999_us']} | {r['mean_us']} "
                  f"| {r['store_mean_us']} |")
        return
    names = [b for b in args.backends.split(",") if b]
    for name in ("llfuse", "pyfuse3"):  # optional: apt-get install python3-llfuse python3-pyfuse3
        if name in names and subprocess.run([sys.executable, "-c", f"import {name}"],
                                            capture_output=True).returncode != 0:
            print(f"bench_frontdoor: {name} not installed (apt-get install python3-{name}); "
                  "skipped", file=sys.stderr)
            names.remove(name)
    tmp = tempfile.mkdtemp(prefix="azfront-build-")
    try:
        floor = build_floor(tmp) if any(n.startswith("cfloor") for n in names) else None
        rows = [run_backend(n, args.threads, args.reads, floor) for n in names]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(rows)} backends, {args.reads} O_DIRECT 4 KiB random ops each, one at a time, "
          f"{args.threads} server threads (Python backends); {os.uname().release}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| backend | loop read p50 / p99 / mean us | loop write p50 / p99 / mean us "
          "| FUSE file read p50 / p99 us | loop dio |")
    print("|---|---|---|---|---|")
    for r in rows:
        lr, lw, fr = r["loop_read"], r["loop_write"], r["file_read"]
        print(f"| {r['backend']} | {lr['p50']:.1f} / {lr['p99']:.1f} / {lr['mean']:.1f} "
              f"| {lw['p50']:.1f} / {lw['p99']:.1f} / {lw['mean']:.1f} "
              f"| {fr['p50']:.1f} / {fr['p99']:.1f} | {'on' if r['dio'] else 'OFF'} |")


if __name__ == "__main__":
    main()
