"""The kernel's swap map of our area, for the store's `forget_freed` (device.swap_map).

The store asks each maintenance round, at most every READ_EVERY seconds, for a copy of the
map (`read`). The area exists only once `up` has named the device (the guard) and swapped
on, so the map is opened lazily and opened again after a swapoff; a refusal that will not
change (no BPF, no BTF, a kernel newer than the format checked) stops the tries, and
`status` says why in one line (`stats.server.swap_map`, `doctor`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from . import swapmap

READ_EVERY = 1.0  # s between two copies of the map
RETRY_EVERY = 5.0  # s between two tries to open it while the area is not there (yet)
# Refusals that a later try cannot change: stop trying.
_FINAL = ("BPF_", "no BTF", "newer than", "layout check failed", "not wired")


class FreedSlots:
    def __init__(self, setting: str, device: Callable[[], str | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.setting = setting
        self._device = device  # the swap area's device, once `up` named it (the guard)
        self._clock = clock
        self._map: swapmap.SwapMap | None = None
        self._next_open = 0.0
        self._next_read = 0.0
        self._final = setting == "off"
        self.status = "off (device.swap_map: off)" if self._final else "waiting for swapon"
        self.last: dict[str, int] = {}  # classify() of the last copy

    def read(self) -> np.ndarray | None:
        """A fresh copy of the map, or None (not yet, not due, or not possible here)."""
        now = self._clock()
        if self._final or now < self._next_read:
            return None
        if self._map is None and not self._open(now):
            return None
        self._next_read = now + READ_EVERY
        try:
            kernel = self._map.read()
        except swapmap.Unsupported as exc:  # swapoff, or the area changed: open again later
            self._close(f"not read: {exc}")
            self._next_open = now + RETRY_EVERY
            return None
        self.last = swapmap.classify(kernel)
        return kernel

    def _open(self, now: float) -> bool:
        if now < self._next_open:
            return False
        self._next_open = now + RETRY_EVERY
        device = self._device()
        if device is None:
            return False
        try:
            self._map = swapmap.SwapMap.open(device)
        except swapmap.Unsupported as exc:
            reason = str(exc)
            self.status = f"not used: {reason}"
            self._final = any(mark in reason for mark in _FINAL)
            return False
        self.status = f"reading {device} ({self._map.area.found_by})"
        return True

    def _close(self, status: str) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self.status = status

    def close(self) -> None:
        self._close("closed")
        self._final = True

    def describe(self) -> dict:
        """For the server's stats: what it does, and the kernel's counts at the last copy."""
        return {"setting": self.setting, "status": self.status, "kernel_slots": self.last}
