"""A store rebuilt from the memory a dead server left (store.recovery, issue 28 item 3).

The server's books live on memfds (store.shared) and its pool in one more; a holder keeps
their descriptors. Here the "holder" is a dict of duplicated descriptors taken through
`attach_holder`, and the "crash" is the old store let go without a word (`release`: its
mappings go, nothing is freed or written). The new store is built from the descriptors
alone, checked, read back byte for byte, and used again. The states a SIGKILL can leave
between two stores (an announced switch half done, rows moved down and not all re-pointed,
a staged blob no slot names, a slot whose row a request in flight had freed) are made by
hand and repaired.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from agentzip_blk.store import PageStore
from agentzip_blk.store.recovery import Held
from agentzip_blk.store.slots import BLOB, EMPTY

from .test_handover import PAGE, PAGES, fill, make_config, verify


class Holder:
    """What the holder process keeps, in this process: a dup of every descriptor."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.metas: dict[str, dict] = {}

    def on_new(self, name: str, fd: int, meta: dict) -> None:
        if name in self.fds:
            os.close(self.fds[name])
        self.fds[name] = os.dup(fd)
        self.metas[name] = meta

    def on_drop(self, name: str) -> None:
        os.close(self.fds.pop(name))
        self.metas.pop(name)

    def held(self) -> Held:
        return Held(dict(self.fds), dict(self.metas))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _crashed(config):
    store = PageStore.from_config(config.device.size, config)
    holder = Holder()
    store.attach_holder(holder.on_new, holder.on_drop)
    model = fill(store)
    store.check()
    assert store.counters.recompressed_pages > 0
    return config, model, holder, store


@pytest.fixture
def crashed(tmp_path):
    """A filled store, most of it in the disk tier, whose server 'died'."""
    config, model, holder, store = _crashed(make_config(tmp_path))
    assert store.counters.demotions + store.counters.direct_to_disk > 0
    yield config, model, holder, store
    holder.close()


@pytest.fixture
def crashed_in_pool(tmp_path):
    """The same, everything in the pool."""
    config = make_config(tmp_path)
    config.pool.max_size = 64 << 20
    config.pool.swap_out_path = None
    config, model, holder, store = _crashed(config)
    yield config, model, holder, store
    holder.close()


def _die(store: PageStore) -> None:
    store.shared.detach()
    store.release()  # unmaps, closes; frees nothing: as a SIGKILL leaves it


def test_everything_committed_reads_back_after_the_server_died(crashed):
    config, model, holder, old = crashed
    _die(old)
    store, repair = PageStore.recover(config.device.size, config, holder.held())
    try:
        store.check()
        verify(store, model)
        assert repair.slots_emptied == 0 and repair.duplicate_rows == 0
        assert repair.slots == int(np.count_nonzero(store.slots.kind))
        assert repair.disk_blobs > 0  # the disk tier came back, read with the held key
        # and it is a store like any other: written, trimmed, packed, demoted, compacted
        rnd = np.random.default_rng(3)
        for first in range(0, PAGES, 97):
            page = bytes(rnd.integers(0, 4, PAGE, dtype=np.uint8))
            store.write(page, first * PAGE)
            model[first * PAGE:(first + 1) * PAGE] = page
        store.trim(0, 64 * PAGE)
        model[:64 * PAGE] = bytes(64 * PAGE)
        time.sleep(0.02)
        store.maintain()
        store.check()
        verify(store, model)
    finally:
        store.close()


def test_a_second_crash_recovers_from_the_first_recovery(crashed):
    config, model, holder, old = crashed
    _die(old)
    store, _ = PageStore.recover(config.device.size, config, holder.held())
    second = Holder()
    store.attach_holder(second.on_new, second.on_drop)
    holder.close()  # the new server committed its own set: the old one is let go
    page = bytes(range(256)) * 16
    store.write(page, 5 * PAGE)
    model[5 * PAGE:6 * PAGE] = page
    _die(store)
    again, _ = PageStore.recover(config.device.size, config, second.held())
    try:
        again.check()
        verify(again, model)
    finally:
        again.close()
        second.close()


def test_what_a_kill_between_two_stores_leaves_is_repaired(crashed_in_pool):
    config, model, holder, old = crashed_in_pool
    slots, blobs = old.slots, old.blobs
    held = np.flatnonzero(slots.kind == BLOB)
    frames = held[blobs.pages[slots.handle[held]] > 1]
    # 1. an announced switch cut after the handle: the slot names the right blob and the
    #    wrong page of it; recovery finishes the switch
    s = int(frames[np.flatnonzero(slots.sub[frames] > 0)[0]])
    right = int(slots.sub[s])
    slots.switching[:] = [s, int(slots.handle[s]), right, 1]
    slots.sub[s] = 0
    # 2. a staged blob that no slot names yet: a row with a cell, freed by recovery
    staged = blobs.new(*old.pool.alloc(100), 100, 0)
    # 3. rows moved down and their slots not all re-pointed: two whole copies of each row
    lone = held[blobs.pages[slots.handle[held]] == 1]
    shared = held[(blobs.ref[slots.handle[held]] >= 2) & (slots.handle[held] != slots.handle[s])]
    victim = int(slots.handle[shared[-1]])
    free = int(np.flatnonzero(blobs.ref[:blobs.rows] == 0)[0])
    for name in ("arena", "cell", "tier", "disk_off", "length", "pages", "codec", "dict_id",
                 "csum", "form"):
        getattr(blobs, name)[free] = getattr(blobs, name)[victim]
    blobs.members[free] = blobs.members[victim]
    twins = np.flatnonzero((slots.kind == BLOB) & (slots.handle == victim))
    slots.handle[twins[: len(twins) // 2 + 1]] = free  # some re-pointed, the rest not
    # 4. a slot whose row a request in flight freed (the kernel sends the write again)
    inflight = int(lone[0])
    gone = int(slots.handle[inflight])
    if blobs.ref[gone] == 1:
        blobs.delete(gone)
    blobs.arena[gone] = -1
    _die(old)
    store, repair = PageStore.recover(config.device.size, config, holder.held())
    try:
        assert repair.arenas > 0
        assert repair.switches_finished == 1
        assert int(store.slots.sub[s]) == right
        assert repair.duplicate_rows == 1
        assert repair.slots_emptied >= 1
        assert store.slots.kind[inflight] == EMPTY
        assert store.blobs.ref[staged] == 0
        assert repair.rows_freed >= 1  # the staged row, named by no slot
        store.check()
        # every slot but the one in flight reads what was written
        model[inflight * PAGE:(inflight + 1) * PAGE] = bytes(PAGE)
        verify(store, model)
    finally:
        store.close()


def test_a_different_frame_size_is_refused_with_the_key_named(crashed, tmp_path):
    config, _model, holder, old = crashed
    _die(old)
    other = make_config(tmp_path, frame_pages=8)
    with pytest.raises(Exception, match="frame_pages"):
        PageStore.recover(other.device.size, other, holder.held())
