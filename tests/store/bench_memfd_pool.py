"""What the pool's memfd-backed arenas cost in the request path (issue 28), against the
private anonymous arenas before them: run this file with the venv of each checkout.

    .venv/bin/python tests/store/bench_memfd_pool.py [ROUNDS]
    .venv/bin/python tests/store/bench_memfd_pool.py handover [PAGES [WARM]]   (this checkout)
    .venv/bin/python tests/store/bench_memfd_pool.py mapping      (the kernel's part alone)

In-process, no FUSE: the native path driven as tests/nativeharness.py drives it, and the
Python path's PageStore.write/read. Per round, on a fresh store: 16-page writes of text
pages (warm lz4 alone, so the native path stores them), 16-page reads of them all, then
zero pages over them all (every blob and arena freed: the munmap, and with the memfd the
punch). And the worst case for the punch: an arena made and released per cell (Pool.alloc
and free of a lone cell). Prints one JSON line: the best round of each, in µs per page
(per cycle for the churn). `handover`: a default-sized (8 GiB) store holding PAGES pages
(default 65536: 256 MiB) in frames, exported and adopted in this process: the time of
export, adopt and check(), and the tables memfd's size. `mapping`: what changed in the
kernel's work, without the store: 4096 arenas of 16 KiB mapped (private anonymous, or
shared from a memfd at id * 64 KiB), written whole, read, unmapped (and punched); the best
of 15 alternating rounds, in µs per 4 KiB page.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import agentzip_blk  # noqa: E402

# the tests/ of the checkout whose package this runs (nativeharness)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(agentzip_blk.__file__)), "tests"))

from agentzip_blk.datapath import native  # noqa: E402
from agentzip_blk.store import PageStore  # noqa: E402
from agentzip_blk.store.pool import Pool  # noqa: E402
from nativeharness import NativeRequests, native_store  # noqa: E402

PAGE = 4096
PAGES = 16384  # 64 MiB written per round
BATCH = 16


def text_pages(n: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % seed]
    out = []
    for _ in range(n):
        words[-1] = b"%d" % rnd.randrange(1 << 30)
        out.append(b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b"."))
    return out


def one_round(io, pages: list[bytes]) -> dict[str, float]:
    requests = [b"".join(pages[i:i + BATCH]) for i in range(0, len(pages), BATCH)]
    zeros = bytes(BATCH * PAGE)
    t = time.perf_counter()
    for k, data in enumerate(requests):
        io.write(data, k * BATCH * PAGE)
    write = time.perf_counter() - t
    t = time.perf_counter()
    for k in range(len(requests)):
        io.read(k * BATCH * PAGE, BATCH * PAGE)
    read = time.perf_counter() - t
    t = time.perf_counter()
    for k in range(len(requests)):
        io.write(zeros, k * BATCH * PAGE)
    free = time.perf_counter() - t
    n = len(pages)
    return {"write_us": write / n * 1e6, "read_us": read / n * 1e6, "free_us": free / n * 1e6}


def churn(cycles: int = 20000) -> float:
    pool = Pool(64 << 20)
    t = time.perf_counter()
    for _ in range(cycles):
        arena, cell = pool.alloc(100)
        pool.free(arena, cell)
    return (time.perf_counter() - t) / cycles * 1e6


def handover(pages: int, warm: str = "none") -> None:
    from agentzip_blk.config.schema import Config
    config = Config()
    config.pool.swap_out_path = None
    config.compression.dictionary = "none"
    config.compression.warm_algorithm = warm  # lz4: a blob row and a cell per page
    store = PageStore.from_config(config.device.size, config)
    batch = b"".join(text_pages(256, 2))
    for first in range(0, pages, 256):  # pages of the same few, dedup off in effect: no
        store.write(batch.replace(b"tool_call", b"%09d" % first), first * PAGE)
    t = time.perf_counter()
    exported = store.export()
    export_s = time.perf_counter() - t
    tables = os.fstat(exported.fds[1]).st_size
    t = time.perf_counter()
    adopted = PageStore.adopt(config.device.size, config, exported)
    adopt_s = time.perf_counter() - t
    t = time.perf_counter()
    adopted.check()
    check_s = time.perf_counter() - t
    store.release()
    print(json.dumps({"pages": pages, "warm": warm, "pool_bytes": adopted.pool.allocated_bytes,
                      "blobs": adopted.blobs.count, "tables_bytes": tables,
                      "export_ms": round(export_s * 1e3, 1), "adopt_ms": round(adopt_s * 1e3, 1),
                      "check_ms": round(check_s * 1e3, 1)}))
    adopted.close()


def mapping(rounds: int = 15) -> None:
    import ctypes

    from agentzip_blk.mman import libc
    arena, n, span = 16384, 4096, 65536
    out = ctypes.create_string_buffer(arena)
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, n * span)

    def once(shared: bool) -> list[float]:
        t0 = time.perf_counter()
        addrs = []
        for i in range(n):
            if shared:
                a = libc.mmap(None, arena, 3, 0x01, fd, i * span)  # MAP_SHARED
            else:
                a = libc.mmap(None, arena, 3, 0x22, -1, 0)  # MAP_PRIVATE | MAP_ANONYMOUS
            libc.madvise(a, arena, 16)  # MADV_DONTDUMP
            ctypes.memset(a, 7, arena)
            addrs.append(a)
        t1 = time.perf_counter()
        for a in addrs:
            ctypes.memmove(out, a, arena)
        t2 = time.perf_counter()
        for i, a in enumerate(addrs):
            libc.munmap(a, arena)
            if shared:
                libc.fallocate(fd, 3, i * span, arena)  # PUNCH_HOLE | KEEP_SIZE
        t3 = time.perf_counter()
        pages = n * arena / PAGE
        return [(t1 - t0) / pages * 1e6, (t2 - t1) / pages * 1e6, (t3 - t2) / pages * 1e6]

    best = {"anon": [1e9] * 3, "memfd": [1e9] * 3}
    for _ in range(rounds):
        for name in best:
            best[name] = [min(x, y) for x, y in zip(best[name], once(name == "memfd"))]
    os.close(fd)
    print(json.dumps({k: {"map_write_us": round(v[0], 2), "read_us": round(v[1], 2),
                          "unmap_us": round(v[2], 2)} for k, v in best.items()}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "mapping":
        mapping()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "handover":
        handover(int(sys.argv[2]) if len(sys.argv) > 2 else 65536,
                 sys.argv[3] if len(sys.argv) > 3 else "none")
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    pages = text_pages(PAGES, 1)
    best: dict[str, float] = {}

    def keep(prefix: str, got: dict[str, float]) -> None:
        for k, v in got.items():
            best[prefix + k] = min(best.get(prefix + k, float("inf")), v)

    for r in range(rounds):
        store = native_store(size=PAGES * PAGE, warm_algorithm="lz4", max_size=1 << 30)
        path = native.NativePath(store)
        door = NativeRequests(store, path)
        keep("native_", one_round(door, pages))
        # handed up: the few requests that found the blob table or the arena books full
        # (no maintainer here to grow them ahead of need)
        best["native_handed_up_writes"] = door.python_writes
        door.close()
        path.close()
        store.close()
        store = PageStore(PAGES * PAGE, warm_algorithm="lz4")
        keep("python_", one_round(store, pages))
        store.close()
        keep("", {"arena_churn_us": churn()})
    print(json.dumps({k: round(v, 2) for k, v in sorted(best.items())}))


if __name__ == "__main__":
    main()
