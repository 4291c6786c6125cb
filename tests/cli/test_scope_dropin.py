"""`scope add/remove/enable/disable` in separate processes: they write config.d/90-scopes.yaml
and never a byte of config.yaml; repeating an edit is exit 0 and says so; the drop-in
round-trips through `scope list` and `config show`. Cgroups: a fake cgroup v2 tree."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml

from cgfake import fake_v2

from .clirun import one_error_line, run

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

CONFIG = b"""\
# the operator's file: comments, odd spacing and key order must survive
compression:   {level: 3}
scopes:
    - cgroup:  "agent-sandbox-*.slice"   # production
device:
  size: 1G
"""
SANDBOX = "/agents/agent-sandbox-1.slice"
JOB = "/agents/ci-7.scope"


def _scope(tmp_path, root, *argv):
    return run("scope", *argv, "--config", tmp_path / "config.yaml", "--run-dir",
               tmp_path / "run", "--cgroup-tree", root)


def _listed(tmp_path, root) -> list[dict]:
    res = _scope(tmp_path, root, "list", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["scopes"]


def test_scope_edits_write_the_dropin_never_config_yaml(tmp_path):
    root, _ = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}, JOB: {}})
    config = tmp_path / "config.yaml"
    config.write_bytes(CONFIG)
    digest = hashlib.sha256(CONFIG).hexdigest()
    dropin = tmp_path / "config.d" / "90-scopes.yaml"

    res = _scope(tmp_path, root, "add", "--cgroup", "ci-*.scope")
    assert res.returncode == 0 and "added scope ci-*.scope (enabled)" in res.stdout, res.stderr
    assert str(dropin) in res.stdout
    assert hashlib.sha256(config.read_bytes()).hexdigest() == digest

    # the drop-in round-trips: what it holds is what `scope list` and the loader see
    written = yaml.safe_load(dropin.read_text())
    assert written == {"scopes": [{"cgroup": "agent-sandbox-*.slice", "enabled": True},
                                  {"cgroup": "ci-*.scope", "enabled": True}]}
    assert _listed(tmp_path, root) == [
        {"cgroup": "agent-sandbox-*.slice", "enabled": True, "matches": [SANDBOX]},
        {"cgroup": "ci-*.scope", "enabled": True, "matches": [JOB]}]
    shown = json.loads(run("config", "show", "--config", config, "--json").stdout)
    assert shown["sources"]["scopes"] == str(dropin)
    assert shown["sources"]["device.size"] == str(config)
    assert shown["config"]["scopes"] == written["scopes"]

    for argv in (("disable", "--cgroup", "ci-*.scope"), ("enable", "--cgroup", "ci-*.scope"),
                 ("remove", "--cgroup", "agent-sandbox-*.slice")):
        res = _scope(tmp_path, root, *argv)
        assert res.returncode == 0, res.stderr
        assert hashlib.sha256(config.read_bytes()).hexdigest() == digest, argv
    assert yaml.safe_load(dropin.read_text()) == {
        "scopes": [{"cgroup": "ci-*.scope", "enabled": True}]}
    assert not [p.name for p in dropin.parent.iterdir() if p.name != dropin.name]  # no temp left


def test_repeated_edits_exit_0_and_say_so(tmp_path):
    root, _ = fake_v2(tmp_path / "fs")
    config = tmp_path / "config.yaml"
    config.write_bytes(CONFIG)
    dropin = tmp_path / "config.d" / "90-scopes.yaml"

    res = _scope(tmp_path, root, "add", "--cgroup", "agent-sandbox-*.slice")
    assert res.returncode == 0, res.stderr
    assert "scope agent-sandbox-*.slice already in the config (enabled)" in res.stdout
    assert not dropin.exists()  # nothing to change: nothing written
    res = _scope(tmp_path, root, "remove", "--cgroup", "nope-*")
    assert res.returncode == 0 and "nothing to remove" in res.stdout, res.stderr
    assert _scope(tmp_path, root, "add", "--cgroup", "x-*").returncode == 0
    before = dropin.read_bytes()
    res = _scope(tmp_path, root, "add", "--cgroup", "x-*")
    assert res.returncode == 0 and "already in the config" in res.stdout
    assert dropin.read_bytes() == before
    assert config.read_bytes() == CONFIG


def test_scope_errors_are_one_line_and_change_nothing(tmp_path):
    root, _ = fake_v2(tmp_path / "fs")
    config = tmp_path / "config.yaml"
    config.write_bytes(CONFIG)
    res = _scope(tmp_path, root, "enable", "--cgroup", "nope-*")
    assert res.returncode == 2
    assert one_error_line(res.stderr).startswith("no scope 'nope-*' in the config")
    res = _scope(tmp_path, root, "add", "--cgroup", "bad-[")
    assert res.returncode == 2 and "unbalanced" in one_error_line(res.stderr)
    bad = tmp_path / "config.d" / "20-bad.yaml"
    bad.write_text("pool:\n  max_size: 1K\n")
    res = _scope(tmp_path, root, "add", "--cgroup", "x-*")
    assert res.returncode == 2
    assert one_error_line(res.stderr).startswith(f"{bad}: pool.max_size:")
    assert sorted(p.name for p in bad.parent.iterdir()) == ["20-bad.yaml"]
    assert config.read_bytes() == CONFIG
