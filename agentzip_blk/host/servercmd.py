"""The nbdkit command line and environment for the agentzip plugin.

``nbdkit_command`` builds exactly the line documented in docs/INTERFACES.md::

    nbdkit -f -U NBD_SOCKET -P PIDFILE --filter=ip python /abs/agentzip_blk/datapath/nbdkit_plugin.py \\
        allow=uid:0 deny=all [config=CONFIG_PATH] [size=BYTES] control=CONTROL_SOCKET

nbdkit accepts the NBD connections itself, so the peer check of nbd.sock is its ``ip``
filter: ``allow=uid:UID deny=all`` (SO_PEERCRED of the unix socket; nbdkit >= 1.24) admits
only the server's own uid, root. A client of another uid is disconnected before the
handshake, whatever the socket file's mode or the run directory's (defence in depth: both
are root-only too, see host.rundir).

The thread model is the plugin's own (``thread_model()`` in the plugin), so no
``--threads``/``-t`` is passed. The plugin mlockall()s itself (on fault): the
server of a swap device must never be swapped out.

``server_command`` is the plugin-agnostic variant used by the attach chain: a
``.py`` path means the Python plugin above, anything else is an nbdkit plugin
name (e.g. the built-in ``memory`` plugin, used by tests before the real plugin
exists); such plugins get ``size=BYTES`` and no control socket.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import agentzip_blk

__all__ = [
    "DEFAULT_PLUGIN",
    "SERVER_PATH",
    "peer_filter_args",
    "default_plugin_path",
    "is_python_plugin",
    "nbdkit_command",
    "server_command",
    "plugin_env",
    "plugin_python_path",
]

PACKAGE_DIR = Path(agentzip_blk.__file__).resolve().parent
DEFAULT_PLUGIN = "nbdkit_plugin.py"


def default_plugin_path() -> str:
    """Absolute path of the plugin the package ships (datapath/nbdkit_plugin.py; in the tree
    nbdkit/agentzip_plugin.py links to it). ``AGENTZIP_PLUGIN`` in the environment overrides it.
    """
    env = os.environ.get("AGENTZIP_PLUGIN")
    if env:
        return os.path.abspath(env)
    return str(PACKAGE_DIR / "datapath" / DEFAULT_PLUGIN)


def is_python_plugin(plugin: str) -> bool:
    return plugin.endswith(".py")


def peer_filter_args(uid: int | None = None, *,
                     nbd_clients: bool = True) -> tuple[list[str], list[str]]:
    """(options before the plugin, keys after it) for nbdkit's ip filter: only ``uid``
    (default: ours, root in production) may connect to the NBD socket. ``nbd_clients``
    False (the FUSE front door, which serves the kernel without NBD): nobody may, root
    included: nbdkit must listen somewhere, but that socket would hand every page to any
    uid-0 process that reaches the run directory (a container that mounts it)."""
    uid = os.geteuid() if uid is None else uid
    if not nbd_clients:
        return ["--filter=ip"], ["deny=all"]
    return ["--filter=ip"], [f"allow=uid:{int(uid)}", "deny=all"]


def nbdkit_command(plugin_path: str, nbd_socket: str, control_socket: str | None, pidfile: str,
                   config_path: str | None = None, size: int | None = None,
                   foreground: bool = True, *, nbdkit: str = "nbdkit",
                   config_sha256: str | None = None, nbd_clients: bool = True) -> list[str]:
    """argv for nbdkit serving the agentzip Python plugin on a unix socket.

    No ``--swap`` here: the plugin calls mlockall(MCL_ONFAULT) itself.
    ``--swap`` locks without ONFAULT and faults in nbdkit's 192 MiB .bss and every thread
    stack: measured 348 MB RSS with it, 36 MB without, for the same locked safety.
    """
    cmd = [nbdkit]
    if foreground:
        cmd.append("-f")
    filter_opts, filter_keys = peer_filter_args(nbd_clients=nbd_clients)
    cmd += ["-U", os.path.abspath(nbd_socket), "-P", os.path.abspath(pidfile), *filter_opts,
            "python", os.path.abspath(plugin_path), *filter_keys]
    if config_path:
        cmd.append(f"config={os.path.abspath(config_path)}")
        if config_sha256:  # that file alone, and only with these bytes (datapath.server)
            cmd.append(f"config_sha256={config_sha256}")
    if size is not None:
        cmd.append(f"size={int(size)}")
    if control_socket:
        cmd.append(f"control={os.path.abspath(control_socket)}")
    return cmd


def server_command(plugin: str, nbd_socket: str, control_socket: str | None, pidfile: str,
                   config_path: str | None = None, size: int | None = None,
                   foreground: bool = True, *, mlock: bool = True,
                   nbdkit: str = "nbdkit", config_sha256: str | None = None,
                   nbd_clients: bool = True) -> list[str]:
    """nbdkit argv for ``plugin``: a .py path (the agentzip plugin) or a plugin name."""
    if is_python_plugin(plugin):
        return nbdkit_command(plugin, nbd_socket, control_socket, pidfile, config_path, size,
                              foreground, nbdkit=nbdkit, config_sha256=config_sha256,
                              nbd_clients=nbd_clients)
    cmd = [nbdkit]
    if mlock:
        cmd.append("--swap")
    if foreground:
        cmd.append("-f")
    filter_opts, filter_keys = peer_filter_args()
    cmd += ["-U", os.path.abspath(nbd_socket), "-P", os.path.abspath(pidfile), *filter_opts,
            plugin, *filter_keys]
    if size is not None:
        cmd.append(f"size={int(size)}")
    return cmd


# nbdkit's embedded interpreter finds its prefix by looking for python3 on PATH: a pyenv,
# conda or venv python3 ahead of /usr/bin gave it another stdlib and no Debian dist-packages
# ("error running this script", ModuleNotFoundError). So nbdkit gets this PATH, and nothing
# else of the caller's environment reaches the interpreter (PYTHONHOME, PYTHONPATH,
# PYTHONSTARTUP, the user's site directory).
SERVER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def plugin_python_path() -> list[str]:
    """The package's own directory, then this interpreter's site directories, in its order.

    Pinned from the interpreter that runs the CLI (the venv, built on Debian's python3, the
    same libpython nbdkit embeds). Only site directories: the stdlib is the embedded
    interpreter's own, and mixing in another build's would break it.
    """
    entries = [str(PACKAGE_DIR.parent)]
    for p in sys.path:
        if p and os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p):
            entries.append(p)
    seen: list[str] = []
    for p in entries:
        if p not in seen:
            seen.append(p)
    return seen


def plugin_env() -> dict[str, str]:
    """The whole environment of nbdkit: independent of the caller's (see SERVER_PATH), but
    for the project's own AGENTZIP_* settings (AGENTZIP_DICT_DIR, ...)."""
    own = {k: v for k, v in os.environ.items() if k.startswith("AGENTZIP_")}
    return {
        **own,
        "PATH": SERVER_PATH,
        "PYTHONPATH": os.pathsep.join(plugin_python_path()),
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
        # numpy's OpenBLAS starts a thread per core with its own buffers; the store does no BLAS.
        "OPENBLAS_NUM_THREADS": "1",
        "HOME": "/root" if os.geteuid() == 0 else os.environ.get("HOME", "/"),
    }
