"""Recovery from a crash on the native request path (store.recovery, issue 28 item 3).

Pages written through the native loop (warm lz4 pages, frames at once, pages packed by the
native recompressor), the server "dies" (its books are let go without a word), and a store
rebuilt from the held descriptors is served by a new native path: every page reads back byte
for byte through it, and it writes and packs on. The same with the Python path, so that
both request paths leave books a recovery can read.
"""

from __future__ import annotations

import random
import time

import pytest

from agentzip_blk.config.schema import Config
from agentzip_blk.datapath import native
from agentzip_blk.store import PageStore
from nativeharness import NativeRequests
from store.test_recovery import Holder

PAGE = 4096
PAGES = 1024

pytestmark = pytest.mark.skipif(not native.available(), reason="no native extension")


def config_for(warm: str, frame_pages: int) -> Config:
    config = Config()
    config.device.size = PAGES * PAGE
    config.compression.frame_pages = frame_pages
    config.compression.warm_algorithm = warm
    config.compression.dictionary = "none"
    config.pool.max_size = 64 << 20
    config.pool.swap_out_path = None
    config.policy.cold_grace_period = 0.01
    config.policy.recompress_cpu = 1.0
    return config


def text_pages(rnd: random.Random, n: int) -> bytes:
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % rnd.randrange(99999)]
    out = b""
    for _ in range(n):
        r = rnd.random()
        if r < 0.7:
            page = b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE]
        elif r < 0.85:
            page = rnd.randbytes(PAGE)
        else:
            page = bytes(PAGE)
        out += page.ljust(PAGE, b".")
    return out


class Served:
    """A store and the native loop serving it, as the server builds them."""

    def __init__(self, store: PageStore, datapath: str) -> None:
        self.store = store
        self.path = native.NativePath(store) if datapath == "native" else None
        self.door = NativeRequests(store, self.path) if self.path else store

    def write(self, data: bytes, offset: int) -> None:
        self.door.write(data, offset)

    def read(self, offset: int, length: int) -> bytes:
        return self.door.read(offset, length)

    def die(self) -> None:
        """As a SIGKILL leaves it: nothing freed, nothing written."""
        if self.path is not None:
            self.door.close()
            self.path.close()
        self.store.shared.detach()
        self.store.release()

    def close(self) -> None:
        if self.path is not None:
            self.door.close()
            self.path.close()
        self.store.close()


@pytest.mark.parametrize("datapath", ["native", "python"])
@pytest.mark.parametrize("warm,frame_pages", [("lz4", 16), ("none", 16), ("lz4", 1)])
def test_pages_written_on_either_path_read_back_after_a_crash(datapath, warm, frame_pages):
    config = config_for(warm, frame_pages)
    choice = native.Choice(datapath, "test")
    size = config.device.size
    served = Served(PageStore.from_config(size, config, lock=native.make_lock(choice)),
                    datapath)
    holder = Holder()
    served.store.attach_holder(holder.on_new, holder.on_drop)
    rnd = random.Random(5)
    model = bytearray(size)
    recovered = None
    try:
        for step in range(300):
            first = rnd.randrange(PAGES - 16)
            n = rnd.choice([1, 2, 4, 8, 16])
            data = text_pages(rnd, n)
            served.write(data, first * PAGE)
            model[first * PAGE:(first + n) * PAGE] = data
            if step % 100 == 99:
                time.sleep(0.02)
                served.store.maintain()  # warm pages packed (natively where bound)
        if warm == "lz4":  # warm pages were packed into frames before the crash
            assert served.store.recompressor.pages_total > 0
        served.store.check()
        served.die()
        store, repair = PageStore.recover(size, config, holder.held(),
                                          lock=native.make_lock(choice))
        recovered = Served(store, datapath)
        assert repair.slots_emptied == 0
        store.check()
        for first in range(0, PAGES, 16):
            assert recovered.read(first * PAGE, 16 * PAGE) == model[first * PAGE:(first + 16) * PAGE], first
        for _ in range(100):  # and it serves on
            first = rnd.randrange(PAGES - 16)
            data = text_pages(rnd, 4)
            recovered.write(data, first * PAGE)
            model[first * PAGE:(first + 4) * PAGE] = data
        time.sleep(0.02)
        store.maintain()
        store.check()
        for first in range(0, PAGES, 16):
            assert recovered.read(first * PAGE, 16 * PAGE) == model[first * PAGE:(first + 16) * PAGE], first
    finally:
        if recovered is not None:
            recovered.close()
        holder.close()
