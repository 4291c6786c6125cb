"""zram setup. As swap, agentzip_blk.demo.backends.ZramSwap (attach, swapoff, reset); as a raw
block device holding pages, ``raw_device`` here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

SYSFS = "/sys/block/zram0"
DEVICE = "/dev/zram0"


class ZramBusy(RuntimeError):
    """/dev/zram0 already has a disksize: someone else's swap or data is on it."""


def available() -> bool:
    return os.path.exists(SYSFS)


@contextlib.contextmanager
def raw_device(algorithm: str = "lz4", disksize: int = 256 << 20) -> Iterator[str]:
    """/dev/zram0 set up with *algorithm* and *disksize*, no swap on it; reset afterwards."""
    with open(f"{SYSFS}/disksize") as f:
        if int(f.read()) != 0:
            raise ZramBusy("zram0 in use")
    try:
        with open(f"{SYSFS}/comp_algorithm", "w") as f:
            f.write(algorithm)
        with open(f"{SYSFS}/disksize", "w") as f:
            f.write(str(disksize))
        yield DEVICE
    finally:
        with open(f"{SYSFS}/reset", "w") as f:
            f.write("1")
