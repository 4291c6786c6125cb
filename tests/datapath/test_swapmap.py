"""agentzip_blk.datapath.swapmap against the real kernel: a swap area of our own (a loop
device with direct I/O over a file in the test's tmp dir, non-rotational, the top swap
priority), a memory cgroup below ours with a small limit, and a Python process squeezed in
it. The map must agree with what the kernel says elsewhere (/proc/swaps, the cgroup's
memsw - usage, the process's VmSwap), follow read faults, MADV_DONTNEED and exit, and stop
answering once the area is swapped off, also when its swap_info slot is reused at once.

The swap tests are marked `swap`, so tests/conftest.py holds /tmp/agentzip-swap.lock. They
are skipped only where the kernel refuses the BPF the module needs (Unsupported says why)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from agentzip_blk import procfs
from agentzip_blk.cgroups.fs import MemoryCgroup
from agentzip_blk.datapath import swapmap
from agentzip_blk.datapath.swapmap import (
    COUNT_CONTINUED,
    COUNT_MASK,
    FREE,
    HAS_CACHE,
    SWAP_MAP_BAD,
    SWAP_MAP_SHMEM,
    SwapMap,
    Unsupported,
    classify,
)

PAGE = 4096
MiB = 1 << 20
TOOLS = ("losetup", "mkswap", "swapon", "swapoff")
# What "the kernel refuses the BPF we need" looks like; anything else is a failure.
REFUSED = re.compile(r"EPERM|EACCES|no BTF|not wired for|BPF_PROG_LOAD: EINVAL")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (swapon, loop devices, BPF)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    return None


def swap_test(fn):
    """Attaches swap: the swap lock (tests/conftest.py takes it for `swap`), root, tools."""
    skip = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
    return pytest.mark.swap(skip(fn))


# -- a swap area of our own ------------------------------------------------------------------

def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def mark_bad(device: str, pages: list[int]) -> None:
    """List `pages` as bad in the swap header mkswap wrote (union swap_header, info:
    nr_badpages at 1032, badpages[] at 1536); swapon sets their swap_map bytes to
    SWAP_MAP_BAD."""
    fd = os.open(device, os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<I", len(pages)), 1032)
        os.pwrite(fd, struct.pack(f"<{len(pages)}I", *pages), 1536)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def swap_area(directory: Path, size: int, name: str = "swap.img", swapon: bool = True,
              bad: list[int] = ()) -> Iterator[str]:
    """/dev/loopN over a sparse file in `directory`, direct I/O, non-rotational, mkswap'ed
    (with `bad` pages) and (if `swapon`) swapped on at the top priority. Undone in order:
    swapoff, losetup -d, remove the file; only this loop device, by path and backing file."""
    img = directory / name
    with open(img, "wb") as f:
        f.truncate(size)
    loop = None
    try:
        loop = _run("losetup", "--direct-io=on", "--find", "--show", str(img))
        sysfs = Path("/sys/block") / os.path.basename(loop)
        assert (sysfs / "loop" / "dio").read_text().strip() == "1", f"direct I/O off on {loop}"
        (sysfs / "queue" / "rotational").write_text("0")
        _run("mkswap", loop)
        if bad:
            mark_bad(loop, list(bad))
        if swapon:
            _run("swapon", "--priority", "32767", loop)
        yield loop
    finally:
        if loop and procfs.swap_area(loop) is not None and procfs.loop_backing(loop) == str(img):
            subprocess.run(["swapoff", loop], check=False)
        if loop and procfs.loop_backing(loop) == str(img):
            subprocess.run(["losetup", "-d", loop], check=False)
        img.unlink(missing_ok=True)


def open_or_skip(device: str) -> SwapMap:
    """SwapMap.open, skipping the test only when the kernel refuses the BPF it needs."""
    try:
        return SwapMap.open(device)
    except Unsupported as e:
        if REFUSED.search(str(e)):
            pytest.skip(f"BPF refused here: {e}")
        raise


# -- a squeezed process --------------------------------------------------------------------

WORKER = r"""
import mmap, os, sys
PAGE = 4096
buf = None
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "alloc":  # random bytes, so that nothing (zswap, same-fill) shortcuts swap
        buf = mmap.mmap(-1, int(arg[0]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for off in range(0, len(buf), 1 << 20):
            buf[off:off + (1 << 20)] = os.urandom(1 << 20)
    elif cmd == "read":  # read faults only: one byte of every page
        lo, hi = int(arg[0]), int(arg[1])
        sum(buf[off] for off in range(lo, hi, PAGE))
    elif cmd == "dontneed":
        lo, hi = int(arg[0]), int(arg[1])
        buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    print("ok", flush=True)
"""


@dataclass
class Worker:
    proc: subprocess.Popen
    cgroup: MemoryCgroup

    def do(self, *cmd: object) -> None:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        assert reply == "ok", f"worker: {cmd} -> {reply!r} (exit {self.proc.poll()})"

    def vm_swap_pages(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmSwap:"):
                    return int(line.split()[1]) * 1024 // PAGE
        return 0

    def exit(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@contextlib.contextmanager
def squeezed_worker(limit: int) -> Iterator[Worker]:
    """A Python worker in a fresh memory cgroup below ours (v1 memory controller), memory
    limited to `limit`, swap unlimited. Torn down first: kill it (by PID), remove the cgroup."""
    cg = MemoryCgroup.create(f"swapmap-test-{os.getpid()}")
    proc = None
    try:
        if cg.version != 1:
            pytest.skip("the cgroup comparisons are written for cgroup v1 (memsw)")
        cg.allow_swap()
        cg.set_swappiness(100)
        cg.set_limit(limit)
        proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        cg.add_pid(proc.pid)
        yield Worker(proc, cg)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        cg.remove()


def swapped_pages(device: str) -> int:
    """/proc/swaps' Used for `device`, in pages (slots with any use, swap cache included)."""
    area = procfs.swap_area(device)
    assert area is not None
    return area.used // PAGE


def cgroup_swap_pages(cg: MemoryCgroup) -> int:
    """memory.memsw.usage - memory.usage: the cgroup's pages that are only in swap."""
    return (int(cg.read("memory.memsw.usage_in_bytes")) - int(cg.read("memory.usage_in_bytes"))) \
        // PAGE


def used(m: np.ndarray) -> int:
    c = classify(m)
    return c["referenced"] + c["cache_only"]


def only_in_swap(m: np.ndarray) -> int:
    """Referenced slots without the cache bit: pages that are in swap and not in RAM."""
    return int((((m & HAS_CACHE) == 0) & (m != FREE) & (m != SWAP_MAP_BAD)).sum())


def near(a: int, b: int, slack: int) -> bool:
    return abs(a - b) <= slack


def settle(sm: SwapMap, device: str, tries: int = 50) -> np.ndarray:
    """A map read while /proc/swaps' Used holds still (reads on both sides agree), so that
    the two can be compared slot for slot. No time limit is asserted: it only waits."""
    for _ in range(tries):
        before = swapped_pages(device)
        m = sm.read()
        if swapped_pages(device) == before:
            return m
        time.sleep(0.1)
    return sm.read()


# -- tests --------------------------------------------------------------------------------------

def test_classify_counts_each_kind_of_slot():
    m = np.array([SWAP_MAP_BAD, FREE, FREE, 1, HAS_CACHE, HAS_CACHE | 1, HAS_CACHE | 3,
                  COUNT_CONTINUED | 5, SWAP_MAP_SHMEM, HAS_CACHE, SWAP_MAP_BAD, FREE],
                 dtype=np.uint8)
    assert classify(m) == {"free": 3, "cache_only": 2, "referenced": 5, "bad": 2}
    assert classify(np.zeros(0, dtype=np.uint8)) == \
        {"free": 0, "cache_only": 0, "referenced": 0, "bad": 0}


def test_constants_are_the_kernels():
    # include/linux/swap.h: SWAP_HAS_CACHE 0x40, COUNT_CONTINUED 0x80, SWAP_MAP_MAX 0x3e,
    # SWAP_MAP_BAD 0x3f, SWAP_MAP_SHMEM 0xbf; a count is what the flags leave
    assert (FREE, HAS_CACHE, COUNT_MASK, COUNT_CONTINUED) == (0, 0x40, 0x3F, 0x80)
    assert (swapmap.SWAP_MAP_MAX, SWAP_MAP_BAD, SWAP_MAP_SHMEM) == (0x3E, 0x3F, 0xBF)
    assert (SWAP_MAP_SHMEM & COUNT_MASK) == SWAP_MAP_BAD and SWAP_MAP_SHMEM != SWAP_MAP_BAD


@swap_test
def test_a_fresh_area_is_free_but_its_header(tmp_path):
    with swap_area(tmp_path, 64 * MiB) as loop, open_or_skip(loop) as sm:
        st = os.stat(loop)
        area = procfs.swap_area(loop)
        assert sm.area.device == loop
        assert sm.area.dev == f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        assert sm.area.pages * PAGE == area.size
        assert sm.area.slots == 64 * MiB // PAGE  # mkswap uses the whole device
        m = sm.read()
        assert m.dtype == np.uint8 and len(m) == sm.area.slots
        assert m[0] == SWAP_MAP_BAD
        assert classify(m) == {"free": sm.area.slots - 1, "cache_only": 0, "referenced": 0,
                               "bad": 1}
        assert m is not sm.read()  # a fresh copy each time


@swap_test
def test_every_chunk_lands_at_its_offset(tmp_path, monkeypatch):
    """Bad pages listed in the header are SWAP_MAP_BAD in the kernel's map: read them back
    exactly, across program runs of one page of map each (the chunking of large areas)."""
    monkeypatch.setattr(swapmap, "CHUNK", PAGE)  # 16384 slots: 4 runs of 4096
    slots = 64 * MiB // PAGE
    bad = [1, 4095, 4096, 4097, 8191, 8192, 10000, 12287, 12288, slots - 2, slots - 1]
    with swap_area(tmp_path, 64 * MiB, bad=bad) as loop, open_or_skip(loop) as sm:
        assert sm.area.slots == slots
        assert sm.area.pages == slots - 1 - len(bad)
        assert procfs.swap_area(loop).size == sm.area.pages * PAGE
        m = sm.read()
        assert np.flatnonzero(m).tolist() == [0] + bad
        assert set(m[[0] + bad].tolist()) == {SWAP_MAP_BAD}
        assert classify(m) == {"free": slots - 1 - len(bad), "cache_only": 0,
                               "referenced": 0, "bad": 1 + len(bad)}


@swap_test
def test_the_map_follows_swap_out_read_faults_dontneed_exit_and_swapoff(tmp_path):
    total = 96 * MiB
    with swap_area(tmp_path, 256 * MiB) as loop:
        sm = open_or_skip(loop)
        try:
            with squeezed_worker(limit=32 * MiB) as w:
                # 1. squeezed: most of it goes to swap, and the map says so
                w.do("alloc", total)
                m = settle(sm, loop)
                c = classify(m)
                out = used(m)
                print("after squeeze", c, "/proc/swaps", swapped_pages(loop), "only in swap",
                      only_in_swap(m), "cgroup", cgroup_swap_pages(w.cgroup), "VmSwap",
                      w.vm_swap_pages())
                assert out > (total - 40 * MiB) // PAGE, c  # at least the part over the limit
                assert near(out, swapped_pages(loop), 64 + out // 100)
                # the cgroup's swap charge: slots whose page is in swap only (a page read
                # back into the swap cache is charged as memory, its slot no longer is)
                assert near(only_in_swap(m), cgroup_swap_pages(w.cgroup), 64 + out // 50)
                assert near(c["referenced"], w.vm_swap_pages(), 64 + out // 50)
                assert m[0] == SWAP_MAP_BAD and c["bad"] == 1

                # 2. room again, then read faults on the first half: those pages come back
                # to RAM and stay in the swap cache, their slots now cache-only
                w.cgroup.set_limit(1 << 30)
                referenced_before = c["referenced"]
                w.do("read", 0, total // 2)
                m = settle(sm, loop)
                c2 = classify(m)
                print("after read faults", c2, "/proc/swaps", swapped_pages(loop))
                swapped_in_half = min(referenced_before, total // 2 // PAGE)
                assert c2["cache_only"] > swapped_in_half // 2, c2
                assert c2["referenced"] < referenced_before - swapped_in_half // 2, c2
                assert near(used(m), swapped_pages(loop), 64 + used(m) // 100)

                # 3. MADV_DONTNEED of the second half: its slots are freed (what stays
                # referenced is the worker's interpreter, swapped out too: VmSwap)
                second, vm2 = m.copy(), w.vm_swap_pages()
                w.do("dontneed", total // 2, total)
                m = settle(sm, loop)
                c3, vm3 = classify(m), w.vm_swap_pages()
                print("after dontneed", c3, "/proc/swaps", swapped_pages(loop), "VmSwap", vm3)
                dropped = vm2 - vm3
                assert dropped > 1000  # the second half had pages in swap
                assert near(c2["referenced"] - c3["referenced"], dropped, 64 + dropped // 50)
                assert near(c3["referenced"], vm3, 64 + vm3 // 50), c3
                freed = (second != FREE) & (m == FREE)
                assert freed.sum() >= dropped * 9 // 10
                assert near(used(m), swapped_pages(loop), 64 + used(m) // 100)

                # 4. exit: nothing references the area any more
                w.exit()
                m = settle(sm, loop)
                c4 = classify(m)
                print("after exit", c4, "/proc/swaps", swapped_pages(loop))
                assert c4["referenced"] <= 64, c4
                assert near(used(m), swapped_pages(loop), 64)

            # 5. swapoff: the struct no longer describes a swap area; read says so
            _run("swapoff", loop)
            with pytest.raises(Unsupported, match="no longer swap"):
                sm.read()
            with pytest.raises(Unsupported, match="no longer swap"):
                sm.read()  # and keeps saying so
        finally:
            sm.close()
    with pytest.raises(ValueError):
        sm.read()


@swap_test
def test_a_reused_swap_info_slot_never_reads_as_the_old_area(tmp_path):
    """swapoff A, swapon B: B takes A's slot in swap_info[] (the lowest free one) and so A's
    swap_info_struct; A's reader must refuse, B's reads B."""
    with swap_area(tmp_path, 64 * MiB, "a.img") as a, \
            swap_area(tmp_path, 32 * MiB, "b.img", swapon=False) as b:
        old = open_or_skip(a)
        try:
            _run("swapoff", a)
            _run("swapon", "--priority", "32767", b)
            with SwapMap.open(b) as new:
                assert new.area.type == old.area.type  # the same struct, reused
                assert new.area.slots == 32 * MiB // PAGE != old.area.slots
                with pytest.raises(Unsupported, match="no longer swap"):
                    old.read()
                assert len(new.read()) == new.area.slots
        finally:
            old.close()


@swap_test
def test_the_fallback_routes_find_the_same_area(tmp_path):
    """Whatever route found it, it is the same struct: each route that works here agrees
    with the first (percpu needs an allocation on this area's CPU caches first)."""
    with swap_area(tmp_path, 64 * MiB) as loop, open_or_skip(loop) as first:
        with squeezed_worker(limit=16 * MiB) as w:
            w.do("alloc", 32 * MiB)  # allocations fill the per-CPU cluster caches
            found = {}
            for route in ("kallsyms", "code", "percpu"):
                try:
                    with SwapMap.open(loop, routes=(route,)) as sm:
                        found[route] = (sm.area.found_by, sm.area.type, sm.area.slots,
                                        classify(sm.read())["bad"])
                except Unsupported as e:
                    assert "not found" in str(e), e
                    found[route] = None
            print(found)
            assert found["percpu"] == ("percpu", first.area.type, first.area.slots, 1)
            hits = [v for v in found.values() if v]
            assert all(v[1:] == hits[0][1:] for v in hits)
            assert first.area.found_by in found and found[first.area.found_by]


@swap_test
def test_a_device_that_is_not_swap_is_refused_with_a_reason(tmp_path):
    with swap_area(tmp_path, 16 * MiB, swapon=False) as loop:
        with pytest.raises(Unsupported, match=r"is not an active swap area"):
            SwapMap.open(loop)
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    with pytest.raises(Unsupported, match="is not a block device"):
        SwapMap.open(str(plain))
    with pytest.raises(Unsupported, match="No such file"):
        SwapMap.open(str(tmp_path / "missing"))


@swap_test
def test_a_kernel_newer_than_the_checked_format_is_refused(tmp_path, monkeypatch):
    with swap_area(tmp_path, 16 * MiB) as loop:
        open_or_skip(loop).close()  # it opens as things are
        monkeypatch.setattr(swapmap, "CHECKED_UP_TO", (4, 19))
        with pytest.raises(Unsupported, match=r"^kernel \d+\.\d+ is newer than the swap_map "
                                              r"format checked here \(4\.19\)$"):
            SwapMap.open(loop)


@swap_test
def test_without_bpf_privileges_open_says_so(tmp_path):
    """The same call in a root process that dropped CAP_SYS_ADMIN, CAP_BPF and CAP_PERFMON:
    one line naming the refused bpf(2) command, no traceback of ours beyond it."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) missing")
    with swap_area(tmp_path, 16 * MiB) as loop:
        code = ("import sys\nfrom agentzip_blk.datapath.swapmap import SwapMap, Unsupported\n"
                "try:\n    SwapMap.open(sys.argv[1])\nexcept Unsupported as e:\n"
                "    print('UNSUPPORTED', e)\nelse:\n    print('OPENED')\n")
        res = subprocess.run(["setpriv", "--bounding-set=-sys_admin,-bpf,-perfmon",
                              "--inh-caps=-all", sys.executable, "-c", code, loop],
                             capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[2])
        assert res.returncode == 0, res.stderr
        assert re.fullmatch(r"UNSUPPORTED BPF_\w+: EPERM \(needs CAP_BPF and CAP_PERFMON, "
                            r"or root\)\n", res.stdout), res.stdout + res.stderr
