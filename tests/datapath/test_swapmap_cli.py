"""The slots the kernel freed, forgotten (device.swap_map), as an operator runs it: `up`,
`stats`, `down` each their own process, a workload in a memory cgroup of its own.

The workload fills one heap, is squeezed into swap, then drops every other 16 KiB of it
(MADV_DONTNEED), so that each swap cluster keeps pages of both kinds. The kernel frees
those slots but discards no cluster (each still holds pages of the other heap), so without
the swap map the store would keep every copy. With it the server forgets them: the store
then holds about what /proc/swaps says is used, and the other heap reads back exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agentzip_blk import procfs
from agentzip_blk.datapath import swapmap
from agentzip_blk.datapath.fuse import MAX_BACKGROUND
from agentzip_blk.host import facts
from cliswap import leave_nothing, squeezed_workload, stop_workload
from fusemem import kernel_max_background
from nbdkit_server import nbdkit_available

MiB = 1 << 20
PAGE = 4096

WORKLOAD = r"""
import hashlib, mmap, sys
mb = int(sys.argv[1])
CHUNK = 16384  # every other 16 KiB is dropped: each swap cluster holds both kinds
heap = mmap.mmap(-1, 2 * mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, len(heap), CHUNK):
    line = b"%08d {'role': 'tool', 'content': 'forget what the kernel freed'} " % i
    heap[i:i + CHUNK] = (line * (1 + CHUNK // len(line)))[:CHUNK]
def kept():
    return hashlib.sha256(b"".join(heap[i:i + CHUNK] for i in range(0, len(heap), 2 * CHUNK)))
digest = kept().hexdigest()
print("READY", flush=True)
for cmd in sys.stdin:
    cmd = cmd.strip()
    if cmd == "DROP":
        for i in range(CHUNK, len(heap), 2 * CHUNK):
            heap.madvise(mmap.MADV_DONTNEED, i, CHUNK)
        print("DROPPED", flush=True)
    elif cmd == "VERIFY":
        print("OK" if kept().hexdigest() == digest else "BAD", flush=True)
"""


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("agentzip-blk")
    return subprocess.run([str(exe), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def _stats(cfg) -> dict:
    r = _cli("--config", str(cfg), "stats", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _area_used_pages(device: str) -> int:
    for area in procfs.swaps():
        if os.path.realpath(area.filename) == os.path.realpath(device):
            return area.used // PAGE  # procfs gives bytes
    raise AssertionError(f"{device} is not in /proc/swaps")


@pytest.mark.swap
@pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available()))
@pytest.mark.skipif(not Path(sys.executable).with_name("agentzip-blk").exists(),
                    reason="agentzip-blk is not installed in this venv (./setup.sh)")
@pytest.mark.skipif(facts.nbd_kernel_available(), reason="kernel nbd host")
def test_the_server_forgets_what_the_kernel_freed_and_keeps_the_rest(tmp_path):
    from agentzip_blk.host import runstate

    if procfs.swaps():
        pytest.skip("another swap area is active; this test must own swap")
    run_dir = tempfile.mkdtemp(prefix="azsm-", dir="/tmp")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n"
                   f"device:\n  size: 1G\n  run_dir: {run_dir}\n  frontend: fuse\n")
    cg = proc = None
    try:
        r = _cli("--config", str(cfg), "up")
        assert r.returncode == 0, r.stderr
        device = runstate.RunState.load(run_dir).device
        # the chain `up` built lets the loop device's requests reach the server
        # (ARCHITECTURE.md "Reads before writes")
        assert kernel_max_background(os.path.join(run_dir, "mnt")) == MAX_BACKGROUND
        try:  # what this kernel allows, asked the way the server asks
            with swapmap.SwapMap.open(device):
                pass
        except swapmap.Unsupported as exc:
            status = _stats(cfg)["server"]["swap_map"]["status"]
            assert str(exc).split(":")[0] in status  # the server says why, in one line
            pytest.skip(f"the kernel's swap map cannot be read here: {exc}")

        cg, proc = squeezed_workload(f"azt-swapmap-{os.getpid()}", WORKLOAD, ["64"],
                                     limit=40 * MiB, swapped=80 * MiB)
        proc.stdin.write("DROP\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "DROPPED"
        # the maintainer reads the map each round (1 s): give it a few
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = _stats(cfg)
            used = _area_used_pages(device)
            if stats["kernel_freed_pages"] > 0 and stats["pages"] <= 1.15 * used + 512:
                break
            time.sleep(1)
        assert stats["server"]["swap_map"]["status"].startswith("reading"), stats["server"]
        assert stats["kernel_freed_pages"] > 4096  # most of the dropped heap's 16384 pages
        assert stats["pages"] <= 1.15 * used + 512, (stats["pages"], used)
        served = stats["server"]["datapath"]
        if served["path"] == "native" and served["native_writes_served"]:
            # the swap-out went through the write queue (reads before writes), and the
            # VERIFY below reads every page it stored
            assert served["native_writes_queued"] > 0, served
        proc.stdin.write("VERIFY\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "OK"  # what the kernel still needed is exact
        assert cg.oom_kills() == 0
        stop_workload(proc, cg)
        proc = cg = None
        r = _cli("--config", str(cfg), "down")
        assert r.returncode == 0, r.stderr
    finally:
        stop_workload(proc, cg)
        left = leave_nothing(run_dir)
    assert left == []
    assert [a for a in procfs.swaps() if "loop" in a.filename] == []
