"""`restart`: a new server from the installed code and config takes over the running one's
FUSE connection and store, without swapoff (docs/ARCHITECTURE.md, "Restart").

The loop device, its FUSE file and the swap area never change: the old server pauses its
workers (requests wait in the kernel's queue), hands its /dev/fuse descriptor and its store
over a unix socket (datapath.handover), and exits once the new one has mapped the store,
checked it and said ready. Anything that fails before that leaves the old server serving as
it was, and the new process is killed (it never served).

Refused, in one line, before anything starts: a device that is not served by the FUSE front
door, a server that is not running, and a config that changes what a running store cannot
change (store.handover.unchangeable names the keys).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

from .. import __version__
from ..config import ConfigError, load_file
from ..errors import DeviceError, SetupError
from ..store.handover import unchangeable
from . import facts, holder
from .chain import server_request, write_effective_config
from .procs import ours_alive, read_pidfile, set_oom_score_adj, spawn, tail, wait_gone
from .runstate import RunState, locked
from .servercmd import default_plugin_path, is_python_plugin, plugin_env, server_command

# the new server's files, beside the running one's until the handover is done
NEXT_CONFIG = "config.next.yaml"
NEXT_PIDFILE = "nbdkit.next.pid"
NEXT_LOG = "nbdkit.next.log"
# nbdkit must listen on an NBD socket (nobody may connect: its ip filter denies all, and the
# file is removed once it serves); status and down know our nbdkit by that path in its
# command line, so each restart takes the other of these two names
NBD_SOCKETS = ("nbd.sock", "nbd.next.sock")
HANDOVER_SOCKET = "handover.sock"
FAILED_LOG = "nbdkit.restart-failed.log"  # the log of the last new server that did not serve


@dataclass
class Restarted:
    old_pid: int
    new_pid: int
    paused_ms: float  # the old server's pause: from its workers' stop to "go"
    seconds: float  # the whole restart, as this command saw it
    restarts: int  # handovers this store has been through
    # why the holder (host.holder) did not take the new server's recipe: it would not
    # recover a crash of the new server; None when it took it or there is none
    holder_problem: str | None = None


def restart(config, run_dir: str, *, timeout: float = 120.0) -> Restarted:
    """Restart the server of ``run_dir`` on ``config`` (a Config), keeping every page."""
    facts.require_root("agentzip-blk restart")
    with locked(run_dir):
        state = RunState.load(run_dir)
        if state is None or not state.nbdkit_pid:
            raise SetupError(f"nothing is up in {run_dir}: `agentzip-blk up` starts a device")
        if not is_python_plugin(state.plugin):
            raise SetupError(f"restart needs the agentzip plugin; this device is served by "
                             f"nbdkit's {state.plugin}: `down` and `up` instead")
        if state.frontend != "fuse" or state.mode != "fuse":
            raise SetupError(f"restart needs the FUSE front door (device.frontend fuse); this "
                             f"device is served by {state.frontend}: `down` and `up` instead")
        if not ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket):
            raise DeviceError(f"the server (pid {state.nbdkit_pid}) is not running: its pages "
                              f"are gone; `agentzip-blk down --force`, then `up`")
        try:
            running = load_file(state.config_path, sha256=state.config_sha256)
        except ConfigError as exc:
            raise SetupError(f"cannot read the running server's config: {exc}") from None
        fixed = unchangeable(running, config)
        if fixed:
            raise SetupError(f"restart cannot change {', '.join(fixed)} of a running device: "
                             f"`agentzip-blk down` and `up` to change "
                             f"{'it' if len(fixed) == 1 else 'them'}")
        return _handover(state, config, timeout)


def _handover(state: RunState, config, timeout: float) -> Restarted:
    run_dir = state.run_dir
    t0 = time.monotonic()
    nbd_name = NBD_SOCKETS[os.path.basename(state.nbd_socket) == NBD_SOCKETS[0]]
    staged = (NEXT_PIDFILE, nbd_name, HANDOVER_SOCKET)  # a restart that died midway left them
    paths = {name: os.path.join(run_dir, name) for name in (*staged, NEXT_LOG)}
    _remove(run_dir, staged)
    config_path, digest = write_effective_config(config, run_dir, NEXT_CONFIG)
    # the installed code's plugin (a .deb upgrade may have moved it), or AGENTZIP_PLUGIN
    plugin = default_plugin_path()
    # a holder that `up` started keeps the new server's descriptors too
    held = holder.is_holder(state.holder_pid, run_dir)
    argv = _server_argv(state, plugin, paths[nbd_name], paths[NEXT_PIDFILE], config_path,
                        digest, held)
    argv += [f"takeover={paths[HANDOVER_SOCKET]}", f"takeover_pid={state.nbdkit_pid}"]
    old_pid = state.nbdkit_pid
    env = plugin_env()
    proc = spawn(argv, paths[NEXT_LOG], env=env)
    handed = False
    try:
        _wait_for(proc, paths[HANDOVER_SOCKET], timeout, paths[NEXT_LOG])
        reply = server_request(state, "handover", timeout, to=paths[HANDOVER_SOCKET],
                               pid=proc.pid)
        if not reply.get("handed_over"):
            raise DeviceError(f"restart refused, the old server (pid {old_pid}) serves on: "
                              f"{reply.get('why')}")
        handed = True
        _wait_serving(proc, state, paths[NEXT_PIDFILE], timeout, paths[NEXT_LOG])
    except BaseException:
        if not handed:  # it never served: nothing of it is worth keeping
            _kill(proc)
            _remove(run_dir, (*staged, NEXT_CONFIG))
            with contextlib.suppress(FileNotFoundError):  # why it failed, for the operator
                os.replace(paths[NEXT_LOG], os.path.join(run_dir, FAILED_LOG))
        raise
    # the new server serves: make its files the run directory's
    os.replace(config_path, os.path.join(run_dir, "config.yaml"))
    os.replace(paths[NEXT_PIDFILE], os.path.join(run_dir, "nbdkit.pid"))
    with contextlib.suppress(FileNotFoundError):
        os.replace(os.path.join(run_dir, "nbdkit.log"), os.path.join(run_dir, "nbdkit.log.1"))
    os.replace(paths[NEXT_LOG], os.path.join(run_dir, "nbdkit.log"))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths[nbd_name])  # nbdkit must listen; nobody may connect
    state.nbdkit_pid = proc.pid
    state.nbd_socket = paths[nbd_name]
    state.plugin = plugin
    state.config_path = os.path.join(run_dir, "config.yaml")
    state.config_sha256 = digest
    state.version = __version__
    state.oom_protected = set_oom_score_adj(proc.pid, -1000)
    state.save()
    problem = None
    if held:  # after a crash the holder starts the new server as it runs now, by these names
        try:
            holder.give_recipe(run_dir, _server_argv(
                state, plugin, state.nbd_socket, os.path.join(run_dir, "nbdkit.pid"),
                state.config_path, digest, held), env, timeout, [state.nbd_socket])
        except DeviceError as exc:
            problem = str(exc)
    if not wait_gone(old_pid, min(timeout, 30.0)):
        raise DeviceError(f"the new server (pid {proc.pid}) serves, but the old one (pid "
                          f"{old_pid}) has not exited: see {run_dir}/nbdkit.log.1")
    health = server_request(state, "health", timeout)
    return Restarted(old_pid, proc.pid, float(reply.get("paused_ms", 0.0)),
                     time.monotonic() - t0, int(health.get("restarts", 0)), problem)


def _server_argv(state: RunState, plugin: str, nbd_socket: str, pidfile: str,
                 config_path: str, digest: str, held: bool) -> list[str]:
    """The server's command line for these files: the new server's while it takes over
    (with the takeover keys added), and the holder's recipe once it serves."""
    argv = server_command(plugin, nbd_socket, state.control_socket, pidfile, config_path,
                          state.size, foreground=True, nbdkit=state.tool("nbdkit"),
                          config_sha256=digest, nbd_clients=False)
    argv.append(f"fuse={state.mountpoint}")
    if held:
        argv.append(f"holder={holder.socket_path(state.run_dir)}")
    return argv


def _wait_for(proc, path: str, timeout: float, log: str) -> None:
    """Until the new server listens for the handover (or dies saying why)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise DeviceError(f"restart refused, the old server serves on: the new server "
                              f"exited (status {proc.returncode}): {_last_error(log)}")
        if time.monotonic() > deadline:
            raise DeviceError(f"restart refused: the new server did not start in {timeout:g} s"
                              f" (log {log})")
        time.sleep(0.02)


def _wait_serving(proc, state: RunState, pidfile: str, timeout: float, log: str) -> None:
    """After "go": until the new server answers on the control socket as itself."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise DeviceError(f"the new server (pid {proc.pid}) exited after the handover: "
                              f"{_last_error(log)}; `agentzip-blk down --force`")
        if read_pidfile(pidfile) == proc.pid:
            with contextlib.suppress(DeviceError):
                if server_request(state, "ping", 2.0).get("pid") == proc.pid:
                    return
        if time.monotonic() > deadline:
            raise DeviceError(f"the new server (pid {proc.pid}) took the store but does not "
                              f"answer after {timeout:g} s; log {log}")
        time.sleep(0.02)


def _last_error(log: str) -> str:
    lines = [ln for ln in tail(log, 20).splitlines() if ln.strip()]
    for line in reversed(lines):
        if "agentzip" in line or "Error" in line:
            return line.strip()
    return lines[-1].strip() if lines else "no log"


def _remove(run_dir: str, names) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_dir, name))


def _kill(proc) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(10)
