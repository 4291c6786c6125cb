"""teardown touches only a device shown to be its own (issue 27, item 1): state.json is a file
that anyone who can write the run directory can edit, so it cannot make `down` disconnect a
/dev/nbdN that `up` did not attach. No nbd driver here: sysfs is faked for the one device,
and the tools are recorded instead of run."""

from __future__ import annotations

import os

import pytest

from agentzip_blk.host import chain
from agentzip_blk.host.runstate import RunState


@pytest.fixture
def nbd3_connected(monkeypatch):
    """/dev/nbd3 is connected (its sysfs pid file exists) to someone else's nbd-client."""
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists",
                        lambda p: p == "/sys/block/nbd3/pid" or real(p))
    ran: list[list[str]] = []
    monkeypatch.setattr(chain, "run_tool", lambda argv, **kw: ran.append(list(argv)) or "")
    return ran


def _state(tmp_path) -> RunState:
    return RunState(run_dir=str(tmp_path), plugin="memory",
                    nbd_socket=str(tmp_path / "nbd.sock"), mode="nbd", frontend="nbd",
                    nbd_device="/dev/nbd3", device="/dev/nbd3")


def test_a_state_naming_an_nbd_device_up_did_not_attach_is_refused(tmp_path, nbd3_connected):
    with pytest.raises(chain.NotOurs, match="/dev/nbd3.*refusing"):
        chain.teardown(_state(tmp_path), timeout=5)
    assert not any("nbd-client" in os.path.basename(a[0]) for a in nbd3_connected), nbd3_connected


def test_the_device_the_server_serves_is_disconnected(tmp_path, nbd3_connected):
    chain.teardown(_state(tmp_path), timeout=5, served="/dev/nbd3")
    assert [a[1:] for a in nbd3_connected if "nbd-client" in a[0]] == [["-d", "/dev/nbd3"]]


def test_another_device_than_the_server_serves_is_refused(tmp_path, nbd3_connected):
    with pytest.raises(chain.NotOurs, match="/dev/nbd3"):
        chain.teardown(_state(tmp_path), timeout=5, served="/dev/nbd0")
    assert nbd3_connected == []


def test_ups_own_rollback_is_trusted(tmp_path, nbd3_connected):
    chain.teardown(_state(tmp_path), timeout=5, trusted=True)
    assert [a[1:] for a in nbd3_connected if "nbd-client" in a[0]] == [["-d", "/dev/nbd3"]]
