"""The handover of a restart: one server process gives the next its FUSE connection and its
store, over a unix socket, without copying a page (docs/ARCHITECTURE.md, "Restart").

The taker (the new server, started by `agentzip-blk restart` with ``takeover=PATH``) listens
on PATH (mode 0600, in the root-only run directory) and admits one connection, from root and
from the pid it was told. The giver (the running server, asked over its control socket with
the ``handover`` verb) connects, and the two speak three messages:

    giver -> taker   OFFER  a JSON header, length-prefixed, with the descriptors (SCM_RIGHTS):
                            the /dev/fuse connection, then the store's (store.handover)
    taker -> giver   "ready" once it has mapped the store and its check passed,
                     or "fail <why>"
    giver -> taker   "go": the giver has stopped for good; only now may the taker serve

The giver paused its FUSE workers and its maintainer before the offer, and decides alone: it
says "go" only after "ready", and a taker that has not heard "go" never serves (it exits).
Without "ready" in time the giver resumes, so two servers never touch one store, and a
failed restart leaves the old server serving as it was.

Nothing in a message is code: the header is JSON, the store's tables travel as numpy arrays
in a memfd (store.handover). The descriptors are reachable only through this socket, whose
peer is checked by SO_PEERCRED on both sides; a memfd has no path in any file system.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass

from .control import peer_of

__all__ = ["HandoverError", "Offer", "Giver", "Taker", "FORMAT", "read_exact"]

FORMAT = 1  # raise when the header's meaning changes: a taker refuses a newer offer
MAX_HEADER = 64 << 20
# the FUSE connection and the store's (a recovery's: every table column on a memfd of its own,
# two dozen, and one per dictionary, up to 255 of them in theory, ~5 in practice); the
# kernel's own cap on one SCM_RIGHTS message is 253 (SCM_MAX_FD)
MAX_FDS = 250
_LEN = struct.Struct("<Q")


class HandoverError(Exception):
    """The handover could not be done; the giver keeps serving."""


@dataclass
class Offer:
    header: dict
    fds: list[int]


def _check_peer(conn: socket.socket, pid: int | None) -> None:
    peer = peer_of(conn)
    if peer.uid != os.geteuid():
        raise HandoverError(f"handover peer uid {peer.uid} is not ours ({os.geteuid()})")
    if pid is not None and peer.pid != pid:
        raise HandoverError(f"handover peer pid {peer.pid} is not the expected {pid}")


def read_exact(conn: socket.socket, n: int, first: bytes = b"",
               error: type[Exception] = HandoverError) -> bytes:
    """`n` bytes from `conn` (`first`: those read already); `error` when the peer closes
    first (the holder's protocol reads the same way: datapath.holding)."""
    buf = bytearray(first)
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise error("the peer closed the connection mid-message")
        buf += chunk
    return bytes(buf)


def _read_line(conn: socket.socket, limit: int = 4096) -> str:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise HandoverError("handover peer closed the connection")
        buf += chunk
        if len(buf) > limit:
            raise HandoverError("handover peer sent an over-long line")
    return buf[:-1].decode("utf-8", "replace")


class Giver:
    """The running server's side: connect to the taker, offer, wait for its verdict."""

    def __init__(self, path: str, pid: int, timeout: float) -> None:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise HandoverError(f"{path} is not a socket")
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(timeout)
        try:
            self.conn.connect(path)
            _check_peer(self.conn, pid)
        except (OSError, HandoverError):
            self.conn.close()
            raise

    def offer(self, offer: Offer) -> None:
        data = json.dumps({"format": FORMAT, **offer.header}).encode()
        if len(offer.fds) > MAX_FDS:
            raise HandoverError(f"{len(offer.fds)} descriptors: at most {MAX_FDS}")
        socket.send_fds(self.conn, [_LEN.pack(len(data))], offer.fds)
        self.conn.sendall(data)

    def verdict(self) -> None:
        """Returns once the taker is ready; raises HandoverError with its reason otherwise."""
        try:
            line = _read_line(self.conn)
        except TimeoutError:
            raise HandoverError("the new server did not answer in time") from None
        if line != "ready":
            raise HandoverError(line.removeprefix("fail ") or "the new server failed")

    def go(self) -> None:
        self.conn.sendall(b"go\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


class Taker:
    """The new server's side: listen, take the offer, say ready (or why not), wait for go."""

    def __init__(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise HandoverError(f"{path} exists and is not a socket")
            os.unlink(path)
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(1)
        self.conn: socket.socket | None = None

    def take(self, pid: int, timeout: float) -> Offer:
        """The giver's offer: its connection must come from ``pid`` within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self.listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                raise HandoverError(f"no handover from pid {pid} within {timeout:g} s") from None
            try:
                _check_peer(conn, pid)
            except (OSError, HandoverError):
                conn.close()  # somebody else: not an offer; keep waiting for ours
                if time.monotonic() > deadline:
                    raise
                continue
            break
        self._unlink()
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        self.conn = conn
        msg, fds, flags, _addr = socket.recv_fds(conn, _LEN.size, MAX_FDS)
        try:
            if flags & socket.MSG_CTRUNC:  # the kernel closed the ones that did not fit
                raise HandoverError(f"an offer of more than {MAX_FDS} descriptors")
            if len(msg) < _LEN.size:
                msg = read_exact(conn, _LEN.size, msg)
            (n,) = _LEN.unpack(msg)
            if n > MAX_HEADER:
                raise HandoverError(f"a handover header of {n} bytes")
            header = json.loads(read_exact(conn, n))
            if not isinstance(header, dict) or not isinstance(header.get("format"), int):
                raise HandoverError("a handover header that is not ours")
            if header["format"] > FORMAT:
                raise HandoverError(f"handover format {header['format']}, this server reads "
                                    f"{FORMAT} at most")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Offer(header, list(fds))

    def ready(self) -> None:
        self.conn.sendall(b"ready\n")

    def fail(self, why: str) -> None:
        with contextlib.suppress(OSError):
            if self.conn is not None:
                self.conn.sendall(f"fail {' '.join(why.split())}"[:4000].encode() + b"\n")

    def wait_go(self, timeout: float) -> None:
        self.conn.settimeout(timeout)
        try:
            line = _read_line(self.conn)
        except TimeoutError:
            raise HandoverError("the old server did not say go") from None
        if line != "go":
            raise HandoverError(f"the old server said {line!r}, not go")

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        self._unlink()
        for s in (self.conn, self.listener):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
