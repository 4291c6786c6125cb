"""agentzip_blk.cgroups.fs: v2 logic on a fake cgroupfs tree (plain files, declared as such:
cgfake.plain), v1 on the real controller."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentzip_blk.cgroups.fs import CgroupError, LimitBusy, MemoryCgroup, detect
from cgfake import plain, real_v1

# ---------------------------------------------------------------------------------------
# fake trees


def _w(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _r(path):
    with open(path) as f:
        return f.read()


def fake_v2(tmp_path, own="/user.slice/me.scope", own_ctrls="cpu memory pids",
            parent_ctrls="cpu memory pids", parent_subtree="memory"):
    root = str(tmp_path)
    _w(f"{root}/proc/mounts",
       "sysfs /sys sysfs rw 0 0\n"
       "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n")
    _w(f"{root}/proc/self/cgroup", f"0::{own}\n")
    mnt = f"{root}/sys/fs/cgroup"
    _w(f"{mnt}/cgroup.controllers", "cpuset cpu io memory pids\n")
    _w(f"{mnt}/cgroup.subtree_control", "cpu memory pids\n")
    parent = os.path.dirname(own)
    _w(f"{mnt}{parent}/cgroup.controllers", parent_ctrls + "\n")
    _w(f"{mnt}{parent}/cgroup.subtree_control", parent_subtree + "\n")
    _w(f"{mnt}{own}/cgroup.controllers", own_ctrls + "\n")
    _w(f"{mnt}{own}/cgroup.subtree_control", "\n")
    _w(f"{mnt}{own}/cgroup.procs", "4242\n")
    return root, mnt


def test_detect_v2(tmp_path):
    root, mnt = fake_v2(tmp_path)
    c = detect(root)
    assert c.version == 2
    assert c.mount == mnt
    assert c.own == "/user.slice/me.scope"
    assert c.own_path == mnt + "/user.slice/me.scope"


def test_detect_prefers_v1_memory_hierarchy(tmp_path):
    root = str(tmp_path)
    _w(f"{root}/proc/mounts",
       "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
       "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
       "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n")
    _w(f"{root}/proc/self/cgroup", "5:cpu:/\n4:memory:/jobs/abc\n0::/\n")
    _w(f"{root}/sys/fs/cgroup/unified/cgroup.controllers", "")  # memory bound to v1
    c = detect(root)
    assert (c.version, c.own, c.mount) == (1, "/jobs/abc", f"{root}/sys/fs/cgroup/memory")


def test_detect_v2_without_memory_controller_is_an_error(tmp_path):
    root, mnt = fake_v2(tmp_path)
    _w(f"{mnt}/cgroup.controllers", "cpu io pids\n")
    with pytest.raises(CgroupError, match="no memory cgroup controller"):
        detect(root)


def test_create_v2_enables_memory_in_own_subtree_control(tmp_path):
    root, mnt = fake_v2(tmp_path)
    own = f"{mnt}/user.slice/me.scope"
    cg = MemoryCgroup.create("job", controller=plain(root))
    assert cg.version == 2
    assert cg.path == own + "/job"
    assert os.path.isdir(cg.path)
    assert _r(own + "/cgroup.subtree_control") == "+memory"
    # already enabled: nothing rewritten
    _w(own + "/cgroup.subtree_control", "memory pids\n")
    MemoryCgroup.create("job2", controller=plain(root))
    assert _r(own + "/cgroup.subtree_control") == "memory pids\n"


def test_create_v2_walks_up_when_memory_not_available(tmp_path):
    root, mnt = fake_v2(tmp_path, own_ctrls="cpu pids", parent_ctrls="cpu memory pids",
                        parent_subtree="cpu pids")
    MemoryCgroup.create("job", controller=plain(root))
    assert _r(f"{mnt}/user.slice/cgroup.subtree_control") == "+memory"
    assert _r(f"{mnt}/user.slice/me.scope/cgroup.subtree_control") == "+memory"
    # the root already had it
    assert _r(f"{mnt}/cgroup.subtree_control") == "cpu memory pids\n"


def test_create_rejects_bad_names_and_existing(tmp_path):
    root, _ = fake_v2(tmp_path)
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(CgroupError, match="bad cgroup name"):
            MemoryCgroup.create(bad, controller=plain(root))
    MemoryCgroup.create("job", controller=plain(root))
    with pytest.raises(CgroupError, match="already exists"):
        MemoryCgroup.create("job", controller=plain(root))
    assert MemoryCgroup.create("job", controller=plain(root), exist_ok=True).name == "job"


def test_v2_limits_usage_stat(tmp_path):
    root, _ = fake_v2(tmp_path)
    cg = MemoryCgroup.create("job", controller=plain(root))
    _w(cg.file("memory.high"), "max\n")
    _w(cg.file("memory.max"), "max\n")

    cg.set_limit(100 << 20)
    assert cg.read("memory.high") == str(100 << 20)
    assert cg.read("memory.max") == str(100 << 20)
    assert cg.limit() == 100 << 20

    cg.set_limit(50 << 20, max_limit=None)  # squeeze through memory.high only
    assert cg.read("memory.high") == str(50 << 20)
    assert cg.read("memory.max") == "max"

    cg.set_limit(60 << 20, max_limit=80 << 20)
    assert (cg.read("memory.high"), cg.read("memory.max")) == (str(60 << 20), str(80 << 20))

    cg.set_limit(None)
    assert (cg.read("memory.high"), cg.read("memory.max")) == ("max", "max")
    assert cg.limit() is None

    _w(cg.file("memory.current"), "12345\n")
    _w(cg.file("memory.swap.current"), "4096\n")
    _w(cg.file("memory.stat"), "anon 8192\nfile 4096\nswapcached 0\npgmajfault 7\n")
    _w(cg.file("memory.events"), "low 0\nhigh 3\nmax 0\noom 0\noom_kill 1\n")
    assert cg.usage() == 12345
    assert cg.swap_usage() == 4096
    assert cg.stat() == {"anon": 8192, "file": 4096, "swapcached": 0, "pgmajfault": 7}
    assert cg.oom_kills() == 1
    assert cg.set_swappiness(100) is False  # v1 only
    assert not os.path.exists(cg.file("memory.swappiness"))

    _w(cg.file("memory.swap.max"), "0\n")
    cg.allow_swap()
    assert cg.read("memory.swap.max") == "max"


def test_v2_add_pid_and_remove_moves_strays_to_parent(tmp_path):
    root, mnt = fake_v2(tmp_path)
    own = f"{mnt}/user.slice/me.scope"
    with MemoryCgroup.create("job", controller=plain(root)) as cg:
        cg.add_pid(777)
        assert cg.pids() == [777]
        assert cg.parent().path == own
    assert not os.path.exists(own + "/job")
    assert _r(own + "/cgroup.procs") == "777"  # the stray went to the parent
    cg.remove()  # removing twice is fine


# ---------------------------------------------------------------------------------------
# the real controller (v1 on the development machines)


ALLOC = ("import sys\n"
         "sys.stdin.readline()\n"
         "b = bytearray(24 << 20)\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "print('ok', flush=True)\n"
         "sys.stdin.readline()\n")


def _start_allocator():
    return subprocess.Popen([sys.executable, "-c", ALLOC], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _finish(p):
    if p.poll() is None:
        p.kill()  # our own child, by pid
    p.wait(timeout=10)
    p.stdin.close()
    p.stdout.close()


def test_v1_real_child_limit_usage_remove():
    c = real_v1()
    name = f"pytest-cgm-{os.getpid()}"
    cg = MemoryCgroup.create(name, controller=c)
    p = _start_allocator()
    try:
        assert cg.path == os.path.join(c.own_path, name)
        cg.set_limit(128 << 20)
        assert cg.limit() == 128 << 20
        assert cg.set_swappiness(100) is True
        assert cg.read("memory.swappiness") == "100"
        cg.allow_swap()
        cg.add_pid(p.pid)
        assert cg.pids() == [p.pid]
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"
        assert cg.usage() >= 24 << 20  # allocated after joining: charged here
        st = cg.stat()
        assert st.get("total_rss", st.get("rss", 0)) >= 20 << 20
        assert cg.swap_usage() >= 0
        assert cg.oom_kills() == 0
        cg.set_limit(None)
        assert cg.limit() is None
    finally:
        _finish(p)
        cg.remove()
    assert not cg.exists()


def test_v1_remove_moves_a_live_stray_to_the_parent():
    c = real_v1()
    cg = MemoryCgroup.create(f"pytest-cgm-stray-{os.getpid()}", controller=c)
    p = subprocess.Popen(["sleep", "60"])
    try:
        cg.add_pid(p.pid)
        cg.remove()
        assert not cg.exists()
        assert p.poll() is None  # still running, now in our own cgroup
        assert p.pid in MemoryCgroup.own(controller=c).pids()
    finally:
        p.kill()
        p.wait(timeout=10)
        cg.remove()


def _swaps_active() -> bool:
    with open("/proc/swaps") as f:
        return len(f.read().splitlines()) > 1


def test_v1_lowering_below_unreclaimable_usage_is_ebusy_not_oom():
    """Without swap, anon memory cannot be reclaimed: v1 refuses the limit (EBUSY) and
    leaves the process alone; it does not OOM-kill (a limit *write* never does on v1)."""
    c = real_v1()
    if _swaps_active():
        pytest.skip("a swap area is active: the limit would be met by swapping")
    cg = MemoryCgroup.create(f"pytest-cgm-busy-{os.getpid()}", controller=c)
    p = _start_allocator()
    try:
        cg.add_pid(p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"
        try:
            cg.set_limit(4 << 20)
        except LimitBusy as e:
            assert "EBUSY" in str(e)
        else:
            if _swaps_active():
                pytest.skip("swap was turned on meanwhile")
            pytest.fail("limit below unreclaimable anon usage was accepted")
        assert p.poll() is None
        assert cg.oom_kills() == 0
        assert cg.limit() is None  # unchanged
    finally:
        _finish(p)
        cg.remove()
