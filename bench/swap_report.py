"""BENCHMARKS.md section and chart from ``results/bench.json`` (written by bench/swap.py).

    .venv/bin/python -m bench swap --from-json results/bench.json   # regenerate only
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from bench.harness import cells  # the same formatting as the demo bench
from bench.harness.md import replace_block

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
ZRAM_BASE = "zram-lz4"
OURS = "agentzip-default"


def rounds(w: dict, cfg: str) -> list[dict | None]:
    """Every cycle of *cfg* on workload *w*, round by round (``bench/swap.py --repeat``): the
    first round is ``configs``, later ones ``repeats``; None for a round that errored."""
    cs = [w.get("configs", {}).get(cfg), *w.get("repeats", {}).get(cfg, [])]
    return [c if c and not c.get("error") else None for c in cs if c is not None]


def n_rounds(doc: dict) -> int:
    return max([len(rounds(w, c["name"])) for w in doc["workloads"].values() for c in doc["configs"]]
               + [1])


def _cycles(doc: dict, cfg: str, rnd: int = 0) -> list[tuple[dict, dict]]:
    """(workload, cycle) for every workload that ran *cfg* without error in round *rnd*."""
    out = []
    for w in doc["workloads"].values():
        rs = rounds(w, cfg)
        if rnd < len(rs) and rs[rnd] is not None:
            out.append((w, rs[rnd]))
    return out


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation of one figure over the rounds that have it."""

    mean: float
    sd: float
    n: int

    @classmethod
    def of(cls, xs) -> Spread | None:
        xs = [x for x in xs if isinstance(x, (int, float))]
        if not xs:
            return None
        return cls(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs))

    def fmt(self, f) -> str:
        return f(self.mean) if self.n < 2 else f"{f(self.mean)} ± {f(self.sd)}"


def _us(v):
    return "-" if v is None else (f"{v:.0f}" if v >= 10 else f"{v:.1f}")


def _sum(xs) -> float:
    return sum(x for x in xs if isinstance(x, (int, float)))


def aggregate(doc: dict, cfg: str, rnd: int = 0) -> dict:
    """One configuration over all workloads in one round: sums for ratios and CPU, medians
    for latency."""
    cs = _cycles(doc, cfg, rnd)
    if not cs:
        return {}
    phys = _sum(c["physical_after"] for _, c in cs)
    stored = _sum(c["stored_mem"] for _, c in cs)
    build_cpu = _sum(w["baseline"]["build_cpu_s"] for w, _ in cs)
    moved = _sum(c["swapped_out"] + c["swapped_in"] for _, c in cs) / (1 << 30)
    swap_cpu = _sum(c["swap_cpu_s"] for _, c in cs)
    return {
        "workloads": len(cs),
        "ratio_field": cells.rel(_sum(c["swap_backed_before"] for _, c in cs), phys),
        "ratio_device": cells.rel(_sum(c["orig_mem"] for _, c in cs), stored),
        "swap_cpu_s": swap_cpu,
        "cpu_overhead": cells.rel(swap_cpu, build_cpu),
        "cpu_s_per_gib": cells.rel(swap_cpu, moved),
        "p50_us": cells.median(c["latency"].get("p50_us") for _, c in cs),
        "p99_us": cells.median(c["latency"].get("p99_us") for _, c in cs),
        "p99_overhead_us": cells.median(c.get("p99_overhead_us") for _, c in cs),
        "slowdown": cells.median(c.get("slowdown") for _, c in cs),
        "verify": all(c.get("verify") == "ok" for _, c in cs),
    }


def _over_rounds(doc: dict, cfg: str, key: str) -> Spread | None:
    return Spread.of(aggregate(doc, cfg, r).get(key) for r in range(n_rounds(doc)))


def _ratio_over_rounds(doc: dict, key: str) -> Spread | None:
    """ours / zram of an all-workload figure, paired round by round."""
    return Spread.of(cells.rel(aggregate(doc, OURS, r).get(key), aggregate(doc, ZRAM_BASE, r).get(key))
                     for r in range(n_rounds(doc)))


def headline(doc: dict) -> list[str]:
    """The comparison with zram in two sentences, wins and losses alike, from this run's figures."""
    us, z = aggregate(doc, OURS), aggregate(doc, ZRAM_BASE)
    if not us or not z:
        return []
    n = n_rounds(doc)

    def g(cfg, key, f=cells.x):
        v = _over_rounds(doc, cfg, key)
        return v.fmt(f) if v else "-"

    saved = Spread.of(1 - 1 / r for r in (
        cells.rel(aggregate(doc, OURS, i).get("ratio_device"), aggregate(doc, ZRAM_BASE, i).get("ratio_device"))
        for i in range(n)) if r)
    cpu = _ratio_over_rounds(doc, "swap_cpu_s")
    runs = (f"Mean ± standard deviation over {n} rounds (each round runs both configurations on "
            f"the same pages, one after the other)" if n > 1 else "Single run")
    return [f"**Headline** (agentzip-blk at its default config vs zram lz4, the same pages): it keeps "
            f"them in {saved.fmt(cells.pct) if saved else '-'} less memory "
            f"(orig/stored {g(OURS, 'ratio_device')} vs {g(ZRAM_BASE, 'ratio_device')}; baseline / "
            f"physical after {g(OURS, 'ratio_field')} vs {g(ZRAM_BASE, 'ratio_field')}), and pays for it "
            f"with {cpu.fmt(cells.x) if cpu else '-'} the CPU ({g(OURS, 'cpu_s_per_gib', cells.f)} vs "
            f"{g(ZRAM_BASE, 'cpu_s_per_gib', cells.f)} CPU s per GiB moved), swap-in latency of "
            f"{g(OURS, 'p50_us', _us)} µs p50 / {g(OURS, 'p99_us', _us)} µs p99 vs "
            f"{g(ZRAM_BASE, 'p50_us', _us)} / {g(ZRAM_BASE, 'p99_us', _us)} µs, and a re-touch of a "
            f"squeezed workload that takes {g(OURS, 'slowdown')} its unconstrained time vs "
            f"{g(ZRAM_BASE, 'slowdown')} (medians over the workloads). {_field_reached(doc)} "
            f"{runs}, on a shared 2-core machine: slowdowns and latencies move by tens of percent "
            f"between runs, ratios by up to ~10%.", ""]


# Issue 15's targets, per workload, each against zram lz4 in the same run (same round).
TARGET_P50_US = 100.0  # 4 KiB fault through the whole chain (the single-fault probe)
TARGET_P99_US = 300.0
TARGET_SWAP_IN = 0.33  # swap-in throughput during CHECK, x zram lz4's
TARGET_CHECK = 2.0  # CHECK time, ours / zram's (at most)
TARGET_SWAP_OUT = 0.6  # swap-out throughput during the squeeze, x zram lz4's
TARGET_CPU = 3.0  # swap CPU per GiB moved, x zram lz4's (at most)
# "Device ratio: not below today's on any workload (within 3%)": agentzip-default's orig/stored
# in the run the issue was written from (bench/swap.py, 2026-11-30 11:57 UTC, the table
# kept below under "before the FUSE front door"); the same seeds give the same pages.
DEVICE_RATIO_BEFORE = {"A": 4.10, "B": 3.39, "C": 5.85, "D": 3.75}
DEVICE_RATIO_SLACK = 0.03


def _speeds(c: dict) -> tuple[float | None, float | None]:
    """Swap-out MiB/s (pages written during the squeeze / its wall time) and swap-in MiB/s
    (pages read back during the CHECK pass's touch / its wall time)."""
    out_s = (c.get("squeeze") or {}).get("seconds")
    in_s = (c.get("check") or {}).get("touch_s")
    mib = 1 << 20
    return (cells.rel(c.get("swapped_out", 0) / mib, out_s), cells.rel(c.get("swapped_in", 0) / mib, in_s))


def _met(ok) -> str:
    return "-" if ok is None else ("**met**" if ok else "missed")


@dataclass(frozen=True)
class Target:
    what: str
    unit: str
    fig: object  # cycle -> float | None
    goal: str  # as printed
    ok: object  # (ours: Spread, ratio: Spread | None) -> bool, on the means
    per_run: object  # (ours, ratio) -> bool, one round
    fmt: object = cells.f


def _fault(p: str):
    return lambda c: (c.get("latency") or {}).get(p)


TARGETS = [
    Target("4 KiB fault p50", "µs", _fault("p50_us"), f"≤ {TARGET_P50_US:.0f} µs",
           lambda o, r: o.mean <= TARGET_P50_US, lambda o, r: o <= TARGET_P50_US, _us),
    Target("4 KiB fault p99", "µs", _fault("p99_us"), f"≤ {TARGET_P99_US:.0f} µs",
           lambda o, r: o.mean <= TARGET_P99_US, lambda o, r: o <= TARGET_P99_US, _us),
    Target("swap-in (CHECK)", "MiB/s", lambda c: _speeds(c)[1], f"≥ {TARGET_SWAP_IN}x zram",
           lambda o, r: r is not None and r.mean >= TARGET_SWAP_IN,
           lambda o, r: r is not None and r >= TARGET_SWAP_IN),
    Target("CHECK time", "s", lambda c: c.get("check_wall_s"), f"≤ {TARGET_CHECK}x zram",
           lambda o, r: r is not None and r.mean <= TARGET_CHECK,
           lambda o, r: r is not None and r <= TARGET_CHECK, lambda v: cells.f(v, "{:.2f}")),
    Target("swap-out (squeeze)", "MiB/s", lambda c: _speeds(c)[0], f"≥ {TARGET_SWAP_OUT}x zram",
           lambda o, r: r is not None and r.mean >= TARGET_SWAP_OUT,
           lambda o, r: r is not None and r >= TARGET_SWAP_OUT),
    Target("swap CPU per GiB moved", "CPU s", lambda c: c.get("swap_cpu_s_per_gib"),
           f"≤ {TARGET_CPU}x zram", lambda o, r: r is not None and r.mean <= TARGET_CPU,
           lambda o, r: r is not None and r <= TARGET_CPU),
]


def targets(doc: dict, cfg: str = OURS) -> list[str]:
    """Issue 15's targets per workload: our figure, zram lz4's in the same round, the ratio
    (paired round by round), mean ± sd over the rounds, and whether the target is met."""
    rows = []
    tally: dict[str, list[str]] = {}  # target -> workloads where it is met
    ws = [w for w in doc["workloads"].values() if any(rounds(w, cfg)) and any(rounds(w, ZRAM_BASE))]
    if not ws:
        return []
    for t in TARGETS:
        for w in ws:
            pairs = list(zip(rounds(w, cfg), rounds(w, ZRAM_BASE)))
            ours = [t.fig(u) if u else None for u, _ in pairs]
            zram = [t.fig(z) if z else None for _, z in pairs]
            ratios = [cells.rel(a, b) for a, b in zip(ours, zram)]
            o, zz, r = Spread.of(ours), Spread.of(zram), Spread.of(ratios)
            if o is None:
                continue
            ok = t.ok(o, r)
            tally.setdefault(t.what, [])
            if ok:
                tally[t.what].append(w["key"])
            good = sum(1 for a, q in zip(ours, ratios) if a is not None and t.per_run(a, q))
            rows.append(f"| {t.what} ({t.unit}) | {w['key']} | {o.fmt(t.fmt)} | "
                        f"{zz.fmt(t.fmt) if zz else '-'} | {r.fmt(cells.x) if r else '-'} | {t.goal} "
                        f"| {_met(ok)} ({good}/{o.n} rounds) |")
    # device ratio: against agentzip-blk's own before the front door, not against zram
    for w in ws:
        ours = [u.get("ratio_device") if u else None for u in rounds(w, cfg)]
        zram = [z.get("ratio_device") if z else None for z in rounds(w, ZRAM_BASE)]
        o, zz = Spread.of(ours), Spread.of(zram)
        r = Spread.of(cells.rel(a, b) for a, b in zip(ours, zram))
        before = DEVICE_RATIO_BEFORE.get(w["key"])
        if o is None or before is None or doc["options"].get("mb_scale", 1.0) != 1.0:
            continue
        floor = before * (1 - DEVICE_RATIO_SLACK)
        tally.setdefault("device ratio", [])
        if o.mean >= floor:
            tally["device ratio"].append(w["key"])
        good = sum(1 for a in ours if a is not None and a >= floor)
        rows.append(f"| device ratio (orig/stored) | {w['key']} | {o.fmt(cells.x)} | "
                    f"{zz.fmt(cells.x) if zz else '-'} | {r.fmt(cells.x) if r else '-'} "
                    f"| ≥ {floor:.2f}x (before: {before:.2f}x, -3%) "
                    f"| {_met(o.mean >= floor)} ({good}/{o.n} rounds) |")
    n = n_rounds(doc)
    return ["### Fast-path targets per workload (issue 15; " + cfg + " vs zram lz4, same run)", "",
            f"Each figure is the mean ± standard deviation over {n} round(s); each round runs "
            f"zram lz4 and then agentzip-blk on the same idle heap, and *×* is ours / zram's of the "
            f"same round, averaged over the rounds. A target is **met** when the mean meets it; "
            f"the rounds column says in how many single rounds it held. Not measured here: "
            f"`bench/load.py` with 8 sandboxes and the 20-sandbox density run (their own sections).",
            "",
            "| target | workload | agentzip-blk | zram lz4 | × | target | met? |",
            "|---|---|---:|---:|---:|---|---|", *rows, "",
            "**Met / missed** (on the means, per workload): " + "; ".join(
                f"{what}: " + (f"met on {', '.join(keys)}" if keys else "met on none")
                + (f", missed on {', '.join(k for k in [w['key'] for w in ws] if k not in keys)}"
                   if len(keys) < len(ws) else "")
                for what, keys in tally.items()) + ".", "",
            "*4 KiB fault*: single-page faults on swapped pages, one at a time, through "
            "`/proc/PID/mem` (the probe described below; the kernel's swap readahead is on, "
            "so a fault may bring neighbours). *swap-in*: bytes read back from swap during the "
            "CHECK pass's page touch / its wall time (one thread). *CHECK time*: the whole "
            "CHECK pass after the squeeze (read every page back, recompute the checksum). "
            "*swap-out*: bytes written to swap during the squeeze / its wall time (the kernel "
            "reclaims synchronously inside the limit writes). *swap CPU per GiB*: reclaim in the "
            "limit writer + the server's CPU + the CHECK pass's extra CPU, per GiB swapped out "
            "plus in (zram has no server: its work is in reclaim and in the faulting task). "
            "*device ratio*: the device's orig/stored.", ""]


def _field_reached(doc: dict) -> str:
    """Which workloads reach the field report's ratio with some agentzip-blk configuration."""
    reached = [w["key"] for w in doc["workloads"].values()
               if any((c.get("ratio_field") or 0) >= w["field_ratio"]
                      for n, c in w.get("configs", {}).items() if n.startswith("agentzip"))]
    missed = [w["key"] for w in doc["workloads"].values() if w["key"] not in reached]
    if not missed:
        return "Every workload reaches the field report's ratio with some agentzip-blk configuration."
    return (f"The field report's ratios are reached on {', '.join(reached) or 'no workload'} and "
            f"missed on {', '.join(missed)}.")


def _server_vs_stored(c: dict) -> str:
    """agentzip-blk: what the server's RSS grew by / what its stored_mem grew by."""
    if c["config"]["kind"] == "zram":
        return "-"
    return f"{cells.mib(c['server_rss_after'] - c['server_rss_before'])} / {cells.mib(c['stored_mem'] - c['stored_mem_empty'])}"


def markdown(doc: dict) -> str:
    m = doc["machine"]
    cfgs = [c["name"] for c in doc["configs"]]
    waited = doc.get("lock_wait_s") or 0
    L = [BEGIN, "## Real agent workloads: agentzip-blk vs zram", "",
         f"Generated by `bench/swap.py` on {doc['date']} in {doc['wall_s'] / 60:.1f} min"
         + (f" ({waited / 60:.1f} of them waiting for other engineers' swap runs to release the swap lock)"
            if waited >= 30 else "") + ". Machine: Linux "
         f"{m['kernel']}, {m['nproc']} x {m.get('cpu') or 'CPU'}, MemTotal {m['mem_total'] / (1 << 30):.1f} GiB, "
         f"memory cgroup v{m.get('cgroup')}, zswap {'on' if m.get('zswap') else 'off'}, "
         f"vm.page-cluster {m.get('page_cluster')}; Python {m['python']}, pandas {m.get('pandas')}, "
         f"Node.js {m.get('node')}, {m.get('chromium')}, {m.get('nbdkit')}. Command (as root):", "",
         f"    {doc['command']}", ""]
    o = doc["options"]
    L += [f"Each workload is started once, unconstrained, in a memory cgroup of its own; once it is "
          f"idle every swap configuration in turn is the only swap, squeezes it to "
          f"{o['limit_fraction']:.0%} of its cgroup usage, is probed for swap-in latency "
          f"({o['probe_samples']} single-page faults), and the workload then re-reads and verifies "
          f"all of its data (CHECK). Same pages, same run, for every configuration."
          + (f" This run repeats that {o['repeat']} times per workload, the configurations "
             f"taking turns (round 1: each configuration, round 2: each again, ...); "
             + ("before each round" if doc.get("rebaseline_every_round") else "before each later round")
             + " the workload's unconstrained CHECK is timed again, and that round's "
             "slowdowns are against it." if o.get("repeat", 1) > 1 else ""), ""]
    loads = [c.get("loadavg_1m") for w in doc["workloads"].values() for cfg in cfgs
             for c in rounds(w, cfg) if c and c.get("loadavg_1m") is not None]
    if loads:
        L += [f"Machine load while it ran (1-minute load average at the start of each cycle, "
              f"{m['nproc']} CPUs): median {statistics.median(loads):.1f}, range "
              f"{min(loads):.1f}-{max(loads):.1f}. Other engineers' tests shared the machine; "
              f"the same-round ratios to zram are the figures to trust, absolute times less.", ""]

    L += headline(doc)
    L += targets(doc)

    # -- the field report's table per workload ------------------------------------------------
    L += ["### Per workload (the field report's table" + (", round 1" if n_rounds(doc) > 1 else "")
          + ")", "",
          "| workload | field report | baseline MiB | peak MiB | agentzip-blk: physical after MiB | ratio "
          "| zram lz4: physical after MiB | ratio | agentzip-blk / zram | best agentzip-blk config |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for w in doc["workloads"].values():
        b = w.get("baseline", {})
        us, z = w.get("configs", {}).get(OURS, {}), w.get("configs", {}).get(ZRAM_BASE, {})
        best = max(((n, c) for n, c in w.get("configs", {}).items()
                    if n.startswith("agentzip") and c.get("ratio_field")),
                   key=lambda nc: nc[1]["ratio_field"], default=(None, None))
        L.append(f"| {w['key']}: {w['title']} | {w['field_ratio']:.1f}x | {cells.mib(b.get('swap_backed'))} "
                 f"| {cells.mib(b.get('peak_usage'))} | {cells.mib(us.get('physical_after'))} | {cells.x(us.get('ratio_field'))} "
                 f"| {cells.mib(z.get('physical_after'))} | {cells.x(z.get('ratio_field'))} "
                 f"| {cells.x(cells.rel(us.get('ratio_field'), z.get('ratio_field')))} "
                 f"| {best[0] or '-'} {cells.x(best[1]['ratio_field']) if best[1] else ''} |")
    L += ["", "*baseline*: the workload's swap-backed memory (anonymous + shmem, `memory.stat`) when "
          "idle, unconstrained; *peak*: the cgroup's peak usage (file cache included). *physical after*: "
          "swap-backed memory still resident after the squeeze plus what holds the swapped pages "
          "(zram: growth of `mem_used_total`; agentzip-blk: growth of the server's RSS or of its "
          "`stored_mem`, whichever is larger). *ratio* = baseline / physical after, the field "
          "report's definition; it depends on how hard the squeeze is, the device ratio below does not.", ""]

    # -- the field report's table per algorithm -------------------------------------------------
    zb = aggregate(doc, ZRAM_BASE)
    L += ["### Per configuration, all workloads together", "",
          "| configuration | ratio (field) | × zram lz4 | orig/stored | × zram lz4 | swap CPU s | CPU overhead "
          "| × zram lz4 | CPU s/GiB | p50 swap-in µs | p99 swap-in µs | p99 overhead µs | × zram lz4 "
          "| CHECK slowdown | verify |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    nr = n_rounds(doc)
    for name, rnd in ((n, r) for n in cfgs for r in range(nr)):
        g = aggregate(doc, name, rnd)
        zb = aggregate(doc, ZRAM_BASE, rnd)
        label = name if nr == 1 else f"{name} (round {rnd + 1})"
        if not g:
            L.append(f"| {label} | not run: " + "; ".join(
                f"{w['key']}: {w.get('configs', {}).get(name, {}).get('error', 'missing')}"
                for w in doc["workloads"].values()).replace("|", "\\|") + " |" + " |" * 13)
            continue
        L.append(f"| {label} | {cells.x(g['ratio_field'])} | {cells.x(cells.rel(g['ratio_field'], zb.get('ratio_field')))} "
                 f"| {cells.x(g['ratio_device'])} | {cells.x(cells.rel(g['ratio_device'], zb.get('ratio_device')))} "
                 f"| {cells.f(g['swap_cpu_s'])} | {cells.pct(g['cpu_overhead'])} "
                 f"| {cells.x(cells.rel(g['swap_cpu_s'], zb.get('swap_cpu_s')))} | {cells.f(g['cpu_s_per_gib'])} "
                 f"| {_us(g['p50_us'])} | {_us(g['p99_us'])} | {_us(g['p99_overhead_us'])} "
                 f"| {cells.x(cells.rel(g['p99_overhead_us'], zb.get('p99_overhead_us')))} | {cells.x(g['slowdown'])} "
                 f"| {'ok' if g['verify'] else 'FAIL'} ({g['workloads']}/{len(doc['workloads'])}) |")
    L += ["", "*ratio (field)*: sum of baselines / sum of physical-after over the workloads; "
          "*orig/stored*: sum of the device's orig_mem / stored_mem (zram: `mm_stat` orig_data_size / "
          "mem_used_total; agentzip-blk: `stats`, which counts the empty device's tables too). "
          "*swap CPU*: CPU seconds spent on swapping: the reclaim inside the limit writes (zram "
          "compresses there), the server's CPU (nbdkit + nbdfuse; agentzip-blk compresses and "
          "decompresses there; the loop device's kernel worker is not counted), and what the "
          "CHECK pass cost the workload on top of the same pass unconstrained (zram decompresses "
          "in the faulting task). *CPU overhead*: swap CPU / the CPU the workloads spent building "
          "their data. *CPU s/GiB*: per GiB swapped out plus in. *p50/p99 swap-in*: median over "
          "the workloads of the percentile of single-page faults on swapped pages, one at a time, "
          "through `/proc/PID/mem` (with the kernel's swap readahead); *p99 overhead*: minus the "
          "same read on resident pages. *CHECK slowdown*: median over the workloads of the "
          "CHECK pass (read every page back, recompute the checksum) after the squeeze / "
          "unconstrained. *× zram lz4*: this configuration's figure / zram lz4's in the same run.", ""]

    # -- everything ------------------------------------------------------------------------------
    L += ["### Every workload and configuration", "",
          "| workload | configuration | out MiB | orig/stored | ratio (field) | physical after MiB "
          "| free-memory gain MiB | server RSS Δ / stored Δ MiB | server CPU s | swap CPU s | p50 / p99 µs "
          "| CHECK s (slowdown) | verify |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for w in doc["workloads"].values():
        b = w.get("baseline")
        if b:
            lat = b.get("latency", {})
            L.append(f"| {w['key']} | unconstrained | - | - | - | {cells.mib(b['swap_backed'])} | - | - | - | - "
                     f"| {_us(lat.get('p50_us'))} / {_us(lat.get('p99_us'))} "
                     f"| {b['check_wall_s']:.2f} | {b['check']['result']} |")
            # --repeat: the unconstrained CHECK re-timed before a round (bench.py rebaseline)
            br = w.get("baseline_rounds") or []
            first = nr - len(br)  # older runs re-timed only rounds 2..N
            for i, rb in enumerate(br):
                L.append(f"| {w['key']} | unconstrained, before round {first + i + 1} | - | - | - "
                         f"| - | - | - | - | - | - | {rb['check_wall_s']:.2f} | ok |")
        allc = [(f"{n}" if nr == 1 else f"{n} #{i + 1}", c) for i in range(nr) for n in cfgs
                for c in [([w.get("configs", {}).get(n)] + w.get("repeats", {}).get(n, []) + [None] * nr)[i]]]
        for name, c in allc:
            if c is None:
                continue
            if c.get("error"):
                L.append(f"| {w['key']} | {name} | error: {c['error'].replace('|', '/')} |" + " |" * 10)
                continue
            lat = c["latency"]
            L.append(f"| {w['key']} | {name} | {cells.mib(c['swapped_out'])} | {cells.x(c['ratio_device'])} "
                     f"| {cells.x(c['ratio_field'])} | {cells.mib(c['physical_after'])} | {cells.mib(c['mem_free_gain'])} "
                     f"| {_server_vs_stored(c)} | {cells.f(c['server_cpu_s'])} | {cells.f(c['swap_cpu_s'])} "
                     f"| {_us(lat.get('p50_us'))} / {_us(lat.get('p99_us'))} "
                     f"| {c['check_wall_s']:.2f} ({cells.x(c['slowdown'])}) | {c['verify']} |")
        fv = w.get("final_verify", {}).get("result", "-")
        L.append(f"| {w['key']} | final TOUCH | | | | | | | | | | | VERIFY {fv}, exit {w.get('exit_status')} |")
    L.append("")
    notes = []
    if not doc.get("dictionaries"):
        notes.append("Dictionaries: `compression.dictionary` had no store support when this ran "
                     "(no `agentzip_blk.dictionaries`); only the no-dictionary figures exist.")
    else:
        gains = []
        for w in doc["workloads"].values():
            a = (w.get("configs", {}).get("agentzip-zstd3-dict") or {}).get("ratio_device")
            b = (w.get("configs", {}).get("agentzip-zstd3") or {}).get("ratio_device")
            if a and b:
                gains.append(f"{w['key']} {(a / b - 1) * 100:+.1f}%")
        notes.append("Dictionaries: `-dict` rows use `compression.dictionary: prebuilt`; the other "
                     "explicit rows use `none`; `agentzip-default` is the default config (zstd 3, "
                     "`dictionary: auto`). Device ratio of zstd 3 with prebuilt dictionaries over "
                     "without: " + (", ".join(gains) or "-") + " (each cycle swaps a slightly "
                     "different set of pages, so differences of a few percent are within noise).")
    if n_rounds(doc) > 1 and not doc.get("rebaseline_every_round"):
        notes.append("Round 1's slowdowns are against the unconstrained CHECK timed when the "
                     "workload was ready, before any wait for the swap lock; under other "
                     "engineers' load that baseline can be several times the later ones (compare "
                     "the *unconstrained* rows), which makes round 1's slowdowns too low. The "
                     "CHECK-time ratio to zram in the targets table is paired within a round and "
                     "does not depend on the baseline. (bench/swap.py now re-times the baseline "
                     "before every round.)")
    if doc.get("lock_wait_s"):
        notes.append(f"Wall time without the waits for the swap lock: "
                     f"{(doc['wall_s'] - doc['lock_wait_s']) / 60:.1f} min.")
    notes.append("Free-memory gain (MemFree + per-CPU lists, host-wide) also moves with other "
                 "processes on the machine; the physical-after figures come from the cgroup and the "
                 "device and do not.")
    L += [f"- {n}" for n in notes]
    L.append(f"\n![memory saved (higher is better) and re-touch slowdown (lower is better) per "
             f"workload, agentzip-blk default vs zram lz4](docs/bench.png)\n{END}")
    return "\n".join(L) + "\n"


# The chart: only agentzip-blk's default against zram lz4, the two figures a user decides on.
# (Every other configuration is in the tables.) Colours from the Okabe-Ito palette, which
# stays distinct for colour-blind readers and in greyscale; zram is also hatched.
CHART_SERIES = ((OURS, "agentzip-blk (default config)", "#0072B2", None),
                (ZRAM_BASE, "zram lz4 (the kernel's)", "#E69F00", "//"))


def chart_data(doc: dict) -> dict:
    """{(cfg, key): [(workload key, Spread | None)]} for the chart (tests read it)."""
    out = {}
    for cfg, *_ in CHART_SERIES:
        for key in ("saved", "slowdown"):
            row = []
            for w in doc["workloads"].values():
                cs = [c for c in rounds(w, cfg) if c]
                if key == "saved":
                    vals = [100 * (1 - c["physical_after"] / c["swap_backed_before"]) for c in cs
                            if c.get("physical_after") and c.get("swap_backed_before")]
                else:
                    vals = [c.get("slowdown") for c in cs]
                row.append((w["key"], Spread.of(vals)))
            out[(cfg, key)] = row
    return out


def chart(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = list(doc["workloads"].values())
    data = chart_data(doc)
    n = n_rounds(doc)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6), layout="constrained")
    panels = (
        (axes[0], "saved", "Memory saved: higher is better",
         "memory saved, % of the workload's\nswap-backed memory (1 - physical after / before)", "{:.0f}%"),
        (axes[1], "slowdown", "Re-touch slowdown: lower is better",
         "time to read all memory back after the squeeze\n/ the same pass unconstrained (x)", "{:.1f}x"),
    )
    width = 0.38
    for ax, key, title, ylabel, fmt in panels:
        top = 0.0
        for j, (cfg, label, colour, hatch) in enumerate(CHART_SERIES):
            row = data[(cfg, key)]
            xs = [i + (j - 0.5) * width for i in range(len(ws))]
            means = [sp.mean if sp else 0 for _, sp in row]
            sds = [sp.sd if sp else 0 for _, sp in row]
            ax.bar(xs, means, width, yerr=sds if n > 1 else None, capsize=4, label=label,
                   color=colour, hatch=hatch, edgecolor="black", linewidth=0.6,
                   error_kw={"elinewidth": 1.2, "ecolor": "black"})
            for x, m, sd in zip(xs, means, sds):  # above the error bar, not under it
                if m:
                    ax.annotate(fmt.format(m) + (f"\n± {fmt.format(sd)}" if n > 1 else ""),
                                (x, m + sd), xytext=(0, 3), textcoords="offset points",
                                ha="center", va="bottom", fontsize=8.5)
            top = max([top] + [m + s for m, s in zip(means, sds)])
        if key == "slowdown":
            ax.axhline(1.0, color="dimgrey", linestyle="dashed", linewidth=1,
                       label="1x: as fast as unconstrained (right panel)")
            ax.set_ylim(0, top * 1.22)
        else:
            ax.set_ylim(0, 100)
        ax.set_xlim(-0.5, len(ws) - 0.5)
        ax.set_title(title, fontsize=12, fontweight="bold")
        ax.set_xticks(range(len(ws)), [f"{w['key']}: {w['name']}" for w in ws])
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    # one legend for both panels, under them: nothing of the bars or their labels is covered
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    bars_note = (f"bars: mean of {n} rounds; error bars: ± 1 standard deviation" if n > 1
                 else "single run (no error bars)")
    fig.suptitle(f"agentzip-blk vs zram lz4 on {len(ws)} agent workloads, each squeezed to "
                 f"{doc['options']['limit_fraction']:.0%} of its memory, then read back\n"
                 f"bench/swap.py, {doc['date']}; {bars_note}", fontsize=11)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def publish(doc: dict, md_path: str | None, chart_path: str | None) -> str:
    section = markdown(doc)
    if md_path:
        replace_block(md_path, section, BEGIN, END)
    if chart_path:
        chart(doc, chart_path)
    print(section)
    return section
