"""The holder in the host's commands (host/holder.py's CLI side, chain, attach, health): `up`
starts it and gives it the server's recipe, `down --force` kills it before the server (it
would start the server again, and while it holds the FUSE connection a dead server's reads
wait instead of failing), `status` names it. A real holder process; the server is a
stand-in whose command line `down` takes for nbdkit's."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile

import pytest

from agentzip_blk.datapath.holding import HolderClient
from agentzip_blk.host import attach, chain, health, holder, procs
from agentzip_blk.host.runstate import RunState
from agentzip_blk.host.servercmd import default_plugin_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="down needs root")


@pytest.fixture
def run_dir():
    path = tempfile.mkdtemp(prefix="azh-", dir="/tmp")
    started: list[int] = []
    try:
        yield path, started
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            procs.wait_gone(pid, 10.0)
        shutil.rmtree(path, ignore_errors=True)


def fake_server(run_dir: str, started: list[int]) -> subprocess.Popen:
    """A process whose command line is nbdkit's with our NBD socket (procs.ours_alive)."""
    proc = subprocess.Popen(["nbdkit", "-c", "import time; time.sleep(600)",
                             os.path.join(run_dir, "nbd.sock")], executable="/usr/bin/python3",
                            stdin=subprocess.DEVNULL, start_new_session=True)
    started.append(proc.pid)
    return proc


def state_of(run_dir: str, **kw) -> RunState:
    state = RunState(run_dir=run_dir, plugin=default_plugin_path(),
                     nbd_socket=os.path.join(run_dir, "nbd.sock"),
                     control_socket=os.path.join(run_dir, "control.sock"),  # nobody answers
                     mode="fuse", frontend="fuse", **kw)
    state.save()
    return state


def test_down_force_kills_the_holder_before_the_server(run_dir, monkeypatch):
    path, started = run_dir
    server = fake_server(path, started)
    hpid = holder.start(path, 10.0)
    started.append(hpid)
    state_of(path, nbdkit_pid=server.pid, holder_pid=hpid)
    assert chain.liveness(RunState.load(path))["holder"]
    killed: list[int] = []
    kill = os.kill

    def recording(pid: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            killed.append(pid)
        kill(pid, sig)

    monkeypatch.setattr(os, "kill", recording)
    res = attach.down(path, force=True, timeout=10.0)
    assert res["server_lost"] is True
    assert killed == [hpid, server.pid]
    server.wait(10)
    assert not procs.pid_alive(hpid)
    for name in (holder.SOCKET, holder.PIDFILE, "state.json"):
        assert not os.path.exists(os.path.join(path, name))


def test_down_force_without_a_state_file_stops_the_holder(run_dir):
    path, started = run_dir
    hpid = holder.start(path, 10.0)
    started.append(hpid)
    assert holder.pid_of(path) == hpid
    res = attach.down(path, force=True, timeout=10.0)
    assert res["holder_stopped"] == hpid
    assert procs.wait_gone(hpid, 10.0)
    assert not os.path.exists(holder.socket_path(path))


def test_stop_kills_a_holder_that_no_server_said_bye_to(run_dir):
    path, started = run_dir
    hpid = holder.start(path, 10.0)
    started.append(hpid)
    holder.stop(hpid, path, 0.2)
    assert not procs.pid_alive(hpid) and holder.pid_of(path) is None
    assert not os.path.exists(holder.socket_path(path))
    holder.stop(hpid, path)  # gone already: nothing to do


def test_stop_takes_the_servers_the_holder_started_with_it(run_dir):
    """A server the holder started for a recovery (its command line names the holder's pid
    and recover socket) would outlive the holder, holding the store and the tier file's lock:
    `stop` kills it too, and nothing else."""
    path, started = run_dir
    hpid = holder.start(path, 10.0)
    started.append(hpid)
    marks = [f"takeover={os.path.join(path, holder.RECOVER_SOCKET)}", f"takeover_pid={hpid}"]
    sleeper = ["-c", "import time; time.sleep(600)"]
    recovering = subprocess.Popen(["nbdkit", *sleeper, *marks], executable="/usr/bin/python3",
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    other = subprocess.Popen(["nbdkit", *sleeper, marks[0], "takeover_pid=1"],
                             executable="/usr/bin/python3", stdin=subprocess.DEVNULL,
                             start_new_session=True)
    started += [recovering.pid, other.pid]
    assert holder.recovering_servers(hpid, path) == [recovering.pid]
    holder.stop(hpid, path, 0.0)
    assert not procs.pid_alive(recovering.pid)  # (stop reaped it: it is our child here)
    assert other.poll() is None  # another holder's, or nobody's: not ours to stop


def test_up_starts_the_holder_and_gives_it_the_recipe(run_dir, monkeypatch):
    path, started = run_dir
    state = state_of(path)
    monkeypatch.setattr(chain, "holder_wanted", lambda state: True)
    keys = chain.start_holder(state, 10.0)
    started.append(state.holder_pid)
    assert keys == [f"holder={path}/holder.sock"]
    assert RunState.load(path).holder_pid == state.holder_pid
    assert holder.is_holder(state.holder_pid, path)
    assert not holder.is_holder(state.holder_pid, path + "/other")
    argv = ["nbdkit", "-f", "python", "plugin.py", "takeover=/x", "takeover_pid=1"]
    holder.give_recipe(path, argv, {"PATH": "/usr/bin"}, 10.0)
    client = HolderClient(holder.socket_path(path))
    assert client.status()["recipe"] is True
    client.close()
    assert "respawn recipe" in open(os.path.join(path, holder.LOG)).read()
    assert "takeover" not in open(os.path.join(path, holder.LOG)).read()

    out = health.status(path)
    # holding nothing yet: nothing pinned, no error
    assert out["server"]["holder"] == {"pid": state.holder_pid, "alive": True, "committed": None,
                                       "pinned_bytes": 0, "pin_errors": []}
    assert out["server"]["recoveries"] == 0


def test_the_holder_goes_with_the_fuse_door_of_our_plugin_only(run_dir):
    path, _ = run_dir
    for frontend, plugin in (("nbdfuse", default_plugin_path()), ("nbd", default_plugin_path()),
                             ("fuse", "memory")):
        state = RunState(run_dir=path, plugin=plugin, nbd_socket=os.path.join(path, "nbd.sock"),
                         frontend=frontend)
        assert not chain.holder_wanted(state)
        assert chain.start_holder(state, 1.0) == []


def test_a_second_holder_on_one_run_dir_is_refused(run_dir):
    path, started = run_dir
    started.append(holder.start(path, 10.0))
    with pytest.raises(Exception, match="another holder listens"):
        holder.start(path, 10.0)
