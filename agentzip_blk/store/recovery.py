"""A store rebuilt from the memory of a server that died (issue 28: a crash loses nothing
the store had committed; docs/ARCHITECTURE.md "Recovery from a crash").

What the dead server left is what its holder kept: the pool's memfd, the shared tables
(store.shared: the slot table's kind/handle/sub, the blob rows, the same-fill words, the two
announced switches), the disk tier's descriptor and key, the dictionaries. The rest is
rebuilt here from those: reference counts, the free row list, the pool's books and free
lists, the chunk books, the word counts, the codec counts, the disk tier's free map. The
dedup index starts empty (its entries are counted as left out, and pages written from now
on are indexed as ever): a page written again after the crash is stored anew once.

A SIGKILL stops the server between any two stores, and at most one holder of the store
lock was changing the books then. What that can leave, and what is done with it:

- a switch announced in `slot_switch` or `blob_move` and not finished: finished (the new
  blob or cell was whole before the announcement);
- rows moved down by a renumbering whose slots were not all re-pointed yet: two identical
  rows at one location; the slots go to the lower one;
- a request's own half-done work (a slot released, a row freed, a cell given back, a blob
  staged that no slot names yet): the request was not answered, so the kernel sends it
  again (FUSE_NOTIFY_RESEND) and it overwrites those slots. A slot whose row no longer makes
  sense is emptied (`Repair.slots_emptied`); a row that no slot names is freed.

The store is built on new shared tables (the old ones stay as they were until the new
server has committed its own to the holder: a recovery that fails can be tried again from
the same state). `PageStore.check` runs on the result before the first request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StoreError
from . import integrity
from .blobs import DISK, MOVE_ARENA, MOVE_BLOB, MOVE_CELL, MOVE_ON, NEXT_UNUSED, POOL
from .disk import ALLOC_STEP, SEAL_OVERHEAD, TIER_HEADER, DiskTier
from .shared import (
    SWITCH_HANDLE,
    SWITCH_ON,
    SWITCH_SLOT,
    SWITCH_SUB,
    map_column,
    read_bytes,
)
from .slots import BLOB, CHUNK_SLOTS, EMPTY, MAX_WORDS, SAME

PageStore = Any  # the facade imports this module; this one names its type only

POOL_NAME = "pool"  # the held pool memfd
DISK_NAME = "disk"  # the held disk tier descriptor
DISK_KEY = "disk_key"
DICT_PREFIX = "dict_"


@dataclass
class Held:
    """What a holder kept: descriptors by name, each with its metadata (store.shared)."""
    fds: dict[str, int]
    metas: dict[str, dict]


@dataclass
class Repair:
    """What recovery found and did (counted, for the log, `status` and the tests)."""
    slots: int = 0  # slots in use after the repair
    blobs: int = 0
    switches_finished: int = 0  # announced switches (slot or cell) finished
    duplicate_rows: int = 0  # rows of an unfinished renumbering merged into their twin
    slots_emptied: int = 0  # slots whose row made no sense (a request the kernel resends)
    rows_freed: int = 0  # rows no slot named (staged, or freed by a request)
    arenas: int = 0
    disk_blobs: int = 0


def _column(held: Held, name: str) -> np.ndarray:
    if name not in held.fds:
        raise StoreError(f"recovery: the holder has no {name}")
    meta = held.metas.get(name, {})
    try:
        return map_column(held.fds[name], str(meta["dtype"]), int(meta["width"]),
                          bool(meta["matrix"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"recovery: {name}: {exc}") from None


def recover(cls: type[PageStore], size: int, config, held: Held, *, lock=None,
            **kwargs) -> tuple[PageStore, Repair]:
    """The store of the server that died, for `config` (the same layout), rebuilt from
    `held`. The descriptors stay the caller's (they are duplicated where kept)."""
    page = config.compression.page_size
    nslots = size // page
    frame_pages = config.compression.frame_pages
    kind = _column(held, "slot_kind")[:nslots].copy()
    handle = _column(held, "slot_handle")[:nslots].astype(np.int64)
    sub = _column(held, "slot_sub")[:nslots].astype(np.int64)
    if len(kind) != nslots or len(handle) != nslots or len(sub) != nslots:
        raise StoreError(f"recovery: the slot table held is shorter than device.size "
                         f"({len(kind)} slots, {nslots} expected): same config as the dead "
                         f"server, or down --force")
    members = _column(held, "blob_members")
    if members.ndim != 2 or members.shape[1] != frame_pages:
        raise StoreError(f"recovery: compression.frame_pages {frame_pages} differs from the "
                         f"dead server's ({members.shape[1] if members.ndim == 2 else '?'})")
    state = _column(held, "blob_state")
    cols = {name: _column(held, f"blob_{name}") for name in
            ("arena", "cell", "tier", "disk_off", "length", "pages", "codec", "dict_id",
             "gen", "csum", "form")}
    rows = min([int(state[NEXT_UNUSED])] + [len(c) for c in cols.values()] + [len(members)])
    rows = max(rows, 0)
    blob = {name: c[:rows].copy() for name, c in cols.items()}
    members = members[:rows].copy()
    words = _column(held, "words")[:MAX_WORDS].copy()
    repair = Repair()

    # 1. the announced switches, finished
    switch = _column(held, "slot_switch")
    if len(switch) >= 4 and switch[SWITCH_ON]:
        s = int(switch[SWITCH_SLOT])
        if 0 <= s < nslots:
            handle[s], sub[s] = int(switch[SWITCH_HANDLE]), int(switch[SWITCH_SUB])
            repair.switches_finished += 1
    move = _column(held, "blob_move")
    if len(move) >= 4 and move[MOVE_ON]:
        b = int(move[MOVE_BLOB])
        if 0 <= b < rows:
            blob["arena"][b], blob["cell"][b] = int(move[MOVE_ARENA]), int(move[MOVE_CELL])
            repair.switches_finished += 1

    # 2. slots that name no sensible row are emptied (a request in flight: resent)
    is_blob = kind == BLOB
    ok = (handle >= 0) & (handle < rows)
    h = np.where(is_blob & ok, handle, 0)
    if rows:
        ok &= sub < blob["pages"][h].astype(np.int64)
        ok &= blob["pages"][h] >= 1
        ok &= (blob["length"][h] >= 1)
        on_pool = blob["tier"][h] == POOL
        ok &= np.where(on_pool, blob["arena"][h] >= 0, blob["tier"][h] == DISK)
        ok &= np.where(blob["tier"][h] == DISK, blob["disk_off"][h] >= len(TIER_HEADER), True)
    bad = is_blob & ~ok
    same = kind == SAME
    bad_same = same & ((handle < 0) | (handle >= MAX_WORDS) | ((handle > 0) &
                       (words[np.clip(handle, 0, MAX_WORDS - 1)] == 0)))
    bad |= bad_same
    bad |= ~np.isin(kind, (EMPTY, SAME, BLOB))
    repair.slots_emptied += int(np.count_nonzero(bad & (kind != EMPTY)))
    kind[bad] = EMPTY
    handle[kind == EMPTY] = 0
    sub[kind != BLOB] = 0

    # 3. the disk tier: its free map is what no live extent covers
    disk = None
    if DISK_NAME in held.fds:
        key = read_bytes(held.fds[DISK_KEY]) if DISK_KEY in held.fds else None
        path = held.metas.get(DISK_NAME, {}).get("path") or config.pool.swap_out_path
        live_rows = np.unique(handle[kind == BLOB])
        on_disk = live_rows[blob["tier"][live_rows] == DISK]
        overhead = SEAL_OVERHEAD if key is not None else 0
        extents = _disk_extents(on_disk, blob, overhead)
        kept, dropped = _no_overlap(extents)
        if dropped:
            gone = np.isin(handle, dropped) & (kind == BLOB)
            repair.slots_emptied += int(np.count_nonzero(gone))
            kind[gone], handle[gone], sub[gone] = EMPTY, 0, 0
        disk = DiskTier.recover(os.dup(held.fds[DISK_NAME]), path,
                                config.pool.swap_out_max_size, key, kept)
        repair.disk_blobs = len(kept)
    elif rows and bool(np.any(blob["tier"][np.unique(handle[kind == BLOB])] == DISK)):
        raise StoreError("recovery: blobs are on a disk tier that the holder does not have")

    store = cls.from_config(size, config, lock=lock, pool_memfd=os.dup(held.fds[POOL_NAME]),
                            disk_tier=disk, **kwargs)
    try:
        _restore_dictionaries(store, held)
        with store.lock:
            _rebuild(store, repair, kind, handle, sub, words, blob, members, rows,
                     _column(held, "blob_ref")[:rows] > 0)
        store.check()
    except BaseException:
        store.release()
        raise
    return store, repair


def _disk_extents(rows: np.ndarray, blob: dict[str, np.ndarray], overhead: int) -> np.ndarray:
    sealed = blob["length"][rows].astype(np.int64) + overhead
    size = -(-sealed // ALLOC_STEP) * ALLOC_STEP
    return np.stack([blob["disk_off"][rows].astype(np.int64), size, rows.astype(np.int64)],
                    axis=1) if len(rows) else np.zeros((0, 3), dtype=np.int64)


def _no_overlap(extents: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(offset, size) of the extents kept, and the rows of those that overlap a kept one
    (never seen: a freed extent is punched before it is handed out again)."""
    kept, dropped = [], []
    end = 0
    for offset, size, row in sorted(extents.tolist()):
        if offset < end:
            dropped.append(row)
            continue
        kept.append((offset, size))
        end = offset + size
    return np.array(kept, dtype=np.int64).reshape(-1, 2), dropped


def _restore_dictionaries(store: PageStore, held: Held) -> None:
    """The dead server's dictionaries under their ids (blobs name them so). Candidates for
    new writes only if the setting is the same; else kept for reading until unused."""
    registry = store.dicts.registry
    setting = store.dicts.setting
    setting = list(setting) if isinstance(setting, (list, tuple)) else setting
    entries = []
    for name, fd in held.fds.items():
        if not name.startswith(DICT_PREFIX):
            continue
        meta = held.metas.get(name, {})
        entries.append((int(meta["id"]), meta, read_bytes(fd)))
    registry.restore_entries(
        [(i, m["name"], m["source"], content, m.get("info", {}),
          bool(m.get("candidate")) and m.get("setting") == setting, m["dict_kind"],
          bool(m["frames"])) for i, m, content in sorted(entries, key=lambda e: e[0])])
    store.share_dictionaries()


def _rebuild(store: PageStore, repair: Repair, kind: np.ndarray, handle: np.ndarray,
             sub: np.ndarray, words: np.ndarray, blob: dict[str, np.ndarray],
             members: np.ndarray, rows: int, old_live: np.ndarray) -> None:
    """Under the store lock: the columns written into the new store's tables, and every
    derived book rebuilt from them."""
    blobs, slots, pool = store.blobs, store.slots, store.pool
    if rows > blobs.capacity:
        blobs.adopt(blobs.prepare(max(rows, 2 * blobs.capacity), rows))

    # pool rows: one location each (duplicates of an unfinished renumbering merged), one
    # size class per arena, cells inside their arena; where rows disagree, their bytes
    # decide (_verifies)
    held = np.unique(handle[kind == BLOB])
    in_pool = held[blob["tier"][held] == POOL]
    remap = np.arange(rows, dtype=np.int64)
    bad_rows: set[int] = set()
    by_place: dict[tuple[int, int], list[int]] = {}
    for row in in_pool.tolist():
        by_place.setdefault((int(blob["arena"][row]), int(blob["cell"][row])), []).append(row)
    same_row = ("length", "pages", "codec", "dict_id", "csum", "form")
    for group in by_place.values():
        if len(group) == 1:
            continue
        first = group[0]
        if all(all(blob[c][row] == blob[c][first] for c in same_row) for row in group):
            for row in group[1:]:
                remap[row] = first
                repair.duplicate_rows += 1
            continue
        valid = [row for row in group if _verifies(store, row, blob)]
        for row in group:
            if not valid or row != valid[0]:
                bad_rows.add(row)
    arena_class: dict[int, int] = {}
    for row in in_pool.tolist():
        if remap[row] != row or row in bad_rows:
            continue
        try:
            cls = pool.class_for(int(blob["length"][row]))
        except ValueError:
            bad_rows.add(row)
            continue
        if int(blob["cell"][row]) >= cls.cells_per_arena:
            bad_rows.add(row)
            continue
        # one class per arena: a row of another class than the arena's first is not whole
        if arena_class.setdefault(int(blob["arena"][row]), cls.index) != cls.index:
            bad_rows.add(row)
    if rows:
        blob_slot = kind == BLOB
        handle = np.where(blob_slot, remap[np.clip(handle, 0, rows - 1)], handle)
    if bad_rows:
        gone = (kind == BLOB) & np.isin(handle, list(bad_rows))
        repair.slots_emptied += int(np.count_nonzero(gone))
        kind[gone], handle[gone], sub[gone] = EMPTY, 0, 0

    # the slot table: only the slots in use are written (a page of the table costs memory
    # once written)
    used = np.flatnonzero(kind)
    slots.kind[used] = kind[used]
    slots.handle[used] = handle[used].astype(np.uint32)
    slots.sub[used] = sub[used].astype(np.uint8)
    slots.words.words[:] = words
    slots.words.recount(handle[kind == SAME])
    slots.same_pages = int(np.count_nonzero(kind == SAME))
    slots.chunk_live[:] = np.add.reduceat((kind != EMPTY).astype(np.int32),
                                          np.arange(0, len(kind), CHUNK_SLOTS))
    slots.chunk_touched[:] = slots.chunk_live > 0
    slots.chunk_written[:] = slots.chunk_touched  # nothing forgotten before a fresh map

    # the blob table: each row's references are the slots that name it
    refs = (np.bincount(handle[kind == BLOB], minlength=rows)[:rows] if rows
            else np.zeros(0, dtype=np.int64))
    live = refs > 0
    repair.rows_freed = int(np.count_nonzero(old_live[:rows] & ~live))
    for name, values in blob.items():
        column = getattr(blobs, name)
        column[:rows] = values
    blobs.members[:rows] = members
    blobs.ref[:rows] = refs.astype(np.uint32)
    now = store.now()
    blobs.atime[:rows] = np.where(live, now, 0)  # warm from now: nobody knows their age
    blobs.rtime[:rows] = 0
    blobs.count = int(np.count_nonzero(live))
    blobs.state[NEXT_UNUSED] = rows
    blobs.relink()
    repair.blobs = blobs.count
    repair.slots = int(np.count_nonzero(kind))

    # what the pages are stored with; the index starts empty (every live page left out)
    codec_of = blobs.codec[:rows][handle[kind == BLOB]].astype(np.int64) if rows else []
    counts = np.bincount(codec_of, minlength=len(store.objects.codec_pages))
    store.objects.codec_pages[:] = counts[: len(store.objects.codec_pages)]
    store.index.unindexed = int(blobs.pages[:rows][live].astype(np.int64).sum()) if rows else 0

    # the pool's books, from the live rows' cells; what no live row uses is punched
    pool_rows = np.flatnonzero(live & (blobs.tier[:rows] == POOL))
    pool.rebuild(blobs.arena[pool_rows].astype(np.int64), blobs.cell[pool_rows].astype(np.int64),
                 np.array([pool.class_for(int(n)).index for n in blobs.length[pool_rows]],
                          dtype=np.int64))
    repair.arenas = pool.arena_count
    store.on_tables_moved()


def _verifies(store: PageStore, row: int, blob: dict[str, np.ndarray]) -> bool:
    """Whether a pool row's bytes, read straight from the pool's memfd, verify as a read
    verifies them (for rows that disagree about a cell or an arena)."""
    pool = store.pool
    length = int(blob["length"][row])
    try:
        cls = pool.class_for(length)
        offset = int(blob["arena"][row]) * pool.span + int(blob["cell"][row]) * cls.cell_size
        stored = os.pread(pool.memfd, length, offset)
        size = int(blob["pages"][row]) * store.page_size
        store.objects.decode_checked(row, int(blob["codec"][row]), int(blob["dict_id"][row]),
                                     stored, size, int(blob["csum"][row]))
    except (ValueError, OSError, integrity.Corrupt):
        return False
    return True
