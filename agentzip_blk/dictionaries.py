"""zstd dictionaries: the shipped (prebuilt) ones, host-trained ones, and which one a write uses.

- **Prebuilt** dictionaries are package data in ``agentzip_blk/dicts/``: one ``NAME.dict``
  (raw dictionary content) per runtime and ``manifest.json`` (name, runtime and version,
  corpus, size, training parameters, gain measured on held-out pages, sha256). A missing or
  corrupt file is a :class:`DictionaryError` (a ConfigError) when the store starts, never a
  wrong read later. ``AGENTZIP_DICT_DIR`` points at another directory (tests, operators).
- **Raw content, not trained dictionaries.** A trained zstd dictionary carries entropy tables
  that zstd then uses for the whole (tiny) frame; on 4 KiB heap pages that lost ratio
  (DESIGN.md, and again in tools/dicts/train.py). We keep only the content part.
- **Registry.** Every loaded dictionary has a small id (1..255; 0 = none) that the store
  records per blob. A dictionary leaves the candidate set when a better one is adopted but
  stays loaded until no blob refers to it; only then is it unloaded and its id reusable.
- **Selection** (:class:`Selector`): per write request, the candidates and "no dictionary"
  compress one sample page of the request and the smallest wins for the whole request (the
  kernel writes clusters of pages of one process together). Trials are paid from a budget
  of a few percent of compressions; between trials the last winner is reused.
- **Auto** (:class:`HostTrainer`): samples written pages, trains a host dictionary in a
  background thread when enough exist, and adopts it only when it shrinks held-out samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import zstandard

from . import config as _config
from .codec import ZSTD, CodecError, ZstdCodec, ZstdDictCodec
from .config import ConfigError

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dicts")
MANIFEST = "manifest.json"
MAX_ID = 255  # the blob table stores dictionary ids as uint8
FILE_MAGIC = b"AZDICT1\n"  # `dict train -o FILE`: magic, one JSON line, then the content
_REP_OFFSETS = b"\x01\x00\x00\x00\x04\x00\x00\x00\x08\x00\x00\x00"  # end of a zstd dict header
STORE_LIMIT = 3072  # the store keeps pages whose compressed size exceeds this raw


class DictionaryError(ConfigError):
    """A dictionary file is missing, corrupt or unknown; the message names the file."""


@dataclass
class DictInfo:
    name: str
    runtime: str = ""
    version: str = ""
    corpus: str = ""
    size: int = 0
    params: dict = field(default_factory=dict)
    gain: dict = field(default_factory=dict)  # held-out workload -> relative gain over zstd
    sha256: str = ""
    file: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> DictInfo:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def dict_dir() -> str:
    return os.environ.get("AGENTZIP_DICT_DIR") or PACKAGE_DIR


def load_manifest(directory: str | None = None) -> list[DictInfo]:
    directory = directory or dict_dir()
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return [DictInfo.from_dict(d) for d in data["dictionaries"]]
    except FileNotFoundError:
        raise DictionaryError(f"{path}: dictionary manifest missing (reinstall agentzip-blk, "
                              f"or set compression.dictionary: none)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DictionaryError(f"{path}: corrupt dictionary manifest: {exc}") from None


def load_content(info: DictInfo, directory: str | None = None) -> bytes:
    """The dictionary's content, checked against the manifest's size and sha256."""
    directory = directory or dict_dir()
    path = os.path.join(directory, info.file or f"{info.name}.dict")
    try:
        with open(path, "rb") as f:
            content = f.read()
    except FileNotFoundError:
        raise DictionaryError(f"dictionary {info.name!r}: {path} is missing (reinstall "
                              f"agentzip-blk, or drop it from compression.dictionary)") from None
    except OSError as exc:
        raise DictionaryError(f"dictionary {info.name!r}: cannot read {path}: {exc}") from None
    digest = hashlib.sha256(content).hexdigest()
    if len(content) != info.size or digest != info.sha256:
        raise DictionaryError(
            f"dictionary {info.name!r}: {path} is corrupt ({len(content)} bytes, sha256 "
            f"{digest[:12]}..., manifest says {info.size} bytes, {info.sha256[:12]}...); "
            f"reinstall agentzip-blk, or drop it from compression.dictionary")
    return content


def known_names(directory: str | None = None) -> set[str]:
    return {info.name for info in load_manifest(directory)}


def publish_names() -> None:
    """Let the config check dictionary names (config.KNOWN_DICTIONARIES). Entry points that
    load a real config call it first; importing this module does not, so the config module
    alone keeps its syntax-only checking. A broken manifest is reported by check_setting /
    the store (with the file named), so here it only leaves names unchecked."""
    try:
        _config.KNOWN_DICTIONARIES = known_names()
    except DictionaryError:
        pass


def check_setting(config) -> None:
    """Load and verify every dictionary `config.compression.dictionary` names: a missing or
    corrupt file raises DictionaryError now, before a server starts listening."""
    comp = config.compression
    if comp.algorithm == "zstd" and comp.dictionary != "none":
        DictionaryRegistry.from_setting(comp.dictionary, comp.level, comp.page_size)


# --- dictionary files made by `dict train` -------------------------------------------------

def write_file(path: str, content: bytes, meta: dict) -> None:
    meta = dict(meta, size=len(content), sha256=hashlib.sha256(content).hexdigest())
    with open(path, "wb") as f:
        f.write(FILE_MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n" + content)


def read_file(path: str) -> tuple[bytes, dict]:
    """(content, metadata) of a `dict train` file, or of a bare content file (a shipped
    .dict: its manifest entry becomes the metadata when the sha256 matches)."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(FILE_MAGIC):
        header, _, content = data[len(FILE_MAGIC):].partition(b"\n")
        try:
            meta = json.loads(header)
        except ValueError as exc:
            raise DictionaryError(f"{path}: corrupt dictionary header: {exc}") from None
        if meta.get("sha256") != hashlib.sha256(content).hexdigest():
            raise DictionaryError(f"{path}: corrupt dictionary (sha256 does not match its header)")
        return content, meta
    digest = hashlib.sha256(data).hexdigest()
    meta = {"size": len(data), "sha256": digest}
    try:
        for info in load_manifest(os.path.dirname(os.path.abspath(path))):
            if info.sha256 == digest:
                meta = asdict(info)
    except DictionaryError:
        pass
    return data, meta


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


def stored_size(n: int, page_size: int = 4096) -> int:
    """Bytes the store keeps for a page compressed to n bytes (raw above STORE_LIMIT)."""
    return n if n <= STORE_LIMIT else page_size


def sizes(codec, pages: Sequence[bytes]) -> np.ndarray:
    return np.fromiter((stored_size(len(codec.compress(p))) for p in pages), dtype=np.int64,
                       count=len(pages))


# --- registry ---------------------------------------------------------------------------------

@dataclass
class LoadedDict:
    id: int
    name: str
    source: str  # "prebuilt" | "host" | "file"
    codec: ZstdDictCodec
    info: dict
    candidate: bool = True


class DictionaryRegistry:
    """Loaded dictionaries by id. `candidates` is replaced, never mutated, so a writer can
    take it once per request without a lock."""

    def __init__(self, level: int = 3, page_size: int = 4096) -> None:
        self.level = level
        self.page_size = page_size
        self._by_id: dict[int, LoadedDict] = {}
        self.candidates: tuple[LoadedDict, ...] = ()
        self.unloaded = 0
        self.extra_bytes: Callable[[], int] = lambda: 0  # e.g. the host trainer's samples
        self._lock = threading.Lock()  # adds/retires may come from the trainer thread

    @classmethod
    def from_setting(cls, setting: str | list[str], level: int = 3, page_size: int = 4096,
                     directory: str | None = None) -> DictionaryRegistry:
        """The registry for `compression.dictionary`: none, prebuilt/auto (every shipped
        dictionary) or a list of names. Raises DictionaryError on a bad file or name."""
        registry = cls(level, page_size)
        if setting == "none":
            return registry
        manifest = {info.name: info for info in load_manifest(directory)}
        names = list(manifest) if setting in ("auto", "prebuilt") else list(setting)
        for name in names:
            if name not in manifest:
                raise DictionaryError(f"compression.dictionary: unknown dictionary {name!r} "
                                      f"(known: {', '.join(sorted(manifest)) or 'none'})")
            info = manifest[name]
            registry.add(name, load_content(info, directory), "prebuilt", asdict(info))
        return registry

    def add(self, name: str, content: bytes, source: str, info: dict | None = None,
            candidate: bool = True) -> LoadedDict:
        codec = ZstdDictCodec(content, self.level, self.page_size)
        with self._lock:
            free = next((i for i in range(1, MAX_ID + 1) if i not in self._by_id), None)
            if free is None:
                raise CodecError(f"more than {MAX_ID} dictionaries loaded")
            entry = LoadedDict(free, name, source, codec, dict(info or {}), candidate)
            self._by_id[free] = entry
            if candidate:
                self.candidates = (*self.candidates, entry)
        return entry

    def retire(self, dict_id: int) -> None:
        """No new writes use it; it stays loaded while blobs refer to it."""
        with self._lock:
            entry = self._by_id.get(dict_id)
            if entry is not None:
                entry.candidate = False
                self.candidates = tuple(e for e in self.candidates if e.id != dict_id)

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
                    gone.append(dict_id)
            self.unloaded += len(gone)
        return gone

    def get(self, dict_id: int) -> LoadedDict:
        try:
            return self._by_id[dict_id]
        except KeyError:
            raise CodecError(f"dictionary id {dict_id} is not loaded") from None

    def decoder(self, dict_id: int) -> ZstdDictCodec:
        return self.get(dict_id).codec

    def loaded(self) -> list[LoadedDict]:
        return sorted(self._by_id.values(), key=lambda e: e.id)

    def memory_bytes(self) -> int:
        return sum(e.codec.memory_bytes() for e in list(self._by_id.values())) + self.extra_bytes()

    def stats(self, dict_ids: np.ndarray, lengths: np.ndarray, page_size: int = 4096) -> list[dict]:
        """Per loaded dictionary: pages (slots) compressed with it, their stored bytes and
        ratio. `dict_ids`/`lengths` are per slot holding a zstd blob (length / refcount)."""
        out = []
        for e in self.loaded():
            mask = dict_ids == e.id
            pages = int(mask.sum())
            stored = float(lengths[mask].sum())
            out.append({"id": e.id, "name": e.name, "source": e.source, "candidate": e.candidate,
                        "pages": pages, "stored_bytes": int(stored),
                        "ratio": round(pages * page_size / stored, 3) if stored else 0.0})
        return out


# --- per-request selection -------------------------------------------------------------------

@dataclass
class Choice:
    codec: ZstdCodec
    dict_id: int
    sample: int = -1  # index (in the request's page list) of the trial page, or -1
    sample_out: bytes | None = None  # the winner's output for that page (reused, not redone)


@dataclass
class SelectionStats:
    requests: int = 0
    trials: int = 0
    extra_compressions: int = 0  # trial compressions whose output was thrown away
    seconds: float = 0.0  # time spent in trials, all of it (the reused output included)
    wins: dict = field(default_factory=dict)  # name -> trials won


class Selector:
    """Chooses the encoder (writer alone, or writer + a dictionary) for each write request.

    Cost control: every compressed page earns `budget` credits; a trial costs one credit per
    discarded compression (the winner's output for the sample page is kept). Without credits
    the previous winner is reused: consecutive requests usually come from the same cgroup.
    A dictionary must beat "no dictionary" on the sample page by `margin` (a fraction of
    that page's plain size): the minimum over several candidates on one page is biased
    towards a win, and a dictionary that wins by a few bytes on the sample loses on the
    rest of the request about as often (measured on V8 heaps; and a dictionary costs ~30%
    compression speed). When few trials find a dictionary worth it, the budget shrinks to
    `min_budget`, so a workload dictionaries do not help pays (almost) nothing.
    """

    def __init__(self, writer: ZstdCodec, registry: DictionaryRegistry | None,
                 budget: float = 0.05, min_budget: float = 0.01, margin: float = 0.02) -> None:
        self.writer = writer
        self.registry = registry
        self.max_budget = budget
        self.min_budget = min_budget
        self.budget = budget
        self.margin = margin
        self.credits = 0.0
        self._sticky: LoadedDict | None = None
        self._window_wins = 0  # trials in the current window that chose a dictionary
        self.stats = SelectionStats()
        self._clock = time.perf_counter

    @property
    def active(self) -> bool:
        return self.registry is not None and bool(self.registry.candidates) and self.writer.id == ZSTD

    def choose(self, pages: Sequence) -> Choice:
        """`pages`: the request's pages that will be compressed (not same-filled)."""
        registry = self.registry
        candidates = registry.candidates if registry is not None else ()
        if not candidates or not pages or self.writer.id != ZSTD:
            return Choice(self.writer, 0)
        self.stats.requests += 1
        cost = len(candidates)
        self.credits = min(self.credits + len(pages) * self.budget, 4.0 * cost + 1)
        sticky = self._sticky
        if self.credits < cost and (sticky is None or sticky.candidate):
            if sticky is None:
                return Choice(self.writer, 0)
            return Choice(sticky.codec, sticky.id)
        self.credits = max(0.0, self.credits - cost)
        t0 = self._clock()
        index = len(pages) // 2
        page = pages[index]
        none_out = self.writer.compress(page)
        best_out, best = none_out, None
        for entry in candidates:
            out = entry.codec.compress(page)
            if len(out) < len(best_out):
                best_out, best = out, entry
        if best is not None and len(none_out) - len(best_out) < self.margin * len(none_out):
            best_out, best = none_out, None  # not worth a dictionary
        self._sticky = best
        st = self.stats
        st.trials += 1
        st.extra_compressions += cost
        name = best.name if best else "none"
        st.wins[name] = st.wins.get(name, 0) + 1
        self._adapt(best is not None)
        st.seconds += self._clock() - t0
        if best is None:
            return Choice(self.writer, 0, index, best_out)
        return Choice(best.codec, best.id, index, best_out)

    def _adapt(self, dictionary_won: bool) -> None:
        self._window_wins += dictionary_won
        if self.stats.trials % 32 == 0:
            # under 1 win in 8 trials: dictionaries do little for what is written now
            self.budget = self.max_budget if self._window_wins >= 4 else self.min_budget
            self._window_wins = 0

    def summary(self) -> dict:
        st = self.stats
        return {"requests": st.requests, "trials": st.trials,
                "extra_compressions": st.extra_compressions,
                "trial_seconds": round(st.seconds, 6), "budget": self.budget, "wins": dict(st.wins)}


# --- auto: host-trained dictionaries ---------------------------------------------------------

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


# --- what the store holds ----------------------------------------------------------------------

class StoreDictionaries:
    """The store's dictionary machinery in one object: registry, selector, optional trainer."""

    COLLECT_EVERY = 1.0  # seconds between scans for unreferenced retired dictionaries

    def __init__(self, writer, setting: str | list[str], level: int = 3, page_size: int = 4096,
                 clock: Callable[[], float] = time.monotonic, **trainer_kwargs) -> None:
        use = writer.id == ZSTD and setting != "none"
        self.setting = setting
        self.registry = DictionaryRegistry.from_setting(setting if use else "none", level, page_size)
        self.selector = Selector(writer, self.registry)
        self.trainer = (HostTrainer(self.registry, clock=clock, **trainer_kwargs)
                        if use and setting == "auto" else None)
        if self.trainer is not None:
            self.registry.extra_bytes = self.trainer.sample_bytes
        self._clock = clock
        self._next_collect = 0.0

    def choose(self, pages: Sequence) -> Choice:
        return self.selector.choose(pages)

    def observe(self, page) -> None:
        if self.trainer is not None:
            self.trainer.observe(page)

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
               "unloaded": self.registry.unloaded}
        if self.trainer is not None:
            out["auto"] = self.trainer.summary()
        return out
