"""The benchmark workloads (bench/workloads): each runs small, speaks READY/CHECK/TOUCH/VERIFY,
verifies its data, reports a corruption as VERIFY FAIL, and is deterministic from its seed.
Plus the page walk behind TOUCH and the bench's report arithmetic. No swap is attached here.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WL = os.path.join(ROOT, "bench", "workloads")
sys.path.insert(0, WL)
sys.path.append(ROOT)

import pagewalk  # noqa: E402
import protocol  # noqa: E402

NODE = shutil.which("node")


def _chromium():
    from browser import find_chromium
    return find_chromium()


def _has_pandas() -> bool:
    return importlib.util.find_spec("pandas") is not None


# key -> (argv, --mb small enough to be quick, skip reason or None)
WORKLOADS = {
    "A-pandas": ([sys.executable, os.path.join(WL, "pandas_analysis.py")], 90,
                 None if _has_pandas() else "pandas is not installed (pip install -e '.[bench]')"),
    "C-browser": ([sys.executable, os.path.join(WL, "browser.py")], 100,
                  None if _chromium() else "chromium is not installed (apt-get install chromium)"),
    "D-node": ([NODE or "node", os.path.join(WL, "node_text.js")], 40,
               None if NODE else "node is not installed (apt-get install nodejs)"),
}


def _params():
    return [pytest.param(k, marks=pytest.mark.skip(reason=v[2])) if v[2] else k for k, v in WORKLOADS.items()]


class Run:
    """One workload process on pipes."""

    def __init__(self, key: str, *extra: str, seed: int = 3):
        argv, mb, _ = WORKLOADS[key]
        self.p = subprocess.Popen([*argv, "--mb", str(mb), "--seed", str(seed), *extra],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, PYTHONHASHSEED="0"))

    def ready(self) -> int:
        line = self.p.stdout.readline().split()
        assert line and line[0] == "READY", (line, self.p.stderr.read() if self.p.poll() is not None else "")
        return int(line[1])

    def send(self, cmd: str) -> list[str]:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().split()

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
            for f in (self.p.stdin, self.p.stdout, self.p.stderr):
                try:
                    f.close()
                except OSError:
                    pass


def run_to_verify(key: str, *extra: str, seed: int = 3):
    r = Run(key, *extra, seed=seed)
    try:
        size = r.ready()
        check = r.send("CHECK")
        verify = r.send("TOUCH")
    finally:
        rc = r.finish()
    return size, check, verify, rc


@pytest.mark.parametrize("key", _params())
def test_ready_check_touch_verify(key):
    size, check, verify, rc = run_to_verify(key)
    _, mb, _ = WORKLOADS[key]
    assert size >= mb * (1 << 20) * 0.5, size  # it built about what it was asked for
    assert check[:2] == ["CHECK", "ok"], check
    assert verify[:2] == ["VERIFY", "ok"], verify
    assert verify[2] == check[2]  # same checksum before and after
    assert float(verify[3]) >= 0 and float(verify[4]) >= 0
    # TOUCH read the workload's memory: at least a third of what READY reported (for the
    # browser READY counts the whole tree, so this fails if Chromium's processes are skipped)
    assert int(verify[5]) * pagewalk.PAGE >= size // 3, (verify, size)
    assert rc == 0


@pytest.mark.parametrize("key", _params())
def test_corruption_is_reported_as_fail(key):
    r = Run(key, "--corrupt-for-test")
    try:
        r.ready()
        assert r.send("CHECK")[:2] == ["CHECK", "ok"]  # corrupted only at TOUCH
        verify = r.send("TOUCH")
    finally:
        rc = r.finish()
    assert verify[:2] == ["VERIFY", "FAIL"], verify
    assert verify[2] != verify[3]
    assert rc == 1


@pytest.mark.parametrize("key", _params())
def test_same_seed_same_data(key):
    a = run_to_verify(key, seed=5)
    b = run_to_verify(key, seed=5)
    assert a[2][1] == b[2][1] == "ok"
    assert a[2][2] == b[2][2]


@pytest.mark.parametrize("key", [k for k in _params() if "browser" not in str(k)])
def test_other_seed_other_data(key):
    assert run_to_verify(key, seed=5)[2][2] != run_to_verify(key, seed=6)[2][2]


@pytest.mark.parametrize("key", _params())
def test_eof_before_touch_exits_2(key):
    r = Run(key)
    try:
        r.ready()
        r.p.stdin.close()
        rc = r.p.wait(timeout=60)
    finally:
        r.finish()
    assert rc == 2


@pytest.mark.skipif(not _chromium(), reason="chromium is not installed (apt-get install chromium)")
def test_browser_leaves_no_process_behind():
    r = Run("C-browser")
    work = None
    try:
        r.ready()
        tree = pagewalk.descendants(r.p.pid)
        assert len(tree) >= 3  # browser, zygote, renderer at least
        with open(f"/proc/{tree[0]}/cmdline", "rb") as f:
            profile = [a for a in f.read().decode().split("\0") if a.startswith("--user-data-dir=")]
        work = os.path.dirname(profile[0].partition("=")[2])  # the workload's temp dir
        r.p.kill()  # even a SIGKILL of the driver takes Chromium down (PR_SET_PDEATHSIG)
    finally:
        r.finish()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in tree):
        time.sleep(0.2)
    alive = [p for p in tree if os.path.exists(f"/proc/{p}")]
    assert not alive, alive
    # a SIGKILLed driver cannot remove its temp dir (pages, profile): the test does
    assert work and os.path.basename(work).startswith("agentzip-browser-")
    shutil.rmtree(work)


# ---------------------------------------------------------------------------------------
# the page walk and the protocol, in this process


def test_pagewalk_finds_and_reads_our_pages():
    import ctypes
    buf = bytearray(os.urandom(8 << 20))  # 2048 resident anonymous pages
    start = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    mine = {a for a in pagewalk.swappable_pages("self", resident_only=True)
            if start <= a < start + len(buf)}
    assert len(mine) >= len(buf) // pagewalk.PAGE - 2  # all but the partial pages at the ends
    pages, seconds = pagewalk.touch(["self"])
    assert pages >= len(mine) and seconds >= 0
    lat = pagewalk.probe(["self"], 200, swapped=False, seed=1)
    assert len(lat) == 200 and all(ns > 0 for ns in lat)
    buf[0] ^= 1  # keep buf alive to here


def test_protocol_serve_check_touch_and_fail():
    data = {"x": 1}
    out = io.StringIO()
    rc = protocol.serve("t", "sum1", lambda: f"sum{data['x']}", size=lambda: 123,
                        stdin=io.StringIO("BOGUS\nCHECK\nTOUCH\n"), stdout=out)
    lines = [ln.split() for ln in out.getvalue().splitlines()]
    assert lines[0] == ["READY", "123"]
    assert lines[1][:3] == ["CHECK", "ok", "sum1"] and int(lines[1][5]) > 0
    assert lines[2][:3] == ["VERIFY", "ok", "sum1"]
    assert rc == 0

    def corrupt():
        data["x"] = 2

    out = io.StringIO()
    rc = protocol.serve("t", "sum1", lambda: f"sum{data['x']}", size=lambda: 1, corrupt=corrupt,
                        stdin=io.StringIO("TOUCH\n"), stdout=out)
    assert out.getvalue().splitlines()[1].split() == ["VERIFY", "FAIL", "sum2", "sum1"]
    assert rc == 1
    assert protocol.serve("t", "s", lambda: "s", stdin=io.StringIO(""), stdout=io.StringIO()) == 2


# ---------------------------------------------------------------------------------------
# the bench's arithmetic (bench/swap.py derive, bench/swap_report.py aggregate)


def _cycle(kind, before, sb_after, orig, stored, empty, rss0, rss1, out, check_wall, lat99):
    from bench import swap
    cfg = swap.SwapConfig("x", kind, "lz4")
    c = {"config": {"kind": kind}, "swap_backed_before": before, "swap_backed_after": sb_after,
         "orig_mem": orig, "stored_mem": stored, "stored_mem_empty": empty,
         "server_rss_before": rss0, "server_rss_after": rss1, "swapped_out": out, "swapped_in": out,
         "check_wall_s": check_wall, "check_cpu_s": 1.5, "reclaim_cpu_s": 0.5, "server_cpu_s": 2.0,
         "latency": {"n": 10, "p50_us": 10.0, "p99_us": lat99}, "verify": "ok"}
    base = {"check_wall_s": 2.0, "check_cpu_s": 1.0, "build_cpu_s": 10.0,
            "latency": {"n": 10, "p50_us": 1.0, "p99_us": 5.0}}
    swap.derive(c, cfg, base)
    return c, base


def test_derive_and_aggregate():
    from bench import swap_report as bench_report
    MiB = 1 << 20
    z, base = _cycle("zram", 400 * MiB, 40 * MiB, 360 * MiB, 120 * MiB, 0, 0, 0, 360 * MiB, 3.0, 105.0)
    a, _ = _cycle("agentzip", 400 * MiB, 40 * MiB, 360 * MiB, 100 * MiB, 10 * MiB, 50 * MiB, 170 * MiB,
                  360 * MiB, 8.0, 505.0)
    assert z["ratio_field"] == pytest.approx(400 / 160)  # 40 resident + 120 in zram
    # agentzip: the server grew 120 MiB but stored_mem only 90: the larger one is what it costs
    assert a["device_cost"] == 120 * MiB and a["ratio_field"] == pytest.approx(400 / 160)
    assert a["ratio_device"] == pytest.approx(3.6)
    assert a["slowdown"] == pytest.approx(4.0) and z["slowdown"] == pytest.approx(1.5)
    assert a["swap_cpu_s"] == pytest.approx(0.5 + 2.0 + 0.5)  # reclaim + server + CHECK extra
    assert a["p99_overhead_us"] == pytest.approx(500.0)
    doc = {"workloads": {"A": {"key": "A", "baseline": base, "configs": {"zram-lz4": z, "agentzip-default": a}},
                         "B": {"key": "B", "baseline": base, "configs": {"zram-lz4": z}}}}
    g = bench_report.aggregate(doc, "zram-lz4")
    assert g["workloads"] == 2 and g["ratio_field"] == pytest.approx(2.5)
    assert g["cpu_overhead"] == pytest.approx(2 * 3.0 / 20.0)
    assert bench_report.aggregate(doc, "agentzip-zstd9") == {}
