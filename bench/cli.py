"""The one entry point: ``python -m bench NAME [ARGS...]`` runs the bench NAME with ARGS, and
``python -m bench --help`` lists the benches with the first sentence of each one's docstring."""

from __future__ import annotations

import ast
import importlib
import os
import sys

# Every bench, by module name (bench/NAME.py, with a main()). Helpers of one bench
# (swap_report) and the harness are not benches.
BENCHES = ("churn", "codecs", "demo", "density", "dicts", "faultpath", "forms", "frame_layout", "frontdoor",
           "hash", "integrity", "latency", "load", "meta", "neighbour", "pins", "restart", "scrape", "stale",
           "store_contention", "swap", "swapfloor", "tuner", "warm_rows")

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = "python -m bench"
WIDTH = 95  # of a summary line


def summary(name: str) -> str:
    """The first sentence of bench NAME's docstring, read without importing it (a bench imports
    numpy, the native extension, sometimes the tests' helpers)."""
    with open(os.path.join(HERE, name + ".py"), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph, one line
    line = first.split(". ")[0].rstrip(".")  # its first sentence
    if len(line) > WIDTH:
        cut = line.rfind(": ", 0, WIDTH)
        line = line[:cut] if cut >= 40 else line[:line.rfind(" ", 0, WIDTH - 3)] + "..."
    return line


def usage() -> str:
    width = max(map(len, BENCHES))
    lines = [f"usage: {PROG} NAME [ARGS...]   ({PROG} NAME --help: the bench's options)", "",
             "Run from the repository's root. The benches:", ""]
    lines += [f"  {name:<{width}}  {summary(name)}" for name in BENCHES]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"{PROG}: no bench {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    # Each bench parses sys.argv itself (argparse): its usage line names the command to type.
    sys.argv = [f"{PROG} {name}", *rest]
    code = module.main()
    return code if isinstance(code, int) else 0
