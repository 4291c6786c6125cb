"""Fixed-bucket latency histograms of the server's read, write, trim and zero requests.

The server times each ``pread``/``pwrite``/``trim``/``zero`` store call (the plugin's
callbacks) with ``time.perf_counter`` and calls ``observe``; the ``stats`` control verb returns ``snapshot()`` under the key
``latency``, and ``agentzip-blk metrics`` turns it into Prometheus histograms.

Why fixed buckets kept here (not in the exporter): latency is only visible inside the server,
and a scrape every 15 s cannot sample it. Why so small: it runs on every request of a swap
device, so it is one ``bisect`` over a tuple and two increments under an uncontended lock
(the FUSE front door's workers run requests in parallel, beside nbdkit's thread, and an
increment of a list item is not atomic even under the GIL). The control thread only copies
the lists; a snapshot that is one request stale is harmless. Buckets are non-cumulative
here and made cumulative by the exporter. Failed requests are not observed.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable

# Upper bounds in seconds. A 4 KiB read from the pool is ~20 us, a 1.25 MiB write with zstd
# a few ms, a disk-tier read tens of us to ms: 10 us .. 1 s covers swap-in and swap-out.
BUCKETS: tuple[float, ...] = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0,
)


class Histogram:
    __slots__ = ("counts", "sum", "_lock", "sources")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # last: above the largest bound (+Inf)
        self.sum = 0.0
        self._lock = threading.Lock()
        # requests timed elsewhere, in the same buckets (the native path): () -> (counts, sum)
        self.sources: list[Callable[[], tuple[list[int], float]]] = []

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound falls in that bucket (Prometheus "le")
        i = bisect_left(BUCKETS, seconds)
        with self._lock:
            self.counts[i] += 1
            self.sum += seconds

    def snapshot(self) -> dict:
        counts = list(self.counts)
        total = self.sum
        for source in self.sources:
            more, seconds = source()
            counts = [a + b for a, b in zip(counts, more)]
            total += seconds
        return {"counts": counts, "count": sum(counts), "sum_s": total}


class Latency:
    """One histogram per request kind the plugin times."""

    def __init__(self) -> None:
        self.read = Histogram()
        self.write = Histogram()
        self.trim = Histogram()
        self.zero = Histogram()

    def snapshot(self) -> dict:
        return {"buckets_s": list(BUCKETS), "read": self.read.snapshot(),
                "write": self.write.snapshot(), "trim": self.trim.snapshot(),
                "zero": self.zero.snapshot()}
