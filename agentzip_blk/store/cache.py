"""A bounded LRU of uncompressed copies of blobs, keyed by blob id.

Two uses: hot pages (only pages read twice within `policy.hot_threshold_ms` get in, so a
one-pass swap-in does not churn it), and the last few decompressed multi-page frames (a
swap-in reads a frame's pages one request after another; without the copy every page would
decompress the whole frame again). Bounded by bytes; each entry's Python overhead is
counted with it.
"""

from __future__ import annotations

from collections import OrderedDict

ENTRY_OVERHEAD = 160  # bytes object header + OrderedDict node + key int


class HotCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0  # held, entry overheads included

    def get(self, blob: int) -> bytes | None:
        data = self._entries.get(blob)
        if data is not None:
            self._entries.move_to_end(blob)
        return data

    def put(self, blob: int, data: bytes) -> None:
        cost = len(data) + ENTRY_OVERHEAD
        if cost > self.capacity_bytes:
            return
        self.discard(blob)
        self._entries[blob] = data
        self._bytes += cost
        while self._bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= len(old) + ENTRY_OVERHEAD

    def discard(self, blob: int) -> None:
        data = self._entries.pop(blob, None)
        if data is not None:
            self._bytes -= len(data) + ENTRY_OVERHEAD

    def __contains__(self, blob: int) -> bool:
        return blob in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        return list(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
