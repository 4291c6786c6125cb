"""The Prometheus exporter against the real nbdkit server: scrape over HTTP after writing data,
and compare every exported figure with ``agentzip-blk stats --json`` taken right after it.

Nothing writes between the scrape and ``stats --json`` except the ``stats`` requests
themselves, so gauges and counters must be equal (latency histogram counts included:
each pread/pwrite is one observation). The real-swap variant (per-cgroup figures while a
workload is squeezed into the attached device) is in ``test_metrics_swap``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import agentzip_blk
from agentzip_blk import cli
from agentzip_blk.datapath import latency
from agentzip_blk.fleet import metrics
from nbdkit_server import nbdkit_available, start_server

nbd = pytest.importorskip("nbd", reason="python3-libnbd not installed")

PAGE = 4096
DICTS = Path(agentzip_blk.__file__).parent / "codec" / "dicts"
SIZE = 64 << 20


def agent_like(n: int, seed: int) -> bytes:
    rnd = random.Random(seed)
    words = ["tool_call", '"arguments"', "result", "\\n", "def", "return", "{", "}", "0.5", "id"]
    return " ".join(rnd.choice(words) for _ in range(n // 3)).encode()[:n]


@contextlib.contextmanager
def exporter(collector: metrics.Collector):
    server = metrics.make_server(("127.0.0.1", 0), collector)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def stats_json(control: str) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["stats", "--json", "--control", control]) == 0
    return json.loads(buf.getvalue())


def test_latency_histogram_buckets():
    h = latency.Histogram()
    for v in (5e-6, 10e-6, 11e-6, 0.3, 5.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["count"] == 5
    assert snap["counts"][0] == 2  # <= 10 us (a value on a bound is in that bucket)
    assert snap["counts"][1] == 1  # <= 25 us
    assert snap["counts"][latency.BUCKETS.index(1.0)] == 1
    assert snap["counts"][-1] == 1  # +Inf
    fam = next(metrics.latency_metrics({"buckets_s": list(latency.BUCKETS), "read": snap}))
    le = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert le["1e-05"] == 2 and le["2.5e-05"] == 3 and le["1.0"] == 4 and le["+Inf"] == 5


def test_exporter_down_server_reports_up_zero(tmp_path):
    col = metrics.Collector(metrics.control_stats(str(tmp_path / "nothing.sock")))
    with exporter(col) as url:
        m = scrape(url)
    assert m[("agentzip_up", ())] == 0
    assert ("agentzip_orig_bytes", ()) not in m


@pytest.mark.nbdkit
@pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available()))
def test_up_is_zero_while_the_server_is_stopped(tmp_path):
    """A stopped server still has its sockets; only an answer to health counts as up."""
    config = tmp_path / "config.yaml"
    config.write_text(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n")
    srv = start_server(tmp_path, size=str(SIZE), config=config)
    try:
        col = metrics.Collector(metrics.control_stats(srv.control_socket))
        with exporter(col) as url:
            assert scrape(url)[("agentzip_up", ())] == 1
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                m = scrape(url)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            assert m[("agentzip_up", ())] == 0
            assert ("agentzip_orig_bytes", ()) not in m
            assert scrape(url)[("agentzip_up", ())] == 1
    finally:
        srv.stop()


@pytest.mark.nbdkit
@pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available()))
def test_scrape_matches_stats_json(tmp_path):
    # One named dictionary: it is the only candidate; pages compressed alone (a dictionary
    # applies only to those, not to multi-page units).
    config = tmp_path / "config.yaml"
    config.write_text(f"compression:\n  dictionary: python312\n  frame_pages: 1\n"
                      "  warm_algorithm: none\n"  # pages alone with the dictionary, as written
                      f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n")
    srv = start_server(tmp_path, size=str(SIZE), config=config)
    try:
        h = nbd.NBD()
        h.connect_unix(srv.nbd_socket)
        # every page kind: compressible, random (raw), same-filled, duplicates (shared)
        comp = agent_like(256 * PAGE, seed=3)
        h.pwrite(comp, 0)
        h.pwrite(os.urandom(16 * PAGE), 300 * PAGE)
        h.pwrite(b"\x5a" * (8 * PAGE), 400 * PAGE)
        h.pwrite(comp[: 32 * PAGE], 500 * PAGE)
        # pages cut from a prebuilt dictionary's content: that dictionary wins the trial
        d = (DICTS / "python312.dict").read_bytes()[-64 * PAGE:]
        h.pwrite(d[: (len(d) // PAGE) * PAGE], 600 * PAGE)
        for i in range(20):  # swap-in: 4 KiB reads
            assert h.pread(PAGE, i * PAGE) == comp[i * PAGE:(i + 1) * PAGE]
        h.trim(8 * PAGE, 400 * PAGE)
        h.shutdown()

        col = metrics.Collector(metrics.control_stats(srv.control_socket))
        with exporter(col) as url:
            m = scrape(url)
        st = stats_json(srv.control_socket)
    finally:
        srv.stop()

    def g(name, **labels):
        return m[(name, tuple(sorted(labels.items())))]

    assert g("agentzip_up") == 1
    assert st["orig_mem"] == (256 + 16 + 32) * PAGE + len(d) // PAGE * PAGE  # the same-filled range was trimmed
    assert g("agentzip_orig_bytes") == st["orig_mem"]
    assert g("agentzip_stored_bytes") == st["stored_mem"]
    assert 0 < st["compressed_bytes"] < st["orig_mem"]  # stored_mem also counts tables, dicts
    assert g("agentzip_compression_ratio") == pytest.approx(st["ratio"])
    for key, name in [("pool_bytes", "agentzip_pool_bytes"), ("disk_mem", "agentzip_disk_bytes"),
                      ("hot_cache_bytes", "agentzip_hot_cache_bytes"),
                      ("max_size", "agentzip_pool_max_bytes"), ("size", "agentzip_device_size_bytes"),
                      ("fragmentation", "agentzip_pool_fragmentation_ratio")]:
        assert g(name) == pytest.approx(st[key]), name
    for kind in ("same", "raw", "compressed"):
        assert g("agentzip_pages", kind=kind) == st[f"{kind}_pages"]
    assert st["raw_pages"] == 16 and st["same_pages"] == 0
    assert g("agentzip_shared_pages") == st["shared_pages"] > 0
    for counter, key in [("reads", "reads"), ("writes", "writes"), ("trims", "trims"),
                         ("demotions", "demotions"), ("promotions", "promotions"),
                         ("pingpong", "pingpong"), ("read_bytes", "bytes_read"),
                         ("written_bytes", "bytes_written")]:
        assert g(f"agentzip_{counter}_total") == st[key], counter
    assert st["writes"] == 5 and st["reads"] == 20 and st["trims"] == 1
    for tier in ("pool", "disk"):
        assert g("agentzip_tier_pages", tier=tier) == st["tiers"][tier]["pages"]
    for d in st["dictionaries"]["in_use"]:
        assert g("agentzip_dictionary_pages", dictionary=d["name"], source=d["source"]) == d["pages"]
    used = {d["name"]: d["pages"] for d in st["dictionaries"]["in_use"]}
    assert used.get("python312", 0) > 0, st["dictionaries"]  # the pages cut from its content
    for op, n in (("read", st["reads"]), ("write", st["writes"])):
        count = g("agentzip_request_duration_seconds_count", op=op)
        assert count == n == st["latency"][op]["count"]
        assert g("agentzip_request_duration_seconds_bucket", op=op, le="+Inf") == n
        assert g("agentzip_request_duration_seconds_sum", op=op) == pytest.approx(
            st["latency"][op]["sum_s"]) and st["latency"][op]["sum_s"] > 0
        les = sorted((float(dict(k[1])["le"]), v) for k, v in m.items()
                     if k[0] == "agentzip_request_duration_seconds_bucket" and dict(k[1])["op"] == op)
        assert [v for _, v in les] == sorted(v for _, v in les)  # cumulative
        assert len(les) == len(latency.BUCKETS) + 1


def test_dashboard_uses_only_exported_metrics():
    """Every agentzip_* series the Grafana dashboard queries is one the exporter produces."""
    import re
    st = {"orig_mem": 1, "stored_mem": 1, "ratio": 1.0, "tiers": {}, "dictionaries": {"in_use": [
        {"name": "v8", "source": "prebuilt", "pages": 1, "stored_bytes": 1}]},
        "codec_pages": {"zstd": 1}, "temperature": {"hot": 1},
        **{k: 0 for k, _, _ in metrics.COUNTERS}, **{k: 0 for k, _, _ in metrics.BYTE_GAUGES},
        "latency": latency.Latency().snapshot(), "server": {"start_time_s": 1.0}}
    col = metrics.Collector(lambda: st, lambda: {"cgroups": [
        {"cgroup": "/a", "orig_mem": 1, "stored_mem": 1, "pages": 1}]},
        lambda: {"swap_attached": True}, metrics.BuildInfo("0", "3", "1"))
    names = set()
    for fam in col.collect():
        names.add(fam.name + ("_total" if fam.type == "counter" else ""))
        names.update(s.name for s in fam.samples)
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana-dashboard.json").read_text())
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            used.update(re.findall(r"agentzip_[a-z_]+", t["expr"]))
    assert used and used <= names, used - names
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    assert "ratio" in titles and "memory saved" in titles and "swap-in" in titles
    # the request histogram is the server's own time, never presented as fault latency
    for p in dash["panels"]:
        if any("request_duration" in t["expr"] for t in p["targets"]):
            assert "server-side" in p["title"].lower(), p["title"]
            assert " not " in p["title"].lower() and "hop" in p["description"].lower()  # what it leaves out


def test_dashboard_imports_with_inputs_and_uses_no_deprecated_name():
    """Grafana's import asks for the data source the dashboard names in __inputs; every
    ${DS_...} it uses is declared there, and no query uses a name kept only for one release."""
    import re
    dash_text = (Path(__file__).resolve().parents[2] / "deploy/grafana-dashboard.json").read_text()
    dash = json.loads(dash_text)
    declared = {i["name"] for i in dash["__inputs"]}
    assert declared == {"DS_PROMETHEUS"}
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    assert set(re.findall(r"\$\{(DS_[A-Z_]+)\}", dash_text)) == declared
    panel_types = {p["type"] for p in dash["panels"]}
    assert panel_types <= {r["id"] for r in dash["__requires"] if r["type"] == "panel"}
    deprecated = {f"agentzip_{old}_total" for old, _, _ in metrics.DEPRECATED_COUNTERS}
    deprecated |= {"agentzip_compression_ratio", "agentzip_checksum_errors_total"}
    used = set(re.findall(r"agentzip_[a-z_]+", dash_text))
    assert not used & deprecated, used & deprecated
    rules = (Path(__file__).resolve().parents[2] / "deploy/prometheus/alerts.yaml").read_text()
    assert not set(re.findall(r"agentzip_[a-z_]+", rules)) & deprecated


def test_saving_ratio_is_a_share_and_requests_and_errors_carry_labels():
    st = {"orig_mem": 4000, "stored_mem": 1000, "reads": 3, "writes": 2, "enospc": 1,
          "checksum_errors": 4}
    fams = {f.name: f for f in metrics.stats_metrics(st)}
    assert fams["agentzip_memory_saving_ratio"].samples[0].value == 0.75
    reqs = {s.labels["op"]: s.value for s in fams["agentzip_requests"].samples}
    assert reqs == {"read": 3, "write": 2, "trim": 0, "zero": 0, "flush": 0}
    errs = {s.labels["reason"]: s.value for s in fams["agentzip_store_errors"].samples}
    assert errs == {"io": 0, "no_space": 1, "disk_full": 0, "disk_io": 0, "checksum": 4}
    assert fams["agentzip_reads"].documentation.startswith("Deprecated: use ")


def test_the_exporter_serves_metrics_only_and_404_elsewhere(tmp_path):
    """A separate process of the installed CLI, its address from metrics.listen."""
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"metrics:\n  listen: 127.0.0.1:{port}\n")
    az = str(Path(sys.executable).parent / "agentzip-blk")
    proc = subprocess.Popen([az, "--config", str(cfg), "--run-dir", str(tmp_path / "run"),
                             "metrics", "--no-cgroups", "--control", str(tmp_path / "none.sock")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/metrics" in line, line + proc.stderr.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?x=1", timeout=20) as r:
            assert r.status == 200 and b"agentzip_up 0.0" in r.read()
        for path in ("/", "/metricsx", "/favicon.ico", "/metrics/"):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20)
            except urllib.error.HTTPError as e:
                assert e.code == 404, path
            else:
                raise AssertionError(f"{path} answered 200")
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_bad_listen_address_is_one_line(tmp_path):
    import subprocess
    import sys
    az = str(Path(sys.executable).parent / "agentzip-blk")
    r = subprocess.run([az, "--run-dir", str(tmp_path), "metrics", "--listen", "9479"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "agentzip-blk: error: --listen: '9479' is not HOST:PORT (e.g. 127.0.0.1:9479, "
        "[::1]:9479, 0.0.0.0:9479)"]


def test_swap_attached_without_reading_state_json(tmp_path, monkeypatch):
    """An exporter that is not root cannot read state.json (root's); it finds our area by the
    loop device over RUN/mnt, so the server-down alert keeps its series."""
    from agentzip_blk import procfs
    from agentzip_blk.errors import SetupError
    from agentzip_blk.host import chain, runstate

    def denied(run_dir):
        raise SetupError("state.json: permission denied")
    monkeypatch.setattr(runstate.RunState, "load", classmethod(lambda cls, d: denied(d)))
    monkeypatch.setattr(chain, "stray_loops", lambda run_dir: ["/dev/loop9"])
    monkeypatch.setattr(procfs, "swap_area", lambda dev: object() if dev == "/dev/loop9" else None)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp_path / 'tier'}\n")
    assert metrics.HostSource(str(tmp_path), str(cfg))()["swap_attached"] is True
    monkeypatch.setattr(procfs, "swap_area", lambda dev: None)
    assert metrics.HostSource(str(tmp_path), str(cfg))()["swap_attached"] is False
