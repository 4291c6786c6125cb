"""`status` and health: what is attached from a run directory, and whether the chain answers
(the server's health verb takes the store lock; one O_DIRECT read goes through the chain)."""

from __future__ import annotations

import subprocess
import time

from .. import __version__, procfs
from ..datapath import control
from . import facts, holder
from .chain import is_mounted, loop_dio, loop_is_ours, loop_rotational
from .procs import STOPPED_STATES, ours_alive
from .runstate import RunState, resolve_run_dir

# `status`, `doctor` and the exporter wait this long for the chain to answer
HEALTH_TIMEOUT = 2.0


def status(run_dir: str | None = None, *, config=None,
           health_timeout: float = HEALTH_TIMEOUT) -> dict:
    """What is attached from ``run_dir``, its health, host swap facts and warnings.
    ``healthy`` is None when nothing of ours runs or is swap."""
    run_dir = resolve_run_dir(config, run_dir)
    state = RunState.load(run_dir)
    areas = procfs.swaps()
    zswap = facts.zswap_enabled()
    out: dict = {"run_dir": run_dir, "attached": False, "healthy": None, "health": None,
                 "state": None, "server": None,
                 "nbdfuse": None, "device": None, "mode": None, "loop": None, "mount": None,
                 "swap": None, "other_swaps": [], "higher_priority_swaps": [],
                 "zswap_enabled": zswap, "kernel_nbd": facts.nbd_kernel_available(),
                 "warnings": []}
    warnings: list[str] = out["warnings"]
    ours = None
    if state is not None:
        out["state"] = state.to_dict()
        out["device"] = state.device
        out["mode"] = state.mode
        alive = ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket)
        out["server"] = {"pid": state.nbdkit_pid, "alive": alive,
                         "rss": procfs.process_rss(state.nbdkit_pid) if alive else 0,
                         # the FUSE door serves without NBD: no socket (chain.up_steps)
                         "socket": None if state.frontend == "fuse" else state.nbd_socket,
                         "control": state.control_socket,
                         "plugin": state.plugin, "size": state.size,
                         "started": state.started}
        if state.mode == "fuse" and state.frontend == "nbdfuse":
            falive = ours_alive(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file)
            out["nbdfuse"] = {"pid": state.nbdfuse_pid, "alive": falive,
                              "rss": procfs.process_rss(state.nbdfuse_pid) if falive else 0,
                              "locked": procfs.process_locked(state.nbdfuse_pid) if falive else 0}
            if falive and not out["nbdfuse"]["locked"]:
                warnings.append("nbdfuse's memory is not locked (no C compiler for the mlock "
                                "shim?): under heavy pressure it can swap onto its own device "
                                "and deadlock; apt-get install gcc and re-run up")
        if state.mode == "fuse":
            out["mount"] = {"path": state.mountpoint, "file": state.fuse_file,
                            "mounted": is_mounted(state.mountpoint)}
            if state.loop_device:
                out["loop"] = {"device": state.loop_device, "attached": loop_is_ours(state),
                               "backing_file": procfs.loop_backing(state.loop_device),
                               "dio": loop_dio(state.loop_device),
                               "rotational": loop_rotational(state.loop_device)}
                if state.rotational and out["loop"]["rotational"] is False:
                    warnings.append(f"device.rotational is set but {state.loop_device} is not "
                                    "flagged rotational (read-only sysfs?): swap readahead "
                                    "follows each process instead of the device")
        ours = procfs.swap_area(state.device)
        if ours is not None:
            out["swap"] = ours.to_dict()
        out["attached"] = alive and ours is not None
        if ours is not None or alive:
            out["health"] = health(state, health_timeout)
            out["healthy"] = out["health"]["ok"]
            out["server"]["datapath"] = out["health"]["nbdkit"].get("datapath")
            out["server"]["request_priority"] = out["health"]["nbdkit"].get("request_priority")
            running = out["health"]["nbdkit"].get("version")
            out["server"]["version"] = running
            if out["health"]["nbdkit"].get("started") is not None:
                out["server"]["started"] = out["health"]["nbdkit"]["started"]
            out["server"]["restarts"] = out["health"]["nbdkit"].get("restarts")
            out["server"]["recoveries"] = out["health"]["nbdkit"].get("recoveries")
            if out["health"]["nbdkit"].get("responsive") and running != __version__:
                warnings.append(version_warning(running, out["server"]["started"]))
        out["server"]["oom_protected"] = state.oom_protected
        # the holder of the server's descriptors (host.holder), whether the server committed
        # them to it (its health reply), and the crashes it recovered (the server's count,
        # else state.json's)
        held = holder.is_holder(state.holder_pid, state.run_dir) if state.holder_pid else None
        committed = ((out["health"] or {}).get("nbdkit") or {}).get("holder")
        out["server"]["holder"] = ({"pid": state.holder_pid, "alive": held,
                                    "committed": committed} if state.holder_pid else None)
        pinned = holder.pins(state.run_dir) if held else None
        if pinned is not None:
            out["server"]["holder"].update(pinned)
            if pinned["pin_errors"]:
                warnings.append("the holder cannot keep the store's memory locked ("
                                + "; ".join(pinned["pin_errors"][:3]) + "): after a crash of "
                                "the server the kernel may swap it onto this device, and the "
                                "recovery would hang")
        if out["server"].get("recoveries") is None:
            out["server"]["recoveries"] = state.recoveries
        if held is False and (alive or ours is not None):
            warnings.append(f"the holder of the server's descriptors (pid {state.holder_pid}) "
                            "is not running: a crash of the server would lose every page; "
                            "`agentzip-blk down` and `up` start a new one")
        srv = (out["health"] or {}).get("nbdkit") or {}
        if srv.get("memory_locked") is False:
            warnings.append(f"the server's memory is not locked (mlockall: "
                            f"{srv.get('memory_lock_error')}): a server page swapped onto its "
                            "own device deadlocks every swap-in; raise RLIMIT_MEMLOCK "
                            "(LimitMEMLOCK=infinity in the unit, `ulimit -l unlimited`) and "
                            "run down and up")
        if srv.get("request_priority_refused"):
            warnings.append(f"device.request_priority: realtime was refused "
                            f"({srv['request_priority_refused']}): the FUSE workers answer "
                            "faults at the normal priority, behind the sandboxes' CPU slices; "
                            "run the server with CAP_SYS_NICE and real-time time in its cpu "
                            "cgroup, or set device.request_priority: normal")
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
                        f"(double compression): {facts.ZSWAP_DISABLE_HINT}")
    return out


def version_warning(running: str | None, started: float | None) -> str:
    """The server runs other code than the installed program (an upgrade since `up`)."""
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            if isinstance(started, (int, float)) else "?")
    return (f"the server runs agentzip-blk {running or 'older than 0.1.0'} (started {when}), "
            f"the installed agentzip-blk is {__version__}: the new code serves after "
            f"`systemctl restart agentzip-blk` (down, then up: swapoff first)")


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
    if ours_alive(state.nbdkit_pid, state.tool("nbdkit"), state.nbd_socket):
        srv["state"] = procfs.process_state(state.nbdkit_pid)
        if srv["state"] in STOPPED_STATES:
            problems.append(f"nbdkit (pid {state.nbdkit_pid}) is stopped (SIGSTOP?): every "
                            "swap-in waits; `kill -CONT` it")
        elif state.control_socket:
            try:
                reply = control.request(state.control_socket, "health", timeout=timeout)
                srv["responsive"] = True
                srv["guarded"] = bool(reply.get("guarded"))
                srv["datapath"] = reply.get("datapath")  # native or python (datapath.native)
                # the code the server runs; None from a server older than the key
                srv["version"] = reply.get("version")
                srv["started"] = reply.get("started")
                # handovers without swapoff this store went through (agentzip-blk restart)
                srv["restarts"] = reply.get("restarts")
                srv["recoveries"] = reply.get("recoveries")
                srv["holder"] = reply.get("holder")
                srv["last_repair"] = reply.get("last_repair")
                srv["memory_locked"] = reply.get("memory_locked")  # None: an older server
                srv["memory_lock_error"] = reply.get("memory_lock_error")
                srv["request_priority"] = reply.get("request_priority")
                srv["request_priority_refused"] = reply.get("request_priority_refused")
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
        if ours_alive(state.nbdfuse_pid, state.tool("nbdfuse"), state.fuse_file):
            fz["state"] = procfs.process_state(state.nbdfuse_pid)
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
