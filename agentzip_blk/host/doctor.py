"""``agentzip-blk doctor``: is this host set up for the device and the tuner? Pass/warn/fail.

``gather()`` reads the host (never changes it) into :class:`Facts`; ``diagnose(facts)`` turns
facts into :class:`Check` lines, each with a fix where there is one. Split so that tests can
feed made-up facts to the rules.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from .. import procfs
from ..config import old_key_names
from . import facts
from .kubelet import KubeletSwap, kubelet_command_line, read_kubelet_swap, verdict
from .procs import pid_alive

__all__ = ["Check", "Facts", "gather", "diagnose", "render", "worst", "PASS", "WARN", "FAIL"]

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""


@dataclass
class Facts:
    kernel: str = ""
    controller: str | None = None  # "v1" | "v2" | "hybrid" | None
    controller_mount: str = ""
    controller_error: str = ""
    memsw: bool = True  # v1 swap accounting files present
    has_reclaim: bool | None = None  # v2 memory.reclaim
    swaps: list[dict] = field(default_factory=list)  # SwapArea dicts, /proc/swaps order
    device: str | None = None  # our swap device, when attached
    mode: str | None = None  # fuse | nbd
    loop_device: str | None = None
    loop_dio: bool | None = None
    loop_control: bool = True
    zswap: bool = False
    nbd_module: bool = False
    fuse_dev: bool = True
    fuse_tools: list[str] = field(default_factory=list)  # missing among nbdfuse, fusermount3
    server_running: bool = False
    health: dict | None = None         # host.health.health() while something of ours runs or is swap
    server_locked: bool | None = None  # mlockall done in the server
    server_locked_bytes: int = 0
    nbdfuse_locked: bool | None = None
    native_built: bool = True  # the native request path's extension imports (datapath.native)
    native_missing: str = ""   # why not
    datapath_running: dict | None = None  # the server's stats["server"]["datapath"]
    old_config_keys: list[tuple[str, str]] = field(default_factory=list)  # (old, new) names
    scopes_enabled: list[str] = field(default_factory=list)
    scoped_cgroups: list[str] = field(default_factory=list)
    scoped_with_server: list[str] = field(default_factory=list)
    # machine-wide proactive reclaim (DAMON pageout on physical memory, DAMON_RECLAIM): it
    # swaps cold anon pages of *every* cgroup into whatever swap exists, scoped or not
    damon_anon_pageout: list[str] = field(default_factory=list)
    damon_file_only: list[str] = field(default_factory=list)  # pageout schemes that skip anon
    kubelet: KubeletSwap | None = None  # the kubelet's swap settings (host.kubelet)
    oomd_active: bool = False  # systemd-oomd runs: it kills the cgroup with most swap
    oomd_omit: bool | None = None  # sandbox slices say ManagedOOMPreference=omit; None: no units


def _kernel_tuple(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _under(root: str, path: str) -> str:
    return path if root in ("", "/") else os.path.join(root, path.lstrip("/"))


def gather(run_dir: str, config=None, root: str = "/", config_path: str | None = None,
           kubelet_config: str | None = None) -> Facts:
    """The facts of this host; `config_path` is the file `config` came from (None: the
    default path), read again for keys spelled the old way."""
    from ..cgroups.backends import open_backend
    from ..cgroups.fs import CgroupError
    from ..cgroups.scopes import scoped_cgroups
    from ..datapath import control, native
    from .chain import loop_dio
    from .health import health
    from .runstate import RunState

    f = Facts(kernel=os.uname().release)
    backend = None
    try:
        backend = open_backend(root)
        f.controller = backend.kind
        f.controller_mount = backend.mount
        own = backend.path(backend.own())
        if backend.version == 1:
            f.memsw = os.path.exists(os.path.join(own, "memory.memsw.limit_in_bytes")) or \
                os.path.exists(os.path.join(backend.mount, "memory.memsw.limit_in_bytes"))
        else:
            # the root cgroup may lack the file: look at ours and at the first-level children
            dirs = [own] + [e.path for e in os.scandir(backend.mount) if e.is_dir()][:5]
            f.has_reclaim = any(os.path.exists(os.path.join(d, "memory.reclaim")) for d in dirs)
    except CgroupError as e:
        f.controller_error = str(e)
    f.swaps = [a.to_dict() for a in procfs.swaps()]
    f.zswap = facts.zswap_enabled()
    f.nbd_module = facts.nbd_kernel_available()
    f.fuse_dev = os.path.exists("/dev/fuse")
    f.loop_control = os.path.exists("/dev/loop-control")
    f.fuse_tools = facts.missing_tools(["nbdfuse", "fusermount3"])
    f.native_built, f.native_missing = native.available(), native.MISSING
    f.damon_anon_pageout, f.damon_file_only = damon_pageout(_under(root, "/sys"))
    # None: the file the running kubelet's --config names (else kubeadm's), with its
    # --config-dir drop-ins and --fail-swap-on (host.kubelet)
    f.kubelet = read_kubelet_swap(kubelet_config, kubelet_command_line())
    f.oomd_active, f.oomd_omit = oomd(root)
    state = None
    try:
        state = RunState.load(run_dir)
    except Exception:
        state = None
    protected: set[int] = set()
    if state is not None and procfs.swap_area(state.device) is not None:
        f.device, f.mode, f.loop_device = state.device, state.mode, state.loop_device
        if state.mode == "fuse" and state.loop_device:
            f.loop_dio = loop_dio(state.loop_device)
        if state.nbdfuse_pid and pid_alive(state.nbdfuse_pid):
            f.nbdfuse_locked = procfs.process_locked(state.nbdfuse_pid) > 0
            protected.add(state.nbdfuse_pid)
    if state is not None and (f.device or pid_alive(state.nbdkit_pid)):
        f.health = health(state)
    if state is not None and state.nbdkit_pid and pid_alive(state.nbdkit_pid):
        f.server_running = True
        protected.add(state.nbdkit_pid)
        try:
            if not f.health["ok"]:
                raise RuntimeError("the server does not answer")
            st = control.request(state.control_socket, "stats", timeout=3.0)
            srv = st.get("server", {})
            f.server_locked = bool(srv.get("memory_locked"))
            f.server_locked_bytes = int(srv.get("locked_bytes") or 0)
            f.datapath_running = srv.get("datapath")
        except Exception:
            f.server_locked_bytes = procfs.process_locked(state.nbdkit_pid)
            f.server_locked = f.server_locked_bytes > 0
    if config is not None:
        f.old_config_keys = old_key_names(config_path)
        f.scopes_enabled = [s.cgroup for s in config.scopes if s.enabled]
        if backend is not None:
            f.scoped_cgroups = scoped_cgroups(backend.walk(), config.scopes)
            for rel in f.scoped_cgroups:
                if protected & set(backend.pids(rel)):
                    f.scoped_with_server.append(rel)
    return f


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _excludes_anon(scheme: str) -> bool:
    """Does a DAMOS scheme filter out anonymous pages? (kernels before the ``allow`` file:
    a matching filter always excludes)"""
    for kind in ("filters", "ops_filters", "core_filters"):
        base = os.path.join(scheme, kind)
        if not os.path.isdir(base):
            continue
        for name in os.listdir(base):
            flt = os.path.join(base, name)
            if not name.isdigit() or _read(os.path.join(flt, "type")) != "anon":
                continue
            matching = _read(os.path.join(flt, "matching")) == "Y"
            allow = _read(os.path.join(flt, "allow"))
            if matching and allow in ("", "N"):
                return True
            if not matching and allow == "Y":
                return True  # "only non-anon allowed"
    return False


def damon_pageout(sysfs: str = "/sys") -> tuple[list[str], list[str]]:
    """Running DAMON pageout schemes on physical memory: (those that may page out anon pages,
    those that exclude anon). Also DAMON_RECLAIM, which pages out anon and file alike."""
    anon, file_only = [], []
    if _read(os.path.join(sysfs, "module/damon_reclaim/parameters/enabled")) == "Y":
        anon.append("DAMON_RECLAIM (damon_reclaim.enabled=Y)")
    root = os.path.join(sysfs, "kernel/mm/damon/admin/kdamonds")
    for k in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        kd = os.path.join(root, k)
        if not k.isdigit() or _read(os.path.join(kd, "state")) != "on":
            continue
        ctxs = os.path.join(kd, "contexts")
        for c in sorted(os.listdir(ctxs)) if os.path.isdir(ctxs) else []:
            ctx = os.path.join(ctxs, c)
            if not c.isdigit() or _read(os.path.join(ctx, "operations")) != "paddr":
                continue
            schemes = os.path.join(ctx, "schemes")
            for sc in sorted(os.listdir(schemes)) if os.path.isdir(schemes) else []:
                scheme = os.path.join(schemes, sc)
                if not sc.isdigit() or _read(os.path.join(scheme, "action")) != "pageout":
                    continue
                name = f"kdamond {k} context {c} scheme {sc}"
                (file_only if _excludes_anon(scheme) else anon).append(name)
    return anon, file_only


# where systemd reads units from, most binding first (systemd.unit(5)); the sandbox slice and
# its prefix drop-in, as install-units (etc) and the .deb (usr/lib) put them
_UNIT_DIRS = ("etc/systemd/system", "run/systemd/system", "usr/lib/systemd/system",
              "lib/systemd/system")
_SANDBOX_UNITS = ("agent-sandbox.slice", "agent-sandbox-.slice.d")


def oomd(root: str = "/") -> tuple[bool, bool | None]:
    """(systemd-oomd runs, the sandbox slices are excluded from it). On a host where it runs
    (Fedora, Ubuntu) it kills the cgroup with the most swap once swap is 90% used: by design
    a sandbox. Read from the unit files (the cgroup's user.oomd_omit xattr exists only on v2)."""
    active = False
    with contextlib.suppress(OSError):
        for entry in os.scandir(_under(root, "/proc")):
            if entry.name.isdigit() and _read(os.path.join(entry.path, "comm")) == "systemd-oomd":
                active = True
                break
    values: dict[str, str] = {}  # unit -> its ManagedOOMPreference= ("" unset)
    for name in _SANDBOX_UNITS:
        for d in _UNIT_DIRS:  # the first directory that has it (systemd would merge drop-ins)
            path = os.path.join(_under(root, "/"), d, name)
            if os.path.isdir(path):
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".conf"))
            elif os.path.isfile(path):
                files = [path]
            else:
                continue
            values[name] = ""
            for line in "\n".join(_read(p) for p in files).splitlines():
                key, _, value = line.strip().partition("=")
                if key == "ManagedOOMPreference":
                    values[name] = value.strip()  # the last one counts
            break
    if not values:
        return active, None
    return active, all(values.get(n) == "omit" for n in _SANDBOX_UNITS)


def diagnose(f: Facts) -> list[Check]:
    """Every rule on the facts, in the order of the report."""
    return [check for rule in RULES for check in rule(f)]


def _kernel(f: Facts) -> Iterator[Check]:
    """The kernel's features the tuner and the device use."""
    k = _kernel_tuple(f.kernel)
    if k >= (6, 12):
        yield Check("kernel", PASS, f"Linux {f.kernel}: PSI, memory.reclaim, zero pages kept out of swap")
    elif k >= (5, 19):
        yield Check("kernel", PASS, f"Linux {f.kernel}: PSI and memory.reclaim (zero pages still "
                                    "go to the device; it stores them in 0 bytes)")
    elif k >= (4, 20):
        yield Check("kernel", WARN, f"Linux {f.kernel}: no memory.reclaim; the tuner pulses "
                                    "memory.high instead (the workload may stall in reclaim)",
                    "use Linux 5.19 or newer")
    else:
        yield Check("kernel", WARN, f"Linux {f.kernel}: no PSI; the tuner estimates pressure from faults",
                    "use Linux 5.19 or newer")


def _memory_cgroup(f: Facts) -> Iterator[Check]:
    """The memory cgroup controller."""
    if f.controller is None:
        yield Check("memory cgroup", FAIL, f.controller_error or "no memory controller found",
                    "boot with cgroup_enable=memory (and mount cgroup v2)")
    elif f.controller == "v2":
        detail = f"cgroup v2 at {f.controller_mount}"
        if f.has_reclaim is False:
            yield Check("memory cgroup", WARN, detail + "; no memory.reclaim", "use Linux 5.19 or newer")
        else:
            yield Check("memory cgroup", PASS, detail + ": PSI per cgroup, memory.reclaim")
    else:
        hybrid = f.controller == "hybrid"
        yield Check("memory cgroup", WARN,
                    f"cgroup v1 memory controller at {f.controller_mount}"
                    + (" (hybrid host: cgroup2 for the rest)" if hybrid else "")
                    + ": no memory.reclaim (the tuner pulses memory.limit_in_bytes); PSI per cgroup "
                    + ("only where a scoped cgroup is mirrored on the cgroup2 tree, else "
                       if hybrid else "") + "estimated from refaults and major faults",
                    "boot with systemd.unified_cgroup_hierarchy=1 (cgroup v2) for PSI-driven tuning")
        if not f.memsw:
            yield Check("swap accounting", WARN, "no memory.memsw.* files: per-cgroup swap is not "
                        "accounted and memory.stat has no swap figure",
                        "boot with swapaccount=1")
        else:
            yield Check("swap accounting", PASS, "memory.memsw.* present: per-cgroup swap accounted")


def _swap_areas(f: Facts) -> Iterator[Check]:
    """The swap areas, ours and the others."""
    ours = next((a for a in f.swaps if f.device and
                 os.path.realpath(a["filename"]) == os.path.realpath(f.device)), None)
    others = [a for a in f.swaps if a is not ours]
    if ours is None:
        msg = "device not attached"
        if others:
            msg += "; other swap: " + ", ".join(f"{a['filename']} (priority {a['priority']})" for a in others)
        yield Check("swap areas", WARN, msg, "agentzip-blk up")
    else:
        higher = [a for a in others if a["priority"] > ours["priority"]]
        equal = [a for a in others if a["priority"] == ours["priority"]]
        desc = f"{ours['filename']} priority {ours['priority']}"
        if higher:
            yield Check("swap areas", FAIL, desc + "; higher priority, takes pages first: " +
                        ", ".join(f"{a['filename']} ({a['priority']})" for a in higher),
                        f"swapoff {higher[0]['filename']}, or agentzip-blk down && agentzip-blk up "
                        f"--priority {max(a['priority'] for a in higher) + 1}")
        elif equal:
            yield Check("swap areas", WARN, desc + "; same priority, pages shared round-robin with " +
                        ", ".join(a["filename"] for a in equal),
                        f"swapoff {equal[0]['filename']} or give it a lower priority")
        else:
            rest = f"; others lower: {', '.join(a['filename'] for a in others)}" if others else ", the only swap"
            yield Check("swap areas", PASS, desc + rest)


def _zswap(f: Facts) -> Iterator[Check]:
    """zswap, which would compress twice."""
    if f.zswap:
        yield Check("zswap", FAIL, "enabled: it compresses pages before they reach the device "
                    "(double compression, and the device sees only what zswap rejects)",
                    f"{facts.ZSWAP_DISABLE_HINT} (permanently: zswap.enabled=0 on the kernel command line)")
    else:
        yield Check("zswap", PASS, "off")


def _attach_path(f: Facts) -> Iterator[Check]:
    """The attach path: nbd, or FUSE and a loop device with direct I/O."""
    if f.nbd_module:
        yield Check("nbd module", PASS, "kernel nbd present: up attaches through nbd-client -swap")
    else:
        yield Check("nbd module", WARN, "not loaded: up attaches through nbdfuse + loop (more copies, "
                    "slower swap-in)", "modprobe nbd && apt-get install nbd-client")
    fuse_ok = f.fuse_dev and not f.fuse_tools
    if fuse_ok:
        yield Check("fuse", PASS, "/dev/fuse, nbdfuse and fusermount3 present")
    else:
        missing = ([] if f.fuse_dev else ["/dev/fuse"]) + f.fuse_tools
        yield Check("fuse", WARN if f.nbd_module else FAIL, "missing: " + ", ".join(missing) +
                    ("" if f.nbd_module else " (and no kernel nbd: nothing to attach with)"),
                    "apt-get install fuse3 libnbd-bin; modprobe fuse")
    if f.mode == "fuse" and f.loop_device:
        if f.loop_dio:
            yield Check("loop direct-io", PASS, f"{f.loop_device}: direct I/O on")
        else:
            yield Check("loop direct-io", FAIL, f"{f.loop_device}: direct I/O OFF: every swapped page "
                        "also stays in the page cache, nothing is saved",
                        "agentzip-blk down && agentzip-blk up (up insists on --direct-io=on)")
    elif f.mode == "nbd":
        yield Check("loop direct-io", PASS, "kernel nbd: no loop device in the path")
    elif not f.loop_control:
        yield Check("loop direct-io", FAIL if not f.nbd_module else WARN, "no /dev/loop-control",
                    "modprobe loop")
    else:
        yield Check("loop direct-io", PASS, "loop devices available; up attaches with --direct-io=on "
                    "and verifies it")


def _server(f: Facts) -> Iterator[Check]:
    """The server: health and locked memory."""
    if f.health is not None:
        if f.health["ok"]:
            yield Check("server health", PASS, "nbdkit answers health (store lock taken) and a 4 KiB "
                        "read through the chain succeeded")
        else:
            yield Check("server health", FAIL, "; ".join(f.health["problems"]),
                        "`kill -CONT` a stopped server; a dead one has lost its pages: stop the "
                        "workloads, then `agentzip-blk down --force` and `up`")
    if not f.server_running:
        yield Check("server memory", WARN, "server not running: nothing to check", "agentzip-blk up")
    elif f.server_locked:
        detail = f"nbdkit memory locked ({f.server_locked_bytes >> 20} MiB)"
        if f.nbdfuse_locked is False:
            yield Check("server memory", WARN, detail + "; nbdfuse NOT locked: under pressure it can "
                        "swap onto its own device and deadlock", "apt-get install gcc; down; up")
        else:
            yield Check("server memory", PASS, detail + (", nbdfuse locked" if f.nbdfuse_locked else ""))
    else:
        yield Check("server memory", FAIL, "nbdkit memory NOT locked: a server page swapped onto its "
                    "own device deadlocks the swap-in",
                    "raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in the unit, `ulimit -l "
                    "unlimited`) or keep CAP_IPC_LOCK, then down and up")


def _request_priority(f: Facts) -> Iterator[Check]:
    """What the FUSE workers answer reads at (device.request_priority, datapath.priority)."""
    # the health reply says it (host.health); None: no FUSE door, or nothing answers
    door = ((f.health or {}).get("nbdkit") or {})
    if door.get("request_priority") is None:
        return
    refused = door.get("request_priority_refused")
    if refused:
        yield Check("request priority", WARN,
                    f"device.request_priority: realtime was refused ({refused}): faults are "
                    "answered at the normal priority, behind the sandboxes' CPU slices",
                    "run the server with CAP_SYS_NICE (and real-time time in its cpu cgroup), "
                    "or set device.request_priority: normal; down; up")
        return
    yield Check("request priority", PASS,
                f"the FUSE workers answer reads at the {door['request_priority']} priority")


def _request_path(f: Facts) -> Iterator[Check]:
    """Which request path the server runs (device.datapath), and whether the native one
    could run here."""
    running = f.datapath_running
    if running is not None:
        detail = f"the server runs the {running.get('path')} request path ({running.get('reason')})"
        if running.get("path") == "native":
            detail += (f"; {running.get('native_reads', 0)} reads answered natively, "
                       f"{running.get('native_handed_up', 0)} requests handed to Python")
        elif not f.native_built:
            yield Check("request path", WARN, detail, "apt-get install gcc python3-dev liblz4-dev "
                        "libxxhash-dev; reinstall the package; down; up")
            return
        yield Check("request path", PASS, detail)
    elif not f.native_built:
        yield Check("request path", WARN, f"{f.native_missing}: every request would be served in "
                    "Python (slower warm faults)", "apt-get install gcc python3-dev liblz4-dev "
                    "libxxhash-dev; reinstall the package")
    else:
        yield Check("request path", PASS, "the native request path is built (device.datapath: auto "
                    "uses it)")


def _host_reclaim(f: Facts) -> Iterator[Check]:
    """Other proactive reclaim on the host."""
    if f.damon_anon_pageout:
        yield Check("host reclaim", WARN, "machine-wide DAMON pageout may swap anon pages of every "
                    "cgroup, scoped or not, into the device: " + ", ".join(f.damon_anon_pageout),
                    "add a DAMOS filter to the scheme (type anon, allow N), or limit it to the "
                    "scoped cgroups with memcg filters")
    elif f.damon_file_only:
        yield Check("host reclaim", PASS, "DAMON pageout runs (" + ", ".join(f.damon_file_only) +
                    ") but excludes anon pages: it never swaps")
    else:
        yield Check("host reclaim", PASS, "no machine-wide proactive reclaim (DAMON) pages out anon memory")


def _oomd(f: Facts) -> Iterator[Check]:
    """systemd-oomd and the sandboxes: they must be left out of its choice."""
    if not f.oomd_active:
        yield Check("systemd-oomd", PASS, "not running: nothing kills a sandbox for its swap use")
    elif f.oomd_omit:
        yield Check("systemd-oomd", PASS, "running; the sandbox slices are excluded "
                    "(ManagedOOMPreference=omit)")
    else:
        what = "the sandbox slices are not installed" if f.oomd_omit is None else \
            "the sandbox slices are not excluded (ManagedOOMPreference=omit)"
        yield Check("systemd-oomd", FAIL, f"running, and {what}: once swap is 90% used it kills "
                    "the cgroup with the most swap, a sandbox by design",
                    "agentzip-blk install-units (or the .deb's units); systemctl daemon-reload")


def _old_config_keys(f: Facts) -> Iterator[Check]:
    """Config keys spelled the old way: accepted, but said."""
    if f.old_config_keys:
        yield Check("config keys", WARN, "; ".join(f"{old} is the old name of {new}"
                                                  for old, new in f.old_config_keys),
                    "rename " + ", ".join(f"{old} to {new}" for old, new in f.old_config_keys))


def _scopes(f: Facts) -> Iterator[Check]:
    """The scopes and what they match."""
    if not f.scopes_enabled:
        yield Check("scopes", WARN, "no enabled scope: the tuner touches no cgroup",
                    "agentzip-blk scope add --cgroup 'agent-sandbox-*.slice'")
    elif f.scoped_with_server:
        yield Check("scopes", FAIL, "scoped cgroup(s) hold the swap server itself: " +
                    ", ".join(f.scoped_with_server) + " (the tuner skips them)",
                    "narrow the scope glob so that it excludes the server's cgroup")
    elif not f.scoped_cgroups:
        yield Check("scopes", WARN, f"enabled: {', '.join(f.scopes_enabled)}; no cgroup matches now",
                    "check the globs against the cgroup tree (agentzip-blk scope list)")
    else:
        shown = ", ".join(f.scoped_cgroups[:5]) + (" ..." if len(f.scoped_cgroups) > 5 else "")
        yield Check("scopes", PASS, f"{len(f.scoped_cgroups)} cgroup(s) in scope: {shown}")


def _kubelet(f: Facts) -> Iterator[Check]:
    """The kubelet's failSwapOn and memorySwap.swapBehavior (docs/KUBERNETES.md)."""
    if f.kubelet is not None:
        yield Check("kubelet swap", *verdict(f.kubelet))


RULES = (_kernel, _memory_cgroup, _swap_areas, _zswap, _attach_path, _server, _request_path,
         _request_priority,
         _host_reclaim,
         _oomd, _old_config_keys, _scopes, _kubelet)


def worst(checks: list[Check]) -> str:
    order = {PASS: 0, WARN: 1, FAIL: 2}
    return max((c.status for c in checks), key=order.__getitem__, default=PASS)


def render(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def to_json(checks: list[Check]) -> str:
    return json.dumps({"status": worst(checks), "checks": [asdict(c) for c in checks]}, sort_keys=True)
