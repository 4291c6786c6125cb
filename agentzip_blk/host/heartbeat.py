"""Heartbeat files: how a long-running loop (the node agent, the tuner) tells Kubernetes'
probes that it lives and is ready, without an HTTP port.

Each round the loop writes ``{"time": UNIX, "ready": BOOL, "detail": "..."}`` to its file
(atomically: a probe never reads half of it). The probe is this module, run by the kubelet as
an exec probe with nothing but the standard library imported (~30 ms, where the whole CLI
takes ~350 ms of CPU per probe)::

    python -m agentzip_blk.host.heartbeat FILE --max-age SECONDS [--ready]

Exit 0: written less than SECONDS ago (and, with --ready, ready). Exit 1 with one line on
stderr otherwise: no file yet, too old (the loop is stuck), or not ready and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Beat:
    time: float
    ready: bool
    detail: str = ""


def write(path: str, ready: bool, detail: str = "") -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"time": time.time(), "ready": bool(ready), "detail": detail}, f)
    os.replace(tmp, path)


def read(path: str) -> Beat | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return Beat(float(data["time"]), bool(data["ready"]), str(data.get("detail", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(path: str, max_age: float, need_ready: bool = False,
          now: float | None = None) -> tuple[bool, str]:
    """(ok, why): the probe's verdict on *path*."""
    beat = read(path)
    if beat is None:
        return False, f"{path}: no heartbeat yet (the loop has not finished a round)"
    age = (time.time() if now is None else now) - beat.time
    if age > max_age:
        return False, f"{path}: last round {age:.0f}s ago (more than {max_age:g}s): stuck"
    if need_ready and not beat.ready:
        return False, f"{path}: not ready: {beat.detail or 'no reason given'}"
    return True, f"{path}: round {age:.0f}s ago" + (f"; {beat.detail}" if beat.detail else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentzip_blk.host.heartbeat",
                                description="Kubernetes exec probe on a heartbeat file.")
    p.add_argument("file")
    p.add_argument("--max-age", type=float, default=120.0, metavar="SECONDS")
    p.add_argument("--ready", action="store_true", help="also require the loop to be ready")
    args = p.parse_args(argv)
    ok, why = check(args.file, args.max_age, args.ready)
    if not ok:
        print(f"agentzip-blk: probe: {why}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
