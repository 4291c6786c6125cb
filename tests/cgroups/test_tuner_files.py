"""The tuner's pid, lock and log files in the run directory are root's: created 0600 and
never opened through a symbolic link (issue 27, item 1). A link planted there by whoever can
write the run directory must not make root's tuner truncate, write or append to its target.
`tune` runs as its own process of the CLI, on a fake cgroup v2 tree."""

from __future__ import annotations

import os
import stat
import time

import pytest

from agentzip_blk.cgroups.tuner import daemon
from agentzip_blk.host import procs
from cgfake import fake_v2, w
from cli.clirun import one_error_line, run

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

SANDBOX = "/agents/agent-sandbox-1.slice"


@pytest.fixture
def tree(tmp_path):
    root, _ = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}})
    w(str(tmp_path / "config.yaml"), "scopes: []\n")
    (tmp_path / "run").mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    return root, victim


def _tune(tmp_path, root):
    return run("--config", tmp_path / "config.yaml", "--run-dir", tmp_path / "run", "tune",
               "--cgroup-tree", root, "--without-device", "--steps", "1", "--interval", "0.01")


@pytest.mark.parametrize("name", [daemon.TUNER_PID, daemon.TUNER_LOCK])
def test_a_planted_link_is_refused_and_its_target_kept(tmp_path, tree, name):
    root, victim = tree
    (tmp_path / "run" / name).symlink_to(victim)
    res = _tune(tmp_path, root)
    assert victim.read_bytes() == b"precious\n"
    assert res.returncode == 2, res.stdout + res.stderr
    assert name in one_error_line(res.stderr)


def test_the_files_are_0600_whatever_the_umask(tmp_path, tree):
    root, _ = tree
    old = os.umask(0o022)
    try:
        pid = daemon.start_daemon(str(tmp_path / "run"), str(tmp_path / "config.yaml"),
                                  ["--cgroup-tree", root, "--without-device", "--steps", "40",
                                   "--interval", "0.05"])
    finally:
        os.umask(old)
    deadline = time.monotonic() + 30
    while procs.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for name in (daemon.TUNER_LOG, daemon.TUNER_LOCK):
        mode = stat.S_IMODE(os.lstat(tmp_path / "run" / name).st_mode)
        assert mode == 0o600, (name, oct(mode))


def test_a_planted_log_link_is_not_appended_to(tmp_path, tree):
    root, victim = tree
    (tmp_path / "run" / daemon.TUNER_LOG).symlink_to(victim)
    with pytest.raises(OSError):
        daemon.start_daemon(str(tmp_path / "run"), str(tmp_path / "config.yaml"),
                            ["--cgroup-tree", root, "--without-device", "--steps", "1",
                             "--interval", "0.01"])
    time.sleep(1.0)  # a tuner started anyway would have logged by now
    assert victim.read_bytes() == b"precious\n"
