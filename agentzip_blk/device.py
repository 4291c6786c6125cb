"""Attach and detach the swap device: nbdkit -> (kernel nbd | nbdfuse + loop) -> swap.

State lives in a run directory (``config.device.run_dir``, default /run/agentzip)
so that ``status`` and ``down`` work from any shell::

    RUN/state.json      RunState (pids, sockets, mountpoint, loop device, ...)
    RUN/nbd.sock        nbdkit's NBD unix socket
    RUN/control.sock    the plugin's JSON control socket
    RUN/nbdkit.{pid,log}, RUN/nbdfuse.{pid,log}
    RUN/mnt/nbd         the nbdfuse file that backs the loop device

``up`` starts nbdkit (``--swap``: mlockall) in its own session, attaches the
device (kernel nbd + ``nbd-client -swap`` when /dev/nbd0 exists, else nbdfuse +
``losetup --direct-io=on``), runs ``mkswap`` and ``swapon --discard=pages -p
PRIO``. A failure midway rolls back what was done. ``down`` undoes it in the
safe order: swapoff, ``losetup -d`` / ``nbd-client -d``, ``fusermount3 -u``,
stop nbdkit. Nothing here stops the server while /proc/swaps lists our device.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

from . import control, system
from .server_cmd import default_plugin_path, is_python_plugin, plugin_env, server_command
from .system import SetupError

__all__ = [
    "DEFAULT_RUN_DIR",
    "DEFAULT_PRIORITY",
    "DeviceError",
    "AlreadyAttached",
    "NotAttached",
    "SwapoffRefused",
    "RunState",
    "TOOLS",
    "up",
    "down",
    "status",
    "health",
    "attached",
    "load_state",
    "swapoff_fits",
    "tail",
]

DEFAULT_RUN_DIR = "/run/agentzip"
DEFAULT_PRIORITY = 100
STATE_FILE = "state.json"
SWAP_LABEL = "agentzip"

# Tool names (or absolute paths); ``up``/``down`` take a ``tools`` dict that overrides these.
TOOLS: dict[str, str] = {
    "nbdkit": "nbdkit",
    "nbdfuse": "nbdfuse",
    "fusermount3": "fusermount3",
    "losetup": "losetup",
    "mkswap": "mkswap",
    "swapon": "swapon",
    "swapoff": "swapoff",
    "nbd-client": "nbd-client",
}

# /proc/PID/stat states of a process that runs no code until SIGCONT
STOPPED_STATES = ("T", "t")
# `status`, `doctor` and the exporter wait this long for the chain to answer
HEALTH_TIMEOUT = 2.0

# swapoff needs the swapped bytes back in RAM; keep this much on top of them
SWAPOFF_MARGIN_MIN = 128 * 1024 * 1024
SWAPOFF_MARGIN_FRACTION = 0.05  # of MemTotal


# nbdfuse has no mlock option, and mlockall() does not survive execve(). A page of nbdfuse
# swapped out onto the very device it serves deadlocks the swap-in. This preload library
# locks nbdfuse from its first instruction (ONFAULT: only pages it touches, so thread stacks
# and malloc arenas stay small) and marks it an I/O flusher where permitted. It also refuses
# SIGTERM, SIGINT, SIGHUP and SIGPIPE with a line in nbdfuse's log: libfuse installs its
# exit-on-signal handlers only over SIG_DFL (lib/fuse_signals.c), so ours stay, and nbdfuse
# ends only when `down` unmounts the file (or by SIGKILL). Built with cc into the run
# directory at `up`; without a compiler nbdfuse runs unprotected and `status` warns.
_MLOCK_SHIM_C = r"""
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#ifndef MCL_ONFAULT
#define MCL_ONFAULT 4
#endif
#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#endif
static void agentzip_refuse(int sig)
{
    static const char msg[] = "agentzip: nbdfuse refused a signal (TERM/INT/HUP/PIPE): "
                              "`agentzip-blk down` unmounts and stops it\n";
    (void) sig;
    (void) !write(2, msg, sizeof msg - 1);
}
__attribute__((constructor)) static void agentzip_lock_memory(void)
{
    static const int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGPIPE};
    struct sigaction sa;
    unsigned i;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = agentzip_refuse;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        (void) sigaction(sigs[i], &sa, 0);
    (void) mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT);
    (void) prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0);
}
"""


class DeviceError(RuntimeError):
    """A runtime failure of the attach/detach chain (a tool failed, a timeout)."""


class AlreadyAttached(SetupError):
    """``up`` while a device from this run directory is attached and alive."""


class NotAttached(SetupError):
    """``down``/``stats`` without a device attached in this run directory."""


class SwapoffRefused(DeviceError):
    """swapoff would need more memory than is available."""


@dataclass
class RunState:
    run_dir: str
    plugin: str
    nbd_socket: str
    control_socket: str | None = None
    config_path: str | None = None
    size: int = 0
    swap_priority: int = DEFAULT_PRIORITY
    mode: str = "fuse"              # "fuse" (nbdfuse + loop) or "nbd" (kernel nbd)
    nbdkit_pid: int | None = None
    nbdfuse_pid: int | None = None
    mountpoint: str | None = None
    fuse_file: str | None = None
    loop_device: str | None = None
    nbd_device: str | None = None
    device: str | None = None       # the block device used as swap
    mkswap_done: bool = False
    swap_on: bool = False
    started: float = field(default_factory=time.time)
    tools: dict = field(default_factory=dict)
    mlock: bool = True              # nbdkit --swap
    oom_protected: bool = False     # oom_score_adj -1000 set on nbdkit (and nbdfuse)
    nbdfuse_locked: bool = False    # nbdfuse runs with the mlockall preload shim
    rotational: bool = False        # device.rotational: flag the loop device before swapon

    # -- persistence ---------------------------------------------------------------
    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, STATE_FILE)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, run_dir: str) -> "RunState | None":
        path = os.path.join(run_dir, STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise DeviceError(f"cannot read {path}: {e}; remove it if nothing is attached") from None
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["run_dir"] = run_dir
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    def tool(self, name: str) -> str:
        return self.tools.get(name) or TOOLS[name]


def load_state(run_dir: str) -> RunState | None:
    return RunState.load(run_dir)


# --- helpers ------------------------------------------------------------------------

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


def _resolve_tool(name: str, tools: dict) -> str:
    t = tools.get(name) or TOOLS[name]
    return system.which(t) or t


def _run(argv: list[str], timeout: float = 60.0, what: str | None = None) -> str:
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


def _read_pidfile(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _spawn(argv: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    """Start a long-running helper detached in its own session, logging to ``log_path``."""
    with open(log_path, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env, start_new_session=True, close_fds=True)


def _wait_ready(proc: subprocess.Popen, pidfile: str, paths: list[str], timeout: float,
                what: str, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rc = proc.poll()
        if rc is not None:
            raise DeviceError(f"{what} exited with status {rc} during start-up; "
                              f"log {log_path}:\n{tail(log_path)}")
        if _read_pidfile(pidfile) and all(os.path.exists(p) for p in paths):
            return
        if time.monotonic() > deadline:
            raise DeviceError(f"{what} not ready after {timeout:g}s; log {log_path}:\n"
                              f"{tail(log_path)}")
        time.sleep(0.05)


def _cmdline_matches(pid: int, exe: str, must_contain: str | None) -> bool:
    argv = system.process_cmdline(pid)
    if not argv or os.path.basename(argv[0]) != os.path.basename(exe):
        return False
    return must_contain is None or any(must_contain in a for a in argv)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while system.pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _is_mounted(path: str | None) -> bool:
    if not path:
        return False
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and system._unescape_proc(parts[4]) == real:
                    return True
    except OSError:
        pass
    return False


def _loop_name(dev: str | None) -> str | None:
    return os.path.basename(dev) if dev else None


def _loop_backing(dev: str | None) -> str | None:
    """Backing file of a loop device, or None when the loop device is not set up."""
    name = _loop_name(dev)
    if not name:
        return None
    try:
        with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8",
                  errors="surrogateescape") as f:
            return f.read().strip()
    except OSError:
        return None


def _loop_flag(dev: str | None, attribute: str) -> bool | None:
    """A 0/1 attribute of the loop device in sysfs (e.g. loop/dio); None when unknown."""
    name = _loop_name(dev)
    if not name:
        return None
    try:
        with open(f"/sys/block/{name}/{attribute}", encoding="ascii") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def _loop_dio(dev: str | None) -> bool | None:
    return _loop_flag(dev, "loop/dio")


def _loop_rotational(dev: str | None) -> bool | None:
    return _loop_flag(dev, "queue/rotational")


def _mark_rotational(dev: str) -> bool:
    """Flag the loop device rotational (`device.rotational`), before swapon, which reads the
    flag once: swap-in then reads ahead 2^vm.page-cluster neighbouring slots per request
    instead of following one process's address space. Every request through the chain costs
    ~300 us whatever its size, so on a sequential re-read fewer larger reads win (demo: 12k
    reads of ~19.5 KiB instead of 37k of ~6.4 KiB, swap-in ~2x). Off by default: the
    neighbours belong to any sandbox and are charged to their cgroups, and a tools/load.py
    run with it ended in memory-cgroup OOM kills (BENCHMARKS.md; not yet pinned on it).
    Best effort: a read-only sysfs only costs speed."""
    try:
        with open(f"/sys/block/{_loop_name(dev)}/queue/rotational", "w", encoding="ascii") as f:
            f.write("1")
    except OSError:
        return False
    return _loop_rotational(dev) is True


def _loop_is_ours(state: RunState) -> bool:
    backing = _loop_backing(state.loop_device)
    if backing is None or not state.fuse_file:
        return False
    backing = backing.removesuffix(" (deleted)")
    return os.path.realpath(backing) == os.path.realpath(state.fuse_file) or \
        backing == state.fuse_file


_locked_bytes = system.process_locked


def _build_mlock_shim(run_dir: str) -> str | None:
    """Compile the mlockall preload library into ``run_dir``; None without a C compiler."""
    cc = system.which("cc") or system.which("gcc")
    if cc is None:
        return None
    src = os.path.join(run_dir, "agentzip-mlock.c")
    lib = os.path.join(run_dir, "agentzip-mlock.so")
    with open(src, "w", encoding="ascii") as f:
        f.write(_MLOCK_SHIM_C)
    try:
        _run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src], timeout=60, what="cc (mlock shim)")
    except DeviceError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(src)
    return lib


def _free_nbd_device() -> str:
    i = 0
    while os.path.exists(f"/dev/nbd{i}"):
        if not os.path.exists(f"/sys/block/nbd{i}/pid"):
            return f"/dev/nbd{i}"
        i += 1
    raise DeviceError("no free /dev/nbdN device (all connected): disconnect one or "
                      "modprobe nbd nbds_max=N")


def swapoff_fits(used: int, mem: dict[str, int]) -> tuple[bool, int, int]:
    """Whether swapping ``used`` bytes back in fits: (ok, available, needed incl. margin)."""
    avail = mem.get("MemAvailable", mem.get("MemFree", 0))
    margin = max(SWAPOFF_MARGIN_MIN, int(mem.get("MemTotal", 0) * SWAPOFF_MARGIN_FRACTION))
    needed = used + margin
    return (used == 0 or avail >= needed), avail, needed


def _fmt(n: int) -> str:
    try:
        from .units import format_bytes
        return format_bytes(n)
    except Exception:  # units.py missing or different: plain MiB
        return f"{n / 1048576:.1f}M"


@contextlib.contextmanager
def _locked(run_dir: str) -> Iterator[None]:
    """Serialise up/down on one run directory."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(run_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SetupError(f"another agentzip-blk up/down is running on {run_dir}: "
                             f"wait for it to finish") from None
        yield
    finally:
        os.close(fd)


def _config_device(config) -> tuple[int | None, int | None, str | None]:
    dev = getattr(config, "device", None) if config is not None else None
    return (getattr(dev, "size", None), getattr(dev, "swap_priority", None),
            getattr(dev, "run_dir", None))


def resolve_run_dir(config=None, run_dir: str | None = None) -> str:
    if run_dir:
        return os.path.abspath(run_dir)
    _, _, cfg_dir = _config_device(config)
    return os.path.abspath(cfg_dir or DEFAULT_RUN_DIR)


def _liveness(state: RunState) -> dict:
    """What of ``state`` still runs. A leftover loop device or dead FUSE mount alone is
    stale (``up`` cleans it); a live process or an active swap area is not."""
    return {
        "nbdkit": _ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket),
        "nbdfuse": _ours_alive(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file),
        "swap": system.swap_area(state.device) is not None,
    }


def _ours_alive(pid: int | None, exe: str, must_contain: str | None) -> bool:
    """``pid`` runs and is still the process we started (not a reused pid)."""
    return bool(pid) and system.pid_alive(pid) and _cmdline_matches(pid, exe, must_contain)


# --- teardown -------------------------------------------------------------------------

def _stop_process(pid: int | None, exe: str, must_contain: str | None, timeout: float,
                  what: str) -> None:
    """SIGTERM ``pid`` if it is still the process we started; SIGKILL after ``timeout``."""
    if not pid or not system.pid_alive(pid):
        return
    if not _cmdline_matches(pid, exe, must_contain):
        # the pid was reused by something else: not ours, leave it alone
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if _wait_gone(pid, timeout):
        return
    if _cmdline_matches(pid, exe, must_contain):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    if not _wait_gone(pid, 5.0):
        raise DeviceError(f"{what} (pid {pid}) did not exit")


def _stop_server(state: RunState, timeout: float) -> None:
    """The shutdown verb (refused by the server while swap points at it); when the control
    socket does not answer, SIGTERM, which the server honours once no swap area is ours,
    and SIGKILL after ``timeout``."""
    pid = state.nbdkit_pid
    if not _ours_alive(pid, state.tool("nbdkit"), state.nbd_socket):
        return
    if state.control_socket and system.process_state(pid) not in STOPPED_STATES:
        try:
            control.request(state.control_socket, "shutdown", timeout=min(timeout, 5.0))
        except control.ControlError:
            pass
        else:
            if _wait_gone(pid, timeout):
                return
    _stop_process(pid, state.tool("nbdkit"), state.nbd_socket, timeout, "nbdkit")


def _teardown(state: RunState, timeout: float = 30.0,
              swapoff_timeout: float | None = None) -> None:
    """Undo whatever ``state`` records, in the safe order. Raises on the first failure
    that makes continuing unsafe (swap still on, loop still attached). swapoff brings every
    page back in, which can take long: by default it may take an hour."""
    errors: list[str] = []

    # 1. swapoff
    if system.swap_area(state.device) is not None:
        _run([_resolve_tool("swapoff", state.tools), state.device],
             timeout=swapoff_timeout or max(timeout, 3600.0), what=f"swapoff {state.device}")
        if system.swap_area(state.device) is not None:
            raise DeviceError(f"{state.device} is still in /proc/swaps after swapoff")
    state.swap_on = False
    with contextlib.suppress(OSError):
        state.save()

    # 2. detach the block device
    if state.mode == "nbd" and state.nbd_device:
        if os.path.exists(f"/sys/block/{os.path.basename(state.nbd_device)}/pid"):
            _run([_resolve_tool("nbd-client", state.tools), "-d", state.nbd_device],
                 timeout=timeout, what=f"nbd-client -d {state.nbd_device}")
        state.nbd_device = None
    if state.loop_device:
        if _loop_is_ours(state):
            _run([_resolve_tool("losetup", state.tools), "-d", state.loop_device],
                 timeout=timeout, what=f"losetup -d {state.loop_device}")
            deadline = time.monotonic() + timeout
            while _loop_is_ours(state):
                if time.monotonic() > deadline:
                    raise DeviceError(f"{state.loop_device} still attached after losetup -d")
                time.sleep(0.05)
        state.loop_device = None
    with contextlib.suppress(OSError):
        state.save()

    # 3. unmount the FUSE file; nbdfuse exits on unmount
    if _is_mounted(state.mountpoint):
        try:
            _run([_resolve_tool("fusermount3", state.tools), "-u", state.mountpoint],
                 timeout=timeout, what=f"fusermount3 -u {state.mountpoint}")
        except DeviceError as e:
            # a dead nbdfuse leaves a "transport endpoint not connected" mount: lazy unmount
            try:
                _run([_resolve_tool("fusermount3", state.tools), "-u", "-z", state.mountpoint],
                     timeout=timeout, what=f"fusermount3 -u -z {state.mountpoint}")
            except DeviceError:
                errors.append(str(e))
    if state.nbdfuse_pid:
        if not _wait_gone(state.nbdfuse_pid, 10.0):
            _stop_process(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file, 10.0,
                          "nbdfuse")
        state.nbdfuse_pid = None
    if state.mountpoint and not _is_mounted(state.mountpoint):
        with contextlib.suppress(OSError):
            os.rmdir(state.mountpoint)
    with contextlib.suppress(OSError):
        state.save()

    # 4. stop nbdkit -- never while a swap area still points at our device
    if state.nbdkit_pid:
        if system.swap_area(state.device) is not None:
            raise DeviceError(f"refusing to stop nbdkit: {state.device} is still in /proc/swaps")
        if _loop_is_ours(state):
            raise DeviceError(f"refusing to stop nbdkit: {state.loop_device} is still attached")
        _stop_server(state, timeout)
        state.nbdkit_pid = None

    if errors:
        with contextlib.suppress(OSError):
            state.save()
        raise DeviceError("; ".join(errors))

    for name in (STATE_FILE, "nbdkit.pid", "nbdfuse.pid", "agentzip-mlock.so"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(state.run_dir, name))
    for sock in (state.nbd_socket, state.control_socket):
        if sock and os.path.dirname(os.path.abspath(sock)) == state.run_dir:
            with contextlib.suppress(OSError):
                os.unlink(sock)


# --- up ---------------------------------------------------------------------------------

def required_tools(kernel_nbd: bool | None = None, tools: dict | None = None) -> list[str]:
    tools = {**TOOLS, **(tools or {})}
    if kernel_nbd is None:
        kernel_nbd = system.nbd_kernel_available()
    names = ["nbdkit", "mkswap", "swapon", "swapoff"]
    names += ["nbd-client"] if kernel_nbd else ["nbdfuse", "fusermount3", "losetup"]
    return [tools[n] for n in names]


def check_up_preconditions(*, allow_zswap: bool = False, plugin: str | None = None,
                           tools: dict | None = None, kernel_nbd: bool | None = None) -> None:
    """Raise SetupError when ``up`` cannot work here (non-root, missing tools, zswap)."""
    system.require_root("agentzip-blk up")
    system.require_tools(required_tools(kernel_nbd, tools))
    if plugin is None or is_python_plugin(plugin):
        system.require_nbdkit_plugin("python", (tools or {}).get("nbdkit", TOOLS["nbdkit"]))
        path = plugin or default_plugin_path()
        if not os.path.isfile(path):
            raise SetupError(f"nbdkit plugin {path} not found: reinstall agentzip-blk "
                             f"(pip install -e .) or set AGENTZIP_PLUGIN")
    if system.zswap_enabled() and not allow_zswap:
        raise SetupError("zswap is enabled and would compress pages before they reach the "
                         f"device (double compression): {system.ZSWAP_DISABLE_HINT}, "
                         "or pass --allow-zswap")


def up(config=None, config_path: str | None = None, run_dir: str | None = None,
       priority: int | None = None, size: int | None = None, *, plugin: str | None = None,
       allow_zswap: bool = False, tools: dict | None = None, kernel_nbd: bool | None = None,
       timeout: float = 30.0, mlock: bool = True,
       fail_after: str | None = None) -> RunState:
    """Start the server and attach it as swap. Returns the saved RunState.

    ``plugin``: path of a Python plugin (default nbdkit/agentzip_plugin.py) or an nbdkit
    plugin name such as ``memory`` (tests). ``tools`` overrides tool names/paths.
    ``kernel_nbd`` forces the attach mode (default: kernel nbd when /dev/nbd0 exists).
    ``mlock``: pass ``--swap`` so nbdkit mlockall()s itself (see docs: costs nbdkit's whole
    192 MiB .bss plus every thread stack in RAM; a plugin that calls
    mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT) itself can run with ``mlock=False``).
    ``fail_after`` (tests) raises right after the named step to exercise the rollback.
    """
    system.require_root("agentzip-blk up")
    tools = dict(tools or {})
    cfg_size, cfg_prio, _ = _config_device(config)
    run_dir = resolve_run_dir(config, run_dir)
    size = int(size if size is not None else (cfg_size or 0))
    if size <= 0:
        raise SetupError("device size unknown: set device.size in the config or pass --size")
    if size % 4096:
        raise SetupError(f"device size {size} is not a multiple of 4096")
    priority = int(priority if priority is not None else
                   (cfg_prio if cfg_prio is not None else DEFAULT_PRIORITY))
    if not -1 <= priority <= 32767:
        raise SetupError(f"swap priority {priority} out of range (-1..32767)")
    if kernel_nbd is None:
        kernel_nbd = system.nbd_kernel_available()
    plugin = plugin or default_plugin_path()
    check_up_preconditions(allow_zswap=allow_zswap, plugin=plugin, tools=tools,
                           kernel_nbd=kernel_nbd)
    nbd_socket = os.path.join(run_dir, "nbd.sock")
    if len(nbd_socket.encode()) > 100:
        raise SetupError(f"run directory path too long for a unix socket: {run_dir}")

    with _locked(run_dir):
        old = RunState.load(run_dir)
        if old is not None:
            live = _liveness(old)
            if any(live.values()):
                what = ", ".join(k for k, v in live.items() if v)
                raise AlreadyAttached(f"a device is already attached from {run_dir} "
                                      f"({what} alive): run `agentzip-blk down` first")
            # stale state: nothing alive; clear leftovers (sockets, state file)
            _teardown(old, timeout)
        for name in ("nbd.sock", "control.sock", "nbdkit.pid", "nbdfuse.pid"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(run_dir, name))

        control = os.path.join(run_dir, "control.sock") if is_python_plugin(plugin) else None
        if config is not None:
            # The server must run on exactly the config the caller validated (which may not
            # be a file at all): hand it over as a file in the run directory.
            config_path = _write_effective_config(config, run_dir)
        state = RunState(run_dir=run_dir, plugin=plugin, nbd_socket=nbd_socket,
                         control_socket=control,
                         config_path=os.path.abspath(config_path) if config_path else None,
                         size=size, swap_priority=priority,
                         mode="nbd" if kernel_nbd else "fuse", tools=tools, mlock=mlock,
                         rotational=bool(config is not None and config.device.rotational))
        state.save()
        try:
            _up_steps(state, timeout, fail_after)
        except BaseException as exc:
            try:
                _teardown(state, timeout)
            except Exception as rb:  # keep the state so that `down` can finish the job
                raise DeviceError(f"{exc}; rollback failed too: {rb} (state kept in "
                                  f"{state.path}; fix and run `agentzip-blk down`)") from exc
            raise
        return state


def _write_effective_config(config, run_dir: str) -> str:
    import yaml

    path = os.path.join(run_dir, "config.yaml")
    with open(path, "w") as f:
        f.write("# the config this server was started with (written by agentzip-blk up)\n")
        yaml.safe_dump(config.to_dict(), f, sort_keys=False)
    return path


def _server_request(state: RunState, cmd: str, timeout: float, **args) -> dict:
    try:
        return control.request(state.control_socket, cmd, timeout=timeout, **args)
    except control.ControlError as exc:
        raise DeviceError(f"nbdkit control {cmd}: {exc}; log {state.run_dir}/nbdkit.log") from None


def _inject(step: str, fail_after: str | None) -> None:
    if fail_after == step:
        raise DeviceError(f"injected failure after {step}")


def _up_steps(state: RunState, timeout: float, fail_after: str | None) -> None:
    run_dir, tools = state.run_dir, state.tools
    # 1. nbdkit, detached in its own session, memory locked
    nbdkit = _resolve_tool("nbdkit", tools)
    pidfile = os.path.join(run_dir, "nbdkit.pid")
    argv = server_command(state.plugin, state.nbd_socket, state.control_socket, pidfile,
                          state.config_path, state.size, foreground=True, nbdkit=nbdkit,
                          mlock=state.mlock)
    log = os.path.join(run_dir, "nbdkit.log")
    proc = _spawn(argv, log, env=plugin_env())
    state.nbdkit_pid = proc.pid
    state.save()
    ready = [state.nbd_socket] + ([state.control_socket] if state.control_socket else [])
    _wait_ready(proc, pidfile, ready, timeout, "nbdkit", log)
    if state.control_socket:
        _server_request(state, "health", timeout)  # serving, not only listening
    # best effort: needs CAP_SYS_RESOURCE (missing in some containers)
    state.oom_protected = system.set_oom_score_adj(proc.pid, -1000)
    state.save()
    _inject("nbdkit", fail_after)

    # 2. block device
    if state.mode == "nbd":
        dev = _free_nbd_device()
        state.nbd_device = dev
        state.save()
        _run([_resolve_tool("nbd-client", tools), "-unix", state.nbd_socket, dev,
              "-block-size", "4096", "-swap"], timeout=timeout, what=f"nbd-client {dev}")
        state.device = dev
        state.save()
    else:
        mnt = os.path.join(run_dir, "mnt")
        os.makedirs(mnt, mode=0o700, exist_ok=True)
        if _is_mounted(mnt):
            raise DeviceError(f"{mnt} is already a mount point: fusermount3 -u {mnt}")
        state.mountpoint = mnt
        state.fuse_file = os.path.join(mnt, "nbd")
        fuse_pidfile = os.path.join(run_dir, "nbdfuse.pid")
        flog = os.path.join(run_dir, "nbdfuse.log")
        fenv = None
        shim = _build_mlock_shim(run_dir) if state.mlock else None
        if shim:
            fenv = dict(os.environ)
            fenv["LD_PRELOAD"] = (shim + " " + fenv["LD_PRELOAD"]).strip() \
                if fenv.get("LD_PRELOAD") else shim
        fproc = _spawn([_resolve_tool("nbdfuse", tools), "-P", fuse_pidfile, state.fuse_file,
                        "--unix", state.nbd_socket], flog, env=fenv)
        state.nbdfuse_pid = fproc.pid
        state.save()
        _wait_ready(fproc, fuse_pidfile, [], timeout, "nbdfuse", flog)
        state.oom_protected = system.set_oom_score_adj(fproc.pid, -1000) and state.oom_protected
        state.nbdfuse_locked = _locked_bytes(fproc.pid) > 0
        state.save()
        st = os.stat(state.fuse_file)
        if st.st_size != state.size:
            raise DeviceError(f"{state.fuse_file} has size {st.st_size}, expected {state.size}")
        _inject("nbdfuse", fail_after)

        out = _run([_resolve_tool("losetup", tools), "--direct-io=on", "--show", "-f",
                    state.fuse_file], timeout=timeout, what="losetup")
        loop = out.strip().splitlines()[-1].strip() if out.strip() else ""
        if not loop.startswith("/dev/loop"):
            raise DeviceError(f"losetup printed no loop device: {out!r}")
        state.loop_device = state.device = loop
        state.save()
        if _loop_dio(loop) is not True:
            raise DeviceError(f"direct I/O is off on {loop} (/sys/block/{_loop_name(loop)}/"
                              "loop/dio): without it every swapped page also stays in the "
                              "page cache and no memory is saved")
        if state.rotational:
            _mark_rotational(loop)
        _inject("losetup", fail_after)

    # 3. mkswap + swapon, the server told first which device it must not die under
    _run([_resolve_tool("mkswap", tools), "-L", SWAP_LABEL, state.device], timeout=timeout,
         what=f"mkswap {state.device}")
    state.mkswap_done = True
    state.save()
    _inject("mkswap", fail_after)
    if state.control_socket:
        _server_request(state, "guard", timeout, device=state.device)
    _run([_resolve_tool("swapon", tools), "--discard=pages", "-p", str(state.swap_priority),
          state.device], timeout=timeout, what=f"swapon {state.device}")
    if system.swap_area(state.device) is None:
        raise DeviceError(f"swapon succeeded but {state.device} is not in /proc/swaps")
    state.swap_on = True
    state.save()
    _inject("swapon", fail_after)


# --- down ----------------------------------------------------------------------------

def down(run_dir: str | None = None, force: bool = False, *, config=None,
         timeout: float = 30.0) -> dict:
    """Detach and stop. Refuses swapoff when MemAvailable cannot take back our swapped
    bytes (plus a margin) unless ``force``. Returns a summary dict."""
    run_dir = resolve_run_dir(config, run_dir)
    system.require_root("agentzip-blk down")
    with _locked(run_dir):
        state = RunState.load(run_dir)
        if state is None:
            _release_cgroups(run_dir)  # a tuner may have run without a device
            raise NotAttached(f"no device attached from {run_dir} (no {STATE_FILE})")
        area = system.swap_area(state.device)
        used = area.used if area else 0
        given_up = False
        if area is not None and not force:
            ok, avail, needed = swapoff_fits(used, system.meminfo())
            if not ok:
                raise SwapoffRefused(
                    f"swapoff would bring {_fmt(used)} back into RAM but only {_fmt(avail)} is "
                    f"available (need {_fmt(needed)} with margin): free memory first, or "
                    f"`agentzip-blk down --force`")
            h = health(state)
            if not h["ok"]:
                raise DeviceError("the swap server is not healthy, so swapoff could wait for "
                                  "ever or lose pages: " + "; ".join(h["problems"]) +
                                  "; `agentzip-blk down --force` gives up what it cannot read")
        t0 = time.monotonic()
        cgroups = _release_cgroups(run_dir)
        if force and (area is not None or _liveness(state)["nbdkit"]):
            given_up = _unwedge(state)
        _teardown(state, timeout, swapoff_timeout=max(timeout, 120.0) if given_up else None)
        _remove_tier_file(state)
        return {"run_dir": run_dir, "device": state.device, "swapped_in": used,
                "seconds": round(time.monotonic() - t0, 3), "cgroups": cgroups,
                "server_lost": given_up}


def _unwedge(state: RunState) -> bool:
    """`down --force` on a chain that does not answer. A stopped process may only be paused:
    SIGCONT and ask again. Otherwise kill what is left of the chain, so that every pending
    and later read fails at once (a FUSE connection aborts when its daemon is gone), and
    swapoff ends instead of waiting for ever: the kernel marks the pages it cannot read
    as poisoned, and whoever touches one gets SIGBUS. True when the chain was given up."""
    procs = [(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket),
             (state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file)]
    if health(state)["ok"]:
        return False
    resumed = False
    for pid, exe, must in procs:
        if _ours_alive(pid, exe, must) and system.process_state(pid) in STOPPED_STATES:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                resumed = True
    if resumed and health(state)["ok"]:
        return False
    for pid, exe, must in procs:
        if _ours_alive(pid, exe, must):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10.0)
    return True


def _remove_tier_file(state: RunState) -> None:
    """A server that was killed leaves its disk tier behind: compressed pages of every
    sandbox. Only a regular file at the configured path is removed (never a link)."""
    if not state.config_path:
        return
    try:
        from .config import load_config
        path = load_config(state.config_path).pool.swap_out_path
    except Exception:
        return
    if not path:
        return
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _release_cgroups(run_dir: str) -> str:
    """Stop the tuner and put back every cgroup setting it recorded (scopes.Ledger), before
    swapoff: pages coming back must not meet the tuner's squeezed limits."""
    from .scopes import release_all
    from .tuner import stop_daemon

    stop_daemon(run_dir)
    report = release_all(run_dir)
    return report.summary() if (report.restored or report.gone or report.failed) else ""


# --- status ----------------------------------------------------------------------------

def status(run_dir: str | None = None, *, config=None,
           health_timeout: float = HEALTH_TIMEOUT) -> dict:
    """What is attached from ``run_dir``, its health, host swap facts and warnings.
    ``healthy`` is None when nothing of ours runs or is swap."""
    run_dir = resolve_run_dir(config, run_dir)
    state = RunState.load(run_dir)
    areas = system.swaps()
    zswap = system.zswap_enabled()
    out: dict = {"run_dir": run_dir, "attached": False, "healthy": None, "health": None,
                 "state": None, "server": None,
                 "nbdfuse": None, "device": None, "mode": None, "loop": None, "mount": None,
                 "swap": None, "other_swaps": [], "higher_priority_swaps": [],
                 "zswap_enabled": zswap, "kernel_nbd": system.nbd_kernel_available(),
                 "warnings": []}
    warnings: list[str] = out["warnings"]
    ours = None
    if state is not None:
        out["state"] = state.to_dict()
        out["device"] = state.device
        out["mode"] = state.mode
        alive = _ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket)
        out["server"] = {"pid": state.nbdkit_pid, "alive": alive,
                         "rss": system.process_rss(state.nbdkit_pid) if alive else 0,
                         "socket": state.nbd_socket, "control": state.control_socket,
                         "plugin": state.plugin, "size": state.size,
                         "started": state.started}
        if state.mode == "fuse":
            falive = _ours_alive(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file)
            out["nbdfuse"] = {"pid": state.nbdfuse_pid, "alive": falive,
                              "rss": system.process_rss(state.nbdfuse_pid) if falive else 0,
                              "locked": _locked_bytes(state.nbdfuse_pid) if falive else 0}
            if falive and not out["nbdfuse"]["locked"]:
                warnings.append("nbdfuse's memory is not locked (no C compiler for the mlock "
                                "shim?): under heavy pressure it can swap onto its own device "
                                "and deadlock; apt-get install gcc and re-run up")
            out["mount"] = {"path": state.mountpoint, "file": state.fuse_file,
                            "mounted": _is_mounted(state.mountpoint)}
            if state.loop_device:
                out["loop"] = {"device": state.loop_device, "attached": _loop_is_ours(state),
                               "backing_file": _loop_backing(state.loop_device),
                               "dio": _loop_dio(state.loop_device),
                               "rotational": _loop_rotational(state.loop_device)}
                if state.rotational and out["loop"]["rotational"] is False:
                    warnings.append(f"device.rotational is set but {state.loop_device} is not "
                                    "flagged rotational (read-only sysfs?): swap readahead "
                                    "follows each process instead of the device")
        ours = system.swap_area(state.device)
        if ours is not None:
            out["swap"] = ours.to_dict()
        out["attached"] = alive and ours is not None
        if ours is not None or alive:
            out["health"] = health(state, health_timeout)
            out["healthy"] = out["health"]["ok"]
        out["server"]["oom_protected"] = state.oom_protected
        if alive and not state.oom_protected:
            warnings.append("could not set oom_score_adj -1000 on the server (needs "
                            "CAP_SYS_RESOURCE): the OOM killer may pick it")
        if ours is not None and not alive:
            warnings.append(f"nbdkit is not running but {state.device} is still swap: "
                            "processes that fault swapped pages will get SIGBUS")
        if state.mode == "fuse" and ours is not None and out["loop"] and \
                out["loop"]["dio"] is False:
            warnings.append(f"direct I/O is off on {state.loop_device}: swapped pages also "
                            "stay in the page cache")
        if not out["attached"] and ours is None and not alive:
            warnings.append(f"stale state in {run_dir}: `agentzip-blk up` will clean it")
    for a in areas:
        if ours is not None and a.filename == ours.filename:
            continue
        out["other_swaps"].append(a.to_dict())
        if ours is not None and a.priority > ours.priority:
            out["higher_priority_swaps"].append(a.to_dict())
            warnings.append(f"{a.filename} has higher swap priority ({a.priority} > "
                            f"{ours.priority}) and takes pages before this device")
    if zswap:
        warnings.append("zswap is enabled and compresses pages before they reach the device "
                        f"(double compression): {system.ZSWAP_DISABLE_HINT}")
    return out


# --- health ------------------------------------------------------------------------------

def health(state: RunState, timeout: float = HEALTH_TIMEOUT) -> dict:
    """Whether the chain answers, not only whether its processes exist: nbdkit alive, not
    stopped, and answering the ``health`` verb (which waits for the store lock; ``ping``
    does not) within ``timeout``; nbdfuse alive and not stopped; and one 4 KiB O_DIRECT read
    of the FUSE file through the whole chain. ``ok`` is False with the reasons in
    ``problems``."""
    problems: list[str] = []
    out: dict = {"ok": False, "problems": problems, "timeout": timeout}
    srv = {"pid": state.nbdkit_pid, "state": None, "responsive": False}
    out["nbdkit"] = srv
    if _ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket):
        srv["state"] = system.process_state(state.nbdkit_pid)
        if srv["state"] in STOPPED_STATES:
            problems.append(f"nbdkit (pid {state.nbdkit_pid}) is stopped (SIGSTOP?): every "
                            "swap-in waits; `kill -CONT` it")
        elif state.control_socket:
            try:
                reply = control.request(state.control_socket, "health", timeout=timeout)
                srv["responsive"] = True
                srv["guarded"] = bool(reply.get("guarded"))
            except control.ControlError as exc:
                problems.append(f"nbdkit (pid {state.nbdkit_pid}) does not answer health "
                                f"within {timeout:g}s: {exc}")
        else:
            srv["responsive"] = True  # a plugin without a control socket (tests)
    else:
        problems.append(f"nbdkit (pid {state.nbdkit_pid}) is not running")
    if state.nbdfuse_pid:
        fz = {"pid": state.nbdfuse_pid, "state": None}
        out["nbdfuse"] = fz
        if _ours_alive(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file):
            fz["state"] = system.process_state(state.nbdfuse_pid)
            if fz["state"] in STOPPED_STATES:
                problems.append(f"nbdfuse (pid {state.nbdfuse_pid}) is stopped (SIGSTOP?)")
        else:
            problems.append(f"nbdfuse (pid {state.nbdfuse_pid}) is not running")
    if not problems and state.fuse_file:
        err = _probe_read(state.fuse_file, timeout)
        out["probe"] = err or "ok"
        if err:
            problems.append(f"a 4 KiB read of {state.fuse_file} failed: {err}")
    out["ok"] = not problems
    return out


def _probe_read(path: str, timeout: float) -> str | None:
    """One O_DIRECT read of the first page, in a child: a wedged chain blocks the child,
    never the caller. None when it succeeded, else why not."""
    argv = ["dd", f"if={path}", "of=/dev/null", "bs=4096", "count=1", "iflag=direct",
            "status=none"]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        return f"dd: {exc.strerror}"
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # a FUSE wait is killable; reaped by init if it lingers
        return f"no answer within {timeout:g}s"
    if proc.returncode != 0:
        return (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return None


# --- context manager ----------------------------------------------------------------------

@contextlib.contextmanager
def attached(config=None, run_dir: str | None = None, **kwargs) -> Iterator[RunState]:
    """``with attached(cfg, run_dir, priority=..., plugin=...) as state:`` -- up, then a
    guaranteed teardown (forced swapoff) on exit, even on errors or KeyboardInterrupt."""
    state = up(config, run_dir=run_dir, **kwargs)
    try:
        yield state
    finally:
        down(state.run_dir, force=True, timeout=kwargs.get("timeout", 30.0))
