"""The shipped conffile says what it means: every key is there, commented out at its real
default in util-linux spelling (8G is 8 GiB), and uncommenting every line changes nothing,
as `agentzip-blk config show` (a separate process, the installed CLI) reports it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentzip_blk.config import Config, parse_config, reference
from agentzip_blk.config.quantities import parse_size

ROOT = Path(__file__).resolve().parents[2]
CONFFILE = ROOT / "tools/debian/config.yaml"
AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")


def config_show(path: Path) -> dict:
    r = subprocess.run([AZ, "--config", str(path), "config", "show", "--json"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_shipped_conffile_is_the_reference():
    assert CONFFILE.read_text() == reference.conffile(), \
        "tools/debian/config.yaml is stale: regenerate it from agentzip_blk.config.reference"


def test_every_schema_key_is_documented_once():
    schema = []
    for section in dataclasses.fields(Config):
        if section.name == "scopes":
            schema.append("scopes")
            continue
        schema += [f"{section.name}.{f.name}"
                   for f in dataclasses.fields(getattr(Config(), section.name))]
    documented = [k.name for k in reference.KEYS]
    assert sorted(documented) == sorted(schema)
    assert len(set(documented)) == len(documented)


def test_uncommented_every_key_is_written_and_means_the_default():
    data = yaml.safe_load(reference.uncomment(CONFFILE.read_text()))
    for k in reference.KEYS:
        section, _, key = k.name.partition(".")
        assert section in data, section
        if key:
            assert key in data[section], k.name  # written, not left to the default
    assert parse_config(data) == Config()


def test_sizes_are_written_as_util_linux_reads_them():
    text = CONFFILE.read_text()
    assert "#  max_size: 8G " in text and "#  hot_cache_size: 4M " in text
    assert "8GB" not in text.replace("8GB would be", "") and "4MB" not in text
    assert parse_size("8G") == 8 << 30 == Config().pool.max_size


@pytest.mark.slow
def test_config_show_is_the_same_uncommented(tmp_path):
    """As an operator checks it: `config show` of the shipped file and of the same file with
    every setting uncommented print the same config; only the sources differ."""
    shipped = tmp_path / "shipped" / "config.yaml"
    shipped.parent.mkdir()
    shipped.write_text(CONFFILE.read_text())
    edited = tmp_path / "edited" / "config.yaml"
    edited.parent.mkdir()
    edited.write_text(reference.uncomment(CONFFILE.read_text()))
    a, b = config_show(shipped), config_show(edited)
    assert a["config"] == b["config"]
    assert set(a["sources"].values()) == {"default"}
    assert set(b["sources"].values()) == {str(edited)}, b["sources"]


def test_a_decimal_size_would_change_the_value(tmp_path):
    """The negative control: the old comments (8GB) uncommented are another value."""
    old = tmp_path / "config.yaml"
    old.write_text(reference.uncomment(CONFFILE.read_text()).replace("max_size: 8G ",
                                                                     "max_size: 8GB "))
    assert config_show(old)["config"]["pool"]["max_size"] == 8 * 10**9
