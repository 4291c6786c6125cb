"""Progress of long work on stderr, through tqdm: only on a terminal unless `--progress`
(a log file or a pipe gets no bar, and stdout stays the command's result).

`pages(label)` is the ``progress(done, total)`` callback that `procmem.process_pages` and
`estimate_pages` take. `SwapoffWatch` shows `down` bringing pages back: swapoff is one
system call that reports nothing, so a thread polls the Used column of /proc/swaps while it
runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from .. import procfs
from ..config.quantities import format_bytes

_forced = False  # --progress


def force(on: bool) -> None:
    """`--progress`: draw bars even when stderr is not a terminal."""
    global _forced
    _forced = bool(on)


def enabled(stream=None) -> bool:
    stream = stream or sys.stderr
    return _forced or bool(getattr(stream, "isatty", lambda: False)())


def bar(label: str, total: int | None, unit: str = "B", stream=None, **kwargs) -> tqdm:
    """A tqdm bar on stderr; disabled (draws nothing) when `enabled` says no."""
    stream = stream or sys.stderr
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=label, unit=unit, file=stream, disable=not enabled(stream),
                dynamic_ncols=True, leave=True, **scale, **kwargs)


class pages:
    """``progress(done, total)`` callback drawing a tqdm bar of pages."""

    def __init__(self, label: str, stream=None) -> None:
        self.label = label
        self.stream = stream
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = bar(self.label, total, unit="page", stream=self.stream)
        elif total != self._bar.total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)
        if total and done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


SwapsReader = Callable[[str], "procfs.SwapArea | None"]


class SwapoffWatch:
    """While swapoff of *device* runs, poll its Used bytes and report them as done =
    used at start - used now (a page back in RAM leaves the area).

    *read(device)* returns the device's /proc/swaps line (procfs.swap_area; tests pass a fake
    reader); *report(done, total)* gets each change; polling stops when the area is gone or
    `stop` is called. Use as a context manager around the call that swaps off.
    """

    def __init__(self, device: str, report: Callable[[int, int], None],
                 read: SwapsReader = procfs.swap_area, interval: float = 0.2,
                 every_poll: bool = False) -> None:
        self.device = device
        self.report = report
        self.read = read
        self.interval = interval
        self.every_poll = every_poll  # report unchanged figures too (SwapoffLog: a stall)
        self.total: int | None = None
        self.last_done = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        """One poll: report progress; False once the area has left /proc/swaps."""
        try:
            area = self.read(self.device)
        except OSError:
            area = None
        if area is None:
            if self.total is not None and self.last_done != self.total:
                self.last_done = self.total
                self.report(self.total, self.total)
            return False
        if self.total is None:
            self.total = area.used
        done = max(0, self.total - area.used)
        if done != self.last_done or self.every_poll:
            self.last_done = done
            self.report(done, self.total)
        return True

    def _run(self) -> None:
        while self.poll_once() and not self._stop.wait(self.interval):
            pass

    def start(self) -> None:
        self.poll_once()  # the starting figure, before swapoff begins
        self._thread = threading.Thread(target=self._run, name="swapoff-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll_once()  # the final figure (usually: the area is gone, all back)

    def __enter__(self) -> SwapoffWatch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class swapoff_bar:
    """`SwapoffWatch` report callback drawing a tqdm bar of bytes swapped back in."""

    def __init__(self, device: str, stream=None) -> None:
        self.device = device
        self.stream = stream
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = bar(f"swapoff {self.device}", total, unit="B", stream=self.stream)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class SwapoffLog:
    """`SwapoffWatch` report callback for a log, not a terminal: `down` under systemd's
    ExecStop, whose stderr is the journal. One line as swapoff starts, then one at least every
    *every* seconds (a stall too: the watch reports every poll), and one at the end, each with
    the pages left and the rate since the last line, so that a shutdown that waits on swapoff
    says why and for how long."""

    def __init__(self, device: str, every: float = 10.0, stream=None,
                 clock: Callable[[], float] = time.monotonic, page_size: int = 4096) -> None:
        self.device = device
        self.every = every
        self.stream = stream
        self.clock = clock
        self.page_size = page_size
        self._t0: float | None = None
        self._last: tuple[float, int] = (0.0, 0)
        self._ended = False

    def _say(self, text: str) -> None:
        print(f"agentzip-blk: swapoff {self.device}: {text}", file=self.stream or sys.stderr,
              flush=True)

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self._t0 is None:
            self._t0, self._last = now, (now, done)
            self._say(f"{(total - done) // self.page_size} pages left "
                      f"({format_bytes(total - done)}) to bring back into RAM")
            return
        if self._ended:
            return
        end = done >= total
        if not end and now - self._last[0] < self.every:
            return
        t, d = self._last
        rate = (done - d) / (now - t) if now > t else 0.0
        left = max(0, total - done)
        self._last = (now, done)
        if end:
            self._ended = True
            self._say(f"done: {total // self.page_size} pages back in "
                      f"{now - self._t0:.1f}s")
            return
        eta = f", ~{left / rate:.0f}s to go" if rate > 0 else ", stalled"
        self._say(f"{left // self.page_size} pages left ({format_bytes(left)}), "
                  f"{rate / self.page_size:.0f} pages/s ({format_bytes(int(rate))}/s){eta}")

    def close(self) -> None:
        pass
