#!/usr/bin/env python3
"""The benchmark suite: four real agent workloads, agentzip-blk side by side with zram.

One command (as root; the tool takes the swap lock itself, for each workload's swap runs):

    .venv/bin/python -m bench swap

For each workload (A pandas, B JSON tool calling, C headless Chromium, D Node.js text) it
starts the workload once in a memory cgroup of its own, unconstrained, and measures the
baseline: peak and idle memory, build time and CPU, one CHECK pass (re-touch every page and
verify the checksum), the latency of reading resident pages. Then, for every swap
configuration in turn (zram lz4, zram lzo-rle, agentzip-blk at its default config, lz4, zstd 3,
zstd 9, with and without dictionaries when the store has them), each the only swap while it
runs: attach; squeeze the idle workload to a fraction of its memory (the kernel swaps it out);
record what went out, what the device stores, what the host got back, the CPU spent; lift the
limit; probe the swap-in latency by faulting single pages back one at a time; CHECK (the
workload reads everything back and verifies it); detach. The same pages go through every
configuration. At the end the workload gets TOUCH and must answer VERIFY ok.

Writes ``results/bench.json``, ``docs/bench.png`` and the section of ``BENCHMARKS.md``
between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` (``bench/swap_report.py``;
``--from-json`` regenerates them without running anything).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from agentzip_blk import procfs
from agentzip_blk.cgroups.fs import CgroupError, MemoryCgroup
from agentzip_blk.demo import backends, common, driver, workload
from agentzip_blk.host import facts
from bench import swap_report
from bench.harness import lock as swaplock
from bench.harness.host import kill_all
from bench.harness.results import REPO, command_line, write_json
from bench.harness.workloads import WorkloadSpec, module, workloads

pagewalk = module("pagewalk")

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class SwapConfig:
    name: str
    kind: str  # "zram" or "agentzip"
    algorithm: str
    level: int | None = None
    dictionary: str | None = None  # agentzip: compression.dictionary; None = the default
    frame_pages: int | None = None  # agentzip: compression.frame_pages; None = the default
    rotational: bool | None = None  # agentzip: device.rotational; None = the default
    warm: str | None = None  # agentzip: compression.warm_algorithm; None = the default
    datapath: str | None = None  # agentzip: device.datapath; None = the default (auto)

    @property
    def is_zram(self) -> bool:
        return self.kind == "zram"


def dictionaries_supported() -> bool:
    return importlib.util.find_spec("agentzip_blk.codec.dictionaries") is not None


def swap_configs(with_dictionaries: bool) -> list[SwapConfig]:
    """zram, agentzip-blk at its defaults, and variants: each page compressed alone (the
    codecs side by side with zram's), and multi-page frames of 4-16 pages."""
    out = [SwapConfig("zram-lz4", "zram", "lz4"), SwapConfig("zram-lzo-rle", "zram", "lzo-rle"),
           SwapConfig("agentzip-default", "agentzip", "default"),
           SwapConfig("agentzip-warm-lz4", "agentzip", "default", warm="lz4"),
           SwapConfig("agentzip-warm-lz4-python", "agentzip", "default", warm="lz4",
                      datapath="python"),
           SwapConfig("agentzip-python", "agentzip", "default", datapath="python"),
           SwapConfig("agentzip-warm-zstd", "agentzip", "default", warm="zstd"),
           SwapConfig("agentzip-rotational", "agentzip", "default", rotational=True),
           SwapConfig("agentzip-vma-readahead", "agentzip", "default", rotational=False),
           SwapConfig("agentzip-lz4", "agentzip", "lz4", 1, "none", 1),
           SwapConfig("agentzip-zstd3", "agentzip", "zstd", 3, "none", 1),
           SwapConfig("agentzip-zstd9", "agentzip", "zstd", 9, "none", 1),
           SwapConfig("agentzip-unit4", "agentzip", "zstd", 3, "none", 4),
           SwapConfig("agentzip-unit8", "agentzip", "zstd", 3, "none", 8),
           SwapConfig("agentzip-unit16", "agentzip", "zstd", 3, "none", 16),
           SwapConfig("agentzip-lz4-unit16", "agentzip", "lz4", 1, "none", 16)]
    if with_dictionaries:
        out += [SwapConfig("agentzip-unit16-prebuilt", "agentzip", "zstd", 3, "prebuilt", 16),
                SwapConfig("agentzip-zstd3-dict", "agentzip", "zstd", 3, "prebuilt", 1),
                SwapConfig("agentzip-zstd9-dict", "agentzip", "zstd", 9, "prebuilt", 1)]
    return out


# ---------------------------------------------------------------------------------------
# the swap lock (machine-wide: every run that attaches swap holds it; bench/harness/lock.py)


@contextlib.contextmanager
def swap_lock(prog: driver.Progress, waited: list[float]):
    """Hold the machine-wide swap lock; seconds spent waiting for it are appended to *waited*."""
    with swaplock.swap_lock(prog.phase) as w:
        if w:
            waited.append(w)
        yield


# ---------------------------------------------------------------------------------------
# measurements


def tree_cpu(pids) -> float:
    """CPU seconds (user + system) of *pids* so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return total / TICK


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def host_busy() -> float:
    """CPU seconds all CPUs of the host spent busy so far (/proc/stat; includes kernel threads)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK  # minus idle and iowait


def swap_backed(cg: MemoryCgroup) -> int:
    """Resident memory of the cgroup that only swap can take: anonymous + shmem."""
    st = cg.stat()
    if cg.version == 1:
        return st.get("total_rss", st.get("rss", 0)) + st.get("total_shmem", st.get("shmem", 0))
    return st.get("anon", 0) + st.get("shmem", 0)


def peak_usage(cg: MemoryCgroup) -> int | None:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            return int(cg.read(name))
        except (OSError, ValueError):
            continue
    return None


def latency_summary(ns: list[int]) -> dict:
    if not ns:
        return {"n": 0}
    s = sorted(ns)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))] / 1000

    return {"n": len(s), "p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99),
            "p999_us": q(0.999), "max_us": s[-1] / 1000, "mean_us": statistics.fmean(s) / 1000}


def parse_check(parts: list[str]) -> dict:
    """CHECK|VERIFY ok <sum> <sum_s> <touch_s> <pages>, or ... FAIL <got> <want>."""
    out = {"result": parts[1] if len(parts) > 1 else "?", "checksum": parts[2] if len(parts) > 2 else None}
    if out["result"] == "ok" and len(parts) >= 6:
        out.update(checksum_s=float(parts[3]), touch_s=float(parts[4]), pages=int(parts[5]))
    return out


# ---------------------------------------------------------------------------------------
# one workload through every configuration


@dataclass
class Options:
    seed: int = 1
    limit_fraction: float = 0.1
    steps: int = 6
    probe_samples: int = 1000
    settle: float = 1.0
    swap_size: int = 2 << 30
    timeout: float = 300.0
    workdir: str = "/tmp"
    mb_scale: float = 1.0
    repeat: int = 1  # cycles per configuration, interleaved (zram, ours, zram, ours, ...)
    cold_wait: float = 120.0  # s: agentzip, after the probe: the backlog drained (wait_cold)


class Bench:
    def __init__(self, specs: list[WorkloadSpec], configs: list[SwapConfig], opts: Options,
                 prog: driver.Progress):
        self.specs, self.configs, self.opts, self.prog = specs, configs, opts, prog
        self.total_steps = len(specs) * (1 + len(configs) * opts.repeat)
        self.step = 0
        self.t0 = time.monotonic()
        self.lock_waits: list[float] = []

    def _header(self, what: str) -> None:
        self.step += 1
        el = time.monotonic() - self.t0
        eta = el / max(self.step - 1, 1) * (self.total_steps - self.step + 1) if self.step > 1 else None
        self.prog.phase(f"=== [{self.step}/{self.total_steps}] {what}  (elapsed {el / 60:.1f} min"
                        + (f", ~{eta / 60:.1f} min left)" if eta is not None else ")"))

    def run(self) -> dict:
        return {s.key: self.run_workload(s) for s in self.specs}

    # -- per workload -----------------------------------------------------------------

    def run_workload(self, spec: WorkloadSpec) -> dict:
        o = self.opts
        mb = max(8, int(spec.mb * o.mb_scale))
        argv = [*spec.argv, "--mb", str(mb), "--seed", str(o.seed)]
        res: dict = {"key": spec.key, "name": spec.name, "title": spec.title, "mb": mb,
                     "field_ratio": spec.field_ratio, "command": shlex.join(argv), "configs": {}}
        self._header(f"{spec.key} {spec.name}: start unconstrained ({mb} MiB, seed {o.seed})")
        cg = wl = None
        try:
            cg = MemoryCgroup.create(f"agentzip-bench-{os.getpid()}-{spec.key}")
            cg.allow_swap()
            cg.set_swappiness(100)
            t = time.monotonic()
            wl = workload.Workload(cg, mb, o.seed, argv=argv)
            ready = wl.expect("READY", o.timeout, tick=lambda: self.prog.bar(
                cg.usage() / (mb * MiB), f"building, cgroup usage {common.fmt(cg.usage())}"))
            res["baseline"] = self.baseline(cg, wl, int(ready[1]), time.monotonic() - t)
            base = res["baseline"]
            self.prog.phase(f"{spec.key} READY: size {common.fmt(base['ready_size'])}, swap-backed "
                            f"{common.fmt(base['swap_backed'])}, peak {common.fmt(base['peak_usage'])}, "
                            f"built in {base['build_s']:.1f}s; CHECK {base['check']['result']} in "
                            f"{base['check_wall_s']:.2f}s; resident read p99 {base['latency'].get('p99_us', 0):.1f}us")
            # one lock for all configurations of a workload: a couple of minutes, and the
            # configurations run back to back on the same idle heap
            # --repeat: the configurations take turns, round after round, so that a drift of
            # the machine (another engineer's load) lands on all of them alike; the first
            # round is `configs`, later rounds `repeats` (older JSON has no `repeats`)
            with swap_lock(self.prog, self.lock_waits):
                for rnd in range(o.repeat):
                    # with --repeat, every round (the first too, now that we hold the lock:
                    # the wait for it can be minutes of someone else's load) times its own
                    rbase = base if o.repeat == 1 else self.rebaseline(cg, wl, base, res)
                    for cfg in self.configs:
                        tag = f" (round {rnd + 1}/{o.repeat})" if o.repeat > 1 else ""
                        self._header(f"{spec.key} {spec.name} x {cfg.name}{tag}")
                        r = self.cycle(cfg, cg, wl, rbase)
                        if rnd == 0:
                            res["configs"][cfg.name] = r
                        else:
                            res.setdefault("repeats", {}).setdefault(cfg.name, []).append(r)
                        self.prog.phase(_one_line(cfg.name, r))
                        if not wl.alive():
                            break
                    if not wl.alive():
                        break
            wl.send("TOUCH")
            v = wl.expect("VERIFY", o.timeout)
            res["final_verify"] = parse_check(v)
            wl.proc.wait(timeout=60)
            res["exit_status"] = wl.proc.returncode
        except (common.DemoError, CgroupError, OSError, subprocess.TimeoutExpired) as e:
            res["error"] = f"{type(e).__name__}: {e}"
            self.prog.phase(f"{spec.key}: {res['error']}")
        finally:
            if wl is not None:
                if wl.alive():
                    res.setdefault("stderr_tail", wl.stderr_tail(1500))
                wl.stop()
            if cg is not None:
                kill_all(cg)  # Chromium's helpers may outlive the script that started them
                with contextlib.suppress(CgroupError, OSError):
                    cg.set_limit(None)
                res["oom_kills"] = _safe(cg.oom_kills)
                cg.remove()
        res["ok"] = (not res.get("error") and res.get("final_verify", {}).get("result") == "ok"
                     and res.get("exit_status") == 0
                     and all(c.get("verify") == "ok" for c in res["configs"].values())
                     and all(c.get("verify") == "ok" for rs in res.get("repeats", {}).values() for c in rs))
        return res

    def baseline(self, cg: MemoryCgroup, wl: workload.Workload, ready_size: int, build_s: float) -> dict:
        o = self.opts
        pids = cg.pids()
        b = {"ready_size": ready_size, "build_s": build_s, "build_cpu_s": tree_cpu(pids),
             "peak_usage": peak_usage(cg), "processes": len(pids)}
        time.sleep(o.settle)
        b["usage"] = cg.usage()
        b["swap_backed"] = swap_backed(cg)
        # two CHECK passes: the first pays one-time costs (JIT, first paint of a screenshot);
        # the second, warm, is the baseline every configuration's CHECK is compared with
        for _ in range(2):
            cpu0, t = tree_cpu(cg.pids()), time.monotonic()
            wl.send("CHECK")
            b["check"] = parse_check(wl.expect("CHECK", o.timeout))
            b["check_wall_s"] = time.monotonic() - t
            b["check_cpu_s"] = tree_cpu(cg.pids()) - cpu0
        time.sleep(o.settle)  # let the garbage of the pass be collected before timing reads
        b["latency"] = latency_summary(pagewalk.probe(cg.pids(), o.probe_samples, swapped=False, seed=o.seed))
        return b

    def rebaseline(self, cg: MemoryCgroup, wl: workload.Workload, base: dict, res: dict) -> dict:
        """A round's own unconstrained CHECK (swapoff brought every page back): each round's
        slowdowns are against a baseline taken seconds, not many minutes, before."""
        cpu0, t = tree_cpu(cg.pids()), time.monotonic()
        wl.send("CHECK")
        check = parse_check(wl.expect("CHECK", self.opts.timeout))
        b = {**base, "check_wall_s": time.monotonic() - t, "check_cpu_s": tree_cpu(cg.pids()) - cpu0}
        if check["result"] != "ok" or check["checksum"] != base["check"]["checksum"]:
            raise common.DemoError(f"unconstrained CHECK between rounds: {check}")
        res.setdefault("baseline_rounds", []).append(
            {"check_wall_s": b["check_wall_s"], "check_cpu_s": b["check_cpu_s"]})
        self.prog.phase(f"{res['key']} unconstrained CHECK again: {b['check_wall_s']:.2f}s")
        return b

    # -- one swap configuration ---------------------------------------------------------

    def backend(self, cfg: SwapConfig, run_dir: str) -> backends.SwapBackend:
        if cfg.is_zram:
            return backends.ZramSwap(cfg.algorithm, size=self.opts.swap_size)
        from agentzip_blk.config import parse_config
        comp = {} if cfg.algorithm == "default" else {"algorithm": cfg.algorithm, "level": cfg.level,
                                                      "dictionary": cfg.dictionary}
        if cfg.frame_pages is not None:
            comp["frame_pages"] = cfg.frame_pages
        if cfg.warm is not None:
            comp["warm_algorithm"] = cfg.warm
        device = {"size": self.opts.swap_size, "run_dir": run_dir}
        if cfg.rotational is not None:
            device["rotational"] = cfg.rotational
        if cfg.datapath is not None:
            device["datapath"] = cfg.datapath
        config = parse_config({"compression": comp,
                               "pool": {"swap_out_path": os.path.join(run_dir, "swapfile")},
                               "device": device})
        b = backends.AgentzipSwap(config, run_dir)
        b.name = cfg.name
        return b

    def cycle(self, cfg: SwapConfig, cg: MemoryCgroup, wl: workload.Workload, base: dict) -> dict:
        o = self.opts
        r: dict = {"config": asdict(cfg), "loadavg_1m": _loadavg()}  # a shared machine: say how busy
        others = common.proc_swaps()
        if others:
            r["error"] = "swap already active (" + ", ".join(s["filename"] for s in others) + ")"
            return r
        run_dir = tempfile.mkdtemp(prefix="agentzip-bench-", dir=o.workdir)
        backend = self.backend(cfg, run_dir)
        try:
            self.prog.phase(f"attach {backend.describe()}")
            backend.attach()
            r["describe"] = backend.describe()
            servers = backend.server_pids()
            time.sleep(o.settle / 2)
            before = driver.snapshot(backend, cg)
            sb_before = swap_backed(cg)
            cpu = {"server": tree_cpu(servers), "self": self_cpu(), "wl": tree_cpu(cg.pids()),
                   "host": host_busy()}

            target = int(before["cg_usage"] * o.limit_fraction)
            sq = driver.squeeze(cg, target, o.steps, self.prog, wl)
            r["squeeze"] = {k: sq[k] for k in ("start_usage", "target", "ebusy", "seconds", "error")}
            time.sleep(o.settle)  # writeback settles before the device is asked
            after = driver.snapshot(backend, cg)
            sb_after = swap_backed(cg)
            r["reclaim_cpu_s"] = self_cpu() - cpu["self"]  # the limit writes reclaim in our context
            if sq["error"]:
                raise common.DemoError(f"squeeze failed: {sq['error']}")

            cg.set_limit(None)
            lat = pagewalk.probe(cg.pids(), o.probe_samples, swapped=True, seed=o.seed)
            r["latency"] = latency_summary(lat)
            if not cfg.is_zram and o.cold_wait > 0:
                # The server's CPU while it waits is the recompressor's (counted: its own
                # thread clock, `recompress_cpu_s`) plus this wait's stats scans (not swap
                # work): only the former is charged to the swap CPU below.
                waiting = tree_cpu(servers)
                r["cold"] = wait_cold(backend, cg, o.cold_wait, self.prog)
                r["cold"]["server_cpu_s"] = tree_cpu(servers) - waiting
            wl_cpu0, t = tree_cpu(cg.pids()), time.monotonic()
            wl.send("CHECK")
            check = parse_check(wl.expect("CHECK", o.timeout))
            r["check"] = check
            r["check_wall_s"] = time.monotonic() - t
            r["check_cpu_s"] = tree_cpu(cg.pids()) - wl_cpu0
            touched = driver.snapshot(backend, cg)
            r["server_cpu_s"] = tree_cpu(servers) - cpu["server"]
            if r.get("cold"):
                r["server_cpu_s"] += ((r["cold"]["recompress_cpu_s"] or 0.0)
                                      - r["cold"]["server_cpu_s"])
            r["host_busy_s"] = host_busy() - cpu["host"]
            r["workload_cpu_s"] = tree_cpu(cg.pids()) - cpu["wl"]
            r["verify"] = "ok" if (check["result"] == "ok"
                                   and check["checksum"] == base["check"]["checksum"]) else "FAIL"

            dev_b, dev_a = before["device"], after["device"]
            r["swapped_out"] = (after["pswpout"] - before["pswpout"]) * PAGE
            r["swapped_in"] = (touched["pswpin"] - after["pswpin"]) * PAGE
            r["cg_swap_after"] = after["cg_swap"]
            r["orig_mem"] = dev_a.get("orig_mem", 0)
            r["stored_mem"] = dev_a.get("stored_mem", 0)
            r["stored_mem_empty"] = dev_b.get("stored_mem", 0)
            r["server_rss_before"], r["server_rss_after"] = before["server_rss"], after["server_rss"]
            r["swap_backed_before"], r["swap_backed_after"] = sb_before, sb_after
            r["mem_free_gain"] = after["mem_free"] - before["mem_free"]
            r["device_after"] = {k: v for k, v in dev_a.items() if not isinstance(v, (dict, list))}
            derive(r, cfg, base)
        except Exception as e:  # squeeze, cgroup, device (SetupError, ControlError...): recorded
            r["error"] = f"{type(e).__name__}: {e}"
            r.setdefault("verify", "not run")
        finally:
            with contextlib.suppress(CgroupError, OSError):
                cg.set_limit(None)
            backend.detach()  # swapoff brings back whatever CHECK did not read
            shutil.rmtree(run_dir, ignore_errors=True)
            r["swaps_after_detach"] = [s["filename"] for s in common.proc_swaps()]
        return r


def wait_cold(backend, cg: MemoryCgroup, limit: float, prog) -> dict:
    """Two speeds: wait until the recompressor has packed every warm page past the grace
    period (the backlog at 0, after at least one grace period), and the device then: the
    ratio once pages are cold, and how long the backlog took to drain."""
    prog.phase("waiting for the warm pages to go cold")
    start = time.monotonic()
    first = backend.stats()
    from agentzip_blk.config import PolicyConfig
    grace = PolicyConfig().cold_grace_period  # bench configs keep the default policy
    while True:
        time.sleep(5.0)  # each stats call is a scan of the store: few of them
        st = backend.stats()
        waited = time.monotonic() - start
        if (waited >= grace and st.get("recompress_backlog", 0) == 0) or waited >= limit:
            break
    snap = driver.snapshot(backend, cg)
    dev = snap["device"]
    return {"waited_s": round(waited, 1), "drained": st.get("recompress_backlog", 0) == 0,
            "orig_mem": dev.get("orig_mem", 0), "stored_mem": dev.get("stored_mem", 0),
            "ratio_device": dev["orig_mem"] / dev["stored_mem"] if dev.get("stored_mem") else None,
            "warm_pages": dev.get("warm_pages"), "cold_pages": dev.get("cold_pages"),
            "recompress_cpu_s": (dev.get("recompress_cpu_seconds_total", 0.0)
                                 - first.get("recompress_cpu_seconds_total", 0.0)),
            "server_rss": snap["server_rss"]}


def derive(r: dict, cfg: SwapConfig, base: dict) -> None:
    """The figures the report compares, from the raw ones of one cycle."""
    # what holds the swapped pages now: zram's pool (kernel), or our server's memory growth
    if cfg.is_zram:
        r["device_cost"] = r["stored_mem"] - r["stored_mem_empty"]
    else:
        r["device_cost"] = max(r["server_rss_after"] - r["server_rss_before"],
                               r["stored_mem"] - r["stored_mem_empty"])
    r["ratio_device"] = r["orig_mem"] / r["stored_mem"] if r["stored_mem"] else None
    r["ratio_payload"] = (r["orig_mem"] / (r["stored_mem"] - r["stored_mem_empty"])
                          if r["stored_mem"] > r["stored_mem_empty"] else None)
    # the field report's definition: baseline RSS / physical memory after (what stays resident
    # plus what holds the rest); on swap-backed memory, file pages excluded on both sides
    r["physical_after"] = r["swap_backed_after"] + r["device_cost"]
    r["ratio_field"] = r["swap_backed_before"] / r["physical_after"] if r["physical_after"] else None
    r["baseline_check_wall_s"] = base["check_wall_s"]  # this round's (see Bench.rebaseline)
    r["slowdown"] = r["check_wall_s"] / base["check_wall_s"] if base["check_wall_s"] else None
    # CPU spent on swapping: reclaim in the limit writer (zram compresses there), the server
    # (agentzip compresses and decompresses there), and what CHECK cost the workload on top
    # of the same pass unconstrained (zram decompresses in the faulting task)
    extra = max(r["check_cpu_s"] - base["check_cpu_s"], 0.0)
    r["swap_cpu_s"] = r["reclaim_cpu_s"] + r["server_cpu_s"] + extra
    moved = (r["swapped_out"] + r["swapped_in"]) / (1 << 30)
    r["swap_cpu_s_per_gib"] = r["swap_cpu_s"] / moved if moved else None
    r["cpu_overhead"] = r["swap_cpu_s"] / base["build_cpu_s"] if base["build_cpu_s"] else None
    lat, blat = r.get("latency", {}), base.get("latency", {})
    if lat.get("n") and blat.get("n"):
        r["p99_overhead_us"] = lat["p99_us"] - blat["p99_us"]
        r["p50_overhead_us"] = lat["p50_us"] - blat["p50_us"]


def _one_line(name: str, r: dict) -> str:
    if r.get("error"):
        return f"{name}: ERROR {r['error']}"
    return (f"{name}: out {common.fmt(r['swapped_out'])}, device {r['ratio_device'] or 0:.2f}x, "
            f"field {r['ratio_field'] or 0:.2f}x (physical after {common.fmt(r['physical_after'])}), "
            f"swap CPU {r['swap_cpu_s']:.1f}s, swap-in p50/p99 {r['latency'].get('p50_us', 0):.0f}/"
            f"{r['latency'].get('p99_us', 0):.0f}us, CHECK {r['check_wall_s']:.2f}s "
            f"(x{r['slowdown'] or 0:.1f}), verify {r['verify']}")


def _loadavg() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _safe(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


# ---------------------------------------------------------------------------------------
# the machine


def _version(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def machine() -> dict:
    mi = procfs.meminfo()
    cpu = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    with open("/proc/sys/vm/page-cluster") as f:
        page_cluster = int(f.read())
    pandas = _safe(lambda: __import__("pandas").__version__)
    find_chromium = module("browser").find_chromium
    return {"kernel": platform.release(), "cpu": cpu, "nproc": os.cpu_count(),
            "mem_total": mi.get("MemTotal"), "python": platform.python_version(), "pandas": pandas,
            "node": _version(["node", "--version"]),
            "chromium": _version([find_chromium() or "chromium", "--version"]),
            "nbdkit": _version(["nbdkit", "--version"]), "zswap": facts.zswap_enabled(),
            "page_cluster": page_cluster, "loadavg_1m": _loadavg(),
            "cgroup": _safe(lambda: MemoryCgroup.own().version)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="A,B,C,D", help="keys to run (default A,B,C,D)")
    ap.add_argument("--cold-wait", type=float, default=120.0,
                    help="agentzip: after the fault probe, wait up to this many seconds for the "
                         "recompress backlog to drain, then measure the cold ratio (0: skip)")
    ap.add_argument("--configs", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run every configuration N times per workload, in turns (error bars; default 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mb-scale", type=float, default=1.0, help="scale every workload's size (tests)")
    ap.add_argument("--limit-fraction", type=float, default=0.1,
                    help="squeeze each workload to this fraction of its cgroup usage (default 0.1)")
    ap.add_argument("--probe-samples", type=int, default=3000,
                    help="single-page faults timed per configuration (3000: p99.9 is the 3rd worst)")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "bench.json"))
    ap.add_argument("--chart", default=os.path.join(REPO, "docs", "bench.png"))
    ap.add_argument("--md", default=os.path.join(REPO, "BENCHMARKS.md"))
    ap.add_argument("--no-md", action="store_true", help="do not touch BENCHMARKS.md or the chart")
    ap.add_argument("--from-json", metavar="PATH", help="no run: regenerate BENCHMARKS.md and the chart")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")

    if a.from_json:
        with open(a.from_json) as f:
            doc = json.load(f)
        swap_report.publish(doc, None if a.no_md else a.md, None if a.no_md else a.chart)
        return 0
    if os.geteuid() != 0:
        print("bench: attaches swap and creates cgroups: run it as root", file=sys.stderr)
        return 2

    dicts = dictionaries_supported()
    configs = swap_configs(dicts)
    if a.configs:
        want = [c.strip() for c in a.configs.split(",") if c.strip()]
        unknown = set(want) - {c.name for c in configs}
        if unknown:
            print(f"bench: unknown configurations {sorted(unknown)} (known: "
                  f"{', '.join(c.name for c in configs)})", file=sys.stderr)
            return 2
        configs = [c for c in configs if c.name in want]
    specs_all = workloads(sys.executable)
    specs = [specs_all[k.strip()] for k in a.workloads.split(",") if k.strip()]
    opts = Options(seed=a.seed, limit_fraction=a.limit_fraction, probe_samples=a.probe_samples,
                   mb_scale=a.mb_scale, repeat=a.repeat, cold_wait=a.cold_wait)
    prog = driver.Progress(sys.stderr)
    t0 = time.monotonic()
    doc = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
           "command": command_line("swap", argv), "machine": machine(), "options": asdict(opts),
           "dictionaries": dicts, "configs": [asdict(c) for c in configs],
           "rebaseline_every_round": a.repeat > 1}
    bench = Bench(specs, configs, opts, prog)
    try:
        with driver.teardown_on_signals():  # SIGTERM/SIGHUP: the finally blocks still detach
            doc["workloads"] = bench.run()
    except KeyboardInterrupt:
        print("bench: interrupted (workloads stopped, cgroups removed, swap detached)", file=sys.stderr)
        return 130
    doc["wall_s"] = time.monotonic() - t0
    doc["lock_wait_s"] = sum(bench.lock_waits)  # others' swap runs we waited for
    write_json(a.out, doc, default=str, newline=True)
    swap_report.publish(doc, None if a.no_md else a.md, None if a.no_md else a.chart)
    prog.phase(f"done in {doc['wall_s'] / 60:.1f} min; wrote {a.out}"
               + ("" if a.no_md else f", {a.md}, {a.chart}"))
    return 0 if all(w.get("ok") for w in doc["workloads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
