"""Facts about the host and its preconditions: privileges, tools, zswap, the nbd driver.

Everything here reads /proc, /sys and PATH and never changes the system. Failures of
preconditions raise :class:`SetupError` with a one-line message that says what to do.
(/proc parsers shared with the server are in `agentzip_blk.procfs`.)
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ..errors import SetupError

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


def is_root() -> bool:
    return os.geteuid() == 0


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
