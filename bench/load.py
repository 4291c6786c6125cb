#!/usr/bin/env python3
"""Sustained swap load: many sandboxes swapping to agentzip-blk at once, for minutes.

    .venv/bin/python -m bench load                       # 8 workloads, 240 s
    .venv/bin/python -m bench load --workers 4 --duration 60 --no-md

Starts the device (small pool over a disk tier, so both tiers work), creates one scoped
memory cgroup per workload below our own (agent-sandbox-N.slice, matching the default
scope glob), starts a workload in each, and squeezes each cgroup to a fraction of its
memory. Each workload keeps an agent-like heap of 64 KiB chunks with a crc32 per chunk
and, until told to stop, picks chunks (80% from a hot fifth, 20% from anywhere), checks
the crc (zero data lost, or it says so) and changes a few bytes: its cold chunks cycle
through swap all the time. One operation = check + change one chunk; its latency is what
a sandbox feels.

Measured: operations/s and latency percentiles (all workloads merged), swap-out and
swap-in MiB/s (/proc/vmstat), CPU of the server, nbdfuse, the workloads and the machine,
and the server's RSS over time. Written to results/load.json and to BENCHMARKS.md between
`<!-- load:begin -->` and `<!-- load:end -->`. Holds /tmp/agentzip-swap.lock throughout;
refuses to run while any other swap area is active.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib

if __package__ in (None, ""):  # run as a script: this bench's own child process (--worker)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentzip_blk import procfs  # noqa: E402
from agentzip_blk.host import attach, runstate  # noqa: E402
from bench.harness.host import joiner  # noqa: E402
from bench.harness.lock import swap_lock  # noqa: E402
from bench.harness.md import replace_block  # noqa: E402
from bench.harness.results import REPO, write_json  # noqa: E402

BEGIN, END = "<!-- load:begin -->", "<!-- load:end -->"
CHUNK = 64 * 1024
MiB = 1 << 20

# ---------------------------------------------------------------------------------------
# the workload (runs inside a cgroup; stdlib only, to keep its own memory small)

_WORDS = ("tool_call arguments result assistant user content error path file function "
          "return value json status 200 OK null true false def class import self list "
          "dict str int float request response model step plan next done").split()


def _chunk(rnd: random.Random, i: int) -> bytearray:
    if i % 10 == 9:  # a tenth incompressible (tokens, embeddings, compressed blobs)
        return bytearray(rnd.randbytes(CHUNK))
    text = " ".join(rnd.choice(_WORDS) for _ in range(CHUNK // 5)).encode()
    head = f'{{"chunk": {i}, "text": "'.encode()
    return bytearray((head + text)[:CHUNK].ljust(CHUNK, b" "))


def worker(args) -> int:
    rnd = random.Random(args.seed)
    n = max(16, args.mb * MiB // CHUNK)
    chunks = [_chunk(rnd, i) for i in range(n)]
    crcs = [zlib.crc32(c) for c in chunks]
    hot = max(1, n // 5)
    lat = array.array("f")
    failures = ops = 0
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print("READY", flush=True)
    t_start = time.monotonic()
    while not stop.is_set():
        i = rnd.randrange(hot) if rnd.random() < 0.8 else rnd.randrange(n)
        t0 = time.perf_counter()
        c = chunks[i]
        if zlib.crc32(c) != crcs[i]:
            failures += 1
        off = rnd.randrange(CHUNK - 256)
        c[off:off + 256] = rnd.randbytes(256) if i % 10 == 9 else rnd.choice(_WORDS).encode().ljust(256)
        crcs[i] = zlib.crc32(c)
        lat.append(time.perf_counter() - t0)
        ops += 1
    elapsed = time.monotonic() - t_start
    final = sum(zlib.crc32(c) != crcs[i] for i, c in enumerate(chunks))
    with open(args.latencies, "wb") as f:
        lat.tofile(f)
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    print("RESULT " + json.dumps({"ops": ops, "seconds": elapsed, "verify_failures": failures,
                                  "final_failures": final, "chunks": n,
                                  "cpu_s": ru.ru_utime + ru.ru_stime,
                                  "majflt": ru.ru_majflt}), flush=True)
    return 0


# ---------------------------------------------------------------------------------------
# the driver


def _proc_cpu(pid: int) -> float:
    """utime+stime of a process, seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def _percentiles(lat_s, ps=(50, 90, 99, 99.9)) -> dict:
    import numpy as np

    if not len(lat_s):
        return {}
    a = np.asarray(lat_s, dtype=np.float64) * 1e3  # ms
    out = {f"p{p:g}": round(float(np.percentile(a, p)), 3) for p in ps}
    out["max"] = round(float(a.max()), 3)
    out["mean"] = round(float(a.mean()), 3)
    return out


class Workload:
    def __init__(self, cg, index: int, mb: int, seed: int, lat_path: str) -> None:
        self.cg, self.index, self.lat_path = cg, index, lat_path
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--mb", str(mb),
             "--seed", str(seed), "--latencies", lat_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=joiner(cg))

    def expect(self, word: str, timeout: float) -> str:
        result: list[str] = []

        def read():
            for line in self.proc.stdout:
                if line.startswith(word):
                    result.append(line.strip())
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not result:
            raise RuntimeError(f"workload {self.index}: no {word} (exit {self.proc.poll()}, "
                               f"OOM kills {self.cg.oom_kills()})")
        return result[0]

    def stop(self) -> dict:
        try:
            self.proc.stdin.write("STOP\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"workload {self.index} died (exit {self.proc.wait()}, "
                               f"OOM kills {self.cg.oom_kills()})") from None
        line = self.expect("RESULT", 600)
        self.proc.wait(60)
        return json.loads(line.split(" ", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its pid
            self.proc.wait()


def run(args) -> dict:
    sys.path.insert(0, REPO)
    from agentzip_blk.cgroups.fs import LimitBusy, MemoryCgroup
    from agentzip_blk.config import parse_config
    from agentzip_blk.datapath import control

    tmp = tempfile.mkdtemp(prefix="azload-", dir="/tmp")
    run_dir = os.path.join(tmp, "run")
    cfg = parse_config({
        "pool": {"max_size": args.pool, "reclaim_threshold": 80,
                 "swap_out_path": os.path.join(tmp, "disk-tier")},
        "policy": {"cold_grace_period": "5s"},
        "compression": {"warm_algorithm": args.warm},
        "device": {"rotational": args.rotational, "datapath": args.datapath,
                   "request_priority": args.request_priority},
    })
    result: dict = {"config": {"workers": args.workers, "duration_s": args.duration,
                               "heap_mb": args.mb, "limit_fraction": args.limit_fraction,
                               "pool": args.pool, "device_size": args.size,
                               "rotational": args.rotational, "warm_algorithm": args.warm,
                               "datapath": args.datapath,
                               "request_priority": args.request_priority}}
    cgroups: list = []
    workloads: list[Workload] = []
    try:
        others = [a.filename for a in procfs.swaps()]
        if others:
            raise SystemExit(f"load: other swap areas are active ({', '.join(others)}); "
                             "the device must be the only swap")
        with attach.attached(cfg, run_dir, priority=10, size=args.size) as state:
            try:
                pids = {"nbdkit": state.nbdkit_pid, "nbdfuse": state.nbdfuse_pid}
                for i in range(args.workers):
                    cg = MemoryCgroup.create(f"agent-sandbox-load{i}.slice")
                    cgroups.append(cg)
                    cg.allow_swap()
                    cg.set_swappiness(100)
                    workloads.append(Workload(cg, i, args.mb, 1000 + i, os.path.join(tmp, f"lat{i}")))
                for w in workloads:
                    w.expect("READY", 300)
                log(f"{args.workers} workloads ready ({args.mb} MiB heaps); squeezing each "
                    f"cgroup to {args.limit_fraction:.0%} of its usage")
                for cg in cgroups:  # like the tuner: gradually, never below what fits
                    usage = cg.usage()
                    for step in range(1, 5):
                        target = int(usage * (1 - (1 - args.limit_fraction) * step / 4))
                        for _ in range(20):
                            try:
                                cg.set_limit(target)
                                break
                            except LimitBusy:
                                time.sleep(0.2)
                series = sample(args, state, pids, cgroups, workloads, control)
                results = [w.stop() for w in workloads]
                oom = sum(cg.oom_kills() for cg in cgroups)
                final_stats = control.request(state.control_socket, "stats")
            finally:
                # Before the device detaches: swapoff charges every swapped page back to its
                # cgroup, and a cgroup still at its limit OOMs, so swapoff fails with ENOMEM
                # (seen when the workloads had died) and the swap area stays attached.
                release(workloads, cgroups)
        result.update(summarize(args, series, results, workloads, oom, final_stats))
    finally:
        release(workloads, cgroups)
        if runstate.RunState.load(run_dir) is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # never delete the state of a device that is still attached
            log(f"the device is still attached; its state is in {run_dir}: "
                f"agentzip-blk --run-dir {run_dir} down")
    return result


def release(workloads: list, cgroups: list) -> None:
    """Kill our workloads and remove their cgroups (limits lifted first); idempotent."""
    for w in workloads:
        w.kill()
    while cgroups:
        cg = cgroups.pop()
        try:
            cg.set_limit(None)
            cg.remove()
        except Exception as exc:  # noqa: BLE001 - report, keep cleaning
            log(f"cannot remove {cg.path}: {exc}")


def log(msg: str) -> None:
    print(f"load: {msg}", file=sys.stderr, flush=True)


def sample(args, state, pids, cgroups, workloads, control) -> list[dict]:
    series = []
    t0 = time.monotonic()
    vm0, cpu0 = _vmstat(), _cpu_times()
    prev = {"t": 0.0, "vm": vm0, "cpu": cpu0,
            "srv": _proc_cpu(pids["nbdkit"]), "fuse": _proc_cpu(pids["nbdfuse"] or 0)}
    while True:
        time.sleep(args.interval)
        t = time.monotonic() - t0
        vm, cpu = _vmstat(), _cpu_times()
        srv, fuse = _proc_cpu(pids["nbdkit"]), _proc_cpu(pids["nbdfuse"] or 0)
        st = control.request(state.control_socket, "stats")
        dt = t - prev["t"]
        point = {
            "t": round(t, 1),
            "swap_out_mib_s": (vm["pswpout"] - prev["vm"]["pswpout"]) * 4096 / MiB / dt,
            "swap_in_mib_s": (vm["pswpin"] - prev["vm"]["pswpin"]) * 4096 / MiB / dt,
            "server_cpu": (srv - prev["srv"]) / dt,
            "nbdfuse_cpu": (fuse - prev["fuse"]) / dt,
            "machine_cpu": (cpu[0] - prev["cpu"][0]) / max(1, cpu[1] - prev["cpu"][1]),
            "server_rss": _rss(pids["nbdkit"]),
            "nbdfuse_rss": _rss(pids["nbdfuse"] or 0),
            "orig_mem": st["orig_mem"], "stored_mem": st["stored_mem"],
            "pool_bytes": st["pool_bytes"], "disk_pages": st["tiers"]["disk"]["pages"],
            "demotions": st["demotions"], "promotions": st["promotions"],
            "cg_swap": sum(cg.swap_usage() for cg in cgroups),
            "alive": sum(w.proc.poll() is None for w in workloads),
        }
        series.append(point)
        prev = {"t": t, "vm": vm, "cpu": cpu, "srv": srv, "fuse": fuse}
        if len(series) % max(1, int(30 / args.interval)) == 0:
            log(f"t={t:.0f}s out {point['swap_out_mib_s']:.1f} MiB/s in "
                f"{point['swap_in_mib_s']:.1f} MiB/s server cpu {point['server_cpu']:.0%} "
                f"rss {point['server_rss'] / MiB:.0f} MiB alive {point['alive']}")
        if point["alive"] < len(workloads):
            log("a workload died: stopping early")
            break
        if t >= args.duration:
            break
    return series


def summarize(args, series, results, workloads, oom, final_stats) -> dict:
    import numpy as np

    lat = []
    for w in workloads:
        with open(w.lat_path, "rb") as f:
            a = array.array("f")
            a.frombytes(f.read())
            lat.append(np.frombuffer(a, dtype=np.float32))
    lat_all = np.concatenate(lat) if lat else np.zeros(0)
    warm = [p for p in series if p["t"] > args.warmup] or series
    mean = lambda key: round(sum(p[key] for p in warm) / len(warm), 3)  # noqa: E731
    ops = sum(r["ops"] for r in results)
    secs = max(r["seconds"] for r in results)
    return {
        "ok": oom == 0 and all(r["verify_failures"] == 0 and r["final_failures"] == 0
                               for r in results) and final_stats["errors"] == 0,
        "seconds": round(series[-1]["t"], 1) if series else 0,
        "ops": ops, "ops_per_s": round(ops / secs, 1) if secs else 0,
        "latency_ms": _percentiles(lat_all),
        "latency_ms_per_workload_p99": [round(float(np.percentile(a, 99)) * 1e3, 2)
                                        for a in lat if len(a)],
        "verify_failures": sum(r["verify_failures"] + r["final_failures"] for r in results),
        "oom_kills": oom,
        "workload_cpu_s": round(sum(r["cpu_s"] for r in results), 1),
        "workload_majflt": sum(r["majflt"] for r in results),
        "steady": {k: mean(k) for k in ("swap_out_mib_s", "swap_in_mib_s", "server_cpu",
                                        "nbdfuse_cpu", "machine_cpu")},
        "server_rss": {"min": min(p["server_rss"] for p in series),
                       "max": max(p["server_rss"] for p in series),
                       "end": series[-1]["server_rss"]},
        "store": {k: final_stats[k] for k in ("orig_mem", "stored_mem", "ratio", "pages",
                                              "demotions", "promotions", "direct_to_disk",
                                              "bytes_read", "bytes_written", "errors",
                                              "enospc")},
        "series": series,
    }


def markdown(res: dict, argv: list[str]) -> str:
    import platform

    c = res["config"]
    s, lat = res["steady"], res["latency_ms"]
    mib = lambda n: f"{n / MiB:.0f}"  # noqa: E731
    lines = [
        BEGIN,
        "## Sustained load: many sandboxes swapping at once",
        "",
        f"Generated by `bench/load.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"machine: Linux {platform.release()}, {os.cpu_count()} CPUs. Command:",
        "",
        "    .venv/bin/python -m bench load " + " ".join(argv),
        "",
        f"{c['workers']} workloads, each in its own memory cgroup (`agent-sandbox-loadN.slice`), "
        f"each an agent-like heap of {c['heap_mb']} MiB (64 KiB chunks, 9/10 text, 1/10 random) "
        f"squeezed to {c['limit_fraction']:.0%} of its usage, running for {res['seconds']:.0f} s. "
        "An operation checks one chunk's crc32 and changes 256 bytes of it; 80% of operations "
        "go to a hot fifth of the chunks, 20% anywhere, so cold chunks keep cycling through "
        f"swap. Device: pool {mib(c['pool'])} MiB over a disk tier, "
        f"{mib(c['device_size'])} MiB device. Steady-state figures exclude the first "
        f"{res.get('warmup', 30):g} s.",
        "",
        "| ops/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | swap-out MiB/s | swap-in MiB/s "
        "| server CPU | nbdfuse CPU | machine CPU | server RSS min/max MiB | verify failures "
        "| OOM kills |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {res['ops_per_s']:.0f} | {lat.get('p50', 0):.2f} | {lat.get('p90', 0):.2f} | "
        f"{lat.get('p99', 0):.2f} | {lat.get('p99.9', 0):.2f} | {lat.get('max', 0):.0f} | "
        f"{s['swap_out_mib_s']:.1f} | {s['swap_in_mib_s']:.1f} | {s['server_cpu']:.0%} | "
        f"{s['nbdfuse_cpu']:.0%} | {s['machine_cpu']:.0%} | "
        f"{mib(res['server_rss']['min'])}/{mib(res['server_rss']['max'])} | "
        f"{res['verify_failures']} | {res['oom_kills']} |",
        "",
        "Over time (one row per ~30 s; rates averaged since the previous row's sample):",
        "",
        "| t s | swap-out MiB/s | swap-in MiB/s | server CPU | server RSS MiB | orig MiB "
        "| stored MiB | pool MiB | disk-tier pages | cgroups' swap MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    series = res["series"]
    step = max(1, len(series) // max(1, int(res["seconds"] // 30)))
    for i in range(step - 1, len(series), step):
        window = series[i - step + 1:i + 1]
        p = series[i]
        avg = lambda k: sum(q[k] for q in window) / len(window)  # noqa: E731
        lines.append(
            f"| {p['t']:.0f} | {avg('swap_out_mib_s'):.1f} | {avg('swap_in_mib_s'):.1f} | "
            f"{avg('server_cpu'):.0%} | {mib(p['server_rss'])} | {mib(p['orig_mem'])} | "
            f"{mib(p['stored_mem'])} | {mib(p['pool_bytes'])} | {p['disk_pages']} | "
            f"{mib(p['cg_swap'])} |")
    st = res["store"]
    lines += [
        "",
        f"- Workloads: {res['ops']} operations, {res['verify_failures']} crc mismatches "
        f"(zero data lost: {'yes' if res['verify_failures'] == 0 else 'NO'}), "
        f"{res['workload_majflt']} major faults, {res['workload_cpu_s']:.0f} CPU-s; "
        f"per-workload p99 ms: {', '.join(f'{x:.1f}' for x in res['latency_ms_per_workload_p99'])}.",
        f"- Server: {st['bytes_written'] / MiB:.0f} MiB written, {st['bytes_read'] / MiB:.0f} MiB "
        f"read; {st['demotions']} demotions, {st['promotions']} promotions, "
        f"{st['direct_to_disk']} pages straight to disk; errors {st['errors']}, ENOSPC "
        f"{st['enospc']}; at the end {st['orig_mem'] / MiB:.0f} MiB held in "
        f"{st['stored_mem'] / MiB:.0f} MiB ({st['ratio']:.2f}x).",
        "- CPU is a share of one CPU (100% = one core busy); machine CPU is the share of all "
        "cores. Latency is wall time per operation inside the workload, swap-ins included.",
        END,
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--duration", type=float, default=240, help="seconds of load (default 240)")
    ap.add_argument("--mb", type=int, default=48, help="heap MiB per workload (default 48)")
    ap.add_argument("--limit-fraction", type=float, default=0.5,
                    help="squeeze each cgroup to this share of its usage (default 0.5)")
    ap.add_argument("--pool", type=int, default=48 * MiB, help="pool.max_size bytes")
    ap.add_argument("--size", type=int, default=2 << 30, help="device size bytes")
    ap.add_argument("--rotational", action="store_true",
                    help="device.rotational: true (cluster readahead of 2^vm.page-cluster slots)")
    ap.add_argument("--warm", default="none", choices=("none", "lz4", "zstd"),
                    help="compression.warm_algorithm (default none, the store's default)")
    ap.add_argument("--datapath", default="auto", choices=("auto", "native", "python"),
                    help="device.datapath: who answers the FUSE reads (default auto)")
    ap.add_argument("--request-priority", default="normal", choices=("normal", "realtime"),
                    help="device.request_priority (default normal, the config's default)")
    ap.add_argument("--interval", type=float, default=2.0, help="sampling interval s")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds left out of averages")
    ap.add_argument("--md", default=os.path.join(REPO, "BENCHMARKS.md"))
    ap.add_argument("--no-md", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--json", default=os.path.join(REPO, "results", "load.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--latencies", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        log("must run as root (swap, cgroups)")
        return 2
    with swap_lock(log):
        res = run(args)
    res["warmup"] = args.warmup
    write_json(args.json, res)
    section = markdown(res, argv)
    if not args.no_md:
        replace_block(args.md, section, BEGIN, END)
    print(section)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
