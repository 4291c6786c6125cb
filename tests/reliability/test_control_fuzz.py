"""Hostile input on the control socket: malformed JSON, random bytes, unknown verbs, odd
arguments to real verbs, very long lines, deep nesting, clients that hang up mid-reply,
idle clients, and many concurrent clients, all while NBD traffic goes on. Every request
line gets exactly one JSON reply; the server never dies; the data stays intact."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from agentzip_blk.datapath.control import MAX_LINE

from . import support
from .conftest import skip_reason
from .support import PAGE, make_pages

pytestmark = pytest.mark.skipif(skip_reason("nbdkit") is not None,
                                reason=str(skip_reason("nbdkit")))

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("AGENTZIP_FUZZ_EXAMPLES", "120"))
VERBS = ["stats", "ping", "defrag", "reclaim", "slots"]
tried = {"n": 0}


class Conn:
    """A raw client: send bytes, read reply lines."""

    def __init__(self, path: str, timeout: float = 30) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.stream = self.sock.makefile("rb")

    def ask(self, line: bytes) -> dict:
        self.sock.sendall(line + b"\n")
        return self.reply()

    def reply(self) -> dict:
        raw = self.stream.readline()
        assert raw.endswith(b"\n"), f"no reply line (got {raw[:200]!r})"
        reply = json.loads(raw)
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        if not reply["ok"]:
            assert isinstance(reply.get("error"), str) and reply["error"]
        return reply

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("control")
    with support.server(tmp, size="16M") as server:
        pages = make_pages(256, seed=7)
        h = support.nbd_client(server.nbd_socket)
        h.pwrite(b"".join(pages), 0)
        h.shutdown()
        yield server
        h = support.nbd_client(server.nbd_socket)
        try:
            lost = support.pages_differing(h.pread(len(pages) * PAGE, 0), b"".join(pages))
        finally:
            h.shutdown()
        support.record("control_fuzz", hostile_inputs=tried["n"],
                       bytes_verified=(len(pages) - lost) * PAGE, data_lost=lost)
        assert lost == 0, f"control traffic hurt {lost} pages"
        assert server.proc.poll() is None, server.log_text()[-2000:]


def alive(srv) -> None:
    assert srv.proc.poll() is None, f"nbdkit died: {srv.log_text()[-2000:]}"
    assert support.request(srv.control_socket, "ping")["pid"] == srv.proc.pid


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10),
                                                                      children, max_size=6),
    max_leaves=30)
requests = st.dictionaries(st.text(max_size=12), json_values, max_size=5).flatmap(
    lambda extra: st.builds(lambda cmd, extra=extra: {**extra, "cmd": cmd},
                            st.sampled_from(VERBS) | st.text(max_size=20) | json_values))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(requests, min_size=1, max_size=4))
def test_json_requests_get_one_reply_each(srv, reqs):
    conn = Conn(srv.control_socket)
    try:
        for req in reqs:
            reply = conn.ask(json.dumps(req).encode())
            tried["n"] += 1
            if req["cmd"] not in VERBS:
                assert reply["ok"] is False
                if isinstance(req["cmd"], str):
                    assert "unknown command" in reply["error"]
    finally:
        conn.close()
    alive(srv)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")), min_size=1,
                max_size=5))
def test_random_bytes_get_an_error_reply(srv, lines):
    conn = Conn(srv.control_socket)
    try:
        for line in lines:
            reply = conn.ask(line)
            tried["n"] += 1
            try:
                valid = isinstance(json.loads(line), dict)
            except (ValueError, UnicodeDecodeError, RecursionError):
                valid = False
            if not valid:
                assert reply["ok"] is False
    finally:
        conn.close()
    alive(srv)


@pytest.mark.parametrize("line", [
    b"{not json", b"", b"   ", b"null", b"[]", b'"stats"', b"{}", b'{"cmd": 5}',
    b'{"cmd": null}', b'{"cmd": ["stats"]}', b'{"cmd": "STATS"}', b'{"cmd": "stats\\u0000"}',
    b'{"cmd": "no-such-verb"}', b"\xff\xfe\x00", b'{"cmd": "stats"', b"NaN", b"1e999",
    b'{"cmd": "slots", "slots": "all"}', b'{"cmd": "slots", "slots": [1e400]}',
    b'{"cmd": "slots", "slots": [99999999999999999999999]}', b'{"cmd": "slots", "slots": [true]}',
    b'{"cmd": "slots", "slots": [-1, -9223372036854775808]}',
    b'{"cmd": "slots"}', b'{"cmd": "defrag", "x": {"y": [1, 2, {"z": null}]}}',
    # nesting deep enough for RecursionError in json.loads, short enough to be read whole
    b"[" * 50_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000, b'{"cmd": "stats", "x": ' + b"[" * 40_000,
])
def test_malformed_lines(srv, line):
    conn = Conn(srv.control_socket)
    try:
        reply = conn.ask(line)
        tried["n"] += 1
    finally:
        conn.close()
    if line not in (b'{"cmd": "slots", "slots": [-1, -9223372036854775808]}',
                    b'{"cmd": "defrag", "x": {"y": [1, 2, {"z": null}]}}'):
        assert reply["ok"] is False, reply
    alive(srv)


@pytest.mark.parametrize("length", [MAX_LINE, MAX_LINE + 1, 4 * MAX_LINE, 16 << 20])
def test_very_long_lines(srv, length):
    """The server stops reading at MAX_LINE, answers with an error and hangs up; the client
    may still be sending the rest (EPIPE on our side is fine)."""
    conn = Conn(srv.control_socket)
    body = b'{"cmd": "stats", "pad": "' + b"x" * length + b'"}'

    def send():
        try:
            conn.sock.sendall(body + b"\n")
        except OSError:
            pass

    sender = threading.Thread(target=send)
    sender.start()
    try:
        reply = conn.reply()
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)
        sender.join()
        conn.close()
    tried["n"] += 1
    assert reply["ok"] is False and "longer than" in reply["error"]
    alive(srv)


def test_clients_hanging_up_mid_reply(srv):
    """A big reply (slots for 1M slots) to clients that close at once: the server's writes
    fail with EPIPE, which must not kill it (no SIGPIPE death)."""
    big = json.dumps({"cmd": "slots", "slots": list(range(1 << 20))}).encode()
    assert len(big) < 64 << 20
    for _ in range(5):
        s = socket.socket(socket.AF_UNIX)
        s.connect(srv.control_socket)
        s.sendall(b'{"cmd": "stats"}\n')
        s.close()
        tried["n"] += 1
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX)
        s.connect(srv.control_socket)
        s.sendall(b'{"cmd": "slots", "slots": ' + json.dumps(list(range(10000))).encode() + b"}\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # reset
        tried["n"] += 1
    alive(srv)


def test_idle_clients_do_not_block_others(srv):
    idle = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX)
            s.connect(srv.control_socket)
            s.sendall(b'{"cmd": "st')  # half a request, then silence
            idle.append(s)
        tried["n"] += len(idle)
        assert support.request(srv.control_socket, "stats", timeout=30)["size"] == 16 << 20
    finally:
        for s in idle:
            s.close()
    alive(srv)


@pytest.mark.slow
def test_concurrent_clients_with_io(srv):
    """16 clients x 40 requests of every verb and some garbage, with NBD writes and reads
    verified at the same time."""
    errors: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        try:
            conn = Conn(srv.control_socket)
            for j in range(40):
                kind = (i + j) % 7
                if kind < 5:
                    req = {"cmd": VERBS[kind]}
                    if VERBS[kind] == "slots":
                        req["slots"] = list(range(j, 4096, 13))
                    reply = conn.ask(json.dumps(req).encode())
                    if not reply["ok"]:
                        errors.append(f"{req['cmd']}: {reply['error']}")
                elif kind == 5:
                    assert conn.ask(b"garbage %d" % j)["ok"] is False
                else:
                    assert conn.ask(b'{"cmd": "nope"}')["ok"] is False
                tried["n"] += 1
            conn.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    def io() -> None:
        h = support.nbd_client(srv.nbd_socket)
        n = 0
        try:
            while not stop.is_set():
                data = b"".join(make_pages(16, seed=1000 + n % 50, mix="tr"))
                off = (512 + (n % 64) * 16) * PAGE
                h.pwrite(data, off)
                if h.pread(len(data), off) != data:
                    errors.append(f"io: read back differs at {off}")
                n += 1
        finally:
            h.shutdown()

    io_thread = threading.Thread(target=io)
    io_thread.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    io_thread.join()
    assert errors == []
    alive(srv)
