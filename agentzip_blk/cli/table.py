"""Tables the way util-linux prints them (zramctl, lsblk, swapon --show): one helper for every
command that prints rows.

A command declares its `Column`s once; `Table.add_arguments` gives it the usual options:

    -o, --output COL,COL   the columns, in that order (``+COL,...`` appends to the defaults)
    --output-all           every column
    --raw                  no alignment: one space between cells, spaces in a cell as \\x20
    -n, --noheadings       no header line
    -b, --bytes            sizes as exact byte counts, not 1.5G
    --json                 the command's JSON document (docs/JSON.md: not cut by --output)

Numbers are right-aligned and text left-aligned, like zramctl. A missing value prints "-" so
that a --raw line always splits into as many fields as there are columns.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.quantities import format_bytes
from ._common import CliError

# kinds of cell: how a value prints, and which side it is aligned to
TEXT, BYTES, INT, RATIO = "text", "bytes", "int", "ratio"
_NUMERIC = (BYTES, INT, RATIO)


@dataclass(frozen=True)
class Column:
    name: str                      # the header, and the name -o takes (case-insensitive)
    help: str                      # one line for `--help`
    get: Callable[[Any], Any]      # the row -> the cell's value (None: "-")
    kind: str = TEXT
    default: bool = True           # shown without -o


def key(name: str) -> Callable[[dict], Any]:
    """A getter for a dict row's key (the usual case)."""
    return lambda row: row.get(name)


def cell(value: Any, kind: str, exact_bytes: bool = False) -> str:
    if value is None:
        return "-"
    if kind == BYTES:
        return str(int(value)) if exact_bytes else format_bytes(int(value))
    if kind == RATIO:
        try:
            return f"{float(value):.2f}"
        except (TypeError, ValueError):
            return str(value)
    if kind == INT:
        return str(int(value))
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = str(value)
    return text if text else "-"


def _raw(text: str) -> str:
    # libsmartcols' raw mode: a cell never contains the separator
    return text.replace("\\", "\\x5c").replace(" ", "\\x20").replace("\t", "\\x09") \
        .replace("\n", "\\x0a")


@dataclass(frozen=True)
class Table:
    columns: Sequence[Column]

    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def defaults(self) -> list[Column]:
        return [c for c in self.columns if c.default]

    def columns_help(self) -> str:
        """The "available columns" list for a command's epilog."""
        width = max(len(c.name) for c in self.columns)
        lines = ["available columns (-o; * = default):"]
        lines += [f"  {c.name:<{width}} {'*' if c.default else ' '} {c.help}" for c in self.columns]
        return "\n".join(lines)

    def add_arguments(self, parser: argparse.ArgumentParser, json_help: str) -> None:
        default = ",".join(c.name for c in self.defaults())
        parser.add_argument("-o", "--output", metavar="COL,COL",
                            help=f"columns to print, in this order; +COL,... adds to the "
                                 f"default ({default}); see the list below")
        parser.add_argument("--output-all", action="store_true", help="print every column")
        parser.add_argument("--raw", action="store_true",
                            help="raw format: cells separated by one space, no alignment")
        parser.add_argument("-n", "--noheadings", action="store_true",
                            help="do not print the header line")
        parser.add_argument("-b", "--bytes", action="store_true",
                            help="print sizes in bytes instead of a human-readable format")
        parser.add_argument("--json", action="store_true", help=json_help)

    def select(self, output: str | None, output_all: bool = False) -> list[Column]:
        """The columns -o / --output-all ask for; an unknown name is a CliError (exit 2)."""
        if output_all:
            return list(self.columns)
        if not output:
            return self.defaults()
        by_name = {c.name.lower(): c for c in self.columns}
        chosen = self.defaults() if output.startswith("+") else []
        for name in output.lstrip("+").split(","):
            name = name.strip()
            if not name:
                continue
            col = by_name.get(name.lower())
            if col is None:
                raise CliError(f"-o/--output: unknown column {name!r} "
                               f"(available: {','.join(self.names())})")
            chosen.append(col)
        if not chosen:
            raise CliError("-o/--output: no column given")
        return chosen

    def render(self, rows: Iterable[Any], columns: Sequence[Column], *, raw: bool = False,
               headings: bool = True, exact_bytes: bool = False) -> str:
        cells = [[cell(c.get(r), c.kind, exact_bytes) for c in columns] for r in rows]
        lines: list[list[str]] = ([[c.name for c in columns]] if headings else []) + cells
        if raw:
            return "\n".join(" ".join(_raw(v) for v in line) for line in lines)
        widths = [max(len(line[i]) for line in lines) if lines else 0
                  for i in range(len(columns))]
        out = []
        for line in lines:
            parts = [v.rjust(w) if c.kind in _NUMERIC else v.ljust(w)
                     for v, w, c in zip(line, widths, columns)]
            out.append(" ".join(parts).rstrip())
        return "\n".join(out)

    def print_args(self, rows: Iterable[Any], args: argparse.Namespace,
                   headings: bool | None = None) -> str:
        """`render` with the options of a command line (as added by add_arguments)."""
        columns = self.select(args.output, args.output_all)
        return self.render(rows, columns, raw=args.raw,
                           headings=not args.noheadings if headings is None else headings,
                           exact_bytes=args.bytes)


def plain(args: argparse.Namespace) -> bool:
    """Whether the table is printed for people: notes may follow it. --raw and -n print the
    table alone, for scripts."""
    return not (args.raw or args.noheadings)
