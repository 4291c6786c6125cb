"""agentzip_blk.doctor: the rules on made-up facts, and a real run on this host."""

from __future__ import annotations

import json

from agentzip_blk import cli
from agentzip_blk.host import doctor
from agentzip_blk.host.doctor import FAIL, PASS, WARN, Facts, diagnose

OURS = {"filename": "/dev/loop0", "type": "partition", "size": 1 << 30, "used": 0, "priority": 100}


def healthy(**kw) -> Facts:
    base = dict(kernel="6.18.4", controller="v2", controller_mount="/sys/fs/cgroup", has_reclaim=True,
                swaps=[OURS], device="/dev/loop0", mode="fuse", loop_device="/dev/loop0",
                loop_dio=True, zswap=False, nbd_module=True, server_running=True,
                server_locked=True, server_locked_bytes=300 << 20, nbdfuse_locked=True,
                scopes_enabled=["agent-*"], scoped_cgroups=["/agent-1"])
    base.update(kw)
    return Facts(**base)


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_host_passes_everything():
    checks = diagnose(healthy())
    assert {c.status for c in checks} == {PASS}, doctor.render(checks)
    assert doctor.worst(checks) == PASS
    assert set(by_name(checks)) >= {"kernel", "memory cgroup", "swap areas", "zswap", "nbd module",
                                    "fuse", "loop direct-io", "server memory", "host reclaim", "scopes"}


def test_zswap_fails_and_says_how_to_turn_it_off():
    c = by_name(diagnose(healthy(zswap=True)))["zswap"]
    assert c.status == FAIL and "double compression" in c.detail
    assert "echo N > /sys/module/zswap/parameters/enabled" in c.fix


def test_swap_priorities():
    higher = dict(OURS, filename="/dev/zram0", priority=200)
    equal = dict(OURS, filename="/swapfile", priority=100)
    lower = dict(OURS, filename="/swapfile", priority=-2)
    c = by_name(diagnose(healthy(swaps=[higher, OURS])))["swap areas"]
    assert c.status == FAIL and "/dev/zram0 (200)" in c.detail and "--priority 201" in c.fix
    c = by_name(diagnose(healthy(swaps=[OURS, equal])))["swap areas"]
    assert c.status == WARN and "round-robin" in c.detail
    assert by_name(diagnose(healthy(swaps=[OURS, lower])))["swap areas"].status == PASS
    c = by_name(diagnose(healthy(device=None, swaps=[higher])))["swap areas"]
    assert c.status == WARN and "not attached" in c.detail and c.fix == "agentzip-blk up"


def test_cgroup_versions():
    c = by_name(diagnose(healthy(controller="v1", controller_mount="/sys/fs/cgroup/memory")))
    assert c["memory cgroup"].status == WARN and "unified_cgroup_hierarchy" in c["memory cgroup"].fix
    assert c["swap accounting"].status == PASS
    c = by_name(diagnose(healthy(controller="hybrid", memsw=False)))
    assert "hybrid" in c["memory cgroup"].detail
    assert c["swap accounting"].status == WARN and "swapaccount=1" in c["swap accounting"].fix
    c = by_name(diagnose(healthy(controller=None, controller_error="no memory cgroup controller")))
    assert c["memory cgroup"].status == FAIL


def test_attach_path_and_server():
    c = by_name(diagnose(healthy(loop_dio=False)))
    assert c["loop direct-io"].status == FAIL and "page cache" in c["loop direct-io"].detail
    c = by_name(diagnose(healthy(nbd_module=False, fuse_tools=["nbdfuse"])))
    assert c["nbd module"].status == WARN and "modprobe nbd" in c["nbd module"].fix
    assert c["fuse"].status == FAIL and "apt-get install" in c["fuse"].fix
    c = by_name(diagnose(healthy(server_locked=False)))
    assert c["server memory"].status == FAIL and "ulimit -l" in c["server memory"].fix
    c = by_name(diagnose(healthy(nbdfuse_locked=False)))
    assert c["server memory"].status == WARN
    assert by_name(diagnose(healthy(kernel="5.4.0")))["kernel"].status == WARN


def test_scopes():
    assert by_name(diagnose(healthy(scopes_enabled=[])))["scopes"].status == WARN
    assert by_name(diagnose(healthy(scoped_cgroups=[])))["scopes"].status == WARN
    c = by_name(diagnose(healthy(scoped_with_server=["/system.slice"])))["scopes"]
    assert c.status == FAIL and "/system.slice" in c.detail


def test_render_and_json():
    checks = diagnose(healthy(zswap=True, nbd_module=False))
    text = doctor.render(checks)
    lines = text.splitlines()
    assert any(l.startswith("FAIL  zswap") for l in lines)
    assert any(l.startswith("WARN  nbd module") for l in lines)
    assert any(l.strip().startswith("fix: echo N") for l in lines)
    # a fix line under every non-passing check that has one, none under passing ones
    assert sum(l.strip().startswith("fix:") for l in lines) == \
        sum(1 for c in checks if c.status != PASS and c.fix)
    data = json.loads(doctor.to_json(checks))
    assert data["status"] == FAIL
    assert {"name", "status", "detail", "fix"} <= set(data["checks"][0])


def test_real_host(tmp_path, capsys):
    """On this machine: every line is pass/warn/fail, the kernel and controller are named,
    and the exit status follows the worst line."""
    rc = cli.main(["--run-dir", str(tmp_path), "doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    names = {c["name"]: c for c in data["checks"]}
    assert all(c["status"] in (PASS, WARN, FAIL) for c in data["checks"])
    import os
    assert os.uname().release in names["kernel"]["detail"]
    assert names["swap areas"]["status"] in (WARN, FAIL)  # nothing attached from this run dir
    assert rc == (1 if data["status"] == FAIL else 0)
    rc2 = cli.main(["--run-dir", str(tmp_path), "doctor"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[0] in ("PASS", "WARN", "FAIL") and rc2 == rc


def _scheme(root, k, filters):
    base = root / "kernel/mm/damon/admin/kdamonds" / str(k)
    (base / "state").parent.mkdir(parents=True, exist_ok=True)
    (base / "state").write_text("on\n")
    ctx = base / "contexts/0"
    (ctx / "schemes/0").mkdir(parents=True)
    (ctx / "operations").write_text("paddr\n")
    (ctx / "schemes/0/action").write_text("pageout\n")
    for i, (typ, matching, allow) in enumerate(filters):
        d = ctx / "schemes/0/ops_filters" / str(i)
        d.mkdir(parents=True)
        (d / "type").write_text(typ + "\n")
        (d / "matching").write_text(matching + "\n")
        if allow is not None:
            (d / "allow").write_text(allow + "\n")


def test_damon_pageout_detection(tmp_path):
    # the layout of this development host: a paddr pageout scheme that filters anon out
    _scheme(tmp_path, 0, [("anon", "Y", "N"), ("unmapped", "Y", "Y")])
    # a scheme with no anon filter pages out everything
    _scheme(tmp_path, 1, [("unmapped", "Y", "Y")])
    # older kernels: no allow file, a matching filter excludes
    _scheme(tmp_path, 2, [("anon", "Y", None)])
    anon, file_only = doctor.damon_pageout(str(tmp_path))
    assert anon == ["kdamond 1 context 0 scheme 0"]
    assert file_only == ["kdamond 0 context 0 scheme 0", "kdamond 2 context 0 scheme 0"]
    c = by_name(diagnose(healthy(damon_anon_pageout=anon)))["host reclaim"]
    assert c.status == WARN and "allow N" in c.fix
    assert by_name(diagnose(healthy(damon_file_only=file_only)))["host reclaim"].status == PASS
    (tmp_path / "module/damon_reclaim/parameters").mkdir(parents=True)
    (tmp_path / "module/damon_reclaim/parameters/enabled").write_text("Y\n")
    assert doctor.damon_pageout(str(tmp_path))[0][0].startswith("DAMON_RECLAIM")


def test_an_old_config_key_is_flagged_with_its_new_name():
    c = by_name(diagnose(healthy(old_config_keys=[("compression.unit_pages",
                                                   "compression.frame_pages")])))["config keys"]
    assert c.status == WARN and "compression.unit_pages" in c.detail
    assert "compression.frame_pages" in c.fix
    assert "config keys" not in by_name(diagnose(healthy()))  # nothing to say otherwise


def test_gather_reads_the_old_names_from_the_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("compression:\n  unit_pages: 4\n")
    from agentzip_blk.config import load_config
    config = load_config(path)
    assert config.compression.frame_pages == 4  # the alias is accepted
    f = doctor.gather(str(tmp_path / "run"), config, config_path=str(path))
    assert f.old_config_keys == [("compression.unit_pages", "compression.frame_pages")]


# --- systemd-oomd ------------------------------------------------------------------------------

def test_oomd_rule():
    assert by_name(diagnose(healthy()))["systemd-oomd"].status == PASS  # not running
    assert by_name(diagnose(healthy(oomd_active=True, oomd_omit=True)))["systemd-oomd"].status == PASS
    c = by_name(diagnose(healthy(oomd_active=True, oomd_omit=False)))["systemd-oomd"]
    assert c.status == FAIL and "ManagedOOMPreference=omit" in c.detail and "install-units" in c.fix
    c = by_name(diagnose(healthy(oomd_active=True, oomd_omit=None)))["systemd-oomd"]
    assert c.status == FAIL and "not installed" in c.detail


def test_oomd_read_from_a_root_with_the_real_units(tmp_path):
    """The facts: a process named systemd-oomd in ROOT/proc, and the units install-units
    writes (the shipped ones say omit; without the line, they do not)."""
    from agentzip_blk.fleet import systemd as units
    assert doctor.oomd(str(tmp_path)) == (False, None)
    (tmp_path / "proc/4242").mkdir(parents=True)
    (tmp_path / "proc/4242/comm").write_text("systemd-oomd\n")
    assert doctor.oomd(str(tmp_path)) == (True, None)
    units.install(str(tmp_path), "/usr/bin/agentzip-blk")  # ROOT/etc/systemd/system
    assert doctor.oomd(str(tmp_path)) == (True, True)
    drop = tmp_path / "etc/systemd/system/agent-sandbox-.slice.d/50-agentzip.conf"
    drop.write_text(drop.read_text().replace("ManagedOOMPreference=omit", ""))
    assert doctor.oomd(str(tmp_path)) == (True, False)
    (tmp_path / "etc/systemd/system/agent-sandbox-.slice.d/60-local.conf").write_text(
        "[Slice]\nManagedOOMPreference=omit\n")  # a later drop-in sets it again
    assert doctor.oomd(str(tmp_path)) == (True, True)


def test_doctor_cli_reports_oomd_in_a_separate_process(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "--run-dir", str(tmp_path),
                        "doctor", "--json"], capture_output=True, text=True, timeout=120)
    names = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert names["systemd-oomd"]["status"] in (PASS, FAIL)
    assert ("not running" in names["systemd-oomd"]["detail"]) == (doctor.oomd()[0] is False)
