"""The cgroup ledger is a file, not root's instruction (issue 16): it writes only known
cgroup file names on cgroupfs (fstatfs magic), never through a symbolic link; a planted
entry is refused with a logged error and nothing at its target changes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agentzip_blk.cgroups import ledger
from agentzip_blk.cgroups.fs import CgroupError, MemoryCgroup
from agentzip_blk.cgroups.ledger import Ledger, NotACgroupFile, write_cgroup_file
from agentzip_blk.cgroups.tree import PlainTree


def _plant(run: Path, entries: list[dict]) -> None:
    run.mkdir(mode=0o700, exist_ok=True)
    (run / ledger.LEDGER_FILE).write_text(json.dumps({"entries": entries}))


def _entry(path: str, original: str = "PWNED\n") -> dict:
    """A planted entry that carries its directory's inode, as the tuner's entries do: the
    other checks must refuse it on their own."""
    ino = os.stat(os.path.dirname(path)).st_ino
    return {"path": path, "cgroup": "/x", "original": original, "last": "1", "ino": ino}


def test_planted_entries_are_refused_and_targets_unchanged(tmp_path, caplog):
    victim = tmp_path / "etc" / "passwd"
    victim.parent.mkdir()
    victim.write_bytes(b"root:x:0:0::/root:/bin/sh\n")
    # a known name, but a plain file on ext4/tmpfs: not cgroupfs
    plain = tmp_path / "cg" / "memory.high"
    plain.parent.mkdir()
    plain.write_bytes(b"max\n")
    # a known name that is a symbolic link to the victim
    link_dir = tmp_path / "linkcg"
    link_dir.mkdir()
    (link_dir / "memory.max").symlink_to(victim)
    run = tmp_path / "run"
    _plant(run, [_entry(str(victim)), _entry(str(plain)), _entry(str(link_dir / "memory.max"))])
    before = (victim.read_bytes(), plain.read_bytes())
    with caplog.at_level(logging.ERROR, logger="agentzip_blk.cgroups.ledger"):
        report = ledger.release_all(str(run))
    assert (victim.read_bytes(), plain.read_bytes()) == before
    assert not report.restored
    failed = {e.path: why for e, why in report.failed}
    assert set(failed) == {str(victim), str(plain), str(link_dir / "memory.max")}
    assert "not a cgroup file the tuner writes" in failed[str(victim)]
    assert "not on a cgroup file system" in failed[str(plain)]
    assert "symbolic link" in failed[str(link_dir / "memory.max")]
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 3
    assert "FAILED" in report.summary()
    # refused entries leave the ledger: the next restore has nothing to try
    assert Ledger(str(run)).entries() == []


def test_fake_trees_still_refuse_unknown_names_and_links(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.high").symlink_to(victim)
    led = Ledger(str(tmp_path / "run"), PlainTree(str(tmp_path)))
    with pytest.raises(NotACgroupFile, match="symbolic link"):
        led.write(str(cg / "memory.high"), "5")
    with pytest.raises(NotACgroupFile, match="not a cgroup file"):
        led.write(str(tmp_path / "cgroup.procs"), "1")
    with pytest.raises(NotACgroupFile, match="not a cgroup file"):
        write_cgroup_file(str(victim), "x", PlainTree(str(tmp_path)))
    assert victim.read_bytes() == b"keep"
    # an unknown name is refused before it is read or recorded
    assert [os.path.basename(e.path) for e in led.entries()] == ["memory.high"]


def test_ledger_run_dir_symlink_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(Exception, match="symbolic link"):
        Ledger(str(tmp_path / "run")).entries()
    assert list(target.iterdir()) == []


def test_ledger_files_are_not_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (run / ledger.LEDGER_LOCK).symlink_to(victim)
    with pytest.raises(OSError):
        Ledger(str(run)).entries()
    assert victim.read_bytes() == b"keep"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a real cgroup)")
def test_real_cgroup_file_is_written_and_restored():
    try:
        cg = MemoryCgroup.create(f"azt-ledger-{os.getpid()}")
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    run = tempfile.mkdtemp(prefix="azt-ledger-", dir="/tmp")
    try:
        name = "memory.swappiness" if cg.version == 1 else "memory.high"
        path = os.path.join(cg.path, name)
        with open(path) as f:
            original = f.read().strip()
        new = "37" if cg.version == 1 else str(512 << 20)
        led = Ledger(run)
        led.write(path, new)
        with open(path) as f:
            assert f.read().strip() == new
        report = ledger.release_all(run)
        assert len(report.restored) == 1 and not report.failed
        with open(path) as f:
            assert f.read().strip() == original
    finally:
        cg.remove()
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a real cgroup)")
def test_an_entry_without_an_inode_is_refused_by_down():
    """Issue 27: a ledger entry that names a real cgroup file on cgroupfs but carries no
    inode was not written by the tuner; `down` (its own process, as an operator runs it)
    refuses it, logs it, and the cgroup file keeps its value."""
    import subprocess
    import sys

    try:
        cg = MemoryCgroup.create(f"azt-ledger-ino-{os.getpid()}")
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    run = Path(tempfile.mkdtemp(prefix="azt-ledger-", dir="/tmp"))
    try:
        name = "memory.swappiness" if cg.version == 1 else "memory.high"
        path = os.path.join(cg.path, name)
        before = Path(path).read_text()
        planted = "13" if cg.version == 1 else str(1 << 20)
        _plant(run, [{"path": path, "cgroup": "/x", "original": planted, "last": "1"}])
        os.chmod(run / ledger.LEDGER_FILE, 0o600)
        res = subprocess.run([os.path.join(os.path.dirname(sys.executable), "agentzip-blk"),
                              "--run-dir", str(run), "down"], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        assert Path(path).read_text() == before, "down wrote a ledger entry without an inode"
        assert res.returncode == 0, res.stderr  # nothing attached: "nothing to do"
        assert "no cgroup inode recorded" in res.stdout + res.stderr
        assert Ledger(str(run)).entries() == []  # refused entries leave the ledger
    finally:
        cg.remove()
        shutil.rmtree(run, ignore_errors=True)
