"""Integrity and encryption at rest, through the real nbdkit with the agentzip plugin and
libnbd: a flipped byte in a pool cell (raw, zstd, lz4, a zstd frame) or in a disk extent,
or a truncated tier file, makes every read of an affected slot fail with EIO, never wrong
bytes; every other slot reads back byte for byte; the counters move. The disk tier holds
nothing readable of the pages (a scan for their plaintext and compressed forms), and a
planted link at the tier path is refused without touching its target.

A pool cell lives in the server's memory: the test finds the cell's bytes through
/proc/PID/mem (a random marker the page carries verbatim in every codec's output) and flips
one byte of every copy there (the other copies are stale request buffers, never read).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentzip_blk.codec.codecs import make_codec
from agentzip_blk.datapath.control import request
from agentzip_blk.store.disk import TIER_HEADER
from nbdkit_server import ROOT, nbdkit_available, plugin_env, start_server

nbd = pytest.importorskip("nbd", reason="python3-libnbd not installed")
pytestmark = [
    pytest.mark.nbdkit,
    pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available())),
    pytest.mark.skipif(os.geteuid() != 0, reason="writes the server's memory (/proc/PID/mem)"),
]

PAGE = 4096
SIZE = 64 << 20
TEXT = (b"tool_call result {\"arguments\": 0.5} " * 200)[: 3 * PAGE // 4]


def marked_page(marker: bytes) -> bytes:
    """A page that compresses (zstd and lz4 alike) yet keeps `marker` verbatim in the
    compressed bytes: random bytes go out as literals."""
    return marker + TEXT[: PAGE - len(marker)]


def write_config(tmp: Path, **pool) -> Path:
    lines = ["compression:", f"  algorithm: {pool.pop('algorithm', 'zstd')}",
             "  dictionary: none", "pool:"]
    pool.setdefault("swap_out_path", str(tmp / "disk-tier"))
    for key, value in pool.items():
        lines.append(f"  {key}: {'null' if value is None else value}")
    lines += ["policy:", "  cold_grace_period: 10ms"]
    path = tmp / "config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Client:
    def __init__(self, srv) -> None:
        self.srv = srv
        self.h = nbd.NBD()
        self.h.connect_unix(srv.nbd_socket)

    def read_or_errno(self, offset: int, length: int = PAGE):
        try:
            return self.h.pread(length, offset)
        except nbd.Error as exc:
            return exc.errno

    def stats(self) -> dict:
        return request(self.srv.control_socket, "stats")

    def close(self) -> None:
        if self.h is not None:
            self.h.shutdown()
            self.h = None


@pytest.fixture
def serve(tmp_path):
    running = []

    def start(**pool):
        srv = start_server(tmp_path, size=str(SIZE), config=write_config(tmp_path, **pool))
        client = Client(srv)
        running.append((srv, client))
        return srv, client

    yield start
    for srv, client in running:
        try:
            client.close()
        except Exception:
            pass
        srv.stop()


def flip_in_memory(pid: int, needle: bytes, at: int) -> int:
    """Flip the low bit of byte `at` of every copy of `needle` in the process's writable
    mappings; returns the copies changed."""
    assert 0 <= at < len(needle)
    flipped = 0
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for line in maps.read().splitlines():
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("[v")):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi - lo > 1 << 30:
                continue
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except OSError:
                continue
            pos = data.find(needle)
            while pos >= 0:
                mem.seek(lo + pos + at)
                mem.write(bytes([data[pos + at] ^ 0x01]))
                flipped += 1
                pos = data.find(needle, pos + 1)
    return flipped


def read_all(client: Client, pages: dict[int, bytes]) -> dict[int, object]:
    return {slot: client.read_or_errno(slot * PAGE) for slot in pages}


@pytest.mark.parametrize("algorithm,pages_per_write", [("zstd", 1), ("lz4", 1), ("zstd", 4),
                                                        ("raw", 1)])
def test_flipped_byte_in_a_pool_cell_is_eio(serve, algorithm, pages_per_write):
    """raw: random pages (stored raw whatever the codec); zstd, lz4: pages compressed alone;
    zstd x4: one frame of four pages."""
    srv, client = serve(algorithm="zstd" if algorithm == "raw" else algorithm)
    pages: dict[int, bytes] = {}
    for slot in range(0, 24, pages_per_write):
        run = [os.urandom(PAGE) if algorithm == "raw" else marked_page(os.urandom(1024))
               for _ in range(pages_per_write)]
        client.h.pwrite(b"".join(run), slot * PAGE)
        pages.update({slot + i: page for i, page in enumerate(run)})
    stats = client.stats()
    if algorithm == "raw":
        assert stats["raw_pages"] == len(pages)
    elif pages_per_write > 1:
        assert stats["units"] == len(pages) // pages_per_write
    target = 8  # the first page of a write
    needle = pages[target][256:320]
    assert flip_in_memory(srv.proc.pid, needle, 17) >= 1
    affected = set(range(target, target + pages_per_write))  # a frame fails as a whole
    before = client.stats()["checksum_errors"]
    for _ in range(2):  # and again: a failed read caches nothing
        got = read_all(client, pages)
        for slot, page in pages.items():
            if slot in affected:
                assert got[slot] == "EIO", slot
            else:
                assert got[slot] == page, slot
    after = client.stats()
    assert after["checksum_errors"] - before >= 2
    assert after["errors"] >= 2
    assert "checksum mismatch in its pool cell" in srv.log_text()


def push_to_disk(client: Client, pages: dict[int, bytes]) -> None:
    """Demote the slots `pages` to the disk tier (`reclaim`, checked with `slots`). Newer
    filler pages keep the pool above its reclaim threshold until the pages are all out
    (the maintainer may have demoted some of them already, leaving the pool in between)."""
    filler = 4096
    for slot in range(filler, filler + 16):
        client.h.pwrite(os.urandom(PAGE), slot * PAGE)
    time.sleep(0.1)  # past the 10 ms cold grace period
    deadline = time.monotonic() + 20
    while True:
        request(client.srv.control_socket, "reclaim")
        tiers = request(client.srv.control_socket, "slots", slots=sorted(pages))["tier"]
        if set(tiers) == {1} or time.monotonic() > deadline:  # every slot on DISK
            break
        time.sleep(0.1)
    assert set(tiers) == {1}


def disk_pages(client: Client, n: int = 32) -> dict[int, bytes]:
    pages = {}
    for slot in range(n):  # one write per page: demoted oldest first, extents in order
        pages[slot] = os.urandom(PAGE)
        client.h.pwrite(pages[slot], slot * PAGE)
    push_to_disk(client, pages)
    return pages


# a 1 MiB pool demoted to its floor (5% threshold: the target is 0), so reads never promote
DISK_POOL = {"max_size": "1M", "reclaim_threshold": 5}


def test_flipped_byte_in_a_disk_extent_is_eio(serve, tmp_path):
    srv, client = serve(**DISK_POOL)
    pages = disk_pages(client)
    tier = tmp_path / "disk-tier"
    with open(tier, "r+b") as f:  # the first extent, after the header: nonce, ciphertext
        f.seek(len(TIER_HEADER) + 40)
        byte = f.read(1)
        f.seek(len(TIER_HEADER) + 40)
        f.write(bytes([byte[0] ^ 0x80]))
    before = client.stats()["checksum_errors"]
    got = read_all(client, pages)
    failed = [slot for slot, value in got.items() if value == "EIO"]
    assert len(failed) == 1
    assert all(got[slot] == page for slot, page in pages.items() if slot not in failed)
    assert client.read_or_errno(failed[0] * PAGE) == "EIO"
    assert client.stats()["checksum_errors"] - before == 2
    assert "AEAD tag mismatch in the disk tier" in srv.log_text()


def test_truncated_tier_file_is_eio(serve, tmp_path):
    srv, client = serve(**DISK_POOL)
    pages = disk_pages(client)
    # raw pages in extents of whole 64-byte steps with their 12-byte nonce and 16-byte tag,
    # in the order they were written (demotion takes the oldest first)
    extent = -(-(PAGE + 28) // 64) * 64
    # the last 16 extents are gone (the header stays)
    os.truncate(tmp_path / "disk-tier", len(TIER_HEADER) + 16 * extent)
    before = client.stats()["disk_errors"]
    got = read_all(client, pages)
    failed = [slot for slot, value in got.items() if value == "EIO"]
    assert failed == list(range(16, 32))
    assert all(got[slot] == pages[slot] for slot in range(16))
    assert client.stats()["disk_errors"] - before == 16


def test_disk_tier_holds_no_plaintext_and_dies_with_the_key(serve, tmp_path):
    srv, client = serve(**DISK_POOL)
    secret = b"AGENTZIP-TEST-SECRET-" + os.urandom(8).hex().encode()
    page = (secret + b" api_key=sk-" + b"x" * 40 + b"\n") * 60
    page = page[:PAGE]
    pages = {}
    for slot in range(48):  # random tails: distinct (no dedup), and enough to pass 5% of 1 MiB
        pages[slot] = page[: PAGE - 1024] + os.urandom(1024)
        client.h.pwrite(pages[slot], slot * PAGE)
    push_to_disk(client, pages)
    tier = (tmp_path / "disk-tier").read_bytes()
    assert tier.count(b"\0") < len(tier)  # something was written
    assert secret not in tier and secret[:12] not in tier
    for algorithm in ("zstd", "lz4"):
        compressed = make_codec(algorithm, 3, PAGE).compress(pages[3])
        for start in range(0, len(compressed) - 16, 8):
            assert compressed[start : start + 16] not in tier, (algorithm, start)
    leftover = tmp_path / "leftover"
    leftover.write_bytes(tier)
    # A crash: the file stays, the key does not. The next server on the path starts empty.
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    for sock in ("nbd.sock", "control.sock"):
        (tmp_path / sock).unlink()
    assert (tmp_path / "disk-tier").stat().st_size > 0
    srv2, client2 = serve(**DISK_POOL)
    assert (tmp_path / "disk-tier").read_bytes() == TIER_HEADER  # emptied but for its header
    assert all(client2.read_or_errno(slot * PAGE) == bytes(PAGE) for slot in pages)
    # The old extents are ciphertext under a key that is gone: planted back they fail.
    fresh = disk_pages(client2)
    with open(tmp_path / "disk-tier", "r+b") as f:
        f.write(leftover.read_bytes()[: 4096 + 64])  # over the first extent
    got = read_all(client2, fresh)
    assert sorted(got.values(), key=lambda v: v != "EIO")[0] == "EIO"
    assert sum(1 for slot, value in got.items() if value != fresh[slot]) == 1
    client2.close()
    srv2.stop()
    assert srv2.proc.returncode == 0
    assert not (tmp_path / "disk-tier").exists()  # a stop removes it


def test_no_disk_tier_with_null_path(serve, tmp_path):
    """pool.swap_out_path: null: no file; a full pool answers ENOSPC (the kernel keeps the
    page) and nothing written before is lost."""
    srv, client = serve(max_size="1M", swap_out_path=None)
    written = []
    with pytest.raises(nbd.Error) as err:
        for i in range(1024):
            chunk = os.urandom(4 * PAGE)
            client.h.pwrite(chunk, i * 4 * PAGE)
            written.append(chunk)
    assert err.value.errno == "ENOSPC"
    assert len(written) >= 32
    request(srv.control_socket, "reclaim")  # nothing to demote to
    for i, chunk in enumerate(written):
        assert client.h.pread(len(chunk), i * 4 * PAGE) == chunk
    stats = client.stats()
    assert stats["enospc"] == 1 and stats["tiers"]["disk"]["pages"] == 0
    assert stats["demotions"] == 0 and stats["direct_to_disk"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml", "control.sock", "nbd.sock", "nbdkit.log"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = plugin_env()
    return subprocess.run([sys.executable, "-m", "agentzip_blk.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_serve_refuses_a_planted_link_at_the_tier_path(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"root's data\n" * 100)
    os.chmod(target, 0o600)  # passes every check but the link itself
    before = target.read_bytes()
    link = tmp_path / "tier-link"
    link.symlink_to(target)
    config = tmp_path / "config.yaml"
    config.write_text(f"pool:\n  swap_out_path: {link}\n")
    proc = cli("--config", str(config), "serve", "--size", "16M",
               "--socket", str(tmp_path / "nbd.sock"), "--control", str(tmp_path / "control.sock"))
    assert proc.returncode != 0
    assert "is a symbolic link: refusing it as the disk tier (pool.swap_out_path)" in proc.stderr
    assert target.read_bytes() == before and link.is_symlink()


def test_the_fuse_door_answers_eio_for_a_corrupt_cell(tmp_path):
    """The same check through the in-process FUSE front door (O_DIRECT, as the loop device
    reads it): the corrupt slot fails with EIO, its neighbours read back exact."""
    import errno
    import mmap

    mnt = tmp_path / "mnt"
    srv = start_server(tmp_path, size="16M", config=write_config(tmp_path),
                       extra_keys=(f"fuse={mnt}",), wait_for=(str(mnt / "device"),))
    try:
        fd = os.open(mnt / "device", os.O_RDWR | os.O_DIRECT)
        buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT wants
        pages = {slot: marked_page(os.urandom(1024)) for slot in range(4)}
        for slot, page in pages.items():
            buf[:] = page
            assert os.pwritev(fd, [buf], slot * PAGE) == PAGE
        assert flip_in_memory(srv.proc.pid, pages[2][300:364], 5) >= 1
        for slot, page in pages.items():
            if slot == 2:
                with pytest.raises(OSError) as err:
                    os.preadv(fd, [buf], slot * PAGE)
                assert err.value.errno == errno.EIO
            else:
                assert os.preadv(fd, [buf], slot * PAGE) == PAGE and bytes(buf) == page
        os.close(fd)
        assert request(srv.control_socket, "stats")["checksum_errors"] >= 1
    finally:
        srv.stop()
    assert not os.path.ismount(mnt)


def test_cli_serve_with_a_null_tier_path_writes_no_file(tmp_path):
    """`pool.swap_out_path: null` through what the operator runs (`agentzip-blk serve` in
    a process of its own): no file appears anywhere under the config's directory, a full
    pool is ENOSPC, and what was written reads back."""
    config = tmp_path / "config.yaml"
    config.write_text("pool:\n  max_size: 1M\n  swap_out_path: null\n")
    nbd_sock, control = tmp_path / "nbd.sock", tmp_path / "control.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentzip_blk.cli", "--config", str(config), "serve", "--size",
         "16M", "--socket", str(nbd_sock), "--control", str(control)],
        cwd=ROOT, env=plugin_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (nbd_sock.exists() and control.exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        h = nbd.NBD()
        h.connect_unix(str(nbd_sock))
        written = []
        with pytest.raises(nbd.Error) as err:
            for i in range(1024):
                written.append(os.urandom(PAGE))
                h.pwrite(written[-1], i * PAGE)
        assert err.value.errno == "ENOSPC"
        written.pop()
        assert all(h.pread(PAGE, i * PAGE) == page for i, page in enumerate(written))
        stats = request(str(control), "stats")
        assert stats["tiers"]["disk"]["file_bytes"] == 0 and stats["enospc"] == 1
        h.shutdown()
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "config.yaml", "control.sock", "nbd.sock", "serve.pid"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
