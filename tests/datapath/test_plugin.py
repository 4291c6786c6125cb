"""The real nbdkit with the agentzip plugin, driven through libnbd."""

from __future__ import annotations

import os
import random
import stat
import subprocess

import pytest

from agentzip_blk.datapath.control import ControlError, request
from nbdkit_server import PLUGIN, nbdkit_available, plugin_env, start_server

nbd = pytest.importorskip("nbd", reason="python3-libnbd not installed")
pytestmark = [
    pytest.mark.nbdkit,
    pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available())),
]

PAGE = 4096
SIZE = 64 << 20


@pytest.fixture
def server(tmp_path):
    srv = start_server(tmp_path, size=str(SIZE))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    h = nbd.NBD()
    h.connect_unix(server.nbd_socket)
    yield h
    h.shutdown()


def agent_like(n: int, seed: int = 1) -> bytes:
    rnd = random.Random(seed)
    words = ["tool_call", '"arguments"', "result", "\\n", "def", "return", "{", "}", "0.5"]
    text = " ".join(rnd.choice(words) for _ in range(n // 4)).encode()
    return text[:n]


def test_round_trip_all_page_kinds(client, server):
    # Three requests: a unit (the default config compresses a request's new pages together),
    # two random pages (too poor together: stored alone, raw), and a same-filled page, a zero
    # page and a text page compressed alone.
    parts = [agent_like(3 * PAGE), os.urandom(2 * PAGE), b"\x07" * PAGE + bytes(PAGE) + agent_like(PAGE, 2)]
    offset = 10 * PAGE
    for part in parts:
        client.pwrite(part, offset)
        offset += len(part)
    data = b"".join(parts)
    assert client.pread(len(data), 10 * PAGE) == data
    stats = request(server.control_socket, "stats")
    assert stats["units"] == 1 and stats["unit_fallbacks"] == 1
    assert stats["raw_pages"] == 2
    assert stats["same_pages"] == 2  # 0x07 page and the zero page
    assert stats["pages"] == len(data) // PAGE
    assert stats["orig_mem"] == len(data)


def test_large_requests_and_overwrites(client):
    model = bytearray(8 << 20)
    rnd = random.Random(5)
    for _ in range(20):
        length = rnd.choice([PAGE, 64 << 10, 1 << 20, 1280 << 10])
        offset = rnd.randrange(0, len(model) - length, PAGE)
        chunk = agent_like(length, rnd.randrange(1000))
        client.pwrite(chunk, offset)
        model[offset : offset + length] = chunk
    assert client.pread(len(model), 0) == model


def test_unaligned_requests(client):
    model = bytearray(16 * PAGE)
    client.pwrite(bytes(model), 0)
    rnd = random.Random(9)
    for _ in range(50):
        offset = rnd.randrange(0, len(model) - 1)
        length = rnd.randrange(1, min(3 * PAGE, len(model) - offset) + 1)
        chunk = rnd.randbytes(length)
        client.pwrite(chunk, offset)
        model[offset : offset + length] = chunk
        probe = rnd.randrange(0, len(model) - 100)
        assert client.pread(100, probe) == model[probe : probe + 100]
    assert client.pread(len(model), 0) == model


def test_trim_and_zero(client, server):
    data = agent_like(8 * PAGE)
    client.pwrite(data, 0)
    client.trim(2 * PAGE, 2 * PAGE)
    client.zero(50, PAGE + 100)  # libnbd: (count, offset)
    expected = bytearray(data)
    expected[2 * PAGE : 4 * PAGE] = bytes(2 * PAGE)
    expected[PAGE + 100 : PAGE + 150] = bytes(50)
    assert client.pread(len(data), 0) == expected
    client.trim(SIZE, 0)
    assert request(server.control_socket, "stats")["pages"] == 0
    assert client.pread(PAGE, 0) == bytes(PAGE)


@pytest.mark.parametrize("offset,length", [(SIZE, 1), (SIZE - PAGE, 2 * PAGE), (SIZE + (1 << 40), PAGE)])
def test_out_of_range(client, offset, length):
    with pytest.raises(nbd.Error) as err:
        client.pread(length, offset)
    assert err.value.errno == "EINVAL"
    # The NBD protocol has the server answer writes past the end with ENOSPC; nbdkit does
    # that itself before the plugin sees the request.
    with pytest.raises(nbd.Error) as err:
        client.pwrite(bytes(length), offset)
    assert err.value.errno == "ENOSPC"
    assert client.pread(PAGE, 0) == bytes(PAGE)


def test_plugin_maps_store_errors_to_errno(monkeypatch):
    """The mapping itself, for requests nbdkit would let through (a stub nbdkit module)."""
    import errno
    import importlib.util
    import sys
    import types

    from agentzip_blk.datapath import protect
    from agentzip_blk.errors import OutOfRange, StoreFull

    monkeypatch.setattr(protect, "lock_memory", lambda: None)  # not the test process
    calls = []
    stub = types.SimpleNamespace(set_error=calls.append, debug=lambda msg: None,
                                 THREAD_MODEL_SERIALIZE_ALL_REQUESTS=2)
    monkeypatch.setitem(sys.modules, "nbdkit", stub)
    spec = importlib.util.spec_from_file_location("agentzip_plugin_under_test", PLUGIN)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    for exc, code in [(OutOfRange("x"), errno.EINVAL), (StoreFull("x"), errno.ENOSPC),
                      (RuntimeError("x"), errno.EIO)]:
        def failing(exc=exc):
            raise exc

        with pytest.raises(type(exc)):
            plugin._request(failing)  # every request's wrapper (errors.errno_of)
        assert calls[-1] == code


def test_full_pool_is_enospc_and_loses_nothing(tmp_path):
    config = tmp_path / "config.yaml"
    # Both tiers tiny: 1 MiB of pool, 1 MiB of disk.
    config.write_text(
        f"pool:\n  max_size: 1M\n  swap_out_path: {tmp_path / 'disk'}\n  swap_out_max_size: 1M\n"
    )
    srv = start_server(tmp_path, size=str(SIZE), config=config)
    h = nbd.NBD()
    try:
        h.connect_unix(srv.nbd_socket)
        written = []
        with pytest.raises(nbd.Error) as err:
            for i in range(1024):
                chunk = os.urandom(4 * PAGE)  # incompressible: stored raw, fills 1 MiB fast
                h.pwrite(chunk, i * 4 * PAGE)
                written.append(chunk)
        assert err.value.errno == "ENOSPC"
        assert len(written) >= 32  # the pool and then the disk tier took pages
        for i, chunk in enumerate(written):
            assert h.pread(len(chunk), i * 4 * PAGE) == chunk
        stats = request(srv.control_socket, "stats")
        assert stats["enospc"] == 1
        assert stats["pool_bytes"] <= 1 << 20
        assert stats["direct_to_disk"] > 0 and stats["disk_full"] >= 1
        assert stats["tiers"]["disk"]["pages"] + stats["tiers"]["pool"]["pages"] == stats["pages"]
        h.shutdown()
    finally:
        srv.stop()


def test_control_socket_is_private_and_robust(server):
    mode = os.stat(server.control_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    with pytest.raises(ControlError, match="unknown command"):
        request(server.control_socket, "no-such-verb")
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(server.control_socket)
        sock.sendall(b"{not json\n")
        assert b'"ok": false' in sock.recv(4096)
    stats = request(server.control_socket, "stats")
    assert stats["server"]["memory_locked"] is True


def test_bad_config_stops_nbdkit_with_the_key(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("compression:\n  level: 42\n")
    proc = subprocess.run(
        ["nbdkit", "-f", "-U", str(tmp_path / "s"), "python", str(PLUGIN), f"config={config}"],
        capture_output=True, text=True, env=plugin_env(), timeout=30,
    )
    assert proc.returncode != 0
    assert "compression.level" in proc.stderr
