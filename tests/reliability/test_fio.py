"""Block-level verification with fio: random and sequential 4 KiB..1 MiB writes at queue
depths 1..32, each block checked with crc32c on read back, mixed reads and writes, trims
followed by a check that trimmed blocks read as zeros. Run directly over NBD (fio's nbd
engine, libnbd) and against the loop device over nbdfuse that swap uses (libaio, O_DIRECT).

The fast variants move ~200 MiB per path; the slow ones more than 1 GiB per path."""

from __future__ import annotations

import pytest

from . import support
from .conftest import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("nbdkit", "fio") is not None,
                                reason=str(skip_reason("nbdkit", "fio")))
pytestmark = [pytestmark, pytest.mark.slow]  # the inner loop leaves it out

# name, fio arguments (on top of --verify=crc32c and the target)
JOBS = [
    ("randwrite-qd1", ["--rw=randwrite", "--bsrange=4k-1m", "--iodepth=1"]),
    # a text-like pattern under each 4 KiB header: pages that compress instead of going raw
    ("randwrite-qd8-compressible", ["--rw=randwrite", "--bsrange=4k-256k", "--iodepth=8",
                                    "--verify_pattern=0x7b22746f6f6c5f63616c6c223a20",
                                    "--verify_interval=4096"]),
    ("randwrite-qd32", ["--rw=randwrite", "--bsrange=4k-1m", "--iodepth=32"]),
    ("write-seq-qd16", ["--rw=write", "--bs=1m", "--iodepth=16"]),
    ("randrw-qd32", ["--rw=randrw", "--rwmixread=40", "--bsrange=4k-128k", "--iodepth=32"]),
    # fio orders a block's trim before its write only at depth 1
    ("randtrimwrite-qd1", ["--rw=randtrimwrite", "--bsrange=4k-1m", "--iodepth=1"]),
]


def verify_failures(res) -> int:
    """Blocks fio's own verification found wrong: EILSEQ (84) is fio's verify error."""
    return sum(1 for j in res.jobs if j.get("error") == 84) + res.stderr.count("verify: bad ")


def run_suite(tmp, target: list[str], region: int, seed: int, area: str) -> dict:
    """Every job over `region` bytes, then trim it all and check it reads as zeros. `lost`:
    fio's verify failures, counted before the asserts and recorded under `area` whatever
    happens (a failing run reports what it lost too)."""
    out = {"verified": 0, "traffic": 0, "lost": 0}
    try:
        return _suite(tmp, target, region, seed, out)
    finally:
        support.record(area, bytes_verified=out["verified"], data_lost=out["lost"])


def _suite(tmp, target: list[str], region: int, seed: int, out: dict) -> dict:
    verified = traffic = 0
    for i, (name, args) in enumerate(JOBS):
        res = support.fio(tmp, name, *target, f"--size={region}", "--verify=crc32c",
                          f"--randseed={seed + i}", *args)
        out["lost"] += verify_failures(res)
        assert res.returncode == 0 and not res.errors and res.jobs, \
            f"fio {name}: rc {res.returncode}, errors {res.errors}\n{res.stderr[-3000:]}"
        writes, reads = res.bytes("write"), res.bytes("read")
        assert writes >= region // 2, f"fio {name} wrote only {writes} bytes"
        traffic += writes + reads + res.bytes("trim")
        # randrw reads unwritten blocks too; what is verified is every written block
        verified += writes if "randrw" in name else reads
        out["verified"] = verified
    res = support.fio(tmp, "trim-all", *target, f"--size={region}", "--rw=randtrim",
                      "--bsrange=4k-1m", "--iodepth=8", f"--randseed={seed}")
    assert res.returncode == 0 and not res.errors, res.stderr[-3000:]
    assert res.bytes("trim") == region
    res = support.fio(tmp, "zero-check", *target, f"--size={region}", "--rw=read", "--bs=1m",
                      "--iodepth=4", "--verify=pattern", "--verify_pattern=0x00")
    out["lost"] += verify_failures(res)
    assert res.returncode == 0 and not res.errors, \
        f"trimmed blocks did not read back as zeros:\n{res.stderr[-3000:]}"
    out["verified"] = verified + res.bytes("read")
    out["traffic"] = traffic + region * 2
    return out


def _nbd(tmp_path, region: int, seed: int) -> dict:
    with support.server(tmp_path, size=str(2 * region)) as srv:
        target = ["--ioengine=nbd", f"--uri=nbd+unix:///?socket={srv.nbd_socket}"]
        out = run_suite(tmp_path, target, region, seed, "fio_nbd")
        st = support.stats(srv)
        assert st["errors"] == 0 and st["enospc"] == 0
        assert st["compressed_pages"] + st["raw_pages"] + st["same_pages"] == st["pages"]
        assert st["pages"] == 0, "everything was trimmed"
        assert srv.proc.poll() is None
    return out


def _loop(tmp_path, region: int, seed: int) -> dict:
    with support.loop_chain(tmp_path, size=str(2 * region)) as chain:
        target = ["--ioengine=libaio", "--direct=1", f"--filename={chain.loop}"]
        out = run_suite(tmp_path, target, region, seed, "fio_loop")
        st = support.stats(chain.server)
        assert st["errors"] == 0 and st["enospc"] == 0 and st["pages"] == 0
    return out


loop_skip = skip_reason("nbdfuse", "losetup", "fusermount3")


def test_fio_nbd_fast(tmp_path):
    _nbd(tmp_path, 16 << 20, seed=11)


@pytest.mark.skipif(loop_skip is not None, reason=str(loop_skip))
def test_fio_loop_fast(tmp_path):
    _loop(tmp_path, 16 << 20, seed=12)


@pytest.mark.long
def test_fio_nbd_1gib(tmp_path):
    out = _nbd(tmp_path, 96 << 20, seed=21)
    assert out["traffic"] >= 1 << 30


@pytest.mark.long
@pytest.mark.skipif(loop_skip is not None, reason=str(loop_skip))
def test_fio_loop_1gib(tmp_path):
    out = _loop(tmp_path, 96 << 20, seed=22)
    assert out["traffic"] >= 1 << 30
