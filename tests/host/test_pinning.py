"""The holder's pins (host/pinning.py): the pages of a held memfd that are in memory are
faulted into a mapping locked on fault, never its holes, and only once; a grown memfd is mapped again, one no longer held
is let go, and what is not a memfd is left alone."""

from __future__ import annotations

import os
import tempfile

import pytest

from agentzip_blk.host import pinning

PAGE = pinning.PAGE


def locked_kib(address: int) -> int:
    """The Locked: figure of our mapping that starts at ``address``."""
    start = f"{address:x}-"
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and not line.split()[0].endswith(":"):
                inside = line.startswith(start)
            elif inside and line.startswith("Locked:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:x}")


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.startswith(f"{address:x}-") for line in f)


@pytest.fixture
def memfd():
    fd = os.memfd_create("test-pins", os.MFD_CLOEXEC)
    yield fd
    os.close(fd)


def test_refresh_locks_the_data_and_allocates_no_hole(memfd):
    os.ftruncate(memfd, 256 * PAGE)
    os.pwrite(memfd, os.urandom(5 * PAGE), 100 * PAGE)
    blocks = os.fstat(memfd).st_blocks
    pins = pinning.Pins()
    try:
        done = pins.refresh([memfd])
        assert (done.memfds, done.bytes, done.faulted, done.errors) == (1, 5 * PAGE, 5 * PAGE, [])
        (pin,) = pins.pins.values()
        assert locked_kib(pin.address) == 5 * PAGE // 1024
        assert os.fstat(memfd).st_blocks == blocks  # no hole filled
        # written later (by the server, which locks it itself meanwhile): the next refresh
        os.pwrite(memfd, os.urandom(PAGE), 7 * PAGE)
        again = pins.refresh([memfd])
        assert (again.bytes, again.faulted) == (6 * PAGE, PAGE)  # only the new page faulted
        assert locked_kib(pin.address) == 6 * PAGE // 1024
    finally:
        pins.close()


def test_a_grown_memfd_is_mapped_again_and_a_dropped_one_let_go(memfd):
    os.ftruncate(memfd, 4 * PAGE)
    os.pwrite(memfd, b"x" * PAGE, 0)
    pins = pinning.Pins()
    try:
        pins.refresh([memfd])
        (small,) = pins.pins.values()
        os.ftruncate(memfd, 4096 * PAGE)  # a column grows in place
        os.pwrite(memfd, b"y" * PAGE, 4000 * PAGE)
        assert pins.refresh([memfd]).bytes == 2 * PAGE
        (grown,) = pins.pins.values()
        assert grown.length == 4096 * PAGE and locked_kib(grown.address) == 8
        assert not mapped(small.address) or small.address == grown.address
        done = pins.refresh([])
        assert done.unmapped == 1 and pins.pins == {} and not mapped(grown.address)
    finally:
        pins.close()


def test_what_is_not_a_memfd_is_left_alone():
    with tempfile.TemporaryFile(dir="/tmp") as f:
        f.write(b"z" * PAGE)
        f.flush()
        pins = pinning.Pins()
        done = pins.refresh([f.fileno()])
        assert (done.memfds, done.bytes, pins.pins) == (0, 0, {})
