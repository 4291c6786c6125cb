#!/usr/bin/env python3
"""Benchmark the demo workload: zram (lz4) vs agentzip-blk, same pages, one run.

For each backend (each the only swap while it runs) the demo driver
``agentzip_blk.demo.run_squeeze`` starts ``bench/workloads/agent_json.py`` (same seed, same
size) in a memory cgroup, squeezes it to 25% of its RSS, reads everything back and checks
the checksum. Recorded per backend: orig and stored bytes (zram: mm_stat orig_data_size /
mem_used_total; agentzip: the ``stats`` verb), ratio, swap-out and swap-in seconds and
MiB/s, free-memory gain (MemFree + per-CPU lists; raw and corrected for other processes), server RSS growth, verify.

Writes ``results/bench_demo.json`` and regenerates the section of ``BENCHMARKS.md``
between ``<!-- bench_demo:begin -->`` and ``<!-- bench_demo:end -->``.

    sudo .venv/bin/python -m bench demo --mb 300
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

from agentzip_blk.demo import driver as demo
from bench.harness import cells
from bench.harness.md import replace_block
from bench.harness.results import REPO, command_line, write_json

BEGIN = "<!-- bench_demo:begin -->"
END = "<!-- bench_demo:end -->"
MiB = 1 << 20

# per-backend figures taken from a run_squeeze result (median over --repeat runs)
FIELDS = ["orig_mem", "stored_mem", "ratio", "swapped_pswpout", "swap_out_seconds", "swap_out_mib_s",
          "swapped_in_pswpin", "swap_in_seconds", "swap_in_mib_s", "swap_in_wall_seconds",
          "verify_baseline_seconds", "mem_free_gain", "mem_free_gain_adjusted", "others_delta",
          "server_rss_before", "server_rss_after", "server_rss_growth", "device_saving",
          "saving_fraction", "saving_fraction_adjusted", "saving_fraction_accounted",
          "workload_rss"]


def machine() -> dict:
    mi = demo.meminfo()
    return {"kernel": platform.release(), "nproc": os.cpu_count(), "mem_total": mi.get("MemTotal"),
            "python": platform.python_version()}


def row_of(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("ok")]
    use = ok or runs
    row = {"runs": len(runs), "ok_runs": len(ok),
           "verify": ",".join(str(r.get("verify", "-")) for r in runs),
           "errors": [r["error"] for r in runs if r.get("error")],
           "ebusy": sum(r.get("squeeze", {}).get("ebusy", 0) for r in runs),
           "oom_kills": sum(r.get("oom_kills", 0) or 0 for r in runs)}
    for f in FIELDS:
        vals = [r[f] for r in use if isinstance(r.get(f), (int, float))]
        row[f] = statistics.median(vals) if vals else None
    return row


def compare(rows: dict[str, dict], base: str) -> None:
    b = rows.get(base)
    for name, row in rows.items():
        row["ratio_vs_base"] = cells.rel(row.get("ratio"), b and b.get("ratio"))
        row["swap_out_vs_base"] = cells.rel(row.get("swap_out_mib_s"), b and b.get("swap_out_mib_s"))
        row["swap_in_vs_base"] = cells.rel(row.get("swap_in_mib_s"), b and b.get("swap_in_mib_s"))


def insights(doc: dict) -> list[str]:
    """Where the bytes and the time go, from the device counters of every run."""
    notes = []
    for name, runs in doc["runs"].items():
        ok = [r for r in runs if r.get("after")]
        if not ok:
            continue
        dev = [r["after"]["device"] for r in ok]
        orig = cells.median([d.get("orig_mem") for d in dev])
        if "mm_stat" in dev[0]:
            payload = cells.median([d["mm_stat"].get("compr_data_size") for d in dev])
        else:
            payload = cells.median([d.get("compressed_bytes") for d in dev])
        stored = cells.median([d.get("stored_mem") for d in dev])
        empty = cells.median([r.get("stored_mem_empty") for r in ok])
        parts = []
        if orig and payload:
            parts.append(f"compressed payload {cells.mib(payload)} MiB (orig/payload {orig / payload:.2f}x)")
        if stored is not None and payload is not None:
            parts.append(f"{cells.mib(stored - payload)} MiB on top of it (allocator, metadata)")
        if empty and empty > MiB:
            parts.append(f"{cells.mib(empty)} MiB of it held by the empty device "
                         f"(orig/(stored-empty) {orig / max(stored - empty, 1):.2f}x)")
        t = [r.get("touched", {}).get("device", {}) for r in ok]
        a = [r["after"]["device"] for r in ok]
        reads = cells.median([(x.get("reads") or 0) - (y.get("reads") or 0) for x, y in zip(t, a)
                         if x.get("reads") is not None])
        rbytes = cells.median([(x.get("bytes_read") or 0) - (y.get("bytes_read") or 0) for x, y in zip(t, a)
                          if x.get("bytes_read") is not None])
        writes = cells.median([y.get("writes") for y in a])
        wbytes = cells.median([y.get("bytes_written") for y in a])
        if reads:
            parts.append(f"swap-in: {reads:.0f} read requests, {rbytes / reads / 1024:.1f} KiB each on average")
        if writes:
            parts.append(f"swap-out: {writes:.0f} write requests, {wbytes / writes / 1024:.0f} KiB each")
        out_pages = cells.median([r.get("swapped_pswpout") for r in ok])
        cg_sw = cells.median([r.get("swapped_cgroup") for r in ok])
        if out_pages and cg_sw:
            parts.append(f"pages written to swap {cells.mib(out_pages)} MiB, cgroup swap usage {cells.mib(cg_sw)} MiB")
        ebusy = sum(r.get("squeeze", {}).get("ebusy", 0) for r in ok)
        ooms = sum(r.get("oom_kills") or 0 for r in ok)
        parts.append(f"EBUSY on limit writes: {ebusy}, OOM kills: {ooms}")
        notes.append(f"{name}: " + "; ".join(parts) + ".")
    return notes


def markdown(doc: dict) -> str:
    m = doc["machine"]
    base = doc["base"]
    lines = [
        BEGIN,
        "## Demo workload: agentzip-blk vs zram",
        "",
        f"Generated by `bench/demo.py` on {doc['date']}; machine: Linux {m['kernel']}, "
        f"{m['nproc']} CPUs, MemTotal {m['mem_total'] / (1 << 30):.1f} GiB; "
        f"memory cgroup v{doc.get('cgroup_version', '?')}. Command:",
        "",
        f"    {doc['command']}",
        "",
        f"Workload: `bench/workloads/agent_json.py --mb {doc['mb']:g} --seed {doc['seed']}` "
        f"(Python agent heap: JSON tool-call transcripts, parsed dicts, strings), started "
        f"unlimited in a memory cgroup, squeezed once idle to {doc['limit_fraction']:.0%} of its "
        f"RSS in {doc['steps']} steps, then read back (TOUCH) and its checksum verified. Each "
        f"backend is the only swap while it runs; figures are medians of {doc['repeat']} run(s).",
        "",
        "| backend | orig MiB | stored MiB | ratio | ratio vs zram | swap-out s | swap-out MiB/s "
        "| vs zram | swap-in s | swap-in MiB/s | vs zram | free-memory gain MiB (adj.) | server RSS Δ MiB "
        "| gain / (orig-stored) (adj.) | verify |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in doc["rows"].items():
        if r.get("orig_mem") is None:
            err = (r.get("errors") or ["no result"])[0].replace("|", "\\|")
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | - | - | - | - | - | not run: {err} |")
            continue
        lines.append(
            f"| {name} | {cells.mib(r['orig_mem'])} | {cells.mib(r['stored_mem'])} | {cells.x(r['ratio'])} "
            f"| {cells.x(r['ratio_vs_base'])} | {cells.f(r['swap_out_seconds'], '{:.2f}')} "
            f"| {cells.f(r['swap_out_mib_s'], '{:.0f}')} | {cells.x(r['swap_out_vs_base'])} "
            f"| {cells.f(r['swap_in_seconds'], '{:.2f}')} | {cells.f(r['swap_in_mib_s'], '{:.0f}')} "
            f"| {cells.x(r['swap_in_vs_base'])} | {cells.mib(r['mem_free_gain'])} ({cells.mib(r['mem_free_gain_adjusted'])}) "
            f"| {cells.mib(r['server_rss_growth'])} | {cells.pct(r['saving_fraction'])} "
            f"({cells.pct(r['saving_fraction_adjusted'])}) | {r['verify']} |")
    lines += [
        "",
        f"- *orig / stored*: bytes the device holds for the swapped pages / bytes it uses for "
        f"them, after the squeeze (zram: `mm_stat` orig_data_size / mem_used_total; agentzip-blk: "
        f"`stats` orig_mem / stored_mem). *vs zram*: this backend's figure / {base}'s.",
        "- *swap-out*: wall time of the limit writes (the kernel reclaims synchronously inside "
        "them), MiB/s = pswpout bytes / that time. *swap-in*: after the limit is lifted, the "
        "workload reads one byte of every page of its anonymous memory (timed on its own, "
        "before the checksum pass), MiB/s = pswpin bytes / that time.",
        "- *free-memory gain*: free memory after the squeeze minus before, counting MemFree "
        "*plus* the pages on the per-CPU free lists (/proc/zoneinfo `count:`; MemFree leaves "
        "them out, and they hold up to ~100 MiB per CPU on this kernel); *adj.* also removes "
        "the change in memory of every other process meanwhile (AnonPages+Cached+SwapCached "
        "minus our cgroup and the server): the machine is shared. *server RSS Δ*: nbdkit + "
        "nbdfuse RSS growth (zram keeps its pool in the kernel: 0).",
    ]
    notes = list(doc.get("notes") or []) + insights(doc)
    lines += [f"- {n}" for n in notes]
    lines.append(END)
    return "\n".join(lines) + "\n"


def _remove_run_dir(path: str) -> None:
    """Remove our temp run directory (state, logs), never while anything is mounted in it."""
    import shutil
    with open("/proc/mounts") as f:
        mounted = [ln.split()[1] for ln in f if len(ln.split()) > 1]
    if any(m == path or m.startswith(path.rstrip("/") + "/") for m in mounted):
        print(f"bench_demo: {path} still has a mount in it; left in place", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=demo.DEFAULT_MB)
    ap.add_argument("--seed", type=int, default=demo.DEFAULT_SEED)
    ap.add_argument("--backends", default="zram-lz4,agentzip",
                    help="comma-separated, the first is the baseline (default zram-lz4,agentzip)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per backend, interleaved; medians reported (default 3: the "
                         "machine is shared and single runs are noisy)")
    ap.add_argument("--config", help="agentzip config file (default: built-in defaults, zstd 3)")
    ap.add_argument("--run-dir", help="agentzip run directory (default: a temp dir)")
    ap.add_argument("--limit-fraction", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(REPO, "results", "bench_demo.json"))
    ap.add_argument("--md", default=os.path.join(REPO, "BENCHMARKS.md"))
    ap.add_argument("--no-md", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--from-json", metavar="PATH",
                    help="no run: regenerate the BENCHMARKS.md section from a saved result")
    a = ap.parse_args(argv)

    if a.from_json:
        with open(a.from_json) as f:
            doc = json.load(f)
        section = markdown(doc)
        if not a.no_md:
            replace_block(a.md, section, BEGIN, END)
        print(section)
        return 0

    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    config = None
    if "agentzip" in backends:
        from agentzip_blk.config import Config, load_config
        config = load_config(a.config) if a.config else Config()  # defaults: zstd 3
    run_dir = a.run_dir
    tmp_run_dir = None
    if run_dir is None and "agentzip" in backends:
        import tempfile
        tmp_run_dir = run_dir = tempfile.mkdtemp(prefix="agentzip-bench-", dir="/run" if os.path.isdir("/run") else None)

    runs: dict[str, list[dict]] = {b: [] for b in backends}
    prog = demo.Progress(sys.stderr)
    try:
        for i in range(a.repeat):
            for b in backends:
                prog.phase(f"=== {b} (run {i + 1}/{a.repeat}, {a.mb:g} MiB, seed {a.seed}) ===")
                try:
                    res = demo.run_squeeze(b, a.mb, seed=a.seed, config=config if b == "agentzip" else None,
                                           config_path=a.config, run_dir=run_dir,
                                           limit_fraction=a.limit_fraction, steps=a.steps, progress=prog)
                except demo.DemoError as e:
                    res = {"backend": b, "ok": False, "error": str(e)}
                runs[b].append(res)
                prog.phase(demo.summary(res) if "orig_mem" in res else f"{b}: {res.get('error')}")
                time.sleep(2)
    finally:
        if tmp_run_dir:
            _remove_run_dir(tmp_run_dir)

    rows = {b: row_of(rs) for b, rs in runs.items()}
    compare(rows, backends[0])
    cg_version = next((r.get("cgroup", {}).get("version") for rs in runs.values() for r in rs
                       if r.get("cgroup")), None)
    doc = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
           "command": command_line("demo", argv), "machine": machine(), "mb": a.mb, "seed": a.seed,
           "repeat": a.repeat, "limit_fraction": a.limit_fraction, "steps": a.steps,
           "base": backends[0], "cgroup_version": cg_version,
           "config": a.config or "defaults", "rows": rows, "runs": runs, "notes": []}
    write_json(a.out, doc, default=str, newline=True)
    section = markdown(doc)
    if not a.no_md:
        replace_block(a.md, section, BEGIN, END)
    print(section)
    print(f"wrote {a.out}" + ("" if a.no_md else f" and {a.md}"), file=sys.stderr)
    return 0 if all(r["ok_runs"] == r["runs"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
