"""What the demo's parts share: its error, /proc readers, byte formatting, running a tool."""

from __future__ import annotations

import dataclasses
import os
import subprocess

from .. import procfs
from ..config.quantities import format_bytes
from ..host import facts

MiB = 1 << 20


class DemoError(RuntimeError):
    """A precondition or step of the demo failed; the message says what to do."""


# ---------------------------------------------------------------------------------------
# /proc readers


meminfo = procfs.meminfo
rss_of = procfs.process_rss
zswap_enabled = facts.zswap_enabled


def proc_swaps() -> list[dict]:
    """Active swap areas: filename, type, size and used in bytes, priority."""
    return [dataclasses.asdict(area) for area in procfs.swaps()]


def pcp_free_bytes() -> int:
    """Free pages parked on the per-CPU page lists (/proc/zoneinfo pagesets ``count:``).

    MemFree leaves them out, and since Linux 6.7 the lists auto-tune up to ~100 MiB per CPU:
    pages that reclaim frees land there first, so MemFree alone under-reports a gain.
    """
    n = 0
    try:
        with open("/proc/zoneinfo") as f:
            for line in f:
                s = line.split()
                if len(s) == 2 and s[0] == "count:":
                    n += int(s[1])
    except (OSError, ValueError):
        return 0
    return n * os.sysconf("SC_PAGE_SIZE")


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, _, v = line.partition(" ")
            try:
                out[k] = int(v)
            except ValueError:
                pass
    return out


def fmt(n: float | int | None) -> str:
    """Bytes like free -h (binary units)."""
    if n is None:
        return "-"
    return format_bytes(int(n)) if n >= 0 else "-" + format_bytes(int(-n))


def run_tool(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)
    except FileNotFoundError:
        raise DemoError(f"{cmd[0]} not found (apt-get install util-linux)") from None
    except subprocess.CalledProcessError as e:
        raise DemoError(f"{' '.join(cmd)} failed: {(e.stderr or e.stdout).strip()}") from None
