"""The exceptions that cross layers: what a caller of the store, the codec or the config catches.

Errors private to one module (a full pool, a full disk tier) stay in that module.
"""

from __future__ import annotations


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
