"""The agentzip nbdkit plugin with a compressor that fails on command (tests only).

    nbdkit python faulty_plugin.py fault=CTL [the agentzip plugin's keys...]

Letters in the file CTL arm the faults, read on every call: `c` makes the page codec's
compress raise, `d` makes decompression raise. Everything else is the real plugin.
"""

import builtins
import importlib.util
import os
import sys

try:
    _REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "nbdkit", "agentzip_plugin.py")
except NameError:
    _REAL = None
_REAL = os.environ.get("AGENTZIP_REAL_PLUGIN") or _REAL

_spec = importlib.util.spec_from_file_location("agentzip_plugin_real", _REAL)
_real = importlib.util.module_from_spec(_spec)
sys.modules["agentzip_plugin_real"] = _real
_spec.loader.exec_module(_real)

API_VERSION = _real.API_VERSION
_fault_ctl = None


class InjectedFault(RuntimeError):
    pass


def _armed(letter):
    try:
        with builtins.open(_fault_ctl) as f:  # `open` below is nbdkit's callback
            return letter in f.read()
    except (OSError, TypeError):
        return False


def config(key, value):
    global _fault_ctl
    if key == "fault":
        _fault_ctl = value
    else:
        _real.config(key, value)


def _patch_codecs():
    """Wrap compress and decompress of every codec class, so that whichever codec the
    store picks for a page (algorithm, dictionary) goes through the fault switch."""
    from agentzip_blk.codec import codecs as codec

    for cls in vars(codec).values():
        if not (isinstance(cls, type) and issubclass(cls, codec.Codec)):
            continue
        for method, letter in (("compress", "c"), ("decompress", "d")):
            if method not in vars(cls):
                continue

            def faulty(self, data, *args, _orig=vars(cls)[method], _letter=letter, **kw):
                if _armed(_letter):
                    raise InjectedFault(f"injected {_orig.__name__} failure")
                return _orig(self, data, *args, **kw)

            setattr(cls, method, faulty)


def after_fork():
    _patch_codecs()
    _real.after_fork()


# Every other callback (and whatever the real plugin adds later) is the real plugin's own.
for _name, _value in vars(_real).items():
    if not _name.startswith("_") and _name not in globals():
        globals()[_name] = _value
