"""A config drop-in that is not root's alone may set `scopes` and nothing else (issue 27,
item 5): on a Kubernetes node the node agent, which runs as another uid, writes its scope
list into config.d, and that must not let it move the disk tier or the device. The loader
enforces it, and the CLI says so in one line (its own process)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from agentzip_blk.config import ConfigError, load_layers
from cli.clirun import one_error_line, run

AGENT = 65534  # the node agent's uid in this test (nobody)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def _dropin(tmp_path, name: str, data: dict, uid: int = 0, mode: int = 0o644):
    d = tmp_path / "config.d"
    d.mkdir(exist_ok=True)
    path = d / name
    path.write_text(yaml.safe_dump(data))
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("pool: {swap_out_path: /var/lib/agentzip/swapfile}\n")
    return path


def test_a_non_root_dropin_setting_anything_but_scopes_is_refused(tmp_path, config):
    dropin = _dropin(tmp_path, "90-scopes.yaml",
                     {"scopes": [{"cgroup": "kubepods-*.slice"}],
                      "pool": {"swap_out_path": "/etc/shadow"}}, uid=AGENT)
    with pytest.raises(ConfigError, match=rf"^{dropin}: pool: this drop-in is owned by uid "
                                          rf"{AGENT}.*may set scopes and nothing else"):
        load_layers(str(config))


def test_its_scopes_count(tmp_path, config):
    dropin = _dropin(tmp_path, "90-scopes.yaml", {"scopes": [{"cgroup": "kubepods-*.slice"}]},
                     uid=AGENT)
    loaded = load_layers(str(config))
    assert [s.cgroup for s in loaded.config.scopes] == ["kubepods-*.slice"]
    assert loaded.sources["scopes"] == str(dropin)
    assert loaded.config.pool.swap_out_path == "/var/lib/agentzip/swapfile"


@pytest.mark.parametrize("how", ["writable", "link"])
def test_root_owned_but_not_roots_alone_is_limited_too(tmp_path, config, how):
    if how == "writable":
        _dropin(tmp_path, "50-x.yaml", {"device": {"size": "1G"}}, mode=0o666)
    else:  # root's file, reached through a link another uid made
        target = tmp_path / "target.yaml"
        target.write_text("device: {size: 1G}\n")
        (tmp_path / "config.d").mkdir()
        link = tmp_path / "config.d" / "50-x.yaml"
        link.symlink_to(target)
        os.lchown(link, AGENT, AGENT)
    with pytest.raises(ConfigError, match="50-x.yaml: device: this drop-in is"):
        load_layers(str(config))


def test_roots_own_dropins_set_anything(tmp_path, config):
    _dropin(tmp_path, "10-pool.yaml", {"pool": {"swap_out_path": None}})
    assert load_layers(str(config)).config.pool.swap_out_path is None


@pytest.mark.slow
def test_the_cli_names_the_file_and_key(tmp_path, config):
    _dropin(tmp_path, "90-scopes.yaml", {"scopes": [], "device": {"run_dir": "/tmp/x"}},
            uid=AGENT)
    res = run("config", "show", "--config", config)
    assert res.returncode == 2, res.stdout + res.stderr
    line = one_error_line(res.stderr)
    assert "90-scopes.yaml: device:" in line and "may set scopes and nothing else" in line
    # the agent's scopes alone: fine, and config show names the file
    _dropin(tmp_path, "90-scopes.yaml", {"scopes": [{"cgroup": "x-*.scope"}]}, uid=AGENT)
    shown = json.loads(run("config", "show", "--config", config, "--json").stdout)
    assert shown["sources"]["scopes"].endswith("90-scopes.yaml")
