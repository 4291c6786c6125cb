"""What the tests that drive the installed CLI with a workload in swap share: a workload in
a memory cgroup below ours, squeezed until part of it is swapped out, and the teardown in the
safe order (the workload, its cgroup, then `down --force` of whatever is still up)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from agentzip_blk.cgroups.fs import MemoryCgroup

# A heap of distinct 1 MiB blocks (argv[1] of them), compressible text, or random bytes with
# argv[2] "random"; it prints READY and the heap's digest, then VERIFY re-reads all of it
# (every swapped page faults back through the device) and answers OK or BAD.
HEAP_WORKLOAD = r"""
import hashlib, os, sys
mb = int(sys.argv[1])
blocks = []
for i in range(mb):
    if sys.argv[2:] == ["random"]:
        blocks.append(bytearray(os.urandom(1 << 20)))
        continue
    line = b"%08d {'role': 'tool', 'content': 'agentzip fuse front door'} " % i
    blocks.append(bytearray((line * (1 + (1 << 20) // len(line)))[: 1 << 20]))
digest = hashlib.sha256(b"".join(blocks)).hexdigest()
print("READY", digest, flush=True)
for cmd in sys.stdin:
    if cmd.strip() == "VERIFY":
        print("OK" if hashlib.sha256(b"".join(blocks)).hexdigest() == digest else "BAD",
              flush=True)
"""


def squeezed_workload(name: str, script: str, args: list[str], limit: int, swapped: int,
                      timeout: float = 60.0) -> tuple[MemoryCgroup, subprocess.Popen]:
    """Start ``script`` (a Python program that prints READY once its heap is built) in a new
    cgroup ``name``, limit the cgroup to ``limit`` bytes and wait until ``swapped`` bytes of
    it are in swap. Returns the cgroup and the process (stdin and stdout are text pipes)."""
    cg = MemoryCgroup.create(name)
    proc = None
    try:
        cg.allow_swap()
        procs = cg.file("cgroup.procs")

        def join():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=join)
        ready = proc.stdout.readline().split()
        assert ready and ready[0] == "READY", ready
        cg.set_limit(limit)
        deadline = time.monotonic() + timeout
        while cg.swap_usage() < swapped and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cg.swap_usage() >= swapped, "the workload did not swap"
        return cg, proc
    except BaseException:
        stop_workload(proc, cg)
        raise


def stop_workload(proc: subprocess.Popen | None, cg: MemoryCgroup | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()
    if cg is not None:
        cg.remove()


def leave_nothing(run_dir: str) -> list[str]:
    """After the workloads are gone: `down --force` of a device still up in ``run_dir``,
    the run directory removed; returns the mounts left under it (a test asserts none)."""
    from agentzip_blk.host import attach, runstate

    if runstate.RunState.load(run_dir) is not None:
        attach.down(run_dir, force=True)
    with open("/proc/mounts") as f:
        left = [line for line in f if run_dir in line]
    shutil.rmtree(run_dir, ignore_errors=True)
    return left
