"""The cached stats snapshot (store.accounting.StatsCache): readers that accept an old one
scan nothing while it is young; concurrent readers share one scan; the maintainer refreshes
it only while someone reads it."""

from __future__ import annotations

import threading
import time

from agentzip_blk.store import PageStore
from agentzip_blk.store.accounting import StatsCache

PAGE = 4096


class SlowScan:
    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        time.sleep(self.seconds)
        return {"scan": self.calls}


def storm(cache: StatsCache, n: int, max_age: float) -> list[tuple[dict, float]]:
    go = threading.Barrier(n)
    out: list[tuple[dict, float]] = []
    lock = threading.Lock()

    def one() -> None:
        go.wait()
        got = cache.get(max_age)
        with lock:
            out.append(got)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_fresh_readers_share_scans():
    scan = SlowScan()
    cache = StatsCache(scan, time.monotonic)
    replies = storm(cache, 50, 0.0)
    assert len(replies) == 50
    # the first scan, and one more for those that came after it had started
    assert scan.calls <= 2


def test_cached_readers_scan_nothing_while_young():
    scan = SlowScan(0.0)
    cache = StatsCache(scan, time.monotonic)
    cache.get(0.0)
    replies = storm(cache, 50, 60.0)
    assert scan.calls == 1
    assert all(r[0] == {"scan": 1} and 0 <= r[1] <= 60.0 for r in replies)


def test_an_old_snapshot_is_refreshed_once():
    now = [100.0]
    scan = SlowScan(0.0)
    cache = StatsCache(scan, lambda: now[0])
    cache.get(5.0)
    now[0] += 6
    assert cache.get(5.0) == ({"scan": 2}, 0.0)
    now[0] += 1
    assert cache.get(5.0) == ({"scan": 2}, 1.0)


def test_maintainer_refreshes_only_while_read():
    now = [0.0]
    scan = SlowScan(0.0)
    cache = StatsCache(scan, lambda: now[0])
    assert not cache.refresh_if_read(60.0, 2.0)  # nobody reads cached stats: no scan
    assert scan.calls == 0
    cache.get(5.0)
    now[0] += 1
    assert not cache.refresh_if_read(60.0, 2.0)  # young enough: no scan
    now[0] += 9
    assert cache.refresh_if_read(60.0, 2.0) and scan.calls == 2
    now[0] += 61
    assert not cache.refresh_if_read(60.0, 2.0)


def test_store_snapshot_matches_the_exact_stats():
    st = PageStore(64 * PAGE, max_size=16 << 20)
    st.write(bytes(range(256)) * 16 * 4, 0)
    cached, age = st.cached_stats(0.0)
    assert cached == st.stats() and age == 0.0
    st.write(b"\1" * PAGE, 10 * PAGE)
    assert st.cached_stats(60.0)[0]["pages"] == 4  # young enough: the old one
    assert st.cached_stats(0.0)[0]["pages"] == 5  # taken after the request came
