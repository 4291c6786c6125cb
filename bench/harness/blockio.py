"""Timed 4 KiB reads of a block device, a file or an NBD socket, one at a time, on the same
64 MiB of agent-like pages at the same random offsets (latency, frontdoor)."""

from __future__ import annotations

import mmap
import os
import random
import time

import numpy as np

PAGE = 4096
DATA = 64 << 20
READS = 4000


def agent_pages(size: int, seed: int = 1) -> bytes:
    rnd = random.Random(seed)
    words = [b'"role"', b'"tool"', b"result", b"\\n", b"value", b"error", b"{", b"}", b"def"]
    out = bytearray()
    while len(out) < size:
        out += rnd.choice(words) + str(rnd.randrange(10**6)).encode() + b" "
    return bytes(out[:size])


def offsets(seed: int = 2) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(DATA // PAGE) * PAGE for _ in range(READS)]


def summarize(times: list[float]) -> dict:
    a = np.array(times) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1),
            "p999_us": round(float(np.percentile(a, 99.9)), 1),
            "mean_us": round(float(a.mean()), 1)}


def time_calls(call, offs: list[int]) -> dict:
    times = []
    for off in offs:
        t = time.perf_counter()
        call(off)
        times.append(time.perf_counter() - t)
    return summarize(times)


def direct_reader(path: str):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, PAGE)
    return fd, (lambda off: os.preadv(fd, [buf], off))


def nbd_reader(sock: str):
    import nbd

    h = nbd.NBD()
    h.connect_unix(sock)
    return h, (lambda off: h.pread(PAGE, off))


def write_direct(path: str, data: bytes, chunk: int = 1 << 20) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)
    try:
        for start in range(0, len(data), chunk):
            buf.seek(0)
            buf.write(data[start:start + chunk])
            os.pwritev(fd, [buf], start)
    finally:
        os.close(fd)
