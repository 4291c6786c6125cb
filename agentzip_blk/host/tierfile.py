"""The disk tier file a server leaves behind, and the only way `down` removes one.

A server that stops cleanly removes its tier file itself (store.disk). One that was killed
leaves it: sealed extents under a key that died with it, still every sandbox's pages in
size and number. `down` removes that file, and nothing else, however the run directory was
tampered with (docs/SECURITY.md, "Files are not instructions"):

- the path comes from the server (its ``owned`` control verb, asked before it stops, with
  the device and inode of the file it holds open) or from the operator's own config; never
  from a file in the run directory (RUN/config.yaml, RUN/config.d, state.json);
- the file must be a regular file of ours (not a link, one link, mode 0600) that starts
  with the tier header (store.disk.TIER_MAGIC), with the device and inode the server
  reported when it reported one;
- no live server may hold it: every tier holds an exclusive flock for its life, so a file
  we can lock is nobody's tier any more.

Anything else is left where it is and named in `down`'s summary.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass

from ..store.disk import TIER_MAGIC


@dataclass(frozen=True)
class TierFile:
    """Where a server's disk tier is: its path, and (from the server) its identity."""
    path: str
    dev: int | None = None
    ino: int | None = None

    @classmethod
    def from_reply(cls, reply: dict | None) -> TierFile | None:
        """The ``tier`` of the server's ``owned`` reply ({"path", "dev", "ino"}, or null:
        no disk tier)."""
        if not isinstance(reply, dict):
            return None
        path, dev, ino = reply.get("path"), reply.get("dev"), reply.get("ino")
        if not isinstance(path, str) or not os.path.isabs(path):
            return None
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (dev, ino))
        return cls(path, dev, ino) if ints else cls(path)


def remove_leftover(tier: TierFile) -> str | None:
    """Remove ``tier.path`` if it is a tier file nobody serves any more (see the module
    docstring). None when removed or absent, else why it was left alone."""
    try:
        fd = os.open(tier.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link"
        return exc.strerror or str(exc)
    try:
        st = os.fstat(fd)
        problem = _problem(fd, st, tier)
        if problem:
            return problem
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "in use by a running server"
        # Still the file we checked at that path (not renamed away and replaced meanwhile)?
        try:
            now = os.lstat(tier.path)
        except FileNotFoundError:
            return None
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return "replaced while it was checked"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tier.path)
        return None
    finally:
        os.close(fd)


def _problem(fd: int, st: os.stat_result, tier: TierFile) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if tier.dev is not None and (st.st_dev, st.st_ino) != (tier.dev, tier.ino):
        return "not the file the server held (another device or inode)"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if stat.S_IMODE(st.st_mode) != 0o600 or st.st_nlink != 1:
        return f"mode {stat.S_IMODE(st.st_mode):04o} with {st.st_nlink} link(s), not a tier's"
    try:
        head = os.pread(fd, len(TIER_MAGIC), 0)
    except OSError as exc:
        return exc.strerror or str(exc)
    if head != TIER_MAGIC:
        return "no tier header: not a disk tier file"
    return None
