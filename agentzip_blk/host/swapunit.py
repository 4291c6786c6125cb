"""The shutdown order of systemd's swap unit for our device (docs/ARCHITECTURE.md; the unit
file's comment).

systemd makes a swap unit (``dev-loop0.swap``, ``dev-nbd0.swap``) of every area in /proc/swaps.
At shutdown it stops it through ``Conflicts=umount.target`` with no order against
agentzip-blk.service, so its swapoff could run before the sandboxes stopped or race `down`'s.
``up`` settles it with a runtime drop-in, written before swapon (a unit systemd first loads
from /proc/swaps reads it then) and made known with a daemon-reload (a unit it already knew
from an earlier swapon of the same device):

    /run/systemd/system/dev-loop0.swap.d/50-agentzip.conf
    [Unit]
    Before=agentzip-blk.service

Stop order is the start order reversed, so agentzip-blk.service (ExecStop: `down`, which
swaps off with its progress in the journal) stops first and the swap unit after it finds the
area gone; the sandbox slices are After= agentzip-blk.service, so they stop before both.
Runtime only (/run): the loop device's number is known only at `up`, and a reboot forgets it
with the device. `down` removes it. Nothing is written where systemd is not PID 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

RUNTIME_UNIT_DIR = "/run/systemd/system"  # systemd's runtime units; exists iff it is PID 1
SERVICE = "agentzip-blk.service"
DROPIN = "50-agentzip.conf"


def systemd_running() -> bool:
    """sd_booted(3): systemd is PID 1 when /run/systemd/system is a directory."""
    return os.path.isdir(RUNTIME_UNIT_DIR)


def unit_name(device: str) -> str:
    """systemd's swap unit for a /dev path (systemd-escape --path --suffix=swap)."""
    path = device.strip("/")
    out = []
    for i, ch in enumerate(path):
        if ch == "/":
            out.append("-")
        elif ch.isalnum() or ch in ":_" or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out) + ".swap"


def dropin_text(device: str) -> str:
    return (f"# written by `agentzip-blk up` for {device}; removed by `agentzip-blk down`\n"
            f"# (agentzip_blk/host/swapunit.py): {SERVICE} stops first at shutdown\n"
            f"[Unit]\nBefore={SERVICE}\n")


def dropin_path(device: str, unit_dir: str = RUNTIME_UNIT_DIR) -> str:
    return os.path.join(unit_dir, unit_name(device) + ".d", DROPIN)


def write_order(device: str, unit_dir: str | None = None) -> str | None:
    """Write the drop-in (unit_dir: tests; default only where systemd runs). Returns its
    path, or None when there is no systemd to tell."""
    if unit_dir is None:
        if not systemd_running():
            return None
        unit_dir = RUNTIME_UNIT_DIR
    path = dropin_path(device, unit_dir)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(dropin_text(device))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # systemd never reads half of it
    return path


def reload() -> None:
    """daemon-reload, best effort (a swap unit loaded before the drop-in existed)."""
    exe = shutil.which("systemctl")
    if exe and systemd_running():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([exe, "daemon-reload"], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


def remove_order(device: str | None, unit_dir: str | None = None) -> None:
    """Remove what write_order wrote (no reload: the order is harmless until then)."""
    if not device:
        return
    path = dropin_path(device, unit_dir or RUNTIME_UNIT_DIR)
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))
