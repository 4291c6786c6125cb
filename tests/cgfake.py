"""Fake cgroupfs trees in a temp dir, for the cgroup v2 files these machines lack.

``fake_v2(tmp, {"/a/agent-sandbox-1.slice": {...}})`` writes ROOT/proc/mounts,
ROOT/proc/self/cgroup and a cgroup2 hierarchy at ROOT/sys/fs/cgroup whose cgroups hold the
usual memory files (overridable per cgroup). ``fake_hybrid`` adds a v1 memory hierarchy.

A fake tree is plain files, and the code is told so, never left to guess it from the path:
``plain(root)`` is its controller (``tree.PlainTree``), ``PlainTree(root)`` goes to a
``Ledger``, ``--cgroup-tree ROOT`` to the CLI. Read-only code may take the root alone.
"""

from __future__ import annotations

import os

from agentzip_blk.cgroups.fs import MemoryController, detect
from agentzip_blk.cgroups.tree import PlainTree

V2_DEFAULTS = {
    "cgroup.procs": "",
    "cgroup.controllers": "memory pids\n",
    "cgroup.subtree_control": "memory\n",
    "memory.current": str(200 << 20) + "\n",
    "memory.high": "max\n",
    "memory.max": "max\n",
    "memory.swap.max": "0\n",
    "memory.swap.current": "0\n",
    "memory.reclaim": "",
    "memory.stat": "anon 100\nfile 0\nworkingset_refault_anon 0\nworkingset_refault_file 0\npgmajfault 0\n",
    "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                       "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
}


def w(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def r(path: str) -> str:
    with open(path) as f:
        return f.read()


def fake_v2(tmp, cgroups: dict[str, dict[str, str]] | None = None, own: str = "/tests.scope") -> tuple[str, str]:
    """Returns (root, mount)."""
    root = str(tmp)
    w(f"{root}/proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n")
    w(f"{root}/proc/self/cgroup", f"0::{own}\n")
    mnt = f"{root}/sys/fs/cgroup"
    w(f"{mnt}/cgroup.controllers", "cpu memory pids\n")
    w(f"{mnt}/cgroup.subtree_control", "memory\n")
    w(f"{mnt}/cgroup.procs", "1\n")
    for rel, files in {own: {}, **(cgroups or {})}.items():
        for name, text in {**V2_DEFAULTS, **files}.items():
            w(f"{mnt}{rel}/{name}", text)
    return root, mnt


V1_DEFAULTS = {
    "cgroup.procs": "",
    "memory.usage_in_bytes": str(200 << 20) + "\n",
    "memory.limit_in_bytes": "9223372036854771712\n",
    "memory.soft_limit_in_bytes": "9223372036854771712\n",
    "memory.memsw.limit_in_bytes": "9223372036854771712\n",
    "memory.swappiness": "60\n",
    "memory.stat": "rss 100\ntotal_swap 0\ntotal_pgmajfault 0\ntotal_workingset_refault_anon 0\n"
                   "total_workingset_refault_file 0\n",
}


def fake_hybrid(tmp, cgroups: dict[str, dict[str, str]] | None = None,
                v2_cgroups: dict[str, dict[str, str]] | None = None,
                own: str = "/tests") -> tuple[str, str, str]:
    """v1 memory hierarchy + a cgroup2 mount without the memory controller.
    Returns (root, v1 mount, v2 mount)."""
    root = str(tmp)
    w(f"{root}/proc/mounts",
      "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
      "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n")
    w(f"{root}/proc/self/cgroup", f"4:memory:{own}\n0::/\n")
    v1 = f"{root}/sys/fs/cgroup/memory"
    v2 = f"{root}/sys/fs/cgroup/unified"
    w(f"{v2}/cgroup.controllers", "cpu io pids\n")
    w(f"{v2}/memory.pressure", "some avg10=0.00 avg60=0.00 avg300=0.00 total=999\n")
    w(f"{v2}/cgroup.procs", "1\n")
    for rel, files in {own: {}, **(cgroups or {})}.items():
        for name, text in {**V1_DEFAULTS, **files}.items():
            w(f"{v1}{rel}/{name}", text)
    for rel, files in (v2_cgroups or {}).items():
        for name, text in {"cgroup.procs": "", "memory.pressure": V2_DEFAULTS["memory.pressure"],
                           **files}.items():
            w(f"{v2}{rel}/{name}", text)
    return root, v1, v2


def plain(root: str) -> MemoryController:
    """The memory controller of the fake tree at *root*, declared a tree of plain files:
    control files created on write, a cgroup's files unlinked before its rmdir."""
    return detect(root, tree=PlainTree(root))


def real_v1():
    """The host's memory controller, for tests on real cgroups: skips unless it is v1 and
    we are root."""
    import pytest

    from agentzip_blk.cgroups.fs import CgroupError

    if os.geteuid() != 0:
        pytest.skip("needs root to create memory cgroups")
    try:
        c = detect()
    except CgroupError as e:
        pytest.skip(str(e))
    if c.version != 1:
        pytest.skip(f"memory controller is on cgroup v{c.version}, not v1")
    return c
