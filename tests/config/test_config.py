import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentzip_blk.config import (
    MAX_DEVICE_SIZE,
    CompressionConfig,
    Config,
    ConfigError,
    DeviceConfig,
    PolicyConfig,
    PoolConfig,
    Scope,
    load_config,
    parse_config,
)
from agentzip_blk.config import load as config_mod

GiB = 1 << 30

# The documented schema (README), plus the device section: all defaults.
SCHEMA_YAML = """\
compression:
  algorithm: zstd          # zstd | lz4 | lz4hc
  level: 3
  dictionary: auto         # auto | prebuilt | none | python312,v8,...
  page_size: 4096
pool:
  max_size: 8G
  reclaim_threshold: 80    # percent of max_size
  swap_out_path: /var/lib/agentzip/swapfile
  defrag: true
policy:
  hot_threshold_ms: 1000
  warm_threshold_ms: 10000
  cold_grace_period: 30s
scopes:
  - cgroup: agent-sandbox-*.slice
    enabled: true
device:
  size: 8G
  swap_priority: 100
  run_dir: /run/agentzip
"""


def with_value(section, key, value):
    """A config dict that is all defaults except section.key = value."""
    return {section: {key: value}}


def error_for(data, **kwargs):
    with pytest.raises(ConfigError) as info:
        parse_config(data, **kwargs)
    return str(info.value)


# --- defaults ---------------------------------------------------------------------------------

def test_defaults():
    cfg = Config()
    assert cfg.compression == CompressionConfig("zstd", 3, "auto", 4096)
    assert cfg.pool == PoolConfig(8 * GiB, 80, "/var/lib/agentzip/swapfile", 0, True)
    assert cfg.policy == PolicyConfig(1000, 10000, 30.0, 4 << 20)
    assert cfg.scopes == [Scope("agent-sandbox-*.slice", True)]
    assert cfg.device == DeviceConfig(8 * GiB, 100, "/run/agentzip")


def test_default_scopes_are_not_shared():
    a, b = Config(), Config()
    a.scopes.append(Scope("x"))
    assert b.scopes == [Scope("agent-sandbox-*.slice")]


def test_empty_mapping_and_null_sections_are_defaults():
    assert parse_config({}) == Config()
    assert parse_config({"compression": None, "pool": None, "policy": None, "device": None}) == Config()


def test_design_yaml_is_the_defaults(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(SCHEMA_YAML)
    assert load_config(str(path)) == Config()
    assert load_config(path) == Config()  # PathLike works too


def test_ConfigError_is_ValueError():
    assert issubclass(ConfigError, ValueError)


# --- round trips ------------------------------------------------------------------------------

def test_to_dict_is_plain_and_normalized():
    cfg = parse_config({"pool": {"max_size": "1.5G"}, "device": {"size": "16GiB"},
                        "policy": {"cold_grace_period": "2m"},
                        "compression": {"dictionary": "python312, v8"}})
    d = cfg.to_dict()
    assert d["pool"]["max_size"] == 3 * GiB // 2
    assert d["device"]["size"] == 16 * GiB
    assert d["policy"]["cold_grace_period"] == 120.0
    assert d["compression"]["dictionary"] == ["python312", "v8"]
    assert d["scopes"] == [{"cgroup": "agent-sandbox-*.slice", "enabled": True}]
    assert json.loads(json.dumps(d)) == d
    assert parse_config(d) == cfg


def test_to_dict_returns_a_copy():
    cfg = parse_config({"compression": {"dictionary": ["v8"]}})
    cfg.to_dict()["compression"]["dictionary"].append("x")
    assert cfg.compression.dictionary == ["v8"]


names = st.from_regex(r"[a-z0-9_-]{1,12}", fullmatch=True).filter(lambda s: s not in ("auto", "prebuilt", "none"))


@st.composite
def valid_configs(draw):
    algorithm = draw(st.sampled_from(["zstd", "lz4", "lz4hc"]))
    lo, hi = {"zstd": (1, 19), "lz4": (0, 16), "lz4hc": (1, 12)}[algorithm]
    hot = draw(st.integers(0, 10**7))
    return {
        "compression": {
            "algorithm": algorithm,
            "level": draw(st.integers(lo, hi)),
            "dictionary": draw(st.one_of(st.sampled_from(["auto", "prebuilt", "none"]),
                                         st.lists(names, min_size=1, max_size=4, unique=True))),
            "page_size": 4096,
            "frame_pages": draw(st.integers(1, 16)),
            "dedup": draw(st.sampled_from(["on", "off"])),
            "warm_algorithm": draw(st.sampled_from(["lz4", "zstd", "none"])),
        },
        "pool": {
            "max_size": draw(st.integers(1 << 20, 1 << 44)),
            "reclaim_threshold": draw(st.integers(1, 100)),
            "swap_out_path": "/" + draw(st.from_regex(r"[a-z/]{0,20}", fullmatch=True)),
            "swap_out_max_size": draw(st.integers(0, 1 << 44)),
            "defrag": draw(st.booleans()),
        },
        "policy": {
            "hot_threshold_ms": hot,
            "warm_threshold_ms": draw(st.integers(hot, 10**8)),
            "cold_grace_period": draw(st.floats(0.001, 1e6)),
            "hot_cache_size": draw(st.integers(0, 1 << 34)),
            "pressure_target": draw(st.floats(0.001, 100)),
            "recompress_cpu": draw(st.floats(0, 64)),
            "returned_to_disk": draw(st.sampled_from(["pressure", "always", "never"])),
        },
        "scopes": draw(st.lists(st.fixed_dictionaries(
            {"cgroup": st.from_regex(r"[a-z*?.-]{1,20}(\[[a-z]+\])?", fullmatch=True), "enabled": st.booleans()}),
            max_size=3)),
        "device": {
            "size": 4096 * draw(st.integers(256, MAX_DEVICE_SIZE // 4096)),
            "swap_priority": draw(st.integers(-1, 32767)),
            "run_dir": "/run/" + draw(st.from_regex(r"[a-z]{1,8}", fullmatch=True)),
            "rotational": draw(st.booleans()),
            "frontend": draw(st.sampled_from(["auto", "fuse", "nbdfuse", "nbd"])),
            "datapath": draw(st.sampled_from(["auto", "native", "python"])),
            "swap_map": draw(st.sampled_from(["auto", "off"])),
            "request_priority": draw(st.sampled_from(["realtime", "normal"])),
            "control_group": draw(st.sampled_from([None, "root"])),
        },
        "metrics": {"listen": draw(st.sampled_from(["127.0.0.1:9479", "[::1]:1", "0.0.0.0:65535"]))},
    }


@pytest.mark.slow
@given(valid_configs())
def test_round_trip(data):
    original = copy.deepcopy(data)
    cfg = parse_config(data)
    assert data == original  # input not mutated
    assert cfg.to_dict() == data  # already-normalized input comes back unchanged
    assert parse_config(cfg.to_dict()) == cfg


# --- per-key validation -----------------------------------------------------------------------

BAD_VALUES = [
    # (section, key, value, fragment expected in the message besides the dotted key)
    ("compression", "algorithm", "gzip", "zstd"),
    ("compression", "algorithm", 3, "zstd"),
    ("compression", "algorithm", "ZSTD", "zstd"),
    ("compression", "level", 25, "zstd: 1-19"),
    ("compression", "level", 0, "zstd: 1-19"),
    ("compression", "level", -3, "-3"),
    ("compression", "level", "3", "integer"),
    ("compression", "level", 3.0, "integer"),
    ("compression", "level", True, "integer"),
    ("compression", "dictionary", "", "dictionary name"),
    ("compression", "dictionary", "Python312", "Python312"),
    ("compression", "dictionary", "python312,,v8", "''"),
    ("compression", "dictionary", "auto,v8", "alone"),
    ("compression", "dictionary", ["v8", "none"], "alone"),
    ("compression", "dictionary", [], "auto"),
    ("compression", "dictionary", [3], "3"),
    ("compression", "dictionary", 7, "auto"),
    ("compression", "dictionary", None, "auto"),
    ("compression", "page_size", 8192, "4096"),
    ("compression", "page_size", 0, "4096"),
    ("compression", "page_size", -4096, "4096"),
    ("compression", "page_size", "big", "4096"),
    ("compression", "page_size", True, "4096"),
    ("compression", "unit_pages", 0, "1-16 pages"),
    ("compression", "unit_pages", 17, "1-16 pages"),
    ("compression", "unit_pages", "4", "integer"),
    ("compression", "unit_pages", True, "integer"),
    ("compression", "frame_pages", 0, "1-16 pages"),
    ("compression", "frame_pages", 17, "1-16 pages"),
    ("compression", "frame_pages", "4", "integer"),
    ("compression", "dedup", "maybe", "on | off"),
    ("compression", "dedup", "ON", "on | off"),
    ("compression", "dedup", 1, "on | off"),
    ("compression", "dedup", None, "on | off"),
    ("device", "rotational", "yes", "true or false"),
    ("device", "rotational", 1, "true or false"),
    ("pool", "max_size", 0, "too small"),
    ("pool", "max_size", -1, "negative"),
    ("pool", "max_size", "512K", "too small"),
    ("pool", "max_size", "lots", "'lots'"),
    ("pool", "max_size", True, "True"),
    ("pool", "max_size", None, "None"),
    ("pool", "reclaim_threshold", 0, "1-100"),
    ("pool", "reclaim_threshold", 101, "1-100"),
    ("pool", "reclaim_threshold", -5, "1-100"),
    ("pool", "reclaim_threshold", "80%", "integer"),
    ("pool", "reclaim_threshold", 80.5, "integer"),
    ("pool", "swap_out_path", "swapfile", "absolute"),
    ("pool", "swap_out_path", "", "absolute"),
    ("pool", "swap_out_path", 5, "absolute"),
    ("pool", "swap_out_path", "/var/lib/x\0y", "absolute"),
    ("pool", "defrag", "yes", "true or false"),
    ("pool", "defrag", 1, "true or false"),
    ("pool", "defrag", None, "true or false"),
    ("policy", "hot_threshold_ms", -1, ">= 0"),
    ("policy", "hot_threshold_ms", "1s", "integer"),
    ("policy", "hot_threshold_ms", 1.5, "integer"),
    ("policy", "hot_threshold_ms", False, "integer"),
    ("policy", "hot_threshold_ms", 20000, "warm_threshold_ms"),
    ("policy", "warm_threshold_ms", -1, ">= 0"),
    ("policy", "warm_threshold_ms", 500, "below policy.hot_threshold_ms (1000)"),  # below the default hot (1000)
    ("policy", "cold_grace_period", 0, "greater than zero"),
    ("policy", "cold_grace_period", "0s", "greater than zero"),
    ("policy", "cold_grace_period", "-5s", "negative"),
    ("policy", "cold_grace_period", "soon", "'soon'"),
    ("policy", "cold_grace_period", True, "True"),
    ("device", "size", "512K", "too small"),
    ("device", "size", -1, "negative"),
    ("device", "size", (1 << 20) + 1, "multiple of 4096"),
    ("device", "size", "1.0001M", "multiple of 4096"),
    ("device", "size", "x", "'x'"),
    ("device", "swap_priority", -2, "-1-32767"),
    ("device", "swap_priority", 32768, "-1-32767"),
    ("device", "swap_priority", "high", "integer"),
    ("device", "swap_priority", True, "integer"),
    ("device", "run_dir", "run/agentzip", "absolute"),
    ("device", "run_dir", ["/run"], "absolute"),
]


@pytest.mark.parametrize("section, key, value, fragment", BAD_VALUES)
def test_bad_value(section, key, value, fragment):
    message = error_for(with_value(section, key, value))
    assert message.startswith(f"{section}.{key}: "), message
    assert fragment in message, message


def test_level_ranges_depend_on_algorithm():
    assert parse_config({"compression": {"algorithm": "lz4", "level": 0}}).compression.level == 0
    assert parse_config({"compression": {"algorithm": "lz4", "level": 16}}).compression.level == 16
    assert parse_config({"compression": {"algorithm": "lz4hc", "level": 12}}).compression.level == 12
    assert parse_config({"compression": {"algorithm": "zstd", "level": 19}}).compression.level == 19
    assert "lz4: 0-16" in error_for({"compression": {"algorithm": "lz4", "level": 17}})
    assert "lz4hc: 1-12" in error_for({"compression": {"algorithm": "lz4hc", "level": 13}})
    assert "lz4hc: 1-12" in error_for({"compression": {"algorithm": "lz4hc", "level": 0}})
    assert error_for({"compression": {"level": 25}}) == "compression.level: 25 is out of range (zstd: 1-19)"


def test_hot_equal_warm_is_fine():
    cfg = parse_config({"policy": {"hot_threshold_ms": 0, "warm_threshold_ms": 0}})
    assert (cfg.policy.hot_threshold_ms, cfg.policy.warm_threshold_ms) == (0, 0)


def test_durations_and_sizes_accept_units():
    cfg = parse_config({"policy": {"cold_grace_period": "500ms"}, "pool": {"max_size": "1MiB"},
                        "device": {"size": 1 << 20}, "compression": {"page_size": "4K"}})
    assert cfg.policy.cold_grace_period == 0.5
    assert cfg.pool.max_size == 1 << 20
    assert cfg.device.size == 1 << 20
    assert cfg.compression.page_size == 4096
    assert parse_config({"policy": {"cold_grace_period": 45}}).policy.cold_grace_period == 45.0


def test_swap_priority_edges():
    assert parse_config({"device": {"swap_priority": -1}}).device.swap_priority == -1
    assert parse_config({"device": {"swap_priority": 32767}}).device.swap_priority == 32767


# --- dictionary forms -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, expected",
    [
        ("auto", "auto"),
        ("prebuilt", "prebuilt"),
        ("none", "none"),
        ("python312", ["python312"]),
        ("python312,v8", ["python312", "v8"]),
        ("python312, v8 ,node_20-x", ["python312", "v8", "node_20-x"]),
        (["python312", "v8"], ["python312", "v8"]),
        ("v8,python312,v8", ["v8", "python312"]),
    ],
)
def test_dictionary_forms(value, expected):
    assert parse_config({"compression": {"dictionary": value}}).compression.dictionary == expected


def test_known_dictionaries_hook():
    known = {"python312", "v8"}
    assert parse_config({"compression": {"dictionary": "v8"}},
                        known_dictionaries=known).compression.dictionary == ["v8"]
    assert parse_config({"compression": {"dictionary": "auto"}},
                        known_dictionaries=known).compression.dictionary == "auto"
    message = error_for({"compression": {"dictionary": "python312,rust"}}, known_dictionaries=known)
    assert message.startswith("compression.dictionary: ")
    assert "'rust'" in message and "python312, v8" in message


def test_known_dictionaries_unset_accepts_any_valid_name():
    assert parse_config({"compression": {"dictionary": "whatever"}}).compression.dictionary == ["whatever"]


# --- unknown keys -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "data, dotted, suggestion",
    [
        ({"compresion": {}}, "compresion", "compression"),
        ({"logging": {}}, "logging", None),
        ({"compression": {"levle": 3}}, "compression.levle", "level"),
        ({"pool": {"maxsize": "1G"}}, "pool.maxsize", "max_size"),
        ({"policy": {"hot_threshold": 5}}, "policy.hot_threshold", "hot_threshold_ms"),
        ({"device": {"swap_prio": 5}}, "device.swap_prio", "swap_priority"),
        ({"scopes": [{"cgroup": "a", "enable": False}]}, "scopes[0].enable", "enabled"),
        ({"scopes": [{"cgroup": "a"}, {"cgrop": "b"}]}, "scopes[1].cgrop", "cgroup"),
        ({1: {}}, "1", None),
    ],
)
def test_unknown_keys(data, dotted, suggestion):
    message = error_for(data)
    assert message.startswith(f"{dotted}: unknown key"), message
    if suggestion:
        assert f"did you mean '{suggestion}'" in message
    else:
        assert "did you mean" not in message


# --- sections of the wrong shape --------------------------------------------------------------

@pytest.mark.parametrize("section", ["compression", "pool", "policy", "device"])
@pytest.mark.parametrize("value", [[], "zstd", 5, True])
def test_section_must_be_mapping(section, value):
    message = error_for({section: value})
    assert message.startswith(f"{section}: ") and "mapping" in message


@pytest.mark.parametrize("data", [[], "x", 5, None])
def test_top_level_must_be_mapping(data):
    assert "mapping" in error_for(data)


# --- scopes -----------------------------------------------------------------------------------

def test_scopes_parse():
    cfg = parse_config({"scopes": [{"cgroup": "a-*.slice"}, {"cgroup": "b[0-9]?", "enabled": False},
                                   {"cgroup": "c[]]"}, {"cgroup": "d[!]x]"}]})
    assert cfg.scopes == [Scope("a-*.slice", True), Scope("b[0-9]?", False), Scope("c[]]"), Scope("d[!]x]")]


def test_empty_scopes():
    assert parse_config({"scopes": []}).scopes == []


@pytest.mark.parametrize(
    "scopes, dotted, fragment",
    [
        (None, "scopes", "list"),
        ({"cgroup": "a"}, "scopes", "list"),
        ("a-*.slice", "scopes", "list"),
        (["a-*.slice"], "scopes[0]", "mapping"),
        ([None], "scopes[0].cgroup", "missing"),
        ([{"enabled": True}], "scopes[0].cgroup", "missing"),
        ([{"cgroup": ""}], "scopes[0].cgroup", "non-empty"),
        ([{"cgroup": 5}], "scopes[0].cgroup", "string"),
        ([{"cgroup": None}], "scopes[0].cgroup", "string"),
        ([{"cgroup": "a\nb"}], "scopes[0].cgroup", "newline"),
        ([{"cgroup": "a\0b"}], "scopes[0].cgroup", "NUL"),
        ([{"cgroup": "ok"}, {"cgroup": "agent-[0-9.slice"}], "scopes[1].cgroup", "unbalanced '['"),
        ([{"cgroup": "x[]"}], "scopes[0].cgroup", "unbalanced"),
        ([{"cgroup": "x[!]"}], "scopes[0].cgroup", "unbalanced"),
        ([{"cgroup": "a", "enabled": "true"}], "scopes[0].enabled", "true or false"),
        ([{"cgroup": "a", "enabled": 0}], "scopes[0].enabled", "true or false"),
    ],
)
def test_bad_scopes(scopes, dotted, fragment):
    message = error_for({"scopes": scopes})
    assert message.startswith(f"{dotted}: "), message
    assert fragment in message, message


# --- load_config ------------------------------------------------------------------------------

def test_load_missing_explicit_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(str(path))
    assert str(path) in str(info.value)


def test_load_default_path_absent_means_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.yaml"))
    assert load_config() == Config()
    assert load_config(None) == Config()


def test_load_default_path_present_is_read(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("compression:\n  level: 7\n")
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(path))
    assert load_config().compression.level == 7
    path.write_text("compression:\n  level: 70\n")
    with pytest.raises(ConfigError, match="compression.level"):
        load_config()


def test_load_yaml_syntax_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("compression:\n  level: 3\n  algorithm: [zstd\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:") and "invalid YAML" in message


def test_load_yaml_tab_indentation_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pool:\n\tmax_size: 1G\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(path))


def test_load_duplicate_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("compression:\n  level: 3\n  level: 30\n")
    with pytest.raises(ConfigError, match="duplicate key 'level'"):
        load_config(str(path))


def test_load_merge_keys_still_work(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("scopes:\n  - &s {cgroup: a, enabled: false}\n  - <<: *s\n    cgroup: b\n")
    assert load_config(str(path)).scopes == [Scope("a", False), Scope("b", False)]


def test_load_empty_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# everything commented out\n")
    assert load_config(str(path)) == Config()


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_load_top_level_not_mapping(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="mapping") as info:
        load_config(str(path))
    assert str(path) in str(info.value)


def test_load_validation_error_names_path_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pool:\n  defrag: 'yes'\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == f"{path}: pool.defrag: 'yes' must be true or false"


def test_unquoted_yaml_yes_is_a_bool(tmp_path):
    # YAML 1.1 (PyYAML) reads bare yes/no as booleans; only quoted strings are rejected.
    path = tmp_path / "c.yaml"
    path.write_text("pool:\n  defrag: no\n")
    assert load_config(str(path)).pool.defrag is False


def test_load_directory(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_config(str(tmp_path))


def test_load_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"pool:\n  swap_out_path: /var/\xe9\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(path))


def test_load_unreadable(tmp_path, monkeypatch):
    # Faked rather than chmod 0: the suite may run as root, which can read anything.
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", args[0])

    path = tmp_path / "secret.yaml"
    path.write_text("{}\n")
    monkeypatch.setattr(config_mod, "open", denied, raising=False)
    with pytest.raises(ConfigError, match="cannot read config file") as info:
        load_config(str(path))
    assert str(path) in str(info.value) and "Permission denied" in str(info.value)


# --- frame_pages and its old name ---------------------------------------------------------------

def test_unit_pages_is_the_old_name_of_frame_pages(tmp_path):
    assert parse_config({"compression": {"unit_pages": 4}}).compression.frame_pages == 4
    assert parse_config({"compression": {"frame_pages": 4}}).compression.frame_pages == 4
    message = error_for({"compression": {"unit_pages": 4, "frame_pages": 8}})
    assert message.startswith("compression.unit_pages: ") and "frame_pages" in message
    from agentzip_blk.config import old_key_names
    old = tmp_path / "old.yaml"
    old.write_text("compression:\n  unit_pages: 8\n")
    new = tmp_path / "new.yaml"
    new.write_text("compression:\n  frame_pages: 8\n")
    assert old_key_names(old) == [("compression.unit_pages", "compression.frame_pages")]
    assert old_key_names(new) == [] and old_key_names(tmp_path / "absent.yaml") == []


@pytest.mark.parametrize("value", ["kernel", "", 1, None, ["fuse"]])
def test_device_frontend_must_be_known(value):
    with pytest.raises(ConfigError, match="device.frontend"):
        parse_config({"device": {"frontend": value}})


@pytest.mark.parametrize("value", ["", "c", "NATIVE", 1, None, ["native"]])
def test_device_datapath_must_be_known(value):
    with pytest.raises(ConfigError, match=r"device\.datapath: .* is not one of auto \| native \| python"):
        parse_config({"device": {"datapath": value}})


@pytest.mark.parametrize("value", ["", "fifo", "REALTIME", 1, None, True])
def test_device_request_priority_must_be_known(value):
    with pytest.raises(ConfigError,
                       match=r"device\.request_priority: .* is not one of realtime \| normal"):
        parse_config({"device": {"request_priority": value}})


def test_device_request_priority_defaults_to_normal():
    assert parse_config({}).device.request_priority == "normal"
    assert parse_config({"device": {"request_priority": "realtime"}}).device.request_priority == "realtime"


@pytest.mark.parametrize("listen", ["9479", "127.0.0.1", "127.0.0.1:x", ":9479", "h:70000", 9479])
def test_metrics_listen_must_be_host_and_port(listen):
    with pytest.raises(ConfigError, match=r"^metrics\.listen: .* is not HOST:PORT"):
        parse_config({"metrics": {"listen": listen}})
