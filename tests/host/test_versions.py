"""Which code is running (issue 29, item 2), each command its own process of the installed CLI:
the server's health reply and `status` name its version and start time; `status` warns when
the installed program is another version than the running server; the control protocol and
state.json carry a version, and a CLI that meets one it cannot speak says so in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import agentzip_blk
from agentzip_blk.datapath import control
from agentzip_blk.host.runstate import STATE_FORMAT
from cli.clirun import one_error_line

ROOT = Path(__file__).resolve().parents[2]
AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the run directory is root's")


def az(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([AZ, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


def fake_server(path: Path, reply: bytes) -> threading.Thread:
    """A unix socket that answers every request line with *reply*."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve() -> None:
        with srv:
            for _ in range(4):
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn, conn.makefile("rwb") as f:
                    f.readline()
                    f.write(reply)
                    f.flush()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_a_server_of_a_newer_protocol_is_one_line(tmp_path):
    sock = tmp_path / "control.sock"
    fake_server(sock, json.dumps({"ok": True, "protocol": control.PROTOCOL + 1,
                                  "orig_mem": 1}).encode() + b"\n")
    r = az("--run-dir", str(tmp_path), "stats", "--control", str(sock))
    assert r.returncode == 1
    line = one_error_line(r.stderr)
    assert f"speaks control protocol {control.PROTOCOL + 1}" in line
    assert f"agentzip-blk {agentzip_blk.__version__} speaks {control.PROTOCOL}" in line


def test_a_socket_that_is_not_ours_is_one_line(tmp_path):
    sock = tmp_path / "control.sock"
    fake_server(sock, b"220 smtp.example ESMTP\r\n")
    r = az("--run-dir", str(tmp_path), "stats", "--control", str(sock))
    assert r.returncode == 1
    assert "not an agentzip-blk control reply" in one_error_line(r.stderr)


def test_a_server_without_the_protocol_key_is_still_spoken_to(tmp_path):
    """Servers from before the key speak protocol 0, which is the same framing."""
    sock = tmp_path / "control.sock"
    fake_server(sock, json.dumps({"ok": True, "orig_mem": 4096, "stored_mem": 1024,
                                  "ratio": 4.0}).encode() + b"\n")
    r = az("--run-dir", str(tmp_path), "stats", "--json", "--control", str(sock))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ratio"] == 4.0


def test_the_server_refuses_a_newer_client_and_names_both_versions():
    srv = control.ControlServer("/nonexistent", {"ping": lambda req: {}})
    reply = srv.dispatch(json.dumps({"cmd": "ping", "protocol": control.PROTOCOL + 5}).encode())
    assert reply["ok"] is False
    assert f"control protocol {control.PROTOCOL + 5}" in reply["error"]
    assert agentzip_blk.__version__ in reply["error"]
    assert srv.dispatch(b'{"cmd": "ping", "protocol": 1}') == {"ok": True}


@needs_root
def test_a_state_file_of_a_newer_format_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "state.json").write_text(json.dumps({
        "run_dir": str(run), "plugin": "x", "nbd_socket": str(run / "nbd.sock"),
        "format": STATE_FORMAT + 1, "version": "9.0.0"}))
    r = az("--run-dir", str(run), "status")
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert f"format {STATE_FORMAT + 1}" in line and "9.0.0" in line
    assert f"reads format {STATE_FORMAT} at most" in line


def _other_version_cli(tmp_path: Path, version: str) -> Path:
    """A copy of this package that calls itself *version*: the program an upgrade installs."""
    dst = tmp_path / "other" / "agentzip_blk"
    shutil.copytree(ROOT / "agentzip_blk", dst,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    init = dst / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{agentzip_blk.__version__}"',
                                             f'__version__ = "{version}"'))
    return dst.parent


@needs_root
@pytest.mark.nbdkit
def test_status_names_the_running_code_and_warns_after_an_upgrade(tmp_path):
    """A server (`agentzip-blk serve`, its own process) recorded in a run directory as `up`
    records it; `status` from this program and from one of another version."""
    if shutil.which("nbdkit") is None:
        pytest.skip("nbdkit missing")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp_path / 'tier'}\n")
    before = time.time()
    proc = subprocess.Popen([AZ, "--config", str(cfg), "--run-dir", str(run), "serve",
                             "--size", "64M"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((run / "control.sock").exists() and (run / "serve.pid").exists()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.05)
        pid = int((run / "serve.pid").read_text())
        (run / "state.json").write_text(json.dumps({
            "run_dir": str(run), "plugin": "agentzip", "nbd_socket": str(run / "nbd.sock"),
            "control_socket": str(run / "control.sock"), "nbdkit_pid": pid, "size": 64 << 20,
            "format": STATE_FORMAT, "version": agentzip_blk.__version__}))
        os.chmod(run / "state.json", 0o600)

        r = az("--run-dir", str(run), "status", "--json")
        assert r.returncode == 3, r.stdout + r.stderr  # healthy, but no swap area (exit 3)
        st = json.loads(r.stdout)
        assert st["server"]["version"] == agentzip_blk.__version__
        assert before - 1 <= st["server"]["started"] <= time.time()
        assert st["health"]["nbdkit"]["version"] == agentzip_blk.__version__
        assert not [w for w in st["warnings"] if "installed agentzip-blk" in w]
        r = az("--run-dir", str(run), "status", "-o", "VERSION,STARTED", "--raw", "-n")
        version, started = r.stdout.split()
        assert version == agentzip_blk.__version__
        assert started == time.strftime("%Y-%m-%dT%H:%M:%S",
                                         time.localtime(st["server"]["started"]))

        other = _other_version_cli(tmp_path, "9.9.9")
        env = dict(os.environ, PYTHONPATH=str(other))
        r = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "--run-dir", str(run),
                            "status"], capture_output=True, text=True, timeout=60, env=env,
                           cwd=tmp_path, stdin=subprocess.DEVNULL)
        assert r.returncode == 3, r.stderr
        warn = [line for line in (r.stdout + r.stderr).splitlines() if "installed agentzip-blk" in line]
        assert len(warn) == 1, r.stderr
        assert f"the server runs agentzip-blk {agentzip_blk.__version__}" in warn[0]
        assert "the installed agentzip-blk is 9.9.9" in warn[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
