#!/usr/bin/env python3
"""Train the shipped dictionaries from a corpus made by collect.py and write them, with
their manifest, into agentzip_blk/dicts/ (package data).

For each runtime: zstd's COVER trainer picks ~SIZE bytes of content from the *training*
runs; only that content is shipped (raw-content dictionary). The manifest records, per
held-out run (other programs, other runs), the gain of zstd LEVEL + this dictionary over
plain zstd LEVEL, and, for comparison, the gain of the full trained dictionary (with its
entropy tables) -- which is what docs/ARCHITECTURE.md warns against, measured again here.

    .venv/bin/python tools/dicts/train.py --corpus /var/tmp/agentzip-corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from agentzip_blk.codec.codecs import ZstdCodec, ZstdDictCodec  # noqa: E402
from agentzip_blk.codec.dictionaries.trainer import content_of, sizes  # noqa: E402

OUT = os.path.join(ROOT, "agentzip_blk", "dicts")
# runtime -> shipped name
NAMES = {"python311": "python311", "python312": "python312", "v8": "v8", "chromium": "chromium"}


def load_pages(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    return [data[i:i + 4096] for i in range(0, len(data) - 4095, 4096)]


class _FullDictCodec(ZstdCodec):
    """zstd with a full trained dictionary (entropy tables and all): for the comparison only."""

    def __init__(self, trained: zstandard.ZstdCompressionDict, level: int) -> None:
        super().__init__(level)
        params = zstandard.ZstdCompressionParameters.from_level(
            level, source_size=4096, format=zstandard.FORMAT_ZSTD1_MAGICLESS,
            write_content_size=False, write_checksum=False, write_dict_id=False)
        self._cctx = zstandard.ZstdCompressor(dict_data=trained, compression_params=params)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="/var/tmp/agentzip-corpus")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--size", type=int, default=32768, help="dictionary size in bytes")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    runs = json.load(open(os.path.join(a.corpus, "runs.json")))
    os.makedirs(a.out, exist_ok=True)
    entries = []
    for runtime, name in NAMES.items():
        train_runs = [r for r in runs if r["runtime"] == runtime and r["role"] == "train"]
        held_runs = [r for r in runs if r["runtime"] == runtime and r["role"] == "heldout"]
        if not train_runs:
            print(f"{runtime}: no training runs in {a.corpus}, skipped")
            continue
        train = [p for r in train_runs for p in load_pages(os.path.join(a.corpus, r["file"]))]
        trained = zstandard.train_dictionary(a.size, train, k=a.k, d=a.d, steps=a.steps,
                                             threads=2, level=a.level)
        content = content_of(trained)
        plain = ZstdCodec(a.level)
        raw = ZstdDictCodec(content, a.level)
        full = _FullDictCodec(trained, a.level)
        gain, gain_full = {}, {}
        for r in held_runs:
            pages = load_pages(os.path.join(a.corpus, r["file"]))
            base = sizes(plain, pages).sum()
            key = f"{r['program']} (seed {r['seed']})"
            gain[key] = round(float(base / sizes(raw, pages).sum() - 1), 4)
            gain_full[key] = round(float(base / sizes(full, pages).sum() - 1), 4)
        with open(os.path.join(a.out, f"{name}.dict"), "wb") as f:
            f.write(content)
        programs = sorted({f"{r['program']} seeds {','.join(str(x['seed']) for x in train_runs if x['program'] == r['program'])}"
                           for r in train_runs})
        entry = {
            "name": name,
            "runtime": runtime,
            "version": train_runs[0]["version"],
            "corpus": (f"resident anonymous pages of {'; '.join(programs)} (tools/dicts/programs, "
                       f"collect.py): {len(train)} distinct non-same-filled 4 KiB pages"),
            "size": len(content),
            "params": {"trainer": "zstd COVER (train_dictionary)", "k": a.k, "d": a.d,
                       "steps": a.steps, "requested_size": a.size, "level": a.level,
                       "type": "raw content (header and entropy tables stripped)"},
            "gain": gain,
            "gain_with_entropy_tables": gain_full,
            "heldout": [f"{r['program']} seed {r['seed']} ({r['version']})" for r in held_runs],
            "sha256": hashlib.sha256(content).hexdigest(),
            "file": f"{name}.dict",
        }
        entries.append(entry)
        print(f"{name:10} {len(content)} bytes from {len(train)} pages; held-out gain "
              f"raw {gain}  with tables {gain_full}")
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump({"format": 1, "dictionaries": entries}, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
