"""Small facts about the host: privileges, memory, swap areas, tools, processes.

Everything here reads /proc and /sys (paths overridable for tests) and never
changes the system. Failures of preconditions raise :class:`SetupError` with a
one-line message that says what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass

__all__ = [
    "SetupError",
    "SwapArea",
    "TOOL_PACKAGES",
    "is_root",
    "meminfo",
    "swaps",
    "swap_area",
    "zswap_enabled",
    "ZSWAP_DISABLE_HINT",
    "missing_tools",
    "which",
    "nbd_kernel_available",
    "process_rss",
    "process_cmdline",
    "pid_alive",
    "set_oom_score_adj",
    "require_root",
    "require_tools",
    "require_nbdkit_plugin",
]

# Directories searched for tools on top of $PATH: swap/loop tools live in
# /sbin and /usr/sbin, which a non-login root shell may not have on its PATH.
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")

# tool -> Debian packages that provide it (for "what to do" messages)
TOOL_PACKAGES: dict[str, str] = {
    "nbdkit": "nbdkit nbdkit-plugin-python",
    "nbdfuse": "libnbd-bin fuse3",
    "nbdinfo": "libnbd-bin",
    "fusermount3": "fuse3",
    "losetup": "mount",
    "mkswap": "util-linux",
    "swapon": "mount",
    "swapoff": "mount",
    "nbd-client": "nbd-client",
    "modprobe": "kmod",
}

ZSWAP_PARAM = "/sys/module/zswap/parameters/enabled"
ZSWAP_DISABLE_HINT = f"echo N > {ZSWAP_PARAM}"


class SetupError(RuntimeError):
    """A precondition is not met; the message is one line that says what to do."""


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


def is_root() -> bool:
    return os.geteuid() == 0


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


def _unescape_proc(s: str) -> str:
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
        filename = _unescape_proc(" ".join(parts[:-4]))
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


def zswap_enabled(path: str = ZSWAP_PARAM) -> bool:
    """True when zswap is built in and enabled (it would compress pages before our device)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip().upper() in ("Y", "1")
    except OSError:
        return False


def which(name: str) -> str | None:
    """shutil.which, also searching the sbin directories."""
    if os.sep in name:
        return name if os.access(name, os.X_OK) and os.path.isfile(name) else None
    found = shutil.which(name)
    if found:
        return found
    path = os.pathsep.join(_SBIN)
    return shutil.which(name, path=path)


def missing_tools(names) -> list[str]:
    """The names (or paths) in ``names`` that cannot be found/executed."""
    return [n for n in names if which(n) is None]


def nbd_kernel_available() -> bool:
    """True when the kernel nbd module is loaded (/dev/nbd0 exists)."""
    return os.path.exists("/dev/nbd0")


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


def process_state(pid: int | None) -> str | None:
    """The state letter of ``pid`` in /proc/PID/stat (R, S, D, T stopped, t traced, Z...),
    None when there is no such process."""
    if not pid or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # state is the field after the parenthesised comm (which may contain spaces)
    state = stat.rpartition(")")[2].split()[:1]
    return state[0] if state else None


def pid_alive(pid: int | None) -> bool:
    """True when ``pid`` runs and is not a zombie. Reaps it if it is our own dead child."""
    if not pid or pid <= 0:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    except OSError:
        pass
    return process_state(pid) not in (None, "Z", "X")


def set_oom_score_adj(pid: int, value: int = -1000) -> bool:
    """Best effort: protect ``pid`` from the OOM killer. Returns True on success."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w", encoding="ascii") as f:
            f.write(str(value))
        return True
    except OSError:
        return False


def require_root(what: str = "this command") -> None:
    if not is_root():
        raise SetupError(f"{what} needs root (swap, loop devices and FUSE mounts): run it with sudo")


def require_tools(names) -> None:
    """Raise SetupError naming the first missing tool and the Debian packages to install."""
    missing = missing_tools(names)
    if not missing:
        return
    pkgs: list[str] = []
    for name in missing:
        for p in TOOL_PACKAGES.get(os.path.basename(name), "").split():
            if p not in pkgs:
                pkgs.append(p)
    names_s = ", ".join(missing)
    if pkgs:
        raise SetupError(f"{names_s} not found: apt-get install {' '.join(pkgs)}")
    raise SetupError(f"{names_s} not found: install it or fix PATH")


def require_nbdkit_plugin(name: str = "python", nbdkit: str = "nbdkit") -> None:
    """Raise SetupError when nbdkit cannot load the named plugin (e.g. python)."""
    require_tools([nbdkit])
    try:
        r = subprocess.run([which(nbdkit) or nbdkit, "--dump-plugin", name],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SetupError(f"nbdkit --dump-plugin {name} failed ({e}): reinstall nbdkit") from None
    if r.returncode != 0:
        pkg = f"nbdkit-plugin-{name}" if name != "python" else "nbdkit-plugin-python"
        raise SetupError(f"nbdkit cannot load the {name} plugin: apt-get install {pkg}")
