"""The attach chain, step by step: nbdkit (the server) -> a block device -> mkswap + swapon;
and its teardown in the safe order (swapoff, ``losetup -d`` / ``nbd-client -d``,
``fusermount3 -u``, stop the server, then the holder of its descriptors, host.holder). Nothing here stops the server while /proc/swaps lists
our device.

The block device is one of three front ends (``device.frontend``, resolve_frontend):
kernel nbd (nbd-client on nbdkit's socket); the FUSE front door, where the server mounts a
FUSE file and serves it itself (``fuse=`` plugin key, agentzip_blk.datapath.fuse) under a
loop device with direct I/O; or nbdfuse, the old chain kept for comparison, a FUSE file that
nbdfuse serves over NBD from nbdkit, under the same loop device.

The server locks its own memory (the plugin calls mlockall(MCL_ONFAULT); nbdkit's ``--swap``
would fault in its whole .bss and every thread stack, see servercmd); nbdfuse cannot, so a
small preload library built here locks it (_MLOCK_SHIM_C).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time

from .. import procfs
from ..datapath import control
from ..errors import DeviceError, SetupError
from . import facts, holder, procs, swapunit
from .procs import (
    STOPPED_STATES,
    ours_alive,
    run_tool,
    spawn,
    stop_process,
    wait_gone,
    wait_ready,
)
from .rundir import open_private
from .runstate import STATE_FILE, TOOLS, RunState
from .servercmd import (
    SERVER_PATH,
    default_plugin_path,
    is_python_plugin,
    plugin_env,
    server_command,
)

log = logging.getLogger(__name__)

SWAP_LABEL = "agentzip"


class NotOurs(SetupError):
    """The state names a swap area or device that is not shown to be this chain's."""


# nbdfuse has no mlock option, and mlockall() does not survive execve(). A page of nbdfuse
# swapped out onto the very device it serves deadlocks the swap-in. This preload library
# locks nbdfuse from its first instruction (ONFAULT: only pages it touches, so thread stacks
# and malloc arenas stay small) and marks it an I/O flusher where permitted. It also refuses
# SIGTERM, SIGINT, SIGHUP and SIGPIPE with a line in nbdfuse's log: libfuse installs its
# exit-on-signal handlers only over SIG_DFL (lib/fuse_signals.c), so ours stay, and nbdfuse
# ends only when `down` unmounts the file (or by SIGKILL). Built ahead of time (MLOCK_SHIMS:
# the .deb's, tools/build-deb.sh; the checkout's, setup.sh); `up` compiles it with cc into
# the run directory only when neither exists, and refuses when it cannot.
MLOCK_SHIMS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "libagentzip-mlock.so"),
               "/usr/lib/agentzip-blk/libagentzip-mlock.so")
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


def resolve_tool(name: str, tools: dict) -> str:
    """The executable for ``name``: an in-process override (tests), else found on the fixed
    SERVER_PATH, never on a path read from a file (state.json no longer records tools)."""
    t = tools.get(name) or TOOLS[name]
    if os.sep in t:
        return t
    return shutil.which(t, path=SERVER_PATH) or facts.which(t) or t


def is_mounted(path: str | None) -> bool:
    return bool(path) and mount_minor(path) is not None


FUSECTL = "/sys/fs/fuse/connections"


def mount_minor(path: str) -> int | None:
    """The minor device number of the mount at ``path`` (a FUSE mount's connection number
    in fusectl), or None when nothing is mounted there. Read from mountinfo only: a stat of
    the mount point would ask its FUSE server, which may never answer."""
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8",
                                            errors="surrogateescape") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and procfs.unescape(parts[4]) == real:
                return int(parts[2].split(":")[1])
    return None


def abort_fuse(mountpoint: str | None, timeout: float = 10.0) -> bool:
    """Abort the FUSE connection of ``mountpoint`` through fusectl: every request waiting on
    it, and every later one, fails at once. The last resort of `down --force` for a server
    that SIGKILL cannot end: one in D state, waiting for a page under writeback to the very
    device it serves (docs/ARCHITECTURE.md, "Recovery from a crash"). The pages in flight
    are lost. True when the abort was written."""
    minor = mount_minor(mountpoint) if mountpoint else None
    if minor is None:
        return False
    mounted_here = False
    if not is_mounted(FUSECTL):
        with contextlib.suppress(DeviceError):
            run_tool(["mount", "-t", "fusectl", "none", FUSECTL], timeout=timeout,
                     what="mount -t fusectl")
            mounted_here = True
    try:
        with open(os.path.join(FUSECTL, str(minor), "abort"), "w") as f:
            f.write("1")
        return True
    except OSError as exc:
        log.warning("cannot abort the FUSE connection of %s: %s", mountpoint, exc)
        return False
    finally:
        if mounted_here:
            with contextlib.suppress(DeviceError):
                run_tool(["umount", FUSECTL], timeout=timeout, what="umount fusectl")


def loop_name(dev: str | None) -> str | None:
    return os.path.basename(dev) if dev else None


def _loop_flag(dev: str | None, attribute: str) -> bool | None:
    """A 0/1 attribute of the loop device in sysfs (e.g. loop/dio); None when unknown."""
    name = loop_name(dev)
    if not name:
        return None
    try:
        with open(f"/sys/block/{name}/{attribute}", encoding="ascii") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def loop_dio(dev: str | None) -> bool | None:
    return _loop_flag(dev, "loop/dio")


def loop_rotational(dev: str | None) -> bool | None:
    return _loop_flag(dev, "queue/rotational")


def _mark_rotational(dev: str) -> bool:
    """Flag the loop device rotational (`device.rotational`), before swapon, which reads the
    flag once: swap-in then reads ahead 2^vm.page-cluster neighbouring slots per request
    instead of following one process's address space. Every request through the chain costs
    ~300 us whatever its size, so on a sequential re-read fewer larger reads win (demo: 12k
    reads of ~19.5 KiB instead of 37k of ~6.4 KiB, swap-in ~2x). Off by default: a single
    fault then reads 8 slots, and on two of the four agent workloads a whole re-touch was
    no faster (BENCHMARKS.md "Readahead"); the OOM kills once blamed on it are not its.
    Best effort: a read-only sysfs only costs speed."""
    try:
        with open(f"/sys/block/{loop_name(dev)}/queue/rotational", "w", encoding="ascii") as f:
            f.write("1")
    except OSError:
        return False
    return loop_rotational(dev) is True


def loop_is_ours(state: RunState) -> bool:
    backing = procfs.loop_backing(state.loop_device)
    if backing is None or not state.fuse_file:
        return False
    # Strings only: both paths lie inside the FUSE mount, where a stat would wait on the
    # server (for ever, if it is stopped); fuse_file was made canonical at `up` (_mountpoint).
    return backing.removesuffix(" (deleted)") == state.fuse_file


def _nbd_connected(state: RunState) -> bool:
    return bool(state.mode == "nbd" and state.nbd_device and os.path.exists(
        f"/sys/block/{os.path.basename(state.nbd_device)}/pid"))


def nbd_is_ours(state: RunState) -> bool:
    """The nbd device is connected by an nbd-client of this chain: the process the kernel
    names in /sys/block/nbdN/pid is nbd-client with our socket on its command line. (With
    netlink nbd-client exits after connecting, and then this cannot be shown.)"""
    name = os.path.basename(state.nbd_device or "")
    try:
        with open(f"/sys/block/{name}/pid", encoding="ascii") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return False
    return procs.ours_alive(pid, state.tool("nbd-client"), state.nbd_socket)


def foreign_device(state: RunState, served: str | None = None, *,
                   trusted: bool = False) -> str | None:
    """Why ``state.device`` is not shown to be this chain's device, or None when it is.

    teardown swaps off and detaches what the state names, and state.json is a file that
    anyone who can write the run directory can edit: it must not make root swap off or
    disconnect another swap area. The device is ours when the server says it serves it
    (``served``: the guard `up` armed once, from the server's memory), or else when the
    kernel ties it to this chain: a loop device whose backing file is our FUSE file, an nbd
    device whose nbd-client connects to our socket. ``trusted``: the state is this
    process's own (up's rollback), not read from a file."""
    dev = state.device
    if dev is None or trusted:
        return None
    if served is not None:
        return None if dev == served else f"the server serves {served}, not {dev}"
    if dev == state.loop_device and loop_is_ours(state):
        return None
    if dev == state.nbd_device and nbd_is_ours(state):
        return None
    return f"nothing shows that {dev} is this run directory's device"


def compile_mlock_shim(lib: str, cflags: tuple[str, ...] = ()) -> str:
    """Compile the mlockall preload library to ``lib`` (``python -m agentzip_blk.host.chain
    LIB``: setup.sh, tools/build-deb.sh). DeviceError without a C compiler or on failure."""
    cc = facts.which("cc") or facts.which("gcc")
    if cc is None:
        raise DeviceError("no C compiler (cc, gcc) for the mlock shim")
    src = lib + ".c"
    with open_private(src, encoding="ascii") as f:
        f.write(_MLOCK_SHIM_C)
    try:
        run_tool([cc, "-O2", *cflags, "-shared", "-fPIC", "-o", lib, src], timeout=60,
                 what="cc (mlock shim)")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(src)
    return lib


def mlock_shim(run_dir: str) -> str:
    """The prebuilt preload library, else one compiled into ``run_dir``, else SetupError."""
    for lib in MLOCK_SHIMS:
        # one older than this file may predate a change of _MLOCK_SHIM_C (a checkout pulled
        # since setup.sh ran): not used. The .deb gives both the same time.
        if os.path.isfile(lib) and os.path.getmtime(lib) >= os.path.getmtime(__file__):
            return lib
    try:
        return compile_mlock_shim(os.path.join(run_dir, "agentzip-mlock.so"))
    except DeviceError as exc:
        raise SetupError(f"nbdfuse's mlock shim: none prebuilt ({', '.join(MLOCK_SHIMS)}) and "
                         f"{exc}: run ./setup.sh or apt-get install gcc (or up --no-mlock, "
                         f"unsafe under pressure)") from None


def _free_nbd_device() -> str:
    i = 0
    while os.path.exists(f"/dev/nbd{i}"):
        if not os.path.exists(f"/sys/block/nbd{i}/pid"):
            return f"/dev/nbd{i}"
        i += 1
    raise DeviceError("no free /dev/nbdN device (all connected): disconnect one or "
                      "modprobe nbd nbds_max=N")


def liveness(state: RunState) -> dict:
    """What of ``state`` still runs. A leftover loop device or dead FUSE mount alone is
    stale (``up`` cleans it); a live process or an active swap area is not."""
    return {
        "nbdkit": ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket),
        "nbdfuse": ours_alive(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file),
        "holder": holder.is_holder(state.holder_pid, state.run_dir),
        "swap": procfs.swap_area(state.device) is not None,
    }


def stop_server(state: RunState, timeout: float) -> None:
    """The shutdown verb (refused by the server while swap points at it); when the control
    socket does not answer, SIGTERM, which the server honours once no swap area is ours,
    and SIGKILL after ``timeout``."""
    pid = state.nbdkit_pid
    if not ours_alive(pid, state.tool("nbdkit"), state.nbd_socket):
        return
    if state.control_socket and procfs.process_state(pid) not in STOPPED_STATES:
        try:
            control.request(state.control_socket, "shutdown", timeout=min(timeout, 5.0))
        except control.ControlError:
            pass
        else:
            if wait_gone(pid, timeout):
                return
    if state.holder_pid:  # first: it would start again the server killed below
        holder.stop(state.holder_pid, state.run_dir, 0.0)
    stop_process(pid, state.tool("nbdkit"), state.nbd_socket, timeout, "nbdkit")


def teardown(state: RunState, timeout: float = 30.0,
              swapoff_timeout: float | None = None, *, served: str | None = None,
              trusted: bool = False) -> None:
    """Undo whatever ``state`` records, in the safe order. Raises on the first failure
    that makes continuing unsafe (swap still on, loop still attached). swapoff brings every
    page back in, which can take long: by default it may take an hour. A swap area or nbd
    device is touched only when it is shown to be ours (``foreign_device``: ``served`` is
    the device the server said it serves; ``trusted`` for up's own in-memory state)."""
    errors: list[str] = []

    # 0. another chain's swap area or nbd device: refused before anything changes
    named, why = state.device, None
    if procfs.swap_area(state.device) is not None:
        why = foreign_device(state, served, trusted=trusted)
    if why is None and not trusted and _nbd_connected(state):
        named = state.nbd_device
        if named != served and not nbd_is_ours(state):
            why = f"nothing shows that {named} is this run directory's device"
    if why is not None:
        raise NotOurs(f"{state.path} names {named}, but {why}: refusing to swap it off "
                          f"or disconnect it (if it is this run directory's, do that by "
                          f"hand, then remove {state.path})")

    # 1. swapoff
    if procfs.swap_area(state.device) is not None:
        run_tool([resolve_tool("swapoff", state.tools), state.device],
             timeout=swapoff_timeout or max(timeout, 3600.0), what=f"swapoff {state.device}")
        if procfs.swap_area(state.device) is not None:
            raise DeviceError(f"{state.device} is still in /proc/swaps after swapoff")
    state.swap_on = False
    swapunit.remove_order(state.device)
    with contextlib.suppress(OSError):
        state.save()

    # 2. detach the block device
    if state.mode == "nbd" and state.nbd_device:
        if _nbd_connected(state):
            run_tool([resolve_tool("nbd-client", state.tools), "-d", state.nbd_device],
                 timeout=timeout, what=f"nbd-client -d {state.nbd_device}")
        state.nbd_device = None
    if state.loop_device:
        if loop_is_ours(state):
            run_tool([resolve_tool("losetup", state.tools), "-d", state.loop_device],
                 timeout=timeout, what=f"losetup -d {state.loop_device}")
            deadline = time.monotonic() + timeout
            while loop_is_ours(state):
                if time.monotonic() > deadline:
                    raise DeviceError(f"{state.loop_device} still attached after losetup -d")
                time.sleep(0.05)
        state.loop_device = None
    with contextlib.suppress(OSError):
        state.save()

    # 3. unmount the FUSE file; nbdfuse exits on unmount. Not while another loop device
    # holds it (someone's swap, perhaps): a lazy unmount would orphan that loop under a
    # dead file's "/device" name, where nothing finds it by our path any more
    others = stray_loops(state.run_dir) if state.mountpoint else []
    if others:
        raise DeviceError(f"{', '.join(others)} still attached over {state.fuse_file}: "
                          f"`agentzip-blk down --force` detaches them")
    if is_mounted(state.mountpoint):
        try:
            run_tool([resolve_tool("fusermount3", state.tools), "-u", state.mountpoint],
                 timeout=timeout, what=f"fusermount3 -u {state.mountpoint}")
        except DeviceError as e:
            # a dead nbdfuse leaves a "transport endpoint not connected" mount: lazy unmount
            try:
                run_tool([resolve_tool("fusermount3", state.tools), "-u", "-z", state.mountpoint],
                     timeout=timeout, what=f"fusermount3 -u -z {state.mountpoint}")
            except DeviceError:
                errors.append(str(e))
    if state.nbdfuse_pid:
        if not wait_gone(state.nbdfuse_pid, 10.0):
            stop_process(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file, 10.0,
                          "nbdfuse")
        state.nbdfuse_pid = None
    if state.mountpoint and not is_mounted(state.mountpoint):
        with contextlib.suppress(OSError):
            os.rmdir(state.mountpoint)
    with contextlib.suppress(OSError):
        state.save()

    # 4. stop nbdkit -- never while a swap area still points at our device
    says_bye = False
    if state.nbdkit_pid:
        if procfs.swap_area(state.device) is not None:
            raise DeviceError(f"refusing to stop nbdkit: {state.device} is still in /proc/swaps")
        if loop_is_ours(state):
            raise DeviceError(f"refusing to stop nbdkit: {state.loop_device} is still attached")
        # a server that stops tells its holder so (bye "shutdown"); a dead one cannot
        says_bye = ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket)
        stop_server(state, timeout)
        state.nbdkit_pid = None

    # 5. the holder of the server's descriptors, last: it exits once the server said bye
    if state.holder_pid:
        holder.stop(state.holder_pid, state.run_dir, holder.EXIT_WAIT if says_bye else 0.0)
        state.holder_pid = None

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


def stray_loops(run_dir: str) -> list[str]:
    """Every loop device whose backing file lies in RUN/mnt (our FUSE mount), whatever
    state.json says or whether it exists: a state file lost under a live server (a package
    removed, a run dir cleaned) leaves them attached, and the next `up` meets a used loop.
    Strings only, as loop_is_ours: a stat inside the mount would wait on its server."""
    mnt = os.path.join(os.path.realpath(run_dir), "mnt") + os.sep
    try:
        names = sorted(n for n in os.listdir("/sys/block") if re.fullmatch(r"loop[0-9]+", n))
    except OSError:
        return []
    out = []
    for name in names:
        backing = procfs.loop_backing(f"/dev/{name}")
        if backing and backing.removesuffix(" (deleted)").startswith(mnt):
            out.append(f"/dev/{name}")
    return out


def sweep(run_dir: str, timeout: float, tools: dict | None = None, *,
          unmount: bool = True) -> list[str]:
    """`down --force`: swapoff and detach every loop device over our FUSE file (stray_loops),
    then (``unmount``) unmount RUN/mnt. Returns what it detached. swapoff of a loop whose
    server is gone ends: the dead FUSE connection fails every read. Before any unmount: a
    lazily unmounted file shows as "/device", no longer under RUN/mnt."""
    tools = tools or {}
    detached = []
    for loop in stray_loops(run_dir):
        if procfs.swap_area(loop) is not None:
            run_tool([resolve_tool("swapoff", tools), loop], timeout=max(timeout, 3600.0),
                     what=f"swapoff {loop}")
        swapunit.remove_order(loop)
        run_tool([resolve_tool("losetup", tools), "-d", loop], timeout=timeout,
                 what=f"losetup -d {loop}")
        detached.append(loop)
    mnt = os.path.join(os.path.realpath(run_dir), "mnt")
    if unmount and is_mounted(mnt):
        try:
            run_tool([resolve_tool("fusermount3", tools), "-u", mnt], timeout=timeout,
                     what=f"fusermount3 -u {mnt}")
        except DeviceError:
            run_tool([resolve_tool("fusermount3", tools), "-u", "-z", mnt], timeout=timeout,
                     what=f"fusermount3 -u -z {mnt}")
    return detached


def required_tools(kernel_nbd: bool | None = None, tools: dict | None = None,
                   frontend: str | None = None) -> list[str]:
    tools = {**TOOLS, **(tools or {})}
    if kernel_nbd is None:
        kernel_nbd = facts.nbd_kernel_available()
    if frontend is None:
        frontend = "nbd" if kernel_nbd else "nbdfuse"
    names = ["nbdkit", "mkswap", "swapon", "swapoff"]
    names += {"nbd": ["nbd-client"], "fuse": ["fusermount3", "losetup"]}.get(
        frontend, ["nbdfuse", "fusermount3", "losetup"])
    return [tools[n] for n in names]


def resolve_frontend(config=None, frontend: str | None = None, kernel_nbd: bool | None = None,
                     plugin: str | None = None) -> str:
    """device.frontend (or ``frontend``) made concrete: "nbd", "fuse" or "nbdfuse".

    auto: kernel nbd where /dev/nbd0 exists, else the server's own FUSE file; a plugin that
    is not ours (nbdkit's memory plugin in tests) cannot serve FUSE, so nbdfuse serves it."""
    if frontend is None:
        dev = getattr(config, "device", None) if config is not None else None
        frontend = getattr(dev, "frontend", None) or "auto"
    if frontend == "auto":
        if kernel_nbd is None:
            kernel_nbd = facts.nbd_kernel_available()
        if kernel_nbd:
            return "nbd"
        return "fuse" if plugin is None or is_python_plugin(plugin) else "nbdfuse"
    if frontend not in ("nbd", "fuse", "nbdfuse"):
        raise SetupError(f"device.frontend: {frontend!r} is not one of auto | fuse | nbdfuse | nbd")
    if frontend == "nbd" and kernel_nbd is False:
        raise SetupError("device.frontend is nbd but the kernel has no nbd driver (/dev/nbd0)")
    if frontend == "fuse" and plugin is not None and not is_python_plugin(plugin):
        raise SetupError(f"device.frontend fuse needs the agentzip plugin, not {plugin!r}")
    return frontend


def check_up_preconditions(*, allow_zswap: bool = False, plugin: str | None = None,
                           tools: dict | None = None, kernel_nbd: bool | None = None,
                           frontend: str | None = None) -> None:
    """Raise SetupError when ``up`` cannot work here (non-root, missing tools, zswap)."""
    facts.require_root("agentzip-blk up")
    facts.require_tools(required_tools(kernel_nbd, tools, frontend))
    if plugin is None or is_python_plugin(plugin):
        facts.require_nbdkit_plugin("python", (tools or {}).get("nbdkit", TOOLS["nbdkit"]))
        path = plugin or default_plugin_path()
        if not os.path.isfile(path):
            raise SetupError(f"nbdkit plugin {path} not found: reinstall agentzip-blk "
                             f"(pip install -e .) or set AGENTZIP_PLUGIN")
    if facts.zswap_enabled() and not allow_zswap:
        raise SetupError("zswap is enabled and would compress pages before they reach the "
                         f"device (double compression): {facts.ZSWAP_DISABLE_HINT}, "
                         "or pass --allow-zswap")


def write_effective_config(config, run_dir: str, name: str = "config.yaml") -> tuple[str, str]:
    """RUN/config.yaml (a restart's new server: RUN/``name`` until it serves), the config
    the server starts on, and the SHA-256 of its bytes: the server reads that file alone (no
    drop-ins) and only with that digest, since others may write the run directory
    (config.load_file)."""
    import yaml

    from ..config import config_digest

    path = os.path.join(run_dir, name)
    data = ("# the config this server was started with (written by agentzip-blk up)\n" +
            yaml.safe_dump(config.to_dict(), sort_keys=False)).encode("utf-8")
    with open_private(path, "wb") as f:
        f.write(data)
    return path, config_digest(data)


def server_request(state: RunState, cmd: str, timeout: float, **args) -> dict:
    try:
        return control.request(state.control_socket, cmd, timeout=timeout, **args)
    except control.ControlError as exc:
        raise DeviceError(f"nbdkit control {cmd}: {exc}; log {state.run_dir}/nbdkit.log") from None


def step_done(step: str) -> None:
    """Each step of the attach (nbdkit, nbdfuse or fuse, losetup, mkswap, swapon) ends here:
    one debug line. Whatever it raises is the step's failure: up rolls everything back."""
    log.debug("up: %s done", step)


def holder_wanted(state: RunState) -> bool:
    """Whether `up` starts a holder of the server's descriptors (host.holder): the FUSE front
    door served by our plugin (nbdfuse and nbdkit's own plugins keep no store of ours)."""
    return state.frontend == "fuse" and is_python_plugin(state.plugin)


def start_holder(state: RunState, timeout: float) -> list[str]:
    """The holder, started and recorded before the server that connects to it; the
    server's plugin keys that name it ([] when `up` starts none)."""
    if not holder_wanted(state):
        return []
    state.holder_pid = holder.start(state.run_dir, timeout)
    state.save()
    step_done("holder")
    return [f"holder={holder.socket_path(state.run_dir)}"]


def up_steps(state: RunState, timeout: float) -> None:
    run_dir, tools = state.run_dir, state.tools
    # 0. the holder of the server's descriptors across a crash (the FUSE door)
    held = start_holder(state, timeout)
    # 1. nbdkit, detached in its own session, memory locked
    nbdkit = resolve_tool("nbdkit", tools)
    pidfile = os.path.join(run_dir, "nbdkit.pid")
    # The FUSE front door serves the kernel itself: no NBD client is ever let in (below)
    argv = server_command(state.plugin, state.nbd_socket, state.control_socket, pidfile,
                          state.config_path, state.size, foreground=True, nbdkit=nbdkit,
                          mlock=state.mlock, config_sha256=state.config_sha256,
                          nbd_clients=state.frontend != "fuse")
    if state.frontend == "fuse":
        argv += _fuse_frontend_keys(state) + held
    log = os.path.join(run_dir, "nbdkit.log")
    env = plugin_env()
    proc = spawn(argv, log, env=env)
    state.nbdkit_pid = proc.pid
    state.save()
    ready = [state.nbd_socket] + ([state.control_socket] if state.control_socket else [])
    if state.frontend == "fuse":
        ready.append(state.fuse_file)  # mounted and answering once its lookup succeeds
    wait_ready(proc, pidfile, ready, timeout, "nbdkit", log)
    _private_socket(state.nbd_socket)
    if state.control_socket:
        server_request(state, "health", timeout)  # serving, not only listening
    if state.frontend == "fuse":
        # nbdkit must listen somewhere; with the FUSE door nobody needs it, and its ip filter
        # already turns every peer away (deny=all). Removed, nobody can reach it at all.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(state.nbd_socket)
    # best effort: needs CAP_SYS_RESOURCE (missing in some containers)
    state.oom_protected = procs.set_oom_score_adj(proc.pid, -1000)
    state.save()
    if held:  # after a crash the holder starts the server as up did
        holder.give_recipe(run_dir, argv, env, timeout, [state.nbd_socket])
    step_done("nbdkit")

    # 2. block device
    if state.mode == "nbd":
        dev = _free_nbd_device()
        state.nbd_device = dev
        state.save()
        run_tool([resolve_tool("nbd-client", tools), "-unix", state.nbd_socket, dev,
                  "-block-size", "4096", "-swap"], timeout=timeout, what=f"nbd-client {dev}")
        state.device = dev
        state.save()
    else:
        if state.frontend == "nbdfuse":
            _start_nbdfuse(state, timeout)
        _attach_loop(state, timeout)

    # 3. mkswap + swapon
    _swapon(state, timeout)


def _private_socket(path: str) -> None:
    """nbdkit gives its socket a mode of its own (0755 measured, whatever the umask): make it
    0600. Its ip filter admits root only anyway (servercmd.peer_filter_args)."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.chmod(path, 0o600)


def _mountpoint(state: RunState, file_name: str) -> None:
    """RUN/mnt and the file in it, canonical (as losetup records its backing file), so that
    status and teardown never need to resolve a path inside the mount."""
    mnt = os.path.join(os.path.realpath(state.run_dir), "mnt")
    os.makedirs(mnt, mode=0o700, exist_ok=True)
    if is_mounted(mnt):
        raise DeviceError(f"{mnt} is already a mount point: fusermount3 -u {mnt}")
    if os.path.islink(mnt) or not os.path.isdir(mnt):
        raise DeviceError(f"{mnt} is not a directory (a link?): remove it")
    os.chmod(mnt, 0o700)  # an old one keeps its mode otherwise
    state.mountpoint = mnt
    state.fuse_file = os.path.join(mnt, file_name)
    state.save()


def _fuse_frontend_keys(state: RunState) -> list[str]:
    """Plugin keys for the in-process FUSE front door: the server mounts RUN/mnt and serves
    RUN/mnt/device itself (agentzip_blk.datapath.fuse) right after nbdkit starts."""
    _mountpoint(state, "device")
    return [f"fuse={state.mountpoint}"]


def _start_nbdfuse(state: RunState, timeout: float) -> None:
    run_dir, tools = state.run_dir, state.tools
    _mountpoint(state, "nbd")
    fuse_pidfile = os.path.join(run_dir, "nbdfuse.pid")
    flog = os.path.join(run_dir, "nbdfuse.log")
    fenv = None
    shim = mlock_shim(run_dir) if state.mlock else None
    if shim:
        fenv = dict(os.environ)
        fenv["LD_PRELOAD"] = (shim + " " + fenv["LD_PRELOAD"]).strip() \
            if fenv.get("LD_PRELOAD") else shim
    fproc = spawn([resolve_tool("nbdfuse", tools), "-P", fuse_pidfile, state.fuse_file,
                   "--unix", state.nbd_socket], flog, env=fenv)
    state.nbdfuse_pid = fproc.pid
    state.save()
    wait_ready(fproc, fuse_pidfile, [], timeout, "nbdfuse", flog)
    state.oom_protected = procs.set_oom_score_adj(fproc.pid, -1000) and state.oom_protected
    state.nbdfuse_locked = procfs.process_locked(fproc.pid) > 0
    state.save()


def _attach_loop(state: RunState, timeout: float) -> None:
    st = os.stat(state.fuse_file)
    if st.st_size != state.size:
        raise DeviceError(f"{state.fuse_file} has size {st.st_size}, expected {state.size}")
    step_done(state.frontend)

    out = run_tool([resolve_tool("losetup", state.tools), "--direct-io=on", "--show", "-f",
                    state.fuse_file], timeout=timeout, what="losetup")
    loop = out.strip().splitlines()[-1].strip() if out.strip() else ""
    if not loop.startswith("/dev/loop"):
        raise DeviceError(f"losetup printed no loop device: {out!r}")
    state.loop_device = state.device = loop
    state.save()
    if loop_dio(loop) is not True:
        raise DeviceError(f"direct I/O is off on {loop} (/sys/block/{loop_name(loop)}/"
                          "loop/dio): without it every swapped page also stays in the "
                          "page cache and no memory is saved")
    if state.rotational:
        _mark_rotational(loop)
    step_done("losetup")


def _swapon(state: RunState, timeout: float) -> None:
    """mkswap + swapon, the server told first which device it must not die under."""
    tools = state.tools
    run_tool([resolve_tool("mkswap", tools), "-L", SWAP_LABEL, state.device], timeout=timeout,
             what=f"mkswap {state.device}")
    state.mkswap_done = True
    state.save()
    step_done("mkswap")
    if state.control_socket:
        server_request(state, "guard", timeout, device=state.device)
    ordered = swapunit.write_order(state.device)  # systemd's swap unit stops after `down`
    run_tool([resolve_tool("swapon", tools), "--discard=pages", "-p", str(state.swap_priority),
              state.device], timeout=timeout, what=f"swapon {state.device}")
    if procfs.swap_area(state.device) is None:
        raise DeviceError(f"swapon succeeded but {state.device} is not in /proc/swaps")
    if ordered:
        swapunit.reload()
    state.swap_on = True
    state.save()
    step_done("swapon")


if __name__ == "__main__":  # build the shim ahead of time: python -m agentzip_blk.host.chain LIB
    import sys
    print(compile_mlock_shim(sys.argv[1], tuple(sys.argv[2:])))
