"""cgroupfs: find the memory controller, read and write cgroup files, and MemoryCgroup, a
cgroup this program creates below its own (the demo's and the tests' workloads), limits and
removes. The scoped cgroups of other programs are reached through `backends`, over the same
helpers. Works on both hierarchies:

- cgroup v1: a hierarchy mounted with the ``memory`` option (``/proc/mounts``); our own
  cgroup is the ``memory`` line of ``/proc/self/cgroup``.
- cgroup v2: the unified hierarchy, when ``memory`` is in its ``cgroup.controllers``;
  our own cgroup is the ``0::`` line.

v1 wins when both exist, because a controller bound to v1 is absent from v2.

Everything goes through a *root* directory (default ``/``): ``ROOT/proc/mounts``,
``ROOT/proc/self/cgroup`` and the mount points found there, prefixed with ROOT (a container
that sees the host's / at /host passes that). Which kind of file system the hierarchy is,
and so how its files are written and its cgroups removed, is another matter, said by the
caller: ``tree`` (``tree.Cgroupfs`` unless told otherwise; unit tests build a fake hierarchy
of plain files in a temp directory and pass it as ``root`` with ``tree=PlainTree(root)``).

    with MemoryCgroup.create("demo") as cg:
        cg.add_pid(pid)
        cg.set_limit(256 << 20)
        print(cg.usage(), cg.swap_usage())
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from .tree import CGROUPFS, CgroupTree

SAME = object()  # set_limit(max_limit=SAME): memory.max follows memory.high

V1_UNLIMITED = 9223372036854771712  # what v1 reports for "no limit" (largest page-aligned long)


class CgroupError(RuntimeError):
    """A cgroup operation failed; the message says which file and what to do."""


class LimitBusy(CgroupError):
    """v1 could not reclaim enough to honour a lower limit (EBUSY)."""


@dataclass(frozen=True)
class MemoryController:
    version: int  # 1 or 2
    mount: str  # absolute path of the hierarchy's mount point (ROOT already applied)
    own: str  # our own cgroup, relative to the mount, "/" for the root cgroup
    root: str = "/"
    tree: CgroupTree = CGROUPFS  # how its control files are written, its cgroups removed

    @property
    def own_path(self) -> str:
        return join_rel(self.mount, self.own)


def join_rel(mount: str, rel: str) -> str:
    rel = rel.strip("/")
    return os.path.join(mount, rel) if rel else mount


def under_root(root: str, path: str) -> str:
    if root in ("", "/"):
        return path
    return os.path.join(root, path.lstrip("/"))


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


def unescape_mount(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def detect(root: str = "/", pid: int | str = "self",
           tree: CgroupTree = CGROUPFS) -> MemoryController:
    """Where the memory controller lives and which cgroup *pid* (default: we) belongs to.
    *tree*: the kind of hierarchy it is, as the caller knows it (cgroupfs unless told
    otherwise, whatever the root: a tree of plain files is declared, tree.PlainTree)."""
    try:
        mounts = read_file(under_root(root, "/proc/mounts"))
    except OSError as e:
        raise CgroupError(f"cannot read /proc/mounts: {e}") from None
    try:
        membership = read_file(under_root(root, f"/proc/{pid}/cgroup"))
    except OSError as e:
        raise CgroupError(f"cannot read /proc/{pid}/cgroup: {e}") from None

    v1_mount = None
    v2_mounts = []
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        fstype, mnt, opts = parts[2], unescape_mount(parts[1]), parts[3].split(",")
        if fstype == "cgroup" and "memory" in opts and v1_mount is None:
            v1_mount = mnt
        elif fstype == "cgroup2":
            v2_mounts.append(mnt)

    v1_own = v2_own = None
    for line in membership.splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            v2_own = path or "/"
        elif "memory" in ctrls.split(","):
            v1_own = path or "/"

    if v1_mount is not None and v1_own is not None:
        return MemoryController(1, under_root(root, v1_mount), v1_own, root, tree)
    for mnt in v2_mounts:
        m = under_root(root, mnt)
        try:
            ctrls = read_file(os.path.join(m, "cgroup.controllers")).split()
        except OSError:
            continue
        if "memory" in ctrls and v2_own is not None:
            return MemoryController(2, m, v2_own, root, tree)
    raise CgroupError(
        "no memory cgroup controller found (neither a v1 'memory' hierarchy in /proc/mounts "
        "nor 'memory' in a cgroup2 cgroup.controllers); enable it (cgroup_enable=memory) "
        "or mount it"
    )


def parse_kv(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


class MemoryCgroup:
    """One memory cgroup. ``create`` makes a child of our own cgroup; ``remove`` deletes it."""

    def __init__(self, controller: MemoryController, rel: str):
        self.controller = controller
        self.rel = "/" + rel.strip("/")
        self.path = join_rel(controller.mount, self.rel)

    # -- construction -----------------------------------------------------------------

    @classmethod
    def own(cls, root: str = "/", controller: MemoryController | None = None) -> "MemoryCgroup":
        c = controller or detect(root)
        return cls(c, c.own)

    @classmethod
    def create(cls, name: str, root: str = "/", controller: MemoryController | None = None,
               exist_ok: bool = False) -> "MemoryCgroup":
        """Create cgroup *name* below our own memory cgroup (v2: enabling +memory on the way)."""
        if not name or "/" in name or name in (".", ".."):
            raise CgroupError(f"bad cgroup name {name!r}: one path component expected")
        c = controller or detect(root)
        parent = cls(c, c.own)
        if c.version == 2:
            parent._v2_enable_memory()
        child = cls(c, c.own.rstrip("/") + "/" + name)
        try:
            os.mkdir(child.path)
        except FileExistsError:
            if not exist_ok:
                raise CgroupError(f"{child.path} already exists (a previous run left it? remove it "
                                  "with rmdir once it has no processes)") from None
        except OSError as e:
            raise CgroupError(f"cannot create {child.path}: {e.strerror}"
                              + ("; run as root" if e.errno in (errno.EACCES, errno.EPERM) else "")) from None
        return child

    def _v2_enable_memory(self) -> None:
        """Make sure this cgroup's children get the memory controller (v2)."""
        if "memory" in self._subtree_control():
            return
        # the controller must be available here first: walk up if it is not
        if "memory" not in self._controllers() and self.rel != "/":
            self.parent()._v2_enable_memory()
        try:
            self.controller.tree.write(self.file("cgroup.subtree_control"), "+memory")
        except OSError as e:
            hint = ""
            if e.errno == errno.EBUSY:
                hint = (" (v2 'no internal processes' rule: this cgroup has processes of its own; "
                        "run from a delegated cgroup, e.g. systemd-run --scope -p Delegate=yes)")
            raise CgroupError(f"cannot enable +memory in {self.file('cgroup.subtree_control')}: "
                              f"{e.strerror}{hint}") from None

    def _subtree_control(self) -> list[str]:
        try:
            return [w.lstrip("+") for w in read_file(self.file("cgroup.subtree_control")).split()]
        except FileNotFoundError:
            return []

    def _controllers(self) -> list[str]:
        try:
            return read_file(self.file("cgroup.controllers")).split()
        except FileNotFoundError:
            return []

    def parent(self) -> "MemoryCgroup":
        return MemoryCgroup(self.controller, os.path.dirname(self.rel.rstrip("/")) or "/")

    # -- files ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.controller.version

    @property
    def name(self) -> str:
        return os.path.basename(self.rel) or "/"

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read(self, name: str) -> str:
        return read_file(self.file(name)).strip()

    def write(self, name: str, value) -> None:
        try:
            self.controller.tree.write(self.file(name), str(value))
        except OSError as e:
            raise CgroupError(f"cannot write {value!r} to {self.file(name)}: {e.strerror}") from e

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def __repr__(self) -> str:
        return f"MemoryCgroup(v{self.version}, {self.path!r})"

    # -- processes --------------------------------------------------------------------

    def add_pid(self, pid: int) -> None:
        self.write("cgroup.procs", int(pid))

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self.read("cgroup.procs").split()]
        except FileNotFoundError:
            return []

    # -- limits -----------------------------------------------------------------------

    def set_limit(self, limit: int | None, max_limit=SAME) -> None:
        """Limit the cgroup's memory; None lifts it.

        v1: ``memory.limit_in_bytes`` (the write reclaims synchronously; ``LimitBusy`` when the
        kernel could not get usage under it; *max_limit* is ignored). v2: ``memory.high`` =
        *limit* and ``memory.max`` = *max_limit*, which defaults to *limit*; pass ``None`` (no
        hard limit) or a larger number to squeeze through memory.high alone, because a
        memory.max the kernel cannot reclaim down to OOM-kills the cgroup.
        """
        if self.version == 1:
            value = -1 if limit is None else int(limit)
            try:
                self.controller.tree.write(self.file("memory.limit_in_bytes"), str(value))
            except OSError as e:
                if e.errno == errno.EBUSY:
                    raise LimitBusy(f"{self.file('memory.limit_in_bytes')}: cannot reclaim below "
                                    f"{value} bytes (EBUSY; usage {self.usage()})") from None
                raise CgroupError(f"cannot write {value} to {self.file('memory.limit_in_bytes')}: "
                                  f"{e.strerror}") from None
            return
        high = "max" if limit is None else str(int(limit))
        if max_limit is SAME:
            mx = high
        else:
            mx = "max" if max_limit is None else str(int(max_limit))
        # raising: max first so high never exceeds it; lowering: high first (reclaims), then max
        cur = self.limit()
        if limit is None or cur is None or int(limit) > cur:
            self.write("memory.max", mx)
            self.write("memory.high", high)
        else:
            self.write("memory.high", high)
            self.write("memory.max", mx)

    def allow_swap(self) -> None:
        """v2: memory.swap.max = max (where swap accounting exists); v1: memsw unlimited."""
        if self.version == 2:
            if os.path.exists(self.file("memory.swap.max")):
                self.write("memory.swap.max", "max")
        elif os.path.exists(self.file("memory.memsw.limit_in_bytes")):
            self.write("memory.memsw.limit_in_bytes", -1)

    def limit(self) -> int | None:
        """The effective limit in bytes (v1 limit_in_bytes, v2 memory.high), None for none."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.high"
        v = self.read(name)
        if v == "max":
            return None
        n = int(v)
        return None if self.version == 1 and n >= V1_UNLIMITED else n

    def set_swappiness(self, n: int) -> bool:
        """v1 memory.swappiness; v2 has no such knob: returns False and does nothing."""
        if self.version != 1:
            return False
        if not 0 <= int(n) <= 200:
            raise CgroupError(f"swappiness {n} out of range 0..200")
        self.write("memory.swappiness", int(n))
        return True

    # -- accounting -------------------------------------------------------------------

    def usage(self) -> int:
        return int(self.read("memory.usage_in_bytes" if self.version == 1 else "memory.current"))

    def swap_usage(self) -> int:
        """Bytes of this cgroup's memory that sit in swap."""
        if self.version == 2:
            try:
                return int(self.read("memory.swap.current"))
            except FileNotFoundError:
                return int(self.stat().get("swap", 0))
        st = self.stat()
        if "total_swap" in st:
            return st["total_swap"]
        if "swap" in st:
            return st["swap"]
        try:
            return max(0, int(self.read("memory.memsw.usage_in_bytes")) - self.usage())
        except FileNotFoundError:
            return 0

    def stat(self) -> dict[str, int]:
        return parse_kv(read_file(self.file("memory.stat")))

    def events(self) -> dict[str, int]:
        """v2 memory.events; v1: oom_kill / under_oom from memory.oom_control, failcnt."""
        if self.version == 2:
            return parse_kv(read_file(self.file("memory.events")))
        out = parse_kv(read_file(self.file("memory.oom_control")))
        try:
            out["failcnt"] = int(self.read("memory.failcnt"))
        except (OSError, ValueError):
            pass
        return out

    def oom_kills(self) -> int:
        return int(self.events().get("oom_kill", 0))

    # -- removal ----------------------------------------------------------------------

    def remove(self, timeout: float = 10.0) -> None:
        """Move stray processes to the parent, then rmdir (retried while the kernel is busy)."""
        if not self.exists():
            return
        parent = self.parent()
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            for pid in self.pids():
                try:
                    parent.add_pid(pid)
                except CgroupError:
                    pass  # exited meanwhile, or a zombie: rmdir tells us if it matters
            try:
                self.controller.tree.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.ENOTEMPTY, errno.EAGAIN) \
                        or time.monotonic() > deadline:
                    raise CgroupError(f"cannot remove {self.path}: {e.strerror} "
                                      f"(pids left: {self.pids()})") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
