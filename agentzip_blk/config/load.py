"""Strict validation of a config mapping, and loading it from YAML.

The program must not start on a bad config, so every problem is a ConfigError whose message names
the dotted key, the offending value and what is allowed, e.g.
``compression.level: 25 is out of range (zstd: 1-19)``.

Which dictionary names exist is the codec's knowledge (its shipped manifest); callers that know
them pass `known_dictionaries`, and without it names are only checked for syntax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import grp
import hashlib
import hmac
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

import yaml

from ..errors import ConfigError
from .dropins import (
    NON_ROOT_KEYS,
    Sources,
    dropin_dir,
    dropin_files,
    limited_by,
    merge,
    normalized_key,
)
from .quantities import decimal_hint, format_bytes, parse_duration, parse_size
from .schema import (
    ALGORITHMS,
    DATAPATHS,
    DEDUP_MODES,
    DEFAULT_CONFIG_PATH,
    DICTIONARY_MODES,
    FRONTENDS,
    KEY_ALIASES,
    LEVEL_RANGES,
    MAX_DEVICE_SIZE,
    MAX_FRAME_PAGES,
    MIN_SIZE,
    REQUEST_PRIORITIES,
    RETURNED_TO_DISK,
    SUPPORTED_PAGE_SIZE,
    SWAP_MAP_MODES,
    SWAP_PRIORITY_RANGE,
    WARM_ALGORITHMS,
    CompressionConfig,
    Config,
    DeviceConfig,
    MetricsConfig,
    PolicyConfig,
    PoolConfig,
    Scope,
    default_scopes,
)

_DICTIONARY_NAME = re.compile(r"[a-z0-9_-]+")


# --- validation helpers: each takes the dotted key so messages can name it -----------------------

def _mapping(value: Any, key: str, cls: type) -> Mapping:
    """Check a section is a mapping with only known keys; a null section means "all defaults".
    A key's old spelling (KEY_ALIASES) is renamed to the new one; both at once are an error."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: {value!r} must be a mapping")
    known = [f.name for f in dataclasses.fields(cls)]
    renamed = {old: new for (section, old), new in KEY_ALIASES.items() if section == key}
    for old, new in renamed.items():
        if old in value:
            if new in value:
                raise ConfigError(f"{key}.{old}: the old name of {key}.{new}; give only one")
            value = {(new if name == old else name): v for name, v in value.items()}
    for name in value:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            dotted = f"{key}.{name}" if key else str(name)
            raise ConfigError(f"{dotted}: unknown key ({hint}known keys: {', '.join(known)})")
    return value


def _int(value: Any, key: str, lo: int, hi: int | None = None, allowed: str | None = None) -> int:
    allowed = allowed or (f"{lo}-{hi}" if hi is not None else f">= {lo}")
    # bool is an int subclass; `level: true` must not become level 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: {value!r} must be an integer ({allowed})")
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{key}: {value} is out of range ({allowed})")
    return value


def _bool(value: Any, key: str) -> bool:
    # Only real YAML booleans: a quoted "yes" or a 1 is more likely a mistake than intent.
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} must be true or false")
    return value


def _size(value: Any, key: str, minimum: int = MIN_SIZE) -> int:
    try:
        size = parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    if size < minimum:
        raise ConfigError(f"{key}: {value!r} is too small (minimum {minimum} bytes)"
                          f"{decimal_hint(value)}")
    return size


def _abs_path(value: Any, key: str) -> str:
    if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value or "\n" in value:
        raise ConfigError(f"{key}: {value!r} must be an absolute path")
    return value


def glob_problem(pattern: str) -> str | None:
    """Why `pattern` is not a sensible fnmatch glob, or None.

    fnmatch itself never fails: an unclosed '[' silently matches a literal '[', which would make a
    scope quietly match nothing. Bracket parsing mirrors fnmatch.translate ('!' negates, a ']'
    right after the opening bracket is literal).
    """
    if not pattern:
        return "must be a non-empty glob"
    if "\0" in pattern or "\n" in pattern:
        return "must not contain NUL or newline characters"
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            j = i + 1
            if pattern[j:j + 1] == "!":
                j += 1
            if pattern[j:j + 1] == "]":
                j += 1
            close = pattern.find("]", j)
            if close < 0:
                return f"has an unbalanced '[' at position {i}"
            i = close + 1
        else:
            i += 1
    return None


# --- sections ---------------------------------------------------------------------------------

def _parse_dictionary(value: Any, key: str,
                      known_dictionaries: Collection[str] | None) -> str | list[str]:
    allowed = f"{', '.join(DICTIONARY_MODES)}, or a list / comma-separated string of dictionary names"
    if isinstance(value, str):
        if value.strip() in DICTIONARY_MODES:
            return value.strip()
        names = [part.strip() for part in value.split(",")]
    elif isinstance(value, list) and value:
        names = value
    else:
        raise ConfigError(f"{key}: {value!r} is not allowed (expected {allowed})")
    result: list[str] = []
    for name in names:
        if not isinstance(name, str) or not _DICTIONARY_NAME.fullmatch(name):
            raise ConfigError(f"{key}: {name!r} is not a valid dictionary name (use a-z, 0-9, '_', '-')")
        if name in DICTIONARY_MODES:
            raise ConfigError(f"{key}: {name!r} cannot be combined with dictionary names; use it alone")
        if known_dictionaries is not None and name not in known_dictionaries:
            known = sorted(known_dictionaries)
            raise ConfigError(f"{key}: unknown dictionary {name!r} (known: {', '.join(known) or 'none'})")
        if name not in result:  # "v8,v8" is harmless; keep the first occurrence's order
            result.append(name)
    return result


def _parse_compression(value: Any, known_dictionaries: Collection[str] | None) -> CompressionConfig:
    written = value.keys() if isinstance(value, Mapping) else ()
    data = _mapping(value, "compression", CompressionConfig)
    d = CompressionConfig()
    algorithm = data.get("algorithm", d.algorithm)
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ConfigError(f"compression.algorithm: {algorithm!r} is not supported ({' | '.join(ALGORITHMS)})")
    lo, hi = LEVEL_RANGES[algorithm]
    level = _int(data.get("level", d.level), "compression.level", lo, hi, f"{algorithm}: {lo}-{hi}")
    dictionary = _parse_dictionary(data.get("dictionary", d.dictionary), "compression.dictionary",
                                   known_dictionaries)
    page_size = data.get("page_size", d.page_size)
    try:
        supported = parse_size(page_size) == SUPPORTED_PAGE_SIZE  # "4K" is fine too
    except ValueError:
        supported = False
    if not supported:
        raise ConfigError(f"compression.page_size: {page_size!r} is not supported (only 4096)")
    frame_key = "unit_pages" if "unit_pages" in written else "frame_pages"  # name what was written
    frame_pages = _int(data.get("frame_pages", d.frame_pages), f"compression.{frame_key}", 1,
                       MAX_FRAME_PAGES, f"1-{MAX_FRAME_PAGES} pages")
    dedup = _dedup(data.get("dedup", d.dedup))
    warm = data.get("warm_algorithm", d.warm_algorithm)
    if not isinstance(warm, str) or warm not in WARM_ALGORITHMS:
        raise ConfigError(f"compression.warm_algorithm: {warm!r} is not supported "
                          f"({' | '.join(WARM_ALGORITHMS)})")
    return CompressionConfig(algorithm, level, dictionary, SUPPORTED_PAGE_SIZE, frame_pages, dedup,
                             warm)


def _dedup(value: Any) -> str:
    # YAML 1.1 reads a bare on/off as a boolean: take those as meant.
    if isinstance(value, bool):
        return "on" if value else "off"
    if not isinstance(value, str) or value not in DEDUP_MODES:
        raise ConfigError(f"compression.dedup: {value!r} is not one of {' | '.join(DEDUP_MODES)}")
    return value


def _parse_pool(value: Any) -> PoolConfig:
    data = _mapping(value, "pool", PoolConfig)
    d = PoolConfig()
    return PoolConfig(
        max_size=_size(data.get("max_size", d.max_size), "pool.max_size"),
        reclaim_threshold=_int(data.get("reclaim_threshold", d.reclaim_threshold),
                               "pool.reclaim_threshold", 1, 100, "1-100 percent"),
        # null: no disk tier (nothing of the sandboxes' memory is ever written to disk)
        swap_out_path=(None if data.get("swap_out_path", d.swap_out_path) is None else
                       _abs_path(data.get("swap_out_path", d.swap_out_path), "pool.swap_out_path")),
        swap_out_max_size=_size(data.get("swap_out_max_size", d.swap_out_max_size),
                                "pool.swap_out_max_size", minimum=0),
        defrag=_bool(data.get("defrag", d.defrag), "pool.defrag"),
    )


def _parse_policy(value: Any) -> PolicyConfig:
    data = _mapping(value, "policy", PolicyConfig)
    d = PolicyConfig()
    hot = _int(data.get("hot_threshold_ms", d.hot_threshold_ms), "policy.hot_threshold_ms", 0,
               allowed="milliseconds >= 0")
    warm = _int(data.get("warm_threshold_ms", d.warm_threshold_ms), "policy.warm_threshold_ms", 0,
                allowed="milliseconds >= 0")
    if hot > warm:
        # Blame the key the user actually wrote, so "warm: 500" alone is not reported as a hot problem.
        if "hot_threshold_ms" in data:
            raise ConfigError(f"policy.hot_threshold_ms: {hot} must not exceed policy.warm_threshold_ms ({warm})")
        raise ConfigError(f"policy.warm_threshold_ms: {warm} is below policy.hot_threshold_ms ({hot})")
    grace = data.get("cold_grace_period", d.cold_grace_period)
    try:
        seconds = parse_duration(grace)
    except ValueError as e:
        raise ConfigError(f"policy.cold_grace_period: {e}") from None
    if seconds <= 0:
        raise ConfigError(f"policy.cold_grace_period: {grace!r} must be greater than zero")
    hot_cache = _size(data.get("hot_cache_size", d.hot_cache_size), "policy.hot_cache_size", minimum=0)
    target = data.get("pressure_target", d.pressure_target)
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 100:
        raise ConfigError(f"policy.pressure_target: {target!r} must be a number of percent, "
                          "greater than 0 and at most 100 (e.g. 0.1)")
    cpu = data.get("recompress_cpu", d.recompress_cpu)
    if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0 <= cpu <= 64:
        raise ConfigError(f"policy.recompress_cpu: {cpu!r} must be a number of CPUs from 0 "
                          "to 64 (e.g. 0.25 for a quarter of one CPU; 0: never recompress)")
    returned = _choice(data.get("returned_to_disk", d.returned_to_disk), "policy.returned_to_disk",
                       RETURNED_TO_DISK)
    return PolicyConfig(hot, warm, seconds, hot_cache, float(target), float(cpu), returned)


def _parse_scopes(value: Any) -> list[Scope]:
    if not isinstance(value, list):
        # A null `scopes:` is rejected rather than guessed at: "no scopes" is spelled `scopes: []`.
        raise ConfigError(f"scopes: {value!r} must be a list of {{cgroup: GLOB, enabled: BOOL}} (use [] for none)")
    scopes = []
    for i, item in enumerate(value):
        key = f"scopes[{i}]"
        data = _mapping(item, key, Scope)
        if "cgroup" not in data:
            raise ConfigError(f"{key}.cgroup: missing (each scope needs a cgroup glob)")
        cgroup = data["cgroup"]
        problem = glob_problem(cgroup) if isinstance(cgroup, str) else "must be a string glob"
        if problem:
            raise ConfigError(f"{key}.cgroup: {cgroup!r} {problem}")
        scopes.append(Scope(cgroup, _bool(data.get("enabled", True), f"{key}.enabled")))
    return scopes


def check_device_size(size: int, key: str, raw: Any = None) -> None:
    """A device the store can hold: its 32-bit blob ids bound it (schema.MAX_DEVICE_SIZE)."""
    if size > MAX_DEVICE_SIZE:
        raise ConfigError(f"{key}: {raw if raw is not None else size!r} is too large (at most "
                          f"{format_bytes(MAX_DEVICE_SIZE)}: the store names pages with 32-bit ids)")


def _parse_device(value: Any) -> DeviceConfig:
    data = _mapping(value, "device", DeviceConfig)
    d = DeviceConfig()
    raw_size = data.get("size", d.size)
    size = _size(raw_size, "device.size")
    if size % SUPPORTED_PAGE_SIZE:  # the kernel swaps whole pages; a partial last page is useless
        raise ConfigError(f"device.size: {raw_size!r} must be a multiple of {SUPPORTED_PAGE_SIZE} "
                          f"bytes{decimal_hint(raw_size)}")
    check_device_size(size, "device.size", raw_size)
    lo, hi = SWAP_PRIORITY_RANGE
    return DeviceConfig(
        size=size,
        swap_priority=_int(data.get("swap_priority", d.swap_priority), "device.swap_priority", lo, hi),
        run_dir=_abs_path(data.get("run_dir", d.run_dir), "device.run_dir"),
        rotational=_bool(data.get("rotational", d.rotational), "device.rotational"),
        frontend=_choice(data.get("frontend", d.frontend), "device.frontend", FRONTENDS),
        datapath=_choice(data.get("datapath", d.datapath), "device.datapath", DATAPATHS),
        swap_map=_choice(data.get("swap_map", d.swap_map), "device.swap_map", SWAP_MAP_MODES),
        request_priority=_choice(data.get("request_priority", d.request_priority),
                                 "device.request_priority", REQUEST_PRIORITIES),
        control_group=_group(data.get("control_group", d.control_group), "device.control_group"),
    )


_GROUP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def _group(value: Any, key: str) -> str | None:
    """A group name that exists on this host (it is resolved to a gid at start), or null."""
    if value is None:
        return None
    if not isinstance(value, str) or not _GROUP_NAME.fullmatch(value):
        raise ConfigError(f"{key}: {value!r} is not a group name (letters, digits, _ . -; "
                          f"null for root only)")
    try:
        grp.getgrnam(value)
    except KeyError:
        raise ConfigError(f"{key}: no group {value!r} on this host (getent group {value}); "
                          f"create it or set null for root only") from None
    return value


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {' | '.join(choices)}")
    return value


def parse_config(data: Mapping[str, Any], *,
                 known_dictionaries: Collection[str] | None = None) -> Config:
    """Validate a config mapping (e.g. parsed YAML, or Config.to_dict()) into a Config.
    `known_dictionaries`: the dictionary names that exist (None: check their syntax only)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"top level: {data!r} must be a mapping of sections")
    data = _mapping(data, "", Config)
    return Config(
        compression=_parse_compression(data.get("compression"), known_dictionaries),
        pool=_parse_pool(data.get("pool")),
        policy=_parse_policy(data.get("policy")),
        scopes=_parse_scopes(data["scopes"]) if "scopes" in data else default_scopes(),
        device=_parse_device(data.get("device")),
        metrics=_parse_metrics(data.get("metrics")),
    )


def parse_listen(text: Any, key: str = "metrics.listen") -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port); ConfigError naming *key*."""
    host, sep, port = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: {text!r} is not HOST:PORT (e.g. 127.0.0.1:9479, "
                          f"[::1]:9479, 0.0.0.0:9479)")
    return host.strip("[]"), int(port)


def _parse_metrics(value: Any) -> MetricsConfig:
    data = _mapping(value, "metrics", MetricsConfig)
    listen = data.get("listen", MetricsConfig().listen)
    parse_listen(listen)
    return MetricsConfig(listen=listen)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys; PyYAML silently keeps the last one, hiding mistakes."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = []
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` overrides are legitimate YAML
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark)
        seen.append(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _resolve(path: str | os.PathLike[str] | None) -> str | None:
    """The file to read: DEFAULT_CONFIG_PATH for None when it exists, else None (defaults)."""
    if path is None:
        return DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None
    return os.fspath(path)


def _read_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from None
    return _parse_yaml(text, path)


def _read_dropin(path: str) -> tuple[Any, str | None]:
    """A drop-in's data, and why it is not root's alone (dropins.limited_by), both from one
    open: the file checked is the file read."""
    try:
        link = os.lstat(path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        try:
            text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read config file: {e}") from None
    return _parse_yaml(text, path), limited_by(link, st)


def _parse_yaml(text: str, path: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:  # PyYAML recurses per nesting level: "{{{{..." must not crash us
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None


@dataclasses.dataclass
class LoadedConfig:
    """A validated config with where it came from: the files read in merge order (config.yaml
    first, then its drop-ins) and, per dotted key set by one of them, the file that set it
    last (keys absent from `sources` are defaults)."""
    config: Config
    files: list[str]
    sources: Sources


def _top_mapping(data: Any, path: str) -> Mapping:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level: {data!r} must be a mapping of sections")
    return data


def load_layers(path: str | os.PathLike[str] | None = None, *,
                known_dictionaries: Collection[str] | None = None,
                replace: Mapping[str, Any] | None = None,
                missing_ok: bool = False) -> LoadedConfig:
    """Load config.yaml and its drop-ins (`dropins`), merged and validated.

    Each file is validated merged over the ones before it, so an error names the file that
    made the config invalid and the key, e.g. ``/etc/agentzip/config.d/20-x.yaml:
    pool.max_size: ...``. *replace* maps a drop-in path to the data it is about to hold (a
    writer validates its edit before writing it). *missing_ok*: an explicitly named file that
    does not exist reads as empty (its drop-ins still count).
    """
    resolved = _resolve(path)
    base = resolved if resolved is not None else (None if path is not None else DEFAULT_CONFIG_PATH)
    files: list[str] = []
    layers: list[tuple[str, Any]] = []
    if resolved is not None and not (missing_ok and not os.path.exists(resolved)):
        layers.append((resolved, _read_yaml(resolved)))
        files.append(resolved)
    directory = dropin_dir(base if base is not None else DEFAULT_CONFIG_PATH)
    replace = {os.path.abspath(k): v for k, v in (replace or {}).items()}
    dropins = dropin_files(directory)
    for extra in replace:
        if extra not in dropins and os.path.dirname(extra) == directory:
            dropins = sorted(dropins + [extra], key=os.path.basename)
    limits: dict[str, str] = {}  # drop-in -> why it may set NON_ROOT_KEYS only
    for dropin in dropins:
        if dropin in replace:  # written next by this process: its own uid's
            layers.append((dropin, replace[dropin]))
        else:
            data, limit = _read_dropin(dropin)
            layers.append((dropin, data))
            if limit:
                limits[dropin] = limit
        files.append(dropin)
    merged: dict = {}
    sources: Sources = {}
    config = Config()
    for origin, data in layers:
        data = _top_mapping(data, origin)
        if origin in limits:
            for key in data:
                if key not in NON_ROOT_KEYS:
                    raise ConfigError(f"{origin}: {key}: this drop-in is {limits[origin]}, not "
                                      f"root's alone: it may set {', '.join(NON_ROOT_KEYS)} "
                                      f"and nothing else")
        merged = merge(merged, data, origin, sources)
        try:
            config = parse_config(merged, known_dictionaries=known_dictionaries)
        except ConfigError as e:
            raise ConfigError(f"{origin}: {e}") from None
    return LoadedConfig(config, files, {normalized_key(k): v for k, v in sources.items()})


def config_digest(data: bytes) -> str:
    """The SHA-256 (hex) by which `up` pins the config file it hands its server."""
    return hashlib.sha256(data).hexdigest()


def load_file(path: str | os.PathLike[str], *, sha256: str | None = None,
              known_dictionaries: Collection[str] | None = None) -> Config:
    """Exactly one config file, without drop-ins: the effective config `up` wrote into the
    run directory for its server (host.chain.write_effective_config), which already holds
    whatever the operator's drop-ins said. The run directory is no place to take orders
    from (a container that mounts it read-write can write there), so nothing beside that
    file is read, and with *sha256* its bytes must be the ones `up` wrote: a file replaced
    or edited since is a ConfigError, and the server does not start on it."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_PINNED_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    if len(data) > MAX_PINNED_BYTES:
        raise ConfigError(f"{path}: config file larger than {MAX_PINNED_BYTES} bytes")
    if sha256 is not None and not hmac.compare_digest(config_digest(data), sha256):
        raise ConfigError(f"{path}: not the config `agentzip-blk up` wrote (its SHA-256 "
                          f"differs): refusing to start on it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from None
    data = _top_mapping(_parse_yaml(text, path), path)  # errors name the path already
    try:
        return parse_config(data, known_dictionaries=known_dictionaries)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


MAX_PINNED_BYTES = 1 << 20  # the effective config is a few hundred bytes


def load_config(path: str | os.PathLike[str] | None = None, *,
                known_dictionaries: Collection[str] | None = None) -> Config:
    """Load and validate a YAML config file and its drop-ins (`load_layers`).

    None means DEFAULT_CONFIG_PATH if it exists, else all defaults; an explicitly named file must
    exist. An empty file means all defaults. Every error is a ConfigError naming the path.
    """
    return load_layers(path, known_dictionaries=known_dictionaries).config


def old_key_names(path: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
    """(old, new) dotted names of the keys the config file or its drop-ins spell the old way
    (KEY_ALIASES): still accepted, and `doctor` says so. A file that cannot be read has none."""
    resolved = _resolve(path)
    base = resolved if resolved is not None else DEFAULT_CONFIG_PATH
    files = [resolved] if resolved else []
    with contextlib.suppress(ConfigError):  # an unreadable config.d: `load_config` says so
        files += dropin_files(dropin_dir(base))
    found: list[tuple[str, str]] = []
    for file in files:
        try:
            data = _read_yaml(file)
        except ConfigError:
            continue
        for (section, old), new in KEY_ALIASES.items():
            part = data.get(section) if isinstance(data, Mapping) else None
            pair = (f"{section}.{old}", f"{section}.{new}")
            if isinstance(part, Mapping) and old in part and pair not in found:
                found.append(pair)
    return found
