"""Progress on stderr: the swapoff watch `down` uses (a fake /proc/swaps reader), the tqdm
page bars, and the real `up` / `down --progress` path with pages in swap."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from agentzip_blk import procfs
from agentzip_blk.cli import progress
from agentzip_blk.host import facts
from agentzip_blk.host.runstate import RunState

from .clirun import run


class FakeSwaps:
    """/proc/swaps as a sequence of Used values for one device (None: the area is gone)."""

    def __init__(self, used: list[int | None]):
        self.used = list(used)
        self.reads = 0

    def __call__(self, device: str):
        assert device == "/dev/loop9"
        value = self.used[min(self.reads, len(self.used) - 1)]
        self.reads += 1
        if value is None:
            return None
        return procfs.SwapArea(device, "partition", 64 << 20, value, 5)


def test_swapoff_watch_reports_pages_coming_back():
    reports = []
    watch = progress.SwapoffWatch("/dev/loop9", lambda d, t: reports.append((d, t)),
                                  read=FakeSwaps([100, 100, 60, 20, None]))
    assert [watch.poll_once() for _ in range(5)] == [True, True, True, True, False]
    # done = used at the start - used now; unchanged figures are not repeated; gone = all back
    assert reports == [(0, 100), (40, 100), (80, 100), (100, 100)]


def test_swapoff_watch_thread_ends_when_the_area_goes():
    reports = []
    fake = FakeSwaps([4096, 2048, 1024, 0, None])
    with progress.SwapoffWatch("/dev/loop9", lambda d, t: reports.append((d, t)), read=fake,
                               interval=0.001) as watch:
        deadline = time.monotonic() + 10
        while fake.reads < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert watch._thread is not None
    assert not watch._thread.is_alive()
    assert reports[0] == (0, 4096) and reports[-1] == (4096, 4096)
    assert [d for d, _ in reports] == sorted(d for d, _ in reports)


def test_swapoff_watch_refused_swapoff_ends_partial():
    reports = []
    watch = progress.SwapoffWatch("/dev/loop9", lambda d, t: reports.append((d, t)),
                                  read=FakeSwaps([100, 100]))
    watch.start()
    watch.stop()  # e.g. swapoff refused: the area stays, the last figure is reported once
    assert reports == [(0, 100)]


def test_bars_only_on_a_terminal_unless_forced():
    out = io.StringIO()
    bar = progress.pages("reading memory", stream=out)
    for done in range(0, 11):
        bar(done, 10)
    assert out.getvalue() == ""  # not a terminal: no bar
    progress.force(True)
    try:
        bar = progress.pages("reading memory", stream=out)
        for done in range(0, 11):
            bar(done, 10)
        swap = progress.swapoff_bar("/dev/loop9", stream=out)
        swap(0, 8 << 20)
        swap(8 << 20, 8 << 20)
    finally:
        progress.force(False)
    text = out.getvalue()
    assert "reading memory" in text and "10/10" in text and "100%" in text
    assert "swapoff /dev/loop9" in text and "8.00M/8.00M" in text


# --- the real path -------------------------------------------------------------------------------

TOOLS = ["nbdkit", "fusermount3", "losetup", "mkswap", "swapon", "swapoff"]


def _skip_reason() -> str | None:
    if not facts.is_root():
        return "needs root"
    if facts.missing_tools(TOOLS):
        return f"missing tools: {facts.missing_tools(TOOLS)}"
    if not os.path.exists("/dev/fuse") or not os.path.exists("/dev/loop-control"):
        return "no /dev/fuse or /dev/loop-control"
    if facts.zswap_enabled():
        return "zswap is enabled (up refuses it)"
    return None


HOG = """\
import hashlib, os, sys
sys.stdin.readline()
b = bytearray(48 << 20)
for i in range(0, len(b), 4096):
    b[i:i + 16] = os.urandom(16)  # distinct pages, not same-filled
print("READY", hashlib.sha256(b).hexdigest(), flush=True)
sys.stdin.readline()
print(hashlib.sha256(b).hexdigest(), flush=True)
"""


@pytest.mark.swap
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_up_then_down_shows_swapoff_progress():
    from agentzip_blk.cgroups.fs import MemoryCgroup

    run_dir = tempfile.mkdtemp(prefix="azc-", dir="/tmp")
    config = os.path.join(run_dir, "config.yaml")
    with open(config, "w") as f:
        f.write(f"pool:\n  swap_out_path: {run_dir}/disk-tier\n")
    cg = hog = None
    try:
        res = run("up", "--config", config, "--run-dir", run_dir, "--size", "128M",
                  "--priority", "32767", timeout=120)
        assert res.returncode == 0, res.stderr
        device = RunState.load(run_dir).device
        # again, same settings: the state asked for is there
        res = run("up", "--config", config, "--run-dir", run_dir, "--size", "128M",
                  "--priority", "32767")
        assert res.returncode == 0 and "already up" in res.stdout, res.stderr
        res = run("up", "--config", config, "--run-dir", run_dir, "--size", "256M")
        assert res.returncode == 2 and "other settings (size, priority)" in res.stderr

        cg = MemoryCgroup.create(f"azc-down-{os.getpid()}")
        cg.allow_swap()
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        cg.add_pid(hog.pid)
        cg.set_limit(16 << 20)
        hog.stdin.write("go\n")
        hog.stdin.flush()
        ready, digest = hog.stdout.readline().split()
        assert ready == "READY"
        used = procfs.swap_area(device).used
        assert used > 8 << 20  # the hog's pages went to our device
        cg.set_limit(None)  # swapoff must be able to bring them back into the cgroup

        res = run("down", "--run-dir", run_dir, "--progress", timeout=300)
        assert res.returncode == 0, res.stderr
        assert "detached" in res.stdout
        lines = res.stderr.replace("\r", "\n").splitlines()
        bars = [line for line in lines if line.startswith(f"swapoff {device}")]
        assert bars and "100%" in bars[-1], res.stderr
        assert procfs.swap_area(device) is None
        hog.stdin.write("done\n")
        hog.stdin.flush()
        assert hog.stdout.readline().strip() == digest  # every page came back, byte for byte
        assert hog.wait(timeout=30) == 0
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        if cg is not None:
            cg.remove()
        if RunState.load(run_dir) is not None:
            run("down", "--run-dir", run_dir, "--force", timeout=300)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_swapoff_log_says_pages_left_and_rate_at_least_every_interval_even_when_stalled():
    """`down` under ExecStop: a line every 10 s of the fake clock whatever moved, with the
    pages left and the rate since the previous line; one at the start and one at the end."""
    import io

    from agentzip_blk.cli.progress import SwapoffLog, SwapoffWatch
    from agentzip_blk.procfs import SwapArea

    clock = [0.0]
    used = [4096 * 1000]
    out = io.StringIO()
    log = SwapoffLog("/dev/loop7", every=10.0, stream=out, clock=lambda: clock[0])

    def read(dev):
        return None if used[0] is None else SwapArea(dev, "partition", 1 << 30, used[0], 100)

    watch = SwapoffWatch("/dev/loop7", log, read=read, every_poll=True)
    watch.poll_once()                       # t=0: the start line
    for t in range(1, 31):                  # 30 s: 40 pages/s for 20 s, then a 10 s stall
        clock[0] = float(t)
        if t <= 20:
            used[0] -= 4096 * 40
        watch.poll_once()
    used[0] = None                          # the area is gone: the end line
    clock[0] = 31.0
    watch.poll_once()
    lines = [line.removeprefix("agentzip-blk: swapoff /dev/loop7: ")
             for line in out.getvalue().splitlines()]
    assert lines == [
        "1000 pages left (3.9M) to bring back into RAM",
        "600 pages left (2.3M), 40 pages/s (160K/s), ~15s to go",
        "200 pages left (800K), 40 pages/s (160K/s), ~5s to go",
        "200 pages left (800K), 0 pages/s (0B/s), stalled",  # nothing moved: still a line
        "done: 1000 pages back in 31.0s",
    ]
