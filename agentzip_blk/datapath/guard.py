"""Polite signals cannot stop a swap server while a swap area points at it.

A swap server that exits takes every swapped page with it: their owners die of SIGBUS. So
SIGTERM, SIGINT and SIGHUP (from a parent's death, a terminal, a supervisor or a stray
`kill`) are refused and logged while the guarded device is in /proc/swaps, and honoured
otherwise (before swapon, after swapoff, or a plain `serve`). The regular stop is the
``shutdown`` control verb that `down` sends after swapoff. See docs/ARCHITECTURE.md.

How: Python's own C-level handler replaces nbdkit's quit handler for these signals, and
writes each signal number to a wakeup pipe. Python runs signal *handlers* only in the main
thread, which in nbdkit never returns to Python, so a thread of ours reads the pipe and
decides. SIGPIPE never stops the server (a write to a closed socket raises it).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from .. import procfs

POLITE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# SIGPIPE stops nothing either way (ignored); handling it too puts it in the log.
HANDLED = POLITE + (signal.SIGPIPE,)


class SignalGuard:
    def __init__(self, stop: Callable[[], None], say: Callable[[str], None]) -> None:
        self._stop = stop          # asks the server to exit (nbdkit.shutdown in the plugin)
        self._say = say            # a log line that reaches the server's log file
        self._device: str | None = None
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}
        self._rfd = self._wfd = -1

    def install(self) -> None:
        """Main thread only (signal.signal's rule): call from the plugin's after_fork."""
        self._rfd, self._wfd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._wfd, False)
        signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        for sig in HANDLED:
            signal.signal(sig, _no_python_handler)
        threading.Thread(target=self._loop, name="agentzip-signals", daemon=True).start()

    def arm(self, device: str) -> None:
        """Once, from `up`: the device stays armed for the server's life. Arming it again
        with another device is refused, so that a peer of the control socket cannot point
        the guard away from the real swap area and then stop the server."""
        with self._lock:
            if self._device is not None and self._device != device:
                raise ValueError(f"the guard is armed for {self._device} already")
            self._device = device

    @property
    def device(self) -> str | None:
        return self._device

    def stop(self) -> None:
        self._stop()

    def guarded(self) -> bool:
        """A swap area in /proc/swaps is the armed device."""
        dev = self._device
        return dev is not None and procfs.swap_area(dev) is not None

    def _loop(self) -> None:
        while True:
            try:
                data = os.read(self._rfd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            for signum in data:
                self._handle(signum)

    def _handle(self, signum: int) -> None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        if signum != signal.SIGPIPE and not self.guarded():
            self._say(f"agentzip: {name}: no swap area points at this server, shutting down")
            self._stop()
            return
        with self._lock:
            self.refused[name] = self.refused.get(name, 0) + 1
        why = (f"{self._device} is swap; `agentzip-blk down` stops this server"
               if signum != signal.SIGPIPE else "a broken pipe never stops the server")
        self._say(f"agentzip: refused {name}: {why}")


def _no_python_handler(signum, frame) -> None:
    """Never runs in nbdkit (its main thread stays in C); the wakeup pipe carries the signal."""
