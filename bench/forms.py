#!/usr/bin/env python3
"""The "Two speeds" table of BENCHMARKS.md from a bench/swap.py JSON: per workload and
configuration, swap-out throughput and server CPU per GiB moved against zram lz4 of the same
run, the 4 KiB fault, the device ratio right after the squeeze (pages warm) and once the
recompress backlog has drained (pages cold), and how long that took.

    .venv/bin/python -m bench forms results/bench-two-speeds.json
"""

from __future__ import annotations

import argparse
import json

ZRAM = "zram-lz4"
MiB = 1 << 20


def _rate(r: dict) -> float | None:
    seconds = (r.get("squeeze") or {}).get("seconds")
    return r["swapped_out"] / MiB / seconds if seconds else None


def _f(value, fmt: str = "{:.2f}", suffix: str = "") -> str:
    return "-" if value is None else fmt.format(value) + suffix


def rows(doc: dict) -> list[str]:
    out = ["| workload | configuration | swap-out MiB/s | × zram | CPU s / GiB moved | × zram "
           "| fault p50 / p99 µs | ratio, warm (after squeeze) | ratio, cold (backlog 0) "
           "| drained after s | recompress CPU s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, w in doc["workloads"].items():
        configs = w.get("configs", {})
        zram = configs.get(ZRAM) or {}
        z_rate, z_cpu = _rate(zram) if zram else None, zram.get("swap_cpu_s_per_gib")
        for name, r in configs.items():
            if "error" in r:
                out.append(f"| {key} | {name} | error: {r['error']} |||||||||")
                continue
            rate, cpu = _rate(r), r.get("swap_cpu_s_per_gib")
            lat = r.get("latency") or {}
            cold = r.get("cold") or {}
            rel_rate = rate / z_rate if rate and z_rate and name != ZRAM else None
            rel_cpu = cpu / z_cpu if cpu and z_cpu and name != ZRAM else None
            drained = cold.get("waited_s") if cold.get("drained") else None
            out.append(
                f"| {key} | {name} | {_f(rate, '{:.0f}')} | {_f(rel_rate, suffix='x')} "
                f"| {_f(cpu, '{:.1f}')} | {_f(rel_cpu, suffix='x')} "
                f"| {_f(lat.get('p50_us'), '{:.0f}')} / {_f(lat.get('p99_us'), '{:.0f}')} "
                f"| {_f(r.get('ratio_device'), suffix='x')} "
                f"| {_f(cold.get('ratio_device'), suffix='x')} "
                f"| {_f(drained, '{:.0f}') if cold else '-'} "
                f"| {_f(cold.get('recompress_cpu_s'), '{:.1f}')} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a `python -m bench swap --out` file")
    doc = json.load(open(ap.parse_args().json))
    print(f"From `{doc.get('command', 'tools/bench.py')}` ({doc.get('date', '?')}).\n")
    print("\n".join(rows(doc)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
