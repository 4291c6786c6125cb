"""The C floor: bench/harness/fusefloor.c, an in-memory file served by libfuse 3 in C, the
least any userspace FUSE chain costs on this machine (frontdoor, latency)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = 64 << 20  # the file the benches serve


def build_floor(out_dir: str) -> str:
    """Compile fusefloor.c with cc against libfuse3 (libfuse3-dev)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_frontdoor: no C compiler for the C floor (apt-get install gcc)")
    try:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"],
                               capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # no pkg-config: Debian's paths
        flags = ["-I/usr/include/fuse3", "-lfuse3", "-lpthread"]
    exe = os.path.join(out_dir, "fusefloor")
    subprocess.run([cc, "-O2", "-o", exe, os.path.join(HERE, "fusefloor.c"), *flags],
                   check=True)
    return exe


def wait_for_file(path: str, proc: subprocess.Popen, timeout: float = 20.0, size: int = SIZE) -> None:
    """Until the server *proc* shows its file at *path*, *size* bytes long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            if os.stat(path).st_size == size:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear")


def stop_floor(mnt: str, proc: subprocess.Popen) -> None:
    """Unmount the floor's file system and reap its server (our child); a server that does
    not exit in 10 s is killed and its mount detached lazily."""
    subprocess.run(["umount", mnt], check=False, capture_output=True)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)
