"""A store handed from one process to another without copying the pool (issue 28: restart
and upgrade without swapoff).

The pool's arenas already live in a memfd (store.pool); everything else the store holds is
small next to them: `export` writes it into a second memfd, once, and the new process maps
the first and reads the second. What goes over (`Exported`):

- `header`: plain data (JSON): the format version, the layout the store was built with (the
  config keys of LAYOUT_KEYS, and the internal layout: size classes, span, table shapes),
  the scalars and the counters. No secret: the dedup hash seed and the disk tier's key stay
  in the tables memfd, which only the descriptor reaches.
- `fds`: [pool memfd, tables memfd, the disk tier's open file (only with a disk tier)].

The tables memfd holds each array's raw bytes at a page-aligned offset; the header's
`tables` names each one's dtype, shape and offset. Only plain numeric dtypes are accepted
(no object arrays, no pickle: the receiving process executes nothing it reads), and the
receiver maps the memfd and copies from it into its own tables: one copy on each side, not
the four of an np.savez archive (BENCHMARKS.md, "The pool in a memfd"). It is sealed
against any change before it is handed out, and its xxh3-64 is in the header. Caches (hot pages, decoded frames, the
recompressor's queue, the dictionary selector's trials and the trainer's samples) are not
carried: they are rebuilt as requests come.

The store must be quiesced when exported: no request in flight, the maintainer stopped, no
other holder of the lock. The exporter stays intact: if the new process fails, the old one
goes on serving; once it has taken over, the old one calls `PageStore.release()` (never
`close()`, which frees every page). So must a new process that gives up after `adopt`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..codec import codecs
from ..codec.dictionaries.registry import LoadedDict
from ..errors import StoreError
from . import accounting
from .dedup import PageHasher
from .disk import DiskTier
from .pool import IDS, PoolFull
from .slots import CHUNK_SLOTS

# The PageStore handed over: pagestore imports this module (its export and adopt are
# here), so this one names the store's type without importing it back.
PageStore = Any

FORMAT = 1
# Config keys a handover cannot change: they shape the books (the slot table, the frames
# already stored, the pool's classes and span), or name what the books refer to (the tier
# file, the dedup index's presence). Any other key is taken from the new config (levels,
# thresholds, caps that still hold what is there, recompress_cpu, hot cache size,
# warm_algorithm, algorithm: every codec id stays readable; compression.dictionary: the
# dictionaries blobs use are kept for reading, the new setting's are the candidates).
LAYOUT_KEYS: tuple[str, ...] = (
    "device.size",
    "compression.page_size",
    "compression.frame_pages",
    "compression.dedup",
    "pool.swap_out_path",
)
POOL_FD, TABLES_FD, DISK_FD = 0, 1, 2
_TABLES_NAME = "agentzip-tables"
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@dataclass
class Exported:
    """A store as handed over: plain data and descriptors (see the module docstring)."""
    header: dict
    fds: list[int]


def _value(config, key: str) -> Any:
    section, name = key.split(".")
    value = getattr(getattr(config, section), name)
    return list(value) if isinstance(value, (list, tuple)) else value


def layout_of(config, size: int | None = None) -> dict[str, Any]:
    """The LAYOUT_KEYS values of `config` (`size`: the device size the store is built
    with, when it is passed apart from the config, as PageStore.from_config takes it)."""
    layout = {key: _value(config, key) for key in LAYOUT_KEYS}
    if size is not None:
        layout["device.size"] = size
    return layout


def unchangeable(old_config, new_config) -> list[str]:
    """The config keys (LAYOUT_KEYS, in that order) whose values differ between the running
    server's config and the new one: a restart by handover must be refused, naming them."""
    old, new = layout_of(old_config), layout_of(new_config)
    return [key for key in LAYOUT_KEYS if old[key] != new[key]]


def refused(header: dict, config, size: int) -> list[str]:
    """The keys of LAYOUT_KEYS on which `config` (and `size`) differ from the exported
    store's `header`."""
    old, new = header["layout"], layout_of(config, size)
    return [key for key in LAYOUT_KEYS if old.get(key) != new[key]]


def _store_layout(store: PageStore) -> dict[str, Any]:
    """What the store was built with, as the config keys name it."""
    return {
        "device.size": store.size,
        "compression.page_size": store.page_size,
        "compression.frame_pages": store.frame_pages,
        "compression.dedup": "on" if store.placer.dedup else "off",
        "pool.swap_out_path": store.tiering.swap_out_path,
    }


def _setting(setting: str | list[str]) -> str | list[str]:
    return list(setting) if isinstance(setting, (list, tuple)) else setting


def _internal_layout(store: PageStore) -> dict[str, Any]:
    """Shapes that follow from the code as well as the config: an upgrade that changes one
    (new size classes, another slot table) cannot map the old books."""
    pool = store.pool
    return {
        "nslots": store.nslots,
        "classes": [int(c) for c in pool.class_cell],
        "class_arena": [int(c) for c in pool.class_arena],
        "span": int(pool.span),
        "max_blob": pool.max_blob,
        "members_stride": int(store.blobs.members.shape[1]),
        "codec_ids": {str(k): v for k, v in codecs.CODEC_NAMES.items()},
        "chunk_slots": CHUNK_SLOTS,
    }


# -- export -------------------------------------------------------------------------------

def export(store: PageStore) -> Exported:
    hasher = store.placer.hasher
    if not isinstance(hasher, PageHasher):
        raise StoreError("the store's page hash is not the keyed PageHasher: it cannot be "
                         "handed over")
    with store.lock:
        if store.requests_in_flight() or store.objects.decoding:
            raise StoreError("requests in flight: quiesce the store before a handover")
        header, arrays = _snapshot(store, hasher)
        tables_fd, header["tables"], header["tables_xxh3"] = _write_tables(arrays)
        fds = [os.dup(store.pool.memfd), tables_fd]
        if store.disk is not None:
            fds.append(os.dup(store.disk.fd))
    return Exported(header, fds)


def _snapshot(store: PageStore, hasher: PageHasher) -> tuple[dict, dict[str, np.ndarray]]:
    """Under the store lock: the header and every array the tables memfd holds (views of
    the live tables, valid while the lock is held)."""
    slots, pool = store.slots, store.pool
    touched = np.flatnonzero(slots.chunk_touched)
    end = min(store.nslots, (int(touched[-1]) + 1) * CHUNK_SLOTS) if len(touched) else 0
    arrays: dict[str, np.ndarray] = {
        # views of the live tables (written out before the lock is let go); the slots up
        # to the last chunk ever written: the rest are zeros
        "slot_kind": slots.kind[:end], "slot_handle": slots.handle[:end],
        "slot_sub": slots.sub[:end], "slot_rtime": slots.rtime[:end],
        "chunk_live": slots.chunk_live, "chunk_touched": slots.chunk_touched,
        "chunk_written": slots.chunk_written, "slot_state": slots.state,
        "index_fps": store.index.arrays()[0], "index_vals": store.index.arrays()[1],
        "index_state": store.index.state,
        "codec_pages": store.objects.codec_pages,
        "hash_seed": np.array([hasher.seed], dtype=np.uint64),
        **store.blobs.handover_arrays(),
        **{f"pool_{name}": book for name, book in pool.books().items()},
    }
    words, word_arrays = slots.words.handover_state()
    arrays.update(word_arrays)
    disk = None
    if store.disk is not None:
        disk, disk_arrays = store.disk.handover_state()
        arrays.update(disk_arrays)
    registry = store.dicts.registry
    dictionaries = []
    for entry in registry.loaded():
        arrays[f"dict_{entry.id}"] = np.frombuffer(entry.content, dtype=np.uint8).copy()
        dictionaries.append({"id": entry.id, "name": entry.name, "source": entry.source,
                             "info": json.loads(json.dumps(entry.info, default=str)),
                             "candidate": entry.candidate, "kind": entry.kind,
                             "frames": entry.frames})
    rec = store.recompressor
    header = {
        "format": FORMAT,
        "exported_at": time.time(),
        "pid": os.getpid(),
        "layout": _store_layout(store),
        "internal": _internal_layout(store),
        "slots_saved": end,
        "clock_origin": store.clock_origin,
        "tick_base": store.tick_base,
        "counters": dataclasses.asdict(store.counters),
        # the other request path's counters (datapath.native), for its successor to go on from
        "outside": {k: v for k, v in store.outside().items()
                    if isinstance(v, (int, float, str, bool))},
        "recompressor": {"pages_total": rec.pages_total, "cpu_seconds": rec.cpu_seconds,
                         "raced": rec.raced},
        "words": words,
        "blob_capacity": store.blobs.capacity,
        "index": {"capacity": store.index.capacity, "enabled": store.index.enabled},
        "pool": {"allocated": pool.allocated_bytes, "arenas": pool.arena_count,
                 "ids": int(pool.state[IDS])},
        "disk": disk,
        "dictionaries": {
            "setting": _setting(store.dicts.setting),
            "entries": dictionaries,
            "candidates": [e.id for e in registry.candidates],
            "frame_candidates": [e.id for e in registry.frame_candidates],
            "last_id": registry._last_id,  # restored as it was (see _restore_dictionaries)
            "unloaded": registry.unloaded,
        },
    }
    return header, arrays


_TABLE_ALIGN = 4096
_TABLE_KINDS = "biuf"  # bool, signed and unsigned integers, floats: nothing else is read


def _write_tables(arrays: dict[str, np.ndarray]) -> tuple[int, dict[str, list], str]:
    """The arrays in a new memfd, sealed against any change: its descriptor, the index
    ({name: [dtype, shape, offset]}) and the xxh3-64 of its content. Written straight from
    the arrays' buffers (under the store lock: views of the live tables are consistent)."""
    index: dict[str, list] = {}
    at = 0
    for name, array in arrays.items():
        if array.dtype.kind not in _TABLE_KINDS:
            raise StoreError(f"table {name}: dtype {array.dtype} is not plain numbers")
        index[name] = [array.dtype.str, list(array.shape), at]
        at += -(-array.nbytes // _TABLE_ALIGN) * _TABLE_ALIGN
    fd = os.memfd_create(_TABLES_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, at)
        for name, array in arrays.items():
            if not array.nbytes:
                continue
            view = memoryview(np.ascontiguousarray(array)).cast("B")
            done, offset = 0, index[name][2]
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        digest = _digest(fd, at)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, index, digest


def _digest(fd: int, size: int) -> str:
    if not size:
        return xxhash.xxh3_64_hexdigest(b"")
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        return xxhash.xxh3_64_hexdigest(m)


# -- adopt --------------------------------------------------------------------------------

class _Tables:
    """The tables memfd mapped read-only, its arrays as views of the mapping (the restore
    copies them into the store's own tables); `close` unmaps it."""

    def __init__(self, fd: int, index: dict, digest: str) -> None:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _SEALS != _SEALS:
            raise StoreError("the tables handed over are not sealed against change")
        size = os.fstat(fd).st_size
        self._map = (mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                     if size else None)
        try:
            got = xxhash.xxh3_64_hexdigest(self._map if self._map is not None else b"")
            if got != digest:
                raise StoreError("the tables handed over do not match their checksum")
            self.arrays = {name: self._view(name, entry, size) for name, entry in index.items()}
        except BaseException:
            self.close()
            raise

    def _view(self, name: str, entry: list, size: int) -> np.ndarray:
        try:
            dtype, shape, offset = np.dtype(str(entry[0])), tuple(int(n) for n in entry[1]), int(entry[2])
        except (TypeError, ValueError, IndexError) as exc:
            raise StoreError(f"table {name}: a malformed entry ({exc})") from None
        if dtype.kind not in _TABLE_KINDS or dtype.hasobject:
            raise StoreError(f"table {name}: dtype {dtype} is not plain numbers")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count < 0 or offset < 0 or offset % _TABLE_ALIGN or offset + count * dtype.itemsize > size:
            raise StoreError(f"table {name}: outside the tables memfd")
        if not count:
            return np.zeros(shape, dtype=dtype)
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def close(self) -> None:
        self.arrays = {}
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still held somewhere: the collector unmaps it
                pass
            self._map = None


def _check(header: dict, config, size: int) -> None:
    """Refuse, naming the config key, what the new config cannot take."""
    try:
        _check_header(header, config, size)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"store handover: a malformed header ({type(exc).__name__}: "
                         f"{exc})") from None


def _check_header(header: dict, config, size: int) -> None:
    if header.get("format") != FORMAT:
        raise StoreError(f"store handover format {header.get('format')!r}, this server "
                         f"reads {FORMAT}: restart with down/up")
    keys = refused(header, config, size)
    if keys:
        old, new = header["layout"], layout_of(config, size)
        why = "; ".join(f"{key}: {old.get(key)!r} in the running store, {new[key]!r} in "
                        f"the new config" for key in keys)
        raise StoreError(f"cannot change {', '.join(keys)} by a restart ({why}): keep the "
                         f"running value, or use down/up")
    allocated = int(header["pool"]["allocated"])
    if config.pool.max_size < allocated:
        raise StoreError(f"pool.max_size: {config.pool.max_size} is below the {allocated} "
                         f"bytes of arenas the running store holds")
    disk = header.get("disk")
    cap = config.pool.swap_out_max_size
    if disk is not None and cap and cap < int(disk["end"]):
        raise StoreError(f"pool.swap_out_max_size: {cap} is below the {int(disk['end'])} "
                         f"bytes the disk tier uses")


def adopt(cls: type[PageStore], size: int, config, exported: Exported, *, lock=None,
          **kwargs) -> PageStore:
    header, fds = exported.header, list(exported.fds)
    store: PageStore | None = None
    disk: DiskTier | None = None
    tables: _Tables | None = None
    try:
        _check(header, config, size)
        has_disk = header.get("disk") is not None
        if len(fds) != (3 if has_disk else 2):
            raise StoreError(f"store handover: {len(fds)} descriptors, expected "
                             f"{3 if has_disk else 2}")
        tables = _Tables(fds[TABLES_FD], header["tables"], header["tables_xxh3"])
        os.close(fds[TABLES_FD])  # the mapping keeps what it needs
        fds[TABLES_FD] = -1
        arrays = tables.arrays
        if has_disk:
            disk = DiskTier.adopt(fds[DISK_FD], config.pool.swap_out_max_size, header["disk"],
                                  arrays)
            fds[DISK_FD] = -1
        store = cls.from_config(size, config, lock=lock,
                                hasher=PageHasher(int(arrays["hash_seed"][0])),
                                pool_memfd=fds[POOL_FD], disk_tier=disk, **kwargs)
        fds[POOL_FD] = -1  # the store's now: its release() closes it
        disk = None
        internal = _internal_layout(store)
        if internal != header["internal"]:
            diff = sorted(k for k in internal if internal[k] != header["internal"].get(k))
            raise StoreError(f"store layout differs from the running store's "
                             f"({', '.join(diff)}): this version cannot adopt it; use down/up")
        with store.lock:
            _restore(store, header, arrays)
        del arrays
        tables.close()
        return store
    except BaseException:
        if tables is not None:
            tables.close()
        if store is not None:
            store.release()  # never close(): the pages are the old server's still
        if disk is not None:
            disk.release()
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        raise


def _restore(store: PageStore, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Every book of the exported store into `store` (built on its pool memfd), under the
    lock, before any request. Layout checked by the caller."""
    try:
        _restore_books(store, header, arrays)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise StoreError(f"the tables handed over are inconsistent: {exc}") from None
    except PoolFull as exc:  # the kernel refused to map an arena (vm.max_map_count, memory)
        raise StoreError(f"cannot map the pool handed over: {exc}") from None


def _restore_books(store: PageStore, header: dict, arrays: dict[str, np.ndarray]) -> None:
    slots = store.slots
    end = int(header["slots_saved"])
    for name, column in (("slot_kind", slots.kind), ("slot_handle", slots.handle),
                         ("slot_sub", slots.sub), ("slot_rtime", slots.rtime)):
        got = arrays[name]
        if got.dtype != column.dtype or len(got) != end:
            raise ValueError(f"{name}: {got.dtype}[{len(got)}]")
        column[:end] = got
    for name, column in (("chunk_live", slots.chunk_live), ("chunk_touched", slots.chunk_touched),
                         ("chunk_written", slots.chunk_written), ("slot_state", slots.state)):
        got = arrays[name]
        if got.shape != column.shape or got.dtype != column.dtype:
            raise ValueError(f"{name}: {got.dtype}{got.shape}")
        column[:] = got
    slots.words.restore(header["words"], arrays)
    store.blobs.restore(arrays)
    store.index.restore(arrays["index_fps"], arrays["index_vals"], arrays["index_state"])
    codec_pages = arrays["codec_pages"]
    if codec_pages.shape != store.objects.codec_pages.shape:
        raise ValueError(f"codec_pages{codec_pages.shape}")
    store.objects.codec_pages[:] = codec_pages
    pool = store.pool
    pool.adopt({name[len("pool_"):]: a for name, a in arrays.items() if name.startswith("pool_")})
    pool.max_size = store.tiering.max_size  # the new config's cap (checked: it holds them)
    for name, value in header["counters"].items():
        if hasattr(store.counters, name):
            setattr(store.counters, name, value)
    # what the old server's native path counted goes on here (its successor counts from
    # zero): the stats' request counters never go back at a restart
    internal = {stats: name for name, stats in accounting.STATS_NAMES.items()}
    for key in accounting.OUTSIDE_COUNTERS:
        name = internal.get(key, key)
        value = header.get("outside", {}).get(key, 0)
        if hasattr(store.counters, name) and isinstance(value, int):
            setattr(store.counters, name, getattr(store.counters, name) + value)
    rec = store.recompressor
    rec.pages_total = header["recompressor"]["pages_total"]
    rec.cpu_seconds = header["recompressor"]["cpu_seconds"]
    rec.raced = header["recompressor"]["raced"]
    _restore_dictionaries(store, header["dictionaries"], arrays)
    # Ticks go on from the old server's origin: blob and slot ticks are relative to it, and
    # time.monotonic is one clock for every process of the host.
    store._t0 = header["clock_origin"]
    store._tick_base = header["tick_base"]
    store.on_tables_moved()


def _restore_dictionaries(store: PageStore, saved: dict, arrays: dict[str, np.ndarray]) -> None:
    """The registry as it was, content included: blobs name their dictionary by id, and an
    upgrade's shipped file of the same name may differ from the one they were compressed
    with. With another compression.dictionary, or a writer that takes no dictionary (the
    algorithm changed), the old ones are kept for reading only (retired: unloaded once no
    blob uses them) and the new setting's are registered beside them as the candidates."""
    registry = store.dicts.registry
    fresh = registry.loaded()  # the new setting's, as the store was built with it
    same = _setting(store.dicts.setting) == saved["setting"]
    usable = same and store.codecs.writer.id == codecs.ZSTD and store.dicts.setting != "none"
    by_id: dict[int, LoadedDict] = {}
    for e in saved["entries"]:
        content = bytes(arrays[f"dict_{e['id']}"])
        by_id[e["id"]] = LoadedDict(e["id"], e["name"], e["source"], content, e["info"],
                                    e["candidate"] and usable, e["kind"], e["frames"],
                                    registry.level, registry.page_size, registry.frame_pages)
    # No public way to put entries back under their ids (codec/ is not this change's): the
    # registry's own fields, as DictionaryRegistry.add keeps them.
    with registry._lock:
        registry._by_id = by_id
        registry._last_id = int(saved["last_id"])
        registry.unloaded = int(saved["unloaded"])
        registry.candidates = tuple(by_id[i] for i in saved["candidates"]
                                    if usable and i in by_id)
        registry.frame_candidates = tuple(by_id[i] for i in saved["frame_candidates"]
                                          if usable and i in by_id)
    if not same:
        for e in fresh:
            registry.add(e.name, e.content, e.source, e.info, e.candidate, e.kind, e.frames)
    store.share_dictionaries()  # the restored ones, where a crash does not lose them
