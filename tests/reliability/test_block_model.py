"""Model-checked random I/O over NBD: writes, reads, trims and zeroes, aligned and not,
4 connections at up to 8 requests in flight each (32 in all), while the maintenance worker
demotes to the disk tier and compacts, and a control client asks for defrag and reclaim.
Every read is compared with a model of the device; at the end the whole device is.

fio has no NBD write-zeroes and checks trims only coarsely; this covers both exactly."""

from __future__ import annotations

import random
import threading

import pytest

from . import support
from .conftest import skip_reason
from .support import PAGE, make_pages

pytestmark = pytest.mark.skipif(skip_reason("nbdkit") is not None,
                                reason=str(skip_reason("nbdkit")))
pytestmark = [pytestmark, pytest.mark.slow]  # the inner loop leaves it out

SIZE = 64 << 20
CONNECTIONS = 4
DEPTH = 8


def _content(rnd: random.Random, length: int, pool: list[bytes]) -> bytes:
    kind = rnd.choice("tttrrszd")
    if kind == "z":
        return bytes(length)
    if kind == "d" and pool:  # a page seen before, repeated: dedup
        page = rnd.choice(pool)
        return (page * (length // PAGE + 1))[:length]
    pages = make_pages(length // PAGE + 1, rnd.randrange(1 << 30), mix=kind)
    pool.append(pages[0])
    return b"".join(pages)[:length]


def _worker(sock: str, base: int, span: int, model: bytearray, ops: int, seed: int,
            out: dict) -> None:
    import nbd

    rnd = random.Random(seed)
    h = support.nbd_client(sock)
    inflight: dict[int, tuple] = {}
    seen: list[bytes] = []
    verified = mismatches = issued = 0
    try:
        while issued < ops or inflight:
            while issued < ops and len(inflight) < DEPTH:
                length = rnd.choice([PAGE, 2 * PAGE, 8 * PAGE, 32 * PAGE, 256 * PAGE,
                                     rnd.randrange(1, 3 * PAGE)])
                offset = rnd.randrange(0, span - length + 1)
                if rnd.random() < 0.7:
                    offset -= offset % PAGE
                end = offset + length
                if any(o < end and offset < e for _, o, e, _ in inflight.values()):
                    issued += 1  # overlaps a request in flight: its outcome would be a race
                    continue
                kind = rnd.choices(["write", "read", "trim", "zero"], [5, 4, 1, 1])[0]
                if kind == "write":
                    data = _content(rnd, length, seen)
                    cookie = h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)),
                                          base + offset)
                    model[offset:end] = data
                    inflight[cookie] = ("write", offset, end, None)
                elif kind == "read":
                    buf = nbd.Buffer(length)
                    cookie = h.aio_pread(buf, base + offset)
                    inflight[cookie] = ("read", offset, end, (buf, bytes(model[offset:end])))
                else:
                    call = h.aio_trim if kind == "trim" else h.aio_zero
                    cookie = call(length, base + offset)
                    model[offset:end] = bytes(length)
                    inflight[cookie] = (kind, offset, end, None)
                issued += 1
            h.poll(-1)
            for cookie in [c for c in inflight if h.aio_command_completed(c)]:
                kind, offset, end, extra = inflight.pop(cookie)
                if kind == "read":
                    buf, want = extra
                    if buf.to_bytearray() != want:
                        mismatches += 1
                    verified += end - offset
        final = h.pread(span, base) if span <= 32 << 20 else b"".join(
            h.pread(32 << 20, base + o) for o in range(0, span, 32 << 20))
        mismatches += final != model
        verified += span
    finally:
        h.shutdown()
    out.update(verified=verified, mismatches=mismatches)


def _pester(sock: str, stop: threading.Event, out: dict) -> None:
    """Background control traffic: stats, defrag, reclaim, slot queries."""
    n = 0
    while not stop.is_set():
        verb = ("stats", "defrag", "reclaim", "slots")[n % 4]
        reply = support.request(sock, verb, **({"slots": list(range(0, 4096, 7))}
                                                if verb == "slots" else {}))
        assert isinstance(reply, dict)
        n += 1
    out["requests"] = n


def run_model(tmp_path, ops: int, seed: int) -> None:
    config = support.write_config(tmp_path, pool={"max_size": "4M", "reclaim_threshold": 50},
                                  policy={"cold_grace_period": "100ms", "hot_threshold_ms": 50,
                                          "warm_threshold_ms": 100})
    with support.server(tmp_path, size=str(SIZE), config=config) as srv:
        span = SIZE // CONNECTIONS
        model = [bytearray(span) for _ in range(CONNECTIONS)]
        results = [{} for _ in range(CONNECTIONS)]
        threads = [threading.Thread(target=_worker, args=(srv.nbd_socket, i * span, span,
                                                          model[i], ops, seed + i, results[i]))
                   for i in range(CONNECTIONS)]
        stop, pester = threading.Event(), {}
        control = threading.Thread(target=_pester, args=(srv.control_socket, stop, pester))
        control.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        control.join()
        # recorded first, so that a failing run reports what it lost; a worker that died
        # verified nothing more, and its span counts as lost
        lost = sum(r.get("mismatches", 1) for r in results)
        support.record("block_model", bytes_verified=sum(r.get("verified", 0) for r in results),
                       data_lost=lost)
        assert all("mismatches" in r for r in results), f"a worker died: {results}"
        st = support.stats(srv)
        assert lost == 0, f"{lost} reads disagreed with the model"
        assert st["errors"] == 0 and st["enospc"] == 0
        assert st["demotions"] + st["direct_to_disk"] > 0, "the disk tier was never used"
        assert srv.proc.poll() is None


def test_model_fast(tmp_path):
    run_model(tmp_path, ops=400, seed=1)


@pytest.mark.long
def test_model_long(tmp_path):
    run_model(tmp_path, ops=6000, seed=100)
