#!/usr/bin/env python3
"""Stale slots: how much the device holds for swap slots the kernel has already freed.

The kernel frees a swap slot (a page swapped back in and then written, or unmapped, or its
process gone) in its own swap map only; the device hears of it only when the kernel discards
the slot's range. This tool measures what such dead pages hold, per workload and swapon
discard policy (``--discard=pages``: what ``up`` uses; ``--discard=once``; no discard):

1. a fresh workload (bench/harness/workloads.py's, started with ``--agent-loop``) builds its data in
   a memory cgroup below our own;
2. our device is attached by the normal chain (``host.attach.attached``), then swapped off and
   on again, still empty, with the policy under test;
3. ``squeezed``: the idle workload is squeezed to ``--limit-fraction`` of its usage;
4. ``re-touched``: the limit is lifted and the workload runs ``--rounds`` protocol ROUNDs,
   each re-reading ``--ws-fraction`` of its items (skewed to the recent ones) and building and
   freeing a ``--transient-mib`` prompt (the browser workload has no ROUND: it re-reads all
   of it with CHECK instead);
5. ``re-squeezed``: squeezed again, as an idle sandbox is;
6. ``exited``: the limit is lifted and the workload TOUCHes, verifies and exits.

At each point it reads the device's ``stats`` (pages, orig_mem, stored_mem, trims), /proc/swaps
Used for our area and the cgroup's swap usage. *held dead* = device pages - Used pages: slots
the device still stores but the kernel no longer uses (Used counts every allocated slot, also
those whose page is back in RAM in the swap cache, so those are not counted as dead).

    sudo .venv/bin/python -m bench stale [--workloads B,A,D] [--mb 150]
        [--policies pages,once,none] [--json results/stale.json] [--write-md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from agentzip_blk import procfs
from agentzip_blk.cgroups.fs import CgroupError, MemoryCgroup
from agentzip_blk.config import parse_config
from agentzip_blk.demo import backends, common, driver, workload
from bench.harness import md as benchmd
from bench.harness.host import joiner, kill_all
from bench.harness.lock import swap_lock
from bench.harness.results import REPO
from bench.harness.workloads import WorkloadSpec, workloads

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
POLICIES = {"pages": ["--discard=pages"], "once": ["--discard=once"], "none": []}
PHASES = ("squeezed", "re-touched", "re-squeezed", "exited")
MD_SECTION = "bench_stale"


def area_used_pages(device: str) -> int | None:
    """Used of *device*'s swap area, in pages (/proc/swaps counts KiB)."""
    for s in common.proc_swaps():
        if os.path.realpath(s["filename"]) == os.path.realpath(device):
            return s["used"] // PAGE
    return None


def reswapon(state, policy: str) -> None:
    """Swap the still-empty device off and on again with the discard policy under test."""
    dev = state.device
    if (area_used_pages(dev) or 0) != 0:
        raise common.DemoError(f"{dev} is not empty: refusing to swapoff it here")
    common.run_tool(["swapoff", dev])
    common.run_tool(["swapon", *POLICIES[policy], "-p", str(state.swap_priority), dev])
    if procfs.swap_area(dev) is None:
        raise common.DemoError(f"swapon {dev} did not list it in /proc/swaps")


def point(backend: backends.AgentzipSwap, cg: MemoryCgroup | None, empty_stored: int) -> dict:
    """One reading: the device's pages against the kernel's Used for our area."""
    cg_swap = cg.swap_usage() if cg is not None and cg.exists() else 0
    used = area_used_pages(backend.state.device) or 0
    st = backend.stats()
    pages = int(st.get("pages", 0))
    stored = int(st.get("stored_mem", 0)) - empty_stored
    dead = max(pages - used, 0)
    return {"device_pages": pages, "orig_mem": int(st.get("orig_mem", 0)),
            "stored_mem": int(st.get("stored_mem", 0)), "used_pages": used, "cg_swap": cg_swap,
            "dead_pages": dead, "dead_orig": dead * PAGE,
            # the dead pages' share of what the device stores for pages (proportional: the
            # device does not know which of its pages are dead)
            "dead_stored": int(stored * dead / pages) if pages else 0,
            "dead_share": dead / pages if pages else 0.0,
            "trims": int(st.get("trims", 0)),
            # pages trimmed inside multi-page frames whose frame is still stored
            "unit_dead_pages": int(st.get("unit_dead_pages", 0))}


def cycle(spec: WorkloadSpec, policy: str, o: argparse.Namespace, prog: driver.Progress) -> dict:
    mb = o.mb if spec.key != "C" else max(o.mb, 200)
    loop = spec.key != "C"  # the browser has no ROUND
    argv = [*spec.argv, "--mb", str(mb), "--seed", str(o.seed)] + (["--agent-loop"] if loop else [])
    r: dict = {"workload": spec.name, "key": spec.key, "policy": policy, "mb": mb,
               "command": shlex.join(argv), "points": {}, "error": None}
    run_dir = tempfile.mkdtemp(prefix="agentzip-stale-")
    cg = wl = backend = None
    try:
        if common.proc_swaps():
            raise common.DemoError("swap already active: this tool measures its own area alone")
        cg = MemoryCgroup.create(f"agentzip-stale-{os.getpid()}-{spec.key}-{policy}")
        cg.allow_swap()
        cg.set_swappiness(100)
        prog.phase(f"{spec.key} {spec.name} x discard={policy}: start ({mb} MiB)")
        wl = workload.Workload(cg, mb, o.seed, argv=argv)
        r["ready_size"] = int(wl.expect("READY", o.timeout)[1])
        config = parse_config({"pool": {"swap_out_path": os.path.join(run_dir, "swapfile")},
                               "device": {"size": o.swap_size, "run_dir": run_dir}})
        backend = backends.AgentzipSwap(config, run_dir)
        backend.attach()
        reswapon(backend.state, policy)
        empty = int(backend.stats().get("stored_mem", 0))
        time.sleep(o.settle)

        def squeeze(name: str) -> None:
            target = int(cg.usage() * o.limit_fraction)
            sq = driver.squeeze(cg, target, o.steps, prog, wl)
            if sq["error"]:
                raise common.DemoError(f"squeeze failed: {sq['error']}")
            time.sleep(o.settle)
            r["points"][name] = point(backend, cg, empty)

        squeeze("squeezed")
        cg.set_limit(None)
        rounds = []
        for i in range(o.rounds if loop else 1):
            if loop:
                wl.send(f"ROUND {o.seed * 1000 + i} {o.ws_fraction} {o.transient_mib}")
                res = wl.expect("ROUND", o.timeout)
            else:
                wl.send("CHECK")
                res = wl.expect("CHECK", o.timeout)
            rounds.append(res[1])
        r["rounds"] = rounds
        time.sleep(o.settle)
        r["points"]["re-touched"] = point(backend, cg, empty)
        squeeze("re-squeezed")
        cg.set_limit(None)
        wl.send("TOUCH")
        r["verify"] = wl.expect("VERIFY", o.timeout)[1]
        wl.proc.wait(timeout=60)
        kill_all(cg)  # helpers (Chromium) may outlive the script: the sandbox is gone
        time.sleep(o.settle)
        r["points"]["exited"] = point(backend, cg, empty)
        r["ok"] = r["verify"] == "ok" and all(x == "ok" for x in rounds)
    except (common.DemoError, CgroupError, OSError, subprocess.TimeoutExpired) as e:
        r["error"] = f"{type(e).__name__}: {e}"
        prog.phase(f"{spec.key} {policy}: {r['error']}")
    finally:
        # safe order: workload and cgroup, then swapoff / loop / FUSE / server (backend.detach)
        try:
            if wl is not None:
                wl.stop()
            if cg is not None:
                kill_all(cg)
                with contextlib.suppress(CgroupError, OSError):
                    cg.set_limit(None)
                cg.remove()
        finally:
            if backend is not None:
                backend.detach()
            shutil.rmtree(run_dir, ignore_errors=True)
    r.setdefault("ok", False)
    return r


# ---------------------------------------------------------------------------------------
# --pagemap-probe: can the swap map's free slots be read from /proc/PID/pagemap?

PM_SWAP = 1 << 62
PM_PRESENT = 1 << 63
PM_FILE_SHARED = 1 << 61
HOLDER = r"""
import mmap, os, random, sys
n = int(sys.argv[2]) << 20
rnd = random.Random(1)
chunk = bytes(rnd.getrandbits(8) for _ in range(1 << 16)) * 4  # compressible, not zero
def fill(buf):
    for off in range(0, n, len(chunk)):
        buf[off:off + len(chunk)] = chunk[: n - off]
anon = bytearray(n)
fill(anon)                                    # private anonymous memory
with open(os.path.join(sys.argv[1], "unmapped"), "wb") as f:
    for off in range(0, n, len(chunk)):       # a tmpfs file nobody maps
        f.write(chunk[: n - off])
fd = os.open(os.path.join(sys.argv[1], "mapped"), os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, n)
shared = mmap.mmap(fd, n, mmap.MAP_SHARED)    # a tmpfs file mapped shared
fill(shared)
print("READY", flush=True)
for line in sys.stdin:
    if line.strip() == "READ":                # read faults only: pages come back as swap cache
        s = 0
        for off in range(0, n, 4096):
            s += anon[off]
        print("READ", s, flush=True)
"""


def pagemap_census(swap_type: int) -> dict:
    """Every process's pagemap: the slots of *swap_type* its PTEs name, and shared entries."""
    import numpy as np  # the server's dependency already; only this mode needs it here

    named: set[int] = set()
    shared_swapped = present_total = 0
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
            fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        except OSError:
            continue
        try:
            for lo, hi in spans:
                if hi - lo > 64 << 30:
                    continue  # reservations (V8, Chromium): nothing populated at this size
                try:
                    raw = os.pread(fd, (hi - lo) // PAGE * 8, lo // PAGE * 8)
                except OSError:
                    continue
                e = np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.uint64)
                sw = e[(e & np.uint64(PM_SWAP)) != 0]
                present_total += int(np.count_nonzero(e & np.uint64(PM_PRESENT)))
                if sw.size:
                    typ = sw & np.uint64(0x1F)
                    off = (sw >> np.uint64(5)) & np.uint64((1 << 50) - 1)
                    mine = off[typ == swap_type]
                    shared_swapped += int(np.count_nonzero(
                        (sw & np.uint64(PM_FILE_SHARED)) != 0))
                    named.update(int(x) for x in mine if x)
        finally:
            os.close(fd)
    return {"named_slots": len(named), "shared_swapped_entries": shared_swapped,
            "present_entries": present_total}


def pagemap_probe(o: argparse.Namespace, prog: driver.Progress) -> dict:
    """Anon memory, an unmapped and a mapped tmpfs file in one squeezed cgroup: which of their
    slots does any process's pagemap name, and how many does Used count?"""
    mib = 32
    r: dict = {"mib_each": mib, "points": {}, "error": None}
    run_dir = tempfile.mkdtemp(prefix="agentzip-stale-probe-")
    mnt = os.path.join(run_dir, "tmpfs")
    os.mkdir(mnt)
    cg = proc = backend = None
    mounted = False
    try:
        if common.proc_swaps():
            raise common.DemoError("swap already active: the probe needs its area alone (type 0)")
        config = parse_config({"pool": {"swap_out_path": os.path.join(run_dir, "swapfile")},
                               "device": {"size": o.swap_size, "run_dir": run_dir}})
        backend = backends.AgentzipSwap(config, run_dir)
        backend.attach()
        common.run_tool(["mount", "-t", "tmpfs", "-o", "size=256m,mode=700", "agentzip-probe", mnt])
        mounted = True
        cg = MemoryCgroup.create(f"agentzip-stale-probe-{os.getpid()}")
        cg.allow_swap()
        cg.set_swappiness(100)
        proc = subprocess.Popen([o.python, "-c", HOLDER, mnt, str(mib)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=joiner(cg))
        if proc.stdout.readline().split()[:1] != ["READY"]:
            raise common.DemoError("probe holder did not start")
        usage = cg.usage()
        sq = driver.squeeze(cg, usage // 10, o.steps, prog, _Alive(proc))
        if sq["error"]:
            raise common.DemoError(f"squeeze failed: {sq['error']}")
        time.sleep(o.settle)

        def census(name: str) -> None:
            c = pagemap_census(0)
            c["used_pages"] = area_used_pages(backend.state.device) or 0
            c["cg_swap_pages"] = cg.swap_usage() // PAGE
            c["device_pages"] = int(backend.stats().get("pages", 0))
            c["unnamed_used"] = c["used_pages"] - c["named_slots"]
            r["points"][name] = c
            prog.phase(f"{name}: {c}")

        census("squeezed")
        cg.set_limit(None)
        proc.stdin.write("READ\n")
        proc.stdin.flush()
        proc.stdout.readline()
        time.sleep(o.settle)
        census("anon read back")
    except (common.DemoError, CgroupError, OSError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
        prog.phase(f"probe: {r['error']}")
    finally:
        try:
            if proc is not None:
                proc.kill()  # our own child
                proc.wait(timeout=30)
            if cg is not None:
                with contextlib.suppress(CgroupError, OSError):
                    cg.set_limit(None)
            if mounted:
                # the tmpfs file's swapped pages are freed here, while the swap is still on
                common.run_tool(["umount", mnt])
            if cg is not None:
                cg.remove()
        finally:
            if backend is not None:
                backend.detach()
            shutil.rmtree(run_dir, ignore_errors=True)
    return r


class _Alive:
    """What driver.squeeze asks of a workload: whether it is still alive."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.poll() is None


def _mib(n: int) -> str:
    return f"{n / MiB:.1f}"


def table(results: list[dict]) -> list[str]:
    rows = ["| workload | discard | point | device pages | Used pages | held dead pages | "
            "dead MiB orig | dead MiB stored | % of device | trims |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for ph in PHASES:
            p = r["points"].get(ph)
            if p is None:
                continue
            rows.append(f"| {r['workload']} | {r['policy']} | {ph} | {p['device_pages']} | "
                        f"{p['used_pages']} | {p['dead_pages']} | {_mib(p['dead_orig'])} | "
                        f"{_mib(p['dead_stored'])} | {p['dead_share'] * 100:.1f}% | {p['trims']} |")
        if r.get("error"):
            rows.append(f"| {r['workload']} | {r['policy']} | error: {r['error']} | | | | | | | |")
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="B", help="keys of the workloads of bench/harness/workloads.py (A,B,C,D)")
    ap.add_argument("--policies", default="pages,once,none")
    ap.add_argument("--mb", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit-fraction", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ws-fraction", type=float, default=0.3)
    ap.add_argument("--transient-mib", type=float, default=8.0)
    ap.add_argument("--swap-size", type=int, default=2 << 30)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--write-md", action="store_true", help="rewrite BENCHMARKS.md's section")
    ap.add_argument("--md-from", metavar="JSON",
                    help="no run: rewrite BENCHMARKS.md's section from a --json file of a run")
    ap.add_argument("--pagemap-probe", action="store_true",
                    help="only the pagemap experiment: which holders of slots pagemap shows")
    o = ap.parse_args(argv)
    if o.md_from:
        with open(o.md_from) as f:
            saved = json.load(f)
        opts = argparse.Namespace(**saved["options"])
        benchmd.write_section(os.path.join(REPO, "BENCHMARKS.md"), MD_SECTION,
                              md_section(saved["command"], saved["date"], opts,
                                         table(saved["results"]), saved.get("kernel")))
        return 0
    if os.geteuid() != 0:
        print("bench_stale: run as root (attaches swap, creates cgroups)", file=sys.stderr)
        return 2
    specs = workloads(o.python)
    prog = driver.Progress(sys.stderr)
    if o.pagemap_probe:
        with swap_lock(prog.phase):
            r = pagemap_probe(o, prog)
        print(json.dumps(r, indent=1))
        if o.json:
            with open(o.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0 if not r["error"] else 1
    results = []
    # one lock for the whole matrix (a few minutes): the rows are compared with each other
    with swap_lock(prog.phase):
        for key in o.workloads.split(","):
            for policy in o.policies.split(","):
                r = cycle(specs[key], policy, o, prog)
                results.append(r)
                prog.phase(" | ".join(f"{ph}: dead {_mib(p['dead_orig'])} MiB of "
                                  f"{_mib(p['device_pages'] * PAGE)}"
                                      for ph, p in r["points"].items()))
    cmd = "sudo .venv/bin/python " + shlex.join(["-m", "bench", "stale", *argv])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = table(results)
    print("\n".join(rows))
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"command": cmd, "date": stamp, "kernel": platform.release(),
                       "options": vars(o), "results": results}, f, indent=1)
    if o.write_md:
        benchmd.write_section(os.path.join(REPO, "BENCHMARKS.md"), MD_SECTION,
                              md_section(cmd, stamp, o, rows))
    return 0 if all(r["ok"] for r in results) else 1


def md_section(cmd: str, stamp: str, o, rows: list[str], kernel: str | None = None) -> str:
    return "\n".join([
        "## Stale slots", "",
        f"Generated by `bench/stale.py` on {stamp}; Linux {kernel or platform.release()}. "
        "Command:", "",
        f"    {cmd}", "",
        f"Each workload (`--agent-loop`, {o.mb} MiB, fresh per row group) squeezed to "
        f"{o.limit_fraction:.0%} of its usage; re-touched: limit lifted, {o.rounds} ROUNDs "
        f"each re-reading {o.ws_fraction:.0%} of its items and building a {o.transient_mib:g} MiB "
        "prompt; squeezed again; then TOUCH, VERIFY and exit. *held dead* = device pages - "
        "/proc/swaps Used pages; *MiB stored*: the dead pages' proportional share of stored_mem "
        "(less the empty device's); *trims*: discards the device received.", "",
        *rows, ""])


if __name__ == "__main__":
    sys.exit(main())
