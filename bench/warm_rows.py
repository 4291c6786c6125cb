#!/usr/bin/env python3
"""Offline, in-process: what the warm form costs once its pages are packed cold, against
frames at once (warm_algorithm none). The same JSON-like heap (seeded) is written in 32-page
requests to a real PageStore, the grace period passes on a fake clock, the maintainer drains
the backlog; then the store's ratio, compressed bytes and metadata by part, and the process
CPU of the writes, and the recompressor's own CPU clock for the packing. No swap, no server.

    .venv/bin/python -m bench warm_rows [--pages N]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from agentzip_blk.store.pagestore import PageStore
from agentzip_blk.store.tiering import Tiering

PAGE = 4096
WORDS = ["tool", "call", "result", "arguments", "assistant", "user", "content", "search",
         "file", "path"]


def heap(pages: int, seed: int = 3) -> bytes:
    rnd = random.Random(seed)
    items, data = [], b""
    while len(data) < pages * PAGE:
        items += [{"role": rnd.choice(WORDS), "id": rnd.randrange(10**6),
                   "text": " ".join(rnd.choice(WORDS) for _ in range(rnd.randrange(5, 40)))}
                  for _ in range(20000)]
        data = json.dumps(items).encode()
    return data[: pages * PAGE]


def run(warm: str, data: bytes) -> dict:
    now = [1000.0]
    st = PageStore(1 << 30, frame_pages=16, warm_algorithm=warm, dictionary="none",
                   tiering=Tiering(cold_grace_period=1.0), clock=lambda: now[0])
    t0 = time.process_time()
    for off in range(0, len(data), 32 * PAGE):
        st.write(data[off : off + 32 * PAGE], off)
    write_cpu = time.process_time() - t0
    now[0] += 5
    while True:
        with st.lock:
            if not st.recompressor.backlog():
                break
        st.maintain()
    pack_cpu = st.recompressor.cpu_seconds  # its thread's CPU clock, as stats reports it
    s = st.stats()
    st.check()
    return {"warm_algorithm": warm, "ratio": s["ratio"], "compressed_bytes": s["compressed_bytes"],
            "meta": s["meta"], "write_us_per_page": round(write_cpu / s["pages"] * 1e6, 1),
            "pack_us_per_page": round(pack_cpu / s["pages"] * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=20000)
    data = heap(ap.parse_args().pages)
    for warm in ("none", "lz4"):
        print(json.dumps(run(warm, data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
