"""`agentzip-blk config show [--json]`: the effective config (config.yaml with its drop-ins
merged, config.dropins) and, for every value, the file that set it or "default"."""

from __future__ import annotations

import argparse
import json

from ..codec.dictionaries import known_names
from ..config import load_layers
from ..config.quantities import format_bytes
from ._common import PROG
from .table import Column, Table, key

# keys whose value is a byte count: printed like sizes elsewhere (1.5G) unless -b
SIZE_KEYS = ("compression.page_size", "pool.max_size", "pool.swap_out_max_size",
             "policy.hot_cache_size", "device.size")

CONFIG = Table([
    Column("KEY", "dotted config key", key("key")),
    Column("VALUE", "its effective value (sizes in bytes with -b)", key("value")),
    Column("SOURCE", "the file that set it last, or default", key("source")),
])

EXAMPLES = f"""\
examples:
  {PROG} config show                    every key, its value and where it came from
  {PROG} --config /tmp/c.yaml config show --json
  {PROG} config show -o KEY,SOURCE --raw -n
"""


def register(sub) -> None:
    c = sub.add_parser("config", help="the effective config and where each value comes from",
                       description="Inspect the configuration: config.yaml (or --config) with "
                                   "the drop-ins of config.d/ next to it merged in name order.",
                       epilog=f"example:\n  {PROG} config show",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = c.add_subparsers(dest="config_command", metavar="ACTION", help="show")
    csub.required = True
    s = csub.add_parser("show", help="print the merged config with the source of each value",
                        description="The merged effective config, one key per line, with the "
                                    "file that set each value (the last one in merge order) or "
                                    "\"default\". A bad file is an error naming it and the key.",
                        epilog=EXAMPLES + "\n" + CONFIG.columns_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    CONFIG.add_arguments(s, 'print {"files", "config", "sources"} as one JSON object')
    s.set_defaults(func=cmd_show)


def _leaves(config: dict) -> list[tuple[str, object]]:
    out = []
    for section, value in config.items():
        if isinstance(value, dict):
            out.extend((f"{section}.{k}", v) for k, v in value.items())
        else:
            out.append((section, value))
    return out


def _text(name: str, value: object, exact: bool) -> str:
    if name in SIZE_KEYS and not exact:
        return format_bytes(int(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def cmd_show(args) -> int:
    CONFIG.select(args.output, args.output_all)
    loaded = load_layers(args.config, known_dictionaries=known_names())
    config = loaded.config.to_dict()
    leaves = _leaves(config)
    sources = {}
    for name, _ in leaves:
        # a value set as a whole (scopes) or key by key: the file that set it, or a part of it
        parts = [v for k, v in loaded.sources.items() if k == name or k.startswith(name + ".")]
        sources[name] = loaded.sources.get(name) or (parts[-1] if parts else "default")
    if args.json:
        print(json.dumps({"files": loaded.files, "config": config, "sources": sources},
                         sort_keys=True))
        return 0
    rows = [{"key": k, "value": _text(k, v, args.bytes), "source": sources[k]} for k, v in leaves]
    print(CONFIG.print_args(rows, args))
    return 0
