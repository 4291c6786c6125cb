"""The swap devices the demo compares: the kernel's zram, and ours (the full attach chain)."""

from __future__ import annotations

import os
import time

from ..config import load_config
from .common import DemoError, fmt, proc_swaps, run_tool


class SwapBackend:
    """Attach/detach one swap device and report its orig/stored bytes."""

    name = "swap"
    stored_in_kernel = False  # True: stored_mem is kernel memory (zram), not a server's RSS

    def attach(self) -> None:
        raise NotImplementedError

    def detach(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        """At least orig_mem, stored_mem (bytes) and ratio."""
        raise NotImplementedError

    def server_pids(self) -> list[int]:
        """Userspace processes that hold the swapped data (their RSS is the cost)."""
        return []

    def describe(self) -> str:
        return self.name

    def __enter__(self):
        try:
            self.attach()
        except BaseException:
            self.detach()
            raise
        return self

    def __exit__(self, *exc):
        self.detach()


class ZramSwap(SwapBackend):
    """The kernel's zram as the only swap, for comparison: /dev/zram0 with a chosen algorithm."""

    def __init__(self, algorithm: str = "lz4", size: int = 2 << 30, device: str = "zram0",
                 priority: int = 100):
        self.algorithm = algorithm
        self.size = int(size)
        self.device = device
        self.dev = f"/dev/{device}"
        self.sysfs = f"/sys/block/{device}"
        self.priority = priority
        self.name = f"zram-{algorithm}"
        self.stored_in_kernel = True
        self._initialized = False  # we wrote disksize: we must reset

    def _sys(self, name: str) -> str:
        with open(os.path.join(self.sysfs, name)) as f:
            return f.read().strip()

    def _syswrite(self, name: str, value) -> None:
        try:
            with open(os.path.join(self.sysfs, name), "w") as f:
                f.write(str(value))
        except OSError as e:
            raise DemoError(f"cannot write {value!r} to {self.sysfs}/{name}: {e.strerror}") from None

    def in_swaps(self) -> bool:
        return any(os.path.realpath(s["filename"]) == os.path.realpath(self.dev) for s in proc_swaps())

    def attach(self) -> None:
        if not os.path.isdir(self.sysfs):
            raise DemoError(f"{self.dev} does not exist (modprobe zram)")
        if self.in_swaps() or self._sys("initstate") != "0":
            raise DemoError(f"{self.dev} is already in use (initstate {self._sys('initstate')}); "
                            f"refusing to reset it: swapoff {self.dev} && echo 1 > {self.sysfs}/reset")
        algs = self._sys("comp_algorithm").replace("[", "").replace("]", "").split()
        if self.algorithm not in algs:
            raise DemoError(f"zram has no {self.algorithm!r} (available: {' '.join(algs)})")
        self._syswrite("comp_algorithm", self.algorithm)
        self._initialized = True
        self._syswrite("disksize", self.size)
        run_tool(["mkswap", "-q", self.dev])
        run_tool(["swapon", "-p", str(self.priority), self.dev])

    def detach(self) -> None:
        # swapoff first, then reset; never leave a swap area behind
        try:
            if self.in_swaps():
                run_tool(["swapoff", self.dev])
        finally:
            if self._initialized:
                for i in range(50):
                    try:
                        with open(os.path.join(self.sysfs, "reset"), "w") as f:
                            f.write("1")
                        break
                    except OSError:
                        if i == 49:
                            raise
                        time.sleep(0.1)
                self._initialized = False

    def stats(self) -> dict:
        names = ["orig_data_size", "compr_data_size", "mem_used_total", "mem_limit",
                 "mem_used_max", "same_pages", "pages_compacted", "huge_pages", "huge_pages_since"]
        try:
            vals = [int(x) for x in self._sys("mm_stat").split()]
        except (OSError, ValueError):
            vals = []
        mm = dict(zip(names, vals))
        orig = mm.get("orig_data_size", 0)
        stored = mm.get("mem_used_total", 0)
        return {"orig_mem": orig, "stored_mem": stored,
                "ratio": (orig / stored) if stored else 0.0, "mm_stat": mm}

    def describe(self) -> str:
        return f"{self.dev} ({self.algorithm}, {fmt(self.size)})"


class AgentzipSwap(SwapBackend):
    """Our device: ``host.attach.attached(config, run_dir)``; stats over the control socket."""

    name = "agentzip"

    def __init__(self, config=None, run_dir: str | None = None, config_path: str | None = None,
                 **attach_kw):
        self.config = config
        self.run_dir = run_dir
        self.config_path = config_path  # handed to the server so it reads the same config
        self.attach_kw = attach_kw
        self.state = None
        self._cm = None

    def attach(self) -> None:
        from ..host import attach

        if self.config is None:
            self.config = load_config(self.config_path)
        if self.run_dir is None:
            dev = getattr(self.config, "device", None)
            self.run_dir = getattr(dev, "run_dir", None)
        kw = dict(self.attach_kw)
        if self.config_path:
            kw["config_path"] = self.config_path
        self._cm = attach.attached(self.config, self.run_dir, **kw)
        self.state = self._cm.__enter__()

    def detach(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def stats(self) -> dict:
        from ..datapath import control

        st = dict(control.request(self.state.control_socket, "stats"))
        st.pop("ok", None)
        return st

    def server_pids(self) -> list[int]:
        pids = []
        st = self.state
        for attr in ("nbdkit_pid", "server_pid", "nbdfuse_pid", "fuse_pid", "pid"):
            v = getattr(st, attr, None)
            if isinstance(v, int) and v > 0 and v not in pids:
                pids.append(v)
        if not pids and self.run_dir and os.path.isdir(self.run_dir):
            for fn in sorted(os.listdir(self.run_dir)):
                if fn.endswith(".pid"):
                    try:
                        with open(os.path.join(self.run_dir, fn)) as f:
                            pids.append(int(f.read().split()[0]))
                    except (OSError, ValueError, IndexError):
                        pass
        return pids

    def describe(self) -> str:
        c = getattr(self.config, "compression", None)
        what = f"{getattr(c, 'algorithm', '?')} {getattr(c, 'level', '')}".strip() if c else "default config"
        return f"agentzip-blk ({what})"


def make_backend(kind, config=None, run_dir: str | None = None, size: int | None = None,
                 config_path: str | None = None) -> SwapBackend:
    """'agentzip', 'zram-lz4', 'zram-lzo-rle', 'zram:ALG', or a SwapBackend instance."""
    if isinstance(kind, SwapBackend):
        return kind
    if kind == "agentzip":
        return AgentzipSwap(config, run_dir, config_path)
    for prefix in ("zram:", "zram-"):
        if kind.startswith(prefix):
            return ZramSwap(kind[len(prefix):], size=size or (2 << 30))
    if kind == "zram":
        return ZramSwap("lz4", size=size or (2 << 30))
    raise DemoError(f"unknown swap backend {kind!r} (agentzip, zram-lz4, zram-lzo-rle, zram:ALG)")
