"""`dictionary: auto` with frames: it trains on whole frames and adopts a dictionary only when
it wins on frames written *after* the training window (a later run), not on frames of the
run it was trained on."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentzip_blk.codec.dictionaries.registry import DictionaryRegistry
from agentzip_blk.codec.dictionaries.trainer import HostTrainer
from agentzip_blk.store import PageStore

PAGE = 4096


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def run_frames(run: int, n: int, unit: int = 4) -> list[list[bytes]]:
    """Frames of one "run" of a program whose pages hold only that run's own tokens: a
    dictionary trained on it copies them, and they never come back in another run."""
    rnd = random.Random(run)
    vocab = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(14))
             for _ in range(3000)]
    return [[" ".join(rnd.choice(vocab) for _ in range(300)).encode()[:PAGE] for _ in range(unit)]
            for _ in range(n)]


def test_auto_does_not_adopt_a_dictionary_that_loses_on_a_later_runs_frames():
    clock = Clock()
    registry = DictionaryRegistry.from_setting("none", frame_pages=4)
    trainer = HostTrainer(registry, unit_pages=4, sample_every=1, heldout_every=1,
                          train_pages=100, heldout_pages=30, size=16384, background=False,
                          clock=clock)
    first = run_frames(1, 140)
    for frame in first[:100]:
        trainer.observe(frame)
    assert trainer.summary()["awaiting_heldout"] and trainer.stats.rounds == 0
    for frame in first[100:]:  # still the training run, inside the delay: not held out
        trainer.observe(frame)
    assert trainer.stats.rounds == 0 and registry.candidates == ()
    clock.t += trainer.heldout_delay
    for frame in run_frames(2, 30):  # a later run
        trainer.observe(frame)
    assert trainer.stats.rounds == 1 and trainer.stats.adopted == 0
    assert trainer.stats.last_gain < trainer.min_gain
    assert registry.candidates == () and registry.loaded() == []
    # The same dictionary tested on held-out frames of the *training* run would have been
    # adopted: that is the test the trainer must not use.
    same_run = HostTrainer(DictionaryRegistry.from_setting("none", frame_pages=4),
                           unit_pages=4, size=16384, background=False)
    assert same_run.train_and_maybe_adopt([b"".join(f) for f in first[:100]],
                                          [b"".join(f) for f in first[100:130]])
    assert same_run.stats.last_gain > 0.1


WORDS = [b'{"role": "tool",', b'"content":', b'"result"', b'"arguments":', b"value", b"null"]


def json_page(seed: int) -> bytes:
    rnd = random.Random(seed)
    return b" ".join(rnd.choice(WORDS) + str(rnd.randrange(100)).encode()
                     for _ in range(PAGE))[:PAGE]


@pytest.mark.slow
def test_auto_adopts_a_frame_dictionary_that_wins_on_a_later_run_and_frames_read_back():
    clock = Clock()
    store = PageStore(1024 * PAGE, max_size=64 << 20, frame_pages=4, dictionary="auto",
                      clock=clock)
    trainer = store.dicts.trainer
    assert trainer.unit_pages == 4
    trainer.background = False
    trainer.sample_every = trainer.heldout_every = 1
    trainer.train_pages, trainer.heldout_pages, trainer.size = 100, 25, 16384
    earlier = b"".join(json_page(i) for i in range(400))
    for i in range(0, 400, 8):
        store.write(earlier[i * PAGE:(i + 8) * PAGE], i * PAGE)
    clock.t += trainer.heldout_delay
    later = b"".join(json_page(10_000 + i) for i in range(400))
    for i in range(0, 400, 8):
        store.write(later[i * PAGE:(i + 8) * PAGE], (400 + i) * PAGE)
    assert trainer.stats.adopted == 1, trainer.summary()
    host = [e for e in store.dicts.registry.candidates if e.source == "host"]
    assert len(host) == 1 and host[0].info["unit_pages"] == 4
    live = np.flatnonzero(store.blobs.live())
    frames = live[store.blobs.pages[live] > 1]
    assert host[0].id in set(store.blobs.dict_id[frames].tolist())  # later frames use it
    for blob in frames.tolist():
        store.objects.frames.discard(blob)
    assert bytes(store.read(0, 400 * PAGE)) == earlier
    assert bytes(store.read(400 * PAGE, 400 * PAGE)) == later
    store.check()
