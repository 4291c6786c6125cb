"""The tuner as a process: `run` wires a Tuner to the host (the ledger, the cgroup backend,
the device's state and counters, signals, the heartbeat file) and restores what it wrote when
it stops; `agentzip-blk tune` calls it in the foreground, `up --tune` starts that in the
background (`start_daemon`, stopped by `down`: `stop_daemon`). One per run directory
(`acquire_instance`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable

import agentzip_blk

from ... import procfs
from ...errors import SetupError
from ...host.procs import pid_alive
from ...host.rundir import open_private
from ..tree import CGROUPFS, CgroupTree

TUNER_PID = "tuner.pid"
TUNER_LOG = "tuner.log"
TUNER_LOCK = "tuner.lock"


class TunerBusy(RuntimeError):
    """Another tuner already runs on this run directory."""


def acquire_instance(run_dir: str) -> int:
    """Hold RUN/tuner.lock for the life of this process (one tuner per run directory: it
    restores every ledger entry when it stops). Returns the fd to keep open.

    The lock, pid and log files are root's, 0600, and never opened through a symbolic link
    (open_private): a link planted in the run directory must not make root create, truncate
    or append to another file."""
    import fcntl

    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    lock = os.path.join(run_dir, TUNER_LOCK)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise SetupError(f"{lock}: {e.strerror}: refusing it (a symbolic link?)") from None
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = running_pid(run_dir)
        raise TunerBusy(f"a tuner already runs on {run_dir}" + (f" (pid {pid})" if pid else "") +
                        ": stop it first (Ctrl-C, or `agentzip-blk down`)") from None
    try:
        with open_private(os.path.join(run_dir, TUNER_PID)) as f:
            f.write(f"{os.getpid()}\n")
    except OSError as e:
        os.close(fd)
        raise SetupError(f"{os.path.join(run_dir, TUNER_PID)}: {e.strerror}: refusing it "
                         f"(a symbolic link?)") from None
    return fd


def release_instance(run_dir: str, fd: int) -> None:
    try:
        mine = _read_pid(run_dir) == os.getpid()
    except (OSError, ValueError):
        mine = False
    if mine:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(run_dir, TUNER_PID))
    os.close(fd)


def _is_tuner(pid: int, run_dir: str) -> bool:
    argv = procfs.process_cmdline(pid)
    return "tune" in argv and any(run_dir in a for a in argv)


def _read_pid(run_dir: str) -> int:
    """RUN/tuner.pid, read without following a link (ValueError/OSError when unusable)."""
    fd = os.open(os.path.join(run_dir, TUNER_PID),
                 os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, encoding="ascii", errors="replace") as f:
        return int(f.read(32).strip() or 0)


def running_pid(run_dir: str) -> int | None:
    """The pid of the tuner of *run_dir* if it runs."""
    try:
        pid = _read_pid(run_dir)
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and pid_alive(pid) and _is_tuner(pid, run_dir) else None


def scopes_reader(config_path: str | None, config, log: Callable[[str], None]):
    """Scopes re-read from the file every step, so `scope` edits apply at once; a broken
    edit keeps the last good list (and says so once)."""
    from ...config import ConfigError
    from ..scopes import list_scopes

    last = {"scopes": list(config.scopes), "error": None}

    def read():
        if config_path is None or not os.path.exists(config_path):
            return last["scopes"]
        try:
            last["scopes"] = list_scopes(config_path)
            last["error"] = None
        except ConfigError as e:
            if str(e) != last["error"]:
                log(f"tune: config unreadable, keeping the previous scopes: {e}")
            last["error"] = str(e)
        return last["scopes"]

    return read


def _print(line: str) -> None:
    print(line, flush=True)


def run(run_dir: str, config, config_path: str | None, settings, *, cgroup_root: str = "/",
        cgroup_tree: CgroupTree = CGROUPFS, steps: int | None = None, keep: bool = False,
        heartbeat: str | None = None, without_device: bool = False,
        log: Callable[[str], None] = _print) -> int:
    """Tune the scoped cgroups until SIGTERM, SIGHUP or Ctrl-C (or ``steps`` decisions per
    cgroup), one log line per decision; then put back every setting written, unless
    ``keep`` (the ledger keeps them for `down`). ``heartbeat``: a file written after every
    step (Kubernetes probes). ``cgroup_root``: where the cgroup hierarchies are mounted;
    ``cgroup_tree``: what kind of tree they are (cgroupfs; the tests' plain files).
    Raises TunerBusy when another tuner holds the run directory."""
    from ... import procfs
    from ...config.quantities import format_bytes
    from ...datapath import control
    from ...host.heartbeat import write as write_heartbeat
    from ...host.runstate import RunState
    from ..backends import open_backend
    from ..fs import detect
    from ..ledger import Ledger
    from .loop import Tuner

    fd = acquire_instance(run_dir)
    try:
        ledger = Ledger(run_dir, cgroup_tree)
        backend = open_backend(writer=ledger, controller=detect(cgroup_root, tree=cgroup_tree))
        ledger.rel_of = backend.rel_of

        def state():
            try:
                return RunState.load(run_dir)
            except Exception:
                return None

        def device_ok() -> bool:
            st = state()
            return st is not None and procfs.swap_area(st.device) is not None

        def pingpong():
            st = state()
            if st is None or not st.control_socket:
                return None
            return control.request(st.control_socket, "stats", timeout=2.0).get("pingpong")

        def protected():
            st = state()
            return [p for p in ((st.nbdkit_pid, st.nbdfuse_pid) if st else ()) if p]

        tuner = Tuner(backend, ledger, scopes_reader(config_path, config, log), settings,
                      pingpong=pingpong, device_ok=None if without_device else device_ok,
                      protected_pids=protected, log=log)
        log(f"tune: {backend.kind} memory hierarchy at {backend.mount}; mode {settings.mode}, "
            f"interval {settings.interval:g}s, pressure target {settings.pressure_target * 100:g}%, "
            f"floor {format_bytes(settings.floor)}, max probe {settings.max_probe:.0%}, "
            f"grace {settings.grace:g}s, hold {settings.hold:g}s; config {config_path or '(defaults)'}, "
            f"ledger {ledger.file}")
        stop = threading.Event()

        def on_signal(signum, frame):
            # raise, so that a long synchronous reclaim write is interrupted too (v1 limit
            # writes give up on a pending signal); the ledger is write-ahead, so stopping
            # anywhere leaves a record that restores correctly
            stop.set()
            raise KeyboardInterrupt(f"signal {signum}")

        def beat() -> None:
            # ready while the device is swap (or without_device): the tuner has work then
            if heartbeat:
                ok = without_device or device_ok()
                try:
                    write_heartbeat(heartbeat, ok, "" if ok else
                                    f"no swap device attached from {run_dir}")
                except OSError as e:
                    log(f"tune: heartbeat {heartbeat}: {e.strerror or e}")

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            tuner.run(stop, steps=steps, after_step=beat)
        except KeyboardInterrupt:
            pass
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            # no signal may cut the restore short
            ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGHUP,
                                                                      signal.SIGINT)}
            try:
                if keep:
                    log(f"tune: stopped; settings kept (recorded in {ledger.file}; "
                        f"`agentzip-blk down` restores them)")
                else:
                    tuner.restore()
            finally:
                for s, h in ignored.items():
                    signal.signal(s, h)
    finally:
        release_instance(run_dir, fd)
    return 0


def start_daemon(run_dir: str, config_path: str | None, extra: list[str] | None = None,
                 timeout: float = 3.0) -> int:
    """Start ``agentzip-blk tune`` in the background (own session), logging to RUN/tuner.log."""
    import subprocess
    import sys

    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    argv = [sys.executable, "-m", "agentzip_blk.cli"]
    if config_path:
        argv += ["--config", os.path.abspath(config_path)]
    argv += ["--run-dir", run_dir, "tune"] + list(extra or [])
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(agentzip_blk.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    log = open_private(os.path.join(run_dir, TUNER_LOG), "ab")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)
    finally:
        log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the tuner exited at once (status {proc.returncode}); see "
                               f"{os.path.join(run_dir, TUNER_LOG)}")
        if running_pid(run_dir) == proc.pid:
            return proc.pid
        time.sleep(0.05)
    return proc.pid


def stop_daemon(run_dir: str, timeout: float = 30.0) -> int | None:
    """SIGTERM the tuner of *run_dir* (it restores what it wrote), SIGKILL after *timeout*."""
    pid = running_pid(os.path.abspath(run_dir))
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid) and _is_tuner(pid, os.path.abspath(run_dir)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pid
