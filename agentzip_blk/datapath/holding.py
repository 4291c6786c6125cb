"""The holder's protocol, and the client the server speaks it with (docs/ARCHITECTURE.md,
"The holder").

The holder (host/holder.py) is a small process apart from the server that keeps the
server's descriptors (the /dev/fuse connection, the store's memfds) and a little JSON about
them, so that they outlive a crash of the server; it then starts a new server and offers it
what it holds (datapath/handover.py). It runs no store code.

Framing: each message is an 8-byte little-endian length, then that many bytes of JSON (an
object). Descriptors, when a message has any, ride with the length bytes (SCM_RIGHTS).
Every request gets one reply: ``{"ok": true, ...}`` or ``{"ok": false, "why": "..."}``.
At most MAX_MESSAGE bytes and MAX_FDS descriptors a message.

Requests (``op``):

    hello    {pid, recovering}  first, from a server: pid must be the peer's (SO_PEERCRED)
    put      {name, meta} + 1 fd  keep a dup of fd under name (an earlier one is closed)
    drop     {name}
    meta     {values}           merged into the connection's server-level JSON
    commit   {}                 this connection's set becomes the held set; the one held
                                before (an earlier server's) is closed
    bye      {why}              "shutdown" (down) or "handover" (restart, after "go")
    respawn  {argv, env, sockets}  how to start a server again (the CLI, after up and
                                restart); sockets: the run directory's that it listens on
                                and nobody uses, removed before it starts and once it serves
    status   {}                 what is held, for tests and the operator

Before commit a connection's puts are staged; after it they change the held set directly.
The socket is root's alone (mode 0600 in the root-only run directory) and both sides check
their peer's uid by SO_PEERCRED.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .control import peer_of
from .handover import read_exact

__all__ = ["HolderError", "BadMessage", "Message", "HolderClient", "send_message",
           "recv_message", "MAX_MESSAGE", "MAX_FDS", "BYE"]

MAX_MESSAGE = 1 << 20
MAX_FDS = 16
BYE = ("shutdown", "handover")
LENGTH = struct.Struct("<Q")


class HolderError(Exception):
    """The holder refused, did not answer, or the connection broke."""


class BadMessage(HolderError):
    """A well-framed message whose content is not a request: the connection goes on."""


@dataclass
class Message:
    body: dict
    fds: list[int]


def send_message(conn: socket.socket, body: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise HolderError(f"a message of {len(data)} bytes: at most {MAX_MESSAGE}")
    if len(fds) > MAX_FDS:
        raise HolderError(f"{len(fds)} descriptors in a message: at most {MAX_FDS}")
    head = LENGTH.pack(len(data))
    if fds:  # the descriptors ride with the length alone, so that the reader finds them there
        if socket.send_fds(conn, [head], list(fds)) != len(head):
            raise HolderError("a short write of a message's length")
        conn.sendall(data)
    else:
        conn.sendall(head + data)


def recv_message(conn: socket.socket) -> Message | None:
    """The next message, or None at a clean end of the stream. HolderError when the stream
    cannot go on (too long, cut short, too many descriptors); BadMessage when it can."""
    head, fds, flags, _ = socket.recv_fds(conn, LENGTH.size, MAX_FDS)
    if not head and not fds:
        return None
    try:
        if flags & socket.MSG_CTRUNC:
            raise HolderError(f"more than {MAX_FDS} descriptors in a message")
        (n,) = LENGTH.unpack(read_exact(conn, LENGTH.size, head, HolderError))
        if n > MAX_MESSAGE:
            raise HolderError(f"a message of {n} bytes: at most {MAX_MESSAGE}")
        data = read_exact(conn, n, error=HolderError)
        try:
            body = json.loads(data)
        except ValueError:
            raise BadMessage("a message that is not JSON") from None
        if not isinstance(body, dict):
            raise BadMessage("a message that is not a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return Message(body, list(fds))


class HolderClient:
    """The server's connection to its holder. One request at a time (a lock: the server's
    main thread and its maintainer both call it); each waits for its reply."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise HolderError(f"{path} is not a socket")
        except OSError as exc:
            raise HolderError(f"no holder on {path}: {exc.strerror}") from None
        self.path = path
        self.lock = threading.Lock()
        self.conn: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(timeout)
        try:
            self.conn.connect(path)
            peer = peer_of(self.conn)
            if peer.uid != os.geteuid():
                raise HolderError(f"the holder on {path} runs as uid {peer.uid}, not ours "
                                  f"({os.geteuid()})")
        except OSError as exc:
            self.close()
            raise HolderError(f"cannot reach the holder on {path}: {exc}") from None
        except HolderError:
            self.close()
            raise

    def request(self, body: dict, fds: Sequence[int] = ()) -> dict:
        with self.lock:
            if self.conn is None:
                raise HolderError(f"the connection to the holder on {self.path} is closed")
            try:
                send_message(self.conn, body, fds)
                reply = recv_message(self.conn)
            except (OSError, HolderError) as exc:
                # a timeout or a cut leaves the stream out of step: nothing more on it
                self.conn.close()
                self.conn = None
                raise HolderError(f"holder {body.get('op')}: {exc or type(exc).__name__}") \
                    from None
            if reply is None:
                self.conn.close()
                self.conn = None
                raise HolderError(f"holder {body.get('op')}: the holder closed the connection")
        for fd in reply.fds:  # a reply carries none; never keep what it should not have
            os.close(fd)
        if reply.body.get("ok") is not True:
            raise HolderError(f"holder {body.get('op')}: {reply.body.get('why', 'refused')}")
        return reply.body

    def hello(self, pid: int, recovering: bool = False) -> dict:
        return self.request({"op": "hello", "pid": pid, "recovering": recovering})

    def put(self, name: str, fd: int, meta: dict) -> None:
        self.request({"op": "put", "name": name, "meta": meta}, [fd])

    def drop(self, name: str) -> None:
        self.request({"op": "drop", "name": name})

    def meta(self, values: dict) -> None:
        self.request({"op": "meta", "values": values})

    def commit(self) -> None:
        self.request({"op": "commit"})

    def bye(self, why: str) -> None:
        self.request({"op": "bye", "why": why})

    def respawn(self, argv: list[str], env: dict[str, str], sockets: list[str] = ()) -> None:
        self.request({"op": "respawn", "argv": argv, "env": env, "sockets": list(sockets)})

    def status(self) -> dict:
        return self.request({"op": "status"})

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None
