"""nbdkit Python plugin (API version 2): config keys in, Server method calls out.

    nbdkit -f -U SOCK python .../agentzip_blk/datapath/nbdkit_plugin.py config=PATH size=BYTES control=PATH

nbdkit loads this file by path (nbdkit/agentzip_plugin.py in the tree links here); the
launcher (host.servercmd.plugin_env) puts the package on PYTHONPATH. Every request is one
Server method (the same ones the FUSE door calls); this file only hands nbdkit the errno of a
failed one (errors.errno_of: EINVAL for ranges outside the device, ENOSPC when the store
cannot take a page, EIO for anything else). The store changes nothing on a failed request.
"""

import errno

import nbdkit

from agentzip_blk.datapath import protect

# nbdkit -f has set PR_SET_PDEATHSIG(SIGTERM) on itself before loading us: a server that died
# with the process that ran `up` would take every swapped page with it.
protect.clear_parent_death_signal()
protect.lock_memory()  # before the heavy imports fault their pages in; again after fork

from agentzip_blk.datapath.server import Server  # noqa: E402
from agentzip_blk.errors import errno_of  # noqa: E402

API_VERSION = 2

_keys = {}
_server = None


def thread_model():
    # NBD requests one at a time. The store would take them in parallel (its own lock, with
    # compression and decompression outside it, as the FUSE front door's workers use it), but
    # nbdkit's 16 workers per connection under nbdfuse grew the server's RSS ~35 MiB past
    # what the store holds (tests/demo/test_swap.py, 2026-12-01); measure before enabling.
    return nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS


def config(key, value):
    _keys[key] = value


def config_complete():
    global _server
    _server = Server.from_keys(_keys)  # a bad config stops nbdkit here, before it listens
    # so does memory that cannot be locked with the disk tier on (start() checks again)
    protect.require_locked(protect.lock_memory(), _server.config.pool.swap_out_path)


def after_fork():
    # nbdkit has installed its quit handlers by now; the server's guard replaces them.
    _server.start(stop=nbdkit.shutdown)


def cleanup():
    if _server is not None:
        _server.stop()


def open(readonly):  # noqa: A001 - nbdkit's callback name
    return 1


def get_size(h):
    return _server.size


def block_size(h):
    return (1, 4096, 32 * 1024 * 1024)


def can_write(h):
    return True


def can_flush(h):
    return True


def can_trim(h):
    return True


def can_zero(h):
    return True


def can_fast_zero(h):
    return True


def can_multi_conn(h):
    return True  # every connection sees the one store; flush has nothing to order


def _request(method, *args):
    try:
        method(*args)
    except Exception as exc:
        err = errno_of(exc)
        nbdkit.set_error(err)
        if err == errno.EIO:  # the others are the caller's range or a full store: expected
            nbdkit.debug(f"agentzip: {type(exc).__name__}: {exc}")
        raise


def pread(h, buf, offset, flags):
    _request(_server.pread, buf, offset)


def pwrite(h, buf, offset, flags):
    _request(_server.pwrite, buf, offset)


def flush(h, flags):
    _request(_server.flush)


def trim(h, count, offset, flags):
    _request(_server.trim, offset, count)


def zero(h, count, offset, flags):
    _request(_server.zero, offset, count)
