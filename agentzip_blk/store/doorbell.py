"""The maintainer's doorbell: an eventfd that request paths ring when the store needs work.

A write that leaves the pool above its reclaim threshold, or the dedup index, the blob
table or the pool's arena books near full, asks the maintainer to come now instead of at its
next interval. The native request path (datapath/nativeloop.c) rings it too, from threads that
hold no GIL: an eventfd is one write(2) for them, and the maintainer waits on it with
select(2), so neither side needs the other's locks. Rings coalesce in the eventfd's counter.
"""

from __future__ import annotations

import os
import select


class Doorbell:
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def ring(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except (BlockingIOError, OSError):  # the counter is saturated, or closed: rung enough
            pass

    def wait(self, timeout: float) -> bool:
        """Until rung or `timeout` seconds; True when rung. Clears the rings."""
        try:
            ready, _, _ = select.select([self.fd], [], [], timeout)
        except (OSError, ValueError):  # closed under us (the store is closing)
            return False
        if not ready:
            return False
        try:
            os.eventfd_read(self.fd)
        except (BlockingIOError, OSError):
            pass
        return True

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
