"""A scrape storm during traffic through the real nbdkit server (issue 16, item 6): 50
concurrent `stats` requests, half of them the exporter's own fetch (cached snapshot), while
a client writes and reads pages. Correctness only (the latency figures are in
bench/scrape.py): every request answers, every snapshot is consistent and no older than
asked, and every page reads back byte for byte."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentzip_blk.datapath.control import ControlError, request
from agentzip_blk.fleet.metrics import STATS_MAX_AGE, control_stats
from nbdkit_server import nbdkit_available, start_server

nbd = pytest.importorskip("nbd", reason="python3-libnbd not installed")
pytestmark = [
    pytest.mark.nbdkit,
    pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available())),
]

PAGE = 4096
SIZE = 64 << 20
SLOTS = 2048


def page_for(slot: int, gen: int) -> bytes:
    rnd = random.Random(slot * 7919 + gen)
    words = [b'{"role":', b'"tool"', b"result", str(slot).encode(), str(gen).encode()]
    return b" ".join(rnd.choice(words) for _ in range(PAGE))[:PAGE]


def consistent(st: dict, max_age: float, elapsed: float = 0.0) -> None:
    """`elapsed`: how long the request took. A fresh one (max_age 0) gets a snapshot whose
    scan started after the request came: its age is within the request's own time."""
    assert st["pages"] == st["same_pages"] + st["raw_pages"] + st["compressed_pages"]
    assert st["orig_mem"] == st["pages"] * PAGE
    assert st["tiers"]["pool"]["pages"] + st["tiers"]["disk"]["pages"] == st["pages"]
    assert 0 <= st["shared_pages"] <= st["pages"]
    assert 0 <= st["snapshot"]["age_s"] <= max(max_age, elapsed) + 0.001


def test_scrape_storm_during_traffic(tmp_path):
    srv = start_server(tmp_path, size=str(SIZE))
    stop = threading.Event()
    written: dict[int, bytes] = {}
    errors: list[str] = []

    def traffic() -> None:
        h = nbd.NBD()
        h.connect_unix(srv.nbd_socket)
        rnd = random.Random(1)
        gen = 0
        try:
            while not stop.is_set() or gen < 200:
                gen += 1
                first = rnd.randrange(0, SLOTS - 4)
                data = b"".join(page_for(first + i, gen) for i in range(4))
                h.pwrite(data, first * PAGE)
                for i in range(4):
                    written[first + i] = data[i * PAGE : (i + 1) * PAGE]
                slot = rnd.choice(list(written))
                if h.pread(PAGE, slot * PAGE) != written[slot]:
                    errors.append(f"slot {slot} read back wrong during the storm")
        finally:
            h.shutdown()

    try:
        _storm(srv, traffic, stop, written, errors)
    finally:
        srv.stop()


def _storm(srv, traffic, stop: threading.Event, written: dict[int, bytes],
           errors: list[str]) -> None:
    writer = threading.Thread(target=traffic)
    writer.start()
    exporter = control_stats(srv.control_socket)

    def scrape(n: int) -> tuple[dict, float, float]:
        t0 = time.monotonic()
        if n % 2:
            return exporter(), STATS_MAX_AGE, time.monotonic() - t0
        st = request(srv.control_socket, "stats", timeout=60)
        return st, 0.0, time.monotonic() - t0

    try:
        with ThreadPoolExecutor(50) as pool:
            for _ in range(3):
                replies = list(pool.map(scrape, range(50)))
                assert len(replies) == 50
                for st, max_age, elapsed in replies:
                    consistent(st, max_age, elapsed)
    finally:
        stop.set()
        writer.join(120)
    assert not errors, errors[:3]
    h = nbd.NBD()
    h.connect_unix(srv.nbd_socket)
    for slot, data in sorted(written.items()):
        assert h.pread(PAGE, slot * PAGE) == data, f"slot {slot}"
    h.shutdown()
    final = request(srv.control_socket, "stats")  # fresh by default: exact
    consistent(final, 0.0)
    assert final["pages"] == len(written)
    with pytest.raises(ControlError, match="max_age"):
        request(srv.control_socket, "stats", max_age="old")
    with pytest.raises(ControlError, match="max_age"):
        request(srv.control_socket, "stats", max_age=-1)
