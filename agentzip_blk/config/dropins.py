"""Config drop-ins: ``<dir of config.yaml>/config.d/*.yaml`` merged in name order over it.

The rules are systemd's and kubelet's: files sort by name (``10-pool.yaml`` before
``90-scopes.yaml``), names starting with ``.`` are ignored (editors' and our own temporary
files), mappings merge key by key, and any other value (a scalar, a list such as ``scopes``)
replaces what came before as a whole: merging list items would leave no way to remove one.

Which file set each value is tracked here too (``Sources``), so ``config show`` can say it.

Not every drop-in is root's: on a Kubernetes node the node agent, which runs as another uid,
writes its scope list there (docs/KUBERNETES.md). A drop-in that is not root's alone (the
file, or the link to it, owned by another uid; or writable by group or others) may set
``scopes`` (which cgroups the tuner squeezes) and nothing else: not where the tier file
lies, not the device, not the control group. The loader enforces it (``limited_by``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from ..errors import ConfigError
from .schema import KEY_ALIASES

DROPIN_DIR = "config.d"
DROPIN_SUFFIX = ".yaml"

# dotted key ("pool.max_size", "scopes") -> the file that set it last
Sources = dict[str, str]

# the top-level keys a drop-in that is not root's may set
NON_ROOT_KEYS = ("scopes",)


def limited_by(link: os.stat_result, file: os.stat_result) -> str | None:
    """Why a drop-in is not root's alone (see the module docstring), or None. ``link``: its
    lstat; ``file``: the fstat of what was opened. Root's, or the reader's own uid's (a
    reader that is not root trusts what it wrote itself)."""
    trusted = (0, os.geteuid())
    for st in (link, file):
        if st.st_uid not in trusted:
            return f"owned by uid {st.st_uid}"
    if stat.S_IMODE(file.st_mode) & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(file.st_mode):04o})"
    return None


def dropin_dir(config_path: str) -> str:
    """The drop-in directory of a config file: ``config.d`` next to it."""
    return os.path.join(os.path.dirname(os.path.abspath(config_path)), DROPIN_DIR)


def dropin_files(directory: str) -> list[str]:
    """The drop-ins of *directory* in merge order (none when it does not exist)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError(f"{directory}: not a directory (config drop-ins go there)") from None
    except OSError as e:
        raise ConfigError(f"{directory}: cannot list config drop-ins: {e.strerror or e}") from None
    return [os.path.join(directory, n) for n in sorted(names)
            if n.endswith(DROPIN_SUFFIX) and not n.startswith(".")]


def _aliases_of(section: str) -> dict[str, str]:
    return {old: new for (sec, old), new in KEY_ALIASES.items() if sec == section}


def _unify_alias(section: str, base: dict, over: Mapping, sources: Sources) -> dict:
    """Give *base* the spelling *over* uses for an aliased key, so that an old name in
    config.yaml and the new one in a drop-in (or the reverse) replace each other."""
    for old, new in _aliases_of(section).items():
        for have, want in ((old, new), (new, old)):
            if have in base and want in over and have not in over:
                base = {(want if k == have else k): v for k, v in base.items()}
                origin = sources.pop(f"{section}.{have}", None)
                if origin is not None:
                    sources[f"{section}.{want}"] = origin
    return base


def merge(base: dict, over: Mapping, origin: str, sources: Sources, prefix: str = "") -> dict:
    """*over* merged into a copy of *base*; *sources* records *origin* for every value set.

    A null section in a drop-in (``pool:`` with nothing under it) changes nothing, as a
    null section means "the defaults" in a single file.
    """
    out = _unify_alias(prefix, dict(base), over, sources)
    for key, value in over.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        old = out.get(key)
        if isinstance(value, Mapping) and (old is None or isinstance(old, Mapping)):
            out[key] = merge(old or {}, value, origin, sources, dotted)
        elif value is None and (old is None or isinstance(old, Mapping)) and not prefix:
            out.setdefault(key, None)
        else:
            for k in [k for k in sources if k.startswith(dotted + ".")]:
                del sources[k]  # a scalar replaced a whole mapping
            out[key] = value
            sources[dotted] = origin
    return out


def normalized_key(dotted: str) -> str:
    """The current name of a dotted key written with an old spelling (KEY_ALIASES)."""
    section, _, name = dotted.partition(".")
    return f"{section}.{_aliases_of(section).get(name, name)}" if name else dotted
