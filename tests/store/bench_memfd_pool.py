"""What the pool's memfd-backed arenas cost in the request path (issue 28), against the
private anonymous arenas before them: run this file with the venv of each checkout.

    .venv/bin/python tests/store/bench_memfd_pool.py [ROUNDS]

In-process, no FUSE: the native path driven as tests/nativeharness.py drives it, and the
Python path's PageStore.write/read. Per round, on a fresh store: 16-page writes of text
pages (warm lz4 alone, so the native path stores them), 16-page reads of them all, then
zero pages over them all (every blob and arena freed: the munmap, and with the memfd the
punch). And the worst case for the punch: an arena made and released per cell (Pool.alloc
and free of a lone cell). Prints one JSON line: the best round of each, in µs per page
(per cycle for the churn).
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


def main() -> None:
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
