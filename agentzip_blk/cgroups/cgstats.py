"""Per-cgroup accounting: which device slots hold a cgroup's pages, and what they cost.

``/proc/PID/pagemap`` (root: CAP_SYS_ADMIN shows swap offsets) has one 64-bit entry per
virtual page; a swapped page has bit 62 set, the swap *type* in bits 0-4 and the swap
*offset* in bits 5-54. The type is the index of the swap area in the kernel's swap_info
table, which /proc/swaps lists in order; the offset is the 4 KiB slot on the area, which for
our device is the store's slot number. Joining the slots of a cgroup's processes with the
server's ``slots`` control verb (per slot: kind, stored bytes, tier) gives:

- ``orig_mem``: pages x 4 KiB, each slot once (a page shared after fork() is one slot);
- ``stored_mem``: the compressed bytes of those slots; a blob shared by N slots (dedup)
  counts 1/N for each; same-filled pages count 0;
- ``zero_pages``: swap entries whose slot is empty on the device. Since Linux 6.12 the kernel
  keeps zero-filled pages in its own bitmap (swap_info->zeromap) and never writes them: they
  count as stored in 0 bytes. (A slot briefly empty because its write is still in flight
  looks the same; it is rare on an idle cgroup.)

Not seen: shared memory (shmem/tmpfs pages keep their swap entry in the page cache, not in a
page table), pages swapped in but still in the swap cache (present in the page table, slot
still allocated), and slots freed by the kernel but not yet discarded. So per-cgroup sums
can be slightly below the device's totals, never above.

Only VMAs whose ``Swap:`` in /proc/PID/smaps is non-zero are read: runtimes reserve huge
address ranges (V8's cage) whose pagemap alone would be gigabytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from .. import procfs

__all__ = ["SwapEntries", "CgroupSwap", "our_swap_type", "swap_entries", "account", "collect",
           "query_slots", "PAGE"]

PAGE = 4096
PM_SWAP = 1 << 62
PM_PRESENT = 1 << 63
SWP_TYPE_BITS = 5
SWP_TYPE_MASK = (1 << SWP_TYPE_BITS) - 1
SWP_OFFSET_MASK = (1 << 50) - 1
CHUNK_PAGES = 1 << 18  # pagemap read size: 2 MiB of entries at a time
REQUEST_BYTES = 60_000  # the control socket takes lines up to 64 KiB


def our_swap_type(device: str, swaps_path: str = "/proc/swaps") -> int | None:
    """The swap type of *device*: its index in /proc/swaps, which lists areas in type order.

    Holes: an area swapped off below ours frees its type, and /proc/swaps skips it, so the
    index would undercount; ``collect`` therefore cross-checks (see ``_type_check``).
    """
    real = os.path.realpath(device)
    for i, area in enumerate(procfs.swaps(swaps_path)):
        if area.filename == device or os.path.realpath(area.filename) == real:
            return i
    return None


@dataclass
class SwapEntries:
    """Swapped pages of some processes, as (type, offset) pairs, deduplicated."""

    by_type: dict[int, np.ndarray] = field(default_factory=dict)  # type -> unique offsets
    pids: int = 0
    unreadable: list[int] = field(default_factory=list)

    def merge(self, other: "SwapEntries") -> "SwapEntries":
        out = SwapEntries(pids=self.pids + other.pids, unreadable=self.unreadable + other.unreadable)
        for t in set(self.by_type) | set(other.by_type):
            parts = [x for x in (self.by_type.get(t), other.by_type.get(t)) if x is not None]
            out.by_type[t] = np.unique(np.concatenate(parts))
        return out


def _swapped_vmas(pid: int, proc: str) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    cur = None
    with open(f"{proc}/{pid}/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            head = line.split(None, 1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                lo, _, hi = head.partition("-")
                try:
                    cur = (int(lo, 16), int(hi, 16))
                except ValueError:
                    cur = None
            elif head == "Swap:" and cur is not None:
                if int(line.split()[1]) > 0:
                    spans.append(cur)
    return spans


def swap_entries(pids: Iterable[int], proc: str = "/proc") -> SwapEntries:
    """The swapped pages of *pids* (processes that vanish meanwhile are skipped)."""
    raw: list[np.ndarray] = []
    out = SwapEntries()
    for pid in pids:
        try:
            spans = _swapped_vmas(pid, proc)
            with open(f"{proc}/{pid}/pagemap", "rb", buffering=0) as f:
                for lo, hi in spans:
                    for start in range(lo // PAGE, hi // PAGE, CHUNK_PAGES):
                        n = min(CHUNK_PAGES, hi // PAGE - start)
                        f.seek(start * 8)
                        data = f.read(n * 8)
                        if not data:
                            break
                        ent = np.frombuffer(data[: len(data) // 8 * 8], dtype=np.uint64)
                        raw.append(ent[(ent & np.uint64(PM_SWAP)) != 0])
            out.pids += 1
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited
        except PermissionError:
            out.unreadable.append(pid)
        except OSError:
            out.unreadable.append(pid)
    if raw:
        ent = np.concatenate(raw)
        # pagemap without CAP_SYS_ADMIN zeroes the frame bits: every swap entry reads 0/0
        types = (ent & np.uint64(SWP_TYPE_MASK)).astype(np.int64)
        offsets = ((ent >> np.uint64(SWP_TYPE_BITS)) & np.uint64(SWP_OFFSET_MASK)).astype(np.int64)
        for t in np.unique(types):
            out.by_type[int(t)] = np.unique(offsets[types == t])
    return out


@dataclass
class CgroupSwap:
    cgroup: str
    pids: int = 0
    unreadable: int = 0
    pages: int = 0  # swap entries on our device (unique slots)
    zero_pages: int = 0  # kernel zero pages (empty slots): stored in 0 bytes
    same_pages: int = 0  # same-filled pages in the store: 0 bytes
    blob_pages: int = 0  # compressed or raw blobs
    disk_pages: int = 0  # of those, on the disk tier
    stored: float = 0.0  # bytes
    other_swap_pages: int = 0  # swap entries on other swap areas
    kernel_swap: int | None = None  # memory.stat swap of the cgroup, for comparison

    @property
    def orig_mem(self) -> int:
        return self.pages * PAGE

    @property
    def stored_mem(self) -> int:
        return int(round(self.stored))

    @property
    def device_pages(self) -> int:
        """The pages the device itself holds for the cgroup (zero pages are not on it)."""
        return self.same_pages + self.blob_pages

    @property
    def ratio(self) -> float | None:
        return round(self.orig_mem / self.stored, 4) if self.stored > 0 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(orig_mem=self.orig_mem, stored_mem=self.stored_mem, ratio=self.ratio,
                 device_pages=self.device_pages)
        d["stored"] = round(self.stored, 1)
        return d


def query_slots(control_path: str, slots: np.ndarray) -> dict[str, np.ndarray]:
    """The ``slots`` verb over the control socket, in requests small enough for it."""
    from ..datapath import control

    kinds, stored, tiers = [], [], []
    i, n = 0, len(slots)
    while i < n:
        # each slot costs its digits plus ", " in the JSON request
        j, size = i, 40
        while j < n and size + len(str(int(slots[j]))) + 2 <= REQUEST_BYTES:
            size += len(str(int(slots[j]))) + 2
            j += 1
        reply = control.request(control_path, "slots", slots=[int(x) for x in slots[i:j]])
        kinds.append(np.asarray(reply["kind"], dtype=np.int8))
        stored.append(np.asarray(reply["stored"], dtype=np.float64))
        tiers.append(np.asarray(reply["tier"], dtype=np.int8))
        i = j
    if not kinds:
        return {"kind": np.zeros(0, np.int8), "stored": np.zeros(0), "tier": np.zeros(0, np.int8)}
    return {"kind": np.concatenate(kinds), "stored": np.concatenate(stored),
            "tier": np.concatenate(tiers)}


def account(name: str, entries: SwapEntries, swap_type: int,
            slots_fn: Callable[[np.ndarray], dict[str, np.ndarray]]) -> CgroupSwap:
    """Join one cgroup's swap entries with the store's per-slot sizes."""
    row = CgroupSwap(name, pids=entries.pids, unreadable=len(entries.unreadable))
    ours = entries.by_type.get(swap_type, np.zeros(0, np.int64))
    row.other_swap_pages = int(sum(len(v) for t, v in entries.by_type.items() if t != swap_type))
    row.pages = int(len(ours))
    if len(ours):
        info = slots_fn(ours)
        kind, stored, tier = info["kind"], info["stored"], info["tier"]
        row.zero_pages = int(np.count_nonzero(kind == 0))
        row.same_pages = int(np.count_nonzero(kind == 1))
        blobs = kind == 2
        row.blob_pages = int(np.count_nonzero(blobs))
        row.disk_pages = int(np.count_nonzero(blobs & (tier == 1)))
        row.stored = float(stored[blobs].sum())
    return row


def _type_check(entries: SwapEntries, swap_type: int, areas: int) -> int:
    """With one active swap area every swap entry is ours, whatever type number it carries
    (an area swapped off below ours leaves a hole that /proc/swaps does not show)."""
    if areas == 1 and len(entries.by_type) == 1:
        return next(iter(entries.by_type))
    return swap_type


def collect(backend, globs: list[str], control_path: str, device: str,
            swaps_path: str = "/proc/swaps", proc: str = "/proc",
            slots_fn: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None,
            stats_fn: Callable[[], dict] | None = None) -> dict:
    """Rows for every cgroup matching one of *globs* (each with its descendants), a total
    over their union, and the device's own figures for comparison."""
    from ..datapath import control
    from .scopes import match

    swap_type = our_swap_type(device, swaps_path)
    if swap_type is None:
        raise ValueError(f"{device} is not an active swap area (/proc/swaps): is the device up?")
    areas = len(procfs.swaps(swaps_path))
    slots_fn = slots_fn or (lambda s: query_slots(control_path, s))
    matched = [rel for rel in backend.walk() if any(match(g, rel) for g in globs)]
    rows = []
    union = SwapEntries()
    per: list[tuple[str, SwapEntries]] = []
    for rel in matched:
        e = swap_entries(backend.pids(rel), proc)
        per.append((rel, e))
        union = union.merge(e)
    swap_type = _type_check(union, swap_type, areas)
    for rel, e in per:
        row = account(rel, e, swap_type, slots_fn)
        try:
            row.kernel_swap = backend.swap_usage(rel)
        except (OSError, ValueError):
            pass
        rows.append(row)
    total = account("total", union, swap_type, slots_fn)
    dev = stats_fn() if stats_fn else control.request(control_path, "stats")
    device_info = {k: dev.get(k) for k in ("orig_mem", "stored_mem", "pages", "same_pages",
                                            "compressed_bytes", "ratio")}
    return {"swap_type": swap_type, "device": device, "cgroups": [r.to_dict() for r in rows],
            "total": total.to_dict(), "store": device_info}


def to_json(result: dict) -> str:
    return json.dumps(result, sort_keys=True)
