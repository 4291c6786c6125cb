"""`dictionary: auto`: raw dictionary content trained from this host's own writes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from ..codecs import ZstdCodec, ZstdDictCodec, stored_size
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


def train_content(samples: Sequence[bytes], size: int = 32768, *, k: int = 64, d: int = 8,
                  steps: int = 8, threads: int = 1, level: int = 3) -> bytes:
    """Raw dictionary content of about `size` bytes chosen by zstd's COVER trainer."""
    trained = zstandard.train_dictionary(size, list(samples), k=k, d=d, steps=steps,
                                         threads=threads, level=level)
    return content_of(trained)


def sizes(codec, pages: Sequence[bytes]) -> np.ndarray:
    return np.fromiter((stored_size(len(codec.compress(p))) for p in pages), dtype=np.int64,
                       count=len(pages))


@dataclass
class TrainerStats:
    sampled: int = 0
    rounds: int = 0
    adopted: int = 0
    last_gain: float | None = None  # held-out gain of the last candidate (adopted or not)
    last_error: str = ""


class HostTrainer:
    """`dictionary: auto`: learn a dictionary from this host's own writes.

    Every `sample_every`-th compressed page is copied; every 5th copy is held out. With
    `train_pages` training and `heldout_pages` held-out samples a background thread trains
    raw content (zstd COVER; the trainer releases the GIL) and compares, on the held-out
    samples, the best of the current candidates and no dictionary with and without the new
    one. It is adopted when it saves at least `min_gain`; the previous host dictionary then
    leaves the candidates (it stays loaded while blobs use it). Samples are dropped after
    each round, and rounds are at least `interval` seconds apart.
    """

    def __init__(self, registry: DictionaryRegistry, *, sample_every: int = 16,
                 train_pages: int = 2048, heldout_pages: int = 512, size: int = 32768,
                 min_gain: float = 0.01, interval: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self.registry = registry
        self.sample_every = sample_every
        self.train_pages = train_pages
        self.heldout_pages = heldout_pages
        self.size = size
        self.min_gain = min_gain
        self.interval = interval
        self.background = background
        self._clock = clock
        self._count = 0
        self._train: list[bytes] = []
        self._heldout: list[bytes] = []
        self._busy = False
        self._next_round = 0.0
        self._thread: threading.Thread | None = None
        self.stats = TrainerStats()

    def observe(self, page) -> None:
        """Called for each page the store compresses; cheap unless it keeps a copy."""
        self._count += 1
        # Collect only once the next round is due: samples kept through the interval would be
        # stale by then and cost their 10 MiB of memory all along.
        if self._count % self.sample_every or self._busy or self._clock() < self._next_round:
            return
        target = self._heldout if self.stats.sampled % 5 == 4 else self._train
        self.stats.sampled += 1
        limit = self.heldout_pages if target is self._heldout else self.train_pages
        if len(target) < limit:
            target.append(bytes(page))
        if len(self._train) >= self.train_pages and len(self._heldout) >= self.heldout_pages:
            self._start_round()

    def _start_round(self) -> None:
        self._busy = True
        train, heldout = self._train, self._heldout
        self._train, self._heldout = [], []
        if self.background:
            self._thread = threading.Thread(target=self._round, args=(train, heldout),
                                            name="agentzip-dict-train", daemon=True)
            self._thread.start()
        else:
            self._round(train, heldout)

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _round(self, train: list[bytes], heldout: list[bytes]) -> None:
        try:
            self.train_and_maybe_adopt(train, heldout)
        except Exception as exc:  # a failed round must never hurt the data path
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.stats.rounds += 1
            self._next_round = self._clock() + self.interval
            self._busy = False

    def train_and_maybe_adopt(self, train: Sequence[bytes], heldout: Sequence[bytes]) -> bool:
        content = train_content(train, self.size)
        registry = self.registry
        # Own codecs: the store's compressors are in use by the write path meanwhile.
        level, page = registry.level, registry.page_size
        current = [ZstdCodec(level, page)] + [ZstdDictCodec(e.codec.content, level, page)
                                              for e in registry.candidates]
        best_now = np.minimum.reduce([sizes(c, heldout) for c in current])
        with_new = np.minimum(best_now, sizes(ZstdDictCodec(content, level, page), heldout))
        gain = float(best_now.sum()) / float(with_new.sum()) - 1
        self.stats.last_gain = round(gain, 4)
        if gain < self.min_gain:
            return False
        old_hosts = [e.id for e in registry.candidates if e.source == "host"]
        self.stats.adopted += 1
        registry.add(f"host-{self.stats.adopted}", content, "host",
                     {"trained_pages": len(train), "heldout_pages": len(heldout),
                      "heldout_gain": round(gain, 4), "adopted_at": time.time()})
        for dict_id in old_hosts:
            registry.retire(dict_id)
        return True

    def sample_bytes(self) -> int:
        """Memory held by the copies of sampled pages (counted in the store's stored_mem)."""
        return (len(self._train) + len(self._heldout)) * self.registry.page_size

    def summary(self) -> dict:
        st = self.stats
        return {"sampled": st.sampled, "rounds": st.rounds, "adopted": st.adopted,
                "last_gain": st.last_gain, "training": self._busy, "last_error": st.last_error}
