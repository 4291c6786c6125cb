"""The holder: a small process apart from the server that keeps the server's descriptors (the
/dev/fuse connection and the store's memfds) so that they outlive a crash of the server,
notices the crash, starts a new server and offers it those descriptors (docs/ARCHITECTURE.md,
"The holder"; the protocol: datapath/holding.py; the offer: datapath/handover.py).

    python -m agentzip_blk.host.holder --run-dir RUN

It listens on RUN/holder.sock (0600, root only by SO_PEERCRED), writes RUN/holder.pid and logs
one line per event to stderr (`up` sends it to RUN/holder.log). It runs no store code: it
keeps descriptors and small JSON, and a respawn recipe that only a root peer on its socket
can give (the CLI, after `up` and `restart`): nothing in the run directory is read as an
order, since a container that mounts the run directory may write there.

A server says hello, puts its descriptors, commits: that set becomes the held set and the
server the current one. When the current server's connection ends:

- after bye "shutdown" (`down`): everything held is closed, the holder's files go, it exits;
- after bye "handover" (`restart`): the next server has HANDOVER_WAIT seconds to commit;
- otherwise (SIGKILL, OOM kill, a crash): recovery. Once the old process is gone (two
  servers never touch one store), the recipe's command runs with
  ``takeover=RUN/recover.sock takeover_pid=<holder>``, is offered the held descriptors and
  their JSON, and must say ready, hear go, then commit its own set. A server that fails is
  killed and another tried, ATTEMPTS times in all, BACKOFF, 2 x BACKOFF... seconds apart;
  then the holder keeps everything (requests wait in the kernel) and says so in its log.

The functions at the end are the CLI's side: start the holder, give it the recipe, stop it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import procfs
from ..datapath import handover, protect
from ..datapath.control import Peer, peer_of
from ..datapath.holding import (
    BYE,
    MAX_MESSAGE,
    BadMessage,
    HolderClient,
    HolderError,
    Message,
    recv_message,
    send_message,
)
from ..errors import DeviceError, SetupError
from . import pinning
from .procs import pid_alive, read_pidfile, set_oom_score_adj, spawn, tail, wait_gone
from .rundir import open_private, secure_run_dir
from .runstate import RunState, locked
from .servercmd import plugin_env

MODULE = "agentzip_blk.host.holder"
SOCKET = "holder.sock"
PIDFILE = "holder.pid"
LOG = "holder.log"
RECOVER_SOCKET = "recover.sock"  # where a recovering server listens for the offer
SERVER_LOG = "nbdkit.log"

ATTEMPTS = 5  # servers started for one recovery before the holder gives up
BACKOFF = 1.0  # s after the first failure; doubled after each
WAIT = 60.0  # s for a server to commit after a handover, or after "go" in a recovery
OFFER_TIMEOUT = 120.0  # s a recovering server may take to map and check the store
STATE_LOCK_WAIT = 5.0  # s for the run directory's lock (down may hold it) to record a recovery
EXIT_WAIT = 10.0  # s `down` waits for the holder to exit after the server said bye
MAX_CONNECTIONS = 16  # a restart has two servers connected, the CLI a third
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def say(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} agentzip-holder[{os.getpid()}]: "
                     f"{msg}\n")
    sys.stderr.flush()


class Refused(Exception):
    """A request the holder does not do; the reply says why and the connection goes on."""


class RecoveryFailed(Exception):
    """One recovering server did not take over; it has been killed."""


class ServerStuck(RecoveryFailed):
    """A recovering server failed and did not exit after SIGKILL (D state)."""


def json_size(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")))


@dataclass
class HeldSet:
    """Descriptors by name (in the order of the offer), their JSON, the server's JSON."""
    fds: dict[str, int] = field(default_factory=dict)
    tables: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def put(self, name: str, fd: int, meta: dict) -> None:
        old = self.fds.pop(name, None)
        if old is not None:
            os.close(old)
        self.fds[name] = fd
        self.tables[name] = meta

    def drop(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        self.tables.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.tables.clear()


@dataclass
class Recipe:
    argv: list[str]
    env: dict[str, str]
    # sockets in the run directory the server listens on and nobody uses (nbdkit's NBD
    # socket with the FUSE door): a dead server's would be in the next one's way, and a
    # live one's goes once it serves, as `up` removes it
    sockets: list[str] = field(default_factory=list)


class Connection:
    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.pid: int | None = None  # said in hello, checked against the peer's
        self.pidfd: int | None = None  # to see that process end, whatever reuses its pid
        self.staged = HeldSet()  # after commit: the held set itself, while current
        self.committed = False
        self.bye: str | None = None


@dataclass
class Lost:
    """The current server's connection ended: what a recovery needs to know of it."""
    pid: int | None
    pidfd: int | None
    bye: str | None


class Holder:
    def __init__(self, run_dir: str, *, attempts: int = ATTEMPTS, backoff: float = BACKOFF,
                 wait: float = WAIT) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, SOCKET)
        self.pidfile = os.path.join(run_dir, PIDFILE)
        self.attempts, self.backoff, self.wait = attempts, backoff, wait
        self.cond = threading.Condition()
        self.held = HeldSet()
        self.current: Connection | None = None
        self.connections: set[Connection] = set()
        self.recipe: Recipe | None = None  # memory only: never from a file
        self.recoveries = 0
        self.recovering: int | None = None  # the pid of the server a recovery started
        self.recovered = False  # that server has committed
        self.lost: Lost | None = None
        self.abandoned = 0  # servers that said hello and went without a commit
        self.children: list[subprocess.Popen] = []
        self.repin = False  # pin the held memfds now, not at the next period
        self.pinned: pinning.Refresh | None = None  # the last refresh
        self.pin_refreshes = 0
        self.wake_r, self.wake_w = os.pipe()
        self.listener = listen(self.path)
        with open_private(self.pidfile) as f:
            f.write(f"{os.getpid()}\n")

    # -- the loop: accept, a thread per connection -------------------------------------

    def run(self) -> int:
        threading.Thread(target=self.recovery_loop, name="recovery", daemon=True).start()
        threading.Thread(target=self.pin_loop, name="pins", daemon=True).start()
        say(f"listening on {self.path}")
        while True:
            ready, _, _ = select.select([self.listener, self.wake_r], [], [])
            if self.wake_r in ready:
                return 0
            try:
                sock, _ = self.listener.accept()
            except OSError:
                continue
            self.admit(sock)

    def admit(self, sock: socket.socket) -> None:
        peer = peer_of(sock)
        if peer.uid != os.geteuid():
            say(f"refused pid {peer.pid} of uid {peer.uid}: root only")
            refuse(sock, "permission denied")
            return
        with self.cond:
            if len(self.connections) >= MAX_CONNECTIONS:
                say(f"refused pid {peer.pid}: {MAX_CONNECTIONS} connections already")
                refuse(sock, "busy")
                return
            conn = Connection(sock, peer)
            self.connections.add(conn)
        threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    msg = recv_message(conn.sock)
                except BadMessage as exc:
                    self.reply(conn, {"ok": False, "why": str(exc)})
                    continue
                except (HolderError, OSError) as exc:  # the stream is out of step: hang up
                    say(f"pid {conn.peer.pid}: {exc}; closing its connection")
                    self.reply(conn, {"ok": False, "why": str(exc)})
                    return
                if msg is None:
                    return
                answer = self.handle(conn, msg)
                for fd in msg.fds:  # whatever the request did not keep
                    os.close(fd)
                self.reply(conn, answer)
        finally:
            self.closed(conn)

    def reply(self, conn: Connection, body: dict) -> None:
        with contextlib.suppress(OSError, HolderError):
            send_message(conn.sock, body)

    # -- requests -----------------------------------------------------------------------

    def handle(self, conn: Connection, msg: Message) -> dict:
        ops: dict[str, Callable[[Connection, Message], dict]] = {
            "hello": self.op_hello, "put": self.op_put, "drop": self.op_drop,
            "meta": self.op_meta, "commit": self.op_commit, "bye": self.op_bye,
            "respawn": self.op_respawn, "status": self.op_status}
        op = msg.body.get("op")
        if not isinstance(op, str) or op not in ops:
            return {"ok": False, "why": f"unknown op {op!r}"}
        try:
            with self.cond:
                return {"ok": True, **ops[op](conn, msg)}
        except Refused as exc:
            return {"ok": False, "why": str(exc)}
        except OSError as exc:
            return {"ok": False, "why": f"{op}: {exc}"}
        except Exception as exc:  # a bug must not end the connection: its end means a crash
            say(f"{op} from pid {conn.peer.pid}: {type(exc).__name__}: {exc}")
            return {"ok": False, "why": f"{op}: the holder failed: {type(exc).__name__}"}

    def op_hello(self, conn: Connection, msg: Message) -> dict:
        pid = msg.body.get("pid")
        if pid != conn.peer.pid or isinstance(pid, bool):
            raise Refused(f"hello as pid {pid!r} from pid {conn.peer.pid}")
        if conn.pid is not None:
            raise Refused("hello twice")
        recovering = msg.body.get("recovering") is True
        if recovering and pid != self.recovering:
            raise Refused(f"pid {pid} says it recovers, but this holder started "
                          f"{self.recovering or 'no recovery'}")
        conn.pidfd = os.pidfd_open(pid)
        conn.pid = pid
        say(f"hello from pid {pid}{' (recovering)' if recovering else ''}")
        return {"holder_pid": os.getpid(), "recoveries": self.recoveries,
                "held": list(self.held.fds)}

    def writable(self, conn: Connection) -> HeldSet:
        if conn.pid is None:
            raise Refused("hello first")
        if conn.committed and self.current is not conn:
            raise Refused("another server has committed since: this connection holds nothing")
        return conn.staged

    def op_put(self, conn: Connection, msg: Message) -> dict:
        held = self.writable(conn)
        name, meta = msg.body.get("name"), msg.body.get("meta", {})
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise Refused(f"name {name!r}: 1 to 64 of letters, digits, '_', '.', '-'")
        if not isinstance(meta, dict):
            raise Refused("meta is not an object")
        if len(msg.fds) != 1:
            raise Refused(f"put takes one descriptor, not {len(msg.fds)}")
        if name not in held.fds and len(held.fds) >= handover.MAX_FDS:
            raise Refused(f"{handover.MAX_FDS} descriptors held: one offer carries no more")
        if json_size({"meta": held.meta, "tables": {**held.tables, name: meta}}) > MAX_MESSAGE:
            raise Refused(f"the held JSON would pass {MAX_MESSAGE} bytes")
        held.put(name, msg.fds.pop(), meta)
        return {}

    def op_drop(self, conn: Connection, msg: Message) -> dict:
        name = msg.body.get("name")
        if not isinstance(name, str):
            raise Refused("drop needs a name")
        self.writable(conn).drop(name)
        return {}

    def op_meta(self, conn: Connection, msg: Message) -> dict:
        held = self.writable(conn)
        values = msg.body.get("values")
        if not isinstance(values, dict):
            raise Refused("values is not an object")
        merged = {**held.meta, **values}
        if json_size({"meta": merged, "tables": held.tables}) > MAX_MESSAGE:
            raise Refused(f"the held JSON would pass {MAX_MESSAGE} bytes")
        held.meta = merged
        return {}

    def op_commit(self, conn: Connection, msg: Message) -> dict:
        held = self.writable(conn)
        if self.current is conn:
            return {}
        if self.recovering is not None and conn.pid != self.recovering:
            raise Refused(f"a recovery (pid {self.recovering}) is under way")
        old, self.held = self.held, held
        old.close()
        before = self.current
        self.current, conn.committed = conn, True
        if conn.pid == self.recovering:
            self.recovered = True
        self.repin = True
        self.cond.notify_all()
        say(f"pid {conn.pid} committed {', '.join(held.fds) or 'nothing'}"
            + (f" (pid {before.pid}'s set closed)" if before is not None else ""))
        return {}

    def op_bye(self, conn: Connection, msg: Message) -> dict:
        why = msg.body.get("why")
        if conn.pid is None:
            raise Refused("hello first")
        if why not in BYE:
            raise Refused(f"bye {why!r}: one of {', '.join(BYE)}")
        conn.bye = why
        say(f"pid {conn.pid} says bye ({why})")
        return {}

    def op_respawn(self, conn: Connection, msg: Message) -> dict:
        argv, env = msg.body.get("argv"), msg.body.get("env")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) and a and "\0" not in a
                                                        for a in argv)):
            raise Refused("argv: a list of non-empty strings")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in env.items())):
            raise Refused("env: an object of strings")
        sockets = msg.body.get("sockets", [])
        if not (isinstance(sockets, list) and all(
                isinstance(p, str) and os.path.dirname(p) == self.run_dir for p in sockets)):
            raise Refused(f"sockets: paths in {self.run_dir}")
        self.recipe = Recipe(argv, env, sockets)
        self.cond.notify_all()
        say(f"respawn recipe from pid {conn.peer.pid}: {' '.join(argv)}")
        return {}

    def op_status(self, conn: Connection, msg: Message) -> dict:
        return {"pid": os.getpid(), "current": self.current.pid if self.current else None,
                "held": list(self.held.fds), "tables": self.held.tables,
                "recoveries": self.recoveries, "recovering": self.recovering,
                "recipe": self.recipe is not None,
                "pinned_bytes": self.pinned.bytes if self.pinned else 0,
                "pin_errors": self.pinned.errors if self.pinned else [],
                "pin_refreshes": self.pin_refreshes,
                "connections": sorted(c.peer.pid for c in self.connections)}

    # -- a connection ends ------------------------------------------------------------------

    def closed(self, conn: Connection) -> None:
        with self.cond:
            self.connections.discard(conn)
            conn.sock.close()
            if conn is not self.current:
                if not conn.committed:
                    conn.staged.close()  # never held: dropped
                    if conn.pid is not None:
                        self.abandoned += 1
                if conn.pidfd is not None:
                    os.close(conn.pidfd)
                self.cond.notify_all()  # a recovery may wait for this connection to end
                return
            self.current = None
            if conn.bye == "shutdown":
                say(f"pid {conn.pid} stopped on purpose: closing what it held, exiting")
                self.finish()
                return
            say(f"pid {conn.pid}'s connection ended "
                + ("after bye (handover)" if conn.bye else "without bye: recovering"))
            if self.lost is not None and self.lost.pidfd is not None:
                os.close(self.lost.pidfd)  # not taken up yet, and superseded by this one
            self.lost = Lost(conn.pid, conn.pidfd, conn.bye)
            self.repin = True  # its locks went with it: ours must cover its last pages now
            self.cond.notify_all()

    def finish(self) -> None:
        """Close everything held, remove our files, make the main loop return."""
        self.held.close()
        for conn in self.connections:
            if not conn.committed:
                conn.staged.close()
        remove_files(self.run_dir, os.getpid())
        os.write(self.wake_w, b"x")

    def pending(self) -> list[int]:
        """Pids of servers that said hello and have not committed: a restart's new server,
        perhaps, still taking over; nothing is recovered while one may serve."""
        return [c.pid for c in self.connections if c.pid is not None and not c.committed]

    # -- pins: the held memory stays in memory when no server locks it ------------------

    def pin_loop(self) -> None:
        pins = pinning.Pins()
        said: list[str] = []
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.repin, timeout=pinning.PERIOD)
                self.repin = False
                try:  # the set cannot change meanwhile: its descriptors stay open
                    work, done = pins.plan(list(self.held.fds.values()))
                except Exception as exc:  # never die of it: the next period tries again
                    work, done = [], pinning.Refresh(errors=[f"{type(exc).__name__}: {exc}"])
            pins.populate(work, done)
            if done.errors != said:
                say("pins: " + ("; ".join(done.errors) if done.errors else "pinned again"))
                said = done.errors
            with self.cond:
                self.pinned = done
                self.pin_refreshes += 1

    # -- recovery -------------------------------------------------------------------------

    def recovery_loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.lost is not None)
                lost, self.lost = self.lost, None
            try:
                self.recover(lost)
            except Exception as exc:  # never die of it: what is held stays held
                say(f"recovery stopped by {type(exc).__name__}: {exc}")
            finally:
                if lost.pidfd is not None:
                    os.close(lost.pidfd)

    def recover(self, lost: Lost) -> None:
        # two servers never touch one store: the lost one must be gone (a server that only
        # dropped its connection still serves)
        if lost.pidfd is not None:
            told = False
            while not select.select([lost.pidfd], [], [], 5.0)[0]:
                if self.current is not None:
                    return
                if not told:
                    say(f"pid {lost.pid} still runs: waiting for it to exit first")
                    told = True
        self.reap()
        with self.cond:
            if lost.bye == "handover":  # unless the next server went without a commit
                say(f"waiting up to {self.wait:g} s for the next server to commit")
                before = self.abandoned
                self.cond.wait_for(lambda: self.current is not None or self.abandoned != before,
                                   timeout=self.wait)
            if self.current is None and self.pending():
                say(f"waiting for pid {', '.join(map(str, self.pending()))} to commit or go")
            self.cond.wait_for(lambda: self.current is not None or not self.pending())
            if self.current is not None:
                say(f"pid {self.current.pid} committed: nothing to recover")
                return
            if not self.held.fds:
                say("nothing held: nothing to recover")
                return
        failures = 0
        while True:
            with self.cond:
                if self.recipe is None:
                    say("no respawn recipe yet (the CLI gives it after up): waiting for one")
                    self.cond.wait_for(lambda: self.recipe is not None
                                       or self.current is not None)
                if self.current is not None:
                    return
                recipe = self.recipe
            try:
                pid = self.recover_once(recipe)
            except ServerStuck as exc:
                # a server SIGKILL cannot end may still touch the store: never a second one
                say(f"recovery stopped: {exc}: `agentzip-blk down --force` aborts the FUSE "
                    "connection it waits on")
                return
            except RecoveryFailed as exc:
                failures += 1
                say(f"recovery attempt {failures} of {self.attempts} failed: {exc}")
                if failures >= self.attempts:
                    say("recovery failed: `agentzip-blk down --force` (everything stays held: "
                        "requests wait in the kernel)")
                    return
                with self.cond:
                    self.cond.wait_for(lambda: self.current is not None,
                                       timeout=self.backoff * 2 ** (failures - 1))
                continue
            self.record(pid)
            self.recoveries += 1  # after the record: whoever sees the count finds the pid
            return

    def recover_once(self, recipe: Recipe) -> int:
        """Start a server, offer it what is held, wait for its commit: its pid. Raises
        RecoveryFailed after killing it."""
        path = os.path.join(self.run_dir, RECOVER_SOCKET)
        for stale in (path, *recipe.sockets):  # the dead server's: nbdkit will not bind over
            remove_socket(stale)
        argv = [a for a in recipe.argv if not a.startswith(("takeover=", "takeover_pid="))]
        argv += [f"takeover={path}", f"takeover_pid={os.getpid()}"]
        try:
            proc = spawn(argv, os.path.join(self.run_dir, SERVER_LOG), env=recipe.env)
        except OSError as exc:
            raise RecoveryFailed(f"cannot start {argv[0]}: {exc}") from None
        self.children.append(proc)
        with self.cond:
            self.recovering, self.recovered = proc.pid, False
        say(f"recovery {self.recoveries + 1}: started pid {proc.pid}")
        try:
            self.offer(proc, path)
            deadline = time.monotonic() + self.wait
            with self.cond:
                while not self.recovered:
                    if proc.poll() is not None:
                        raise RecoveryFailed(f"pid {proc.pid} exited (status {proc.returncode})"
                                             f" before it committed: see {SERVER_LOG}")
                    if time.monotonic() > deadline:
                        raise RecoveryFailed(f"pid {proc.pid} did not commit within "
                                             f"{self.wait:g} s of go")
                    self.cond.wait(0.2)
        except RecoveryFailed as exc:
            kill(proc)
            if proc.poll() is None:  # kept running: `down` finds it by its command line
                raise ServerStuck(f"{exc}; and pid {proc.pid} did not exit after SIGKILL "
                                  f"(state {procfs.process_state(proc.pid)})") from None
            self.children.remove(proc)
            raise
        except BaseException:
            kill(proc)
            self.children.remove(proc)
            raise
        finally:
            remove_socket(path)
            with self.cond:
                self.recovering = None
        for unused in recipe.sockets:  # it serves: nobody may connect there
            remove_socket(unused)
        return proc.pid

    def offer(self, proc: subprocess.Popen, path: str) -> None:
        deadline = time.monotonic() + self.wait
        while not is_socket(path):
            if proc.poll() is not None:
                raise RecoveryFailed(f"pid {proc.pid} exited (status {proc.returncode}) before "
                                     f"it listened on {path}: see {SERVER_LOG}")
            if time.monotonic() > deadline:
                raise RecoveryFailed(f"pid {proc.pid} did not listen on {path} within "
                                     f"{self.wait:g} s")
            time.sleep(0.05)
        with self.cond:  # without a current server nothing changes the held set
            names = list(self.held.fds)
            fds = [self.held.fds[n] for n in names]
            header = {"recover": True, "meta": self.held.meta, "tables": dict(self.held.tables),
                      "names": names, "recoveries": self.recoveries + 1}
        while True:
            try:
                giver = handover.Giver(path, proc.pid, OFFER_TIMEOUT)
                break
            except ConnectionRefusedError as exc:  # bound, not yet listening
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RecoveryFailed(f"cannot reach pid {proc.pid} on {path}: {exc}") \
                        from None
                time.sleep(0.05)
            except (OSError, handover.HandoverError) as exc:
                raise RecoveryFailed(f"cannot reach pid {proc.pid} on {path}: {exc}") from None
        try:
            giver.offer(handover.Offer(header, fds))  # ours stay ours until it commits
            giver.verdict()
            giver.go()
        except (OSError, handover.HandoverError) as exc:
            raise RecoveryFailed(f"pid {proc.pid}: {exc}") from None
        finally:
            giver.close()

    def record(self, pid: int) -> None:
        """The recovered server in state.json, so that status and down find it."""
        oom = set_oom_score_adj(pid, -1000)
        say(f"recovery {self.recoveries + 1} done: pid {pid} serves")
        try:
            with locked(self.run_dir, wait=STATE_LOCK_WAIT):
                state = RunState.load(self.run_dir)
                if state is None:
                    say("no state.json: the recovered pid is not recorded")
                    return
                state.nbdkit_pid = pid
                state.recoveries += 1
                state.oom_protected = oom
                state.save()
        except (SetupError, DeviceError, OSError) as exc:
            say(f"state.json not updated with pid {pid}: {exc}")

    def reap(self) -> None:
        for proc in list(self.children):
            if proc.poll() is not None:
                self.children.remove(proc)


def refuse(sock: socket.socket, why: str) -> None:
    with contextlib.suppress(OSError, HolderError):
        sock.settimeout(1.0)
        send_message(sock, {"ok": False, "why": why})
    sock.close()


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_socket(path: str) -> None:
    if is_socket(path):
        with contextlib.suppress(OSError):
            os.unlink(path)


def listen(path: str) -> socket.socket:
    """A socket on ``path``, 0600 from the start; refused when something that is not a
    socket is there, or when another holder answers on it."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise HolderError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a holder killed before it could remove it
        else:
            raise HolderError(f"another holder listens on {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(MAX_CONNECTIONS)
    return listener


def remove_files(run_dir: str, pid: int) -> None:
    """The holder's socket and pid file, once holder ``pid`` is done with them."""
    remove_socket(os.path.join(run_dir, SOCKET))
    remove_socket(os.path.join(run_dir, RECOVER_SOCKET))
    pidfile = os.path.join(run_dir, PIDFILE)
    if read_pidfile(pidfile) == pid:
        with contextlib.suppress(OSError):
            os.unlink(pidfile)


def kill(proc: subprocess.Popen) -> None:
    """A server this holder started, by its pid (not yet reaped: it cannot be another's)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def refuse_signal(signum: int, _frame) -> None:
    os.write(2, f"agentzip-holder[{os.getpid()}]: refused signal {signum}: it holds the swap "
                f"server's descriptors; `agentzip-blk down` stops it\n".encode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                description="Hold the swap server's descriptors across a crash.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempts", type=int, default=ATTEMPTS,
                   help="servers started for one recovery before giving up")
    p.add_argument("--backoff", type=float, default=BACKOFF,
                   help="seconds after a failed recovery; doubled after each")
    p.add_argument("--wait", type=float, default=WAIT,
                   help="seconds for a server to commit after a handover or a recovery's go")
    args = p.parse_args(argv)
    run_dir = os.path.abspath(args.run_dir)
    os.chdir("/")  # holds no file system busy; what it starts gets absolute paths
    # what it holds is every tenant's memory: locked, never in a core dump, and it must
    # outlive the `up` that started it. (Not PR_SET_IO_FLUSHER: the servers it starts would
    # inherit it, all their threads, where the server sets it on its request threads only.)
    for what, why in (("mlockall", protect.lock_memory()),
                      ("core dumps", protect.forbid_core_dumps()),
                      ("parent death signal", protect.clear_parent_death_signal())):
        if why is not None:
            say(f"{what}: {why}")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, refuse_signal)
    try:
        secure_run_dir(run_dir, keep_group=True, create=False)
        holder = Holder(run_dir, attempts=max(1, args.attempts), backoff=args.backoff,
                        wait=args.wait)
    except (HolderError, SetupError, OSError) as exc:
        say(f"cannot start: {exc}")
        return 1
    return holder.run()


# -- the CLI's side: up, restart, down, status ----------------------------------------------

def socket_path(run_dir: str) -> str:
    return os.path.join(run_dir, SOCKET)


def command(run_dir: str) -> list[str]:
    return [sys.executable, "-m", MODULE, "--run-dir", run_dir]


def is_holder(pid: int | None, run_dir: str) -> bool:
    """``pid`` runs and is the holder of ``run_dir`` (not a reused pid, nor another's)."""
    if not pid or not pid_alive(pid):
        return False
    argv = procfs.process_cmdline(pid) or []
    return MODULE in argv and any(a == "--run-dir" and b == run_dir
                                  for a, b in zip(argv, argv[1:]))


def start(run_dir: str, timeout: float) -> int:
    """Start the holder of ``run_dir``; its pid once it listens. DeviceError if it does not."""
    log = os.path.join(run_dir, LOG)
    proc = spawn(command(run_dir), log, env=plugin_env())
    deadline = time.monotonic() + timeout
    while not (read_pidfile(os.path.join(run_dir, PIDFILE)) == proc.pid
               and is_socket(socket_path(run_dir))):
        if proc.poll() is not None:
            raise DeviceError(f"the holder exited with status {proc.returncode} at start; "
                              f"log {log}:\n{tail(log, 5)}")
        if time.monotonic() > deadline:
            kill(proc)
            raise DeviceError(f"the holder did not listen within {timeout:g}s; log {log}")
        time.sleep(0.02)
    set_oom_score_adj(proc.pid, -1000)  # best effort, as for nbdkit
    return proc.pid


def give_recipe(run_dir: str, argv: list[str], env: dict[str, str], timeout: float,
                sockets: list[str] = ()) -> None:
    """Tell the holder how to start a server again (never with takeover keys: it adds its
    own); ``sockets``: those the server listens on that nobody uses (Recipe). DeviceError if
    it does not take it."""
    argv = [a for a in argv if not a.startswith(("takeover=", "takeover_pid="))]
    try:
        client = HolderClient(socket_path(run_dir), timeout)
        try:
            client.respawn(argv, env, list(sockets))
        finally:
            client.close()
    except HolderError as exc:
        raise DeviceError(f"the holder did not take the respawn recipe: {exc}; log "
                          f"{os.path.join(run_dir, LOG)}") from None


def stop(pid: int | None, run_dir: str, wait: float = EXIT_WAIT) -> None:
    """After the server stopped: the holder exits by itself once the server said bye; it is
    killed (SIGKILL, by pid, once shown to be ours) after ``wait`` seconds. ``wait`` 0: at
    once (`down --force`: it must not start a server again). A server it started for a
    recovery and that still runs then is killed with it: the state may not name it, and it
    would hold the store and the tier file after `down`."""
    if is_holder(pid, run_dir) and not wait_gone(pid, wait) and is_holder(pid, run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not wait_gone(pid, 10.0):
            raise DeviceError(f"the holder (pid {pid}) did not exit after SIGKILL")
        started = recovering_servers(pid, run_dir)
        for child in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        for child in started:
            if not wait_gone(child, 10.0):
                raise DeviceError(f"pid {child}, a server the holder started, did not exit "
                                  "after SIGKILL")
    if pid:
        remove_files(run_dir, pid)


def recovering_servers(holder_pid: int, run_dir: str) -> list[int]:
    """The servers holder ``holder_pid`` started for a recovery (their command line names it:
    ``takeover_pid=``, and its recover socket), and a copy of it forked and not yet exec'd
    into one (it holds the holder's descriptors, the tier file's lock among them); found by
    command line, since once the holder is gone their parent is init."""
    marks = {f"takeover_pid={holder_pid}", f"takeover={os.path.join(run_dir, RECOVER_SOCKET)}"}
    found = []
    for pid in procfs.pids():
        argv = procfs.process_cmdline(pid) or []
        if marks <= set(argv) or (pid != holder_pid and is_holder(pid, run_dir)):
            found.append(pid)
    return found


def pins(run_dir: str, timeout: float = 2.0) -> dict | None:
    """What the holder's last refresh of its pins found (host/pinning.py): the bytes it
    keeps locked and its errors; None when it does not answer."""
    try:
        client = HolderClient(socket_path(run_dir), timeout=timeout)
    except HolderError:
        return None
    try:
        reply = client.status()
    except (HolderError, OSError):
        return None
    finally:
        client.close()
    return {"pinned_bytes": reply.get("pinned_bytes", 0),
            "pin_errors": reply.get("pin_errors", [])}


def pid_of(run_dir: str) -> int | None:
    """The holder of ``run_dir`` by its pid file, only when that pid is shown to be it."""
    pid = read_pidfile(os.path.join(run_dir, PIDFILE))
    return pid if is_holder(pid, run_dir) else None


if __name__ == "__main__":
    sys.exit(main())
