"""`dictionary: auto`: a dictionary trained from this host's own writes (pages or frames)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from ..codecs import DICT_KINDS, ZstdCodec, ZstdDictCodec, pays
from .registry import DictionaryRegistry

_REP_OFFSETS = b"\x01\x00\x00\x00\x04\x00\x00\x00\x08\x00\x00\x00"  # end of a zstd dict header


# --- training and measuring ------------------------------------------------------------------

def content_of(trained: zstandard.ZstdCompressionDict) -> bytes:
    """The content part of a trained zstd dictionary (its header, entropy tables and the
    three repeat offsets 1, 4, 8 that close the header, stripped)."""
    data = trained.as_bytes()
    end = data.find(_REP_OFFSETS)
    if end < 0:
        raise ValueError("not a zstd dictionary with a standard header")
    return data[end + len(_REP_OFFSETS):]


def train_dictionary(samples: Sequence[bytes], size: int = 32768, *, k: int = 64, d: int = 8,
                     steps: int = 8, threads: int = 1, level: int = 3) -> bytes:
    """A trained zstd dictionary (header, entropy tables, content) of about `size` bytes,
    content chosen by zstd's COVER trainer."""
    return zstandard.train_dictionary(size, list(samples), k=k, d=d, steps=steps,
                                      threads=threads, level=level).as_bytes()


def train_content(samples: Sequence[bytes], size: int = 32768, **kwargs) -> bytes:
    """Raw dictionary content of about `size` bytes chosen by zstd's COVER trainer."""
    return content_of(zstandard.ZstdCompressionDict(train_dictionary(samples, size, **kwargs)))


def as_kind(trained: bytes, kind: str) -> bytes:
    """A trained dictionary as the bytes a dictionary of `kind` registers."""
    return trained if kind == "full" else content_of(zstandard.ZstdCompressionDict(trained))


def sizes(codec, units: Sequence[bytes], pages: int = 1, page_size: int = 4096) -> np.ndarray:
    """What the store keeps for each of `units` (pages, or frames of `pages` pages)
    compressed by `codec`: the output, or the unit raw when compression does not pay."""
    def kept(unit) -> int:
        n = len(codec.compress(unit))
        return n if pays(n, pages) else pages * page_size
    return np.fromiter((kept(u) for u in units), dtype=np.int64, count=len(units))


def _joined(unit) -> bytes:
    return b"".join(unit) if isinstance(unit, list) else bytes(unit)


@dataclass
class TrainerStats:
    sampled: int = 0
    rounds: int = 0
    adopted: int = 0
    last_gain: float | None = None  # held-out gain of the last candidate (adopted or not)
    last_error: str = ""


class HostTrainer:
    """`dictionary: auto`: learn a dictionary from this host's own writes.

    Units are what the store compresses: pages (`unit_pages` 1) or whole frames of
    `unit_pages` pages (a frame's dictionary must prime a frame, and trained on single pages
    it would hold what a frame finds in its own earlier pages).

    A round has two windows. Training: every `sample_every`-th unit is copied until
    `train_pages` are kept; then a background thread trains (zstd COVER; it releases the
    GIL). Held-out: only units written at least `heldout_delay` seconds after the training
    window closed and after training finished are sampled (every `heldout_every`-th),
    `heldout_pages` of them. On
    those the best of the current candidates and no dictionary is compared with and without
    the new dictionary, as raw content and as a full dictionary (entropy tables too); the
    better kind is adopted when it saves at least `min_gain`, and the previous host
    dictionary leaves the candidates (it stays registered while blobs use it).

    Why held-out units come from a later window and not from the training window: samples
    of the same window hold the same objects as the training samples (a heap's strings,
    neighbouring pages of one data structure), so a dictionary wins on them because it
    copied them; later writes are what the dictionary will actually compress (other runs of
    the programs, or their next phase). A dictionary only has to pay on those. Samples are
    dropped after each round; rounds are at least `interval` seconds apart.
    """

    def __init__(self, registry: DictionaryRegistry, *, unit_pages: int = 1,
                 sample_every: int | None = None, heldout_every: int | None = None,
                 train_pages: int | None = None,
                 heldout_pages: int | None = None, size: int | None = None,
                 min_gain: float = 0.01, interval: float = 600.0, heldout_delay: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self.registry = registry
        self.unit_pages = unit_pages
        frames = unit_pages > 1
        # Frames: 160 + 40 sampled frames (12.5 MiB of copies, as 2048 + 512 pages are 10).
        # Training samples spread over 40 MiB of frames (a workload's first run must fill the
        # window: 100 MiB heaps give 65-110 MiB of frames); held-out ones are taken densely,
        # so the test ends early in the later writes and what follows can use the dictionary.
        self.sample_every = sample_every or (4 if frames else 16)
        self.heldout_every = heldout_every or (2 if frames else 4)
        self.train_pages = train_pages or (160 if frames else 2048)
        self.heldout_pages = heldout_pages or (40 if frames else 512)
        # 64 KiB for frames: measured +5.1% on JSON heaps vs +4.5% with 32 KiB
        # (tools/bench_dicts.py); larger ones gain little more and cost their tables.
        self.size = size or (65536 if frames else 32768)
        self.min_gain = min_gain
        self.interval = interval
        self.heldout_delay = heldout_delay
        self.background = background
        self._clock = clock
        self._count = 0
        self._train: list[bytes] = []
        self._heldout: list[bytes] = []
        self._trained: bytes | None = None  # the round's dictionary, awaiting its held-out test
        self._heldout_from = 0.0
        self._busy = False
        self._next_round = 0.0
        self._thread: threading.Thread | None = None
        self.stats = TrainerStats()

    def observe(self, unit) -> None:
        """Called for each unit the store compresses (a page, or a frame as the list of its
        pages: joined only when it is kept); cheap unless it keeps a copy."""
        self._count += 1
        # Collect only while a window is open: samples kept through the interval would be
        # stale by then and cost their memory all along.
        if self._busy:
            return
        if self._trained is None:
            if self._count % self.sample_every or self._clock() < self._next_round:
                return
            self.stats.sampled += 1
            self._train.append(_joined(unit))
            if len(self._train) >= self.train_pages:
                train, self._train = self._train, []
                self._run(self._train_round, train)
        elif self._count % self.heldout_every == 0 and self._clock() >= self._heldout_from:
            self.stats.sampled += 1
            self._heldout.append(_joined(unit))
            if len(self._heldout) >= self.heldout_pages:
                heldout, self._heldout = self._heldout, []
                self._run(self._test_round, heldout)

    def _run(self, fn, units: list[bytes]) -> None:
        self._busy = True
        if self.background:
            self._thread = threading.Thread(target=self._guarded, args=(fn, units),
                                            name="agentzip-dict-train", daemon=True)
            self._thread.start()
        else:
            self._guarded(fn, units)

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _guarded(self, fn, units: list[bytes]) -> None:
        try:
            fn(units)
        except Exception as exc:  # a failed round must never hurt the data path
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            self._end_round()
        finally:
            self._busy = False

    def _train_round(self, train: list[bytes]) -> None:
        self._trained = self.train(train)
        self._heldout_from = self._clock() + self.heldout_delay

    def _test_round(self, heldout: list[bytes]) -> None:
        trained, self._trained = self._trained, None
        self.maybe_adopt(trained, heldout, self.train_pages)
        self._end_round()

    def _end_round(self) -> None:
        self._trained = None
        self._train, self._heldout = [], []
        self.stats.rounds += 1
        self._next_round = self._clock() + self.interval

    def train(self, train: Sequence[bytes]) -> bytes:
        return train_dictionary(train, self.size)

    def train_and_maybe_adopt(self, train: Sequence[bytes], heldout: Sequence[bytes]) -> bool:
        """Train on `train` and adopt if the dictionary wins on `heldout`, which the caller
        took from later writes than `train` (see the class comment)."""
        return self.maybe_adopt(self.train(train), heldout, len(train))

    def maybe_adopt(self, trained: bytes, heldout: Sequence[bytes], trained_on: int) -> bool:
        registry = self.registry
        # Own codecs: the store's compressors are in use by the write path meanwhile.
        level, n = registry.level, self.unit_pages
        size = n * registry.page_size
        now = registry.frame_candidates if n > 1 else registry.candidates  # what units try
        current = [ZstdCodec(level, size)] + [ZstdDictCodec(e.content, level, size, e.kind)
                                              for e in now]
        best_now = np.minimum.reduce([sizes(c, heldout, n) for c in current])
        gains = {}
        for kind in DICT_KINDS:
            codec = ZstdDictCodec(as_kind(trained, kind), level, size, kind)
            with_new = np.minimum(best_now, sizes(codec, heldout, n))
            gains[kind] = float(best_now.sum()) / float(with_new.sum()) - 1
        kind = max(gains, key=lambda k: (gains[k], k == "raw"))  # a tie: raw is smaller
        gain = gains[kind]
        self.stats.last_gain = round(gain, 4)
        if gain < self.min_gain:
            return False
        old_hosts = [e.id for e in registry.candidates if e.source == "host"]
        self.stats.adopted += 1
        registry.add(f"host-{self.stats.adopted}", as_kind(trained, kind), "host",
                     {"trained_units": trained_on, "heldout_units": len(heldout),
                      "unit_pages": n, "kind": kind, "heldout_gain": round(gain, 4),
                      "heldout_gains": {k: round(v, 4) for k, v in gains.items()},
                      "adopted_at": time.time()}, kind=kind)
        for dict_id in old_hosts:
            registry.retire(dict_id)
        return True

    def sample_bytes(self) -> int:
        """Memory held by the copies of sampled units (counted in the store's stored_mem)."""
        return ((len(self._train) + len(self._heldout)) * self.unit_pages * self.registry.page_size
                + len(self._trained or b""))

    def summary(self) -> dict:
        st = self.stats
        return {"sampled": st.sampled, "rounds": st.rounds, "adopted": st.adopted,
                "last_gain": st.last_gain, "training": self._busy,
                "awaiting_heldout": self._trained is not None, "unit_pages": self.unit_pages,
                "last_error": st.last_error}
