"""Processes of the chain and of the tuner daemon: run a tool, spawn a helper in its own
session, wait for it, tell whether a pid is still the process we started, stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from .. import procfs
from ..errors import DeviceError, SetupError
from .rundir import open_private

# /proc/PID/stat states of a process that runs no code until SIGCONT
STOPPED_STATES = ("T", "t")


def tail(path: str, lines: int = 15) -> str:
    """The last lines of a log file ('' when missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.rstrip("\n").splitlines()[-lines:])


_OUR_ERROR = re.compile(r"\bagentzip_blk(?:\.\w+)+: (.+)$")  # "agentzip_blk.store.disk.DiskError: ..."


def our_error(log: str) -> str | None:
    """The message of the last agentzip_blk error a traceback in ``log`` ends with, if any:
    nbdkit prints the plugin's traceback over many lines; the operator needs its last one."""
    found = None
    for line in log.splitlines():
        m = _OUR_ERROR.search(line.strip())
        if m:
            found = m.group(1).strip()
    return found


def run_tool(argv: list[str], timeout: float = 60.0, what: str | None = None) -> str:
    """Run a short tool; return stdout; raise DeviceError with its stderr on failure."""
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except FileNotFoundError:
        raise DeviceError(f"{argv[0]}: not found") from None
    except PermissionError:
        raise DeviceError(f"{argv[0]}: permission denied") from None
    except subprocess.TimeoutExpired:
        raise DeviceError(f"{what or ' '.join(argv)}: timed out after {timeout:g}s") from None
    if r.returncode != 0:
        msg = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}")
        msg = " / ".join(msg.splitlines()[-3:])
        raise DeviceError(f"{what or os.path.basename(argv[0])} failed: {msg}")
    return r.stdout


def read_pidfile(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def spawn(argv: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    """Start a long-running helper detached in its own session, logging to ``log_path``."""
    with open_private(log_path, "ab") as log:  # 0600, never through a symlink
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env, start_new_session=True, close_fds=True)


def wait_ready(proc: subprocess.Popen, pidfile: str, paths: list[str], timeout: float,
                what: str, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rc = proc.poll()
        if rc is not None:
            log = tail(log_path)
            ours = our_error(log)
            if ours:  # the plugin refused to start (bad config, a refused tier file): say why
                raise SetupError(f"{what} refused to start: {ours} (log {log_path})")
            raise DeviceError(f"{what} exited with status {rc} during start-up; "
                              f"log {log_path}:\n{log}")
        if read_pidfile(pidfile) and all(os.path.exists(p) for p in paths):
            return
        if time.monotonic() > deadline:
            raise DeviceError(f"{what} not ready after {timeout:g}s; log {log_path}:\n"
                              f"{tail(log_path)}")
        time.sleep(0.05)


def cmdline_matches(pid: int, exe: str, must_contain: str | None) -> bool:
    argv = procfs.process_cmdline(pid)
    if not argv or os.path.basename(argv[0]) != os.path.basename(exe):
        return False
    return must_contain is None or any(must_contain in a for a in argv)


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def ours_alive(pid: int | None, exe: str, must_contain: str | None) -> bool:
    """``pid`` runs and is still the process we started (not a reused pid)."""
    return bool(pid) and pid_alive(pid) and cmdline_matches(pid, exe, must_contain)


def stop_process(pid: int | None, exe: str, must_contain: str | None, timeout: float,
                  what: str) -> None:
    """SIGTERM ``pid`` if it is still the process we started; SIGKILL after ``timeout``."""
    if not pid or not pid_alive(pid):
        return
    if not cmdline_matches(pid, exe, must_contain):
        # the pid was reused by something else: not ours, leave it alone
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if wait_gone(pid, timeout):
        return
    if cmdline_matches(pid, exe, must_contain):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    if not wait_gone(pid, 5.0):
        raise DeviceError(f"{what} (pid {pid}) did not exit")


def pid_alive(pid: int | None) -> bool:
    """True while any thread of ``pid`` runs: a killed process's leader turns zombie before
    its other threads have exited and closed its descriptors (a tier file's lock, the FUSE
    connection). Reaps it if it is our own dead child."""
    if not pid or pid <= 0:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    except OSError:
        pass
    return any(state not in ("Z", "X") for state in procfs.thread_states(pid))


def set_oom_score_adj(pid: int, value: int = -1000) -> bool:
    """Best effort: protect ``pid`` from the OOM killer. Returns True on success."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w", encoding="ascii") as f:
            f.write(str(value))
        return True
    except OSError:
        return False
