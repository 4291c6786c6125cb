"""agentzip_blk.cgroups.backends: v2 and hybrid on fake trees, v1 on the real controller."""

from __future__ import annotations

import os
import subprocess
import sys

from agentzip_blk.cgroups.backends import V1Backend, V2Backend, open_backend, parse_psi
from agentzip_blk.cgroups.fs import MemoryCgroup
from agentzip_blk.cgroups.ledger import Ledger
from agentzip_blk.cgroups.tree import PlainTree
from cgfake import fake_hybrid, fake_v2, plain, r, real_v1, w

SANDBOX = "/agents/agent-sandbox-1.slice"


def test_parse_psi():
    text = "some avg10=1.00 avg60=0.50 avg300=0.10 total=12345\nfull avg10=0 avg60=0 avg300=0 total=77\n"
    assert parse_psi(text) == 12345
    assert parse_psi(text, "full") == 77
    assert parse_psi("") is None


def test_v2_detect_walk_and_reads(tmp_path):
    root, mnt = fake_v2(tmp_path, {SANDBOX: {
        "cgroup.procs": "10\n11\n", "memory.current": "1000\n", "memory.swap.current": "4096\n",
        "memory.stat": "anon 1\nworkingset_refault_anon 5\nworkingset_refault_file 2\npgmajfault 9\n",
        "memory.pressure": "some avg10=0 avg60=0 avg300=0 total=500\nfull avg10=0 avg60=0 avg300=0 total=1\n"},
        SANDBOX + "/job": {"cgroup.procs": "12\n"}})
    b = open_backend(root)
    assert isinstance(b, V2Backend) and b.kind == "v2" and b.mount == mnt
    rels = list(b.walk())
    assert rels[0] == "/"
    assert rels.index("/agents") < rels.index(SANDBOX) < rels.index(SANDBOX + "/job")
    assert b.pids(SANDBOX) == [10, 11, 12]
    assert b.pids(SANDBOX, recursive=False) == [10, 11]
    c = b.counters(SANDBOX)
    assert (c.psi_some_us, c.refaults, c.majfaults, c.swap_usage, c.usage) == (500, 7, 9, 4096, 1000)
    assert b.psi_file("/") is None  # the root's PSI is the whole machine's
    assert b.cap(SANDBOX) is None


def test_v2_writes_go_through_the_writer_and_reclaim_is_transient(tmp_path):
    root, mnt = fake_v2(tmp_path, {SANDBOX: {}})
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    b = open_backend(writer=ledger, controller=plain(root))
    assert b.prepare(SANDBOX, 1 << 20) == ["memory.swap.max"]
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "max"
    assert b.prepare(SANDBOX, 1 << 20) == []  # already allowed: no second write
    b.set_cap(SANDBOX, 150 << 20)
    assert b.cap(SANDBOX) == 150 << 20
    b.reclaim(SANDBOX, 5 << 20)
    assert r(f"{mnt}{SANDBOX}/memory.reclaim") == str(5 << 20)
    recorded = {os.path.basename(e.path): e.original for e in ledger.entries()}
    assert recorded == {"memory.swap.max": "0", "memory.high": "max"}  # not memory.reclaim
    ledger.restore()
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "0"
    assert r(f"{mnt}{SANDBOX}/memory.high") == "max"
    assert ledger.entries() == []


def test_v2_reclaim_without_memory_reclaim_pulses_memory_high(tmp_path):
    root, mnt = fake_v2(tmp_path, {SANDBOX: {"memory.high": "300000000\n"}})
    os.unlink(f"{mnt}{SANDBOX}/memory.reclaim")
    writes = []

    class Rec:
        def write(self, path, value, *, transient=False):
            writes.append((os.path.basename(path), value))
            w(path, value)

    b = open_backend(root, writer=Rec())
    b.reclaim(SANDBOX, 50 << 20)
    assert writes == [("memory.high", str((200 << 20) - (50 << 20))), ("memory.high", "300000000")]


def test_hybrid_detection_and_mirrored_psi(tmp_path):
    root, v1, v2 = fake_hybrid(
        tmp_path,
        {SANDBOX: {"cgroup.procs": "10\n11\n"}, "/agents/other": {"cgroup.procs": "20\n"}},
        {SANDBOX: {"cgroup.procs": "10\n", "memory.pressure":
                   "some avg10=0 avg60=0 avg300=0 total=4242\nfull total=0\n"},
         SANDBOX + "/x": {"cgroup.procs": "11\n"},
         "/agents/other": {"cgroup.procs": "21\n"}})
    b = open_backend(root)
    assert isinstance(b, V1Backend) and b.kind == "hybrid" and b.unified == v2
    # same processes on the cgroup2 side: that cgroup's PSI is this cgroup's
    assert b.psi_file(SANDBOX) == f"{v2}{SANDBOX}/memory.pressure"
    assert b.counters(SANDBOX).psi_some_us == 4242
    # different processes: no PSI (the estimate is used instead)
    assert b.psi_file("/agents/other") is None
    assert b.counters("/agents/other").psi_some_us is None
    # no mirror at all
    assert b.psi_file("/tests") is None


def test_v1_prepare_fake(tmp_path):
    root, v1, _ = fake_hybrid(tmp_path, {SANDBOX: {"memory.memsw.limit_in_bytes": "104857600\n",
                                                   "memory.limit_in_bytes": "104857600\n"}})
    ledger = Ledger(str(tmp_path / "run"), PlainTree(root))
    b = open_backend(writer=ledger, controller=plain(root))
    done = b.prepare(SANDBOX, 32 << 20)
    assert done == ["memory.memsw.limit_in_bytes", "memory.swappiness", "memory.soft_limit_in_bytes"]
    assert r(f"{v1}{SANDBOX}/memory.memsw.limit_in_bytes") == "-1"
    assert r(f"{v1}{SANDBOX}/memory.swappiness") == "100"
    assert r(f"{v1}{SANDBOX}/memory.soft_limit_in_bytes") == str(32 << 20)
    assert b.cap(SANDBOX) == 104857600
    ledger.restore()
    assert r(f"{v1}{SANDBOX}/memory.memsw.limit_in_bytes") == "104857600"
    assert r(f"{v1}{SANDBOX}/memory.swappiness") == "60"


# --- the real v1 controller ----------------------------------------------------------------

def _swaps_active() -> bool:
    with open("/proc/swaps") as f:
        return len(f.read().splitlines()) > 1


ALLOC = ("import sys, mmap\n"
         "m = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
         "for i in range(0, len(m), 4096): m[i] = 1\n"
         "print('ok', flush=True)\n"
         "sys.stdin.readline()\n")


def test_v1_real_child(tmp_path):
    c = real_v1()
    cg = MemoryCgroup.create(f"pytest-backends-{os.getpid()}", controller=c)
    p = None
    try:
        ledger = Ledger(str(tmp_path / "run"))
        b = open_backend(controller=c, writer=ledger)
        assert b.version == 1
        rel = cg.rel
        assert rel in list(b.walk())
        before = {n: b.read(rel, n) for n in V1Backend.SETTINGS}
        assert b.prepare(rel, 8 << 20)
        assert b.read(rel, "memory.swappiness") == "100"
        assert b.read(rel, "memory.soft_limit_in_bytes") == str(8 << 20)
        p = subprocess.Popen([sys.executable, "-c", ALLOC], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, preexec_fn=lambda: cg.add_pid(os.getpid()))
        assert p.stdout.readline().strip() == "ok"
        assert b.pids(rel) == [p.pid]
        cnt = b.counters(rel)
        assert cnt.usage >= 16 << 20 and cnt.swap_usage == 0 and cnt.psi_some_us is None
        b.set_cap(rel, 512 << 20)
        assert b.cap(rel) == 512 << 20
        if not _swaps_active():
            # without swap anon memory cannot go: the pulse reclaims little, returns, and the
            # limit is back where it was
            got = b.reclaim(rel, 8 << 20)
            assert 0 <= got < 8 << 20
            assert b.cap(rel) == 512 << 20
            assert p.poll() is None
        ledger.restore()
        assert {n: b.read(rel, n) for n in V1Backend.SETTINGS} == before
    finally:
        if p is not None:
            p.kill()
            p.wait()
            p.stdin.close()
            p.stdout.close()
        cg.remove()
