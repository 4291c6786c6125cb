"""The control channel: one JSON object per line over a unix socket (mode 0600, root only).

Request  {"cmd": "stats", "protocol": 1, ...args}
Reply    {"ok": true, "protocol": 1, ...}  or  {"ok": false, "protocol": 1, "error": "..."}

``protocol`` is the version of this framing and of the verbs' meaning (PROTOCOL): a server
refuses a request of a newer protocol than its own, and a client refuses a reply of a newer
one, each in one line that names both versions. A server from before the key existed sends
none and speaks protocol 0, which is protocol 1 without the key (so both sides take it).

The server runs in a daemon thread inside the nbdkit plugin. Each client gets its own
short-lived thread; a handler that raises answers with an error and the server goes on.

Who may ask: the file mode (0600 root; 0660 and the control group when one is configured)
is only the first gate. Every connection's peer is checked with SO_PEERCRED (uid, gid) and
SO_PEERGROUPS (supplementary groups), as the kernel recorded them at connect(): root (our
own uid) may use every verb; a member of the control group only the read-only verbs; anyone
else gets one "permission denied" reply and the connection is closed.

How many at once: every connection is served by a thread of its own (in a server whose
memory is locked), so their number is capped: MAX_CONNECTIONS for root, and a smaller
MAX_UNPRIVILEGED for everyone else together (the group's members, and strangers until
their refusal is sent), counted apart so that no number of the group's connections keeps
root's `status` or `down` out. A connection over its cap gets one "busy" reply from a
single refusing thread (or, when even that one is behind, is closed at once) and counts in
``busy``. A verb may also be served differently to the group (``group_handlers``: the
server rate-limits the stats scans its members may force).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

MAX_LINE = 64 * 1024
CLIENT_TIMEOUT = 10.0
PROTOCOL = 1  # raise when a verb changes meaning or a reply loses a key a client reads
MAX_CONNECTIONS = 128  # root's connections served at once (root is trusted: a bound on threads)
MAX_UNPRIVILEGED = 8  # everyone else's, together
_BUSY_QUEUE = 64  # over-cap connections waiting for their "busy" reply
BUSY_LINGER = 0.5  # s an over-cap connection is kept for its client to read the reply

Handler = Callable[[dict], dict]


class ControlError(Exception):
    """The server could not be reached or answered with an error."""


class ProtocolMismatch(ControlError):
    """The peer speaks a newer control protocol than this program."""


def _newer(protocol: object) -> bool:
    return isinstance(protocol, int) and not isinstance(protocol, bool) and protocol > PROTOCOL


# SO_PEERGROUPS (Linux >= 4.13); the socket module names it only on newer Pythons
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    """The credentials of a connected client, as the kernel recorded them at connect()."""
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    groups: tuple[int, ...] = ()
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
        groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    except OSError:
        pass  # older kernel or more than 256 groups: the primary gid still counts
    return Peer(pid, uid, gid, tuple(groups))


# what a peer may do: every verb, the read-only ones, nothing
ALL, READ, NONE = "all", "read", "none"


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler], *,
                 read_only: Collection[str] = (), group_gid: int | None = None,
                 group_handlers: dict[str, Handler] | None = None) -> None:
        """``read_only``: the verbs a member of ``group_gid`` may use (none without a
        group). Root, i.e. our own uid, may use all of ``handlers``. ``group_handlers``:
        read-only verbs served to the group by another handler than root's."""
        self.path = path
        self.handlers = handlers
        self.read_only = frozenset(read_only)
        self.group_handlers = dict(group_handlers or {})
        self.group_gid = group_gid
        self.owner_uid = os.geteuid()
        self.refused = 0  # connections and requests refused by the peer check
        self.busy = 0  # connections refused because their cap was reached
        self._open = {True: 0, False: 0}  # connections being served: root's, the others'
        self._open_lock = threading.Lock()
        self._busy_queue: queue.Queue[socket.socket] = queue.Queue(_BUSY_QUEUE)
        self._sock: socket.socket | None = None
        self._ino: int | None = None  # of our socket file: stop() unlinks only that one
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if os.path.exists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise ControlError(f"{self.path} exists and is not a socket")
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Create the socket file with no permissions for group and others from the start.
        old_umask = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old_umask)
        # listen at once: `up` connects as soon as the file exists (a connect between bind
        # and listen is refused)
        sock.listen(16)
        if self.group_gid is not None:
            # the group may connect (its members' requests are still checked per verb)
            os.chown(self.path, -1, self.group_gid)
            os.chmod(self.path, 0o660)
        else:
            os.chmod(self.path, 0o600)
        self._sock = sock
        self._ino = os.lstat(self.path).st_ino
        self._thread = threading.Thread(target=self._accept_loop, name="agentzip-control", daemon=True)
        self._thread.start()
        threading.Thread(target=self._busy_loop, name="agentzip-control-busy",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        # after a restart the path is the next server's socket (move_to): leave that one
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_ino == self._ino:
                os.unlink(self.path)

    def move_to(self, path: str) -> None:
        """rename(2) our socket file over ``path``: a restart's new server takes the old
        one's path in one step (clients connect to one or the other, never to nothing)."""
        os.rename(self.path, path)
        self.path = path

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                root = peer_of(conn).uid == self.owner_uid
            except OSError:
                conn.close()
                continue
            with self._open_lock:
                cap = MAX_CONNECTIONS if root else MAX_UNPRIVILEGED
                admitted = self._open[root] < cap
                if admitted:
                    self._open[root] += 1
                else:
                    self.busy += 1
                    busy = self.busy
            if not admitted:
                if busy & (busy - 1) == 0:  # a log line at the 1st, 2nd, 4th, 8th... only
                    print(f"agentzip: control: {busy} connection(s) refused so far: "
                          f"{cap} {'root' if root else 'non-root'} connections open",
                          file=sys.stderr, flush=True)
                try:
                    self._busy_queue.put_nowait(conn)
                except queue.Full:
                    conn.close()
                continue
            threading.Thread(target=self._serve_counted, args=(conn, root),
                             daemon=True).start()

    def _serve_counted(self, conn: socket.socket, root: bool) -> None:
        try:
            self._serve(conn)
        finally:
            with self._open_lock:
                self._open[root] -= 1

    def _busy_loop(self) -> None:
        """One thread answers every connection over its cap, without waiting on any: the
        reply goes first (a unix socket keeps it for the client), then whatever the client
        sends is read and dropped until it closes or BUSY_LINGER passes, since a close on
        unread bytes would reset the connection before the client read the reply."""
        reply = json.dumps({"ok": False, "protocol": PROTOCOL,
                            "error": "busy: too many control connections open; try again"}
                           ).encode() + b"\n"
        sel = selectors.DefaultSelector()
        until: dict[socket.socket, float] = {}

        def drop(conn: socket.socket) -> None:
            sel.unregister(conn)
            del until[conn]
            conn.close()

        while True:
            try:
                conn = self._busy_queue.get(timeout=0.05 if until else None)
            except queue.Empty:
                pass
            else:
                try:
                    conn.setblocking(False)
                    conn.send(reply)
                except OSError:
                    conn.close()
                else:
                    if len(until) >= _BUSY_QUEUE:
                        conn.close()  # a flood: no lingering for this one
                    else:
                        sel.register(conn, selectors.EVENT_READ)
                        until[conn] = time.monotonic() + BUSY_LINGER
            for key, _ in sel.select(timeout=0) if until else ():
                try:
                    data = key.fileobj.recv(MAX_LINE)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    drop(key.fileobj)
            now = time.monotonic()
            for conn in [c for c, t in until.items() if t <= now]:
                drop(conn)

    def access(self, peer: Peer) -> str:
        """ALL for root (our uid), READ for a member of the control group, else NONE."""
        if peer.uid == self.owner_uid:
            return ALL
        if self.group_gid is not None and (peer.gid == self.group_gid
                                           or self.group_gid in peer.groups):
            return READ
        return NONE

    def _refuse(self, peer: Peer, why: str) -> dict:
        self.refused += 1
        print(f"agentzip: control: refused pid {peer.pid} uid {peer.uid} gid {peer.gid}: "
              f"{why}", file=sys.stderr, flush=True)
        return {"ok": False, "error": f"permission denied: {why}"}

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(CLIENT_TIMEOUT)
        with conn, conn.makefile("rwb") as stream:
            try:
                peer = peer_of(conn)
            except OSError:
                return
            access = self.access(peer)
            if access == NONE:
                reply = self._refuse(peer, f"uid {peer.uid} is not root"
                                     + (" nor in the control group" if self.group_gid
                                        is not None else ""))
                with contextlib.suppress(OSError):  # gone before it read it
                    # take its request first (never acted on): closing on unread bytes
                    # resets the connection, and the client would lose the reason
                    conn.settimeout(1.0)
                    stream.readline(MAX_LINE + 1)
                    stream.write(json.dumps({"protocol": PROTOCOL, **reply}).encode()
                                 + b"\n")
                    stream.flush()
                return
            while True:
                try:
                    line = stream.readline(MAX_LINE + 1)
                except (OSError, TimeoutError):
                    return
                if not line:
                    return
                reply = {"protocol": PROTOCOL, **self.dispatch(line, access, peer)}
                try:
                    stream.write(json.dumps(reply).encode() + b"\n")
                    stream.flush()
                except OSError:
                    return
                if len(line) > MAX_LINE:
                    return  # the rest of an over-long line is not a request

    def dispatch(self, line: bytes, access: str = ALL, peer: Peer | None = None) -> dict:
        if access == NONE:
            return {"ok": False, "error": "permission denied"}
        if len(line) > MAX_LINE:
            return {"ok": False, "error": f"request longer than {MAX_LINE} bytes"}
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # RecursionError: deeply nested arrays ("[[[[...") within MAX_LINE; uncaught it
            # killed the client's thread without a reply.
            return {"ok": False, "error": f"malformed JSON: {exc}"}
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            return {"ok": False, "error": 'a request is a JSON object with a string "cmd"'}
        if _newer(request.get("protocol")):
            from .. import __version__
            return {"ok": False, "error": f"the client speaks control protocol "
                    f"{request['protocol']}, this server (agentzip-blk {__version__}) speaks "
                    f"{PROTOCOL}: use the agentzip-blk that started it"}
        handler = self.handlers.get(request["cmd"])
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            return {"ok": False, "error": f"unknown command {request['cmd']!r} (known: {known})"}
        if access != ALL and request["cmd"] not in self.read_only:
            allowed = ", ".join(sorted(self.read_only & set(self.handlers))) or "none"
            return self._refuse(peer or Peer(0, -1, -1),
                                f"{request['cmd']!r} needs root; the control group may use "
                                f"only: {allowed}")
        if access != ALL:
            handler = self.group_handlers.get(request["cmd"], handler)
        try:
            reply = handler(request)
        except Exception as exc:  # a handler bug must not take the server down
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, **reply}


def _connect(sock: socket.socket, path: str, timeout: float) -> None:
    """With a timeout the socket is non-blocking, and a unix connect() to a server whose
    listen backlog is momentarily full fails at once with EAGAIN instead of waiting (seen
    with many concurrent clients): retry until the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def request(path: str, cmd: str, timeout: float = 10.0, **args) -> dict:
    """Send one request and return the reply without its `ok` key."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            _connect(sock, path, timeout)
            try:
                sock.sendall(json.dumps({"cmd": cmd, "protocol": PROTOCOL, **args}).encode()
                             + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # a server over its connection cap answers "busy" and may close first
            with sock.makefile("rb") as stream:
                line = stream.readline()
    except FileNotFoundError:
        raise ControlError(f"no control socket at {path}: is the server running?") from None
    except PermissionError:
        raise ControlError(f"permission denied on {path}: run as root") from None
    except OSError as exc:
        raise ControlError(f"control socket {path}: {exc}") from None
    if not line:
        raise ControlError(f"control socket {path} closed without a reply")
    try:
        reply = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        reply = None
    if not isinstance(reply, dict):
        raise ControlError(f"{path} answered {line[:60]!r}, not an agentzip-blk control reply: "
                           f"is it the control socket of an agentzip-blk server?")
    protocol = reply.pop("protocol", 0)
    if _newer(protocol):
        from .. import __version__
        raise ProtocolMismatch(f"the server on {path} speaks control protocol {protocol}, this "
                               f"agentzip-blk {__version__} speaks {PROTOCOL}: run the "
                               f"agentzip-blk that started it (or upgrade this one)")
    if not reply.pop("ok", False):
        raise ControlError(str(reply.get("error", "unknown error")))
    return reply
