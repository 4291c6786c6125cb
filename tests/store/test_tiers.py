"""Tiers with an injected clock: demotion order, cap, hysteresis, promotion, hot cache,
ping-pong, ENOSPC with both tiers full, compaction; every read byte-exact."""

from __future__ import annotations

import os
import random
import shutil
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from agentzip_blk.errors import StoreFull
from agentzip_blk.store import PageStore, Tiering
from agentzip_blk.store.blobs import DISK, POOL
from agentzip_blk.store.slots import BLOB

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

PAGE = 4096
N_PAGES = 700  # ~750 KiB of cells: past a 50% threshold of a 1 MiB pool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def text_page(seed: int) -> bytes:
    """A compressible page (~1.3 KiB compressed) unique to its seed."""
    rnd = random.Random(seed)
    words = [b"tool", b"result", b'"id"', b"value", b"\\n", b"error", b"ok", str(seed).encode()]
    return b" ".join(rnd.choice(words) for _ in range(PAGE))[:PAGE]


def make_store(tmp_path, clock, **kw) -> PageStore:
    tiering = Tiering(
        max_size=kw.pop("max_size", 256 * 1024),
        reclaim_threshold=kw.pop("reclaim_threshold", 50),
        swap_out_path=str(tmp_path / "disk-tier"),
        swap_out_max_size=kw.pop("swap_out_max_size", 0),
        hot_threshold_ms=1000,
        warm_threshold_ms=10_000,
        cold_grace_period=kw.pop("cold_grace_period", 30.0),
        hot_cache_size=kw.pop("hot_cache_size", 64 * 1024),
        defrag=kw.pop("defrag", True),
    )
    return PageStore(kw.pop("size", 4 << 20), tiering=tiering, clock=clock, **kw)


def tier_of(store: PageStore, slot: int) -> int:
    assert store.slots.kind[slot] == BLOB
    return int(store.blobs.tier[int(store.slots.handle[slot])])


def test_demotion_takes_the_oldest_first_and_stops_at_the_hysteresis_target(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock, max_size=1 << 20, reclaim_threshold=50)
    # Pages written one second apart: slot i is older than slot i+1.
    for slot in range(N_PAGES):
        store.write(text_page(slot), slot * PAGE)
        clock.advance(1)
        assert store.pool.allocated_bytes <= store.pool.max_size
    clock.advance(60)  # everything is cold now
    assert store.pool.allocated_bytes >= store.reclaim_bytes
    result = store.maintain()
    assert result["demoted"] > 0
    assert store.pool.allocated_bytes <= store.reclaim_target
    tiers = [tier_of(store, s) for s in range(N_PAGES)]
    demoted = [s for s, t in enumerate(tiers) if t == DISK]
    kept = [s for s, t in enumerate(tiers) if t == POOL]
    assert demoted and kept
    assert max(demoted) < min(kept), "a newer page went to disk before an older one"
    # Hysteresis: between the target and the threshold nothing moves.
    assert store.maintain()["demoted"] == 0
    for slot in range(N_PAGES):
        assert store.read(slot * PAGE, PAGE) == text_page(slot)
    store.check()


def test_warm_pages_are_not_demoted(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock, max_size=1 << 20, reclaim_threshold=10)
    for slot in range(300):
        store.write(text_page(slot), slot * PAGE)
    clock.advance(5)  # younger than cold_grace_period (30 s)
    assert store.maintain()["demoted"] == 0
    assert store.stats()["tiers"]["disk"]["pages"] == 0


def test_full_pool_sends_new_writes_to_disk_then_enospc(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock, max_size=64 * 1024, swap_out_max_size=128 * 1024)
    written = {}
    with pytest.raises(StoreFull):
        for slot in range(1000):
            data = os.urandom(PAGE) if slot % 2 else text_page(slot)
            store.write(data, slot * PAGE)
            written[slot] = data
            assert store.pool.allocated_bytes <= 64 * 1024
    stats = store.stats()
    assert stats["direct_to_disk"] > 0
    assert stats["disk_full"] >= 1 and stats["enospc"] == 1
    assert stats["tiers"]["disk"]["file_bytes"] <= 128 * 1024
    assert stats["tiers"]["pool"]["pages"] + stats["tiers"]["disk"]["pages"] == stats["pages"]
    assert stats["pages"] == len(written)
    for slot, data in written.items():  # nothing already stored was lost
        assert store.read(slot * PAGE, PAGE) == data
    store.check()


def test_promotion_on_read_while_the_pool_has_room(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock, max_size=1 << 20, reclaim_threshold=50)
    for slot in range(N_PAGES):
        store.write(text_page(slot), slot * PAGE)
    clock.advance(60)
    store.maintain()
    on_disk = [s for s in range(N_PAGES) if tier_of(store, s) == DISK]
    assert on_disk
    # Fill the pool past its threshold with fresh pages: a read must not promote now.
    extra = N_PAGES
    while store.pool.allocated_bytes < store.reclaim_bytes:
        store.write(text_page(extra), extra * PAGE)
        extra += 1
    assert store.read(on_disk[-1] * PAGE, PAGE) == text_page(on_disk[-1])
    assert tier_of(store, on_disk[-1]) == DISK
    assert store.stats()["promotions"] == 0
    store.trim(N_PAGES * PAGE, (extra - N_PAGES) * PAGE)
    store.trim(N_PAGES // 2 * PAGE, N_PAGES // 2 * PAGE)  # make room below the threshold
    store.compact()
    assert store.pool.allocated_bytes < store.reclaim_bytes
    slot = on_disk[0]
    assert store.read(slot * PAGE, PAGE) == text_page(slot)
    assert tier_of(store, slot) == POOL
    assert store.stats()["promotions"] >= 1
    store.check()


def test_hot_cache_and_pingpong(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock)
    store.write(text_page(1), 0)
    store.write(text_page(2), PAGE)
    assert store.read(0, PAGE) == text_page(1)
    clock.advance(0.5)
    assert store.read(0, PAGE) == text_page(1)  # second read within 1 s: hot
    assert int(store.slots.handle[0]) in store.hot
    assert store.read(0, PAGE) == text_page(1)
    stats = store.stats()
    assert stats["hot_hits"] >= 1
    assert stats["hot_cache_bytes"] > PAGE
    assert stats["temperature"]["hot"] == 1
    assert stats["stored_mem"] >= stats["pool_resident_bytes"] + stats["hot_cache_bytes"]
    # Slot 1 read, then written again 0.2 s later: the kernel swapped it right back out.
    store.read(PAGE, PAGE)
    clock.advance(0.2)
    store.write(text_page(3), PAGE)
    assert store.stats()["pingpong"] == 1
    # A write long after a read is not ping-pong.
    store.read(PAGE, PAGE)
    clock.advance(5)
    store.write(text_page(4), PAGE)
    assert store.stats()["pingpong"] == 1
    # Freed blobs leave the cache.
    store.trim(0, PAGE)
    assert len(store.hot) == 0
    store.check()


def test_temperature_counts(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock)
    store.write(text_page(1), 0)
    clock.advance(40)
    store.write(text_page(2), PAGE)
    clock.advance(20)
    store.write(text_page(3), 2 * PAGE)
    temp = store.stats()["temperature"]
    assert temp == {"hot": 0, "warm": 1, "idle": 1, "cold": 1}


def test_the_evacuation_plan_of_all_classes_is_each_class_planned_alone():
    """Pool.evacuation_plan plans every class in one pass (compaction's scan per class cost
    0.16 CPU under `bench load`); the model: per class, the arenas beyond the fewest, fullest
    first, that hold its cells, and a class of one arena keeps it."""
    from agentzip_blk.store.pool import Pool

    def model(pool: Pool) -> list[int]:
        out = []
        for cls in pool.classes:
            ids = np.flatnonzero(pool._a_class == cls.index)  # noqa: SLF001 - the model reads the books
            if len(ids) < 2:
                continue
            used = pool._a_used[ids].astype(np.int64)  # noqa: SLF001
            needed = -(-int(used.sum()) // cls.cells_per_arena)
            out += ids[np.argsort(-used, kind="stable")[needed:]].tolist()
        return sorted(out)

    rnd = random.Random(5)
    for _ in range(6):
        pool = Pool(256 << 20, max_blob=16 * PAGE)
        cells = [pool.alloc(rnd.randrange(PAGE, 16 * PAGE) if rnd.random() < 0.05
                            else rnd.randrange(16, PAGE - 96)) for _ in range(6000)]
        rnd.shuffle(cells)
        for arena, cell in cells[: rnd.randrange(len(cells))]:
            pool.free(arena, cell)
        plan = pool.evacuation_plan()
        assert plan and sorted(plan) == model(pool)
        pool.release()


def test_compaction_after_churn(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock, max_size=64 << 20, size=64 << 20, defrag=False)
    rnd = random.Random(11)
    slots = 8192
    for slot in range(slots):
        store.write(text_page(rnd.randrange(1 << 30)), slot * PAGE)
    # Trim three pages in four at random: every arena keeps a few live cells.
    for slot in rnd.sample(range(slots), slots * 3 // 4):
        store.trim(slot * PAGE, PAGE)
    before = store.stats()
    assert before["fragmentation"] > 0.5
    assert store.needs_compaction()
    moved = store.compact()
    after = store.stats()
    assert moved > 0 and after["pages_moved"] == moved
    # Bound: per size class at most one partly used arena, plus the tail waste of arenas.
    classes = len(store.pool.class_usage())
    slack = classes * max(c.arena_size for c in store.pool.classes)
    assert after["pool_bytes"] <= after["pool_live_bytes"] * 1.05 + slack
    assert after["pool_bytes"] < before["pool_bytes"] / 2
    store.check()


class TieredModel(RuleBasedStateMachine):
    """Random requests, clock steps and maintenance against a bytearray; the cap is checked
    after every operation and the books after every step."""

    UNIT_PAGES = 1

    @initialize(data=st.data())
    def setup(self, data) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="azt-tiers-")
        self.clock = Clock()
        tiering = Tiering(
            max_size=96 * 1024, reclaim_threshold=60, swap_out_path=os.path.join(self.dir, "d"),
            swap_out_max_size=data.draw(st.sampled_from([0, 160 * 1024])),
            cold_grace_period=2.0, hot_cache_size=16 * 1024,
        )
        self.store = PageStore(128 * PAGE, tiering=tiering, clock=self.clock,
                               frame_pages=self.UNIT_PAGES)
        self.model = bytearray(128 * PAGE)

    @rule(slot=st.integers(0, 127), pages=st.integers(1, 8), seed=st.integers(0, 50),
          kind=st.sampled_from(["text", "random", "same"]))
    def write(self, slot: int, pages: int, seed: int, kind: str) -> None:
        pages = min(pages, 128 - slot)
        rnd = random.Random(seed)
        if kind == "text":
            data = b"".join(text_page(seed * 100 + i) for i in range(pages))
        elif kind == "random":
            data = rnd.randbytes(pages * PAGE)
        else:
            data = bytes([seed]) * (pages * PAGE)
        try:
            self.store.write(data, slot * PAGE)
        except StoreFull:
            return  # refused whole: the model keeps the old bytes
        self.model[slot * PAGE : (slot + pages) * PAGE] = data

    @rule(offset=st.integers(0, 128 * PAGE - 1), length=st.integers(1, 3 * PAGE))
    def read(self, offset: int, length: int) -> None:
        length = min(length, 128 * PAGE - offset)
        assert self.store.read(offset, length) == self.model[offset : offset + length]

    @rule(slot=st.integers(0, 127), pages=st.integers(1, 16))
    def trim(self, slot: int, pages: int) -> None:
        pages = min(pages, 128 - slot)
        self.store.trim(slot * PAGE, pages * PAGE)
        self.model[slot * PAGE : (slot + pages) * PAGE] = bytes(pages * PAGE)

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.5, 3.0, 10.0]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def maintain(self) -> None:
        self.store.maintain()

    @rule()
    def compact(self) -> None:
        self.store.compact()

    @invariant()
    def books_and_cap(self) -> None:
        if not hasattr(self, "store"):
            return
        assert self.store.pool.allocated_bytes <= self.store.pool.max_size
        self.store.check()
        stats = self.store.stats()
        tiers = stats["tiers"]
        assert tiers["pool"]["pages"] + tiers["disk"]["pages"] == stats["pages"]

    def teardown(self) -> None:
        if hasattr(self, "store"):
            assert self.store.read(0, len(self.model)) == self.model
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class UnitTieredModel(TieredModel):
    """The same with 4-page units, which move between the tiers whole."""

    UNIT_PAGES = 4


TestTieredModel = TieredModel.TestCase
TestUnitTieredModel = UnitTieredModel.TestCase
for case in (TestTieredModel, TestUnitTieredModel):
    case.settings = settings(
        max_examples=40, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def test_rebase_keeps_order(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock)
    store.write(text_page(1), 0)
    clock.advance(10)
    store.write(text_page(2), PAGE)
    before = store.blobs.atime[[int(store.slots.handle[0]), int(store.slots.handle[1])]].astype(np.int64)
    store._rebase(int(before[0]) - 1)
    after = store.blobs.atime[[int(store.slots.handle[0]), int(store.slots.handle[1])]].astype(np.int64)
    assert after[1] - after[0] == before[1] - before[0]
    assert store.now() >= after[1]


def test_failed_writeback_during_demotion_keeps_pages_in_the_pool(tmp_path, monkeypatch):
    from agentzip_blk.store.disk import DiskError, DiskTier

    clock = Clock()
    store = make_store(tmp_path, clock, max_size=1 << 20, reclaim_threshold=50)
    for slot in range(N_PAGES):
        store.write(text_page(slot), slot * PAGE)
    clock.advance(60)

    def failing_sync(self):
        raise DiskError("fdatasync: Input/output error")

    # the demotion syncs its batch outside the store lock (sync_written); requests that
    # write straight to disk sync under it (drop_cache): both fail here
    monkeypatch.setattr(DiskTier, "drop_cache", failing_sync)
    monkeypatch.setattr(DiskTier, "sync_written", failing_sync)
    assert store.maintain()["demoted"] == 0
    assert store.stats()["tiers"]["disk"]["pages"] == 0
    assert store.disk.live_bytes == 0  # the copies' extents were given back
    for slot in range(N_PAGES):
        assert store.read(slot * PAGE, PAGE) == text_page(slot)
    store.check()


def test_promotion_stops_at_the_demotion_target(tmp_path):
    """Reads refill the pool only up to the hysteresis target, so maintenance does not have to
    demote what reads just promoted (pool/disk thrash)."""
    clock = Clock()
    store = make_store(tmp_path, clock, max_size=1 << 20, reclaim_threshold=50)
    for slot in range(N_PAGES):
        store.write(text_page(slot), slot * PAGE)
    clock.advance(60)
    store.maintain()
    on_disk = [s for s in range(N_PAGES) if tier_of(store, s) == DISK]
    for slot in on_disk:
        assert store.read(slot * PAGE, PAGE) == text_page(slot)
    assert store.pool.allocated_bytes <= store.reclaim_target
    clock.advance(60)
    assert store.maintain()["demoted"] == 0


class _HookedLock:
    """The store lock, calling `after_release` each time the compaction thread lets it go:
    the requests it runs come in exactly between two holds."""

    def __init__(self, lock) -> None:
        self._lock = lock
        self.after_release = None
        self._in_hook = False

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
        if self.after_release is not None and not self._in_hook:
            self._in_hook = True
            try:
                self.after_release()
            finally:
                self._in_hook = False


def test_compaction_moves_in_chunks_and_lets_requests_in_between(tmp_path, monkeypatch):
    """The store lock is released between chunks of COMPACT_CHUNK cells: requests that free
    and write cells meanwhile (here, after every release) leave the books right and every
    page exact."""
    from agentzip_blk.store import tiering

    monkeypatch.setattr(tiering, "COMPACT_CHUNK", 64)
    # the hooked lock from the start: the store's parts hold the lock it was built with
    hooked = _HookedLock(threading.Lock())
    store = make_store(tmp_path, Clock(), max_size=64 << 20, size=64 << 20, defrag=False,
                       lock=hooked)
    rnd = random.Random(5)
    model: dict[int, bytes] = {}
    for slot in range(8192):
        model[slot] = text_page(rnd.randrange(1 << 30))
        store.write(model[slot], slot * PAGE)
    for slot in rnd.sample(range(8192), 8192 * 3 // 4):  # every arena keeps a few cells
        store.trim(slot * PAGE, PAGE)
        model.pop(slot)
    assert store.needs_compaction()
    holds: list[int] = []
    real = store.tiers._move_cells
    monkeypatch.setattr(store.tiers, "_move_cells", lambda movers: holds.append(len(movers))
                        or real(movers))
    writes = 0

    def meanwhile() -> None:  # one write and one trim between two holds of the lock
        nonlocal writes
        writes += 1
        slot = 8192 + writes % 500
        model[slot] = text_page(10**9 + writes)
        store.write(model[slot], slot * PAGE)
        victim = min(model)
        store.trim(victim * PAGE, PAGE)
        model.pop(victim)

    hooked.after_release = meanwhile
    moved = store.compact()
    hooked.after_release = None
    assert len(holds) > 3 and max(holds) <= 64
    assert moved > 0 and writes >= len(holds)
    for slot, page in model.items():
        assert store.read(slot * PAGE, PAGE) == page, slot
    store.check()
    store.close()
