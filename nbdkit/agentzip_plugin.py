"""nbdkit Python plugin (API version 2): config keys in, agentzip_blk.server calls out.

    nbdkit -f -U SOCK python agentzip_plugin.py config=PATH size=BYTES control=PATH

Errors: EINVAL for ranges outside the device, ENOSPC when the store cannot take a page
(the kernel keeps it), EIO for anything else. The store changes nothing on a failed request.
"""

import errno
import os
import sys
from time import perf_counter

import nbdkit

# nbdkit embeds Debian's libpython; the launcher puts the venv on PYTHONPATH, and a checkout
# run by hand still finds the package next to this file.
try:
    _HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _HERE not in sys.path:
        sys.path.append(_HERE)
except NameError:
    pass

from agentzip_blk import protect  # noqa: E402

# nbdkit -f has set PR_SET_PDEATHSIG(SIGTERM) on itself before loading us: a server that died
# with the process that ran `up` would take every swapped page with it.
protect.clear_parent_death_signal()
protect.lock_memory()  # before the heavy imports fault their pages in; again after fork

from agentzip_blk.server import Server  # noqa: E402
from agentzip_blk.store import OutOfRange, StoreFull  # noqa: E402

API_VERSION = 2

_keys = {}
_server = None


def _fail(exc):
    if isinstance(exc, OutOfRange):
        nbdkit.set_error(errno.EINVAL)
    elif isinstance(exc, StoreFull):
        nbdkit.set_error(errno.ENOSPC)
    else:
        nbdkit.set_error(errno.EIO)
        nbdkit.debug(f"agentzip: {type(exc).__name__}: {exc}")
    raise exc


def thread_model():
    return nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS


def config(key, value):
    _keys[key] = value


def config_complete():
    global _server
    _server = Server.from_keys(_keys)  # a bad config stops nbdkit here, before it listens


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


def pread(h, buf, offset, flags):
    _server.on_request_thread()
    t0 = perf_counter()
    try:
        _server.store.readinto(buf, offset)
    except Exception as exc:
        _fail(exc)
    _server.latency.read.observe(perf_counter() - t0)


def pwrite(h, buf, offset, flags):
    _server.on_request_thread()
    t0 = perf_counter()
    try:
        _server.store.write(buf, offset)
    except Exception as exc:
        _fail(exc)
    _server.latency.write.observe(perf_counter() - t0)


def flush(h, flags):
    _server.store.flush()


def trim(h, count, offset, flags):
    try:
        _server.store.trim(offset, count)
    except Exception as exc:
        _fail(exc)


def zero(h, count, offset, flags):
    try:
        _server.store.zero(offset, count)
    except Exception as exc:
        _fail(exc)
