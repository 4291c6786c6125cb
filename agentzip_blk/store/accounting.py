"""What the store holds and what it costs: stats, metadata bytes, temperature, per-slot sizes
for per-cgroup accounting, and `check`, the cross-check of every book (for tests).

Memory is counted as the kernel counts it: the big preallocated tables cost the pages
actually touched, not their mappings. The caller holds the store lock, except for `stats`,
which takes it for what it copies and counts after.

Each function takes the store's parts (parts.StoreParts), not the store, and what else it
reads as an argument: `outside`, the counters of another request path over the same books
(PageStore.outside, a callable: the native path sets it after the store is built), the
recompressor and the reclaim threshold.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..codec import codecs
from .blobs import DISK, POOL, WARM
from .dedup import SUB_BITS
from .disk import ALLOC_STEP
from .slots import BLOB, EMPTY
from .tables import array_resident_bytes

if TYPE_CHECKING:
    from collections.abc import Callable

    from .parts import StoreParts
    from .recompress import Recompressor


def meta_parts(parts: StoreParts) -> dict[str, int]:
    """Everything held in memory besides pool arenas, by part. The dedup index counts its
    resident pages (mincore): it is sized for the pages stored, not the device."""

    def resident(arrays) -> int:
        return sum(array_resident_bytes(a) for a in arrays)

    return {
        "slot_table": parts.slots.touched_bytes(),
        "blob_table": parts.blobs.used_bytes,
        "dedup_index": resident(parts.index.arrays()),
        "codecs": parts.codecs.memory_bytes()
        + (parts.frame_codec.memory_bytes() if parts.frame_codec else 0)
        + (parts.warm_codec.memory_bytes() if parts.warm_codec else 0),
        "pool_books": parts.pool.meta_bytes(),
        "disk_books": parts.disk.meta_bytes() if parts.disk else 0,
    }


def stored_mem(parts: StoreParts, meta_bytes: int,
               outside: Callable[[], dict[str, int]]) -> int:
    """Pool pages touched, metadata, and the decoded copies held (ours, and the native
    path's frame cache: `outside`)."""
    held_outside = outside().get("frame_cache_bytes", 0)
    return parts.pool.resident_bytes + meta_bytes + parts.objects.cache_bytes() + held_outside


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


def _freeze(parts: StoreParts) -> _Frozen:
    slots, blobs = parts.slots, parts.blobs
    held = slots.blob_slots()
    rows = blobs.rows
    return _Frozen(
        held=held, slot_blobs=slots.handle[held].astype(np.int64), subs=slots.sub[held],
        returned=slots.rtime[held] != 0, live=blobs.ref[:rows] > 0,
        tier=blobs.tier[:rows].copy(), length=blobs.length[:rows].astype(np.int64),
        pages=blobs.pages[:rows].copy(), form=blobs.form[:rows].copy(),
        atime=blobs.atime[:rows].astype(np.int64), rtime=blobs.rtime[:rows].copy(),
        ref=blobs.ref[:rows].copy(), now=parts.now(),
        hot=np.array(parts.objects.hot.keys(), dtype=np.int64))


def stats(parts: StoreParts, *, recompressor: Recompressor, reclaim_bytes: int,
          outside: Callable[[], dict[str, int]]) -> dict:
    """Every figure of the `stats` verb: what must agree is read under the store lock, the
    counting is done after it."""
    page = parts.page_size
    with parts.lock:
        if parts.disk is not None:
            parts.disk.settle()  # extents the native writes freed, into the tier's books
        frozen = _freeze(parts)
        codec_pages = parts.objects.codec_pages.copy()
        same_pages = parts.slots.same_pages
        meta = meta_parts(parts)
        meta_bytes = sum(meta.values())
        stored = stored_mem(parts, meta_bytes, outside)
        dictionaries = parts.dicts.stats(parts.blobs, frozen.slot_blobs, page)
        pool, disk = parts.pool, parts.disk
        figures = {
            "unique_blobs": parts.blobs.count,
            "dedup_unindexed": parts.index.unindexed,  # pages left out of the index (dedup.py)
            "pool_bytes": pool.allocated_bytes,
            "pool_resident_bytes": pool.resident_bytes,
            "pool_live_bytes": pool.live_bytes,
            "pool_arenas": pool.arena_count,
            "fragmentation": round(pool.fragmentation(), 4),
            "hot_cache_bytes": (parts.objects.cache_bytes()
                                + outside().get("frame_cache_bytes", 0)),
            "max_size": pool.max_size,
            "reclaim_bytes": reclaim_bytes,
            "disk_mem": disk.file_size if disk else 0,
        }
        disk_figures = {"file_bytes": disk.file_size if disk else 0,
                        "reads": disk.reads if disk else 0,
                        "writes": disk.writes if disk else 0}
        counters = _counters(parts, outside)
        recompress = {"recompressed_pages_total": parts.counters.recompressed_pages,
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
        "size": parts.slots.nslots * page,
        "slots": parts.slots.nslots,
        "page_size": page,
        "algorithm": parts.codecs.writer.name,
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
        "dedup": parts.placer.dedup,
        "dedup_unindexed": figures.pop("dedup_unindexed"),
        # frames: "unit" is their name in the stats interface (docs/JSON.md)
        "unit_pages": parts.frame_pages,
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
        "temperature": _temperature(parts, frozen),
        **_forms(parts, frozen, same_pages, recompressor.enabled),
        **recompress,
        **counters,
    }


def _counters(parts: StoreParts, outside: Callable[[], dict[str, int]]) -> dict:
    """The request counters under their stats names, with the requests another request path
    served from the same tables (`outside`: the native path's)."""
    counters = {STATS_NAMES.get(k, k): v for k, v in asdict(parts.counters).items()}
    served = outside()
    for key in OUTSIDE_COUNTERS:
        counters[key] += served.get(key, 0)
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


def _forms(parts: StoreParts, f: _Frozen, same_pages: int, recompressing: bool) -> dict:
    """Pages and stored bytes of each form (docs/JSON.md), from the slots holding blobs:
    warm (alone, fast codec) and cold (dense) in the pool, on disk, same-filled; they add
    up to `pages`. Stored bytes are the blobs' compressed lengths (a shared blob once)."""
    page = parts.page_size
    in_pool = f.tier[f.slot_blobs] == POOL
    warm_slot = f.form[f.slot_blobs] == WARM
    warm_pages = int(np.count_nonzero(in_pool & warm_slot))
    pool_pages = int(np.count_nonzero(in_pool))
    pool_blobs = f.live & (f.tier == POOL)
    warm_stored = int(f.length[pool_blobs & (f.form == WARM)].sum())
    cold_stored = int(f.length[pool_blobs & (f.form != WARM)].sum())
    cold_pages = pool_pages - warm_pages
    # the recompressor's backlog (Recompressor.backlog), from the same copy
    due = pool_blobs & (f.form == WARM) & ((f.now - f.atime >= parts.cold_ticks) | (f.rtime > 0))
    backlog = int(f.ref[due].astype(np.int64).sum()) if recompressing else 0
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


def _temperature(parts: StoreParts, f: _Frozen) -> dict:
    """Pages by temperature: hot (in the hot cache), warm (accessed within
    warm_threshold_ms), cold (untouched for cold_grace_period), idle (in between)."""
    if not len(f.slot_blobs):
        return {"hot": 0, "warm": 0, "idle": 0, "cold": 0}
    age = f.now - f.atime[f.slot_blobs]
    in_cache = np.isin(f.slot_blobs, f.hot)
    warm = ~in_cache & (age <= parts.warm_ticks)
    cold = ~in_cache & (age >= parts.cold_ticks)
    hot = int(in_cache.sum())
    return {
        "hot": hot,
        "warm": int(warm.sum()),
        "idle": len(f.slot_blobs) - hot - int(warm.sum()) - int(cold.sum()),
        "cold": int(cold.sum()),
    }


def slot_sizes(parts: StoreParts, slots) -> dict:
    """What the given slots cost, for per-cgroup accounting: per slot the stored bytes
    (a shared blob's length divided by its refcount; 0 for same-filled and empty slots),
    whether it holds data, and its tier. Slots outside the device are reported as empty."""
    slots = np.asarray(slots, dtype=np.int64)
    valid = (slots >= 0) & (slots < parts.slots.nslots)
    idx = np.where(valid, slots, 0)
    blobs = parts.blobs
    kinds = np.where(valid, parts.slots.kind[idx], EMPTY)
    blob_ids = np.where(kinds == BLOB, parts.slots.handle[idx].astype(np.int64), 0)
    lengths = blobs.length[blob_ids].astype(np.float64)
    refs = np.maximum(blobs.ref[blob_ids].astype(np.float64), 1)
    stored = np.where(kinds == BLOB, lengths / refs, 0.0)
    tiers = np.where(kinds == BLOB, blobs.tier[blob_ids], POOL)
    return {
        "kind": kinds.astype(int).tolist(),
        "stored": np.round(stored, 1).tolist(),
        "tier": tiers.astype(int).tolist(),
    }


def check(parts: StoreParts) -> None:
    """Cross-check every invariant of the books; raises AssertionError."""
    blobs, slots, pool = parts.blobs, parts.slots, parts.pool
    if parts.disk is not None:
        parts.disk.settle()
    idx = slots.touched()  # a chunk never written holds nothing, and is never read
    kind = slots.kind[idx]
    held = idx[kind == BLOB]
    blob_slots = slots.handle[held].astype(np.int64)
    refs = np.bincount(blob_slots, minlength=blobs.capacity)[: blobs.capacity]
    assert np.array_equal(refs, blobs.ref.astype(np.int64)), "refcounts disagree"
    assert blobs.count == int(np.count_nonzero(refs)), "blob count disagrees"
    live = blobs.live()
    assert parts.index.count + parts.index.unindexed == int(
        blobs.pages[live].astype(np.int64).sum()), "index and blob table disagree"
    assert parts.index.unindexed >= 0
    assert (slots.sub[held] < blobs.pages[blob_slots]).all(), "slot names a missing page"
    assert not slots.sub[idx[kind != BLOB]].any()
    slots.check()
    assert int(parts.objects.codec_pages.sum()) == len(blob_slots)
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
    if parts.disk is not None:
        sealed = blobs.length[on_disk].astype(np.int64) + parts.disk.overhead  # nonce + tag
        extents = (-(-sealed // ALLOC_STEP) * ALLOC_STEP).sum()
        assert parts.disk.live_bytes == int(extents), "disk extents leak"
        parts.disk.check()
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
