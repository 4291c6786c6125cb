"""The alert rules and the exposition, judged by Prometheus' own promtool (Debian's
``prometheus`` package): the rules load (``check rules``), the alerts fire and stay quiet
when they should (``test rules`` on deploy/prometheus/alerts_test.yaml), and a real scrape
of ``agentzip-blk metrics`` (a separate process) against a real nbdkit server passes
``check metrics`` and carries the build-info, start-time and host-side series the rules use.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import agentzip_blk
from agentzip_blk.fleet import metrics
from nbdkit_server import ROOT, nbdkit_available, plugin_env, start_server

RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool missing (apt-get install prometheus)")


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          timeout=60)


@needs_promtool
def test_alert_rules_pass_promtool_check():
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


@pytest.mark.slow
@needs_promtool
def test_alert_rules_unit_tests_pass():
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
@needs_promtool
def test_rule_unit_tests_can_fail(tmp_path):
    """The unit tests are not vacuous: with the server-down alert's condition inverted they fail."""
    broken = RULES.read_text().replace("agentzip_swap_attached == 1 and agentzip_up == 0",
                                       "agentzip_swap_attached == 1 and agentzip_up == 1")
    assert broken != RULES.read_text()
    (tmp_path / "alerts.yaml").write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / "alerts_test.yaml")
    r = promtool("test", "rules", str(tmp_path / "alerts_test.yaml"))
    assert r.returncode != 0 and "AgentzipServerDownWithSwapAttached" in r.stdout + r.stderr


def test_every_alert_has_a_unit_test_or_is_named_here():
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert alerts == {"AgentzipServerDownWithSwapAttached", "AgentzipExporterDown",
                      "AgentzipIOErrors", "AgentzipOutOfSpace", "AgentzipPoolNearCap",
                      "AgentzipDiskTierNearFull", "AgentzipChecksumErrors"}
    assert alerts == tested  # ExporterDown too: its absent() branch has a case of its own


def test_rules_use_only_exported_series():
    """Every agentzip_* name in the rules is one the exporter produces (a typo would make an
    alert silently never fire)."""
    st = {"orig_mem": 1, "stored_mem": 1, **{k: 0 for k, _, _ in metrics.COUNTERS},
          **{k: 0 for k, _, _ in metrics.BYTE_GAUGES}, "server": {"start_time_s": 1.0}}
    host = {"swap_attached": True, "disk_max_bytes": 0, "disk_fs_size_bytes": 1,
            "disk_fs_avail_bytes": 1}
    col = metrics.Collector(lambda: st, host_fn=lambda: host,
                            build=metrics.BuildInfo("0", "3", "1"))
    names = set()
    for fam in col.collect():
        names.add(fam.name + ("_total" if fam.type == "counter" else ""))
        names.update(s.name for s in fam.samples)
    used = set(re.findall(r"agentzip_[a-z_]+", RULES.read_text()))
    assert used and used <= names, used - names


@pytest.mark.parametrize("st,want", [
    ({}, 0),
    ({"checksum_errors": 3}, 3),
    ({"errors": {"checksum": 2, "io": 1}}, 2),
    ({"errors": 5}, 0),  # today's flat I/O error counter is not a checksum count
])
def test_checksum_errors_from_stats(st, want):
    fams = {f.name: f for f in metrics.stats_metrics(st)}
    assert fams["agentzip_checksum_errors"].samples[0].value == want
    # a dict-valued "errors" never reaches the flat errors counter (float() of a dict)
    if isinstance(st.get("errors"), dict):
        assert "agentzip_errors" not in fams


def _start_exporter(tmp_path: Path, control: str) -> tuple[subprocess.Popen, str]:
    """`agentzip-blk metrics` in its own process on a free port; returns it and its URL."""
    env = plugin_env()
    cmd = [sys.executable, "-m", "agentzip_blk.cli", "--run-dir", str(tmp_path / "run"),
           "--config", str(tmp_path / "config.yaml"), "metrics", "--listen", "127.0.0.1:0",
           "--control", control, "--no-cgroups"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))
    line = proc.stdout.readline()  # "agentzip-blk: metrics on http://127.0.0.1:PORT/metrics"
    m = re.search(r"(http://\S+/metrics)", line)
    if not m:
        proc.kill()
        raise AssertionError(f"exporter did not start: {line!r} {proc.stderr.read()}")
    return proc, m.group(1)


@needs_promtool
@pytest.mark.nbdkit
@pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available()))
def test_real_scrape_passes_promtool_check_metrics(tmp_path):
    disk_dir = tmp_path / "tier"
    disk_dir.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(f"pool:\n  swap_out_path: {disk_dir / 'swapfile'}\n"
                      f"  swap_out_max_size: 64M\n")
    before = time.time()
    srv = start_server(tmp_path, size="64M", config=config)
    exporter = None
    try:
        import nbd
        h = nbd.NBD()
        h.connect_unix(srv.nbd_socket)
        data = (b"agentzip " * 4096)[:8 * 4096]
        h.pwrite(data, 0)
        assert h.pread(len(data), 0) == data
        h.shutdown()
        exporter, url = _start_exporter(tmp_path, srv.control_socket)
        with urllib.request.urlopen(url, timeout=20) as r:
            text = r.read().decode()
    finally:
        if exporter is not None:
            exporter.terminate()
            exporter.wait(10)
        srv.stop()
    after = time.time()

    r = promtool("check", "metrics", stdin=text)
    assert r.returncode == 0, r.stdout + r.stderr + text
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr  # no lint

    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    assert samples["agentzip_up"][0].value == 1
    (bi,) = samples["agentzip_build_info"]
    assert bi.value == 1
    assert bi.labels["version"] == agentzip_blk.__version__
    assert bi.labels["server_version"] == agentzip_blk.__version__  # from the server's stats
    assert re.fullmatch(r"3\.\d+\.\d+", bi.labels["python"])
    nbdkit_v = subprocess.run(["nbdkit", "--version"], capture_output=True, text=True).stdout.split()[1]
    assert bi.labels["nbdkit"] == nbdkit_v
    # the server's start: after we launched it, before the scrape ended (wall clock)
    start = samples["agentzip_start_time_seconds"][0].value
    assert before - 1 <= start <= after, (before, start, after)
    assert "agentzip_server_uptime_seconds" not in samples  # replaced, not doubled
    assert samples["agentzip_server_restarts_total"][0].value == 0  # a fresh server
    errors = {s.labels["reason"]: s.value for s in samples["agentzip_store_errors_total"]}
    assert errors == {"io": 0, "no_space": 0, "disk_full": 0, "disk_io": 0, "checksum": 0}
    requests = {s.labels["op"]: s.value for s in samples["agentzip_requests_total"]}
    assert requests["write"] == 1 and requests["read"] >= 1
    # the names they replace, one more release, marked deprecated in their HELP
    assert samples["agentzip_writes_total"][0].value == 1
    assert samples["agentzip_checksum_errors_total"][0].value == 0
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    for old, new in (("agentzip_writes_total", 'agentzip_requests_total{op="write"}'),
                     ("agentzip_demotions_total", "agentzip_demoted_pages_total"),
                     ("agentzip_compression_ratio", "agentzip_memory_saving_ratio")):
        assert helps[old].startswith("Deprecated: use ") and new in helps[old], helps[old]
    assert not helps["agentzip_requests_total"].startswith("Deprecated")
    orig = samples["agentzip_orig_bytes"][0].value
    stored = samples["agentzip_stored_bytes"][0].value
    assert samples["agentzip_memory_saving_ratio"][0].value == max(0.0, 1 - stored / orig)
    assert samples["agentzip_swap_attached"][0].value == 0  # no swapon in this test
    assert samples["agentzip_disk_max_bytes"][0].value == 64 << 20
    vfs = os.statvfs(disk_dir)
    assert samples["agentzip_disk_filesystem_size_bytes"][0].value == vfs.f_blocks * vfs.f_frsize
    assert 0 < samples["agentzip_disk_filesystem_avail_bytes"][0].value <= vfs.f_blocks * vfs.f_frsize
