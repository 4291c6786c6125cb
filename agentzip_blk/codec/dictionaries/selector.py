"""Per write request: which encoder (no dictionary, or one of the candidates) compresses it:
its pages compressed alone (`Selector`) or its frames (`Selector(..., frames=True)`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..codecs import ZSTD, Codec, PooledCodec
from .registry import DictionaryRegistry, LoadedDict


@dataclass
class Choice:
    codec: Codec | PooledCodec
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

    With `frames`, the units are the request's frames (`writer` is the frame codec): credits
    are earned per frame and a trial compresses one whole frame with each candidate (a
    dictionary primes only a frame's first pages, so one page would overstate its gain).
    Trials of a dictionary no request has chosen yet load nothing (LoadedDict.trial); the
    winner is loaded. The selector may be called from several request threads at once:
    the codecs it uses are pooled, and a lost update of its credits only shifts a trial.
    """

    def __init__(self, writer: Codec | PooledCodec, registry: DictionaryRegistry | None,
                 budget: float = 0.05, min_budget: float = 0.01, margin: float = 0.02,
                 frames: bool = False) -> None:
        self.writer = writer
        self.frames = frames
        self.registry = registry
        self.max_budget = budget
        self.min_budget = min_budget
        self.budget = budget
        self.margin = margin
        self.credits = 0.0
        self._sticky: LoadedDict | None = None
        self._candidates: tuple[LoadedDict, ...] = ()
        self._window_wins = 0  # trials in the current window that chose a dictionary
        self.stats = SelectionStats()
        self._clock = time.perf_counter

    @property
    def active(self) -> bool:
        return bool(self._of(self.registry)) and self.writer.id == ZSTD

    def _of(self, registry: DictionaryRegistry | None) -> tuple[LoadedDict, ...]:
        if registry is None:
            return ()
        return registry.frame_candidates if self.frames else registry.candidates

    def choose(self, pages: Sequence) -> Choice:
        """`pages`: the request's pages that will be compressed (not same-filled), or with
        `frames` its frames (each the joined bytes of its pages)."""
        registry = self.registry
        candidates = self._of(registry)
        if not candidates or not pages or self.writer.id != ZSTD:
            return Choice(self.writer, 0)
        self.stats.requests += 1
        cost = len(candidates)
        self.credits = min(self.credits + len(pages) * self.budget, 4.0 * cost + 1)
        if candidates is not self._candidates:  # one was adopted or retired: try them now
            self._candidates = candidates
            self.credits = max(self.credits, float(cost))
        sticky = self._sticky
        if self.credits < cost and (sticky is None or sticky.candidate):
            if sticky is None:
                return Choice(self.writer, 0)
            return Choice(self._codec(sticky), sticky.id)
        self.credits = max(0.0, self.credits - cost)
        t0 = self._clock()
        index = len(pages) // 2
        page = pages[index]
        none_out = self.writer.compress(page)
        best_out, best = none_out, None
        for entry in candidates:
            out = entry.trial(page, self.frames)
            if len(out) < len(best_out):
                best_out, best = out, entry
        if best is not None and len(none_out) - len(best_out) < self.margin * len(none_out):
            best_out, best = none_out, None  # not worth a dictionary
        self._sticky = best
        if best is not None:
            best.load(self.frames)  # chosen: from now on it has codecs of its own
        st = self.stats
        st.trials += 1
        st.extra_compressions += cost
        name = best.name if best else "none"
        st.wins[name] = st.wins.get(name, 0) + 1
        self._adapt(best is not None)
        st.seconds += self._clock() - t0
        if best is None:
            return Choice(self.writer, 0, index, best_out)
        return Choice(self._codec(best), best.id, index, best_out)

    def _codec(self, entry: LoadedDict) -> Codec | PooledCodec:
        return entry.frame_codec if self.frames else entry.codec

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
