"""config.d drop-ins: merged in name order over config.yaml (mappings key by key, anything
else replaced), validated file by file so an error names the file and the key, and the
source of every value for `config show`."""

from __future__ import annotations

import json
import os

import pytest

from agentzip_blk.config import ConfigError, Scope, load_config, load_layers
from agentzip_blk.config import load as config_mod
from cli.clirun import one_error_line, run

MiB = 1 << 20


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


@pytest.fixture
def etc(tmp_path):
    """A config.yaml and an empty config.d next to it."""
    base = write(tmp_path / "config.yaml",
                 "compression:\n  level: 3\n  algorithm: zstd\npool:\n  max_size: 64M\n"
                 "scopes:\n  - cgroup: a-*\n  - cgroup: b-*\n")
    os.makedirs(tmp_path / "config.d")
    return base, tmp_path / "config.d"


def test_name_order_key_by_key_and_sources(etc):
    base, d = etc
    # written out of order: the name decides, not the mtime
    b = write(d / "20-b.yaml", "compression:\n  level: 7\n")
    a = write(d / "10-a.yaml", "compression:\n  level: 5\n  algorithm: lz4hc\npool:\n  defrag: false\n")
    write(d / ".90-hidden.yaml", "compression:\n  level: 1\n")  # editors' and our temp files
    write(d / "30-c.yml", "compression:\n  level: 2\n")  # only *.yaml counts
    write(d / "README", "not yaml: [")
    loaded = load_layers(base)
    cfg = loaded.config
    assert (cfg.compression.algorithm, cfg.compression.level) == ("lz4hc", 7)
    assert cfg.pool.max_size == 64 * MiB and cfg.pool.defrag is False  # merged key by key
    assert cfg.scopes == [Scope("a-*"), Scope("b-*")]
    assert loaded.files == [base, a, b]
    assert loaded.sources == {"compression.level": b, "compression.algorithm": a,
                              "pool.max_size": base, "pool.defrag": a, "scopes": base}
    assert load_config(base) == cfg


def test_lists_are_replaced_and_null_sections_change_nothing(etc):
    base, d = etc
    write(d / "50-scopes.yaml", "scopes:\n  - cgroup: c-*\n    enabled: false\npool:\n")
    cfg = load_config(base)
    assert cfg.scopes == [Scope("c-*", False)]
    assert cfg.pool.max_size == 64 * MiB
    write(d / "60-none.yaml", "scopes: []\n")
    assert load_config(base).scopes == []
    write(d / "70-empty.yaml", "# nothing but a comment\n")
    assert load_config(base).scopes == []


def test_old_and_new_key_name_replace_each_other(tmp_path):
    base = write(tmp_path / "config.yaml", "compression:\n  unit_pages: 4\n")
    write(tmp_path / "config.d" / "10.yaml", "compression:\n  frame_pages: 8\n")
    loaded = load_layers(base)
    assert loaded.config.compression.frame_pages == 8
    assert loaded.sources["compression.frame_pages"].endswith("10.yaml")
    write(tmp_path / "config.d" / "20.yaml", "compression:\n  unit_pages: 2\n")
    loaded = load_layers(base)
    assert loaded.config.compression.frame_pages == 2
    assert loaded.sources["compression.frame_pages"].endswith("20.yaml")


@pytest.mark.parametrize("text, key", [
    ("pool:\n  max_size: 1K\n", "pool.max_size: '1K' is too small"),
    ("pool:\n  max_sise: 1G\n", "pool.max_sise: unknown key (did you mean 'max_size'?"),
    ("compression:\n  level: 30\n", "compression.level: 30 is out of range"),
    ("scopes:\n  - cgroup: 'x-['\n", "scopes[0].cgroup: 'x-[' has an unbalanced '['"),
    ("- a\n", "top level: ['a'] must be a mapping of sections"),
])
def test_an_error_names_the_file_and_the_key(etc, text, key):
    base, d = etc
    write(d / "10-fine.yaml", "pool:\n  defrag: false\n")
    bad = write(d / "20-x.yaml", text)
    write(d / "30-later.yaml", "pool:\n  max_size: 1G\n")  # would fix max_size: too late
    with pytest.raises(ConfigError) as info:
        load_config(base)
    assert str(info.value).startswith(f"{bad}: {key}"), str(info.value)


def test_yaml_errors_name_the_file_and_line(etc):
    base, d = etc
    bad = write(d / "20-x.yaml", "pool:\n  max_size: [1G\n")
    with pytest.raises(ConfigError, match=f"^{bad}:3:1: invalid YAML"):
        load_config(base)
    write(bad, "pool:\n  defrag: true\n  defrag: false\n")
    with pytest.raises(ConfigError, match=f"^{bad}:3:3: invalid YAML: duplicate key 'defrag'"):
        load_config(base)


def test_checks_across_files_blame_the_file_that_breaks_them(etc):
    base, d = etc
    write(base, "policy:\n  warm_threshold_ms: 30000\n")
    write(d / "10-hot.yaml", "policy:\n  hot_threshold_ms: 20000\n")  # fine: warm is 30000
    assert load_config(base).policy.hot_threshold_ms == 20000
    bad = write(d / "20-warm.yaml", "policy:\n  warm_threshold_ms: 5000\n")
    with pytest.raises(ConfigError, match=f"^{bad}: policy.hot_threshold_ms: 20000 must not exceed"):
        load_config(base)


def test_default_path_absent_still_reads_its_dropins(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(tmp_path / "config.yaml"))
    assert load_config() == load_config(None)
    dropin = write(tmp_path / "config.d" / "10.yaml", "device:\n  swap_priority: 5\n")
    loaded = load_layers()
    assert loaded.config.device.swap_priority == 5 and loaded.files == [dropin]


def test_missing_explicit_file_is_an_error_even_with_dropins(tmp_path):
    write(tmp_path / "config.d" / "10.yaml", "device:\n  swap_priority: 5\n")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "config.yaml"))
    assert load_layers(str(tmp_path / "config.yaml"), missing_ok=True).config.device.swap_priority == 5


def test_replace_validates_a_dropin_before_it_is_written(etc):
    base, d = etc
    target = str(d / "90-scopes.yaml")
    cfg = load_layers(base, replace={target: {"scopes": [{"cgroup": "z-*"}]}}).config
    assert cfg.scopes == [Scope("z-*")] and not os.path.exists(target)
    with pytest.raises(ConfigError, match=f"^{target}: scopes"):
        load_layers(base, replace={target: {"scopes": "z-*"}})


# --- the CLI, in separate processes ----------------------------------------------------------

def test_cli_error_line_names_the_file_and_the_key(etc):
    base, d = etc
    bad = write(d / "20-x.yaml", "pool:\n  max_size: 1K\n")
    res = run("config", "show", "--config", base)
    assert res.returncode == 2 and res.stdout == ""
    assert one_error_line(res.stderr).startswith(f"{bad}: pool.max_size: '1K' is too small")


@pytest.mark.slow
def test_cli_config_show_reports_sources(etc):
    base, d = etc
    lvl = write(d / "10-level.yaml", "compression:\n  level: 9\n")
    res = run("config", "show", "--config", base, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert set(doc) == {"files", "config", "sources"} and doc["files"] == [base, lvl]
    assert doc["config"]["compression"]["level"] == 9
    assert doc["config"]["pool"]["max_size"] == 64 * MiB
    src = doc["sources"]
    assert (src["compression.level"], src["pool.max_size"], src["scopes"]) == (lvl, base, base)
    assert src["device.size"] == "default" and src["compression.algorithm"] == base
    # every leaf key has a source
    assert set(src) == {f"{s}.{k}" for s, v in doc["config"].items() if isinstance(v, dict)
                        for k in v} | {"scopes"}

    res = run("--config", base, "config", "show", "-o", "KEY,SOURCE", "--raw", "-n")
    assert res.returncode == 0, res.stderr
    rows = dict(line.split() for line in res.stdout.splitlines())
    assert rows == src
    res = run("config", "show", "--config", base)
    line = next(l for l in res.stdout.splitlines() if l.startswith("pool.max_size "))
    assert line.split() == ["pool.max_size", "64M", base]
