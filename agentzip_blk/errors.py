"""The exceptions that cross layers: what a caller of the store, the codec, the config or the
attach chain catches (the CLI turns them into one line and an exit status).

Errors private to one module (a full pool, a full disk tier) stay in that module.
"""

from __future__ import annotations

import errno


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the value."""


class CodecError(Exception):
    """A blob could not be compressed or decompressed (corrupt data or a library failure)."""


class StoreError(Exception):
    """Base of the errors a request can end in; the device is unchanged after each."""


class OutOfRange(StoreError):
    """The byte range is negative or runs past the end of the device (EINVAL)."""


class StoreFull(StoreError):
    """No room for the request's pages in any tier (ENOSPC); the kernel keeps them."""


class SetupError(RuntimeError):
    """A precondition is not met; the message is one line that says what to do."""


class DeviceError(RuntimeError):
    """A runtime failure of the attach/detach chain (a tool failed, a timeout)."""


def errno_of(exc: BaseException) -> int:
    """The errno a failed request answers, behind either front door (the nbdkit plugin and
    the FUSE door): EINVAL for a range outside the device, ENOSPC when no tier has room (the
    kernel keeps the page), EIO for anything else."""
    if isinstance(exc, OutOfRange):
        return errno.EINVAL
    if isinstance(exc, StoreFull):
        return errno.ENOSPC
    return errno.EIO
