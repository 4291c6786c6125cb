"""The nbdkit command line and environment for the agentzip plugin.

``nbdkit_command`` builds exactly the line documented in docs/INTERFACES.md::

    nbdkit -f -U NBD_SOCKET -P PIDFILE python /abs/nbdkit/agentzip_plugin.py \\
        [config=CONFIG_PATH] [size=BYTES] control=CONTROL_SOCKET

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
import site
import sys
from pathlib import Path

__all__ = [
    "DEFAULT_PLUGIN",
    "default_plugin_path",
    "is_python_plugin",
    "nbdkit_command",
    "server_command",
    "plugin_env",
]

DEFAULT_PLUGIN = "agentzip_plugin.py"


def default_plugin_path() -> str:
    """Absolute path of nbdkit/agentzip_plugin.py next to the agentzip_blk package.

    ``AGENTZIP_PLUGIN`` in the environment overrides it.
    """
    env = os.environ.get("AGENTZIP_PLUGIN")
    if env:
        return os.path.abspath(env)
    pkg_dir = Path(__file__).resolve().parent
    return str(pkg_dir.parent / "nbdkit" / DEFAULT_PLUGIN)


def is_python_plugin(plugin: str) -> bool:
    return plugin.endswith(".py")


def nbdkit_command(plugin_path: str, nbd_socket: str, control_socket: str | None, pidfile: str,
                   config_path: str | None = None, size: int | None = None,
                   foreground: bool = True, *, mlock: bool = True,
                   nbdkit: str = "nbdkit") -> list[str]:
    """argv for nbdkit serving the agentzip Python plugin on a unix socket.

    No ``--swap`` here even when ``mlock``: the plugin calls mlockall(MCL_ONFAULT) itself.
    ``--swap`` locks without ONFAULT and faults in nbdkit's 192 MiB .bss and every thread
    stack: measured 348 MB RSS with it, 36 MB without, for the same locked safety.
    """
    cmd = [nbdkit]
    if foreground:
        cmd.append("-f")
    cmd += ["-U", os.path.abspath(nbd_socket), "-P", os.path.abspath(pidfile),
            "python", os.path.abspath(plugin_path)]
    if config_path:
        cmd.append(f"config={os.path.abspath(config_path)}")
    if size is not None:
        cmd.append(f"size={int(size)}")
    if control_socket:
        cmd.append(f"control={os.path.abspath(control_socket)}")
    return cmd


def server_command(plugin: str, nbd_socket: str, control_socket: str | None, pidfile: str,
                   config_path: str | None = None, size: int | None = None,
                   foreground: bool = True, *, mlock: bool = True,
                   nbdkit: str = "nbdkit") -> list[str]:
    """nbdkit argv for ``plugin``: a .py path (the agentzip plugin) or a plugin name."""
    if is_python_plugin(plugin):
        return nbdkit_command(plugin, nbd_socket, control_socket, pidfile, config_path, size,
                              foreground, mlock=mlock, nbdkit=nbdkit)
    cmd = [nbdkit]
    if mlock:
        cmd.append("--swap")
    if foreground:
        cmd.append("-f")
    cmd += ["-U", os.path.abspath(nbd_socket), "-P", os.path.abspath(pidfile), plugin]
    if size is not None:
        cmd.append(f"size={int(size)}")
    return cmd


def _python_path_entries() -> list[str]:
    entries: list[str] = []
    # the directory that holds the agentzip_blk package (works for editable installs too)
    entries.append(str(Path(__file__).resolve().parent.parent))
    # this interpreter's own site-packages (the venv's), ahead of Debian's
    cands: list[str] = []
    try:
        cands += site.getsitepackages()
    except AttributeError:  # pragma: no cover - very old virtualenv
        pass
    prefix = os.path.realpath(sys.prefix)
    for p in cands:
        if os.path.isdir(p) and os.path.realpath(p).startswith(prefix + os.sep):
            entries.append(p)
    return entries


def plugin_env(base: dict | None = None) -> dict:
    """Environment for nbdkit: PYTHONPATH has the project dir and this venv's site-packages.

    nbdkit embeds Debian's libpython 3.11 and does not know about the venv.
    """
    env = dict(os.environ if base is None else base)
    entries = _python_path_entries()
    old = env.get("PYTHONPATH")
    if old:
        entries += [p for p in old.split(os.pathsep) if p and p not in entries]
    seen: list[str] = []
    for p in entries:
        if p not in seen:
            seen.append(p)
    env["PYTHONPATH"] = os.pathsep.join(seen)
    # numpy's OpenBLAS starts a thread per core with its own buffers; the store does no BLAS.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env
