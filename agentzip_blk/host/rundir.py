"""The run directory is root's alone: nbd.sock (every sandbox's swapped pages, read and
write), control.sock, state.json (pids and paths that `down` acts on), the cgroup ledger.

``secure_run_dir`` runs before anything is created in it or read from it (``up``, ``down``):

- missing: created 0700, owned by us;
- a symbolic link, or not a directory: refused (a link would send root's files elsewhere);
- owned by another uid: refused (its owner could swap our files under us);
- a group/other-accessible mode: fixed, we own it (0700; 0710 and the configured
  ``device.control_group`` when one is set: members may only traverse it to reach
  control.sock, whose own mode and peer check say what they may do);
- an ancestor that another uid owns, or that others may write without the sticky bit:
  refused (they could rename the directory away and plant their own).

Everything is checked with lstat and an O_NOFOLLOW|O_DIRECTORY descriptor (fstat, fchmod,
fchown on that descriptor), never by following the path twice.
"""

from __future__ import annotations

import os
import stat

from ..errors import SetupError

__all__ = ["RUN_DIR_MODE", "GROUP_SEARCH", "secure_run_dir", "open_private"]

RUN_DIR_MODE = 0o700
GROUP_SEARCH = 0o010  # the control group may traverse the run directory, nothing else


def secure_run_dir(path: str, group_gid: int | None = None, *, keep_group: bool = False,
                   create: bool = True) -> None:
    """Make ``path`` a run directory only we can use, or raise SetupError saying why not.

    ``group_gid``: the control group (mode 0710, that group); None: mode 0700. ``keep_group``
    (callers that do not know the config, such as ``down``): a group search bit already
    there stays, every other group/other bit goes. ``create=False``: a missing directory
    is left missing."""
    path = os.path.abspath(path)
    _check_ancestors(os.path.dirname(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        try:
            os.mkdir(path, RUN_DIR_MODE)
        except FileExistsError:
            pass  # raced with another up: the checks below decide
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise SetupError(f"run directory {path} is a symbolic link (to "
                         f"{_readlink(path)}): refusing it; remove the link and run again")
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError(f"run directory {path} exists and is not a directory: refusing it")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise SetupError(f"run directory {path} was replaced while it was checked: "
                             f"refusing it")
        if fst.st_uid != os.geteuid():
            raise SetupError(f"run directory {path} is owned by uid {fst.st_uid}, not by "
                             f"root (uid {os.geteuid()}): refusing it; remove it or choose "
                             f"another device.run_dir")
        mode = stat.S_IMODE(fst.st_mode)
        if group_gid is not None:
            want = RUN_DIR_MODE | GROUP_SEARCH
            if fst.st_gid != group_gid:
                os.fchown(fd, -1, group_gid)
        elif keep_group:
            want = RUN_DIR_MODE | (mode & GROUP_SEARCH)
        else:
            want = RUN_DIR_MODE
        if mode != want:
            os.fchmod(fd, want)
    finally:
        os.close(fd)


def _check_ancestors(parent: str) -> None:
    """Every existing ancestor is root's (or ours) and not writable by others unless sticky:
    otherwise its owner or writers can rename the run directory and put theirs in place."""
    real = os.path.realpath(parent)
    cur = real
    while True:
        try:
            st = os.stat(cur)
        except FileNotFoundError:
            st = None  # created by us later, 0755
        if st is not None:
            if st.st_uid not in (0, os.geteuid()):
                raise SetupError(f"{cur} (above the run directory) is owned by uid "
                                 f"{st.st_uid}: its owner could replace the run directory; "
                                 f"choose a device.run_dir under root-owned directories")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise SetupError(f"{cur} (above the run directory) is writable by group or "
                                 f"others without the sticky bit (mode "
                                 f"{stat.S_IMODE(st.st_mode):o}): anyone there could replace "
                                 f"the run directory; choose another device.run_dir")
        up = os.path.dirname(cur)
        if up == cur:
            return
        cur = up


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def open_private(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """open() for a file root writes in the run directory: created 0600, truncated, never
    through a symbolic link (O_NOFOLLOW), whatever the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    fd = os.open(path, flags, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
        return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)
    except BaseException:
        os.close(fd)
        raise
