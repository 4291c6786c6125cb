"""The run directory and what it records: RunState (pids, sockets, mountpoint, loop device),
so that `status` and `down` work from any shell::

    RUN/state.json      RunState
    RUN/nbd.sock        nbdkit's NBD unix socket
    RUN/control.sock    the plugin's JSON control socket
    RUN/nbdkit.{pid,log}, RUN/nbdfuse.{pid,log}
    RUN/mnt/nbd         the nbdfuse file that backs the loop device
    RUN/holder.{sock,pid,log}  the holder of the server's descriptors (host.holder)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

from .. import __version__
from ..errors import DeviceError, SetupError
from .rundir import open_private, secure_run_dir

DEFAULT_RUN_DIR = "/run/agentzip"


DEFAULT_PRIORITY = 100


STATE_FILE = "state.json"


# The layout of state.json. A newer one than this program knows is refused in one line (its
# keys may mean what this program cannot act on safely); a file without the key is format 0,
# the same layout.
STATE_FORMAT = 1


# Tool names; ``up`` takes a ``tools`` dict that overrides these for its own process (tests).
# Overrides are never written to state.json: a file in the run directory must not tell root
# what to execute; ``down`` finds the tools again (chain.resolve_tool, on a fixed PATH).
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


@dataclass
class RunState:
    run_dir: str
    plugin: str
    nbd_socket: str
    control_socket: str | None = None
    config_path: str | None = None
    config_sha256: str | None = None  # of config_path as `up` wrote it (its server checks it)
    size: int = 0
    swap_priority: int = DEFAULT_PRIORITY
    mode: str = "fuse"              # "fuse" (loop over a FUSE file) or "nbd" (kernel nbd)
    # who serves the FUSE file: "fuse" (the server itself, datapath.fuse) or "nbdfuse";
    # "nbd" in nbd mode. The default is what state files written before the key meant.
    frontend: str = "nbdfuse"
    nbdkit_pid: int | None = None
    nbdfuse_pid: int | None = None
    # the FUSE door's holder of the server's descriptors (host.holder); None: none runs
    holder_pid: int | None = None
    recoveries: int = 0             # servers the holder started after a crash
    mountpoint: str | None = None
    fuse_file: str | None = None
    loop_device: str | None = None
    nbd_device: str | None = None
    device: str | None = None       # the block device used as swap
    mkswap_done: bool = False
    swap_on: bool = False
    started: float = field(default_factory=time.time)
    # in-process overrides only (see TOOLS): never saved, and ignored in old state files
    tools: dict = field(default_factory=dict, repr=False)
    mlock: bool = True              # lock nbdfuse (preload shim); --swap for a named plugin
    oom_protected: bool = False     # oom_score_adj -1000 set on nbdkit (and nbdfuse)
    nbdfuse_locked: bool = False    # nbdfuse runs with the mlockall preload shim
    rotational: bool = False        # device.rotational: flag the loop device before swapon
    format: int = STATE_FORMAT      # the layout of this file (STATE_FORMAT)
    version: str = __version__      # the agentzip-blk that ran `up` (and so started the server)

    # -- persistence ---------------------------------------------------------------
    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, STATE_FILE)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open_private(tmp) as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, run_dir: str) -> "RunState | None":
        path = os.path.join(run_dir, STATE_FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except PermissionError:
            raise SetupError(f"{path}: permission denied: the run directory is root's "
                             f"alone; run this as root") from None
        except (OSError, ValueError) as e:
            raise DeviceError(f"cannot read {path}: {e}; remove it if nothing is attached") from None
        # "tools" (tool paths) was saved before: a file must not name what root executes
        known = {f.name for f in fields(cls)} - {"tools"}
        if not isinstance(data, dict):
            raise DeviceError(f"cannot read {path}: not a JSON object; remove it if nothing "
                              f"is attached")
        fmt = data.get("format", 0)
        if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt > STATE_FORMAT:
            raise SetupError(f"{path} has format {fmt!r} (written by agentzip-blk "
                              f"{data.get('version', '?')}); this agentzip-blk {__version__} "
                              f"reads format {STATE_FORMAT} at most: run the agentzip-blk that "
                              f"ran `up`")
        data = {k: v for k, v in data.items() if k in known}
        data.setdefault("format", 0)
        data.setdefault("version", "")  # before 0.1.0 state files named no version
        data["run_dir"] = run_dir
        try:
            state = cls(**data)
        except TypeError as e:
            raise DeviceError(f"cannot read {path}: {e}; remove it if nothing is attached") from None
        bad = state.misplaced()
        if bad:
            key, value = bad
            raise DeviceError(f"{path} names {key} {value!r}, which is not where `up` puts it: "
                              f"refusing to act on it; remove {path} if nothing is attached")
        return state

    def misplaced(self) -> tuple[str, object] | None:
        """The first recorded path that is not where `up` puts it, or None. `down` swaps off,
        detaches, unmounts and removes what the state names: a file must not point it at
        anything else (another swap area, loop device or mount)."""
        real = os.path.realpath(self.run_dir)  # never resolves inside the FUSE mount
        mnt = os.path.join(real, "mnt")

        def in_run_dir(p) -> bool:
            return isinstance(p, str) and os.path.realpath(os.path.dirname(p)) == real

        checks = [
            ("nbd_socket", in_run_dir(self.nbd_socket)),
            ("control_socket", self.control_socket is None or in_run_dir(self.control_socket)),
            ("mountpoint", self.mountpoint in (None, mnt)),
            ("fuse_file", self.fuse_file is None
             or (isinstance(self.fuse_file, str) and os.path.dirname(self.fuse_file) == mnt)),
            ("loop_device", self.loop_device is None or _is_dev(self.loop_device, "loop")),
            ("nbd_device", self.nbd_device is None or _is_dev(self.nbd_device, "nbd")),
            ("device", self.device is None or _is_dev(self.device, "loop")
             or _is_dev(self.device, "nbd")),
        ]
        for key, ok in checks:
            if not ok:
                return key, getattr(self, key)
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("tools", None)
        return d

    def tool(self, name: str) -> str:
        return self.tools.get(name) or TOOLS[name]


def _is_dev(path, kind: str) -> bool:
    return isinstance(path, str) and re.fullmatch(rf"/dev/{kind}[0-9]+", path) is not None


@contextlib.contextmanager
def locked(run_dir: str, group_gid: int | None = None, *, keep_group: bool = True,
           wait: float = 0.0) -> Iterator[None]:
    """Serialise up/down on one run directory, after making it root's alone (rundir):
    ``up`` passes ``keep_group=False`` and the control group, so the mode is exact.
    ``wait``: seconds to wait for a holder of the lock (the holder's record of a recovery);
    the commands refuse at once."""
    secure_run_dir(run_dir, group_gid, keep_group=keep_group)
    fd = os.open(os.path.join(run_dir, "lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise SetupError(f"another agentzip-blk up/down is running on {run_dir}: "
                                     f"wait for it to finish") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def config_device(config) -> tuple[int | None, int | None, str | None]:
    dev = getattr(config, "device", None) if config is not None else None
    return (getattr(dev, "size", None), getattr(dev, "swap_priority", None),
            getattr(dev, "run_dir", None))


def resolve_run_dir(config=None, run_dir: str | None = None) -> str:
    if run_dir:
        return os.path.abspath(run_dir)
    _, _, cfg_dir = config_device(config)
    return os.path.abspath(cfg_dir or DEFAULT_RUN_DIR)
