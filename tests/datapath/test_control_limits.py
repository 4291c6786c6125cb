"""What a member of device.control_group can cost the server (issue 27, item 2): a bounded
number of connections (a thread each), never root's, and no stats scan under the store lock
more often than GROUP_STATS_MIN_AGE. The real server, the members real processes of another
uid (setpriv), as in test_access."""

from __future__ import annotations

import json
import subprocess

import pytest

from agentzip_blk.datapath import control
from agentzip_blk.datapath.server import GROUP_STATS_MIN_AGE
from datapath.test_access import NOBODY, ask, pytestmark, serve  # noqa: F401 (the fixture)

MEMBER = {"uid": NOBODY, "gid": NOBODY}

# Opens N idle connections, says so, waits for a line on stdin, then asks once more.
HOLDER = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    held.append(s)
print("held", flush=True)
sys.stdin.readline()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(path)
try:
    s.sendall(b'{"cmd": "ping"}\n')
except BrokenPipeError:  # over the cap in a flood: the "busy" reply came, then the close
    pass
line = s.makefile("rb").readline()
print(json.dumps(json.loads(line) if line else None), flush=True)
"""


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_the_groups_connections_are_capped_and_root_still_gets_in(serve):
    srv = serve(group="nogroup")
    base = _threads(srv.proc.pid)
    holder = subprocess.Popen(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                               "--clear-groups", "/usr/bin/python3", "-c", HOLDER,
                               srv.control, "100"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert holder.stdout.readline().strip() == "held"
        # 100 connections open: served by at most MAX_UNPRIVILEGED threads (+ the refuser)
        assert _threads(srv.proc.pid) <= base + control.MAX_UNPRIVILEGED + 1
        # root is not among them: status and down still get in
        assert control.request(srv.control, "ping")["pid"] == srv.proc.pid
        assert control.request(srv.control, "health")["pid"] == srv.proc.pid
        # one more of the group's is turned away with a reason
        holder.stdin.write("\n")
        holder.stdin.flush()
        reply = json.loads(holder.stdout.readline())
        assert reply["ok"] is False and reply["error"].startswith("busy"), reply
    finally:
        holder.kill()
        holder.wait()
    stats = control.request(srv.control, "stats")
    assert stats["server"]["control_busy"] >= 100 - control.MAX_UNPRIVILEGED
    assert "connection(s) refused so far" in srv.log_text()
    # the group's connections closed: a member is served again
    assert ask(srv.control, "ping", **MEMBER)["reply"]["ok"] is True


ASK_STATS = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(b'{"cmd": "stats", "max_age": 0}\n')
print(json.dumps(json.loads(s.makefile("rb").readline())))
"""


def _member_stats(path: str) -> dict:
    r = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                        "--clear-groups", "/usr/bin/python3", "-c", ASK_STATS, path],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_the_group_cannot_force_a_scan_per_request(serve):
    srv = serve(group="nogroup")
    fresh = control.request(srv.control, "stats", max_age=0)  # root may force one
    assert fresh["snapshot"]["age_s"] == 0.0
    ages = []
    for _ in range(3):
        reply = _member_stats(srv.control)
        assert reply["ok"] is True
        assert reply["snapshot"]["max_age_s"] == GROUP_STATS_MIN_AGE
        ages.append(reply["snapshot"]["age_s"])
    # the snapshot root's request took, getting older: no scan of the group's own
    assert 0 < ages[0] <= ages[1] <= ages[2] < GROUP_STATS_MIN_AGE, ages


def test_a_client_turned_away_before_it_sent_still_reads_why(tmp_path):
    """A server over its cap may answer "busy" and close before the client has sent its
    request (the flood path of ControlServer._busy_loop): the client's send then fails with
    EPIPE, and `control.request` still reads the reply and reports its reason."""
    import socket
    import threading

    path = str(tmp_path / "control.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def answer_and_close() -> None:
        conn, _ = listener.accept()
        conn.sendall(json.dumps({"ok": False, "protocol": control.PROTOCOL,
                                 "error": "busy: too many control connections open"}).encode()
                     + b"\n")
        conn.shutdown(socket.SHUT_WR)
        conn.close()

    server = threading.Thread(target=answer_and_close)
    server.start()
    try:
        # a request larger than the socket's buffer: its send meets the closed peer
        with pytest.raises(control.ControlError, match="busy: too many control connections"):
            control.request(path, "slots", slots=list(range(1 << 18)))
    finally:
        server.join(10)
        listener.close()
