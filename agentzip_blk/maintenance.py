"""The background worker: demotes cold pages and compacts the pool, off the request path.

The store wakes it when a write leaves the pool above its reclaim threshold; otherwise it
looks every `interval` seconds. Each round works in chunks that take the store lock briefly,
so requests interleave with it.
"""

from __future__ import annotations

import threading

from .store import PageStore


class Maintainer:
    def __init__(self, store: PageStore, interval: float = 1.0, log=None) -> None:
        self.store = store
        self.interval = interval
        self.log = log or (lambda msg: None)
        self.rounds = 0
        self.last_error: str | None = None
        self._event = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentzip-maintain", daemon=True)

    def start(self) -> None:
        self.store.wake = self._event.set
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._event.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._event.wait(self.interval)
            self._event.clear()
            if self._stop.is_set():
                return
            try:
                result = self.store.maintain()
            except Exception as exc:  # keep serving; the error shows in stats
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.log(f"agentzip: maintenance failed: {self.last_error}")
                continue
            self.rounds += 1
            if result["demoted"] or result["compacted"] or result["units_rewritten"]:
                self.log(f"agentzip: demoted {result['demoted']} pages, compacted "
                         f"{result['compacted']}, rewrote {result['units_rewritten']} sparse units")
