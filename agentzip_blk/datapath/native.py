"""The native request path: the C extension (`nativeloop.c`) and how the server uses it.

docs/ARCHITECTURE.md, "The native request path", says what it serves and how it shares the
store's tables. This module decides whether it runs (`device.datapath`), builds the lock
the store uses, binds the tables and keeps the binding current, and reports what it did.
Where the extension was not built, `device.datapath: auto` serves every request in Python
and `native` is refused with one line saying why.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..codec import codecs
from ..store import PageStore, integrity
from ..store.dedup import MAX_BLOBS, PageHasher
from .latency import BUCKETS

try:
    from . import nativeloop
except ImportError as exc:  # not built (no compiler or headers at install time)
    nativeloop = None
    MISSING = f"the native request path is not built ({exc})"
else:
    MISSING = ""


class NativeUnavailable(RuntimeError):
    """`device.datapath: native` where the extension is missing, or the store cannot use it."""


@dataclass(frozen=True)
class Choice:
    """Which request path serves, and why (for `doctor`, `status` and the log)."""
    path: str  # "native" or "python"
    reason: str


def available() -> bool:
    return nativeloop is not None


def choose(setting: str) -> Choice:
    """The path for `device.datapath`; NativeUnavailable for `native` without the extension."""
    if setting == "python":
        return Choice("python", "device.datapath: python")
    if nativeloop is None:
        if setting == "native":
            raise NativeUnavailable(f"device.datapath: native, but {MISSING}; rebuild the "
                                    f"package (./setup.sh) or set device.datapath: python")
        return Choice("python", MISSING)
    return Choice("native", f"device.datapath: {setting}")


def make_lock(choice: Choice):
    """The store's lock: the extension's mutex for the native path, else threading.Lock."""
    if choice.path == "native":
        return nativeloop.StoreLock()
    return threading.Lock()


class NativePath:
    """The extension's worker loop bound to one store (whose lock is a StoreLock)."""

    def __init__(self, store: PageStore) -> None:
        if nativeloop is None:
            raise NativeUnavailable(MISSING)
        if not isinstance(store.lock, nativeloop.StoreLock):
            raise NativeUnavailable("the store was not built with the native path's lock")
        if store.clock is not time.monotonic:
            # the extension reads CLOCK_MONOTONIC, which is what time.monotonic reads
            raise NativeUnavailable("the store's clock is not time.monotonic")
        self.store = store
        self._path = nativeloop.Path(store.lock, store.size, store.clock_origin, list(BUCKETS),
                                  integrity.CHECKSUMS)
        self.writes = writes_served(store)
        self.packs = packs_served(store)
        with store.lock:
            store.on_tables_moved = self._bind
            store.outside = self.counters
            store.outside_drop_idle = self._path.drop_idle
            self._bind()
            placer = store.placer
            self._path.set_writes(
                enabled=self.writes, dedup=placer.dedup,
                seed=placer.hasher.seed if isinstance(placer.hasher, PageHasher) else 0,
                hot_ticks=store.hot_ticks, reclaim_bytes=store.reclaim_bytes,
                max_blobs=MAX_BLOBS, doorbell=store.doorbell.fd,
                dense=store.warm_codec is None, frame_pages=store.frame_pages,
                level=store.codecs.writer.level if self.writes and store.warm_codec is None
                else 3)
            if store.disk is not None:
                self._path.set_disk(fd=store.disk.fd, key=store.disk.key())
                store.disk.freed_outside = self._path.take_disk_frees
            self._follow_dictionaries()
            if self.packs:
                self._path.set_packing(store.frame_pages, store.codecs.writer.level)
                store.recompressor.native_pack = self.pack

    def _follow_dictionaries(self) -> None:
        """Every dictionary blobs may name, now and as the registry adds and unloads them,
        for the native reads (their content stays referenced here: the extension reads it
        in place for as long as it lives)."""
        registry = self.store.dicts.registry
        self._dict_contents: list[bytes] = []
        for entry in registry.loaded():
            self._add_dictionary(entry)
        self._added, self._unloaded = registry.on_added, registry.on_unloaded

        def added(entry) -> None:
            self._added(entry)
            self._add_dictionary(entry)

        def unloaded(dict_id: int) -> None:
            self._unloaded(dict_id)
            self._path.set_dictionary(dict_id, None, False)

        registry.on_added, registry.on_unloaded = added, unloaded

    def _add_dictionary(self, entry) -> None:
        content = bytes(entry.content)
        self._dict_contents.append(content)
        self._path.set_dictionary(entry.id, content, entry.kind == "full")

    def _bind(self) -> None:
        """Under the store lock: the tables' current addresses and tick base."""
        self._path.bind(self.store.columns(), self.store.tick_base, self.store.frame_pages)

    def close(self) -> None:
        """Stop serving from the tables (every request is handed up from now on)."""
        with self.store.lock:
            self._path.unbind()
            self.store.on_tables_moved = lambda: None
            self.store.outside_drop_idle = lambda seconds: None
            self.store.recompressor.native_pack = None
            if self.store.disk is not None:
                self.store.disk.settle()
                self.store.disk.freed_outside = list
            registry = self.store.dicts.registry
            registry.on_added, registry.on_unloaded = self._added, self._unloaded

    def serve(self, fd: int, rbuf, wbuf, epfd: int = -1, stop=None) -> int:
        """Serve requests from `fd` until one needs Python: its length (it is in `rbuf`),
        0 at end of file, or -errno when read(2) failed. With `epfd` and `stop` (a
        non-blocking `fd`, datapath.fuse): an empty queue waits in epoll_wait(epfd), and
        -ECANCELED is returned, before another request is read, once stop[0] is set."""
        if stop is None:
            return self._path.serve(fd, rbuf, wbuf)
        return self._path.serve(fd, rbuf, wbuf, epfd, stop)

    def serve_writes(self, fd: int, rbuf, wbuf, stop) -> int | None:
        """A writer thread's loop (docs/ARCHITECTURE.md, "Reads before writes"): serves
        the writes the workers queued, in order; returns the length of one that needs
        Python (it is in `rbuf`), or -ECANCELED once stop[0] is set and the queue is empty.
        None when this store's writes are not served natively (no writer is needed)."""
        if not self.writes:
            return None
        return self._path.serve_writes(fd, rbuf, wbuf, stop)

    def pack(self, blobs, gens, slots) -> tuple[int, int, int, int, bool]:
        """The recompressor's pass over warm blobs held by one slot each (store.recompress):
        (switched, raced, kept, bad, room). Takes the store lock itself."""
        return self._path.pack(blobs.tobytes(), gens.tobytes(), slots.tobytes())

    def counters(self) -> dict:
        """What it served (reads, writes, their pages and bytes, the dedup and ping-pong
        counts of its writes), requests handed up (`handed_up`, and `handed_up_by` reason),
        in_flight, reply_errors, and the latency histograms."""
        return self._path.counters()

    def read_latency(self) -> tuple[list[int], float]:
        """The native reads' latency histogram (latency.BUCKETS) and its sum in seconds."""
        return self._path.counters()["read_latency"]

    def write_latency(self) -> tuple[list[int], float]:
        return self._path.counters()["write_latency"]


def packs_served(store: PageStore) -> bool:
    """Whether the native path packs this store's warm pages (store.recompress): they are
    lz4 or raw (what it decodes), and frames are zstd (what it writes, without a
    dictionary: in frames the dictionaries measured 0-0.5%, BENCHMARKS.md "Dictionaries in
    frames")."""
    warm = store.warm_codec
    return (warm is not None and warm.id == codecs.LZ4
            and store.codecs.writer.id == codecs.ZSTD)


def writes_served(store: PageStore) -> bool:
    """Whether the native path stores this store's writes, as nativestore.c writes them:
    warm pages lz4 at the default acceleration (warm_algorithm: lz4), or frames at once
    (warm_algorithm: none) with zstd, no dictionary (in frames the dictionaries measured
    0-0.5%, BENCHMARKS.md "Dictionaries in frames"); and pages hashed with the store's keyed
    hash (a test's weak hasher is Python's alone). Otherwise every write is handed up."""
    warm = store.warm_codec
    if warm is None:
        if store.codecs.writer.id != codecs.ZSTD:
            return False
    elif warm.id != codecs.LZ4 or getattr(warm, "acceleration", None) != 1:
        return False
    return not store.placer.dedup or isinstance(store.placer.hasher, PageHasher)
