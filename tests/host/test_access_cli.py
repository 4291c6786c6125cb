"""Who can reach the data, through the installed CLI in separate processes (issue 16): after
`agentzip-blk up`, another uid gets a clear error from `status` and EACCES on control.sock,
nbd.sock, the FUSE device file and the disk-tier file; root's `status` and `down` work."""

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
import yaml

from agentzip_blk.host import facts
from host.test_device import assert_clean, leftovers

NOBODY = 65534
AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
TREE = str(Path(__file__).resolve().parents[2])

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "setpriv"])),
                       reason="nbdkit/util-linux missing (./setup.sh installs them)"),
    pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed"),
]

PROBE = r"""
import json, os, socket, sys
out = {}
for name in sys.argv[1:]:
    try:
        if name.endswith(".sock"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(name)
            s.close()
        else:
            os.close(os.open(name, os.O_RDONLY))
        out[name] = "opened"
    except OSError as e:
        out[name] = e.errno
print(json.dumps(out))
"""


def _az(*args: str, config: str, uid: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": TREE}
    argv = [AZ, "--config", config, *args]
    if uid is not None:
        argv = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env,
                          stdin=subprocess.DEVNULL, cwd="/")


def test_cli_up_then_other_uid_is_shut_out():
    base = tempfile.mkdtemp(prefix="azacc-", dir="/tmp")
    os.chmod(base, 0o755)  # the config is readable by everyone; the run directory is not
    run_dir = os.path.join(base, "run")
    config = os.path.join(base, "config.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"device": {"size": "64M", "run_dir": run_dir},
                        "pool": {"swap_out_path": os.path.join(base, "tier")}}, f)
    os.chmod(config, 0o644)
    try:
        up = _az("up", config=config)
        assert up.returncode == 0, up.stdout + up.stderr
        st = os.lstat(run_dir)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
        state = json.loads(Path(run_dir, "state.json").read_text())
        assert "tools" not in state
        for name in os.listdir(run_dir):
            mode = stat.S_IMODE(os.lstat(os.path.join(run_dir, name)).st_mode)
            assert mode & 0o022 == 0, (name, oct(mode))  # nobody else may write any
            if name != "nbdkit.pid":  # nbdkit writes its pid file 0644 whatever the umask
                assert mode & 0o077 == 0, (name, oct(mode))  # nor read or connect
        # the FUSE door (what up picks here) needs no NBD: its socket is gone once the server
        # serves, and its ip filter let nobody in before (issue 27)
        assert state["frontend"] == "fuse" and not os.path.lexists(state["nbd_socket"])
        targets = [state["control_socket"]]
        if state.get("fuse_file"):
            targets.append(state["fuse_file"])
        tier = os.path.join(base, "tier")  # the disk tier, in a directory everyone may search
        st = os.lstat(tier)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        targets.append(tier)
        # another uid: one clear line and exit 2 from status, EACCES on everything (sockets,
        # the device file, the tier file)
        other = _az("status", config=config, uid=NOBODY)
        assert other.returncode == 2, other.stdout + other.stderr
        assert other.stderr.startswith("agentzip-blk: error: ")
        assert "permission denied" in other.stderr and "root" in other.stderr
        assert len(other.stderr.strip().splitlines()) == 1
        stats = _az("stats", config=config, uid=NOBODY)
        assert stats.returncode != 0 and "agentzip-blk: error: " in stats.stderr
        probe = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                                "--clear-groups", "/usr/bin/python3", "-c", PROBE, *targets],
                               capture_output=True, text=True, timeout=60, cwd="/")
        assert json.loads(probe.stdout) == {t: 13 for t in targets}, probe.stderr  # EACCES
        # root: status healthy, the device still served
        mine = _az("status", "--json", config=config)
        assert mine.returncode == 0, mine.stdout + mine.stderr
        assert json.loads(mine.stdout)["attached"] is True
    finally:
        down = _az("down", "--force", config=config)
        if down.returncode != 0:  # the safe order, in-process, before anything is removed
            from agentzip_blk.host import attach
            attach.down(run_dir, force=True, timeout=30)
        if not any(leftovers(run_dir).values()):
            shutil.rmtree(base, ignore_errors=True)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_clean(run_dir)
