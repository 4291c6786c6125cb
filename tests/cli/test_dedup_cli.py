"""`compression.dedup: off` through the installed CLI, each command its own process: `serve`
with such a config stores two identical pages twice (`stats --json` shows no sharing) and
reads both back; a bad value is one error line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbdkit_server import nbdkit_available

nbd = pytest.importorskip("nbd", reason="python3-libnbd not installed")
EXE = Path(sys.executable).with_name("agentzip-blk")
pytestmark = [
    pytest.mark.nbdkit,
    pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available())),
    pytest.mark.skipif(not EXE.exists(), reason="agentzip-blk is not installed in this venv"),
]
PAGE = 4096


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.run([str(EXE), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_dedup_off_stores_identical_pages_twice(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"compression:\n  dedup: off\npool:\n  swap_out_path: {tmp_path}/tier\n")
    sock, ctl = tmp_path / "nbd.sock", tmp_path / "control.sock"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    serve = subprocess.Popen([str(EXE), "--config", str(config), "--run-dir", str(tmp_path),
                              "serve", "--socket", str(sock), "--control", str(ctl),
                              "--size", "64M", "--no-mlock"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while not (sock.exists() and ctl.exists()):
            assert serve.poll() is None, serve.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.05)
        page = os.urandom(PAGE // 2) * 2
        h = nbd.NBD()
        h.connect_unix(str(sock))
        h.pwrite(page + page, 0)  # a repeat within one request
        h.pwrite(page, 9 * PAGE)  # and in another request
        assert [h.pread(PAGE, n * PAGE) for n in (0, 1, 9)] == [page] * 3
        h.shutdown()
        r = cli("stats", "--json", "--control", str(ctl))
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["dedup"] is False
        # the request's two pages went into one frame, both stored; the third page alone
        assert st["pages"] == 3 and st["unique_blobs"] == 2
        assert st["shared_pages"] == 0 and st["dedup_saved_pages"] == 0
        assert st["dedup_hits"] == 0
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def test_bad_dedup_value_is_one_error_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("compression:\n  dedup: sometimes\n")
    r = cli("--config", str(config), "--run-dir", str(tmp_path), "serve",
            "--socket", str(tmp_path / "s"), "--control", str(tmp_path / "c"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentzip-blk: error: "), r.stderr
    assert "compression.dedup" in lines[0] and "on | off" in lines[0]
