"""Where the FUSE front door serves the kernel, nothing serves NBD (issue 27, item 2): the
socket nbdkit must listen on lets nobody in, root included (its ip filter: deny=all), and
`up` removes it once the server serves, so that no container that mounts the run directory
can read every page over NBD."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentzip_blk import procfs
from agentzip_blk.host import facts
from agentzip_blk.host.servercmd import peer_filter_args
from host.test_device import assert_clean, leftovers

AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
TREE = str(Path(__file__).resolve().parents[2])

needs_nbdkit = pytest.mark.skipif(bool(facts.missing_tools(["nbdkit"])), reason="no nbdkit")


@needs_nbdkit
def test_the_fuse_doors_nbd_filter_turns_root_away(tmp_path):
    import nbd

    opts, keys = peer_filter_args(nbd_clients=False)
    sock = str(tmp_path / "nbd.sock")
    proc = subprocess.Popen(["nbdkit", "-f", "-U", sock, *opts, "memory", "size=1M", *keys],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.02)
        h = nbd.NBD()
        with pytest.raises(nbd.Error):
            h.connect_unix(sock)  # as root, the server's own uid
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "not permitted to connect" in err


@pytest.mark.swap
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)")
@pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                              "fusermount3"])), reason="tools missing")
@pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed")
def test_up_with_the_fuse_door_leaves_no_nbd_socket(tmp_path):
    run_dir = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"device": {"size": "64M", "run_dir": run_dir,
                                                 "frontend": "fuse"},
                                      "pool": {"swap_out_path": str(tmp_path / "tier")}}))
    env = {**os.environ, "PYTHONPATH": TREE}

    def az(*args):
        return subprocess.run([AZ, "--config", str(config), *args], capture_output=True,
                              text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)

    try:
        up = az("up")
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads(Path(run_dir, "state.json").read_text())
        assert not os.path.lexists(state["nbd_socket"]), "an NBD socket in the run directory"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, \
                pytest.raises(FileNotFoundError):
            s.connect(state["nbd_socket"])  # a unix socket is reached by its path alone
        assert sorted(os.listdir(run_dir)) == sorted(
            ["config.yaml", "control.sock", "holder.log", "holder.pid", "holder.sock", "lock",
             "mnt", "nbdkit.log", "nbdkit.pid", "state.json"]), \
            "something else to connect to in the run directory?"
        # the holder's socket (host.holder) is root's alone, as control.sock
        assert stat.S_IMODE(os.lstat(Path(run_dir, "holder.sock")).st_mode) == 0o600
        argv = procfs.process_cmdline(state["nbdkit_pid"])
        assert "deny=all" in argv and not any(a.startswith("allow=") for a in argv), argv
        status = json.loads(az("status", "--json").stdout)
        assert status["healthy"] is True and status["server"]["socket"] is None
    finally:
        down = az("down", "--force")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(leftovers(run_dir).values())
    assert_clean(run_dir)
