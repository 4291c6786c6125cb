"""Every config key with what it takes and what it does: the one source of the shipped
conffile (``tools/debian/config.yaml``, every setting commented out at its default) and of the
section-5 man page agentzip-blk.yaml(5) (``tools/debian/gen_docs.py``).

The defaults are not written here: they are read from the schema's dataclasses and printed the
way an operator writes them (util-linux sizes: ``8G`` is 8 GiB, ``8GB`` would be 8 * 10^9), so
that uncommenting a line of the conffile can never change the value (tests/config/
test_reference.py parses the uncommented file and compares it with the defaults).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .schema import Config, default_scopes

# keys whose value is a byte count / a duration in seconds (what load.py parses them as)
SIZE_KEYS = frozenset({"compression.page_size", "pool.max_size", "pool.swap_out_max_size",
                       "policy.hot_cache_size", "device.size"})
DURATION_KEYS = frozenset({"policy.cold_grace_period"})


@dataclass(frozen=True)
class Key:
    name: str      # dotted: "pool.max_size"
    takes: str     # what it accepts, short: "zstd | lz4 | lz4hc", "size", "1-100 (percent)"
    text: str      # what it does (the man page; the conffile's comment is its first sentence)


KEYS: tuple[Key, ...] = (
    Key("compression.algorithm", "zstd | lz4 | lz4hc",
        "The codec of the dense (cold) form: frames of compression.frame_pages pages."),
    Key("compression.level", "integer",
        "Compression level: zstd 1-19, lz4hc 1-12; plain lz4 ignores it (0-16 accepted)."),
    Key("compression.dictionary", "auto | prebuilt | none | a list of names",
        "zstd dictionaries: auto (the shipped ones and the host's own, trained on its pages), "
        "prebuilt (the shipped ones only), none, or the names to use (agentzip-blk dict list)."),
    Key("compression.page_size", "4096",
        "The page size; 4096 is the only one supported."),
    Key("compression.frame_pages", "1-16",
        "New pages of one write compressed together (a frame); 1 compresses each page alone. "
        "The old name unit_pages is still accepted."),
    Key("compression.dedup", "on | off",
        "Share identical pages between slots (the bytes are compared). off: no page is shared, "
        "so no tenant can learn whether another holds a page."),
    Key("compression.warm_algorithm", "none | lz4 | zstd",
        "The fast codec a page is stored with alone when the kernel writes it, packed into "
        "frames after policy.cold_grace_period. none: frames at once."),
    Key("pool.max_size", "size",
        "Hard cap of the in-memory pool; pages beyond it go to the disk tier."),
    Key("pool.reclaim_threshold", "1-100 (percent)",
        "Share of pool.max_size at which cold pages start moving to the disk tier."),
    Key("pool.swap_out_path", "absolute path | null",
        "The disk tier's file (AES-256-GCM, a new key at every start). null: no disk tier; "
        "a full pool answers ENOSPC. An existing file there without the tier's header is "
        "refused, never emptied; `down` removes only a tier file no server holds."),
    Key("pool.swap_out_max_size", "size",
        "Cap of the disk tier; 0 is what the filesystem holds."),
    Key("pool.defrag", "true | false",
        "Compact the pool's arenas when they are fragmented."),
    Key("policy.hot_threshold_ms", "milliseconds",
        "A page read twice within this is hot: kept uncompressed in the hot cache."),
    Key("policy.warm_threshold_ms", "milliseconds",
        "A page read back and unread this long may leave RAM (policy.returned_to_disk); "
        "the tuner's hold after a backoff."),
    Key("policy.cold_grace_period", "duration",
        "Pages unread this long are packed into frames and may be demoted to the disk tier."),
    Key("policy.hot_cache_size", "size",
        "Uncompressed copies of hot pages kept; 0: no hot cache."),
    Key("policy.pressure_target", "percent (0-100]",
        "The tuner's goal: memory stall share (PSI some) of a scoped cgroup it squeezes below."),
    Key("policy.recompress_cpu", "CPUs (0-64)",
        "CPU time the recompressor may spend packing warm pages; 0: never."),
    Key("policy.returned_to_disk", "never | pressure | always",
        "Where copies of pages read back and kept in RAM go: to the disk tier while the host "
        "is short of memory (pressure), always, or never."),
    Key("scopes", "list of {cgroup: GLOB, enabled: BOOL}",
        "The cgroups the tuner works on (fnmatch globs of cgroup paths). agentzip-blk scope and "
        "the node agent write theirs to config.d/90-scopes.yaml. A drop-in that is not "
        "root's alone may set scopes and nothing else."),
    Key("device.size", "size (at most 512G)",
        "Logical size of the swap device."),
    Key("device.swap_priority", "-1..32767",
        "swapon priority of the device (higher is used first)."),
    Key("device.run_dir", "absolute path",
        "The run directory: state file, sockets, logs, the FUSE mount."),
    Key("device.rotational", "true | false",
        "Flag the loop device rotational: cluster swap readahead instead of per-process."),
    Key("device.frontend", "auto | fuse | nbdfuse | nbd",
        "How the kernel reaches the server. auto: kernel nbd where /dev/nbd0 exists, else a "
        "loop device over a FUSE file the server itself serves (fuse)."),
    Key("device.datapath", "auto | native | python",
        "Who answers FUSE reads of warm pages. auto: the C extension where it was built."),
    Key("device.request_priority", "normal | realtime",
        "The FUSE workers answer reads at SCHED_FIFO 1 (realtime), ahead of the sandboxes, or "
        "at the normal priority. Writes and requests handed to Python run at the normal one."),
    Key("device.swap_map", "auto | off",
        "Read the kernel's swap map of our area every second (a BPF program, loaded but never "
        "attached) and forget the copies of slots the kernel freed without a discard. auto: "
        "where the kernel allows it (root, BTF, a known layout; stats says why not); off: never."),
    Key("device.control_group", "group name | null",
        "A group whose members may use the read-only control verbs (stats, health, ping, "
        "slots) on RUN/control.sock, e.g. a non-root exporter. null: root only."),
    Key("metrics.listen", "HOST:PORT",
        "Where agentzip-blk metrics serves /metrics when --listen is not given "
        "(agentzip-blk-metrics.service). 9479, not OpenTelemetry's 9464. /metrics has no "
        "authentication: keep it on loopback or behind a network policy."),
)


def defaults() -> dict:
    """The default config as a plain dict (Config.to_dict of the schema's defaults)."""
    return Config().to_dict()


def default_of(name: str, config: dict | None = None) -> object:
    config = config if config is not None else defaults()
    if "." not in name:
        return config[name]
    section, key = name.split(".", 1)
    return config[section][key]


def exact_size(n: int) -> str:
    """A byte count the way util-linux reads it back exactly: the largest binary unit that
    divides it ("8G", "4M", "4096" for a page, "0")."""
    if n == 0:
        return "0"
    for letter, power in (("E", 6), ("P", 5), ("T", 4), ("G", 3), ("M", 2)):
        if n % 1024 ** power == 0:
            return f"{n // 1024 ** power}{letter}"
    return str(n)  # K would do too, but bytes read plainer for 4096


def exact_duration(seconds: float) -> str:
    return f"{seconds:g}s"


def value_text(name: str, value: object) -> str:
    """A default as it is written in YAML (scalars only; scopes are written as a list)."""
    if name in SIZE_KEYS and name != "compression.page_size":
        return exact_size(int(value))
    if name in DURATION_KEYS:
        return exact_duration(float(value))
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def keys_of(section: str) -> list[Key]:
    return [k for k in KEYS if k.name.split(".")[0] == section]


CONFFILE_HEADER = """\
# agentzip-blk configuration: agentzip-blk.yaml(5) describes every key.
#
# As shipped, every setting below is commented out and shows its default: uncommenting a
# line changes nothing. Sizes are util-linux's: K, M, G (or KiB, MiB, GiB) are powers of 1024,
# KB, MB, GB powers of 1000 (8G is 8 GiB; 8GB would be 8,000,000,000 bytes).
# Unknown keys, wrong types and impossible values are errors that name the key: nothing starts
# on a bad config. Drop-ins in config.d/*.yaml are merged over this file in name order.
# Check a change with `agentzip-blk config show` and `agentzip-blk doctor`.
"""


def conffile() -> str:
    """The shipped /etc/agentzip/config.yaml: each setting commented out (``#key: default``,
    no space after the ``#``) with a short comment; prose lines start with ``# ``."""
    cfg = defaults()
    lines = [CONFFILE_HEADER.rstrip("\n")]
    for section in sections():
        lines.append("#")
        if section == "scopes":
            doc = next(k for k in KEYS if k.name == "scopes")
            lines.append(f"{'#scopes:':<36} # {doc.takes}")
            for s in default_scopes():
                lines.append(f"#  - cgroup: {s.cgroup}")
                lines.append(f"#    enabled: {value_text('', s.enabled)}")
            continue
        lines.append(f"#{section}:")
        for k in keys_of(section):
            name = k.name.split(".", 1)[1]
            setting = f"#  {name}: {value_text(k.name, default_of(k.name, cfg))}"
            lines.append(f"{setting:<36} # {k.takes}")
    return "\n".join(lines) + "\n"


def uncomment(text: str) -> str:
    """Every commented setting of a conffile uncommented: ``#section:`` -> ``section:`` and
    ``#  key: v`` -> ``  key: v`` (a setting follows the ``#`` at once, or after the two spaces
    of its YAML indentation); prose (``# text``, one space, and ``#``) stays a comment."""
    out = []
    for line in text.splitlines():
        if re.match(r"#(?:[^\s#]|  )", line):
            line = line[1:]
        out.append(line)
    return "\n".join(out) + "\n"
