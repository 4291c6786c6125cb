"""Who can reach the data (issue 16): the run directory is root's alone, and no file in it
is an instruction to root (state.json names no tools)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentzip_blk import cli
from agentzip_blk.config import ConfigError
from agentzip_blk.config.load import parse_config
from agentzip_blk.errors import SetupError
from agentzip_blk.host import attach, runstate
from agentzip_blk.host.chain import resolve_tool
from agentzip_blk.host.rundir import secure_run_dir
from agentzip_blk.host.servercmd import SERVER_PATH

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mount)")


@pytest.fixture
def base():
    """A world-traversable, root-owned directory under /tmp (like /run)."""
    d = tempfile.mkdtemp(prefix="azacc-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield Path(d)
    finally:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mnt = line.split()[4]
                if mnt.startswith(d):
                    subprocess.run(["umount", "-l", mnt], check=False)
        shutil.rmtree(d, ignore_errors=True)


def snapshot(path: Path) -> dict:
    """Every file below ``path`` with its bytes and mode: what must not change."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = os.lstat(p)
        out[str(p)] = (stat.S_IMODE(st.st_mode), st.st_uid,
                       p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    st = os.lstat(path)
    out["."] = (stat.S_IMODE(st.st_mode), st.st_uid, None)
    return out


# --- the run directory ----------------------------------------------------------------------

def test_run_dir_created_root_only(base):
    run = base / "run"
    secure_run_dir(str(run))
    st = os.lstat(run)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0


def test_run_dir_open_mode_is_fixed(base):
    run = base / "run"
    run.mkdir(mode=0o777)
    os.chmod(run, 0o777)
    (run / "keep").write_bytes(b"x")
    secure_run_dir(str(run))
    assert stat.S_IMODE(os.lstat(run).st_mode) == 0o700
    assert (run / "keep").read_bytes() == b"x"
    # with a control group: members may traverse it, nothing more
    secure_run_dir(str(run), NOBODY)
    st = os.lstat(run)
    assert stat.S_IMODE(st.st_mode) == 0o710 and st.st_gid == NOBODY
    # a caller that does not know the group (down) keeps the search bit, drops the rest
    os.chmod(run, 0o777)
    secure_run_dir(str(run), keep_group=True)
    assert stat.S_IMODE(os.lstat(run).st_mode) == 0o710
    secure_run_dir(str(run))
    assert stat.S_IMODE(os.lstat(run).st_mode) == 0o700


def test_run_dir_of_another_owner_is_refused(base):
    run = base / "run"
    run.mkdir(mode=0o755)
    os.chown(run, NOBODY, NOBODY)
    before = snapshot(run)
    with pytest.raises(SetupError, match=f"owned by uid {NOBODY}"):
        secure_run_dir(str(run))
    assert snapshot(run) == before


@pytest.mark.slow
def test_run_dir_symlink_is_refused_and_target_untouched(base):
    target = base / "target"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    (target / "state.json").write_bytes(b'{"planted": true}\n')
    (target / "lock").write_bytes(b"LOCK")
    run = base / "run"
    run.symlink_to(target)
    before = snapshot(target)
    with pytest.raises(SetupError, match="symbolic link"):
        secure_run_dir(str(run))
    with pytest.raises(SetupError, match="symbolic link"):
        with runstate.locked(str(run)):
            pass
    # the CLI in its own process: one clear line, exit 2, nothing written through the link
    for argv in (["down"], ["down", "--force"]):
        r = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "--run-dir", str(run),
                            *argv], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("agentzip-blk: error: ") and "symbolic link" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert snapshot(target) == before


def test_run_dir_under_a_writable_ancestor_is_refused(base):
    open_dir = base / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # world-writable, no sticky bit: anyone could swap run/ away
    with pytest.raises(SetupError, match="writable by group or others"):
        secure_run_dir(str(open_dir / "run"))
    assert not (open_dir / "run").exists()
    os.chmod(open_dir, 0o1777)  # sticky like /tmp: others cannot rename our directory
    secure_run_dir(str(open_dir / "run"))
    owned = base / "theirs"
    owned.mkdir()
    os.chown(owned, NOBODY, NOBODY)
    with pytest.raises(SetupError, match=f"owned by uid {NOBODY}"):
        secure_run_dir(str(owned / "run"))


def test_run_dir_regular_file_is_refused(base):
    run = base / "run"
    run.write_bytes(b"not a dir")
    with pytest.raises(SetupError, match="not a directory"):
        secure_run_dir(str(run))
    assert run.read_bytes() == b"not a dir"


# --- state.json is no instruction -----------------------------------------------------------

def test_state_file_records_no_tools_and_is_private(base):
    run = base / "run"
    secure_run_dir(str(run))
    st = runstate.RunState(run_dir=str(run), plugin="memory", nbd_socket=str(run / "nbd.sock"),
                           tools={"swapoff": "/bin/true"})
    old = os.umask(0)  # whatever the caller's umask, the file is 0600
    try:
        st.save()
    finally:
        os.umask(old)
    data = json.loads((run / "state.json").read_text())
    assert "tools" not in data
    assert stat.S_IMODE(os.lstat(run / "state.json").st_mode) == 0o600
    assert "tools" not in st.to_dict()


def test_old_state_file_tool_paths_are_ignored(base):
    run = base / "run"
    secure_run_dir(str(run))
    planted = base / "evil"
    planted.write_text("#!/bin/sh\ntouch %s\n" % (base / "ran"))
    planted.chmod(0o755)
    old = {"run_dir": str(run), "plugin": "memory", "nbd_socket": str(run / "nbd.sock"),
           "tools": {name: str(planted) for name in runstate.TOOLS}}
    (run / "state.json").write_text(json.dumps(old))
    state = runstate.RunState.load(str(run))
    assert state.tools == {}
    for name in runstate.TOOLS:
        assert state.tool(name) == runstate.TOOLS[name]
        found = shutil.which(runstate.TOOLS[name], path=SERVER_PATH)
        if found:
            assert resolve_tool(name, state.tools) == found
    assert not (base / "ran").exists()


def test_down_does_not_run_tools_named_in_state(base):
    """A state whose mount point is mounted makes `down` run fusermount3: the real one, found
    again on the fixed PATH, never the one an old (or planted) state.json names."""
    run = base / "run"
    secure_run_dir(str(run))
    mnt = run / "mnt"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "aztest", str(mnt)], check=True)
    marker = base / "ran"
    planted = base / "evil"
    planted.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marker}\nexit 0\n")
    planted.chmod(0o755)
    old = {"run_dir": str(run), "plugin": "memory", "nbd_socket": str(run / "nbd.sock"),
           "mountpoint": str(mnt), "tools": {name: str(planted) for name in runstate.TOOLS}}
    (run / "state.json").write_text(json.dumps(old))
    try:
        attach.down(str(run))
    except Exception:
        pass  # whatever the real tools make of a tmpfs; what matters is who ran
    assert not marker.exists(), marker.read_text()
    with open("/proc/self/mountinfo") as f:  # the real fusermount3 unmounted it
        assert not any(line.split()[4] == str(mnt) for line in f)


@pytest.mark.slow
def test_status_of_non_root_is_a_clear_error(base):
    run = base / "run"
    secure_run_dir(str(run))
    (run / "state.json").write_text("{}")
    r = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                        "--clear-groups", sys.executable, "-m", "agentzip_blk.cli",
                        "--run-dir", str(run), "status"], capture_output=True, text=True,
                       timeout=60, cwd="/",
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("agentzip-blk: error: ") and "permission denied" in r.stderr
    assert "run this as root" in r.stderr


# --- the config key --------------------------------------------------------------------------

@pytest.mark.slow
def test_control_group_validates(base):
    assert parse_config({"device": {"control_group": "nogroup"}}).device.control_group == "nogroup"
    assert parse_config({}).device.control_group is None
    for bad, why in (("no-such-group-azt", "no group"), ("two words", "not a group name"),
                     (7, "not a group name"), ("", "not a group name")):
        with pytest.raises(ConfigError, match=f"device.control_group: .*{why}"):
            parse_config({"device": {"control_group": bad}})
    cfg = base / "config.yaml"
    cfg.write_text("device:\n  control_group: no-such-group-azt\n")
    # no --run-dir: the run directory comes from the config, which is read (and refused)
    r = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "--config", str(cfg),
                        "status"], capture_output=True,
                       text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 2
    assert r.stderr.strip() == (f"agentzip-blk: error: {cfg}: device.control_group: no group "
                                "'no-such-group-azt' on this host (getent group "
                                "no-such-group-azt); create it or set null for root only")
    assert cli.main(["--config", str(cfg), "status"]) == 2


@pytest.mark.slow
def test_state_naming_foreign_paths_is_refused(base):
    """A state.json that points `down` at another mount, swap area or loop device is refused
    before anything runs: the mount stays, the CLI says why in one line."""
    run = base / "run"
    secure_run_dir(str(run))
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "aztest", str(elsewhere)],
                   check=True)
    good = {"run_dir": str(run), "plugin": "memory", "nbd_socket": str(run / "nbd.sock")}
    for key, value in (("mountpoint", str(elsewhere)), ("device", "/dev/zram0"),
                       ("loop_device", "/dev/sda"), ("nbd_socket", "/etc/passwd"),
                       ("fuse_file", str(elsewhere / "device"))):
        (run / "state.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(Exception, match="not where `up` puts it"):
            runstate.RunState.load(str(run))
        r = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "--run-dir", str(run),
                            "down", "--force"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        assert r.returncode == 1 and r.stderr.startswith("agentzip-blk: error: "), r.stderr
        assert f"names {key}" in r.stderr
    with open("/proc/self/mountinfo") as f:
        assert any(line.split()[4] == str(elsewhere) for line in f)
    (run / "state.json").write_text(json.dumps(good))
    assert runstate.RunState.load(str(run)).nbd_socket == str(run / "nbd.sock")
