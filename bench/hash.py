"""What the dedup hash costs per 4 KiB page on the write path, against compressing the page.

    .venv/bin/python -m bench hash [--pages 20000]

Times, on the same agent-like pages in one run: xxh3-128 unseeded (the old hash), xxh3-128
with a random seed (store.dedup.PageHasher, the hash now), keyed blake2b-128 (a real MAC, the
alternative considered), and zstd level 3 on 16-page frames divided per page (what a write
costs anyway). Prints microseconds per page and the ratio to the unseeded hash.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time

import xxhash
import zstandard

from agentzip_blk.store.dedup import PageHasher

PAGE = 4096


def page(n: int) -> bytes:
    rnd = random.Random(n)
    words = [b'{"role": "tool",', b'"content":', b'"result"', b"value", b"42,", str(n).encode()]
    return b" ".join(rnd.choice(words) for _ in range(PAGE))[:PAGE]


def per_page(fn, pages: list[bytes], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for p in pages:
            fn(p)
        best = min(best, (time.perf_counter() - t0) / len(pages))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=20000)
    args = ap.parse_args()
    pages = [page(n) for n in range(args.pages)]
    key = os.urandom(32)
    keyed = PageHasher()
    frames = [b"".join(pages[i:i + 16]) for i in range(0, len(pages) - 15, 16)]
    zstd = zstandard.ZstdCompressor(level=3)
    rows = [
        ("xxh3-128 unseeded (old)", per_page(xxhash.xxh3_128_intdigest, pages)),
        ("xxh3-128 seeded (PageHasher)", per_page(keyed, pages)),
        ("blake2b-128 keyed", per_page(
            lambda p: hashlib.blake2b(p, key=key, digest_size=16).digest(), pages)),
        ("zstd-3, 16-page frames, per page", per_page(zstd.compress, frames) / 16),
    ]
    base = rows[0][1]
    print(f"{args.pages} agent-like 4 KiB pages, best of 3")
    print(f"{'':34} {'us/page':>8} {'x old':>7}")
    for name, t in rows:
        print(f"{name:34} {t * 1e6:8.2f} {t / base:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
