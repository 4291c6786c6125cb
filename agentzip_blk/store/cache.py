"""A bounded LRU of uncompressed copies of blobs, keyed by blob id and row generation.

The generation (`blobs.gen`, bumped whenever a row is freed) is part of the key: the native
request path frees blobs without telling these caches, so a copy of a freed blob must never
answer for a new blob in its reused row. Such a copy is simply never found again, and goes
with the least recently used.

Two uses: hot pages (only pages read twice within `policy.hot_threshold_ms` get in, so a
one-pass swap-in does not churn it), and the last few decompressed multi-page frames (a
swap-in reads a frame's pages one request after another; without the copy every page would
decompress the whole frame again). Bounded by bytes; each entry's Python overhead is
counted with it. `drop_idle` lets the frame copies go once their swap-in has passed: they
are counted in the store's memory, and the kernel keeps the pages it read in its swap cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

ENTRY_OVERHEAD = 160  # bytes object header + OrderedDict node + key int


class HotCache:
    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
        self._used: dict[int, float] = {}  # last get or put, by blob
        self._bytes = 0  # held, entry overheads included
        self._clock = clock

    def get(self, blob: int, gen: int) -> bytes | None:
        entry = self._entries.get(blob)
        if entry is None or entry[0] != gen:
            return None
        self._entries.move_to_end(blob)
        self._used[blob] = self._clock()
        return entry[1]

    def put(self, blob: int, gen: int, data: bytes) -> None:
        cost = len(data) + ENTRY_OVERHEAD
        if cost > self.capacity_bytes:
            return
        self.discard(blob)
        self._entries[blob] = (gen, data)
        self._used[blob] = self._clock()
        self._bytes += cost
        while self._bytes > self.capacity_bytes:
            self.discard(next(iter(self._entries)))

    def discard(self, blob: int) -> None:
        entry = self._entries.pop(blob, None)
        if entry is not None:
            self._bytes -= len(entry[1]) + ENTRY_OVERHEAD
            del self._used[blob]

    def drop_idle(self, max_age: float) -> int:
        """Drop the entries not used for `max_age` seconds (least recently used first, so
        the scan stops at the first recent one); the number dropped."""
        cutoff = self._clock() - max_age
        dropped = 0
        while self._entries:
            oldest = next(iter(self._entries))
            if self._used[oldest] > cutoff:
                break
            self.discard(oldest)
            dropped += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._used.clear()
        self._bytes = 0

    def __contains__(self, blob: int) -> bool:
        return blob in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        return list(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
