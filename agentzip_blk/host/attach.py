"""`up` and `down`: the chain (`chain`) attached as swap, and detached again.

``up`` starts the server in its own session, attaches the device (kernel nbd +
``nbd-client -swap`` when /dev/nbd0 exists, else nbdfuse + ``losetup --direct-io=on``),
runs ``mkswap`` and ``swapon --discard=pages -p PRIO``; a failure midway rolls back what was
done. ``down`` stops the tuner and restores the cgroups it touched (swapoff charges pages
back to their cgroups), then tears the chain down (`chain.teardown`).
"""

from __future__ import annotations

import contextlib
import grp
import os
import signal
import time
from typing import Iterator

from .. import procfs
from ..config.quantities import format_bytes
from ..datapath import control
from ..errors import DeviceError, SetupError
from . import facts, holder
from .chain import (
    abort_fuse,
    check_up_preconditions,
    foreign_device,
    liveness,
    resolve_frontend,
    stray_loops,
    sweep,
    teardown,
    up_steps,
    write_effective_config,
)
from .health import health
from .procs import STOPPED_STATES, ours_alive, wait_gone
from .runstate import (
    DEFAULT_PRIORITY,
    STATE_FILE,
    RunState,
    config_device,
    locked,
    resolve_run_dir,
)
from .servercmd import default_plugin_path, is_python_plugin
from .tierfile import TierFile, remove_leftover

# swapoff needs the swapped bytes back in RAM; keep this much on top of them
SWAPOFF_MARGIN_MIN = 128 * 1024 * 1024


SWAPOFF_MARGIN_FRACTION = 0.05  # of MemTotal


class AlreadyAttached(SetupError):
    """``up`` while a device from this run directory is attached and alive."""


class NotAttached(SetupError):
    """``down``/``stats`` without a device attached in this run directory."""


class SwapoffRefused(DeviceError):
    """swapoff would need more memory than is available."""


def swapoff_fits(used: int, mem: dict[str, int]) -> tuple[bool, int, int]:
    """Whether swapping ``used`` bytes back in fits: (ok, available, needed incl. margin)."""
    avail = mem.get("MemAvailable", mem.get("MemFree", 0))
    margin = max(SWAPOFF_MARGIN_MIN, int(mem.get("MemTotal", 0) * SWAPOFF_MARGIN_FRACTION))
    needed = used + margin
    return (used == 0 or avail >= needed), avail, needed


def up(config=None, config_path: str | None = None, run_dir: str | None = None,
       priority: int | None = None, size: int | None = None, *, plugin: str | None = None,
       allow_zswap: bool = False, tools: dict | None = None, kernel_nbd: bool | None = None,
       timeout: float = 30.0, mlock: bool = True, frontend: str | None = None) -> RunState:
    """Start the server and attach it as swap. Returns the saved RunState.

    ``plugin``: path of a Python plugin (default: the package's datapath/nbdkit_plugin.py) or
    an nbdkit plugin name such as ``memory`` (tests). ``tools`` overrides tool names/paths.
    ``kernel_nbd`` forces the attach mode (default: kernel nbd when /dev/nbd0 exists).
    ``frontend`` overrides ``device.frontend`` (auto | fuse | nbdfuse | nbd).
    ``mlock``: lock the chain's memory. Our plugin locks the server itself
    (mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT), whatever ``mlock`` says); ``mlock`` adds
    the preload library that locks nbdfuse, and ``--swap`` for a named nbdkit plugin (which
    costs nbdkit's whole 192 MiB .bss plus every thread stack in RAM: servercmd).
    """
    facts.require_root("agentzip-blk up")
    tools = dict(tools or {})
    cfg_size, cfg_prio, _ = config_device(config)
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
        kernel_nbd = facts.nbd_kernel_available()
    plugin = plugin or default_plugin_path()
    frontend = resolve_frontend(config, frontend, kernel_nbd, plugin)
    kernel_nbd = frontend == "nbd"
    check_up_preconditions(allow_zswap=allow_zswap, plugin=plugin, tools=tools,
                           kernel_nbd=kernel_nbd, frontend=frontend)
    nbd_socket = os.path.join(run_dir, "nbd.sock")
    if len(nbd_socket.encode()) > 100:
        raise SetupError(f"run directory path too long for a unix socket: {run_dir}")

    group = config.device.control_group if config is not None else None
    # Everything up creates (state, logs, config copy, sockets, the mount point) is root's
    # alone from its first byte, whatever umask the caller had; children inherit it.
    old_umask = os.umask(0o077)
    try:
        with locked(run_dir, _group_gid(group), keep_group=False):
            return _up_locked(run_dir, plugin, nbd_socket, config, config_path, size, priority,
                              kernel_nbd, frontend, tools, mlock, timeout)
    finally:
        os.umask(old_umask)


def _group_gid(name: str | None) -> int | None:
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise SetupError(f"device.control_group: no group {name!r} on this host") from None


def _up_locked(run_dir: str, plugin: str, nbd_socket: str, config, config_path: str | None,
               size: int, priority: int, kernel_nbd: bool, frontend: str, tools: dict,
               mlock: bool, timeout: float) -> RunState:
    old = RunState.load(run_dir)
    if old is not None:
        live = liveness(old)
        if any(live.values()):
            what = ", ".join(k for k, v in live.items() if v)
            raise AlreadyAttached(f"a device is already attached from {run_dir} "
                                  f"({what} alive): run `agentzip-blk down` first")
        # stale state: nothing alive; clear leftovers (sockets, state file)
        teardown(old, timeout)
    for name in ("nbd.sock", "control.sock", "nbdkit.pid", "nbdfuse.pid"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_dir, name))

    control = os.path.join(run_dir, "control.sock") if is_python_plugin(plugin) else None
    digest = None
    if config is not None:
        # The server must run on exactly the config the caller validated (which may not
        # be a file at all): hand it over as a file in the run directory, pinned by its
        # digest, and read alone (no RUN/config.d: the run directory gives no orders).
        config_path, digest = write_effective_config(config, run_dir)
    state = RunState(run_dir=run_dir, plugin=plugin, nbd_socket=nbd_socket,
                     control_socket=control,
                     config_path=os.path.abspath(config_path) if config_path else None,
                     config_sha256=digest,
                     size=size, swap_priority=priority,
                     mode="nbd" if kernel_nbd else "fuse", frontend=frontend,
                     tools=tools, mlock=mlock,
                     rotational=bool(config is not None and config.device.rotational))
    state.save()
    try:
        up_steps(state, timeout)
    except BaseException as exc:
        try:
            teardown(state, timeout, trusted=True)  # our own state, in memory
        except Exception as rb:  # keep the state so that `down` can finish the job
            raise DeviceError(f"{exc}; rollback failed too: {rb} (state kept in "
                              f"{state.path}; fix and run `agentzip-blk down`)") from exc
        raise
    return state


def down(run_dir: str | None = None, force: bool = False, *, config=None,
         timeout: float = 30.0) -> dict:
    """Detach and stop. Refuses swapoff when MemAvailable cannot take back our swapped
    bytes (plus a margin) unless ``force``. Returns a summary dict.

    ``config``: the operator's config (never one from the run directory). A server that
    died leaves its disk tier: the path the server gave when asked, else this config's
    ``pool.swap_out_path``, is removed if it is a tier file nobody holds (host.tierfile)."""
    run_dir = resolve_run_dir(config, run_dir)
    facts.require_root("agentzip-blk down")
    with locked(run_dir):
        state = RunState.load(run_dir)
        if state is None:
            _release_cgroups(run_dir)  # a tuner may have run without a device
            if force:
                orphans = _sweep_orphans(run_dir, timeout, config)
                if orphans is not None:
                    return orphans
            raise NotAttached(f"no device attached from {run_dir} (no {STATE_FILE})")
        area = procfs.swap_area(state.device)
        used = area.used if area else 0
        given_up = False
        if area is not None and not force:
            ok, avail, needed = swapoff_fits(used, procfs.meminfo())
            if not ok:
                raise SwapoffRefused(
                    f"swapoff would bring {format_bytes(used)} back into RAM but only {format_bytes(avail)} is "
                    f"available (need {format_bytes(needed)} with margin): free memory first, or "
                    f"`agentzip-blk down --force`")
            h = health(state)
            if not h["ok"]:
                raise DeviceError("the swap server is not healthy, so swapoff could wait for "
                                  "ever or lose pages: " + "; ".join(h["problems"]) +
                                  "; `agentzip-blk down --force` gives up what it cannot read")
        t0 = time.monotonic()
        cgroups = _release_cgroups(run_dir)
        served, tier = _owned(state, config, timeout)  # asked before the server stops
        if force and (area is not None or liveness(state)["nbdkit"]):
            given_up = _unwedge(state)
        if force:
            # every loop over our FUSE file, the state's and any it does not name (an older
            # up's), before teardown unmounts: a lazy unmount would hide their backing path
            sweep(run_dir, timeout, state.tools, unmount=False)
        teardown(state, timeout, swapoff_timeout=max(timeout, 120.0) if given_up else None,
                 served=served)
        left = remove_leftover(tier) if tier is not None else None
        return {"run_dir": run_dir, "device": state.device, "swapped_in": used,
                "seconds": round(time.monotonic() - t0, 3), "cgroups": cgroups,
                "server_lost": given_up,
                "tier_left": f"{tier.path}: {left}" if left else None}


def _sweep_orphans(run_dir: str, timeout: float, config=None) -> dict | None:
    """`down --force` without a state file: detach what is still over our FUSE file (swap
    areas, loop devices, the mount), then ask a server still on RUN/control.sock to stop (it
    refuses while a swap area points at it). A server that stops removes its own disk tier;
    without one, the tier the operator's config names is removed if it is a leftover
    (host.tierfile). None when there was nothing of ours."""
    t0 = time.monotonic()
    # the holder first: it would start again a server that the sweep's swapoff gives up
    held = holder.pid_of(run_dir)
    if held is not None:
        holder.stop(held, run_dir, 0.0)
    used = sum(a.used for loop in stray_loops(run_dir) if (a := procfs.swap_area(loop)))
    loops = sweep(run_dir, timeout)
    sock = os.path.join(run_dir, "control.sock")
    stopped = False
    if os.path.exists(sock):
        try:
            control.request(sock, "shutdown", timeout=5.0)
            stopped = True
        except control.ControlError:
            pass
    if not loops and not stopped and held is None:
        return None
    path = config.pool.swap_out_path if config is not None else None
    left = remove_leftover(TierFile(path)) if path and not stopped else None
    return {"run_dir": run_dir, "device": ", ".join(loops) or None, "swapped_in": used,
            "seconds": round(time.monotonic() - t0, 3), "cgroups": "", "server_lost": False,
            "orphans": loops, "server_stopped": stopped, "holder_stopped": held,
            "tier_left": f"{path}: {left}" if left else None}


def _unwedge(state: RunState) -> bool:
    """`down --force` on a chain that does not answer. A stopped process may only be paused:
    SIGCONT and ask again. Otherwise abort the FUSE connection (fusectl) and kill what is left
    of the chain, the holder first (it keeps the connection open, and would start the server
    again) with the servers it started, so that every pending and later read fails at once,
    and swapoff ends instead of waiting for ever: the kernel marks the pages it cannot read
    as poisoned, and whoever touches one gets SIGBUS. True when the chain was given up."""
    chain = [(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket),
             (state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file)]
    if health(state)["ok"]:
        return False
    resumed = False
    for pid, exe, must in chain:
        if ours_alive(pid, exe, must) and procfs.process_state(pid) in STOPPED_STATES:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                resumed = True
    if resumed and health(state)["ok"]:
        return False
    # The connection first: a server SIGKILL cannot end (D state: a recovering one waiting for
    # a page under writeback to this very device) would keep it open, and swapoff would wait
    # on it for ever. Aborted, every request fails at once and that server can exit.
    abort_fuse(state.mountpoint)
    if state.holder_pid:  # it would start again the server killed below
        holder.stop(state.holder_pid, state.run_dir, 0.0)  # and the servers it started
    for pid, exe, must in chain:
        if ours_alive(pid, exe, must):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_gone(pid, 10.0)
    return True


def _owned(state: RunState, config, timeout: float) -> tuple[str | None, TierFile | None]:
    """(the device the server serves as swap, its disk tier file), from the server's own
    memory (the ``owned`` verb: the guard `up` armed once, the file its tier holds). Without
    an answer (dead, stopped, an old server): no device (chain.teardown then needs the
    kernel's word that the device is ours) and the tier the operator's config names. The
    run directory's files never name either: anyone who can write there could name any."""
    pid = state.nbdkit_pid
    if (state.control_socket and ours_alive(pid, state.tool("nbdkit"), state.nbd_socket)
            and procfs.process_state(pid) not in STOPPED_STATES):
        try:
            reply = control.request(state.control_socket, "owned", timeout=min(timeout, 5.0))
        except control.ControlError:
            pass
        else:
            device = reply.get("device")
            return (device if isinstance(device, str) else None,
                    TierFile.from_reply(reply.get("tier")))
    path = config.pool.swap_out_path if config is not None else None
    return None, (TierFile(path) if path else None)


def device_is_ours(state: RunState, timeout: float = 5.0) -> bool:
    """Whether ``state.device`` is shown to be this chain's: the server says it serves it, or
    the kernel ties it to this chain (chain.foreign_device). What `down`'s progress report may
    watch: state.json alone may name any swap area, which `down` then refuses to touch."""
    served, _ = _owned(state, None, timeout)
    return foreign_device(state, served) is None


def _release_cgroups(run_dir: str) -> str:
    """Stop the tuner and put back every cgroup setting it recorded (cgroups.ledger.Ledger), before
    swapoff: pages coming back must not meet the tuner's squeezed limits."""
    from ..cgroups.ledger import release_all
    from ..cgroups.tuner.daemon import stop_daemon

    stop_daemon(run_dir)
    report = release_all(run_dir)
    return report.summary() if (report.restored or report.gone or report.failed) else ""


@contextlib.contextmanager
def attached(config=None, run_dir: str | None = None, **kwargs) -> Iterator[RunState]:
    """``with attached(cfg, run_dir, priority=..., plugin=...) as state:`` -- up, then a
    guaranteed teardown (forced swapoff) on exit, even on errors or KeyboardInterrupt."""
    state = up(config, run_dir=run_dir, **kwargs)
    try:
        yield state
    finally:
        down(state.run_dir, force=True, config=config, timeout=kwargs.get("timeout", 30.0))
