"""`agentzip-blk dict list|train|show` and `agentzip-blk estimate`.

    agentzip-blk dict list                         shipped dictionaries and their measured gains
    agentzip-blk dict train --pid 123 --pid 456 -o host.dict
    agentzip-blk dict show host.dict
    agentzip-blk estimate --pid 123 | --cgroup /sys/fs/cgroup/memory/agent-sandbox-1.slice
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence

from .cgroups import procmem
from .codec.estimate import Estimate, classify, estimate_pages


class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, label: str, stream=None, width: int = 30) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self._last = -1.0
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def __call__(self, done: int, total: int) -> None:
        frac = done / total if total else 1.0
        if not self._tty and frac < 1.0 and frac - self._last < 0.25:
            return  # a log file gets a few lines, not thousands
        if self._tty and frac < 1.0 and frac - self._last < 0.01:
            return
        self._last = frac
        fill = int(frac * self.width)
        line = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} {done}/{total}"
        self.stream.write(("\r" + line) if self._tty else (line + "\n"))
        if self._tty and frac >= 1.0:
            self.stream.write("\n")
        self.stream.flush()


def estimate_pids(pids: Sequence[int], *, limit: int | None = 20000, level: int = 3,
                  dictionaries: bool = True, seed: int = 0, progress: bool = True) -> Estimate:
    """The estimate for live processes: a sample of their resident anonymous pages."""
    addresses = 0
    for pid in pids:
        try:
            addresses += len(procmem.resident_anon_addresses(pid))
        except procmem.ProcMemError:
            pass
    bar = ProgressBar("reading memory") if progress else None
    pages = procmem.process_pages(pids, limit=limit, seed=seed, progress=bar)
    if not pages:
        raise procmem.ProcMemError(f"no resident anonymous pages readable in {list(pids)}")
    bar2 = ProgressBar("compressing   ") if progress else None
    est = estimate_pages(pages, level=level, dictionaries=dictionaries, seed=seed, progress=bar2)
    est.pids = list(pids)
    est.resident_pages = max(addresses, len(pages))
    return est


def register(subparsers) -> None:
    d = subparsers.add_parser("dict", help="list, train and inspect zstd dictionaries")
    dsub = d.add_subparsers(dest="dict_command", metavar="ACTION")
    dsub.required = True
    s = dsub.add_parser("list", help="the shipped dictionaries (manifest)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_list)
    s = dsub.add_parser("train", help="train a dictionary from live processes' memory")
    s.add_argument("--pid", type=int, action="append", required=True, metavar="PID",
                   help="process to sample (repeat for several)")
    s.add_argument("-o", "--output", required=True, metavar="FILE")
    s.add_argument("--size", type=int, default=32768, help="dictionary bytes (default 32768)")
    s.add_argument("--sample", type=int, default=20000, help="pages to read at most")
    s.add_argument("--name", default="host")
    s.set_defaults(func=cmd_train)
    s = dsub.add_parser("show", help="describe a dictionary file")
    s.add_argument("file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_show)

    e = subparsers.add_parser("estimate", help="predict the ratio on live processes (read-only)")
    target = e.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, action="append", metavar="PID")
    target.add_argument("--cgroup", metavar="PATH", help="cgroup directory (v1 or v2)")
    e.add_argument("--sample", type=int, default=20000, help="pages to read at most (default 20000)")
    e.add_argument("--level", type=int, default=3, help="zstd level for the dictionary rows")
    e.add_argument("--no-dictionaries", action="store_true")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)


def cmd_list(args) -> int:
    from .codec.dictionaries.files import dict_dir, load_manifest
    infos = load_manifest()
    if args.json:
        print(json.dumps([vars(i) for i in infos], indent=1))
        return 0
    print(f"{'NAME':10} {'SIZE':>6}  {'RUNTIME':28} HELD-OUT GAIN (zstd 3 + dict vs zstd 3)")
    for i in infos:
        gains = ", ".join(f"{k} {v:+.1%}" for k, v in i.gain.items()) or "-"
        print(f"{i.name:10} {i.size // 1024:4}Ki  {i.version[:28]:28} {gains}")
    print(f"(from {dict_dir()})")
    return 0


def _pages(pids, limit) -> list[bytes]:
    pages = procmem.process_pages(pids, limit=limit, progress=ProgressBar("reading memory"))
    unique, _, _ = classify(pages)
    return unique


def cmd_train(args) -> int:
    from .codec.codecs import ZstdCodec, ZstdDictCodec
    from .codec.dictionaries.files import write_file
    from .codec.dictionaries.trainer import sizes, train_content
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
    from .codec.dictionaries.files import read_file
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


def cmd_estimate(args) -> int:
    from .codec.estimate import format_estimate
    pids = args.pid or procmem.cgroup_pids(args.cgroup)
    if not pids:
        print(f"agentzip-blk: error: no processes in {args.cgroup}", file=sys.stderr)
        return 1
    est = estimate_pids(pids, limit=args.sample, level=args.level,
                        dictionaries=not args.no_dictionaries, progress=not args.json)
    if args.json:
        print(json.dumps(est.to_dict(), indent=1))
    else:
        print(format_estimate(est))
    return 0
