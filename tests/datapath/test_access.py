"""Who can reach the data (issue 16): both sockets check their peer (SO_PEERCRED), and the
FUSE device file opens for root only. The server is the real nbdkit with the command line
`up` uses (servercmd.nbdkit_command: the ip filter included). Each layer is tested on its
own: the socket files are opened up to 0777 in a world-traversable directory, so that the
peer check is what refuses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentzip_blk.datapath import control
from agentzip_blk.host.servercmd import default_plugin_path, nbdkit_command, plugin_env
from nbdkit_server import nbdkit_available

NOBODY = 65534  # uid nobody, gid nogroup
SIZE = 64 << 20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setpriv, FUSE mount)"),
    pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available())),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) missing"),
]

# A client of its own uid: only the standard library, run by /usr/bin/python3.
CLIENT = r"""
import json, socket, sys
path, cmd = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(path)
except OSError as e:
    print(json.dumps({"connect_errno": e.errno})); sys.exit(0)
try:
    s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
    line = s.makefile("rb").readline()
except OSError as e:
    print(json.dumps({"io_errno": e.errno})); sys.exit(0)
print(json.dumps({"reply": json.loads(line) if line else None}))
"""


def as_user(argv: list[str], uid: int = NOBODY, gid: int = NOBODY,
            groups: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    ids = ["--reuid", str(uid), "--regid", str(gid)]
    ids += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return subprocess.run(["setpriv", *ids, *argv], capture_output=True, text=True,
                          timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})


def ask(path: str, cmd: str, **ids) -> dict:
    r = as_user(["/usr/bin/python3", "-c", CLIENT, path, cmd], **ids)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def nbd_size(sock: str, **ids) -> subprocess.CompletedProcess:
    uri = f"nbd+unix:///?socket={sock}"
    if not ids:
        return subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True,
                              timeout=60)
    return as_user(["nbdinfo", "--size", uri], **ids)


@dataclass
class Server:
    dir: Path
    proc: subprocess.Popen
    nbd: str
    control: str
    mnt: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@pytest.fixture
def serve():
    """Start the real server on sockets in a world-traversable directory; stopped, its FUSE
    mount gone and the directory removed afterwards."""
    started: list[Server] = []

    def start(group: str | None = None, fuse: bool = False) -> Server:
        d = Path(tempfile.mkdtemp(prefix="azacc-", dir="/tmp"))
        os.chmod(d, 0o755)
        cfg = d / "config.yaml"
        cfg.write_text(f"pool:\n  swap_out_path: {d / 'tier'}\n"
                       + (f"device:\n  control_group: {group}\n" if group else ""))
        nbd, ctl, mnt = str(d / "nbd.sock"), str(d / "control.sock"), str(d / "mnt")
        argv = nbdkit_command(default_plugin_path(), nbd, ctl, str(d / "nbdkit.pid"),
                              str(cfg), SIZE)
        if fuse:
            os.mkdir(mnt, 0o755)
            argv.append(f"fuse={mnt}")
        log = d / "nbdkit.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=plugin_env())
        srv = Server(d, proc, nbd, ctl, mnt, log)
        started.append(srv)
        deadline = time.monotonic() + 30
        want = [nbd, ctl] + ([os.path.join(mnt, "device")] if fuse else [])
        while not all(os.path.exists(p) for p in want):
            assert proc.poll() is None, srv.log_text()
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.05)
        control.request(ctl, "health")
        return srv

    try:
        yield start
    finally:
        for srv in started:
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGTERM)
                try:
                    srv.proc.wait(20)
                except subprocess.TimeoutExpired:
                    srv.proc.kill()
                    srv.proc.wait()
            if _mounted(srv.mnt):
                subprocess.run(["umount", "-l", srv.mnt], check=False)
            shutil.rmtree(srv.dir, ignore_errors=True)


def test_control_socket_refuses_other_uids(serve):
    srv = serve()
    st = os.lstat(srv.control)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    # the file mode is the first gate
    assert ask(srv.control, "ping") == {"connect_errno": 13}  # EACCES
    # the peer check is the second: with the file opened up, the server still refuses
    os.chmod(srv.control, 0o777)
    for cmd in ("ping", "stats", "shutdown"):
        reply = ask(srv.control, cmd)["reply"]
        assert reply["ok"] is False and reply["error"].startswith("permission denied: uid 65534")
    assert srv.proc.poll() is None  # the shutdown was not obeyed
    # root (the same uid as the server) may do everything
    assert control.request(srv.control, "ping")["pid"] > 0
    stats = control.request(srv.control, "stats")
    assert stats["server"]["control_refused"] == 3
    assert srv.log_text().count("agentzip: control: refused pid") == 3


def test_nbd_socket_refuses_other_uids(serve):
    srv = serve()
    os.chmod(srv.nbd, 0o777)  # past the file mode: nbdkit's ip filter decides
    r = nbd_size(srv.nbd, uid=NOBODY, gid=NOBODY)
    assert r.returncode != 0 and r.stdout.strip() == ""
    assert "not permitted to connect" in srv.log_text()
    # another uid in the root group is refused too: the filter allows uid 0, not gid 0
    r = nbd_size(srv.nbd, uid=NOBODY, gid=0, groups=(0,))
    assert r.returncode != 0
    ok = nbd_size(srv.nbd)
    assert ok.returncode == 0 and ok.stdout.strip() == str(SIZE)


@pytest.mark.slow
def test_control_group_may_only_read(serve):
    srv = serve(group="nogroup")
    st = os.lstat(srv.control)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
    member = {"uid": NOBODY, "gid": NOBODY}
    assert ask(srv.control, "ping", **member)["reply"]["ok"] is True
    stats = ask(srv.control, "stats", **member)["reply"]
    assert stats["ok"] is True and "server" in stats
    assert ask(srv.control, "health", **member)["reply"]["ok"] is True
    for cmd in ("shutdown", "reclaim", "defrag", "guard"):
        reply = ask(srv.control, cmd, **member)["reply"]
        assert reply["ok"] is False and "needs root" in reply["error"], reply
    assert srv.proc.poll() is None
    # a member through a supplementary group (SO_PEERGROUPS)
    assert ask(srv.control, "ping", uid=NOBODY, gid=1, groups=(NOBODY,))["reply"]["ok"] is True
    # not a member: the file mode refuses it; opened up, the peer check does
    assert ask(srv.control, "ping", uid=NOBODY, gid=1) == {"connect_errno": 13}
    os.chmod(srv.control, 0o777)
    reply = ask(srv.control, "ping", uid=NOBODY, gid=1)["reply"]
    assert reply["ok"] is False and "nor in the control group" in reply["error"]
    # the group never reaches the NBD socket
    os.chmod(srv.nbd, 0o777)
    assert nbd_size(srv.nbd, **member).returncode != 0
    assert control.request(srv.control, "reclaim") is not None  # root still may


def test_fuse_device_file_opens_for_root_only(serve):
    srv = serve(fuse=True)
    device = os.path.join(srv.mnt, "device")
    st = os.stat(device)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0 and st.st_size == SIZE
    assert stat.S_IMODE(os.stat(srv.mnt).st_mode) == 0o700
    probe = ("import os, sys\n"
             "try:\n"
             "    os.close(os.open(sys.argv[1], os.O_RDONLY))\n"
             "    print('opened')\n"
             "except OSError as e:\n"
             "    print(e.errno)\n")
    for ids in ({"uid": NOBODY, "gid": NOBODY}, {"uid": NOBODY, "gid": 0, "groups": (0,)}):
        r = as_user(["/usr/bin/python3", "-c", probe, device], **ids)
        assert r.stdout.strip() == "13", (ids, r.stdout, r.stderr)  # EACCES
    # root cannot widen it either: the file system answers with its own modes
    os.chmod(device, 0o666)
    assert stat.S_IMODE(os.stat(device).st_mode) == 0o600
    r = as_user(["/usr/bin/python3", "-c", probe, device])
    assert r.stdout.strip() == "13"
    # root reads and writes it, byte for byte
    data = os.urandom(8192)
    fd = os.open(device, os.O_RDWR)
    try:
        os.pwrite(fd, data, 4096)
        assert os.pread(fd, 8192, 4096) == data
    finally:
        os.close(fd)
