#!/usr/bin/env python3
"""Benchmark the tuner: resident memory and wall time of a scoped agent workload.

The workload (this file with ``--workload``) builds several hundred MB of agent transcripts
(bench/workloads/agent_json.py's heap: raw JSON, parsed dicts, token arrays) that it then
leaves alone -- the *cold* data of an agent that has moved on -- and works for a fixed number
of iterations on a bounded *hot* set: each iteration makes a new model round, serialises and
parses it, keeps the last ``--hot-rounds`` of them, and every ``--revisit`` iterations looks
one old session up again (an agent re-reading an old transcript). After the timed work it
re-reads everything and compares the checksum taken at build time (untimed).

Two runs, each in a fresh memory cgroup below ours:

- **unconstrained**: no device, no tuner;
- **tuned**: the device attached (``attach.attached``) and ``agentzip-blk tune`` running as a
  subprocess with a scope matching the cgroup (policy from ``--grace``/``--interval`` etc.).

Reported: wall time (spawn to DONE, and the work phase alone), the workload's RSS over the
work phase (mean, and the mean of its last quarter = steady state), cgroup usage, swap, the
device's orig/stored, the tuner's decisions. The target of issue 5: steady-state RSS cut by at
least half, wall time within 10 % of the unconstrained run. Writes its section of
BENCHMARKS.md between ``<!-- bench_tuner:begin -->`` and ``<!-- bench_tuner:end -->``.

Run as root, alone on the swap lock:

    flock /tmp/agentzip-swap.lock .venv/bin/python -m bench tuner
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

if __package__ in (None, ""):  # run as a script: this bench's own child process (--workload)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentzip_blk import procfs  # noqa: E402
from agentzip_blk.host import attach  # noqa: E402
from bench.harness.host import joiner  # noqa: E402
from bench.harness.md import write_section  # noqa: E402
from bench.harness.results import REPO as ROOT  # noqa: E402
from bench.harness.results import write_json  # noqa: E402
from bench.harness.workloads import module  # noqa: E402

BEGIN, END = "<!-- bench_tuner:begin -->", "<!-- bench_tuner:end -->"
MiB = 1 << 20


# --- the workload (child process) ---------------------------------------------------------

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workload(a) -> int:
    agent_json = module("agent_json")

    gc.disable()  # as agent_json: nothing cyclic, and a full collection would walk the cold heap
    t0 = time.monotonic()
    heap = agent_json.Heap(a.seed, a.cold_mb)
    heap.build()
    want = heap.checksum()
    gc.freeze()
    build_s = time.monotonic() - t0
    print(f"READY {rss()} {build_s:.3f} {len(heap.sessions)}", flush=True)

    gen = agent_json.Gen(a.seed + 1)
    rng = random.Random(a.seed + 2)
    recent: deque = deque(maxlen=a.hot_rounds)
    t1 = time.monotonic()
    revisits = 0
    acc = 0
    for i in range(a.iterations):
        rd = gen.round(i // 8, i % 8, "agent-model-2")
        raw = json.dumps(rd)
        recent.append((raw, json.loads(raw)))
        if i % 64 == 0:  # re-read the working context, as an agent building its next prompt
            acc += sum(len(r) for r, _ in recent)
        if a.revisit and i % a.revisit == a.revisit - 1:
            sess = heap.sessions[rng.randrange(len(heap.sessions))]
            acc += len(json.dumps(sess["messages"]))
            revisits += 1
    work_s = time.monotonic() - t1
    print(f"DONE {work_s:.3f} {revisits} {acc % 997}", flush=True)
    got = heap.checksum()
    print(f"VERIFY {'ok' if got == want else 'FAIL'} {got}", flush=True)
    return 0 if got == want else 1


# --- the driver -------------------------------------------------------------------------------

def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Child:
    def __init__(self, cg, a):
        argv = [sys.executable, os.path.abspath(__file__), "--workload", "--cold-mb", str(a.cold_mb),
                "--iterations", str(a.iterations), "--hot-rounds", str(a.hot_rounds),
                "--revisit", str(a.revisit), "--seed", str(a.seed)]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     preexec_fn=joiner(cg), env=dict(os.environ, PYTHONHASHSEED="0"))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.split()))
        self.lines.put((time.monotonic(), None))

    def expect(self, word, timeout, tick=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, parts = self.lines.get(timeout=0.5)
            except queue.Empty:
                if tick:
                    tick()
                continue
            if parts is None:
                raise RuntimeError(f"workload exited ({self.proc.wait()}) before {word}")
            if parts[0] == word:
                return t, parts
            if tick:
                tick()
        raise RuntimeError(f"no {word} within {timeout}s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by pid
        self.proc.wait()


def one_run(kind: str, a, cfg_path: str, tmp: str) -> dict:
    from agentzip_blk.cgroups.fs import MemoryCgroup
    from agentzip_blk.config import load_config
    from agentzip_blk.datapath import control

    name = f"agent-sandbox-bench-{os.getpid()}-{kind}.slice"
    run_dir = os.path.join(tmp, f"run-{kind}")
    res: dict = {"kind": kind}
    cg = MemoryCgroup.create(name)
    att = tuner = child = None
    samples: list[tuple[float, int, int, int]] = []  # (t, rss, usage, swap)
    try:
        if kind == "tuned":
            cfg = load_config(cfg_path)
            att = attach.attached(cfg, run_dir, size=a.device_size << 20)
            state = att.__enter__()
            tlog = open(os.path.join(tmp, "tuner.log"), "w")
            targv = [sys.executable, "-m", "agentzip_blk.cli", "--config", cfg_path, "--run-dir", run_dir,
                     "tune", "--interval", str(a.interval), "--floor", f"{a.floor}M",
                     "--max-probe", str(a.max_probe)]
            tuner = subprocess.Popen(targv, stdout=tlog, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=ROOT))
        child = Child(cg, a)

        def sample():
            samples.append((time.monotonic(), _status_kb(child.proc.pid, "VmRSS"), cg.usage(),
                            cg.swap_usage()))

        t_ready, ready = child.expect("READY", 600, sample)
        res["build_s"] = float(ready[2])
        res["rss_ready"] = int(ready[1])
        res["sessions"] = int(ready[3])
        work_start = len(samples)
        stop = threading.Event()

        def sampler():
            while not stop.is_set():
                sample()
                stop.wait(0.5)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        t_done, done = child.expect("DONE", 3600)
        stop.set()
        th.join()
        res["wall_s"] = t_done - child.t0
        res["work_s"] = float(done[1])
        res["revisits"] = int(done[2])
        work = samples[work_start:]
        rss_series = [s[1] for s in work]
        tail = rss_series[len(rss_series) * 3 // 4:] or rss_series
        res["rss_mean"] = int(statistics.mean(rss_series)) if rss_series else 0
        res["rss_steady"] = int(statistics.mean(tail)) if tail else 0
        res["rss_end"] = rss_series[-1] if rss_series else 0
        res["usage_steady"] = int(statistics.mean([s[2] for s in work[len(work) * 3 // 4:]] or [0]))
        res["swap_end"] = work[-1][3] if work else 0
        res["samples"] = [(round(t - child.t0, 2), r, u, s) for t, r, u, s in samples[::4]]
        if kind == "tuned":
            st = control.request(state.control_socket, "stats")
            res["device"] = {k: st.get(k) for k in ("orig_mem", "stored_mem", "compressed_bytes",
                                                    "pages", "ratio", "pingpong", "reads", "writes")}
        _, v = child.expect("VERIFY", 900)
        res["verify"] = v[1]
    finally:
        if child is not None:
            child.stop()
        if tuner is not None:
            tuner.send_signal(signal.SIGTERM)  # our own child: it restores what it wrote
            try:
                tuner.wait(60)
            except subprocess.TimeoutExpired:
                tuner.kill()
                tuner.wait()
            tlog.close()
            res["tuner_log"] = _tuner_summary(os.path.join(tmp, "tuner.log"))
        try:
            cg.set_limit(None)
        except Exception:
            pass
        cg.remove()
        if att is not None:
            att.__exit__(None, None, None)
        res["swaps_after"] = [s.filename for s in procfs.swaps()]
    return res


def _tuner_summary(path: str) -> dict:
    counts: dict[str, int] = {}
    lines = open(path).read().splitlines()
    for line in lines:
        m = re.search(r" tune /\S*: (\w+), usage ", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return {"decisions": counts, "first": lines[:3], "last": lines[-4:]}


def fmt_mib(n) -> str:
    return f"{n / MiB:.0f}"


def markdown(r: dict, a, cmd: str) -> str:
    from agentzip_blk.cgroups.backends import open_backend

    u, t = r["unconstrained"], r["tuned"]
    mi = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            mi[k] = int(v.split()[0])
    cut = 1 - t["rss_steady"] / u["rss_steady"] if u["rss_steady"] else 0.0
    cut_mean = 1 - t["rss_mean"] / u["rss_mean"] if u["rss_mean"] else 0.0
    slow_work = t["work_s"] / u["work_s"] - 1
    slow_wall = t["wall_s"] / u["wall_s"] - 1
    dev = t.get("device", {})
    ok_mem = cut >= 0.5
    ok_time = slow_wall <= 0.10
    dec = t.get("tuner_log", {}).get("decisions", {})
    out = [
        "## Tuner: resident memory and wall time of a scoped agent workload",
        "",
        f"Generated by `bench/tuner.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"machine: Linux {os.uname().release}, {os.cpu_count()} CPUs, MemTotal {mi['MemTotal'] / 2**20:.1f} GiB; "
        f"memory cgroup {open_backend().kind}. Command:",
        "",
        f"    {cmd}",
        "",
        f"Workload: `bench/tuner.py --workload`: {a.cold_mb} MiB of agent transcripts "
        f"(agent_json heap, seed {a.seed}) built and then left cold, then {a.iterations} iterations "
        f"on a hot set of the last {a.hot_rounds} rounds, one old session re-read every {a.revisit} "
        f"iterations; data verified after the timed part. Tuned run: device attached, "
        f"`agentzip-blk tune --interval {a.interval} --floor {a.floor}M --max-probe {a.max_probe}` "
        f"(mode reclaim, pressure target {a.pressure_target}%, cold_grace_period {a.grace}s, "
        f"warm_threshold_ms {int(a.hold * 1000)}), started with the workload. One run each.",
        "",
        "| run | wall s | work s | RSS after build MiB | RSS mean, work MiB | RSS steady MiB | cgroup usage steady MiB | swap at end MiB | verify |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, x in (("unconstrained", u), ("tuned", t)):
        out.append(f"| {name} | {x['wall_s']:.1f} | {x['work_s']:.1f} | {fmt_mib(x['rss_ready'])} | "
                   f"{fmt_mib(x['rss_mean'])} | {fmt_mib(x['rss_steady'])} | {fmt_mib(x['usage_steady'])} | "
                   f"{fmt_mib(x['swap_end'])} | {x['verify']} |")
    out += [
        "",
        f"- **Resident memory** (steady state = mean RSS over the last quarter of the work phase): "
        f"cut by **{cut:.0%}** ({'meets' if ok_mem else 'MISSES'} the target of at least 50%); "
        f"over the whole work phase, including the ramp-down, by {cut_mean:.0%}.",
        f"- **Wall time** (spawn to the end of the work): **{slow_wall:+.1%}** "
        f"({'meets' if ok_time else 'MISSES'} the target of at most +10%); the work phase alone "
        f"{slow_work:+.1%}.",
        f"- Device at the end of the work: orig {fmt_mib(dev.get('orig_mem', 0))} MiB, stored "
        f"{fmt_mib(dev.get('stored_mem', 0))} MiB (ratio {dev.get('ratio', 0):.2f}), "
        f"{dev.get('reads', 0)} reads, ping-pong {dev.get('pingpong', 0)}. "
        f"Tuner decisions: {', '.join(f'{k} {v}' for k, v in sorted(dec.items())) or '-'}; "
        f"old sessions re-read: {t['revisits']}.",
        "- *RSS* is the workload's VmRSS; *cgroup usage* (v1 memory.usage_in_bytes) also counts "
        "page cache and the swap cache (pages already written to the device but not yet freed).",
    ]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cold-mb", type=int, default=400)
    ap.add_argument("--iterations", type=int, default=150_000)
    ap.add_argument("--hot-rounds", type=int, default=1500)
    ap.add_argument("--revisit", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--floor", type=int, default=32, help="MiB")
    ap.add_argument("--max-probe", type=float, default=0.1)
    ap.add_argument("--pressure-target", type=float, default=1.0,
                    help="percent; on v1 the estimate counts every major fault, cold re-reads too")
    ap.add_argument("--grace", type=float, default=30.0, help="cold_grace_period, seconds")
    ap.add_argument("--hold", type=float, default=10.0, help="warm_threshold, seconds")
    ap.add_argument("--device-size", type=int, default=2048, help="MiB")
    ap.add_argument("--markdown", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--json", default=os.path.join(ROOT, "results", "bench_tuner.json"))
    ap.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    a = ap.parse_args()
    if a.workload:
        return workload(a)

    sys.path.insert(0, ROOT)
    if os.geteuid() != 0:
        sys.exit("bench_tuner: run as root (cgroups, swap)")
    if procfs.swaps():
        sys.exit("bench_tuner: another swap area is active; run alone under flock /tmp/agentzip-swap.lock")
    tmp = tempfile.mkdtemp(prefix="bench-tuner-")
    cfg_path = os.path.join(tmp, "config.yaml")
    with open(cfg_path, "w") as f:
        f.write(f"pool:\n  swap_out_path: {tmp}/disk-tier\n"
                f"policy:\n  cold_grace_period: {a.grace}s\n  warm_threshold_ms: {int(a.hold * 1000)}\n"
                f"  pressure_target: {a.pressure_target}\n"
                f"scopes:\n  - cgroup: agent-sandbox-bench-*.slice\n    enabled: true\n")
    cmd = "flock /tmp/agentzip-swap.lock .venv/bin/python -m bench tuner" + \
        "".join(f" {x}" for x in sys.argv[1:])
    results = {}
    for kind in ("unconstrained", "tuned"):
        print(f"bench_tuner: {kind} run ...", file=sys.stderr, flush=True)
        results[kind] = one_run(kind, a, cfg_path, tmp)
        r = results[kind]
        print(f"bench_tuner: {kind}: wall {r['wall_s']:.1f}s work {r['work_s']:.1f}s rss steady "
              f"{fmt_mib(r['rss_steady'])} MiB mean {fmt_mib(r['rss_mean'])} MiB verify {r['verify']}",
              file=sys.stderr, flush=True)
    results["args"] = vars(a)
    text = markdown(results, a, cmd)
    print(text)
    if not a.no_write:
        write_json(a.json, results)
        write_section(a.markdown, "bench_tuner", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
