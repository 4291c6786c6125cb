"""The control channel: one JSON object per line over a unix socket (mode 0600, root only).

Request  {"cmd": "stats", ...args}
Reply    {"ok": true, ...}  or  {"ok": false, "error": "..."}

The server runs in a daemon thread inside the nbdkit plugin. Each client gets its own
short-lived thread; a handler that raises answers with an error and the server goes on.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable

MAX_LINE = 64 * 1024
CLIENT_TIMEOUT = 10.0

Handler = Callable[[dict], dict]


class ControlError(Exception):
    """The server could not be reached or answered with an error."""


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        self.path = path
        self.handlers = handlers
        self._sock: socket.socket | None = None
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
        os.chmod(self.path, 0o600)
        sock.listen(16)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="agentzip-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(CLIENT_TIMEOUT)
        with conn, conn.makefile("rwb") as stream:
            while True:
                try:
                    line = stream.readline(MAX_LINE + 1)
                except (OSError, TimeoutError):
                    return
                if not line:
                    return
                reply = self.dispatch(line)
                try:
                    stream.write(json.dumps(reply).encode() + b"\n")
                    stream.flush()
                except OSError:
                    return
                if len(line) > MAX_LINE:
                    return  # the rest of an over-long line is not a request

    def dispatch(self, line: bytes) -> dict:
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
        handler = self.handlers.get(request["cmd"])
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            return {"ok": False, "error": f"unknown command {request['cmd']!r} (known: {known})"}
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
            sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
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
    reply = json.loads(line)
    if not reply.pop("ok", False):
        raise ControlError(reply.get("error", "unknown error"))
    return reply
