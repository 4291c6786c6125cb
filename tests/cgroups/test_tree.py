"""agentzip_blk.cgroups.tree: the kind of a cgroup hierarchy is declared, never guessed from
where it is mounted (issue 30). A hierarchy found under another root than / is cgroupfs, with
every check: a missing control file is an error, not a file created, and a file that is not
on cgroupfs is refused and left as it was. A tree of plain files says so (PlainTree): files
created on write, nothing written outside it, a cgroup's files unlinked before its rmdir."""

from __future__ import annotations

import os

import pytest

from agentzip_blk import cli
from agentzip_blk.cgroups.backends import open_backend
from agentzip_blk.cgroups.fs import CgroupError, MemoryCgroup, detect
from agentzip_blk.cgroups.ledger import Ledger, NotACgroupFile
from agentzip_blk.cgroups.tree import CGROUPFS, Cgroupfs, PlainTree
from cgfake import fake_v2, plain, r, w

SANDBOX = "/agents/agent-sandbox-1.slice"


def test_a_hierarchy_under_another_root_is_cgroupfs(tmp_path):
    root, _ = fake_v2(tmp_path)
    assert detect(root).tree == CGROUPFS  # root "/host" or a temp dir: the same kind
    assert plain(root).tree == PlainTree(root)
    assert detect(root).mount == plain(root).mount  # the kind moves nothing


def test_cgroupfs_under_another_root_never_creates_a_control_file(tmp_path):
    """The hazard of the old inference: a root other than / made every write create its file
    and skip the cgroupfs check. Undeclared, the fake tree is taken for cgroupfs: a missing
    control file fails loudly and stays missing."""
    root, mnt = fake_v2(tmp_path, {SANDBOX: {}})
    c = detect(root)
    cg = MemoryCgroup(c, SANDBOX)
    missing = f"{mnt}{SANDBOX}/memory.low"
    with pytest.raises(CgroupError, match="No such file"):
        cg.write("memory.low", 1 << 20)
    assert not os.path.exists(missing)
    # the backends' direct writes and the ledger's alike
    os.unlink(f"{mnt}{SANDBOX}/memory.high")
    with pytest.raises(CgroupError, match="No such file"):
        open_backend(controller=c).set_cap(SANDBOX, 1 << 20)
    assert not os.path.exists(f"{mnt}{SANDBOX}/memory.high")
    with pytest.raises(FileNotFoundError):
        Ledger(str(tmp_path / "run")).write(f"{mnt}{SANDBOX}/memory.high", "5")
    assert not os.path.exists(f"{mnt}{SANDBOX}/memory.high")


def test_cgroupfs_refuses_a_plain_file_and_leaves_it_whole(tmp_path):
    root, mnt = fake_v2(tmp_path, {SANDBOX: {"memory.swap.max": "0\n"}})
    c = detect(root)
    path = f"{mnt}{SANDBOX}/memory.swap.max"
    with pytest.raises(CgroupError, match="not on a cgroup file system"):
        MemoryCgroup(c, SANDBOX).write("memory.swap.max", "max")
    with pytest.raises(CgroupError, match="not on a cgroup file system"):
        open_backend(controller=c).prepare(SANDBOX, 1 << 20)
    with pytest.raises(NotACgroupFile, match="not on a cgroup file system"):
        Cgroupfs().write(path, "max")
    assert r(path) == "0\n"  # checked after the open, which neither creates nor truncates


def test_cgroupfs_rmdir_leaves_files_it_does_not_own(tmp_path):
    root, mnt = fake_v2(tmp_path, {SANDBOX: {}})
    with pytest.raises(CgroupError, match="cannot remove"):
        MemoryCgroup(detect(root), SANDBOX).remove(timeout=0)
    assert os.path.exists(f"{mnt}{SANDBOX}/memory.high")


def test_a_plain_tree_creates_files_within_it_only(tmp_path):
    root, mnt = fake_v2(tmp_path / "fs", {SANDBOX: {}})
    tree = PlainTree(root)
    tree.write(f"{mnt}{SANDBOX}/memory.low", "7")
    assert r(f"{mnt}{SANDBOX}/memory.low") == "7"
    tree.write(f"{mnt}{SANDBOX}/memory.high", "5")  # truncated, as if the kernel took it
    assert r(f"{mnt}{SANDBOX}/memory.high") == "5"
    outside = tmp_path / "elsewhere" / "memory.high"
    w(str(outside), "keep")
    with pytest.raises(NotACgroupFile, match="outside the plain cgroup tree"):
        tree.write(str(outside), "5")
    with pytest.raises(NotACgroupFile, match="outside the plain cgroup tree"):
        tree.write(f"{root}/../elsewhere/memory.high", "5")
    assert r(str(outside)) == "keep"
    (tmp_path / "fs" / "link").symlink_to(outside)
    with pytest.raises(NotACgroupFile, match="symbolic link"):
        tree.write(str(tmp_path / "fs" / "link"), "5")
    assert r(str(outside)) == "keep"


def test_a_plain_tree_removes_a_cgroup_with_its_files(tmp_path):
    root, mnt = fake_v2(tmp_path, {SANDBOX: {}})
    MemoryCgroup(plain(root), SANDBOX).remove(timeout=0)
    assert not os.path.exists(f"{mnt}{SANDBOX}")


# --- the CLI: --cgroup-root is cgroupfs under another root, --cgroup-tree a plain tree --------

def _tune(tmp_path, *argv):
    return cli.main(["--config", str(tmp_path / "config.yaml"), "--run-dir", str(tmp_path / "run"),
                     "tune", "--without-device", "--steps", "1", "--interval", "0.01",
                     "--grace", "0", *argv])


@pytest.mark.skipif(os.geteuid() != 0, reason="tune on cgroupfs is root's")
def test_tune_with_cgroup_root_takes_it_for_cgroupfs(tmp_path, capsys):
    root, mnt = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}})
    w(str(tmp_path / "config.yaml"), "scopes: [{cgroup: 'agent-sandbox-*.slice'}]\n")
    assert _tune(tmp_path, "--cgroup-root", root) == 0
    out = capsys.readouterr().out
    assert f"{SANDBOX}: prepare failed" in out and "not on a cgroup file system" in out, out
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "0\n"
    assert Ledger(str(tmp_path / "run")).entries() == []


def test_tune_with_cgroup_tree_writes_the_plain_files(tmp_path, capsys):
    root, mnt = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}})
    w(str(tmp_path / "config.yaml"), "scopes: [{cgroup: 'agent-sandbox-*.slice'}]\n")
    assert _tune(tmp_path, "--cgroup-tree", root, "--keep") == 0
    assert f"{SANDBOX}: prepared (memory.swap.max)" in capsys.readouterr().out
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "max"


def test_cgroup_root_and_cgroup_tree_exclude_each_other(tmp_path, capsys):
    root, mnt = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}})
    w(str(tmp_path / "config.yaml"), "scopes: [{cgroup: 'agent-sandbox-*.slice'}]\n")
    assert _tune(tmp_path, "--cgroup-root", root, "--cgroup-tree", root) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "0\n"
