"""The parts of one store, as the modules that work on its books beside the request path
get them: the tiers (`tiering`), the recompressor (`recompress`) and the accounting.

PageStore builds one StoreParts when it is made and hands it to each of them, instead of
itself: so none of them imports or types against pagestore, and none can call back into
the facade (issue 30). What they need of the facade beyond its parts comes as an argument
of its own (a callable where it changes after the store is built, e.g. the native path's
counters), and the order of the maintainer's steps is PageStore.maintain's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager

if TYPE_CHECKING:
    from ..codec.codecs import Codec, CodecSet, PooledCodec
    from ..codec.dictionaries import StoreDictionaries
    from .blobs import BlobTable
    from .dedup import DedupIndex
    from .disk import DiskTier
    from .doorbell import Doorbell
    from .objects import Counters, Objects
    from .placement import Placer
    from .pool import Pool
    from .slots import SlotTable


@dataclass(frozen=True)
class StoreParts:
    """One store's tables, pool, tiers, codecs, lock and clock. Frozen: each part is built
    once with the store and never replaced (a table that grows replaces its arrays, not
    itself), so a holder never sees a part the store no longer uses. The lock is the one
    the store was built with (`PageStore(lock=...)`)."""

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
    frame_codec: PooledCodec | None
    warm_codec: Codec | PooledCodec | None
    dicts: StoreDictionaries
    counters: Counters
    # threading.Lock, or the native path's StoreLock (pagestore.StoreLock)
    lock: ContextManager
    now: Callable[[], int]  # the store's tick (PageStore.now: >= 1, rebased when due)
    warm_ticks: int  # policy.warm_threshold_ms in ticks
    cold_ticks: int  # policy.cold_grace_period in ticks
    doorbell: Doorbell  # rung when the store needs its maintainer now
