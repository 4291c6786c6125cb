"""A bounded LRU of uncompressed copies of hot pages, keyed by blob id.

Only pages read twice within `policy.hot_threshold_ms` get in, so a one-pass swap-in does
not churn it. Bounded by bytes; each entry's Python overhead is counted with it.
"""

from __future__ import annotations

from collections import OrderedDict

ENTRY_OVERHEAD = 160  # bytes object header + OrderedDict node + key int


class HotCache:
    def __init__(self, capacity_bytes: int, page_size: int = 4096) -> None:
        self.max_entries = capacity_bytes // (page_size + ENTRY_OVERHEAD)
        self.page_size = page_size
        self._entries: OrderedDict[int, bytes] = OrderedDict()
        self.hits = 0
        self.inserts = 0

    def get(self, blob: int) -> bytes | None:
        data = self._entries.get(blob)
        if data is not None:
            self._entries.move_to_end(blob)
            self.hits += 1
        return data

    def put(self, blob: int, data: bytes) -> None:
        if self.max_entries <= 0:
            return
        self._entries[blob] = data
        self._entries.move_to_end(blob)
        self.inserts += 1
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def discard(self, blob: int) -> None:
        self._entries.pop(blob, None)

    def __contains__(self, blob: int) -> bool:
        return blob in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        return list(self._entries)

    @property
    def nbytes(self) -> int:
        return len(self._entries) * (self.page_size + ENTRY_OVERHEAD)
