"""The pause a restart costs a faulting sandbox: agentzip-blk restart under a workload's faults.

    .venv/bin/python -m bench restart [--restarts 20] [--mb 128] [--kill] [--out results/bench-restart.json]

Issue 28's target: under 1 s at the default size. With --kill the server is not restarted but
killed (SIGKILL) each time, and the holder brings a new one back from its memory: reported
then is each recovery as `status` sees it (from the kill to a healthy new server), and the
same touch latencies.

`agentzip-blk up` (FUSE front door), one workload in a cgroup below ours whose heap is mostly
in the device, touching random pages of it without pause (each touch a swap-in fault, most
of the time); then the same workload for the same time without restarts (the reference),
then `agentzip-blk restart` every 2 s, each its own process. Reported: the server's own pause
per restart (workers stopped to "go"), the whole `restart` command, and the workload's touch
latency p50/p99/max in both phases (its max is the longest stall a sandbox saw). Every byte is
checked at the end. Holds /tmp/agentzip-swap.lock; refuses to run while another swap area is on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentzip_blk import procfs
from agentzip_blk.cgroups.fs import MemoryCgroup
from bench.harness.host import joiner
from bench.harness.lock import swap_lock
from bench.harness.results import command_line, write_json

MiB = 1 << 20
CLI = Path(sys.executable).with_name("agentzip-blk")

# touches random pages for `seconds`, then prints the touch latencies' percentiles (µs) and
# whether every block still hashes as it did
TOUCHER = r"""
import hashlib, random, sys, time, json
mb = int(sys.argv[1])
blocks = []
for i in range(mb):
    line = b"%08d {'role': 'tool', 'content': 'agentzip restart bench'} " % i
    blocks.append(bytearray((line * (1 + (1 << 20) // len(line)))[: 1 << 20]))
digest = hashlib.sha256(b"".join(blocks)).hexdigest()
print("READY", flush=True)
for cmd in sys.stdin:
    seconds = float(cmd)
    lat = []
    end = time.monotonic() + seconds
    r = random.Random(1)
    while time.monotonic() < end:
        b = blocks[r.randrange(mb)]
        off = r.randrange(256) * 4096
        t0 = time.perf_counter()
        b[off] ^= 0  # a read and a write of the same byte: the page comes back
        lat.append(time.perf_counter() - t0)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e6
    ok = hashlib.sha256(b"".join(blocks)).hexdigest() == digest
    print(json.dumps({"touches": len(lat), "p50_us": q(0.5), "p99_us": q(0.99),
                      "max_us": lat[-1] * 1e6, "ok": ok}), flush=True)
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=300)


def kill_and_wait(cfg: Path, timeout: float = 120.0) -> float:
    """SIGKILL the server; seconds until `status` names a healthy other one."""
    pid = json.loads(cli("--config", str(cfg), "status", "--json").stdout)["state"]["nbdkit_pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while time.monotonic() - t0 < timeout:
        st = json.loads(cli("--config", str(cfg), "status", "--json").stdout)
        if st.get("healthy") and st["state"]["nbdkit_pid"] not in (None, pid):
            return round(time.monotonic() - t0, 3)
        time.sleep(0.05)
    sys.exit(f"no server back {timeout:g} s after the kill of pid {pid}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench restart",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--mb", type=int, default=128, help="the workload's heap")
    ap.add_argument("--kill", action="store_true",
                    help="SIGKILL the server instead of restarting it (the holder recovers it)")
    ap.add_argument("--out", default="results/bench-restart.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench restart: needs root")
    with swap_lock():
        if procfs.swaps():
            sys.exit("bench restart: another swap area is active")
        return run(args)


def run(args) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="azbr-"))
    run_dir = str(tmp / "run")
    cfg = tmp / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp / 'tier'}\n"
                   f"device:\n  run_dir: {run_dir}\n  frontend: fuse\n")
    cg = proc = None
    up = False
    try:
        r = cli("--config", str(cfg), "up")
        if r.returncode:
            sys.exit(f"up failed: {r.stderr}")
        up = True
        cg = MemoryCgroup.create(f"azb-restart-{os.getpid()}")
        cg.allow_swap()
        proc = subprocess.Popen([sys.executable, "-c", TOUCHER, str(args.mb)], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                preexec_fn=joiner(cg))
        assert proc.stdout.readline().strip() == "READY"
        cg.set_limit(args.mb * MiB // 4)
        deadline = time.monotonic() + 120
        while cg.swap_usage() < args.mb * MiB // 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        swapped = cg.swap_usage()
        period = 4.0 if args.kill else 2.0  # a recovery starts a whole new nbdkit
        seconds = period * args.restarts

        def phase(restarts: int) -> tuple[dict, list[dict]]:
            proc.stdin.write(f"{seconds}\n")
            proc.stdin.flush()
            done: list[dict] = []
            t_end = time.monotonic() + seconds
            for _ in range(restarts):
                time.sleep(1.0)
                t0 = time.monotonic()
                if args.kill:
                    done.append({"paused_ms": None, "command_s": kill_and_wait(cfg)})
                else:
                    r = cli("--config", str(cfg), "restart")
                    if r.returncode:
                        sys.exit(f"restart failed: {r.stderr}")
                    m = re.search(r"paused (\d+) ms", r.stdout)
                    done.append({"paused_ms": int(m.group(1)) if m else None,
                                 "command_s": round(time.monotonic() - t0, 3)})
                time.sleep(max(0.0, period - 1.0 - (time.monotonic() - t0)))
            time.sleep(max(0.0, t_end - time.monotonic()))
            return json.loads(proc.stdout.readline()), done

        reference, _ = phase(0)
        during, restarts = phase(args.restarts)
        paused = sorted(x["paused_ms"] for x in restarts if x["paused_ms"] is not None)
        commands = sorted(x["command_s"] for x in restarts)
        stats = json.loads(cli("--config", str(cfg), "stats", "--json").stdout)
        result = {
            "command": command_line("restart", sys.argv[1:]),
            "restarts": len(restarts), "heap_mib": args.mb, "killed": args.kill,
            "swapped_mib_at_start": round(swapped / MiB, 1),
            "server_pause_ms": ({"p50": statistics.median(paused), "max": paused[-1],
                                 "p99": paused[min(len(paused) - 1, int(0.99 * len(paused)))]}
                                if paused else None),
            # restart: the command; --kill: from the kill to a healthy new server
            "restart_command_s": {"p50": statistics.median(commands), "max": commands[-1]},
            "touch_without_restarts": reference, "touch_with_restarts": during,
            "server_restarts_counted": stats["server"]["restarts"],
            "server_recoveries_counted": stats["server"].get("recoveries"),
            "every_byte_ok": reference["ok"] and during["ok"],
        }
        print(json.dumps(result, indent=2))
        write_json(args.out, result, newline=True)
        return 0 if result["every_byte_ok"] else 1
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        if cg is not None:
            cg.remove()
        if up:
            cli("--config", str(cfg), "down", "--force")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
