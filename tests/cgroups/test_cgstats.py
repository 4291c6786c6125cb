"""agentzip_blk.cgroups.cgstats: pagemap swap entries (fake /proc), the join with per-slot sizes, the
chunked `slots` requests against a real server. The real end to end is in test_scoped_swap."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from agentzip_blk.cgroups import cgstats
from agentzip_blk.cgroups.backends import open_backend
from agentzip_blk.cgroups.cgstats import (
    CgroupSwap,
    SwapEntries,
    account,
    collect,
    our_swap_type,
    swap_entries,
)
from cgfake import fake_v2, w

PAGE = 4096
SWAPS = ("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
         "/dev/zram0                              partition\t1048572\t\t0\t\t10\n"
         "/dev/loop3                              partition\t1048572\t\t400\t\t100\n")


def _entry(swap_type: int, offset: int) -> int:
    return (1 << 62) | swap_type | (offset << 5)


def _fake_proc(tmp_path, pid: int, vmas: list[tuple[int, int, int, dict[int, int]]]):
    """vmas: (lo, hi, swap_kb_in_smaps, {page_index_in_vma: pagemap entry})."""
    d = tmp_path / "proc" / str(pid)
    smaps = []
    os.makedirs(d, exist_ok=True)
    with open(d / "pagemap", "wb") as f:
        for lo, hi, swap_kb, ents in vmas:
            smaps.append(f"{lo:x}-{hi:x} rw-p 00000000 00:00 0 \nSize: {(hi - lo) >> 10} kB\n"
                         f"Rss: 4 kB\nSwap:                {swap_kb} kB\nVmFlags: rd wr mr mw me ac\n")
            for i, e in ents.items():
                f.seek((lo // PAGE + i) * 8)
                f.write(struct.pack("<Q", e))
    (d / "smaps").write_text("".join(smaps))
    return str(tmp_path / "proc")


def test_our_swap_type_is_the_index_in_proc_swaps(tmp_path):
    w(str(tmp_path / "swaps"), SWAPS)
    assert our_swap_type("/dev/loop3", str(tmp_path / "swaps")) == 1
    assert our_swap_type("/dev/zram0", str(tmp_path / "swaps")) == 0
    assert our_swap_type("/dev/loop9", str(tmp_path / "swaps")) is None


def test_swap_entries_from_pagemap(tmp_path):
    lo = 0x400000
    present = (1 << 63) | 12345
    proc = _fake_proc(tmp_path, 10, [
        (lo, lo + 16 * PAGE, 12, {0: _entry(1, 500), 1: _entry(1, 501), 2: present, 3: _entry(0, 77),
                                 15: _entry(1, 9_000_000)}),
        # smaps says no swap here: never read, whatever its pagemap holds
        (lo + 32 * PAGE, lo + 40 * PAGE, 0, {0: _entry(1, 666)}),
    ])
    _fake_proc(tmp_path, 11, [(lo, lo + 4 * PAGE, 4, {0: _entry(1, 500), 1: _entry(1, 502)})])  # 500: shared after fork
    e = swap_entries([10, 11, 12], proc)  # 12 does not exist: skipped
    assert e.pids == 2 and e.unreadable == []
    assert sorted(e.by_type) == [0, 1]
    assert e.by_type[1].tolist() == [500, 501, 502, 9_000_000]
    assert e.by_type[0].tolist() == [77]


def _slots_fn(table):
    def fn(slots):
        rows = [table.get(int(s), (0, 0.0, 0)) for s in slots]
        return {"kind": np.array([r[0] for r in rows]), "stored": np.array([r[1] for r in rows]),
                "tier": np.array([r[2] for r in rows])}
    return fn


def test_account_kinds_and_sizes():
    e = SwapEntries(by_type={1: np.array([1, 2, 3, 4, 5, 6]), 0: np.array([9, 10])}, pids=3)
    table = {1: (2, 1000.0, 0), 2: (2, 500.5, 1), 3: (1, 0.0, 0), 4: (2, 250.0, 0), 5: (0, 0.0, 0)}
    row = account("/x", e, 1, _slots_fn(table))
    assert (row.pages, row.zero_pages, row.same_pages, row.blob_pages, row.disk_pages) == (6, 2, 1, 3, 1)
    assert row.other_swap_pages == 2
    assert row.orig_mem == 6 * PAGE and row.stored_mem == 1750 and row.device_pages == 4
    assert row.ratio == pytest.approx(6 * PAGE / 1750.5, rel=1e-3)
    assert CgroupSwap("/z", pages=3, zero_pages=3).ratio is None  # all zero pages: nothing stored


def test_collect_rows_total_and_the_single_area_type_check(tmp_path):
    root, mnt = fake_v2(tmp_path / "fs", {"/a/agent-1": {"cgroup.procs": "10\n"},
                                          "/a/agent-1/job": {"cgroup.procs": "11\n"},
                                          "/a/agent-2": {"cgroup.procs": "12\n"},
                                          "/b": {"cgroup.procs": "13\n"}})
    lo = 0x400000
    proc = _fake_proc(tmp_path, 10, [(lo, lo + 4 * PAGE, 8, {0: _entry(3, 100), 1: _entry(3, 101)})])
    _fake_proc(tmp_path, 11, [(lo, lo + 4 * PAGE, 4, {0: _entry(3, 100)})])
    _fake_proc(tmp_path, 12, [(lo, lo + 4 * PAGE, 4, {0: _entry(3, 200)})])
    _fake_proc(tmp_path, 13, [(lo, lo + 4 * PAGE, 4, {0: _entry(3, 300)})])
    swaps = tmp_path / "swaps"
    # one area, listed first, but its type is 3 (areas below it were swapped off): still ours
    w(str(swaps), SWAPS.splitlines()[0] + "\n" + SWAPS.splitlines()[2] + "\n")
    table = {100: (2, 100.0, 0), 101: (2, 50.0, 0), 200: (1, 0.0, 0), 300: (2, 7.0, 0)}
    res = collect(open_backend(root), ["agent-*"], "unused", "/dev/loop3", swaps_path=str(swaps),
                  proc=proc, slots_fn=_slots_fn(table),
                  stats_fn=lambda: {"orig_mem": 4 * PAGE, "stored_mem": 999, "pages": 4,
                                    "same_pages": 1, "compressed_bytes": 157, "ratio": 1.0})
    assert res["swap_type"] == 3
    rows = {r["cgroup"]: r for r in res["cgroups"]}
    assert list(rows) == ["/a/agent-1", "/a/agent-2"]  # /a/agent-1/job is part of agent-1
    assert rows["/a/agent-1"]["pages"] == 2 and rows["/a/agent-1"]["stored_mem"] == 150
    assert rows["/a/agent-2"]["same_pages"] == 1 and rows["/a/agent-2"]["stored_mem"] == 0
    assert res["total"]["pages"] == 3 and res["total"]["stored_mem"] == 150
    assert res["store"]["compressed_bytes"] == 157


def test_query_slots_chunks_below_the_control_line_limit(tmp_path):
    """Enough slots that one request would exceed the control socket's 64 KiB line limit."""
    from nbdkit_server import nbdkit_available, start_server
    why = nbdkit_available()
    if why:
        pytest.skip(why)
    srv = start_server(tmp_path, size="512M")
    try:
        slots = np.arange(0, 120_000, dtype=np.int64)  # ~800 KB of JSON
        got = cgstats.query_slots(srv.control_socket, slots)
        assert len(got["kind"]) == len(slots)
        assert not got["kind"].any() and not got["stored"].any()  # an empty store
    finally:
        srv.stop()


def test_swap_entries_of_a_real_process_without_swap():
    if os.geteuid() != 0:
        pytest.skip("pagemap swap offsets need CAP_SYS_ADMIN")
    with open("/proc/swaps") as f:
        if len(f.read().splitlines()) > 1:
            pytest.skip("a swap area is active: our own pages might be on it")
    e = swap_entries([os.getpid()])
    assert e.pids == 1 and e.by_type == {}
