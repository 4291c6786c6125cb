"""Bad configs: every key with wrong types and impossible values, unknown algorithms and
dictionaries, bad globs, broken YAML, and random structures. Each must be a ConfigError
whose message names the key (never another exception), and a real nbdkit given one must
exit before it listens or creates anything (no partial start)."""

from __future__ import annotations

import os
import subprocess

import pytest

from agentzip_blk.config import ConfigError, load_config, parse_config

from . import support

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("AGENTZIP_FUZZ_EXAMPLES", "120"))
tried = {"n": 0}

# Values no key accepts (bool is fine only for the boolean keys, which get their own list).
ALWAYS_BAD = [None, [], [1, 2], {"a": 1}, float("nan"), float("-inf"), "\0", "-1"]
NOT_BOOL = ["yes", "true", 1, 0, "on"]

BAD: dict[str, list] = {
    "compression.algorithm": ["brotli", "ZSTD", "", 3, True, "zstd lz4"],
    "compression.level": [0, 20, -1, 100, "3", 3.0, True, 2**70],
    "compression.dictionary": [5, True, "", "Bad Name", "auto,v8", ["v8", 1], [], "v8,,x",
                               "../etc/passwd"],
    "compression.page_size": [8192, "8K", 512, -4096, 0, True, "4096x"],
    "compression.dedup": ["yes", "maybe", 1, 0, "", "ON!", ["on"]],
    "pool.max_size": [-1, "-1G", "1X", 0, "0.5K", 1000, True, "1 0G", "inf"],
    "pool.reclaim_threshold": [0, 101, -5, "80", 80.5, True],
    "pool.swap_out_path": ["relative/path", 5, "", "/a\0b", "/a\nb", True],
    "pool.swap_out_max_size": [-1, "abc", True, "-5M"],
    "pool.defrag": NOT_BOOL,
    "policy.hot_threshold_ms": [-1, "1000", 1.5, True, 20000],
    "policy.warm_threshold_ms": [-1, "10s", 10.5, True, 10],
    "policy.cold_grace_period": [0, "-5s", "abc", "0s", -1, True, "5 parsecs"],
    "policy.hot_cache_size": [-1, "x", True, "-1K"],
    "device.size": [0, -1, "1000", 1048577, "1.5K", True, "100T0"],
    "device.swap_priority": [-2, 32768, "100", True, 1.5],
    "device.run_dir": ["run", 1, "", True],
}
BAD_SCOPES = [None, "agent-*", [{"cgroup": "a["}], [{}], [{"cgroup": 5}],
              [{"cgroup": "x", "enabled": "yes"}], ["str"], [{"cgroup": "x", "extra": 1}],
              [{"cgroup": ""}], [{"cgroup": "a\nb"}], [{"cgroup": "ok"}, {"cgroup": "[!"}], 7]


def _config_with(dotted: str, value) -> dict:
    section, key = dotted.split(".")
    return {section: {key: value}}


# null is a meaning for these keys, not a bad value: pool.swap_out_path null disables the tier
NULL_MEANS_SOMETHING = {"pool.swap_out_path"}


def bad_values_of(dotted: str) -> list:
    extra = [v for v in ALWAYS_BAD if not (dotted == "compression.dictionary" and v == "-1")
             and not (v is None and dotted in NULL_MEANS_SOMETHING)]
    return BAD[dotted] + extra + ([2] if dotted == "pool.defrag" else [])


@pytest.mark.parametrize("dotted", sorted(BAD))
def test_every_key_rejects_bad_values(dotted):
    for value in bad_values_of(dotted):
        with pytest.raises(ConfigError) as err:
            try:
                parse_config(_config_with(dotted, value))
            except ConfigError:
                raise
            else:
                pytest.fail(f"{dotted}={value!r} accepted")
        tried["n"] += 1
        assert dotted in str(err.value), f"{dotted}={value!r}: {err.value}"


@pytest.mark.parametrize("scopes", BAD_SCOPES, ids=range(len(BAD_SCOPES)))
def test_bad_scopes(scopes):
    with pytest.raises(ConfigError, match=r"scopes"):
        parse_config({"scopes": scopes})
    tried["n"] += 1


def test_unknown_keys_and_sections():
    for data in ({"compresion": {}}, {"pool": {"max": "1G"}}, {"policy": {"hot": 1}},
                 {"device": {"sise": "1G"}}, {5: {}}, {"pool": {None: 1}}):
        with pytest.raises(ConfigError, match="unknown key"):
            parse_config(data)
        tried["n"] += 1


def test_unknown_dictionary_when_the_set_is_known():
    known = {"python312", "v8"}
    assert parse_config({"compression": {"dictionary": "python312,v8"}},
                        known_dictionaries=known).compression.dictionary == ["python312", "v8"]
    for value in ("python2", "v8,node", ["chromium"]):
        with pytest.raises(ConfigError, match=r"compression.dictionary: unknown dictionary"):
            parse_config({"compression": {"dictionary": value}}, known_dictionaries=known)
        tried["n"] += 1


keys = st.sampled_from(sorted(BAD))
bad_values = keys.flatmap(lambda k: st.tuples(st.just(k), st.sampled_from(bad_values_of(k))))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(bad_values, min_size=1, max_size=4, unique_by=lambda kv: kv[0]))
def test_any_bad_value_is_named(pairs):
    data: dict = {}
    for dotted, value in pairs:
        section, key = dotted.split(".")
        data.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    tried["n"] += 1
    msg = str(err.value)
    assert any(dotted in msg for dotted, _ in pairs) or "warm_threshold_ms" in msg, msg


leaf = (st.none() | st.booleans() | st.integers(-2**66, 2**66) | st.floats()
        | st.text(max_size=20) | st.sampled_from(["1G", "4K", "30s", "zstd", "/tmp/x", "auto"]))
names = st.sampled_from(["compression", "pool", "policy", "scopes", "device", "algorithm",
                         "level", "dictionary", "max_size", "swap_out_path", "cgroup",
                         "enabled", "size", "run_dir"]) | st.text(max_size=8)
structures = st.recursive(leaf, lambda c: st.lists(c, max_size=4)
                          | st.dictionaries(names, c, max_size=5), max_leaves=25)


@settings(max_examples=EXAMPLES * 3, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(structures)
def test_random_structures_only_ever_raise_config_error(data):
    tried["n"] += 1
    try:
        parse_config(data)
    except ConfigError as exc:
        assert str(exc)
        assert ":" in str(exc), f"no key named in {exc}"


BROKEN_YAML = [b"pool: [unclosed", b"pool:\n  max_size: 1G\n  max_size: 2G\n", b"\xff\xfe\x00bad",
               b"- a list\n- at top\n", b"just a string", b"pool: !!python/object:os.system x",
               b"compression:\n\tlevel: 3\n", b"{" * 10000]


@pytest.mark.parametrize("text", BROKEN_YAML, ids=range(len(BROKEN_YAML)))
def test_broken_yaml_names_the_file(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    tried["n"] += 1
    assert str(path) in str(err.value)


NBDKIT_BAD = [
    ("compression:\n  level: 42\n", "compression.level"),
    ("compression:\n  algorithm: brotli\n", "compression.algorithm"),
    ("compression:\n  dictionary: 'Bad Name'\n", "compression.dictionary"),
    ("pool:\n  max_size: -1G\n", "pool.max_size"),
    ("pool:\n  reclaim_threshold: 0\n", "pool.reclaim_threshold"),
    ("policy:\n  cold_grace_period: 0s\n", "policy.cold_grace_period"),
    ("scopes:\n  - cgroup: 'agent-[*.slice'\n", "scopes[0].cgroup"),
    ("device:\n  swap_priority: 99999\n", "device.swap_priority"),
    ("pool:\n  swap_out_path: relative\n", "pool.swap_out_path"),
]


@pytest.mark.skipif(not support.shutil.which("nbdkit"), reason="nbdkit missing")
@pytest.mark.parametrize("text,key", NBDKIT_BAD, ids=[k for _, k in NBDKIT_BAD])
def test_nbdkit_refuses_to_start(tmp_path, text, key):
    """The plugin validates in config_complete: nbdkit exits non-zero naming the key, and
    leaves no NBD socket, control socket or disk tier file behind."""
    tier = tmp_path / "disk-tier"
    config = tmp_path / "config.yaml"
    # the swap_out_path line goes first so the bad section can add to pool too
    config.write_text(text if "swap_out_path" in text else
                      text + ("" if text.startswith("pool:") else "pool:\n")
                      + f"  swap_out_path: {tier}\n")
    nbd_sock, ctl_sock = tmp_path / "nbd.sock", tmp_path / "control.sock"
    proc = subprocess.run(
        ["nbdkit", "-f", "-U", str(nbd_sock), "python", str(support.PLUGIN), "size=64M",
         f"control={ctl_sock}", f"config={config}"],
        capture_output=True, text=True, env=support.plugin_env(), timeout=60)
    tried["n"] += 1
    assert proc.returncode != 0
    assert key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr or "ConfigError" in proc.stderr
    assert not nbd_sock.exists() and not ctl_sock.exists() and not tier.exists()


def test_zz_record():
    support.record("config_fuzz", hostile_inputs=tried["n"])
