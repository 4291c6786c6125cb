"""agentzip_blk.cgroups.scopes and .ledger: glob matching, scope edits in their drop-in, the restore ledger,
and the `scope` CLI on a fake cgroup v2 tree."""

from __future__ import annotations

import json
import os
import stat

import pytest

from agentzip_blk import cli
from agentzip_blk.cgroups import ledger, scopes
from agentzip_blk.cgroups.ledger import Ledger
from agentzip_blk.cgroups.scopes import covered, match, scoped_cgroups
from agentzip_blk.cgroups.tree import PlainTree
from agentzip_blk.config import ConfigError, Scope, load_config
from cgfake import fake_v2, r, w

# --- matching ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern,rel,want", [
    ("agent-sandbox-*.slice", "/agent-sandbox-1.slice", True),
    ("agent-sandbox-*.slice", "/machine.slice/agent-sandbox-7.slice", True),  # any depth
    ("agent-sandbox-*.slice", "/agent-sandbox-1.slice/job.scope", False),  # the name must match
    ("agent-sandbox-*.slice", "/agent-sandbox-.slice", True),
    ("agent-sandbox-*.slice", "/agent-sandbox-1.slice.bak", False),
    ("agent-*", "/a/agent-x/y", False),
    ("agent-*", "/a/agent-x", True),
    ("*", "/", False),  # the root cgroup is never a scope
    ("a/agent-*", "/x/a/agent-1", True),  # last components
    ("a/agent-*", "/x/b/agent-1", False),
    ("/a/agent-*", "/a/agent-1", True),  # anchored
    ("/a/agent-*", "/x/a/agent-1", False),
    ("*/agent-1", "/x/agent-1", True),  # '*' is one component, never crosses '/'
    ("a*1", "/a/b1", False),
    ("job-[0-9]", "/s/job-3", True),
    ("job-[!0-9]", "/s/job-3", False),
])
def test_match(pattern, rel, want):
    assert match(pattern, rel) is want


def test_scoped_cgroups_outermost_enabled_only():
    paths = ["/", "/a", "/a/agent-1", "/a/agent-1/agent-2", "/a/agent-3", "/b", "/b/other"]
    scopes_ = [Scope("agent-*"), Scope("other", enabled=False)]
    assert scoped_cgroups(paths, scopes_) == ["/a/agent-1", "/a/agent-3"]
    assert scoped_cgroups(paths, [Scope("agent-*", enabled=False)]) == []
    assert covered(scopes_, "/a/agent-1/agent-2/job")
    assert not covered(scopes_, "/b/other")
    assert not covered(scopes_, "/a")


# --- config editing ---------------------------------------------------------------------------

CONFIG = """\
# agentzip config for this host (hand-written)
compression:
  algorithm: zstd          # zstd | lz4 | lz4hc
  level: 3
pool:
  swap_out_path: /var/tmp/agentzip-test   # keep on local disk
scopes:
  # sandboxes of the agent runner
  - cgroup: agent-sandbox-*.slice
    enabled: true   # production
  - cgroup: "batch-*"
    enabled: false
device:
  size: 1G
"""


def _dropin(tmp_path) -> str:
    return str(tmp_path / "config.d" / scopes.SCOPES_DROPIN)


def test_add_writes_the_dropin_and_never_the_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    os.chmod(path, 0o640)
    before = path.read_bytes()
    assert "added" in scopes.add(str(path), "ci-*.scope")
    assert path.read_bytes() == before and stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(_dropin(tmp_path)).st_mode) == 0o644
    cfg = load_config(str(path))
    assert [(s.cgroup, s.enabled) for s in cfg.scopes] == [
        ("agent-sandbox-*.slice", True), ("batch-*", False), ("ci-*.scope", True)]
    assert cfg.device.size == 1 << 30  # the rest of config.yaml still counts
    assert not [f for f in os.listdir(tmp_path / "config.d") if f.startswith(".")]


def test_enable_disable_remove(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, CONFIG)
    scopes.enable(path, "batch-*")
    scopes.disable(path, "agent-sandbox-*.slice")
    assert [(s.cgroup, s.enabled) for s in scopes.list_scopes(path)] == [
        ("agent-sandbox-*.slice", False), ("batch-*", True)]
    assert "already disabled" in scopes.disable(path, "agent-sandbox-*.slice")
    scopes.remove(path, "batch-*")
    assert [s.cgroup for s in scopes.list_scopes(path)] == ["agent-sandbox-*.slice"]
    assert r(path) == CONFIG


def test_repeats_are_no_errors_and_write_nothing(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, CONFIG)
    assert "already in the config (disabled)" in scopes.add(path, "batch-*", enabled=False)
    assert "nothing to remove" in scopes.remove(path, "nope")
    assert not os.path.exists(_dropin(tmp_path))  # nothing changed: nothing written
    assert "was disabled: enabled it" in scopes.add(path, "batch-*")  # add = present + enabled
    assert [(s.cgroup, s.enabled) for s in scopes.list_scopes(path)][1] == ("batch-*", True)


def test_errors_leave_the_files_alone(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, CONFIG)
    scopes.add(path, "x-*")
    dropin = r(_dropin(tmp_path))
    with pytest.raises(scopes.ScopeError, match="no scope 'nope'"):
        scopes.enable(path, "nope")
    with pytest.raises(scopes.ScopeError, match="unbalanced"):
        scopes.add(path, "bad-[glob")
    assert r(path) == CONFIG and r(_dropin(tmp_path)) == dropin
    assert not [f for f in os.listdir(tmp_path / "config.d") if f.startswith(".")]


def test_invalid_config_is_not_edited(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, "pool:\n  max_sise: 1G\n")
    with pytest.raises(ConfigError, match="max_sise"):
        scopes.add(path, "x-*")
    assert r(path) == "pool:\n  max_sise: 1G\n"
    assert not os.path.exists(_dropin(tmp_path))


def test_a_later_dropin_with_scopes_is_refused(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, CONFIG)
    w(str(tmp_path / "config.d" / "95-mine.yaml"), "scopes: []\n")
    with pytest.raises(scopes.ScopeError, match="95-mine.yaml sets scopes"):
        scopes.add(path, "x-*")


def test_missing_scopes_key_means_defaults_and_a_missing_config_is_not_created(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, "# only a comment\npool:\n  max_size: 1G\n")
    scopes.add(path, "x-*")
    # the default scope was implicit; it stays in force next to the new one
    assert [s.cgroup for s in scopes.list_scopes(path)] == ["agent-sandbox-*.slice", "x-*"]
    assert r(path) == "# only a comment\npool:\n  max_size: 1G\n"

    fresh = str(tmp_path / "etc" / "agentzip" / "config.yaml")
    with pytest.raises(ConfigError, match="not found"):
        scopes.add(fresh, "y-*", enabled=False)
    assert not os.path.exists(tmp_path / "etc")

    empty = tmp_path / "e" / "config.yaml"
    w(str(empty), "scopes: []\n")
    scopes.add(str(empty), "z-*")
    assert r(str(tmp_path / "e" / "config.d" / scopes.SCOPES_DROPIN)).endswith(
        "scopes:\n- cgroup: z-*\n  enabled: true\n")


def test_dropin_is_not_written_through_a_symlink(tmp_path):
    path = str(tmp_path / "config.yaml")
    w(path, CONFIG)
    victim = tmp_path / "victim"
    victim.write_text("# precious\n")
    os.makedirs(tmp_path / "config.d")
    os.symlink(victim, tmp_path / "config.d" / scopes.SCOPES_DROPIN)
    scopes.add(path, "x-*")
    assert victim.read_text() == "# precious\n"  # the link was replaced, not followed
    assert not os.path.islink(_dropin(tmp_path))


# --- the ledger ---------------------------------------------------------------------------------

def test_ledger_records_before_writing_and_restores(tmp_path):
    cg = tmp_path / "cg"
    w(str(cg / "memory.high"), "max\n")
    w(str(cg / "memory.swap.max"), "0\n")
    led = Ledger(str(tmp_path / "run"), PlainTree(str(tmp_path)))
    led.write(str(cg / "memory.high"), "1000")
    led.write(str(cg / "memory.high"), "900")  # the original stays the first one seen
    led.write(str(cg / "memory.swap.max"), "max")
    on_disk = json.loads(r(str(tmp_path / "run" / ledger.LEDGER_FILE)))
    assert [(os.path.basename(e["path"]), e["original"], e["last"]) for e in on_disk["entries"]] == [
        ("memory.high", "max", "900"), ("memory.swap.max", "0", "max")]
    # another process (a new Ledger object) sees the same record
    report = Ledger(str(tmp_path / "run"), PlainTree(str(tmp_path))).restore()
    assert len(report.restored) == 2 and not report.failed
    assert r(str(cg / "memory.high")) == "max"
    assert r(str(cg / "memory.swap.max")) == "0"
    assert not os.path.exists(tmp_path / "run" / ledger.LEDGER_FILE)


def test_ledger_write_ahead_survives_a_failed_write(tmp_path, monkeypatch):
    cg = tmp_path / "cg"
    w(str(cg / "memory.high"), "max\n")
    real_write = ledger.write_cgroup_file

    def crash(path, value, tree):
        raise OSError(5, "Input/output error")  # e.g. the tuner dies inside the write

    monkeypatch.setattr(ledger, "write_cgroup_file", crash)
    with pytest.raises(OSError):
        Ledger(str(tmp_path / "run"), PlainTree(str(tmp_path))).write(str(cg / "memory.high"), "5")
    monkeypatch.setattr(ledger, "write_cgroup_file", real_write)
    # the original was on disk before the write was tried
    entries = Ledger(str(tmp_path / "run")).entries()
    assert [(e.original, e.last) for e in entries] == [("max", "")]
    w(str(cg / "memory.high"), "5")  # as if the write had landed after all
    assert len(ledger.release_all(str(tmp_path / "run"), PlainTree(str(tmp_path))).restored) == 1
    assert r(str(cg / "memory.high")) == "max"


def test_ledger_drops_removed_and_recreated_cgroups(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        w(str(d / "memory.high"), "max\n")
    led = Ledger(str(tmp_path / "run"), PlainTree(str(tmp_path)))
    led.write(str(a / "memory.high"), "1")
    led.write(str(b / "memory.high"), "2")
    # a: removed; b: removed and created again (another cgroup under the same name). The new
    # b is made while the old one still holds its inode, then renamed into place: a freed
    # inode number may be handed out again at once, and the new b must not get the old one
    w(str(tmp_path / "b.new" / "memory.high"), "new\n")
    for f in (a / "memory.high", b / "memory.high"):
        os.unlink(f)
    os.rmdir(a)
    os.rmdir(b)
    os.rename(tmp_path / "b.new", b)
    report = led.restore()
    assert len(report.gone) == 2 and not report.restored
    assert r(str(b / "memory.high")) == "new\n"
    assert led.entries() == []


def test_release_unscoped_restores_only_uncovered(tmp_path):
    cgs = {n: tmp_path / "fs" / n for n in ("agent-1", "agent-2", "other")}
    tree = PlainTree(str(tmp_path))
    led = Ledger(str(tmp_path / "run"), tree, rel_of=lambda d: "/" + os.path.basename(d))
    for n, d in cgs.items():
        w(str(d / "memory.high"), "max\n")
        led.write(str(d / "memory.high"), "7")
    report = ledger.release_unscoped(str(tmp_path / "run"), [Scope("agent-1"), Scope("other")],
                                     tree)
    assert [e.cgroup for e in report.restored] == ["/agent-2"]
    assert r(str(cgs["agent-2"] / "memory.high")) == "max"
    assert r(str(cgs["agent-1"] / "memory.high")) == "7"
    assert sorted(led.cgroups()) == ["/agent-1", "/other"]
    assert len(ledger.release_all(str(tmp_path / "run"), tree).restored) == 2
    assert r(str(cgs["other"] / "memory.high")) == "max"


# --- the CLI on a fake v2 tree ------------------------------------------------------------------

SANDBOX = "/agents/agent-sandbox-1.slice"
OTHER = "/agents/other.slice"


def _cli(tmp_path, root, *argv):
    return cli.main(["--config", str(tmp_path / "config.yaml"), "--run-dir", str(tmp_path / "run"),
                     *argv, "--cgroup-tree", root])


def _v2_files(mnt, rel):
    d = f"{mnt}{rel}"
    return {n: r(f"{d}/{n}").strip() for n in sorted(os.listdir(d)) if n != "memory.reclaim"}


def test_cli_scope_tune_disable_restores(tmp_path, capsys):
    root, mnt = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}, OTHER: {"cgroup.procs": "200\n"}})
    w(str(tmp_path / "config.yaml"), "# test\nscopes: []\n")
    before = {rel: _v2_files(mnt, rel) for rel in (SANDBOX, OTHER)}

    assert _cli(tmp_path, root, "scope", "add", "--cgroup", "agent-sandbox-*.slice") == 0
    assert _cli(tmp_path, root, "scope", "list", "--json") == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    listed = json.loads(out)
    assert listed["scopes"] == [{"cgroup": "agent-sandbox-*.slice", "enabled": True, "matches": [SANDBOX]}]

    assert _cli(tmp_path, root, "tune", "--without-device", "--steps", "3", "--interval", "0.01",
                "--grace", "0", "--floor", "16M", "--mode", "limit", "--keep") == 0
    out = capsys.readouterr().out
    decisions = [l for l in out.splitlines() if f"tune {SANDBOX}: " in l and "prepared" not in l]
    assert len(decisions) == 3  # one line per decision
    assert OTHER not in out
    assert r(f"{mnt}{SANDBOX}/memory.high").strip() != "max"  # the cap was written (and kept)
    assert r(f"{mnt}{SANDBOX}/memory.swap.max") == "max"
    assert _v2_files(mnt, OTHER) == before[OTHER]  # the unscoped cgroup: untouched

    assert _cli(tmp_path, root, "scope", "disable", "--cgroup", "agent-sandbox-*.slice") == 0
    msg = capsys.readouterr().out
    assert "2 setting(s) restored" in msg and SANDBOX in msg
    assert _v2_files(mnt, SANDBOX) == before[SANDBOX]
    assert r(str(tmp_path / "config.yaml")) == "# test\nscopes: []\n"


def test_cli_scope_errors(tmp_path, capsys):
    root, _ = fake_v2(tmp_path / "fs")
    w(str(tmp_path / "config.yaml"), "")
    assert _cli(tmp_path, root, "scope", "add") == 2
    assert "--cgroup GLOB is required" in capsys.readouterr().err
    assert _cli(tmp_path, root, "scope", "enable", "--cgroup", "nope-*") == 2
    assert "no scope 'nope-*'" in capsys.readouterr().err


@pytest.mark.slow
def test_tune_heartbeat_says_ready_only_with_a_device(tmp_path):
    """The DaemonSet's tuner probes: `tune --heartbeat` (its own process) writes the file each
    step; ready only while a swap device is attached from the run dir (none here), or with
    --without-device."""
    import subprocess
    import sys

    from agentzip_blk.host import heartbeat
    root, _ = fake_v2(tmp_path / "fs", {SANDBOX: {"cgroup.procs": "100\n"}})
    w(str(tmp_path / "config.yaml"), "scopes: []\n")
    az = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
    beat = tmp_path / "tuner.beat"
    for extra, ready in ((["--without-device"], True), ([], False)):
        beat.unlink(missing_ok=True)
        r = subprocess.run([az, "--config", str(tmp_path / "config.yaml"), "--run-dir",
                            str(tmp_path / "run"), "tune", "--steps", "2", "--interval", "0.01",
                            "--cgroup-tree", root, "--heartbeat", str(beat), *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        b = heartbeat.read(str(beat))
        assert b is not None and b.ready is ready, (extra, b)
        ok, why = heartbeat.check(str(beat), 60, need_ready=True)
        assert ok is ready and (ready or "no swap device attached" in why), why
