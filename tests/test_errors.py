"""errors.errno_of: the one mapping of a failed request to its errno, for both front doors."""

from __future__ import annotations

import errno

from agentzip_blk.errors import CodecError, OutOfRange, StoreError, StoreFull, errno_of


def test_each_request_error_has_its_errno():
    assert errno_of(OutOfRange("past the end")) == errno.EINVAL
    assert errno_of(StoreFull("no room")) == errno.ENOSPC
    # the other store errors, a codec failure and a bug are all EIO, never success
    for exc in (StoreError("other"), CodecError("corrupt"), RuntimeError("bug"), OSError(5, "io")):
        assert errno_of(exc) == errno.EIO


def test_subclasses_map_like_their_base():
    class Narrower(StoreFull):
        pass

    assert errno_of(Narrower("still full")) == errno.ENOSPC
