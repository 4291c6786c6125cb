"""Dictionaries inside multi-page frames: frames compressed with a raw-content or a full
(trained) dictionary round-trip byte for byte through overwrites, trims and maintenance,
their blob records the dictionary, and dictionaries load only when a request chooses one."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from agentzip_blk.codec.dictionaries.trainer import as_kind, train_dictionary
from agentzip_blk.store import PageStore
from tests.store import test_store as base

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

PAGE = 4096
WORDS = [b'{"role": "tool",', b'"content":', b'"result"', b'"arguments":', b"value", b"42,",
         b"\\n", b"null", b"true"]


def text_page(seed: int) -> bytes:
    rnd = random.Random(seed)
    return b" ".join(rnd.choice(WORDS) + str(rnd.randrange(100)).encode()
                     for _ in range(PAGE))[:PAGE]


_TRAINED: dict[tuple, bytes] = {}


def trained(frame_pages: int, model: bool = False) -> bytes:
    """A full zstd dictionary trained on frames of text pages (cached): of this file's
    text pages, or (`model`) of the store model's text pages."""
    key = (frame_pages, model)
    if key not in _TRAINED:
        rnd = random.Random(3)
        page = ((lambda i: base.page_content("text", rnd.randrange(6))) if model else
                (lambda i: text_page(1000 + i)))
        frames = [b"".join(page(frame_pages * i + k) for k in range(frame_pages))
                  for i in range(120)]
        _TRAINED[key] = train_dictionary(frames, 16384)
    return _TRAINED[key]


def dict_store(kind: str, frame_pages: int = 4, pages: int = 256,
               model: bool = False) -> tuple[PageStore, object]:
    """A store whose frames always try the one registered dictionary (and take it whenever
    it is smaller at all)."""
    store = PageStore(pages * PAGE, max_size=64 << 20, frame_pages=frame_pages, dictionary="none")
    entry = store.dicts.registry.add(f"test-{kind}", as_kind(trained(frame_pages, model), kind),
                                     "host", kind=kind)
    sel = store.dicts.frame_selector
    sel.budget = sel.max_budget = sel.min_budget = 10.0
    sel.margin = 0.0
    return store, entry


def frame_blobs(store: PageStore) -> np.ndarray:
    live = np.flatnonzero(store.blobs.live())
    return live[store.blobs.pages[live] > 1]


@pytest.mark.parametrize("kind", ["raw", "full"])
def test_frames_with_a_dictionary_round_trip_and_record_it(kind: str):
    store, entry = dict_store(kind)
    data = b"".join(text_page(i) for i in range(64))
    for first in range(0, 64, 16):
        store.write(data[first * PAGE:(first + 16) * PAGE], first * PAGE)
    frames = frame_blobs(store)
    assert len(frames) == 16
    # every frame's blob names the dictionary it was compressed with
    assert set(store.blobs.dict_id[frames].tolist()) == {entry.id}
    assert entry.kind == kind and entry.loaded
    assert bytes(store.read(0, 64 * PAGE)) == data
    for blob in frames.tolist():  # decoded again, not from the frame cache
        store.objects.frames.discard(blob)
    assert bytes(store.read(5 * PAGE, PAGE)) == data[5 * PAGE:6 * PAGE]
    store.check()


@pytest.mark.parametrize("kind", ["raw", "full"])
def test_overwrite_and_trim_inside_a_dictionary_frame_keep_the_others(kind: str):
    store, entry = dict_store(kind)
    data = bytearray(b"".join(text_page(500 + i) for i in range(16)))
    store.write(bytes(data), 0)
    frames = frame_blobs(store)
    assert len(frames) == 4 and set(store.blobs.dict_id[frames].tolist()) == {entry.id}
    new = text_page(9999)
    store.write(new, 1 * PAGE)  # one page of the first frame overwritten
    data[PAGE:2 * PAGE] = new
    store.trim(6 * PAGE, PAGE)  # one page of the second frame trimmed
    data[6 * PAGE:7 * PAGE] = bytes(PAGE)
    store.write(bytes(PAGE // 2) + b"x" * (PAGE // 2), 10 * PAGE + 0)  # and one replaced
    data[10 * PAGE:11 * PAGE] = bytes(PAGE // 2) + b"x" * (PAGE // 2)
    for blob in frames.tolist():
        store.objects.frames.discard(blob)  # the others must decode from the frame again
    for slot in range(16):
        assert bytes(store.read(slot * PAGE, PAGE)) == data[slot * PAGE:(slot + 1) * PAGE], slot
    store.maintain()  # sparse frames may be rewritten
    assert bytes(store.read(0, 16 * PAGE)) == bytes(data)
    store.check()


def test_a_dictionary_no_request_chose_is_not_loaded():
    store = PageStore(512 * PAGE, max_size=64 << 20, frame_pages=16, dictionary="prebuilt")
    registry = store.dicts.registry
    assert registry.loaded() and registry.loaded_names() == set()  # registered, none loaded
    lazy = registry.memory_bytes()
    assert lazy == sum(len(e.content) for e in registry.loaded())  # their content, no codecs
    sel = store.dicts.frame_selector
    sel.budget = sel.max_budget = sel.min_budget = 10.0  # a trial on every request
    sel.margin = 0.0  # and any saving chooses a dictionary
    rnd = random.Random(5)
    noise = b"".join(bytes(rnd.randrange(8) for _ in range(PAGE)) for _ in range(64))
    store.write(noise, 0)  # no dictionary helps random bytes: trials ran, none chosen
    assert sel.stats.trials >= 1 and set(sel.stats.wins) == {"none"}
    assert registry.loaded_names() == set()
    assert registry.memory_bytes() == lazy
    assert set(store.blobs.dict_id[store.blobs.live()].tolist()) == {0}
    assert bytes(store.read(0, 64 * PAGE)) == noise
    # a request a dictionary wins: that one (and only what won) gets loaded
    entry = store.dicts.registry.add("json", as_kind(trained(16), "raw"), "host")
    data = b"".join(text_page(7000 + i) for i in range(32))
    store.write(data, 100 * PAGE)
    won = {name for name, n in sel.stats.wins.items() if n and name != "none"}
    assert won and registry.loaded_names() == won
    assert entry.name in won
    assert registry.memory_bytes() > lazy
    assert bytes(store.read(100 * PAGE, 32 * PAGE)) == data
    store.check()


class DictFrameStoreModel(base.StoreModel):
    """The store model with 3-page frames that try a dictionary on every request."""

    UNIT_PAGES = 3
    KIND = "raw"

    def __init__(self) -> None:
        super().__init__()
        self.store, self.entry = dict_store(self.KIND, self.UNIT_PAGES, base.DEVICE // PAGE,
                                            model=True)


class FullDictFrameStoreModel(DictFrameStoreModel):
    KIND = "full"


TestDictFrameStoreModel = DictFrameStoreModel.TestCase
TestFullDictFrameStoreModel = FullDictFrameStoreModel.TestCase
for case in (TestDictFrameStoreModel, TestFullDictFrameStoreModel):
    case.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


def test_the_frame_trial_budget_counts_frames_not_pages():
    from agentzip_blk.codec.codecs import PooledCodec, ZstdCodec
    from agentzip_blk.codec.dictionaries.registry import DictionaryRegistry
    from agentzip_blk.codec.dictionaries.selector import Selector

    registry = DictionaryRegistry(frame_pages=16)
    for n, kind in enumerate(["raw", "full"]):
        registry.add(f"d{n}", as_kind(trained(16), kind), "host", kind=kind)
    sel = Selector(PooledCodec(lambda: ZstdCodec(3, 16 * PAGE)), registry, budget=0.5,
                   min_budget=0.5, frames=True)
    frames = [b"".join(text_page(20_000 + 16 * i + k) for k in range(16)) for i in range(2)]
    for _ in range(40):  # 40 requests of 2 frames (32 pages) each
        sel.choose(frames)
    # 0.5 credit per frame = 1 per request, a trial costs 2 (one per candidate): one trial
    # every other request, plus the first (new candidates are tried at once). Counted per
    # page it would be a trial on every request.
    assert sel.stats.requests == 40
    assert 19 <= sel.stats.trials <= 22
    assert sel.stats.extra_compressions == 2 * sel.stats.trials


def test_a_frame_compressed_with_a_dictionary_unloaded_before_the_lock_is_recompressed():
    """Frames are compressed before the store lock; the dictionary they chose may be retired
    and unloaded (no blob used it) before the request takes the lock."""
    store, entry = dict_store("raw")
    registry = store.dicts.registry
    prepare = store.placer.prepare

    def prepare_then_unload(data, offset):
        early = prepare(data, offset)
        assert {d for _, d in early.frames.values()} == {entry.id}  # it chose the dictionary
        registry.retire(entry.id)
        registry.collect(store.blobs.dict_id[store.blobs.live()])  # no blob uses it yet
        assert not registry.registered(entry.id)
        return early

    store.placer.prepare = prepare_then_unload
    data = b"".join(text_page(300 + i) for i in range(16))
    store.write(data, 0)
    frames = frame_blobs(store)
    assert len(frames) == 4 and set(store.blobs.dict_id[frames].tolist()) == {0}
    assert store.counters.frames_compressed_locked == 4
    for blob in frames.tolist():
        store.objects.frames.discard(blob)
    assert bytes(store.read(0, 16 * PAGE)) == data
    store.check()


@pytest.mark.parametrize("kind", ["raw", "full"])
def test_a_frame_read_with_the_wrong_dictionary_is_eio_never_other_bytes(kind: str):
    """Issue 27 item 4: the checksum covers what the kernel wrote, not only the stored bytes.
    A frame whose blob names another dictionary (a bug, a corrupt row) decodes through zstd's
    content checksum: EIO, counted, never the other bytes."""
    from agentzip_blk.store.integrity import Corrupt

    store, entry = dict_store(kind)
    other = store.dicts.registry.add("test-other", as_kind(trained(4, model=True), kind), "host",
                                     kind=kind)
    other.load(True)
    data = b"".join(text_page(i) for i in range(16))
    store.write(data, 0)
    blob = int(store.slots.handle[0])
    assert int(store.blobs.dict_id[blob]) == entry.id
    for wrong in (other.id, 0):  # another loaded dictionary, and none at all
        store.blobs.dict_id[blob] = wrong
        store.objects.frames.discard(blob)
        before = store.counters.checksum_errors
        with pytest.raises(Corrupt):
            store.read(0, PAGE)
        assert store.counters.checksum_errors == before + 1
    store.blobs.dict_id[blob] = entry.id
    store.objects.frames.discard(blob)
    assert bytes(store.read(0, 16 * PAGE)) == data  # the right one reads back exact
