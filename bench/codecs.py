#!/usr/bin/env python3
"""Codec and dictionary benchmark on held-out heap pages of real runtimes, in the field
report's shape: per workload x codec, per-page ratio and compress/decompress MB/s.

Pages come from tools/dicts/collect.py (`heldout` runs: programs and runs that no shipped
dictionary was trained on). Every page is compressed on its own, as the store does; a page
whose compressed size exceeds 3 KiB counts as stored raw (4 KiB). Same-filled pages and
exact duplicates were removed at collection (the store never compresses them).

- `zstd 3 + prebuilt`: the store's own selection (agentzip_blk.dictionaries.Selector) over
  every shipped dictionary, on requests of --request pages in the run's address order;
  its compress time includes the selection trials.
- `zstd 3 + auto`: the same plus what `dictionary: auto` would have learnt on this host
  from an *earlier run* of the same program (the `host` run, another seed): HostTrainer
  trains on pages sampled from it and adopts the dictionary only if it wins on held-out
  samples of that run. Then the held-out run is compressed as above.

    .venv/bin/python -m bench codecs --corpus /var/tmp/agentzip-corpus

Writes the table into BENCHMARKS.md between <!-- bench_codecs:begin --> and :end -->.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone

import numpy as np

from agentzip_blk.codec.codecs import Lz4Codec, Lz4HcCodec, ZstdCodec, stored_size
from agentzip_blk.codec.dictionaries.registry import DictionaryRegistry
from agentzip_blk.codec.dictionaries.selector import Selector
from agentzip_blk.codec.dictionaries.trainer import HostTrainer
from agentzip_blk.codec.estimate import measure
from bench.harness.md import write_section
from bench.harness.results import REPO as ROOT
from bench.harness.results import write_json

PAGE = 4096
WORKLOAD_ORDER = ["Python data analysis", "tool calling", "headless browser", "Node.js text"]


def load_pages(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    return [data[i:i + PAGE] for i in range(0, len(data) - PAGE + 1, PAGE)]


def plain(codec, pages: list[bytes]) -> dict:
    stored, ct, dt = measure(codec, pages)
    return {"stored": stored, "ctime": ct, "dtime": dt}


def selected(selector: Selector, registry: DictionaryRegistry, pages: list[bytes],
             request: int) -> dict:
    """Compress as the store does: one Choice per request of `request` pages."""
    outs: list[tuple[bytes, int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(pages), request):
        chunk = pages[start:start + request]
        choice = selector.choose(chunk)
        for n, p in enumerate(chunk):
            out = choice.sample_out if n == choice.sample else choice.codec.compress(p)
            outs.append((out, choice.dict_id))
    ct = time.perf_counter() - t0
    plain_dec = ZstdCodec(3)
    t0 = time.perf_counter()
    for (o, dict_id), p in zip(outs, pages):
        dec = registry.decoder(dict_id) if dict_id else plain_dec
        if dec.decompress(o) != p:
            raise AssertionError("round trip failed")
    dt = time.perf_counter() - t0
    ids = np.array([d for _, d in outs])
    usage = {e.name: int((ids == e.id).sum()) for e in registry.loaded() if (ids == e.id).any()}
    return {"stored": sum(stored_size(len(o)) for o, _ in outs), "ctime": ct, "dtime": dt,
            "usage": usage, "selection": selector.summary()}


def auto_registry(host_pages: list[bytes], level: int, seed: int) -> tuple[DictionaryRegistry, dict]:
    registry = DictionaryRegistry.from_setting("prebuilt", level)
    trainer = HostTrainer(registry, background=False)
    rnd = random.Random(seed)
    sample = rnd.sample(host_pages, min(len(host_pages), trainer.train_pages + trainer.heldout_pages))
    cut = len(sample) * 4 // 5
    adopted = trainer.train_and_maybe_adopt(sample[:cut], sample[cut:])
    return registry, {"adopted": adopted, "heldout_gain": trainer.stats.last_gain,
                      "host_pages": len(sample)}


def run(corpus: str, request: int, level: int) -> dict:
    runs = json.load(open(os.path.join(corpus, "runs.json")))
    held = [r for r in runs if r["role"] == "heldout"]
    results = []
    for r in held:
        pages = load_pages(os.path.join(corpus, r["file"]))
        if not pages:
            continue
        host = next((h for h in runs if h["role"] == "host" and h["program"] == r["program"]
                     and h["runtime"] == r["runtime"]), None)
        rows = {}
        for name, codec in [("lz4", Lz4Codec()), ("lz4hc", Lz4HcCodec(9)), ("zstd 1", ZstdCodec(1)),
                            ("zstd 3", ZstdCodec(3)), ("zstd 9", ZstdCodec(9))]:
            rows[name] = plain(codec, pages)
        registry = DictionaryRegistry.from_setting("prebuilt", level)
        rows["zstd 3 + prebuilt"] = selected(Selector(ZstdCodec(level), registry), registry,
                                             pages, request)
        if host is not None:
            areg, info = auto_registry(load_pages(os.path.join(corpus, host["file"])), level, 8)
            rows["zstd 3 + auto"] = selected(Selector(ZstdCodec(level), areg), areg, pages, request)
            rows["zstd 3 + auto"]["auto"] = info
        # What always using the matching runtime's dictionary would give (no selection):
        # the ceiling the selection is chasing.
        own = next((e for e in registry.loaded() if e.name == r["runtime"]), None)
        if own is not None:
            rows["zstd 3 + own dict, always"] = plain(own.codec, pages)
        for row in rows.values():
            row["ratio"] = len(pages) * PAGE / row["stored"]
            row["cMBs"] = len(pages) * PAGE / row["ctime"] / 1e6
            row["dMBs"] = len(pages) * PAGE / row["dtime"] / 1e6
        results.append({"workload": r.get("workload", r["program"]), "program": r["program"],
                        "runtime": r["runtime"], "version": r.get("version", ""), "seed": r["seed"],
                        "pages": len(pages), "host_run": host["file"] if host else None,
                        "rows": rows})
        print(f"{r['program']:18} zstd3 {rows['zstd 3']['ratio']:.3f}  prebuilt "
              f"{rows['zstd 3 + prebuilt']['ratio']:.3f}  auto "
              f"{rows.get('zstd 3 + auto', {}).get('ratio', 0):.3f}", flush=True)
    return {"results": results, "request": request, "level": level}


def table(data: dict, command: str) -> str:
    res = sorted(data["results"], key=lambda x: (WORKLOAD_ORDER.index(x["workload"])
                                                 if x["workload"] in WORKLOAD_ORDER else 9, x["program"]))
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Codecs and dictionaries on held-out heap pages",
        "",
        f"Generated by `bench/codecs.py` on {now}, one run; machine: {platform.system()} "
        f"{platform.release()}, {os.cpu_count()} CPUs. Command:",
        "",
        f"    {command}",
        "",
        "Pages: resident anonymous 4 KiB pages sampled from live processes of real runtimes "
        "(tools/dicts/collect.py), from programs and runs no shipped dictionary was trained on; "
        "same-filled pages and exact duplicates removed. Ratio = original bytes / stored bytes, "
        "each page compressed alone, a page above 3 KiB counted as stored raw. MB/s per core, "
        "Python calls included. *+ prebuilt*: the store's per-request selection over every "
        f"shipped dictionary ({data['request']}-page requests, its trials included in the "
        "compress time). *+ auto*: the same plus a host dictionary trained from an earlier run "
        "(other seed) of the same program, adopted only if it won on that run's held-out samples. "
        "*own dict, always*: the matching runtime's dictionary on every page, no selection (the ceiling "
        "selection chases). Gain = ratio / zstd 3 ratio - 1. Ratios are deterministic for a corpus; "
        "speeds were taken on a machine shared with other runs (load ~3 on 2 cores) and vary by "
        "up to ~2x between runs: compare them within a row group, not across tables.",
        "",
        "| workload | program (runtime) | pages | codec | ratio | gain vs zstd 3 | compress MB/s | decompress MB/s |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in res:
        base = r["rows"]["zstd 3"]["ratio"]
        for name, row in r["rows"].items():
            gain = f"{row['ratio'] / base - 1:+.1%}" if name.startswith("zstd 3 +") else ""
            lines.append(f"| {r['workload']} | {r['program']} ({r['version'].split(' built')[0]}) | "
                         f"{r['pages']} | {name} | {row['ratio']:.3f} | {gain} | {row['cMBs']:.0f} | "
                         f"{row['dMBs']:.0f} |")
    lines += ["", "Selection cost and what was chosen (zstd 3 + prebuilt):", ""]
    for r in res:
        row = r["rows"]["zstd 3 + prebuilt"]
        sel = row["selection"]
        plain_t = r["rows"]["zstd 3"]["ctime"]
        lines.append(f"- {r['program']}: {sel['trials']} trials in {sel['requests']} requests, "
                     f"{sel['extra_compressions']} extra compressions for {r['pages']} pages "
                     f"({sel['extra_compressions'] / r['pages']:.1%}), trial time "
                     f"{sel['trial_seconds'] * 1e3:.0f} ms = {sel['trial_seconds'] / row['ctime']:.1%} "
                     f"of this row's compress time (plain zstd 3: {plain_t * 1e3:.0f} ms, this row "
                     f"{row['ctime'] * 1e3:.0f} ms); pages per dictionary {row['usage'] or 'none'}.")
        auto = r["rows"].get("zstd 3 + auto", {}).get("auto")
        if auto:
            lines.append(f"  auto: host dictionary {'adopted' if auto['adopted'] else 'not adopted'} "
                         f"(gain on the host run's held-out samples {auto['heldout_gain']:+.1%}).")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="/var/tmp/agentzip-corpus")
    ap.add_argument("--request", type=int, default=32, help="pages per write request")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(ROOT, "results", "bench_codecs.json"))
    ap.add_argument("--markdown", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    data = run(a.corpus, a.request, a.level)
    write_json(a.json, data)
    cmd = ".venv/bin/python -m bench codecs" + (
        f" --corpus {a.corpus}" if a.corpus != "/var/tmp/agentzip-corpus" else "")
    write_section(a.markdown, "bench_codecs", table(data, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
