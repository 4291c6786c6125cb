"""Result JSON, and the command line a result records (the one that reruns it)."""

from __future__ import annotations

import json
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python() -> str:
    """This interpreter, relative to the repository when it is the repository's venv."""
    rel = os.path.relpath(sys.executable, REPO)
    return sys.executable if rel.startswith("..") else rel


def command_line(name: str, argv: list[str]) -> str:
    """``.venv/bin/python -m bench NAME ARGS...``: how to run bench NAME again."""
    return shlex.join([python(), "-m", "bench", name, *argv])


def write_json(path: str | os.PathLike, doc, *, default=None, newline: bool = False) -> None:
    """*doc* as JSON (indent 1) at *path*, its directory made if missing."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=default)
        if newline:
            f.write("\n")
