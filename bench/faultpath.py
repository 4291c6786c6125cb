#!/usr/bin/env python3
"""Where a fault's time goes under load: the loop device, FUSE and our own threads, sampled
from a running agentzip-blk server.

A swap-in read crosses the loop device (a kernel worker submits it to the FUSE file), waits
in FUSE's queue for one of our workers, is answered by the store, and completes back through
the loop device. This bench takes one window of a server under load (started by another
command, e.g. `bench density`) and splits a read's time along that path:

  loop        block_rq_issue -> block_rq_complete on the loop device (perf tracepoints)
  FUSE        fuse_request_send -> fuse_request_end, per opcode (Linux >= 6.15)
  ours        the server's own read / write histograms (`stats`: from the request read
              off /dev/fuse to its reply)
  run queue   per server thread, the time it waited for a CPU per wake-up
              (/proc/PID/task/TID/schedstat)

plus the native path's requests handed to Python and writes queued / served inline.

    flock /tmp/agentzip-swap.lock .venv/bin/python -m bench density --configs agentzip --ns 16 --no-md --json D   (in the background)
    .venv/bin/python -m bench faultpath --after-swapon 65 --json F

`--after-swapon S` waits for a loop device in /proc/swaps, then S seconds (bench density
builds its sandboxes for ~50 s before its loop). The control socket is found under
/tmp/azd-*/a/run (bench density's run directory) unless `--control` names one. The tracing
costs CPU: compare windows taken the same way. Needs root (perf, schedstat).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench.harness.results import write_json

TRACEPOINTS = ("block:block_rq_issue", "block:block_rq_complete",
               "fuse:fuse_request_send", "fuse:fuse_request_end")
LOOP_MAJOR = "7"
BLOCK = re.compile(r"\s(\d+\.\d+):\s+block:block_rq_(issue|complete):\s+(\d+),(\d+)\s+(\S+)"
                   r"\s+\d*\s*\(.*?\)\s+(\d+)\s+\+\s+(\d+)")
FUSE_SEND = re.compile(r"\s(\d+\.\d+):\s+fuse:fuse_request_send:.*req (\d+) opcode \d+ \((\w+)\)")
FUSE_END = re.compile(r"\s(\d+\.\d+):\s+fuse:fuse_request_end:.*req (\d+)")


def summary(us: list[float]) -> dict:
    if not us:
        return {"n": 0}
    us = sorted(us)

    def q(p: float) -> float:
        return round(us[min(len(us) - 1, int(p * len(us)))], 1)

    return {"n": len(us), "mean_us": round(statistics.mean(us), 1), "p50_us": q(0.5),
            "p90_us": q(0.9), "p99_us": q(0.99)}


def parse_trace(text: str) -> dict:
    """Per-request latencies from `perf script` of TRACEPOINTS."""
    issued: dict = {}
    loop: dict[str, list[float]] = collections.defaultdict(list)
    sent: dict = {}
    fuse: dict[str, list[float]] = collections.defaultdict(list)
    for line in text.splitlines():
        m = BLOCK.search(line)
        if m:
            t, kind, major, minor, rwbs, sector, _ = m.groups()
            if major != LOOP_MAJOR:
                continue
            key = (minor, sector)
            if kind == "issue":
                issued[key] = (float(t), "read" if "R" in rwbs else "write" if "W" in rwbs else rwbs)
            elif key in issued:
                t0, op = issued.pop(key)
                loop[op].append((float(t) - t0) * 1e6)
            continue
        m = FUSE_SEND.search(line)
        if m:
            sent[m.group(2)] = (float(m.group(1)), m.group(3))
            continue
        m = FUSE_END.search(line)
        if m and m.group(2) in sent:
            t0, op = sent.pop(m.group(2))
            fuse[op].append((float(m.group(1)) - t0) * 1e6)
    return {"loop": {op: summary(v) for op, v in loop.items()},
            "fuse": {op: summary(v) for op, v in fuse.items()}}


def schedstats(pid: int) -> dict[str, tuple[int, int, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, slices = map(int, f.read().split())
        except (OSError, ValueError):
            continue
        out[tid] = (run, wait, slices)
    return out


def histogram_mean_us(before: dict, after: dict) -> dict:
    n = after["count"] - before["count"]
    return {"n": n, "mean_us": round((after["sum_s"] - before["sum_s"]) / n * 1e6, 1) if n else None}


def find_control() -> str:
    socks = glob.glob("/tmp/azd-*/a/run/control.sock")
    if len(socks) != 1:
        raise SystemExit(f"faultpath: {len(socks)} control sockets under /tmp/azd-*/a/run; "
                         "name one with --control")
    return socks[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--control", help="the server's control.sock (default: bench density's)")
    ap.add_argument("--after-swapon", type=float, metavar="S",
                    help="wait for a loop device in /proc/swaps, then S seconds")
    ap.add_argument("--trace", type=float, default=10.0, help="seconds of tracing (default 10)")
    ap.add_argument("--window", type=float, default=30.0,
                    help="seconds between the two stats samples (default 30, >= --trace)")
    ap.add_argument("--json", required=True, help="where the figures go")
    args = ap.parse_args()
    from agentzip_blk.datapath.control import request

    if args.after_swapon is not None:
        while not any("/dev/loop" in line for line in open("/proc/swaps").read().splitlines()[1:]):
            time.sleep(0.2)
        time.sleep(args.after_swapon)
    control = args.control or find_control()
    before = request(control, "stats", timeout=30)
    pid = before["server"]["pid"]
    sched0 = schedstats(pid)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="azfp-") as tmp:
        data = os.path.join(tmp, "perf.data")
        events = [a for tp in TRACEPOINTS for a in ("-e", tp)]
        subprocess.run(["perf", "record", "-q", "-o", data, *events, "-a", "sleep", str(args.trace)],
                       check=True)
        time.sleep(max(0.0, args.window - (time.monotonic() - t0)))
        sched1 = schedstats(pid)
        after = request(control, "stats", timeout=30)
        text = subprocess.run(["perf", "script", "-i", data], check=True, capture_output=True,
                              text=True).stdout
    result = {"command": " ".join(["python -m bench faultpath", *sys.argv[1:]]),
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "window_s": round(time.monotonic() - t0, 1), **parse_trace(text)}
    result["ours"] = {op: histogram_mean_us(before["latency"][op], after["latency"][op])
                      for op in ("read", "write")}
    dp0, dp1 = before["server"].get("datapath", {}), after["server"].get("datapath", {})
    result["native"] = {k: dp1[k] - dp0.get(k, 0) for k in
                        ("native_handed_up", "native_writes_queued", "native_writes_inline")
                        if k in dp1}
    result["request_priority"] = after["server"].get("fuse", {}).get("request_priority")
    threads = []
    for tid, (run, wait, slices) in sched1.items():
        if tid in sched0:
            r0, w0, s0 = sched0[tid]
            if run - r0 > 0.05e9:  # threads that ran at least 50 ms
                threads.append({"tid": int(tid), "run_s": round((run - r0) / 1e9, 2),
                                "runqueue_s": round((wait - w0) / 1e9, 2),
                                "wakeups": slices - s0,
                                "runqueue_per_wakeup_us": round((wait - w0) / max(1, slices - s0) / 1e3, 1)})
    result["threads"] = sorted(threads, key=lambda t: -t["run_s"])
    write_json(args.json, result)
    print(json.dumps({k: result[k] for k in ("loop", "fuse", "ours", "native", "request_priority")},
                     indent=1))
    for t in result["threads"]:
        print(f"thread {t['tid']}: ran {t['run_s']} s, waited {t['runqueue_s']} s for a CPU, "
              f"{t['runqueue_per_wakeup_us']} us per wake-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
