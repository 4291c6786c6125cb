"""What the store holds and what it costs: stats, metadata bytes, temperature, per-slot sizes
for per-cgroup accounting, and `check`, the cross-check of every book (for tests).

Memory is counted as the kernel counts it: the big preallocated tables cost the pages
actually touched, not their mappings. The caller holds the store lock, except for `stats`,
which takes it for what it copies and counts after.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..codec import codecs
from .blobs import DISK, POOL, WARM
from .dedup import SUB_BITS
from .disk import ALLOC_STEP
from .slots import BLOB, EMPTY
from .tables import array_resident_bytes

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..codec.codecs import Codec, CodecSet
    from ..codec.dictionaries import StoreDictionaries
    from .blobs import BlobTable
    from .cache import HotCache
    from .dedup import DedupIndex
    from .disk import DiskTier
    from .objects import Counters, Objects
    from .placement import Placer
    from .pool import Pool
    from .recompress import Recompressor
    from .slots import SlotTable
    from .tiering import Tiers


class AccountedStore(Protocol):
    """What the accounting reads of the store (store.PageStore is one): its tables and
    parts, its clock and the counters of its request paths. A protocol, so that this module
    does not import pagestore, which imports it."""

    size: int
    nslots: int
    page_size: int
    frame_pages: int
    slots: SlotTable
    blobs: BlobTable
    index: DedupIndex
    pool: Pool
    disk: DiskTier | None
    objects: Objects
    placer: Placer
    codecs: CodecSet
    frame_codec: Codec | None
    warm_codec: Codec | None
    dicts: StoreDictionaries
    hot: HotCache
    counters: Counters
    tiers: Tiers
    recompressor: Recompressor
    cold_ticks: int
    warm_ticks: int
    outside: Callable[[], dict[str, int]]

    def now(self) -> int: ...


def meta_parts(store: AccountedStore) -> dict[str, int]:
    """Everything held in memory besides pool arenas, by part. The dedup index counts its
    resident pages (mincore): it is sized for the pages stored, not the device."""

    def resident(arrays) -> int:
        return sum(array_resident_bytes(a) for a in arrays)

    return {
        "slot_table": store.slots.touched_bytes(),
        "blob_table": store.blobs.used_bytes,
        "dedup_index": resident(store.index.arrays()),
        "codecs": store.codecs.memory_bytes()
        + (store.frame_codec.memory_bytes() if store.frame_codec else 0)
        + (store.warm_codec.memory_bytes() if store.warm_codec else 0),
        "pool_books": store.pool.meta_bytes(),
        "disk_books": store.disk.meta_bytes() if store.disk else 0,
    }


def stored_mem(store: AccountedStore, meta_bytes: int) -> int:
    """Pool pages touched, metadata, and the decoded copies held (ours, and the native
    path's frame cache: PageStore.outside)."""
    outside = store.outside().get("frame_cache_bytes", 0)
    return store.pool.resident_bytes + meta_bytes + store.objects.cache_bytes() + outside


@dataclass
class _Frozen:
    """What `stats` counts, copied under the store lock: the slots holding blobs and the
    blob table's rows in use. The sums and the sort of the counts then run without the lock
    (a scan held it ~40 ms per 64Ki pages stored, which every request waited out)."""
    held: np.ndarray  # slots holding a blob
    slot_blobs: np.ndarray  # their blobs
    subs: np.ndarray  # their page in the blob
    returned: np.ndarray  # read back and not written since
    live: np.ndarray  # the blob rows in use (the rest: copies of rows [:rows])
    tier: np.ndarray
    length: np.ndarray
    pages: np.ndarray
    form: np.ndarray
    atime: np.ndarray
    rtime: np.ndarray
    ref: np.ndarray
    now: int
    hot: np.ndarray  # blobs in the hot cache


def _freeze(store: AccountedStore) -> _Frozen:
    slots, blobs = store.slots, store.blobs
    held = slots.blob_slots()
    rows = blobs.rows
    return _Frozen(
        held=held, slot_blobs=slots.handle[held].astype(np.int64), subs=slots.sub[held],
        returned=slots.rtime[held] != 0, live=blobs.ref[:rows] > 0,
        tier=blobs.tier[:rows].copy(), length=blobs.length[:rows].astype(np.int64),
        pages=blobs.pages[:rows].copy(), form=blobs.form[:rows].copy(),
        atime=blobs.atime[:rows].astype(np.int64), rtime=blobs.rtime[:rows].copy(),
        ref=blobs.ref[:rows].copy(), now=store.now(),
        hot=np.array(store.hot.keys(), dtype=np.int64))


def stats(store: AccountedStore, lock) -> dict:
    """Every figure of the `stats` verb: what must agree is read under `lock` (the store's),
    the counting is done after it."""
    page = store.page_size
    with lock:
        frozen = _freeze(store)
        codec_pages = store.objects.codec_pages.copy()
        same_pages = store.slots.same_pages
        meta = meta_parts(store)
        meta_bytes = sum(meta.values())
        stored = stored_mem(store, meta_bytes)
        dictionaries = store.dicts.stats(store.blobs, frozen.slot_blobs, page)
        pool, disk, tiers = store.pool, store.disk, store.tiers
        figures = {
            "unique_blobs": store.blobs.count,
            "dedup_unindexed": store.index.unindexed,  # pages left out of the index (dedup.py)
            "pool_bytes": pool.allocated_bytes,
            "pool_resident_bytes": pool.resident_bytes,
            "pool_live_bytes": pool.live_bytes,
            "pool_arenas": pool.arena_count,
            "fragmentation": round(tiers.fragmentation(), 4),
            "hot_cache_bytes": (store.objects.cache_bytes()
                                + store.outside().get("frame_cache_bytes", 0)),
            "max_size": pool.max_size,
            "reclaim_bytes": tiers.reclaim_bytes,
            "disk_mem": disk.file_size if disk else 0,
        }
        disk_figures = {"file_bytes": disk.file_size if disk else 0,
                        "reads": disk.reads if disk else 0,
                        "writes": disk.writes if disk else 0}
        counters = _counters(store)
        recompressor = store.recompressor
        recompress = {"recompressed_pages_total": store.counters.recompressed_pages,
                      "recompress_cpu_seconds_total": round(recompressor.cpu_seconds, 6),
                      "recompress_raced": recompressor.raced}
    blob_pages = int(codec_pages.sum())
    pages = same_pages + blob_pages
    orig = pages * page
    pages_held = _pages_held(frozen)
    tier_pages = np.bincount(frozen.tier[frozen.slot_blobs], minlength=2)
    live, lengths = frozen.live, frozen.length
    disk_stored = int(lengths[live & (frozen.tier == DISK)].sum())
    return {
        "size": store.size,
        "slots": store.nslots,
        "page_size": page,
        "algorithm": store.codecs.writer.name,
        "orig_mem": orig,
        "stored_mem": stored,
        "ratio": round(orig / stored, 4) if stored else 0.0,
        "pages": pages,
        "same_pages": same_pages,
        "raw_pages": int(codec_pages[codecs.RAW]),
        "compressed_pages": blob_pages - int(codec_pages[codecs.RAW]),
        "shared_pages": pages_held["shared"],
        "unique_blobs": figures.pop("unique_blobs"),
        "dedup_saved_pages": blob_pages - pages_held["distinct"],
        "dedup": store.placer.dedup,
        "dedup_unindexed": figures.pop("dedup_unindexed"),
        # frames: "unit" is their name in the stats interface (docs/JSON.md)
        "unit_pages": store.frame_pages,
        "units": int(np.count_nonzero(live & (frozen.pages > 1))),
        "unit_dead_pages": pages_held["dead"],
        "codec_pages": {
            name: int(codec_pages[cid])
            for cid, name in codecs.CODEC_NAMES.items()
            if codec_pages[cid]
        },
        "dictionaries": dictionaries,
        **{k: figures[k] for k in ("pool_bytes", "pool_resident_bytes", "pool_live_bytes",
                                   "pool_arenas", "fragmentation")},
        "compressed_bytes": int(lengths[live].sum()),
        "meta_bytes": meta_bytes,
        "meta": meta,
        **{k: figures[k] for k in ("hot_cache_bytes", "max_size", "reclaim_bytes", "disk_mem")},
        "tiers": {
            "pool": {
                "pages": int(tier_pages[POOL]) + same_pages,
                "orig_bytes": (int(tier_pages[POOL]) + same_pages) * page,
                "stored_bytes": stored,
            },
            "disk": {
                "pages": int(tier_pages[DISK]),
                "orig_bytes": int(tier_pages[DISK]) * page,
                "stored_bytes": disk_stored,
                **disk_figures,
            },
        },
        "temperature": _temperature(store, frozen),
        **_forms(store, frozen, same_pages),
        **recompress,
        **counters,
    }


def _counters(store: AccountedStore) -> dict:
    """The request counters under their stats names, with the requests another request path
    served from the same tables (the native path: PageStore.outside)."""
    counters = {STATS_NAMES.get(k, k): v for k, v in asdict(store.counters).items()}
    outside = store.outside()
    for key in OUTSIDE_COUNTERS:
        counters[key] += outside.get(key, 0)
    return counters


# objects.Counters fields whose stats and metrics name (docs/JSON.md) is another: frames
# were "units" when the interface was made, and it keeps that name
STATS_NAMES = {"frames_written": "units_written", "frame_fallbacks": "unit_fallbacks",
               "frame_hits": "unit_hits", "frames_rewritten": "units_rewritten",
               "frames_incompressible": "units_incompressible"}

# what a request path outside Python counts of the store's request counters, by stats name
# (the native path reports them so)
OUTSIDE_COUNTERS = ("reads", "bytes_read", "writes", "bytes_written", "dedup_hits",
                    "dedup_compares", "hash_collisions", "pingpong", "units_written",
                    "unit_fallbacks", "units_incompressible")


def _forms(store: AccountedStore, f: _Frozen, same_pages: int) -> dict:
    """Pages and stored bytes of each form (docs/JSON.md), from the slots holding blobs:
    warm (alone, fast codec) and cold (dense) in the pool, on disk, same-filled; they add
    up to `pages`. Stored bytes are the blobs' compressed lengths (a shared blob once)."""
    page = store.page_size
    in_pool = f.tier[f.slot_blobs] == POOL
    warm_slot = f.form[f.slot_blobs] == WARM
    warm_pages = int(np.count_nonzero(in_pool & warm_slot))
    pool_pages = int(np.count_nonzero(in_pool))
    pool_blobs = f.live & (f.tier == POOL)
    warm_stored = int(f.length[pool_blobs & (f.form == WARM)].sum())
    cold_stored = int(f.length[pool_blobs & (f.form != WARM)].sum())
    cold_pages = pool_pages - warm_pages
    # the recompressor's backlog (Recompressor.backlog), from the same copy
    due = pool_blobs & (f.form == WARM) & ((f.now - f.atime >= store.cold_ticks) | (f.rtime > 0))
    backlog = int(f.ref[due].astype(np.int64).sum()) if store.recompressor.enabled else 0
    return {
        "warm_pages": warm_pages,
        "warm_stored": warm_stored,
        "warm_ratio": round(warm_pages * page / warm_stored, 4) if warm_stored else 0.0,
        "cold_pages": cold_pages,
        "cold_stored": cold_stored,
        "cold_ratio": round(cold_pages * page / cold_stored, 4) if cold_stored else 0.0,
        "pool_pages": pool_pages + same_pages,
        "disk_pages": len(f.slot_blobs) - pool_pages,
        # read back and not written since: the kernel may still need them (swap cache, a
        # clean eviction) or may have freed their slots without telling the device
        "returned_pages": int(np.count_nonzero(f.returned)),
        # of those, the ones still in memory (policy.returned_to_disk moves them out)
        "returned_pool_pages": int(np.count_nonzero(f.returned & in_pool)),
        "recompress_backlog": backlog,
    }


def _pages_held(f: _Frozen) -> dict:
    """Distinct stored pages the slots use, slots sharing one with another slot, and
    pages of live frames no slot uses any more (overwritten or trimmed: memory a frame
    holds until its last page goes)."""
    pairs = f.slot_blobs << SUB_BITS | f.subs.astype(np.int64)
    distinct, counts = np.unique(pairs, return_counts=True)
    stored = int(f.pages[f.live].astype(np.int64).sum())
    return {"distinct": len(distinct), "shared": int(counts[counts > 1].sum()),
            "dead": stored - len(distinct)}


def _temperature(store: AccountedStore, f: _Frozen) -> dict:
    """Pages by temperature: hot (in the hot cache), warm (accessed within
    warm_threshold_ms), cold (untouched for cold_grace_period), idle (in between)."""
    if not len(f.slot_blobs):
        return {"hot": 0, "warm": 0, "idle": 0, "cold": 0}
    age = f.now - f.atime[f.slot_blobs]
    in_cache = np.isin(f.slot_blobs, f.hot)
    warm = ~in_cache & (age <= store.warm_ticks)
    cold = ~in_cache & (age >= store.cold_ticks)
    hot = int(in_cache.sum())
    return {
        "hot": hot,
        "warm": int(warm.sum()),
        "idle": len(f.slot_blobs) - hot - int(warm.sum()) - int(cold.sum()),
        "cold": int(cold.sum()),
    }


def slot_sizes(store: AccountedStore, slots) -> dict:
    """What the given slots cost, for per-cgroup accounting: per slot the stored bytes
    (a shared blob's length divided by its refcount; 0 for same-filled and empty slots),
    whether it holds data, and its tier. Slots outside the device are reported as empty."""
    slots = np.asarray(slots, dtype=np.int64)
    valid = (slots >= 0) & (slots < store.nslots)
    idx = np.where(valid, slots, 0)
    blobs = store.blobs
    kinds = np.where(valid, store.slots.kind[idx], EMPTY)
    blob_ids = np.where(kinds == BLOB, store.slots.handle[idx].astype(np.int64), 0)
    lengths = blobs.length[blob_ids].astype(np.float64)
    refs = np.maximum(blobs.ref[blob_ids].astype(np.float64), 1)
    stored = np.where(kinds == BLOB, lengths / refs, 0.0)
    tiers = np.where(kinds == BLOB, blobs.tier[blob_ids], POOL)
    return {
        "kind": kinds.astype(int).tolist(),
        "stored": np.round(stored, 1).tolist(),
        "tier": tiers.astype(int).tolist(),
    }


def check(store: AccountedStore) -> None:
    """Cross-check every invariant of the books; raises AssertionError."""
    blobs, slots, pool = store.blobs, store.slots, store.pool
    held = slots.kind == BLOB
    blob_slots = slots.handle[held].astype(np.int64)
    refs = np.bincount(blob_slots, minlength=blobs.capacity)[: blobs.capacity]
    assert np.array_equal(refs, blobs.ref.astype(np.int64)), "refcounts disagree"
    assert blobs.count == int(np.count_nonzero(refs)), "blob count disagrees"
    live = blobs.live()
    assert store.index.count + store.index.unindexed == int(
        blobs.pages[live].astype(np.int64).sum()), "index and blob table disagree"
    assert store.index.unindexed >= 0
    assert (slots.sub[held] < blobs.pages[blob_slots]).all(), "slot names a missing page"
    assert not slots.sub[~held].any()
    slots.check()
    assert int(store.objects.codec_pages.sum()) == len(blob_slots)
    warm = live & (blobs.form == WARM)
    assert (blobs.pages[warm] == 1).all(), "a warm blob holds more than one page"
    assert not (blobs.dict_id[warm]).any(), "a warm blob names a dictionary"
    in_pool = live & (blobs.tier == POOL)
    assert pool.live_cells == int(in_pool.sum()), "pool cells leak"
    cells = sum(pool.class_for(int(n)).cell_size for n in blobs.length[in_pool])
    assert pool.live_bytes == cells
    assert pool.allocated_bytes <= pool.max_size, "pool over its cap"
    assert pool.live_bytes <= pool.resident_bytes <= pool.allocated_bytes
    on_disk = live & (blobs.tier == DISK)
    if store.disk is not None:
        sealed = blobs.length[on_disk].astype(np.int64) + store.disk.overhead  # nonce + tag
        extents = (-(-sealed // ALLOC_STEP) * ALLOC_STEP).sum()
        assert store.disk.live_bytes == int(extents), "disk extents leak"
    else:
        assert not on_disk.any()


class StatsCache:
    """The last `stats` of a store, for readers that can take it a little old: the metrics
    exporter asks for one at most `max_age` seconds old, so a storm of scrapes costs no scan
    at all while the snapshot is young, and one scan when it is not.

    Refreshes are single-flight: a reader that finds one under way waits for it and takes
    its result if the scan started after the reader arrived. A reader asking for
    `max_age=0` so gets a snapshot taken after its request came, without a scan of its own
    when others are refreshing already. The maintainer calls `refresh_if_read` each round,
    so a periodic scraper finds a young snapshot and never scans on its request."""

    def __init__(self, scan, clock) -> None:
        self._scan = scan  # takes the store lock itself
        self._clock = clock
        self._refresh = threading.Lock()
        # (stats, when its scan started): one attribute, so a reader without the lock never
        # pairs a new dict with an old time
        self._last: tuple[dict, float] | None = None
        self._read_at = float("-inf")  # the last read that took the snapshot as it was
        self._scan_seconds = 0.0

    def get(self, max_age: float = 0.0) -> tuple[dict, float]:
        """A stats dict at most `max_age` seconds old (from the start of its scan), and its
        age. The dict is shared: do not change it."""
        arrived = self._clock()
        last = self._last
        if max_age > 0:
            self._read_at = arrived
            if last is not None and arrived - last[1] <= max_age:
                return last[0], arrived - last[1]
        with self._refresh:
            last = self._last
            if last is not None and last[1] >= arrived - max_age:
                return last[0], max(0.0, self._clock() - last[1])
            return self._refresh_locked(), 0.0

    def refresh_if_read(self, within: float, older_than: float) -> bool:
        """Refresh a snapshot older than `older_than` s when a cached read came in the last
        `within` seconds: keeps a periodic scraper's snapshot young without scanning for
        nobody, and without scanning more often than every `older_than` seconds."""
        now = self._clock()
        last = self._last
        if now - self._read_at > within or (last is not None and now - last[1] < older_than):
            return False
        with self._refresh:
            self._refresh_locked()
        return True

    @property
    def scan_seconds(self) -> float:
        """How long the last scan took (the store lock is held through it)."""
        return self._scan_seconds

    def _refresh_locked(self) -> dict:
        taken = self._clock()
        snapshot = self._scan()
        self._scan_seconds = self._clock() - taken
        self._last = (snapshot, taken)
        return snapshot
