"""BENCHMARKS.md is written by several benches; each owns the block between its two markers
(`<!-- NAME:begin -->` ... `<!-- NAME:end -->`) and rewrites only that."""

from __future__ import annotations

import os

HEADER = "# Benchmarks\n\nGenerated sections are rewritten by the tools named in them.\n"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(path: str | os.PathLike, block: str, begin: str, end: str) -> None:
    """Put `block` (which starts with `begin` and ends with `end`) where the old block was,
    or append it; the file is replaced atomically."""
    path = os.fspath(path)
    block = block.rstrip("\n") + "\n"
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = HEADER
    if begin in text and end in text and text.index(begin) < text.index(end):
        a = text.index(begin)
        b = text.index(end) + len(end)
        if text[b : b + 1] == "\n":
            b += 1
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_section(path: str | os.PathLike, name: str, body: str) -> None:
    """Write `body` (no markers) as the section called `name`."""
    begin, end = markers(name)
    replace_block(path, f"{begin}\n{body.strip(chr(10))}\n{end}", begin, end)
