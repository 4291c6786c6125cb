"""Read-only parsers of /proc that every layer uses: memory, swap areas, a process's status.

At the bottom of the package, beside `errors`: the server reads its own RSS and locked
memory and /proc/swaps (its signal guard) with these, and so do the host tools above it.
Paths are overridable for tests; nothing here changes the system.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass
class SwapArea:
    """One line of /proc/swaps; sizes in bytes."""

    filename: str
    type: str
    size: int
    used: int
    priority: int

    def to_dict(self) -> dict:
        return asdict(self)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as a dict; values in bytes (kB fields scaled, counts as-is)."""
    out: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if not parts:
                continue
            try:
                value = int(parts[0])
            except ValueError:
                continue
            if len(parts) > 1 and parts[1] == "kB":
                value *= 1024
            out[key.strip()] = value
    return out


def memory_stall_us(path: str = "/proc/pressure/memory") -> int | None:
    """The machine's cumulative memory stall time (PSI "some" total, microseconds): how long
    some task waited on memory since boot. None where the kernel has no PSI (psi=0)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("some "):
                    for field in line.split()[1:]:
                        name, _, value = field.partition("=")
                        if name == "total":
                            return int(value)
    except (OSError, ValueError):
        return None
    return None


def unescape(s: str) -> str:
    # /proc/swaps and mountinfo escape space, tab, newline and backslash as \ooo
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def swaps(path: str = "/proc/swaps") -> list[SwapArea]:
    """Active swap areas (sizes in bytes)."""
    areas: list[SwapArea] = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines()
    for line in lines[1:]:
        parts = line.split()
        if len(parts) < 5:
            continue
        try:
            size, used, prio = int(parts[-3]), int(parts[-2]), int(parts[-1])
        except ValueError:
            continue
        # the filename may contain (escaped) spaces: everything before the type
        filename = unescape(" ".join(parts[:-4]))
        areas.append(SwapArea(filename, parts[-4], size * 1024, used * 1024, prio))
    return areas


def swap_area(device: str | None, path: str = "/proc/swaps") -> SwapArea | None:
    """The active swap area for ``device`` (matched by path or by realpath), or None."""
    if not device:
        return None
    real = os.path.realpath(device)
    for area in swaps(path):
        if area.filename == device or os.path.realpath(area.filename) == real:
            return area
    return None


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = rest.strip()
    return out


def _status_bytes(pid: int, key: str) -> int:
    try:
        value = _proc_status(pid).get(key, "0 kB").split()
        return int(value[0]) * 1024
    except (OSError, IndexError, ValueError):
        return 0


def process_rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 when the process is gone)."""
    return _status_bytes(pid, "VmRSS")


def process_locked(pid: int) -> int:
    """Locked memory (VmLck) of ``pid`` in bytes (0 when the process is gone)."""
    return _status_bytes(pid, "VmLck")


def process_cmdline(pid: int) -> list[str]:
    """argv of ``pid`` ([] when gone or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="surrogateescape") for a in raw.split(b"\0") if a]


def pids() -> list[int]:
    """Every process id in /proc now."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def process_state(pid: int | None) -> str | None:
    """The state letter of ``pid`` in /proc/PID/stat (R, S, D, T stopped, t traced, Z...),
    None when there is no such process."""
    if not pid or pid <= 0:
        return None
    return _state(f"/proc/{pid}/stat")


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid``; [] when there is no such process. A
    killed process's leader is a zombie while its other threads still exit, and until the
    last one has, its descriptors (and their locks) stay open."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    states = [_state(f"/proc/{pid}/task/{tid}/stat") for tid in tids]
    return [s for s in states if s is not None]


def _state(stat_path: str) -> str | None:
    try:
        with open(stat_path, encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # state is the field after the parenthesised comm (which may contain spaces)
    state = stat.rpartition(")")[2].split()[:1]
    return state[0] if state else None


def loop_backing(dev: str | None) -> str | None:
    """Backing file of a loop device (/sys/block/loopN/loop/backing_file), or None when the
    loop device is not set up."""
    name = os.path.basename(dev) if dev else None
    if not name:
        return None
    try:
        with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8",
                  errors="surrogateescape") as f:
            return f.read().strip()
    except OSError:
        return None
