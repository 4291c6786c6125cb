#!/usr/bin/env python3
"""Dictionaries in frames: `none` vs `prebuilt` vs `auto` on the four workloads, offline.

The real store (agentzip_blk.store.PageStore, 16-page frames, zstd 3, no swap attached)
is written with ordered page corpora of bench/swap.py's workloads (tools/dicts/collect_frames.py:
every resident anonymous page of the workload's process tree in address order, same-filled
pages and repeats dropped), in write requests of --request pages in that order:

1. the workload's *earlier run* (seed 8), then
2. its held-out run (seed 7), at the next offsets, after a pause of the trainer's
   `heldout_delay` (the store's clock is simulated: nothing sleeps).

Figures are for step 2 only. The same two steps run for each setting, so dedup against the
earlier run counts alike for all three. `auto` learns during step 1 (frames sampled from
the earlier run), and adopts a dictionary only if it wins on frames sampled from the first
writes of step 2 (a later run of the program); what follows those writes can use it.

- ratio: step 2's original bytes / the compressed bytes step 2 added (blob lengths);
- compress CPU: process CPU seconds of step 2's writes (hashing, selection trials, the
  store's books included) per GiB written;
- decompress CPU: seconds to decode every blob step 2 added, per GiB decoded;
- read: p50 / p99 of one 4 KiB store read of a random page of step 2, frame and hot caches
  emptied before each read (a frame's whole decompression each time);
- memory: bytes the dictionaries hold (registry.memory_bytes: content + loaded codecs),
  and the dictionaries loaded at the end (the lazy registry builds only chosen ones).

    .venv/bin/python -m bench dicts --corpus /var/tmp/agentzip-frames

Writes results/bench_dicts.json and the BENCHMARKS.md block between
<!-- bench_dicts:begin --> and <!-- bench_dicts:end -->. With --rss it also measures the
resident memory a store adds with every shipped dictionary registered, lazily (as now) and
all loaded (as before this change), each in a fresh process.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone

import numpy as np

from agentzip_blk.store import PageStore
from agentzip_blk.store.cache import HotCache
from bench.harness.md import write_section
from bench.harness.results import REPO as ROOT
from bench.harness.results import write_json

PAGE = 4096
GiB = 1 << 30
SETTINGS = ("none", "prebuilt", "auto")
NAMES = {"A": "Python data analysis", "B": "tool calling (JSON)", "C": "headless browser",
         "D": "Node.js text"}


def load_pages(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    return [data[i:i + PAGE] for i in range(0, len(data) - PAGE + 1, PAGE)]


class Clock:
    """The store's clock, moved by hand: the pause between the two runs costs no time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def compressed_bytes(store: PageStore) -> int:
    blobs = store.blobs
    return int(blobs.length[blobs.live()].astype(np.int64).sum())


def write_run(store: PageStore, pages: list[bytes], first: int, request: int) -> float:
    t0 = time.process_time()
    for i in range(0, len(pages), request):
        store.write(b"".join(pages[i:i + request]), (first + i) * PAGE)
    return time.process_time() - t0


def one(setting: str, earlier: list[bytes], held: list[bytes], request: int, frame_pages: int,
        reads: int, seed: int) -> dict:
    clock = Clock()
    store = PageStore((len(earlier) + len(held)) * PAGE, max_size=4 * GiB, dictionary=setting,
                      frame_pages=frame_pages, clock=clock)
    trainer = store.dicts.trainer
    if trainer is not None:
        trainer.background = False  # deterministic: the round runs inside the write
    write_run(store, earlier, 0, request)
    before = set(np.flatnonzero(store.blobs.live()).tolist())
    base = compressed_bytes(store)
    clock.t += (trainer.heldout_delay if trainer is not None else 0) + 1
    cpu_write = write_run(store, held, len(earlier), request)
    added = compressed_bytes(store) - base
    orig = len(held) * PAGE
    # decode every blob step 2 added
    new = [b for b in np.flatnonzero(store.blobs.live()).tolist() if b not in before]
    objects = store.objects
    decoded = 0
    t0 = time.process_time()
    for b in new:
        decoded += len(objects.decode(int(store.blobs.codec[b]), objects.stored_bytes(b),
                                      int(store.blobs.dict_id[b]),
                                      int(store.blobs.pages[b]) * PAGE))
    cpu_read = time.process_time() - t0
    # single-page reads, caches emptied first
    rnd = random.Random(seed)
    lat = []
    for _ in range(reads):
        slot = len(earlier) + rnd.randrange(len(held))
        objects.frames = HotCache(0)
        store.hot = objects.hot = HotCache(0)
        t0 = time.perf_counter_ns()
        got = store.read(slot * PAGE, PAGE)
        lat.append(time.perf_counter_ns() - t0)
        if bytes(got) != held[slot - len(earlier)]:
            raise AssertionError(f"{setting}: slot {slot} read back wrong")
    if bytes(store.read(len(earlier) * PAGE, orig)) != b"".join(held):
        raise AssertionError(f"{setting}: the held-out run did not read back byte for byte")
    store.check()
    dicts = store.dicts
    added_blobs = np.array(new, dtype=np.int64)
    frame_blobs = added_blobs[store.blobs.pages[added_blobs] > 1]
    with_dict = frame_blobs[store.blobs.dict_id[frame_blobs] > 0]
    out = {
        "ratio": orig / added,
        "pages": len(held),
        "compress_cpu_s_per_gib": cpu_write / (orig / GiB),
        "decompress_cpu_s_per_gib": cpu_read / (decoded / GiB),
        "read_p50_us": float(np.percentile(lat, 50)) / 1e3,
        "read_p99_us": float(np.percentile(lat, 99)) / 1e3,
        "dict_memory_bytes": dicts.registry.memory_bytes(),
        "loaded": sorted(dicts.registry.loaded_names()),
        "frames": int(len(frame_blobs)),
        "frames_with_dict": int(len(with_dict)),
        "frame_selection": dicts.frame_selector.summary() if dicts.frame_selector else None,
        "page_selection": dicts.selector.summary(),
    }
    if trainer is not None:
        hosts = [e for e in dicts.registry.loaded() if e.source == "host"]
        out["auto"] = dict(trainer.summary(), adopted_kind=hosts[-1].kind if hosts else None,
                           heldout_gains=hosts[-1].info.get("heldout_gains") if hosts else None)
    store.close()
    return out


def run(corpus: str, keys: list[str], request: int, frame_pages: int, reads: int) -> dict:
    res = {}
    for key in keys:
        earlier = load_pages(os.path.join(corpus, f"{key}-8.pages"))
        held = load_pages(os.path.join(corpus, f"{key}-7.pages"))
        rows = {s: one(s, earlier, held, request, frame_pages, reads, 7) for s in SETTINGS}
        res[key] = rows
        base = rows["none"]["ratio"]
        print(f"{key} {NAMES[key]:22} " + "  ".join(
            f"{s} {r['ratio']:.3f} ({r['ratio'] / base - 1:+.2%})" for s, r in rows.items()),
            flush=True)
    return {"results": res, "request": request, "frame_pages": frame_pages, "reads": reads}


RSS_CHILD = r"""
import gc, sys
sys.path.insert(0, sys.argv[1])
from agentzip_blk.store import PageStore
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
setting, load_all = sys.argv[2], sys.argv[3] == "1"
gc.collect(); r0 = rss()
store = PageStore(1 << 30, max_size=1 << 30, dictionary=setting, frame_pages=16)
if load_all:
    for e in store.dicts.registry.loaded():
        e.load()
        e.frame_codec.compress(bytes(16 * 4096))  # a frame compressor per dictionary exists
gc.collect()
print(rss() - r0, store.dicts.registry.memory_bytes(), len(store.dicts.registry.loaded_names()))
"""


def rss_rows() -> list[dict]:
    out = []
    for setting, load_all, label in [("none", "0", "none"),
                                     ("prebuilt", "0", "prebuilt, lazy (nothing chosen yet)"),
                                     ("prebuilt", "1", "prebuilt, every dictionary loaded (as before)")]:
        got = subprocess.run([sys.executable, "-c", RSS_CHILD, ROOT, setting, load_all],
                             capture_output=True, text=True, check=True).stdout.split()
        out.append({"what": label, "rss_delta": int(got[0]), "registry_bytes": int(got[1]),
                    "loaded": int(got[2])})
    return out


def net_ratio(r: dict) -> float:
    """The ratio with the dictionaries' memory counted as stored bytes (at this corpus's
    size: the memory is fixed, the savings grow with what is stored)."""
    return r["pages"] * PAGE / (r["pages"] * PAGE / r["ratio"] + r["dict_memory_bytes"])


def table(data: dict, command: str) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Dictionaries in frames",
        "",
        f"Generated by `bench/dicts.py` on {now}, one run; machine: {platform.system()} "
        f"{platform.release()}, {os.cpu_count()} CPUs. Command:",
        "",
        f"    {command}",
        "",
        "Offline, over the real store (`PageStore`, zstd 3, "
        f"{data['frame_pages']}-page frames, {data['request']}-page write requests, no swap "
        "attached): per workload an earlier run (seed 8) is written, then the held-out run "
        "(seed 7); figures are for the held-out run. Pages: every resident anonymous page of "
        "the workload (bench/swap.py's A-D at 100 MiB, tools/dicts/collect_frames.py) in "
        "address order, the proxy for swap order; same-filled pages and repeats dropped. "
        "*prebuilt*: the shipped dictionaries (raw content), chosen per request on a sample "
        "frame. *auto*: also a host dictionary trained on frames of the earlier run and "
        "adopted only if it beat the current choice on frames of the held-out run's first "
        "writes (the rest of that run may use it); it tries raw content and the full trained "
        "dictionary and keeps the better. Ratio = held-out bytes / compressed bytes they "
        "added (stored-memory ratios of the device are lower: metadata, pool cells). CPU per "
        "GiB: process CPU of the writes (hashing, trials, books included) and of decoding "
        "every new blob. Read: one 4 KiB store read with the caches emptied (a whole frame "
        f"decoded), {data['reads']} random pages. *Dictionary memory counted*: the "
        "dictionaries' bytes (registry.memory_bytes, an upper bound: the RSS table below "
        "measures ~1 MiB per loaded dictionary) added to the held-out run's compressed bytes; "
        "that memory is fixed while savings grow with what is stored, so at this corpus's "
        "size (100 MiB heaps) it dominates. Speeds from a shared 2-CPU VM: compare within a "
        "workload.",
        "",
        "| workload | setting | ratio | vs none | vs none, dictionary memory counted | compress CPU "
        "s/GiB | decompress CPU s/GiB | read p50 / p99 us | frames with a dictionary "
        "| dictionaries loaded (memory) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, rows in data["results"].items():
        base = rows["none"]["ratio"]
        for s, r in rows.items():
            note = ""
            if s == "auto" and r.get("auto"):
                a = r["auto"]
                note = (f"; host dictionary {'adopted (' + a['adopted_kind'] + ')' if a['adopted'] else 'not adopted'}, "
                        f"held-out gain {a['last_gain']:+.1%}" if a["last_gain"] is not None
                        else "; no round finished")
            delta = "" if s == "none" else f"{r['ratio'] / base - 1:+.1%}"
            net = "" if s == "none" else f"{net_ratio(r) / net_ratio(rows['none']) - 1:+.1%}"
            loaded = ", ".join(r["loaded"]) or "none"
            lines.append(
                f"| {key} {NAMES[key]} | {s} | {r['ratio']:.3f} | {delta} | "
                f"{net} | {r['compress_cpu_s_per_gib']:.1f} | {r['decompress_cpu_s_per_gib']:.2f} | "
                f"{r['read_p50_us']:.0f} / {r['read_p99_us']:.0f} | "
                f"{r['frames_with_dict']}/{r['frames']} | {loaded} "
                f"({r['dict_memory_bytes'] / 1024:.0f} KiB){note} |")
    res = data["results"]
    if "B" in res:
        pre = res["B"]["prebuilt"]["ratio"] / res["B"]["none"]["ratio"] - 1
        auto = res["B"]["auto"]["ratio"] / res["B"]["none"]["ratio"] - 1
        lines += ["", f"Targets (issue 19), JSON workload B, frames on: `prebuilt` >= +3% over "
                  f"`none`: **{'met' if pre >= 0.03 else 'not met'}** ({pre:+.1%}); `auto` trained "
                  f"on an earlier run >= +8%: **{'met' if auto >= 0.08 else 'not met'}** "
                  f"({auto:+.1%})."]
    if data.get("rss"):
        lines += ["", "Resident memory a store (1 GiB device, 16-page frames) adds, fresh "
                  "process each (`--rss`):", "",
                  "| store | RSS added | registry bytes | dictionaries loaded |",
                  "|---|---:|---:|---:|"]
        for r in data["rss"]:
            lines.append(f"| {r['what']} | {r['rss_delta'] / 1024:.0f} KiB | "
                         f"{r['registry_bytes'] / 1024:.0f} KiB | {r['loaded']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="/var/tmp/agentzip-frames")
    ap.add_argument("--workloads", default="A,B,C,D")
    ap.add_argument("--request", type=int, default=32, help="pages per write request")
    ap.add_argument("--frame-pages", type=int, default=16)
    ap.add_argument("--reads", type=int, default=300)
    ap.add_argument("--rss", action="store_true", help="also measure the lazy registry's RSS")
    ap.add_argument("--json", default=os.path.join(ROOT, "results", "bench_dicts.json"))
    ap.add_argument("--markdown", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    data = run(a.corpus, [k.strip() for k in a.workloads.split(",")], a.request, a.frame_pages,
               a.reads)
    if a.rss:
        data["rss"] = rss_rows()
    data["max_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    write_json(a.json, data)
    cmd = ".venv/bin/python -m bench dicts" + (" --rss" if a.rss else "") + (
        f" --workloads {a.workloads}" if a.workloads != "A,B,C,D" else "")
    write_section(a.markdown, "bench_dicts", table(data, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
