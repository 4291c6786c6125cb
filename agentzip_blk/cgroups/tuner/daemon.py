"""The tuner as a background process (`up --tune`, stopped by `down`): one per run directory."""

from __future__ import annotations

import contextlib
import os
import time

import agentzip_blk

from ... import procfs
from ...errors import SetupError
from ...host.procs import pid_alive
from ...host.rundir import open_private

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
    import signal

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
