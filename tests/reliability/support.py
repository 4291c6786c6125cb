"""Shared parts of the reliability suite: the ledger, the swap lock, a loop chain without
swap, fio, and the two fault filesystems (a full tmpfs, and failfs which fails on command)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agentzip_blk.datapath.control import request
from nbdkit_server import PLUGIN, RunningServer, plugin_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SWAP_LOCK = "/tmp/agentzip-swap.lock"
LEDGER_ENV = "AGENTZIP_RELIABILITY_LEDGER"
PAGE = 4096

# -- the ledger: what each test verified, injected and tried -----------------------------

_totals: dict[str, int] = {}


def record(test: str, **counts: int) -> None:
    """Add to the suite's report. Keys: bytes_verified, faults_injected, hostile_inputs,
    data_lost (pages or bytes found wrong: any non-zero fails the report)."""
    for key, value in counts.items():
        _totals[key] = _totals.get(key, 0) + int(value)
    path = os.environ.get(LEDGER_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **{k: int(v) for k, v in counts.items()}}) + "\n")


@contextlib.contextmanager
def recorded(test: str, counts) -> Iterator[None]:
    """Record ``counts()`` (a dict of the keys `record` takes) under ``test`` when the block
    ends, however it ends: a run whose assert fails still reports what it verified and what
    it lost, and the suite's report (tools/reliability.py) fails on any loss. The asserts go
    inside the block."""
    try:
        yield
    finally:
        record(test, **counts())


def pages_differing(got: bytes, want: bytes) -> int:
    """4 KiB pages of `got` that differ from `want` (a missing page counts): the data lost
    by a read the test compared byte for byte."""
    size = max(len(got), len(want))
    return sum(got[i:i + PAGE] != want[i:i + PAGE] for i in range(0, size, PAGE))


def totals() -> dict[str, int]:
    return dict(_totals)


# -- the machine-wide swap lock ------------------------------------------------------------

def _lock_holders(path: str) -> set[int]:
    """PIDs holding a flock on `path`, from /proc/locks."""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return set()
    holders = set()
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[5].split(":")[-1] == str(ino):
                holders.add(int(parts[4]))
    return holders


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


@contextlib.contextmanager
def swap_lock() -> Iterator[None]:
    """Hold /tmp/agentzip-swap.lock, unless this process or an ancestor (`flock LOCK cmd`,
    tools/reliability.py) already does: a second flock from us would wait for ourselves."""
    if _lock_holders(SWAP_LOCK) & _ancestors():
        yield
        return
    fd = os.open(SWAP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- servers -----------------------------------------------------------------------------

def write_config(tmp: Path, name: str = "config.yaml", **sections: dict) -> Path:
    """A config whose disk tier lives in `tmp` (never the shared default path)."""
    import yaml

    data = {"pool": {"swap_out_path": str(tmp / "disk-tier")}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def stats(server: RunningServer) -> dict:
    return request(server.control_socket, "stats")


FAULTY_PLUGIN = HERE / "faulty_plugin.py"


def start_server(tmp: Path, size: str = "64M", config: Path | None = None,
                 plugin: Path = PLUGIN, extra: tuple[str, ...] = (),
                 timeout: float = 30.0) -> RunningServer:
    """tests/nbdkit_server.start_server, with a choice of plugin and extra plugin keys."""
    nbd_socket, control_socket = str(tmp / "nbd.sock"), str(tmp / "control.sock")
    log = tmp / "nbdkit.log"
    config = config or write_config(tmp)
    cmd = ["nbdkit", "-f", "-U", nbd_socket, "python", str(plugin), f"size={size}",
           f"control={control_socket}", f"config={config}", *extra]
    env = plugin_env()
    env["AGENTZIP_REAL_PLUGIN"] = str(PLUGIN)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = RunningServer(proc, nbd_socket, control_socket, log)
    deadline = time.monotonic() + timeout
    while not (os.path.exists(nbd_socket) and os.path.exists(control_socket)):
        if proc.poll() is not None:
            raise RuntimeError(f"nbdkit exited {proc.returncode}: {srv.log_text()}")
        if time.monotonic() > deadline:
            srv.stop()
            raise RuntimeError(f"nbdkit did not come up in {timeout}s: {srv.log_text()}")
        time.sleep(0.05)
    return srv


@contextlib.contextmanager
def server(tmp: Path, size: str = "64M", config: Path | None = None, **kw) -> Iterator[RunningServer]:
    srv = start_server(tmp, size=size, config=config, **kw)
    try:
        yield srv
    finally:
        srv.stop()


def nbd_client(sock: str):
    import nbd

    h = nbd.NBD()
    h.connect_unix(sock)
    return h


# -- the block chain without swap: nbdkit -> nbdfuse -> loop (direct I/O) --------------------

@dataclass
class LoopChain:
    server: RunningServer
    mountpoint: str
    fuse_file: str
    nbdfuse: subprocess.Popen
    loop: str | None = None


def _loop_backing(loop: str) -> str | None:
    try:
        return Path(f"/sys/block/{os.path.basename(loop)}/loop/backing_file").read_text().strip()
    except OSError:
        return None


@contextlib.contextmanager
def loop_chain(tmp: Path, size: str = "256M", config: Path | None = None,
               **kw) -> Iterator[LoopChain]:
    """The kernel's view of the device, as swap would see it, but no swap: fio and O_DIRECT
    writes may scribble on it. Torn down in the safe order: losetup -d, fusermount3 -u,
    stop nbdkit."""
    mnt = tempfile.mkdtemp(prefix="azrel-mnt-", dir="/tmp")
    srv = start_server(tmp, size=size, config=config, **kw)
    fuse_file = os.path.join(mnt, "nbd")
    log = open(tmp / "nbdfuse.log", "wb")
    proc = subprocess.Popen(["nbdfuse", fuse_file, "--unix", srv.nbd_socket],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    chain = LoopChain(srv, mnt, fuse_file, proc)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(fuse_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nbdfuse did not come up: {(tmp / 'nbdfuse.log').read_text()}")
            time.sleep(0.05)
        out = subprocess.run(["losetup", "--direct-io=on", "--show", "-f", fuse_file],
                             capture_output=True, text=True, check=True).stdout.strip()
        chain.loop = out
        dio = Path(f"/sys/block/{os.path.basename(out)}/loop/dio").read_text().strip()
        assert dio == "1", f"direct I/O off on {out}"
        yield chain
    finally:
        if chain.loop and _loop_backing(chain.loop) == fuse_file:
            subprocess.run(["losetup", "-d", chain.loop], check=False)
            deadline = time.monotonic() + 10
            while _loop_backing(chain.loop) == fuse_file and time.monotonic() < deadline:
                time.sleep(0.05)
        _unmount(mnt, proc)
        log.close()
        srv.stop()
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


def direct_fd(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_DIRECT)


def aligned(n: int):
    """An anonymous mmap: page-aligned, as O_DIRECT wants."""
    import mmap

    return mmap.mmap(-1, n)


# -- fio ------------------------------------------------------------------------------------

@dataclass
class FioResult:
    returncode: int
    jobs: list[dict]
    stderr: str

    @property
    def errors(self) -> list:
        return [j["error"] for j in self.jobs if j["error"]]

    def bytes(self, ddir: str) -> int:
        return sum(j[ddir]["io_bytes"] for j in self.jobs)


def fio(tmp: Path, name: str, *args: str, timeout: float = 900) -> FioResult:
    """Run fio with `args`; the JSON report goes to a file (the nbd engine chats on stdout)."""
    out = tmp / f"{name}.json"
    proc = subprocess.run(["fio", f"--name={name}", f"--output={out}", "--output-format=json",
                           *args], capture_output=True, text=True, timeout=timeout)
    try:
        jobs = json.loads(out.read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        jobs = []
    return FioResult(proc.returncode, jobs, proc.stderr + proc.stdout)


# -- fault filesystems --------------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[str]:
    """A tmpfs of `size`, mounted in a fresh /tmp directory and removed afterwards."""
    mnt = tempfile.mkdtemp(prefix="azrel-tmpfs-", dir="/tmp")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "azrel", mnt],
                   check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


def failfs_skip_reason() -> str | None:
    if not shutil.which("cc"):
        return "no C compiler (apt-get install gcc)"
    if not os.path.exists("/usr/include/fuse3/fuse.h"):
        return "libfuse3 headers missing (apt-get install libfuse3-dev)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


_FAILFS_BIN: str | None = None


def _build_failfs() -> str:
    global _FAILFS_BIN
    if _FAILFS_BIN and os.path.exists(_FAILFS_BIN):
        return _FAILFS_BIN
    build = tempfile.mkdtemp(prefix="azrel-failfs-bin-")
    atexit.register(shutil.rmtree, build, True)
    out = os.path.join(build, "failfs")
    subprocess.run(["cc", "-O2", "-Wall", "-o", out, str(HERE / "failfs.c"),
                    "-I/usr/include/fuse3", "-lfuse3", "-lpthread"],
                   check=True, capture_output=True, text=True)
    _FAILFS_BIN = out
    return out


class FailFS:
    """A mounted failfs: `arm("r")` makes reads fail with EIO, `arm("")` clears all faults."""

    def __init__(self, mountpoint: str, ctl: str) -> None:
        self.mountpoint = mountpoint
        self.ctl = ctl
        self.injected = 0

    def arm(self, faults: str) -> None:
        Path(self.ctl).write_text(faults)
        self.injected += bool(faults)


def _unmount(mnt: str, proc: subprocess.Popen) -> None:
    """Unmount a FUSE mount and reap its daemon (our own child), killing it if it hangs."""
    subprocess.run(["fusermount3", "-u", mnt], check=False, capture_output=True)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def failfs() -> Iterator[FailFS]:
    binary = _build_failfs()
    base = tempfile.mkdtemp(prefix="azrel-failfs-", dir="/tmp")
    src, mnt, ctl = (os.path.join(base, n) for n in ("src", "mnt", "ctl"))
    os.mkdir(src)
    os.mkdir(mnt)
    Path(ctl).write_text("")
    proc = subprocess.Popen([binary, src, ctl, mnt], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("failfs did not mount")
            time.sleep(0.05)
        yield FailFS(mnt, ctl)
    finally:
        Path(ctl).write_text("")
        _unmount(mnt, proc)
        shutil.rmtree(base, ignore_errors=True)


# -- page contents ----------------------------------------------------------------------------

_WORDS = [b"tool_call", b'"arguments":', b"result", b"\\n", b"def ", b"return", b"{", b"}",
          b"0.5", b"assistant", b"error", b"path/to/file.py", b"200 OK", b"null"]


def make_pages(n: int, seed: int, mix: str = "tsr") -> list[bytes]:
    """`n` distinct 4 KiB pages cycling through kinds: t = agent-like text (compresses),
    r = random (stored raw), s = same-filled (one repeated word, stored as the word)."""
    import random

    rnd = random.Random(seed)
    pages = []
    for i in range(n):
        kind = mix[i % len(mix)]
        if kind == "t":
            head = f"page {seed}:{i} ".encode()
            body = b" ".join(rnd.choice(_WORDS) for _ in range(1200))
            pages.append((head + body)[:PAGE])
        elif kind == "r":
            pages.append(rnd.randbytes(PAGE))
        else:
            pages.append(rnd.randbytes(8) * (PAGE // 8))
    return pages
