"""Predict the ratio agentzip-blk would reach on live processes, before enabling anything.

Takes a sample of the targets' resident anonymous pages (`agentzip-blk estimate` reads them
with agentzip_blk.cgroups.procmem: root, read-only, no swap needed), then compresses them the
way the store would: same-filled pages cost nothing, exact duplicates are stored once, the
others are compressed and kept raw when that does not pay (codecs.pays: 3/4 of a page). The
ratio printed is the store's *payload* ratio, original bytes / compressed bytes
(`orig_mem / compressed_bytes` in `stats`); the pool's size classes and metadata add a few
percent on top of the compressed bytes.

Rows: lz4, lz4hc, zstd 1/3/9 with each page compressed alone (`compression.frame_pages: 1`);
zstd 3 with the shipped dictionaries (the store's own per-request selection) and with `auto`
(a host dictionary trained on half of the sampled pages, measured on the other half): both
apply to pages compressed alone; and zstd 3 in frames of `frame_pages` pages, the store's
default (`compression.frame_pages: 16`). The sample is spread over the whole address space,
so a frame's pages are rarely neighbours as they are in a swap-out: the frames row is a lower
bound of what the store reaches.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ..config import CompressionConfig
from .codecs import Lz4Codec, Lz4HcCodec, ZstdCodec, pays, stored_size
from .dictionaries.files import DictionaryError
from .dictionaries.registry import DictionaryRegistry
from .dictionaries.selector import Selector
from .dictionaries.trainer import HostTrainer

PAGE = 4096
ROLLOUT_MIN_RATIO = 2.5  # the field report advises against rollout below about this
REQUEST_PAGES = 32  # pages per simulated write request (for dictionary selection)
FRAME_PAGES = CompressionConfig().frame_pages  # the store's default


@dataclass
class Row:
    codec: str
    ratio: float  # original bytes / stored bytes, over all sampled pages
    compressed_ratio: float  # the same over only the pages that get compressed
    compress_mbs: float
    decompress_mbs: float
    note: str = ""


@dataclass
class Estimate:
    pids: list[int]
    resident_pages: int
    sampled_pages: int
    same_pages: int
    duplicate_pages: int
    rows: list[Row] = field(default_factory=list)
    recommendation: str = ""
    recommended: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def classify(pages: Sequence[bytes]) -> tuple[list[bytes], int, int]:
    """(pages the store would compress, same-filled count, duplicate count)."""
    seen: set[bytes] = set()
    unique: list[bytes] = []
    same = dup = 0
    for p in pages:
        w = np.frombuffer(p, dtype=np.uint64)
        if (w == w[0]).all():
            same += 1
        elif p in seen:
            dup += 1
        else:
            seen.add(p)
            unique.append(p)
    return unique, same, dup


def measure(codec, pages: Sequence[bytes]) -> tuple[int, float, float]:
    """Stored bytes (raw above the store's limit), compress and decompress seconds."""
    t0 = time.perf_counter()
    outs = [codec.compress(p) for p in pages]
    ct = time.perf_counter() - t0
    t0 = time.perf_counter()
    for o in outs:
        codec.decompress(o)
    dt = time.perf_counter() - t0
    return sum(stored_size(len(o)) for o in outs), ct, dt


def measure_frames(pages: Sequence[bytes], level: int, frame_pages: int = FRAME_PAGES
                   ) -> tuple[int, float, float]:
    """As `measure`, for the store's frames: `frame_pages` pages at a time compressed
    together, and page by page where that does not pay (placement.Placer.store_group)."""
    frame_codec, page_codec = ZstdCodec(level, frame_pages * PAGE), ZstdCodec(level)
    t0 = time.perf_counter()
    outs: list[tuple[bytes, int]] = []  # (output, pages in it)
    for start in range(0, len(pages), frame_pages):
        group = pages[start:start + frame_pages]
        if len(group) > 1:
            out = frame_codec.compress(b"".join(group))
            if pays(len(out), len(group)):
                outs.append((out, len(group)))
                continue
        outs.extend((page_codec.compress(p), 1) for p in group)
    ct = time.perf_counter() - t0
    t0 = time.perf_counter()
    for out, n in outs:
        (frame_codec if n > 1 else page_codec).decompress(out, n * PAGE)
    dt = time.perf_counter() - t0
    return sum(len(o) if n > 1 else stored_size(len(o)) for o, n in outs), ct, dt


def _measure_selected(registry: DictionaryRegistry, pages: Sequence[bytes], level: int
                      ) -> tuple[int, float, float, dict]:
    selector = Selector(ZstdCodec(level), registry)
    outs = []
    t0 = time.perf_counter()
    for start in range(0, len(pages), REQUEST_PAGES):
        chunk = pages[start:start + REQUEST_PAGES]
        choice = selector.choose(chunk)
        for n, p in enumerate(chunk):
            outs.append((choice.sample_out if n == choice.sample else choice.codec.compress(p),
                         choice.dict_id))
    ct = time.perf_counter() - t0
    plain = ZstdCodec(level)
    t0 = time.perf_counter()
    for o, d in outs:
        (registry.decoder(d) if d else plain).decompress(o)
    dt = time.perf_counter() - t0
    usage: dict[str, int] = {}
    for _, d in outs:
        if d:
            name = registry.get(d).name
            usage[name] = usage.get(name, 0) + 1
    return sum(stored_size(len(o)) for o, _ in outs), ct, dt, usage


def estimate_pages(pages: Sequence[bytes], *, level: int = 3, dictionaries: bool = True,
                   auto: bool = True, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> Estimate:
    """What each codec would store for `pages` (a sample of the targets' memory)."""
    unique, same, dup = classify(pages)
    total = len(pages) * PAGE
    est = Estimate([], len(pages), len(pages), same, dup)
    if not unique:
        return est
    plan: list[tuple[str, Callable[[], tuple]]] = []
    for name, codec in [("lz4", Lz4Codec()), ("lz4hc 9", Lz4HcCodec(9)), ("zstd 1", ZstdCodec(1)),
                        (f"zstd {level}", ZstdCodec(level)), ("zstd 9", ZstdCodec(9))]:
        plan.append((name, lambda c=codec: (*measure(c, unique), "")))
    plan.append((f"zstd {level}, {FRAME_PAGES}-page frames",
                 lambda: (*measure_frames(unique, level), "the store's default; sampled pages "
                          "are rarely neighbours, so a lower bound")))
    registry = None
    if dictionaries:
        try:
            registry = DictionaryRegistry.from_setting("prebuilt", level)
        except DictionaryError as exc:
            print(f"estimate: dictionaries skipped: {exc}", file=sys.stderr)
    if registry is not None and registry.candidates:
        def prebuilt():
            stored, ct, dt, usage = _measure_selected(registry, unique, level)
            used = ", ".join(f"{k} {v}" for k, v in sorted(usage.items())) or "none chosen"
            return stored, ct, dt, f"pages per dictionary: {used}"
        plan.append((f"zstd {level} + prebuilt", prebuilt))
    if auto and registry is not None and len(unique) >= 400:
        def auto_row():
            # Train on a random half, measure on the other half (scaled to all pages), as
            # `dictionary: auto` learns from earlier writes and applies to later ones.
            rnd = random.Random(seed)
            order = list(range(len(unique)))
            rnd.shuffle(order)
            half = len(order) // 2
            train = [unique[i] for i in order[:half]]
            test = [unique[i] for i in order[half:]]
            reg = DictionaryRegistry.from_setting("prebuilt", level)
            trainer = HostTrainer(reg, background=False, min_gain=0.01)
            cut = len(train) * 4 // 5
            adopted = trainer.train_and_maybe_adopt(train[:cut], train[cut:])
            stored, ct, dt, _ = _measure_selected(reg, test, level)
            scale = len(unique) / len(test)
            note = (f"host dictionary {'adopted' if adopted else 'not adopted'} "
                    f"(trained on half the sample, measured on the other half)")
            return int(stored * scale), ct * scale, dt * scale, note
        plan.append((f"zstd {level} + auto", auto_row))
    compressed_orig = len(unique) * PAGE
    for i, (name, run) in enumerate(plan):
        stored, ct, dt, note = run()
        est.rows.append(Row(name, round(total / stored, 3), round(compressed_orig / stored, 3),
                            round(compressed_orig / ct / 1e6, 1) if ct else 0.0,
                            round(compressed_orig / dt / 1e6, 1) if dt else 0.0, note))
        if progress:
            progress(i + 1, len(plan))
    _recommend(est, level)
    return est


def _recommend(est: Estimate, level: int) -> None:
    rows = {r.codec: r for r in est.rows}
    base = rows.get(f"zstd {level}")
    best = max(est.rows, key=lambda r: r.ratio)
    if best.ratio < ROLLOUT_MIN_RATIO:
        est.recommendation = (
            f"not recommended: the best ratio here is {best.ratio:.2f}x ({best.codec}), below "
            f"the ~{ROLLOUT_MIN_RATIO}x under which the field report advises against rollout "
            f"(CPU and latency cost more than the memory saved)")
        return
    choice = base
    for name in (f"zstd {level} + auto", f"zstd {level} + prebuilt"):
        r = rows.get(name)
        if r is not None and base is not None and r.ratio >= base.ratio * 1.01 and (
                choice is base or r.ratio > choice.ratio):
            choice = r  # dictionaries only when they buy at least 1%
    if choice is None:
        choice = best
    est.recommended = choice.codec
    setting = "auto" if "auto" in choice.codec else "prebuilt" if "prebuilt" in choice.codec else "none"
    est.recommendation = (f"recommended: {choice.codec} ({choice.ratio:.2f}x, compress "
                          f"{choice.compress_mbs:.0f} MB/s); config: algorithm: zstd, level: {level}, "
                          f"dictionary: {setting}")


def format_estimate(est: Estimate) -> str:
    mib = est.resident_pages * PAGE / 2**20
    lines = [
        f"targets: {len(est.pids)} process(es), {mib:.1f} MiB resident anonymous memory; "
        f"sampled {est.sampled_pages} pages: {est.same_pages} same-filled, "
        f"{est.duplicate_pages} duplicates (stored once)",
        "",
        f"{'codec':22} {'ratio':>7} {'compressed-only':>15} {'compress':>12} {'decompress':>12}  note",
    ]
    for r in est.rows:
        lines.append(f"{r.codec:22} {r.ratio:6.2f}x {r.compressed_ratio:14.2f}x "
                     f"{r.compress_mbs:8.0f} MB/s {r.decompress_mbs:8.0f} MB/s  {r.note}")
    lines += ["", "ratio = original / compressed bytes as the store keeps them (pool and "
              "metadata overhead not included); speeds are per core.", est.recommendation]
    return "\n".join(lines)
