"""Where a write request's pages go: same-filled pages store their word, a page equal to one
already stored (or to an earlier page of the request) shares it, and the rest are grouped
into frames of `frame_pages` new pages compressed together.

Sharing is decided by comparing bytes, always: the keyed hash (dedup.PageHasher) only finds
the candidates, at most dedup.MAX_CANDIDATES per page. With `compression.dedup: off` no page
is shared with another (nothing is hashed or indexed); same-filled pages still store only
their word, which shares no data.

A frame holds the new pages of one write request in their order: zstd finds far more matches
across a frame's pages than inside one page. Pages that do not compress well enough together
(the codec decides: `codecs.pays`) are stored one by one, each compressed with the request's
dictionary choice or kept raw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..codec.codecs import RAW, Codec, CodecSet, alone_may_pay, pays
from ..codec.dictionaries import StoreDictionaries
from ..codec.dictionaries.selector import Choice
from .blobs import WARM
from .dedup import MAX_CANDIDATES, HashFn, PageHasher, index_key, unpack
from .objects import Counters, Objects
from .slots import BLOB, SAME

_NO_HASH = (0, 0)  # the hash of every page with dedup off: never looked up


def same_filled(data: memoryview, count: int, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For `count` pages of `data`: which are one 64-bit word repeated, and the slots' new
    (kind, handle) arrays with those words; BLOB pages get handle 0 until placed."""
    words = np.frombuffer(data, dtype=np.uint64).reshape(count, page_size // 8)
    same = (words == words[:, :1]).all(axis=1)
    kind = np.where(same, SAME, BLOB).astype(np.uint8)
    handle = np.where(same, words[:, 0], 0).astype(np.uint64)
    return same, kind, handle


@dataclass
class Prepared:
    """What a write request's pages are, worked out before the store lock is taken: which
    are same-filled (`same`, and the slots' new `kind`/`handle`), the others (`todo`, their
    `pages` and `hashes`), and `frames`: the compressed frame for each group of positions
    in `pages` that `place` will form if none of the pages is already stored, with the
    dictionary id it was compressed with."""
    same: np.ndarray
    kind: np.ndarray
    handle: np.ndarray
    todo: list[int]
    pages: list[memoryview]
    hashes: list[tuple[int, int]] | None = None
    copies: tuple[list[int], dict[int, int]] | None = None  # first_copies(pages, hashes)
    frames: dict[tuple[int, ...], tuple[bytes, int]] = field(default_factory=dict)
    # the warm form: each new page (by position in `pages`) compressed alone, fast
    warm: dict[int, bytes] = field(default_factory=dict)


def first_copies(pages: list[memoryview], hashes: list[tuple[int, int]],
                 dedup: bool = True) -> tuple[list[int], dict[int, int]]:
    """The positions of the first page of each content in a request, and for each later page
    equal to an earlier one, that earlier position. Equal hashes are only a hint: the bytes
    are compared, so pages that collide on the hash stay apart (the later is stored too)."""
    if not dedup:
        return list(range(len(pages))), {}
    first_of: dict[tuple[int, int], list[int]] = {}  # hash -> its first copies (capped)
    fresh: list[int] = []
    repeats: dict[int, int] = {}
    for n, h in enumerate(hashes):
        firsts = first_of.setdefault(h, [])
        earlier = next((e for e in firsts if pages[e] == pages[n]), None)
        if earlier is not None:
            repeats[n] = earlier
            continue
        if len(firsts) < MAX_CANDIDATES:
            firsts.append(n)
        fresh.append(n)
    return fresh, repeats


class _Chooser:
    """The request's encoder for pages compressed alone (a dictionary or none), picked from
    a sample page of the request, and only when the first such page comes: a request whose
    pages all go into frames pays no selection trials."""

    def __init__(self, dicts: StoreDictionaries, pages: list[memoryview]) -> None:
        self._dicts, self._pages = dicts, pages
        self._choice: Choice | None = None

    def get(self) -> Choice:
        if self._choice is None:
            self._choice = self._dicts.choose(self._pages)
        return self._choice


class Placer:
    def __init__(self, *, objects: Objects, codecs: CodecSet, frame_codec: Codec | None,
                 dicts: StoreDictionaries, counters: Counters, frame_pages: int,
                 hot_ticks: int, dedup: bool = True, hasher: HashFn | None = None,
                 warm_codec: Codec | None = None) -> None:
        self.objects = objects
        # The warm form's codec (compression.warm_algorithm): new pages are stored alone with
        # it, and the recompressor packs them into frames later. None: frames at once.
        self.warm_codec = warm_codec
        self.dedup = dedup
        # keyed, random per store; tests may pass a weak one to force collisions
        self.hasher: HashFn = hasher or PageHasher()
        self.codecs = codecs
        # Frames get their own compressor: zstd sizes its window from the frame size it is
        # told, and a 4 KiB window could not see the frame's earlier pages.
        self.frame_codec = frame_codec
        self.dicts = dicts
        self.counters = counters
        self.frame_pages = frame_pages
        self.hot_ticks = hot_ticks

    def split(self, data: memoryview, count: int, not_same: np.ndarray | None = None) -> Prepared:
        """Same-filled pages and the others, for `count` whole pages of `data`; pages in
        `not_same` are stored as blobs even if same-filled (no room for their word)."""
        page = self.objects.page_size
        same, kind, handle = same_filled(data, count, page)
        if not_same is not None:
            same &= ~not_same
            kind[not_same] = BLOB
            handle[not_same] = 0
        todo = np.flatnonzero(~same).tolist()
        return Prepared(same, kind, handle, todo, [data[i * page : (i + 1) * page] for i in todo])

    def prepare(self, data: memoryview, offset: int) -> Prepared | None:
        """`split`, the hashes, and the frames compressed, for a request of whole pages.
        Runs without the store lock and reads no store state: only the request's bytes."""
        page = self.objects.page_size
        if self.frame_codec is None and self.warm_codec is None:
            return None
        if not data or offset % page or len(data) % page:
            return None
        early = self.split(data, len(data) // page)
        early.hashes = self.hashes(early.pages)
        # worked out once, here, before the lock: `place` reuses it under the lock
        early.copies = first_copies(early.pages, early.hashes, self.dedup)
        fresh = early.copies[0]
        if self.warm_codec is not None:
            for n in fresh:
                try:
                    early.warm[n] = self.warm_codec.compress(early.pages[n])
                except Exception:  # noqa: BLE001 - compressed again under the lock, if needed
                    # A page that turns out to be stored already needs no compression: the
                    # failure counts only for a page that must be stored (place, under the
                    # lock), where it fails the request and changes nothing.
                    continue
            return early
        step = self.frame_pages
        groups = [tuple(fresh[start : start + step]) for start in range(0, len(fresh), step)]
        joined = [b"".join(early.pages[n] for n in g) for g in groups if len(g) > 1]
        if joined:  # one dictionary choice (maybe none) for the request's frames
            choice = self.dicts.choose_frames(joined)
            for k, group in enumerate(g for g in groups if len(g) > 1):
                out = choice.sample_out if k == choice.sample else choice.codec.compress(joined[k])
                early.frames[group] = (out, choice.dict_id)
        return early

    def hashes(self, pages: list[memoryview]) -> list[tuple[int, int]]:
        """The pages' keyed hashes; with dedup off, none is computed."""
        if not self.dedup:
            return [_NO_HASH] * len(pages)
        return [self.hasher(p) for p in pages]

    def place(self, pages: list[memoryview], now: int,
              placed: list[tuple[int, int]], staged: list[int],
              hashes: list[tuple[int, int]] | None = None,
              frames: dict[tuple[int, ...], tuple[bytes, int]] | None = None,
              copies: tuple[list[int], dict[int, int]] | None = None,
              warm: dict[int, bytes] | None = None) -> None:
        """Find or store a home for each page: an equal page already stored (any blob, any
        page of a frame), an equal page earlier in this request, or a new blob (warm, or
        in a frame). Fills `placed` with (blob, page in blob) and appends every reference
        taken to `staged`. `hashes`, `frames`, `copies` and `warm` come from `prepare`
        when it ran."""
        if hashes is None:
            hashes = self.hashes(pages)
        firsts, repeat_of = copies if copies is not None else first_copies(pages, hashes, self.dedup)
        fresh: list[int] = []  # positions of pages to store
        repeats: list[tuple[int, int]] = []  # (position, earlier position with equal bytes)
        found_at: set[int] = set()
        for n in firsts:
            lo, hi = hashes[n]
            found = self.lookup(pages[n], lo, hi, now) if self.dedup else None
            if found is not None:
                placed[n] = found
                staged.append(found[0])
                found_at.add(n)
            else:
                fresh.append(n)
        for n, earlier in repeat_of.items():
            if earlier in found_at:  # its first copy is a stored page: share that directly
                found = placed[earlier]
                self.objects.ref(found[0])
                staged.append(found[0])
                placed[n] = found
                self.counters.dedup_hits += 1
            else:
                repeats.append((n, earlier))
        if self.warm_codec is not None:
            for n in fresh:
                blob = self.store_warm(pages[n], hashes[n], now, (warm or {}).get(n))
                placed[n] = (blob, 0)
                staged.append(blob)
            fresh = []
        step = self.frame_pages
        chooser = _Chooser(self.dicts, pages)
        for start in range(0, len(fresh), step):
            self.store_group(fresh[start : start + step], pages, hashes, now, chooser,
                             placed, staged, frames)
        for n, earlier in repeats:
            blob = placed[earlier][0]
            self.objects.ref(blob)
            staged.append(blob)
            placed[n] = placed[earlier]
            self.counters.dedup_hits += 1

    def lookup(self, page: memoryview, lo: int, hi: int, now: int) -> tuple[int, int] | None:
        """(blob, page in blob) of a stored page equal to `page`, with one more reference."""
        objects = self.objects
        blobs = objects.blobs
        key = index_key(lo)
        for tried, value in enumerate(objects.index.candidates(key)):
            if tried >= MAX_CANDIDATES:  # the index keeps no more; never compare more
                break
            blob, sub = unpack(value)
            # The index keeps a 16-bit fingerprint; the blob table the full 32-bit key of
            # each stored page (blobs.members): a candidate whose key differs is no match
            # and costs no comparison. Otherwise the bytes decide.
            if int(blobs.members[blob, sub]) != key:
                continue
            self.counters.dedup_compares += 1
            equal = objects.page(blob, sub) == page
            if equal:
                objects.ref(blob)
                blobs.atime[blob] = now
                self.counters.dedup_hits += 1
                if int(blobs.rtime[blob]) and now - int(blobs.rtime[blob]) <= self.hot_ticks:
                    self.counters.pingpong += 1  # the same content came back right after a read
                return blob, sub
            self.counters.hash_collisions += 1
        return None

    def store_group(self, group: list[int], pages: list[memoryview],
                    hashes: list[tuple[int, int]], now: int, chooser: _Chooser | None,
                    placed: list[tuple[int, int]], staged: list[int],
                    frames: dict[tuple[int, ...], tuple[bytes, int]] | None = None) -> None:
        """Store the pages at positions `group`: as one frame when there are several and
        they compress well enough together, else one blob per page. `frames` may hold the
        group already compressed (a page found stored shifts the groups: then not)."""
        if len(group) > 1:
            # Compressed by `prepare` with the request's dictionary choice; recompressed here
            # (rare: the groups shifted, or that dictionary was unloaded since) without one.
            compressed, dict_id = (frames.get(tuple(group)) if frames else None) or (None, 0)
            if dict_id and not self.dicts.registry.registered(dict_id):
                compressed, dict_id = None, 0
            if compressed is None:
                compressed = self.frame_codec.compress(b"".join(pages[n] for n in group))
                self.counters.frames_compressed_locked += 1
            self.dicts.observe_frame([pages[n] for n in group])
            if pays(len(compressed), len(group)):
                keys = [index_key(hashes[n][0]) for n in group]
                blob = self.objects.new_frame(compressed, self.frame_codec.id, keys, now, dict_id)
                for sub, n in enumerate(group):
                    placed[n] = (blob, sub)
                    staged.append(blob)
                self.counters.frames_written += 1
                return
            self.counters.frame_fallbacks += 1
            if not alone_may_pay(len(compressed), len(group)):
                # random bytes: compressing each page again (under the lock) would only
                # cost every other tenant's requests time (issue 27, item 6)
                self.counters.frames_incompressible += 1
                for n in group:
                    lo, hi = hashes[n]
                    placed[n] = (self.objects.new_page(pages[n], RAW, 0, lo, hi, now, pages[n]), 0)
                    staged.append(placed[n][0])
                return
        for n in group:
            choice = chooser.get() if chooser is not None else None
            sample = choice.sample_out if choice is not None and n == choice.sample else None
            blob = self.store_page(pages[n], hashes[n], now, choice, sample)
            placed[n] = (blob, 0)
            staged.append(blob)

    def store_warm(self, page: memoryview, digest: tuple[int, int], now: int,
                   compressed: bytes | None = None) -> int:
        """A new one-page blob in the warm form: `page` compressed alone by the fast codec
        (`compressed`, when `prepare` did it), or raw when that does not pay."""
        stored, codec_id, _ = self.codecs.encode_page(page, self.warm_codec, 0, compressed)
        lo, hi = digest
        blob = self.objects.new_page(stored, codec_id, 0, lo, hi, now, page)
        self.objects.blobs.form[blob] = WARM
        return blob

    def store_page(self, page: memoryview, digest: tuple[int, int], now: int,
                   choice: Choice | None, compressed: bytes | None = None) -> int:
        """A new one-page blob holding `page`. `choice` is the request's encoder;
        `compressed` the page already compressed by it."""
        encoder = choice.codec if choice is not None else None
        dict_id = choice.dict_id if choice is not None else 0
        stored, codec_id, dict_id = self.codecs.encode_page(page, encoder, dict_id, compressed)
        self.dicts.observe(page)
        lo, hi = digest
        return self.objects.new_page(stored, codec_id, dict_id, lo, hi, now, page)
