"""`agentzip-blk dict list|train|show`: the shipped zstd dictionaries, training one from live
processes' memory, describing a dictionary file.

    agentzip-blk dict list [-o COL,..]             shipped dictionaries and their measured gains
    agentzip-blk dict train --pid 123 --pid 456 -o host.dict
    agentzip-blk dict show host.dict
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from ..cgroups import procmem
from ..codec.codecs import ZstdCodec, ZstdDictCodec
from ..codec.dictionaries.files import dict_dir, load_manifest, read_file, write_file
from ..codec.dictionaries.trainer import sizes, train_content
from ..codec.estimate import classify
from . import progress
from ._common import PROG
from .table import BYTES, Column, Table, plain


def _gains(info) -> str | None:
    return ", ".join(f"{k} {v:+.1%}" for k, v in info.gain.items()) or None


DICTS = Table([
    Column("NAME", "dictionary name (compression.dictionary takes it)", lambda i: i.name),
    Column("SIZE", "dictionary bytes", lambda i: i.size, BYTES),
    Column("RUNTIME", "runtime and version it was trained on", lambda i: i.version),
    Column("GAIN", "held-out gain, zstd 3 + dictionary vs zstd 3, per workload", _gains),
    Column("KIND", "runtime family", lambda i: i.runtime, default=False),
    Column("CORPUS", "what it was trained from", lambda i: i.corpus, default=False),
    Column("SHA256", "checksum of the dictionary file", lambda i: i.sha256, default=False),
    Column("FILE", "file name in the dictionary directory", lambda i: i.file, default=False),
])

LIST_EXAMPLES = f"""\
examples:
  {PROG} dict list                      the shipped dictionaries
  {PROG} dict list -o NAME,SIZE -b --raw -n
"""


def register(subparsers) -> None:
    d = subparsers.add_parser(
        "dict", help="list, train and inspect zstd dictionaries",
        description="The shipped zstd dictionaries; training one from live processes' memory; "
                    "describing a dictionary file.",
        epilog=f"examples:\n  {PROG} dict list\n  {PROG} dict train --pid 123 -o host.dict\n"
               f"  {PROG} dict show host.dict",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    dsub = d.add_subparsers(dest="dict_command", metavar="ACTION", help="list | train | show")
    dsub.required = True
    s = dsub.add_parser("list", help="the shipped dictionaries (manifest)",
                        description="The shipped dictionaries and their measured gains, as a "
                                    "table like zramctl's.",
                        epilog=LIST_EXAMPLES + "\n" + DICTS.columns_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    DICTS.add_arguments(s, "print the manifest entries as a JSON list")
    s.set_defaults(func=cmd_list)
    s = dsub.add_parser("train", help="train a dictionary from live processes' memory",
                        description="Sample the memory of live processes, train a zstd "
                                    "dictionary on 4/5 of the distinct pages and measure it on "
                                    "the rest.",
                        epilog=f"example:\n  {PROG} dict train --pid 123 --pid 456 -o host.dict",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--pid", type=int, action="append", required=True, metavar="PID",
                   help="process to sample (repeat for several)")
    s.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the dictionary file to write")
    s.add_argument("--size", type=int, default=32768, help="dictionary bytes (default 32768)")
    s.add_argument("--sample", type=int, default=20000, help="pages to read at most")
    s.add_argument("--name", default="host", help="name recorded in the file (default host)")
    s.set_defaults(func=cmd_train)
    s = dsub.add_parser("show", help="describe a dictionary file",
                        description="The metadata of a dictionary file and how much of it is "
                                    "printable.",
                        epilog=f"example:\n  {PROG} dict show host.dict",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("file", help="a dictionary file (from `dict train`)")
    s.add_argument("--json", action="store_true", help="print the metadata as a JSON object")
    s.set_defaults(func=cmd_show)


def cmd_list(args) -> int:
    DICTS.select(args.output, args.output_all)
    infos = load_manifest()
    if args.json:
        print(json.dumps([vars(i) for i in infos], indent=1))
        return 0
    print(DICTS.print_args(infos, args))
    if plain(args):
        print(f"(from {dict_dir()})")
    return 0


def _pages(pids, limit) -> list[bytes]:
    pages = procmem.process_pages(pids, limit=limit, progress=progress.pages("reading memory"))
    unique, _, _ = classify(pages)
    return unique


def cmd_train(args) -> int:
    unique = _pages(args.pid, args.sample)
    if len(unique) < 200:
        print(f"agentzip-blk: error: only {len(unique)} distinct pages; need at least 200",
              file=sys.stderr)
        return 1
    rnd = random.Random(0)
    rnd.shuffle(unique)
    cut = len(unique) * 4 // 5
    train, held = unique[:cut], unique[cut:]
    content = train_content(train, args.size)
    base = sizes(ZstdCodec(3), held).sum()
    gain = float(base / sizes(ZstdDictCodec(content, 3), held).sum() - 1)
    write_file(args.output, content, {
        "name": args.name, "source": f"pids {','.join(map(str, args.pid))}",
        "trained_pages": len(train), "heldout_pages": len(held),
        "heldout_gain_zstd3": round(gain, 4), "type": "raw content"})
    print(f"{args.output}: {len(content)} bytes from {len(train)} pages; zstd 3 on "
          f"{len(held)} held-out pages: {gain:+.1%}")
    return 0


def cmd_show(args) -> int:
    content, meta = read_file(args.file)
    meta = dict(meta, bytes=len(content))
    if args.json:
        print(json.dumps(meta, indent=1, sort_keys=True))
        return 0
    for k in sorted(meta):
        print(f"{k:22} {meta[k]}")
    printable = sum(32 <= b < 127 for b in content) / max(1, len(content))
    print(f"{'printable':22} {printable:.0%} of the content is printable ASCII")
    return 0
