"""The holder (host/holder.py) and its protocol (datapath/holding.py), the holder a real
process in a temporary run directory: what a server puts and commits is held, a second
commit closes the first set, bye "shutdown" ends it, strangers and malformed messages are
refused; and a killed server is recovered with the same bytes by a stand-in server
(tests/holder_stub.py), or given up after a few failing ones."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agentzip_blk import procfs
from agentzip_blk.datapath import handover
from agentzip_blk.datapath.holding import HolderClient, HolderError
from agentzip_blk.host.runstate import RunState

STUB = str(Path(__file__).resolve().parents[1] / "holder_stub.py")
HOLDER = "agentzip_blk.host.holder"

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")


def wait_for(what, timeout: float = 30.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


class Run:
    """A run directory under /tmp, the processes a test started in it, and their end."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="azh-", dir="/tmp")
        self.sock = os.path.join(self.dir, "holder.sock")
        self.pids = os.path.join(self.dir, "stub.pids")
        self.procs: list[subprocess.Popen] = []

    def holder(self, *extra: str) -> subprocess.Popen:
        with open(os.path.join(self.dir, "holder.log"), "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", HOLDER, "--run-dir", self.dir,
                                     *extra], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
        self.procs.append(proc)
        wait_for(lambda: os.path.exists(self.sock) or proc.poll() is not None)
        assert proc.poll() is None, self.log()
        return proc

    def stub(self, *keys: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, STUB, f"holder={self.sock}",
                                 f"pids={self.pids}", *keys], stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def recipe(self, *keys: str) -> tuple[list[str], dict[str, str]]:
        return ([sys.executable, STUB, f"holder={self.sock}", f"pids={self.pids}", *keys],
                dict(os.environ))

    def stub_pids(self) -> list[int]:
        with contextlib.suppress(FileNotFoundError):
            return [int(x) for x in Path(self.pids).read_text().split()]
        return []

    def log(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return Path(self.dir, "holder.log").read_text()
        return ""

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for pid in self.stub_pids():  # the holder's children: stubs, each by its pid
            if STUB in (procfs.process_cmdline(pid) or []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def run():
    r = Run()
    try:
        yield r
    finally:
        r.close()


def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    return fd


def held_memfds(pid: int) -> list[str]:
    """The memfd names among ``pid``'s open descriptors."""
    names = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/memfd:"):
                names.append(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
    return sorted(names)


def raw(sock: socket.socket, payload: bytes, fds: list[int] = ()) -> dict:
    """One hand-made message; its reply."""
    head = struct.pack("<Q", len(payload))
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(payload)
    else:
        sock.sendall(head + payload)
    (n,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
    return json.loads(sock.recv(n, socket.MSG_WAITALL))


def test_a_commit_holds_a_set_and_the_next_commit_closes_it(run):
    holder = run.holder()
    first = HolderClient(run.sock)
    assert first.hello(os.getpid())["held"] == []
    fd = memfd("az-first", b"first")
    first.put("pool", fd, {"size": 5})
    os.close(fd)
    first.meta({"fuse_connection": 3})
    first.commit()
    status = first.status()
    assert status["current"] == os.getpid() and status["held"] == ["pool"]
    assert status["tables"] == {"pool": {"size": 5}}
    assert held_memfds(holder.pid) == ["az-first"]

    second = HolderClient(run.sock)
    assert second.hello(os.getpid())["held"] == ["pool"]
    fd = memfd("az-second", b"second")
    second.put("pool", fd, {"size": 6})
    os.close(fd)
    assert held_memfds(holder.pid) == ["az-first", "az-second"]  # staged beside the held
    second.commit()
    assert held_memfds(holder.pid) == ["az-second"]
    with pytest.raises(HolderError, match="another server has committed"):
        first.drop("pool")
    first.close()  # not the current one any more: nothing happens
    assert second.status()["held"] == ["pool"]

    second.bye("shutdown")
    second.close()
    assert holder.wait(10) == 0
    assert not os.path.exists(run.sock)
    assert not os.path.exists(os.path.join(run.dir, "holder.pid"))


def test_put_replaces_a_name_and_drop_closes_it(run):
    holder = run.holder()
    client = HolderClient(run.sock)
    client.hello(os.getpid())
    for name in ("az-a", "az-b"):
        fd = memfd(name, b"x")
        client.put("pool", fd, {})
        os.close(fd)
    assert held_memfds(holder.pid) == ["az-b"]
    client.drop("pool")
    assert held_memfds(holder.pid) == []
    client.close()


def test_malformed_messages_are_refused_and_the_holder_serves_on(run):
    holder = run.holder()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(run.sock)
    assert raw(sock, b"not json") == {"ok": False, "why": "a message that is not JSON"}
    assert raw(sock, b"[1, 2]")["ok"] is False
    assert "unknown op" in raw(sock, b'{"op": "format"}')["why"]
    assert raw(sock, b'{"op": "commit"}') == {"ok": False, "why": "hello first"}
    assert "hello as pid" in raw(sock, json.dumps({"op": "hello", "pid": 1}).encode())["why"]
    assert raw(sock, json.dumps({"op": "hello", "pid": os.getpid()}).encode())["ok"] is True
    a, b = memfd("az-two-a", b"a"), memfd("az-two-b", b"b")
    reply = raw(sock, b'{"op": "put", "name": "pool", "meta": {}}', [a, b])
    assert reply == {"ok": False, "why": "put takes one descriptor, not 2"}
    assert raw(sock, b'{"op": "put", "name": "../x", "meta": {}}', [a])["ok"] is False
    assert raw(sock, b'{"op": "bye", "why": "later"}')["ok"] is False
    assert raw(sock, b'{"op": "respawn", "argv": [], "env": {}}')["ok"] is False
    assert "sockets: paths in" in raw(sock, b'{"op": "respawn", "argv": ["x"], "env": {}, '
                                            b'"sockets": ["/etc/passwd"]}')["why"]
    os.close(a)
    os.close(b)
    assert held_memfds(holder.pid) == []  # refused descriptors are not kept
    # a length over the limit: the stream cannot go on, so the holder says why and hangs up
    sock.sendall(struct.pack("<Q", 2 << 20))
    (n,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
    assert "at most" in json.loads(sock.recv(n, socket.MSG_WAITALL))["why"]
    assert sock.recv(1) == b""
    sock.close()
    client = HolderClient(run.sock)
    assert client.status()["pid"] == holder.pid
    client.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as uid 65534")
def test_a_peer_of_another_uid_is_refused(run):
    holder = run.holder()
    # open the way for uid 65534, so that the holder's own check is what refuses it
    os.chmod(run.dir, 0o711)
    os.chmod(run.sock, 0o666)
    probe = ("import json, socket, struct\n"
             "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
             "s.settimeout(10)\n"
             f"s.connect({run.sock!r})\n"  # refused at once: nothing to send
             "n, = struct.unpack('<Q', s.recv(8, socket.MSG_WAITALL))\n"
             "print(s.recv(n, socket.MSG_WAITALL).decode())\n")
    r = subprocess.run(["/usr/bin/python3", "-c", probe], user=65534, group=65534,
                       extra_groups=[], capture_output=True, text=True, timeout=30,
                       cwd="/")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ok": False, "why": "permission denied"}
    assert holder.poll() is None and "refused pid" in run.log()


def test_the_client_refuses_a_path_that_is_not_a_socket(run):
    path = os.path.join(run.dir, "plain")
    Path(path).write_text("")
    with pytest.raises(HolderError, match="not a socket"):
        HolderClient(path)


def first_server(run: Run, content: bytes, mode: str = "serve",
                 tables: int = 0) -> subprocess.Popen:
    ready = os.path.join(run.dir, "first.ready")
    proc = run.stub(f"content={content.hex()}", f"ready={ready}", f"mode={mode}",
                    f"tables={tables}")
    wait_for(lambda: os.path.exists(ready) or proc.poll() is not None)
    assert os.path.exists(ready), "the first stub did not commit"
    return proc


def save_state(run: Run, pid: int) -> None:
    RunState(run_dir=run.dir, plugin="/x/nbdkit_plugin.py",
             nbd_socket=os.path.join(run.dir, "nbd.sock"), frontend="fuse",
             nbdkit_pid=pid).save()


def test_a_killed_server_is_recovered_with_what_it_held(run):
    holder = run.holder("--wait", "20")
    content = os.urandom(3000)
    server = first_server(run, content, tables=24)  # 25 descriptors: as many as a store's
    save_state(run, server.pid)
    out, ready = os.path.join(run.dir, "recovered.json"), os.path.join(run.dir, "rec.ready")
    client = HolderClient(run.sock)
    stale = os.path.join(run.dir, "nbd.sock")  # a dead nbdkit's, in the new one's way
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(stale)
    client.respawn(*run.recipe(f"out={out}", f"ready={ready}", "takeover=stale"), [stale])

    server.kill()  # SIGKILL: no bye
    server.wait(10)
    wait_for(lambda: client.status()["recoveries"] == 1)
    got = json.loads(Path(out).read_text())
    header = got["header"]
    names = ["pool"] + [f"table{i}" for i in range(24)]
    assert header == {"format": handover.FORMAT, "recover": True, "recoveries": 1,
                      "meta": {"fuse_connection": 7}, "names": names,
                      "tables": {"pool": {"size": len(content)},
                                 **{f"table{i}": {"rows": i + 1} for i in range(24)}}}
    assert got["contents"] == {"pool": content.hex(),
                               **{f"table{i}": (bytes([i]) * (i + 1)).hex() for i in range(24)}}
    status = client.status()
    assert status["current"] == got["pid"] and status["held"] == names
    # the same memfds, held again (each once: the dead server's set was replaced)
    assert held_memfds(holder.pid) == sorted(["az-stub"] + [f"az-table{i}" for i in range(24)])
    state = RunState.load(run.dir)
    assert state.nbdkit_pid == got["pid"] and state.recoveries == 1
    assert f"takeover_pid={holder.pid}" in procfs.process_cmdline(got["pid"])
    assert "takeover=stale" not in procfs.process_cmdline(got["pid"])
    assert not os.path.exists(stale)
    client.close()


def test_a_failing_server_is_retried_then_given_up(run):
    holder = run.holder("--attempts", "2", "--backoff", "0.05", "--wait", "10")
    server = first_server(run, b"pages")
    client = HolderClient(run.sock)
    client.respawn(*run.recipe(f"out={os.path.join(run.dir, 'out.json')}", "mode=fail"))
    server.kill()
    server.wait(10)
    wait_for(lambda: "recovery failed: `agentzip-blk down --force`" in run.log())
    started = [pid for pid in run.stub_pids() if pid != server.pid]
    assert len(started) == 2, run.log()
    assert run.log().count("the stub was told to fail") == 2, run.log()
    assert not any(STUB in (procfs.process_cmdline(pid) or []) for pid in started)
    status = client.status()  # it keeps everything: the pages are not lost
    assert status["current"] is None and status["held"] == ["pool"]
    assert held_memfds(holder.pid) == ["az-stub"]
    client.close()


def test_after_a_handover_bye_without_a_commit_the_holder_recovers(run):
    run.holder("--wait", "0.5")
    out = os.path.join(run.dir, "recovered.json")
    client = HolderClient(run.sock)
    client.respawn(*run.recipe(f"out={out}"))
    server = first_server(run, b"handed", mode="handover")
    server.wait(10)
    wait_for(lambda: client.status()["recoveries"] == 1)
    assert "waiting up to 0.5 s for the next server" in run.log()
    assert json.loads(Path(out).read_text())["contents"] == {"pool": b"handed".hex()}
    client.close()


def test_a_handover_whose_successor_commits_recovers_nothing(run):
    holder = run.holder("--wait", "30")
    client = HolderClient(run.sock)
    client.respawn(*run.recipe(f"out={os.path.join(run.dir, 'recovered.json')}"))
    server = first_server(run, b"old", mode="handover")
    server.wait(10)
    wait_for(lambda: "after bye (handover)" in run.log())  # the old one is gone, not replaced
    successor = HolderClient(run.sock)
    successor.hello(os.getpid())
    fd = memfd("az-successor", b"new")
    successor.put("pool", fd, {"size": 3})
    os.close(fd)
    successor.commit()
    assert held_memfds(holder.pid) == ["az-successor"]
    wait_for(lambda: "committed: nothing to recover" in run.log())
    assert client.status()["recoveries"] == 0
    successor.bye("shutdown")
    successor.close()
    assert holder.wait(10) == 0
    client.close()


def test_a_handover_whose_successor_leaves_without_a_commit_is_recovered(run):
    run.holder("--wait", "600")  # not waited for: the successor's end says enough
    client = HolderClient(run.sock)
    client.respawn(*run.recipe(f"out={os.path.join(run.dir, 'recovered.json')}"))
    server = first_server(run, b"old", mode="handover")
    successor = HolderClient(run.sock)
    successor.hello(os.getpid())
    server.wait(10)
    wait_for(lambda: "for the next server to commit" in run.log())
    successor.close()
    wait_for(lambda: client.status()["recoveries"] == 1)
    client.close()


def test_a_server_that_drops_its_connection_is_not_replaced_while_it_runs(run):
    run.holder("--wait", "20")
    out = os.path.join(run.dir, "recovered.json")
    client = HolderClient(run.sock)
    client.respawn(*run.recipe(f"out={out}"))
    server = first_server(run, b"alive", mode="drop")
    wait_for(lambda: "still runs: waiting for it to exit first" in run.log())
    assert client.status()["recoveries"] == 0 and not os.path.exists(out)
    server.kill()
    server.wait(10)
    wait_for(lambda: client.status()["recoveries"] == 1)
    client.close()
