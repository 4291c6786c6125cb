#!/usr/bin/env python3
"""What a random 4 KiB fault pays to decode its frame, per frame layout, offline.

    .venv/bin/python -m bench frame_layout --corpus /var/tmp/agentzip-frames

For each workload's captured heap (tools/dicts/collect_frames.py; the first 24 MiB of its
seed-7 run), zstd 3 compresses it in frames of F pages, either as one block (what the store
does: `f16/b16`) or flushed into blocks of B pages inside the frame (`f16/b4`: zstd keeps
its window across the blocks, so the ratio barely moves, and a decoder can stop after the
block holding the page it needs). Reported per layout: the ratio, the mean time to decode
up to one random page of each frame (the whole frame when it is one block), and the time
to decode whole frames (what a sequential swap-in pays once per frame). No root, no swap.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import zstandard as zstd

PAGE = 4096
LAYOUTS = ((16, 16), (16, 4), (16, 2), (16, 1), (8, 8), (8, 2))  # (frame pages, block pages)


def flushed(cctx: zstd.ZstdCompressor, frame: bytes, block_pages: int) -> bytes:
    obj = cctx.compressobj(size=len(frame))
    out = []
    step = block_pages * PAGE
    for i in range(0, len(frame), step):
        out.append(obj.compress(frame[i : i + step]))
        if i + step < len(frame):
            out.append(obj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(obj.flush())
    return b"".join(out)


def measure(data: bytes) -> list[dict]:
    cctx = zstd.ZstdCompressor(level=3)
    dctx = zstd.ZstdDecompressor()
    rows = []
    for frame_pages, block_pages in LAYOUTS:
        size = frame_pages * PAGE
        frames = [data[i : i + size] for i in range(0, len(data) - size + 1, size)]
        one_block = block_pages == frame_pages
        comp = [cctx.compress(f) if one_block else flushed(cctx, f, block_pages) for f in frames]
        rnd = random.Random(1)
        wanted = [rnd.randrange(frame_pages) for _ in comp]
        t0 = time.perf_counter()
        for blob, page in zip(comp, wanted):
            if one_block:
                dctx.decompress(blob)
            else:
                dctx.stream_reader(blob, read_size=len(blob)).read((page + 1) * PAGE)
        random_us = (time.perf_counter() - t0) / len(comp) * 1e6
        t0 = time.perf_counter()
        for blob in comp:
            dctx.decompress(blob)
        whole_us = (time.perf_counter() - t0) / len(comp) * 1e6
        rows.append({"layout": f"f{frame_pages}/b{block_pages}",
                     "ratio": round(len(frames) * size / sum(map(len, comp)), 3),
                     "random_page_us": round(random_us), "whole_frame_us": round(whole_us)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="/var/tmp/agentzip-frames")
    ap.add_argument("--workloads", default="ABCD")
    ap.add_argument("--mb", type=int, default=24)
    args = ap.parse_args()
    for w in args.workloads:
        path = os.path.join(args.corpus, f"{w}-7.pages")
        with open(path, "rb") as f:
            data = f.read(args.mb << 20)
        rows = measure(data)
        print(w, "; ".join(f"{r['layout']}: ratio {r['ratio']:.3f} random page "
                           f"{r['random_page_us']} us, whole {r['whole_frame_us']} us" for r in rows),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
