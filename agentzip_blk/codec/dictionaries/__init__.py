"""zstd dictionaries: the shipped (prebuilt) ones, host-trained ones, and which one a write uses.

- **Prebuilt** dictionaries (`files`) are package data in ``agentzip_blk/dicts/``: one ``NAME.dict``
  (raw dictionary content) per runtime and ``manifest.json`` (name, runtime and version,
  corpus, size, training parameters, gain measured on held-out pages, sha256). A missing or
  corrupt file is a :class:`DictionaryError` (a ConfigError) when the store starts, never a
  wrong read later. ``AGENTZIP_DICT_DIR`` points at another directory (tests, operators).
- **Raw content, mostly.** A trained zstd dictionary carries entropy tables that zstd then
  uses for the whole (tiny) frame; on 4 KiB heap pages that lost ratio (docs/ARCHITECTURE.md,
  and again in tools/dicts/train.py), so shipped dictionaries are content only. `auto`
  tries both kinds on frames and keeps the better one (registry entries have a `kind`).
- **Frames** (`compression.frame_pages` > 1): a request's frames are compressed with one
  dictionary choice of their own (a second selector, trials on whole frames); the frame's
  blob records the dictionary id as a page's does. A dictionary primes only a frame's first
  pages, so the gains are smaller than on single pages (tools/bench_dicts.py).
- **Lazy.** A registered dictionary keeps its content; its zstd objects are made when a
  request first chooses it (registry.LoadedDict.load), so an unchosen one costs no more.
- **Registry** (`registry`). Every loaded dictionary has a small id (1..255; 0 = none) that the store
  records per blob. A dictionary leaves the candidate set when a better one is adopted but
  stays loaded until no blob refers to it; only then is it unloaded and its id reusable.
- **Selection** (`selector`): per write request, the candidates and "no dictionary"
  compress one sample page of the request and the smallest wins for the whole request (the
  kernel writes clusters of pages of one process together). Trials are paid from a budget
  of a few percent of compressions; between trials the last winner is reused.
- **Auto** (`trainer`): samples written units (frames when frames are on), trains a host
  dictionary in a background thread when enough exist, and adopts it only when it shrinks
  held-out samples written *after* the training window (not samples of the same window).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..codecs import ZSTD
from .files import DictionaryError, load_manifest
from .registry import DictionaryRegistry
from .selector import Choice, Selector
from .trainer import HostTrainer


def known_names(directory: str | None = None) -> set[str] | None:
    """The names of the shipped dictionaries, for the config check (`load_config(...,
    known_dictionaries=)`); None when the manifest is broken: check_setting and the store
    report that with the file named, so here it only leaves names unchecked."""
    try:
        return {info.name for info in load_manifest(directory)}
    except DictionaryError:
        return None


def check_setting(config) -> None:
    """Load and verify every dictionary `config.compression.dictionary` names: a missing or
    corrupt file raises DictionaryError now, before a server starts listening."""
    comp = config.compression
    if comp.algorithm == "zstd" and comp.dictionary != "none":
        DictionaryRegistry.from_setting(comp.dictionary, comp.level, comp.page_size)


class StoreDictionaries:
    """The store's dictionary machinery in one object: registry, selector, optional trainer."""

    COLLECT_EVERY = 1.0  # seconds between scans for unreferenced retired dictionaries

    # A dictionary must save this fraction of a sample frame's plain size to be chosen.
    # In frames a chosen dictionary costs ~1.6 MiB (its frame context and digested tables)
    # and the shipped ones save 0-0.5% there (tools/bench_dicts.py): 0.5% loaded them for
    # savings that never repay that memory; 2% cost the host dictionary 0.4% on JSON.
    FRAME_MARGIN = 0.01

    def __init__(self, writer, setting: str | list[str], level: int = 3, page_size: int = 4096,
                 clock: Callable[[], float] = time.monotonic, frame_writer=None,
                 frame_pages: int = 1, **trainer_kwargs) -> None:
        use = writer.id == ZSTD and setting != "none"
        self.setting = setting
        frames = frame_writer is not None and frame_pages > 1
        self.registry = DictionaryRegistry.from_setting(
            setting if use else "none", level, page_size, frame_pages=frame_pages if frames else 1)
        self.selector = Selector(writer, self.registry)
        # Frames: their own selector, with its own trial budget in frames.
        self.frame_selector = (Selector(frame_writer, self.registry, margin=self.FRAME_MARGIN,
                                        frames=True) if frames else None)
        self.trainer = (HostTrainer(self.registry, clock=clock,
                                    unit_pages=frame_pages if frames else 1, **trainer_kwargs)
                        if use and setting == "auto" else None)
        if self.trainer is not None:
            self.registry.extra_bytes = self.trainer.sample_bytes
        self._clock = clock
        self._next_collect = 0.0

    def choose(self, pages: Sequence) -> Choice:
        return self.selector.choose(pages)

    def choose_frames(self, frames: Sequence[bytes]) -> Choice:
        """The encoder for a request's frames (each the joined bytes of its pages)."""
        return self.frame_selector.choose(frames)  # type: ignore[union-attr]

    def observe(self, page) -> None:
        """A page compressed alone (the trainer learns from these when frames are off)."""
        if self.trainer is not None and self.trainer.unit_pages == 1:
            self.trainer.observe(page)

    def observe_frame(self, frame) -> None:
        """A frame compressed (the trainer learns from whole frames when frames are on)."""
        if self.trainer is not None and self.trainer.unit_pages > 1:
            self.trainer.observe(frame)

    def maybe_collect(self, blobs) -> None:
        """Unload retired dictionaries nobody uses; the caller holds the store lock."""
        if not self.registry.has_retired():
            return
        now = self._clock()
        if now < self._next_collect:
            return
        self._next_collect = now + self.COLLECT_EVERY
        live = blobs.live()
        self.registry.collect(blobs.dict_id[live])

    def stats(self, blobs, slot_blobs: np.ndarray, page_size: int = 4096) -> dict:
        ids = blobs.dict_id[slot_blobs]
        lengths = blobs.length[slot_blobs].astype(np.float64) / np.maximum(
            blobs.ref[slot_blobs].astype(np.float64), 1)
        out = {"setting": self.setting if isinstance(self.setting, str) else ",".join(self.setting),
               "in_use": self.registry.stats(ids, lengths, page_size),
               "selection": self.selector.summary(),
               "frame_selection": (self.frame_selector.summary()
                                   if self.frame_selector is not None else None),
               "loaded": sorted(self.registry.loaded_names()),
               "unloaded": self.registry.unloaded}
        if self.trainer is not None:
            out["auto"] = self.trainer.summary()
        return out
