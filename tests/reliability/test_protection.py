"""Server protection: memory locked, OOM score lowered and PR_SET_IO_FLUSHER where the
kernel permits (probed in a child process first: without CAP_SYS_RESOURCE both are refused,
and then the server must say so rather than claim it), a control socket only root can use
(tested as `nobody`), and `down` refusing to stop the server while swap points at it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from agentzip_blk import errors, procfs
from agentzip_blk.host import attach, chain, procs, runstate

from . import support
from .conftest import skip_reason
from .support import PAGE, make_pages

pytestmark = pytest.mark.skipif(skip_reason("nbdkit") is not None,
                                reason=str(skip_reason("nbdkit")))


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _permitted(code: str) -> bool:
    """Whether a fresh child process may do `code` (a Python snippet that raises if not)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


OOM_PROBE = ("import os; fd = os.open('/proc/self/oom_score_adj', os.O_WRONLY)\n"
             "os.write(fd, b'-1000')")  # unbuffered: the refusal comes from write()
FLUSHER_PROBE = ("import ctypes, os; libc = ctypes.CDLL('libc.so.6', use_errno=True)\n"
                 "assert libc.prctl(57, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())")


@pytest.fixture
def srv(tmp_path):
    with support.server(tmp_path, size="256M") as server:
        yield server


def test_memory_is_locked_as_it_grows(srv):
    """mlockall(MCL_FUTURE|MCL_ONFAULT): pages the store allocates later are locked too."""
    pid = srv.proc.pid
    locked0 = _status(pid, "VmLck")
    assert locked0 > 0
    h = support.nbd_client(srv.nbd_socket)
    data = b"".join(make_pages(64 * 256, seed=8, mix="r"))  # 64 MiB, stored raw
    for off in range(0, len(data), 4 << 20):
        h.pwrite(data[off:off + (4 << 20)], off)
    h.shutdown()
    grown = _status(pid, "VmLck") - locked0
    assert grown >= 48 << 20, f"only {grown} more bytes locked after storing 64 MiB"
    st = support.stats(srv)
    assert st["server"]["memory_locked"] is True
    assert st["server"]["locked_bytes"] >= 64 << 20


def test_oom_score_where_permitted(srv):
    st = support.stats(srv)["server"]
    with open(f"/proc/{srv.proc.pid}/oom_score_adj") as f:
        adj = int(f.read())
    if _permitted(OOM_PROBE):
        assert st["oom_score_lowered"] is True and adj == -1000
    else:  # refused here (no CAP_SYS_RESOURCE): the server must not claim it
        assert st["oom_score_lowered"] is False and adj > -1000


def test_io_flusher_where_permitted(srv):
    h = support.nbd_client(srv.nbd_socket)
    h.pwrite(b"\x01" * PAGE, 0)  # a request thread: the flag is set per worker thread
    h.shutdown()
    st = support.stats(srv)["server"]
    assert st["io_flusher"] is _permitted(FLUSHER_PROBE)


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60)


CONNECT = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
           "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n"
           "s.sendall(b'{\"cmd\": \"ping\"}\\n'); print(s.recv(200).decode())")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root + setpriv")
def test_control_socket_is_root_only(tmp_path):
    """The socket sits in a world-searchable directory, so its own mode (0600, root) keeps
    `nobody` out. With the mode opened up the same probe connects (the probe works), and the
    server's peer check (SO_PEERCRED) still refuses it: two layers, each checked."""
    public = tempfile.mkdtemp(prefix="azrel-public-", dir="/tmp")
    os.chmod(public, 0o755)
    config = support.write_config(tmp_path)
    try:
        srv = support.start_server(tmp_path, size="16M", config=config)
        sock = os.path.join(public, "control.sock")
        try:
            os.link(srv.control_socket, sock)  # same inode, public directory
            st = os.stat(sock)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_uid == 0
            probe = _as_nobody("/usr/bin/python3", "-c", CONNECT, sock)
            assert probe.returncode == 13, probe
            cli = _as_nobody(sys.executable, "-m", "agentzip_blk.cli", "stats", "--control", sock)
            assert cli.returncode != 0 and "permission denied" in cli.stderr, cli
            assert "Traceback" not in cli.stderr
            os.chmod(sock, 0o666)  # the control: now nobody connects, and the peer check answers
            try:
                opened = _as_nobody("/usr/bin/python3", "-c", CONNECT, sock)
            finally:
                os.chmod(sock, 0o600)
            assert opened.returncode == 0, opened
            assert '"ok": false' in opened.stdout and "permission denied" in opened.stdout, opened
            support.record("protection_nobody", hostile_inputs=2)
        finally:
            srv.stop()
    finally:
        shutil.rmtree(public, ignore_errors=True)


swap_skip = skip_reason("nbdkit", "nbdfuse", "losetup", "fusermount3", "mkswap", "swapon",
                        "swapoff")


@pytest.mark.swap
@pytest.mark.skipif(swap_skip is not None, reason=str(swap_skip))
def test_down_refuses_to_stop_server_under_swap(tmp_path, swap_locked):
    """With a swapoff that does nothing (the swap area stays), teardown must stop before the
    server: nbdkit and the device stay up and keep serving; then the real down works."""
    from agentzip_blk.config import Config

    cfg = Config()
    cfg.pool.swap_out_path = str(tmp_path / "disk-tier")
    run_dir = tempfile.mkdtemp(prefix="azrel-run-", dir="/tmp")
    try:
        with attach.attached(cfg, run_dir, priority=5, size=64 << 20) as state:
            assert procfs.swap_area(state.device) is not None
            fake = runstate.RunState.load(run_dir)
            fake.tools = {"swapoff": "/bin/true"}
            with pytest.raises(errors.DeviceError, match="still in /proc/swaps"):
                chain.teardown(fake)
            assert procfs.swap_area(state.device) is not None
            assert procs.pid_alive(state.nbdkit_pid)
            assert support.request(state.control_socket, "ping")["pid"] == state.nbdkit_pid
            # (the CLI's down once ran a do-nothing swapoff recorded in state.json; tool
            # paths are no longer saved or read from it, issue 16, so only the in-process
            # override above can stand in for a swapoff that leaves the area)
        assert procfs.swap_area(state.device) is None
        assert not procs.pid_alive(state.nbdkit_pid)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _limit(pid: int, name: str) -> tuple[str, str]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith(name):
                soft, hard = line[len(name):].split()[:2]
                return soft, hard
    raise KeyError(name)


def _dontdump_bytes(pid: int) -> int:
    """Bytes of the process's mappings flagged MADV_DONTDUMP ("dd" in VmFlags)."""
    total = size = 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and "dd" in line.split()[1:]:
                total += size
    return total


def test_the_server_leaves_no_core_dump(srv):
    """RLIMIT_CORE 0, not dumpable, and the pool's arenas MADV_DONTDUMP: a crash writes
    no tenant's page and no tier key anywhere (issue 27, item 3)."""
    pid = srv.proc.pid
    assert _limit(pid, "Max core file size") == ("0", "0")
    before = _dontdump_bytes(pid)
    h = support.nbd_client(srv.nbd_socket)
    h.pwrite(b"".join(make_pages(1024, seed=3, mix="r")), 0)  # 4 MiB stored raw in arenas
    h.shutdown()
    assert _dontdump_bytes(pid) - before >= 4 << 20
    assert support.stats(srv)["server"]["core_dumps_forbidden"] is True


def test_no_core_dumps_in_process():
    code = ("import resource; from agentzip_blk.datapath import protect\n"
            "assert protect.forbid_core_dumps() is None\n"
            "print(resource.getrlimit(resource.RLIMIT_CORE), protect.dumpable())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "(0, 0) False"


def test_the_guard_is_armed_once(srv):
    """`up` arms the guard with its device; a peer cannot re-point it elsewhere."""
    assert support.request(srv.control_socket, "guard", device="/dev/loop-az-a")
    assert support.request(srv.control_socket, "guard", device="/dev/loop-az-a")  # same: fine
    with pytest.raises(Exception, match="armed for /dev/loop-az-a already"):
        support.request(srv.control_socket, "guard", device="/dev/loop-az-b")


@pytest.mark.swap
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_shutdown_is_refused_while_our_file_is_swap_whatever_the_guard_says(tmp_path, swap_locked):
    """The attack of issue 27, item 2: arm the guard with a device that is not swap, then
    ask for shutdown while a swap area sits on the server's FUSE file. Refused; after
    swapoff it is honoured."""
    mnt = str(tmp_path / "mnt")
    device = os.path.join(mnt, "device")
    loop = None
    swap_on = False
    with support.server(tmp_path, size="64M", extra=(f"fuse={mnt}",)) as server:
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(device) and time.monotonic() < deadline:
                time.sleep(0.05)
            loop = subprocess.run(["losetup", "--direct-io=on", "--show", "-f", device],
                                  capture_output=True, text=True, check=True).stdout.strip()
            subprocess.run(["mkswap", loop], check=True, capture_output=True)
            subprocess.run(["swapon", "-p", "1", loop], check=True)
            swap_on = True
            support.request(server.control_socket, "guard", device="/dev/az-not-swap")
            with pytest.raises(Exception, match=f"{loop} is swap over"):
                support.request(server.control_socket, "shutdown")
            assert server.proc.poll() is None
        finally:
            if swap_on:
                subprocess.run(["swapoff", loop], check=False)
            if loop:
                subprocess.run(["losetup", "-d", loop], check=False)
        assert support.request(server.control_socket, "shutdown")["pid"] == server.proc.pid
        server.proc.wait(30)
    subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)
