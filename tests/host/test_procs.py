"""Start-up failures of the server reach the operator as one line, not nbdkit's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentzip_blk.host.procs import our_error

ROOT = Path(__file__).resolve().parents[2]

TRACEBACK = """\
nbdkit: error: /x/nbdkit/agentzip_plugin.py: config_complete: error: Traceback (most recent call last):
   File "/x/nbdkit/agentzip_plugin.py", line 58, in config_complete
    _server = Server.from_keys(_keys)
 agentzip_blk.store.disk.DiskError: /var/lib/agentzip/swapfile is a symbolic link: refusing it
nbdkit: error: /x/nbdkit/agentzip_plugin.py: config_complete failed
"""


def test_our_error_is_the_last_line_of_the_plugins_traceback():
    assert our_error(TRACEBACK) == "/var/lib/agentzip/swapfile is a symbolic link: refusing it"
    assert our_error("nbdkit: error: cannot open socket: Address in use\n") is None
    assert our_error("") is None


@pytest.mark.swap
@pytest.mark.skipif(os.geteuid() != 0, reason="root: up")
def test_up_with_a_refused_tier_file_says_why_in_one_line(tmp_path):
    """The installed CLI, its own process: the server refuses a planted symlink at the tier
    path, and `up` says so on one line (exit 2), leaving nothing attached."""
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    link = tmp_path / "swapfile"
    link.symlink_to(target)
    config = tmp_path / "config.yaml"
    config.write_text(f"pool:\n  swap_out_path: {link}\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "agentzip_blk.cli", "--config", str(config), "--run-dir", str(run_dir)]
    try:
        r = subprocess.run([*cli, "up", "--size", "64M"], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agentzip-blk: error: "), r.stderr
        assert "refused to start" in lines[0] and "symbolic link" in lines[0], lines[0]
        assert "Traceback" not in r.stderr
        assert target.read_bytes() == b"precious" and link.is_symlink()
        with open("/proc/swaps") as f:
            assert str(run_dir) not in f.read()
    finally:
        subprocess.run([*cli, "down", "--force"], capture_output=True, timeout=120, env=env)


def test_a_process_whose_leader_is_a_zombie_is_alive_while_a_thread_runs():
    """A killed process's leader turns zombie while its other threads still exit, and its
    descriptors (a tier file's lock) stay open until the last one has: `pid_alive` counts
    threads. Here the leader leaves by pthread_exit while a thread sleeps on."""
    import signal
    import time

    from agentzip_blk import procfs
    from agentzip_blk.host.procs import pid_alive, wait_gone

    child = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, threading, time\n"
         "threading.Thread(target=time.sleep, args=(60,)).start()\n"
         "print('up', flush=True)\n"
         "ctypes.CDLL(None).pthread_exit(None)\n"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while procfs.process_state(child.pid) != "Z":
            assert time.monotonic() < deadline, procfs.thread_states(child.pid)
            time.sleep(0.02)
        assert set(procfs.thread_states(child.pid)) - {"Z", "X"}  # the thread runs on
        assert pid_alive(child.pid)  # was False: the leader's state alone
        os.kill(child.pid, signal.SIGKILL)
        assert wait_gone(child.pid, 10.0)
    finally:
        child.kill()
        child.wait()
