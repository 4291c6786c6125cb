"""The registered dictionaries by id (1..255; 0 = none), the id the store records per blob.

Registering a dictionary keeps its content (~32-64 KiB, checked against the manifest when the
store starts); its zstd objects (digested tables, contexts: most of what a dictionary costs,
and more for frames) are made on first choice (`LoadedDict.load`), so a dictionary that no
request has chosen costs its content and nothing more. Selection trials of such a dictionary
use a context made for the trial (codecs.trial_compress).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from ...errors import CodecError
from ..codecs import Codec, PooledCodec, ZstdDictCodec, trial_compress
from .files import DictionaryError, load_content, load_manifest

MAX_ID = 255  # the blob table stores dictionary ids as uint8


@dataclass
class LoadedDict:
    """One registered dictionary. `codec` (pages), `frame_codec` (frames of `frame_pages`)
    and `decoder` are made on first use and kept: `loaded` says whether that happened."""

    id: int
    name: str
    source: str  # "prebuilt" | "host" | "file"
    content: bytes
    info: dict
    candidate: bool = True
    kind: str = "raw"  # codecs.DICT_KINDS
    frames: bool = True  # a candidate for frames too (else for pages compressed alone only)
    level: int = 3
    page_size: int = 4096
    frame_pages: int = 1
    _page: ZstdDictCodec | None = field(default=None, repr=False)
    _frame: PooledCodec | None = field(default=None, repr=False)
    _decoder: ZstdDictCodec | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def loaded(self) -> bool:
        """Whether any of its zstd objects exist (a request chose it, or a blob uses it)."""
        return self._page is not None or self._frame is not None or self._decoder is not None

    def load(self, frame: bool | None = None) -> None:
        """Make the zstd objects for pages (`frame` False), frames (True) or whichever
        the registry compresses (None: frames when frames are on). The decoder comes with
        either. Request threads may race here: one wins."""
        if frame is None:
            frame = self.frame_pages > 1
        if (self._frame if frame and self.frame_pages > 1 else self._page) is not None:
            return
        with self._lock:
            if frame and self.frame_pages > 1:
                if self._frame is None:
                    size = self.frame_pages * self.page_size
                    first = ZstdDictCodec(self.content, self.level, size, self.kind)
                    made = [first]  # the pool's first context owns the digested tables

                    def make() -> ZstdDictCodec:
                        if made:
                            return made.pop()
                        return ZstdDictCodec(self.content, self.level, size, self.kind,
                                             shared=first)
                    self._frame = PooledCodec(make)
                    self._decoder = self._decoder or first
            elif self._page is None:
                self._page = ZstdDictCodec(self.content, self.level, self.page_size, self.kind)
                self._decoder = self._decoder or self._page

    @property
    def codec(self) -> ZstdDictCodec:
        """The codec for pages compressed alone."""
        self.load(frame=False)
        return self._page  # type: ignore[return-value]

    @property
    def frame_codec(self) -> Codec | PooledCodec:
        self.load(frame=True)
        return self._frame or self._page  # type: ignore[return-value]

    @property
    def decoder(self) -> ZstdDictCodec:
        """Decodes any blob of this dictionary (decoding does not depend on the size the
        compressor was made for)."""
        if self._decoder is None:
            self.load()
        return self._decoder  # type: ignore[return-value]

    def trial(self, data, frame: bool) -> bytes:
        """`data` compressed with this dictionary for a selection trial: by the loaded
        codec when there is one, else without loading anything."""
        codec = self._frame if frame and self.frame_pages > 1 else self._page
        if codec is not None:
            return codec.compress(data)
        size = self.frame_pages * self.page_size if frame else self.page_size
        return trial_compress(self.content, self.kind, self.level, size, data)

    def memory_bytes(self) -> int:
        held = len(self.content)
        if self._page is not None:
            held += self._page.memory_bytes()
        if self._frame is not None:
            held += self._frame.memory_bytes()
        return held


class DictionaryRegistry:
    """Registered dictionaries by id. `candidates` (and `frame_candidates`, those of them
    frames try) are replaced, never mutated, so a writer can take one once per request
    without a lock."""

    def __init__(self, level: int = 3, page_size: int = 4096, frame_pages: int = 1) -> None:
        self.level = level
        self.page_size = page_size
        self.frame_pages = frame_pages
        self._by_id: dict[int, LoadedDict] = {}
        self.candidates: tuple[LoadedDict, ...] = ()
        self.frame_candidates: tuple[LoadedDict, ...] = ()
        self._last_id = 0
        self.unloaded = 0
        self.extra_bytes: Callable[[], int] = lambda: 0  # e.g. the host trainer's samples
        # told of each dictionary before any writer may take it, and of each one unloaded:
        # the store keeps them where a crash does not lose them (store.shared)
        self.on_added: Callable[[LoadedDict], None] = lambda entry: None
        self.on_unloaded: Callable[[int], None] = lambda dict_id: None
        self._lock = threading.Lock()  # adds/retires may come from the trainer thread

    @classmethod
    def from_setting(cls, setting: str | list[str], level: int = 3, page_size: int = 4096,
                     directory: str | None = None, frame_pages: int = 1) -> DictionaryRegistry:
        """The registry for `compression.dictionary`: none, prebuilt/auto (every shipped
        dictionary) or a list of names. Raises DictionaryError on a bad file or name.

        With `auto` the shipped dictionaries are candidates for pages compressed alone only,
        not for frames: in 16-page frames they saved 0-0.5% on the four workloads while a
        chosen one costs ~1.6 MiB (tools/bench_dicts.py, BENCHMARKS.md), so frames use the
        host's own dictionaries there. Named explicitly (`prebuilt`, a list) they are
        tried on frames too."""
        registry = cls(level, page_size, frame_pages)
        if setting == "none":
            return registry
        manifest = {info.name: info for info in load_manifest(directory)}
        names = list(manifest) if setting in ("auto", "prebuilt") else list(setting)
        for name in names:
            if name not in manifest:
                raise DictionaryError(f"compression.dictionary: unknown dictionary {name!r} "
                                      f"(known: {', '.join(sorted(manifest)) or 'none'})")
            info = manifest[name]
            registry.add(name, load_content(info, directory), "prebuilt", asdict(info),
                         frames=setting != "auto")
        return registry

    def add(self, name: str, content: bytes, source: str, info: dict | None = None,
            candidate: bool = True, kind: str = "raw", frames: bool = True) -> LoadedDict:
        """Register a dictionary (not loaded: see LoadedDict.load)."""
        if kind == "full" and not bytes(content[:4]) == b"\x37\xa4\x30\xec":
            raise CodecError(f"dictionary {name!r}: not a trained zstd dictionary")
        with self._lock:
            # The next free id after the last one given: frames are compressed before the
            # store lock, so a frame may name a dictionary that was retired and unloaded
            # meanwhile; the store checks `registered` under its lock, and an id is not
            # given out again until 255 others were (weeks of adoption rounds).
            order = [1 + (self._last_id + k) % MAX_ID for k in range(MAX_ID)]
            free = next((i for i in order if i not in self._by_id), None)
            if free is None:
                raise CodecError(f"more than {MAX_ID} dictionaries loaded")
            entry = LoadedDict(free, name, source, bytes(content), dict(info or {}), candidate,
                               kind, frames, self.level, self.page_size, self.frame_pages)
            self.on_added(entry)  # raises: not added
            self._last_id = free
            self._by_id[free] = entry
            if candidate:
                self.candidates = (*self.candidates, entry)
                if frames:
                    self.frame_candidates = (*self.frame_candidates, entry)
        return entry

    def restore_entries(self, entries: list[tuple]) -> None:
        """Put dictionaries back under the ids blobs name them by (a store rebuilt after
        a crash, store.recovery): each (id, name, source, content, info, candidate, kind,
        frames). An id already registered (the new setting's) is replaced by the old one:
        the blobs were written with that content."""
        with self._lock:
            for dict_id, name, source, content, info, candidate, kind, frames in entries:
                entry = LoadedDict(dict_id, name, source, bytes(content), dict(info or {}),
                                   candidate, kind, frames, self.level, self.page_size,
                                   self.frame_pages)
                self._by_id[dict_id] = entry
                self._last_id = max(self._last_id, dict_id)
            self.candidates = tuple(e for e in self._by_id.values() if e.candidate)
            self.frame_candidates = tuple(e for e in self.candidates if e.frames)

    def retire(self, dict_id: int) -> None:
        """No new writes use it; it stays loaded while blobs refer to it."""
        with self._lock:
            entry = self._by_id.get(dict_id)
            if entry is not None:
                entry.candidate = False
                self.candidates = tuple(e for e in self.candidates if e.id != dict_id)
                self.frame_candidates = tuple(e for e in self.frame_candidates
                                              if e.id != dict_id)

    def has_retired(self) -> bool:
        return any(not e.candidate for e in self._by_id.values())

    def collect(self, blob_dict_ids: np.ndarray) -> list[int]:
        """Unload retired dictionaries that no live blob refers to. `blob_dict_ids` are the
        dictionary ids of all live blobs; call it where no write is in flight (store lock)."""
        counts = np.bincount(blob_dict_ids.astype(np.int64), minlength=MAX_ID + 1)
        gone = []
        with self._lock:
            for dict_id, entry in list(self._by_id.items()):
                if not entry.candidate and counts[dict_id] == 0:
                    del self._by_id[dict_id]
                    self.on_unloaded(dict_id)
                    gone.append(dict_id)
            self.unloaded += len(gone)
        return gone

    def registered(self, dict_id: int) -> bool:
        return dict_id in self._by_id

    def get(self, dict_id: int) -> LoadedDict:
        try:
            return self._by_id[dict_id]
        except KeyError:
            raise CodecError(f"dictionary id {dict_id} is not loaded") from None

    def decoder(self, dict_id: int) -> ZstdDictCodec:
        return self.get(dict_id).decoder

    def loaded(self) -> list[LoadedDict]:
        """Every registered dictionary, loaded or not (by id)."""
        return sorted(self._by_id.values(), key=lambda e: e.id)

    def loaded_names(self) -> set[str]:
        """The dictionaries whose zstd objects exist (some request chose them)."""
        return {e.name for e in list(self._by_id.values()) if e.loaded}

    def memory_bytes(self) -> int:
        return sum(e.memory_bytes() for e in list(self._by_id.values())) + self.extra_bytes()

    def stats(self, dict_ids: np.ndarray, lengths: np.ndarray, page_size: int = 4096) -> list[dict]:
        """Per loaded dictionary: pages (slots) compressed with it, their stored bytes and
        ratio. `dict_ids`/`lengths` are per slot holding a zstd blob (length / refcount)."""
        out = []
        for e in self.loaded():
            mask = dict_ids == e.id
            pages = int(mask.sum())
            stored = float(lengths[mask].sum())
            out.append({"id": e.id, "name": e.name, "source": e.source, "candidate": e.candidate,
                        "kind": e.kind, "loaded": e.loaded,
                        "pages": pages, "stored_bytes": int(stored),
                        "ratio": round(pages * page_size / stored, 3) if stored else 0.0})
        return out
