"""bench/swap_report.py on repeated runs (``python -m bench swap --repeat``): rounds are read from
``configs`` and ``repeats``, figures are mean ± sd over rounds, ratios to zram are paired round
by round, targets are marked from the means, and the chart holds the default config and zram
lz4 only. Built on a synthetic bench.json (the arithmetic; the real run is the benchmark)."""

from __future__ import annotations

import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)

from bench import swap_report as bench_report  # noqa: E402

MiB = 1 << 20


def cycle(name, *, check_s, p50, p99, ratio, phys, out_s=2.0, cpu_gib=4.0, slowdown=None):
    return {"config": {"name": name, "kind": "zram" if name.startswith("zram") else "agentzip"},
            "latency": {"n": 100, "p50_us": p50, "p99_us": p99},
            "check": {"result": "ok", "touch_s": check_s / 2}, "check_wall_s": check_s,
            "squeeze": {"seconds": out_s}, "swapped_out": 200 * MiB, "swapped_in": 200 * MiB,
            "ratio_device": ratio, "orig_mem": 200 * MiB, "stored_mem": int(200 * MiB / ratio),
            "swap_backed_before": 300 * MiB, "physical_after": phys * MiB, "ratio_field": 300 / phys,
            "swap_cpu_s": cpu_gib * 0.4, "swap_cpu_s_per_gib": cpu_gib, "cpu_overhead": 0.1,
            "slowdown": slowdown if slowdown is not None else check_s, "verify": "ok",
            "server_cpu_s": 1.0, "mem_free_gain": 0, "server_rss_before": 0, "server_rss_after": 0,
            "stored_mem_empty": 0}


def doc_with_rounds():
    # workload A: three rounds; zram's CHECK 1 s each, ours 1.5 / 2.5 / 3.5 s (ratio mean 2.5)
    z = [cycle("zram-lz4", check_s=1.0, p50=10, p99=30, ratio=2.0, phys=150, out_s=1.0, cpu_gib=4.0)
         for _ in range(3)]
    u = [cycle("agentzip-default", check_s=s, p50=p, p99=4 * p, ratio=4.1, phys=90, out_s=1.5,
               cpu_gib=10.0) for s, p in ((1.5, 80), (2.5, 90), (3.5, 130))]
    w = {"key": "A", "name": "pandas", "title": "t", "field_ratio": 8.7,
         "baseline": {"swap_backed": 300 * MiB, "peak_usage": 1, "check_wall_s": 1.0, "build_cpu_s": 10,
                      "latency": {}, "check": {"result": "ok"}},
         "configs": {"zram-lz4": z[0], "agentzip-default": u[0]},
         "repeats": {"zram-lz4": z[1:], "agentzip-default": u[1:]}}
    return {"workloads": {"A": w}, "options": {"limit_fraction": 0.1, "probe_samples": 100, "repeat": 3,
                                               "mb_scale": 1.0},
            "configs": [{"name": "zram-lz4"}, {"name": "agentzip-default"}],
            "machine": {"kernel": "k", "nproc": 2, "mem_total": 1 << 30, "python": "3", "nbdkit": "n"},
            "date": "today", "wall_s": 60, "command": ".venv/bin/python -m bench swap --repeat 3", "dictionaries": True}


def test_rounds_and_spread():
    doc = doc_with_rounds()
    w = doc["workloads"]["A"]
    assert len(bench_report.rounds(w, "agentzip-default")) == 3
    assert bench_report.n_rounds(doc) == 3
    sp = bench_report.Spread.of([1.5, 2.5, 3.5, None])
    assert sp.n == 3 and sp.mean == pytest.approx(2.5) and sp.sd == pytest.approx(statistics.stdev([1.5, 2.5, 3.5]))
    # an errored round is left out of the figures, not counted as zero
    w["repeats"]["agentzip-default"][0] = {"error": "boom"}
    assert bench_report.rounds(w, "agentzip-default")[1] is None
    assert bench_report.aggregate(doc, "agentzip-default", 1) == {}
    # old single-run JSON (no repeats) still reads as one round
    del w["repeats"]
    assert bench_report.n_rounds(doc) == 1


def test_targets_marked_from_paired_means():
    rows = {(r.split("|")[1].strip(), r.split("|")[2].strip()): r
            for r in bench_report.targets(doc_with_rounds()) if r.startswith("| ") and "target |" not in r}
    # CHECK time: ours / zram per round 1.5, 2.5, 3.5 -> mean 2.5 > 2.0: missed, held in 1 of 3
    check = rows[("CHECK time (s)", "A")]
    assert "2.50x ± 1.00x" in check and "missed (1/3 rounds)" in check
    # fault p50 80/90/130 -> mean 100 <= 100: met on the mean, held in 2 of 3 rounds
    assert "**met** (2/3 rounds)" in rows[("4 KiB fault p50 (µs)", "A")]
    assert "missed (0/3 rounds)" in rows[("4 KiB fault p99 (µs)", "A")]
    # swap-out: 200 MiB in 1.5 s vs 1.0 s -> 0.67x >= 0.6: met in every round
    assert "0.67x" in rows[("swap-out (squeeze) (MiB/s)", "A")]
    assert "**met** (3/3 rounds)" in rows[("swap-out (squeeze) (MiB/s)", "A")]
    assert "2.50x" in rows[("swap CPU per GiB moved (CPU s)", "A")]
    assert "**met** (3/3" in rows[("swap CPU per GiB moved (CPU s)", "A")]
    # device ratio 4.1 against A's 4.10 before the front door, 3% slack: met
    assert "**met** (3/3 rounds)" in rows[("device ratio (orig/stored)", "A")]


def test_device_ratio_target_can_miss():
    doc = doc_with_rounds()
    for c in bench_report.rounds(doc["workloads"]["A"], "agentzip-default"):
        c["ratio_device"] = 3.9  # below 4.10 * 0.97
    row = next(r for r in bench_report.targets(doc) if r.startswith("| device ratio"))
    assert "missed (0/3 rounds)" in row


@pytest.mark.slow
def test_chart_has_two_series_with_error_bars(tmp_path):
    doc = doc_with_rounds()
    data = bench_report.chart_data(doc)
    assert {cfg for cfg, _ in data} == {"agentzip-default", "zram-lz4"}
    [(key, saved)] = data[("agentzip-default", "saved")]
    assert key == "A" and saved.mean == pytest.approx(70.0) and saved.n == 3  # 1 - 90/300
    [(_, slow)] = data[("agentzip-default", "slowdown")]
    assert slow.mean == pytest.approx(2.5) and slow.sd == pytest.approx(1.0)
    png = tmp_path / "bench.png"
    bench_report.chart(doc, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_states_rounds_and_keeps_every_cycle():
    md = bench_report.markdown(doc_with_rounds())
    assert "repeats that 3 times per workload" in md
    assert "agentzip-default #3" in md and "zram-lz4 #2" in md
    assert "higher is better" in md and "lower is better" in md
