"""The demo: squeeze a real agent-like Python heap into a swap device and measure the gain.

``run_squeeze(swap_kind, mb)`` is the driver shared by ``agentzip-blk demo`` and
``tools/bench_demo.py``:

1. attach the swap backend (``backends``; ``agentzip``: our device via ``host.attach.attached``;
   ``zram-lz4`` / ``zram-lzo-rle`` / ``zram:ALG``: the kernel's /dev/zram0 for comparison);
2. create a memory cgroup below our own, with no limit, and start the workload
   (``workload``: ``scripts/agent_json.py``) in it; wait for ``READY``, time one ``CHECK`` pass
   (the checksum's own cost, subtracted from the swap-in time);
3. record free memory (MemFree + the per-CPU page lists), MemAvailable, the server's
   RSS, swap usage;
4. squeeze: lower the limit in a few steps to ~25% of the workload's RSS (the kernel
   reclaims synchronously inside each write), timed, with a progress bar;
5. record again: cgroup swap usage, /proc/swaps Used, pswpout, MemFree, server RSS,
   the device's orig/stored;
6. lift the limit, send ``TOUCH``, time until ``VERIFY ok`` (every byte read back);
7. tear down: kill the workload if still alive, remove the cgroup, swapoff, detach.

docs/ARCHITECTURE.md: a hard limit from a sandbox's start can OOM-kill it; the squeeze is applied
once the workload is idle, gradually.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from ..cgroups.fs import CgroupError, LimitBusy, MemoryCgroup
from .backends import SwapBackend, make_backend
from .common import (
    DemoError,
    MiB,
    fmt,
    meminfo,
    pcp_free_bytes,
    proc_swaps,
    rss_of,
    vmstat,
    zswap_enabled,
)
from .workload import DEFAULT_MB, DEFAULT_SEED, WORKLOAD, Workload

# ---------------------------------------------------------------------------------------
# progress


class Progress:
    """One line per phase with elapsed time; a tqdm bar on stderr while something is
    measured (on a terminal only, or when *bars* says so)."""

    def __init__(self, stream=None, quiet: bool = False, bars: bool | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.bars = sys.stderr.isatty() if bars is None else bars
        self._bar = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def phase(self, msg: str) -> None:
        if self.quiet:
            return
        self._end_bar()
        print(f"[{self.elapsed():6.1f}s] {msg}", file=self.stream, flush=True)

    def bar(self, frac: float, suffix: str = "") -> None:
        if self.quiet or not self.bars:
            return
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=100, file=sys.stderr, leave=False, dynamic_ncols=True,
                             bar_format="          {bar} {percentage:5.1f}% {postfix}")
        self._bar.n = min(max(frac, 0.0), 1.0) * 100
        self._bar.set_postfix_str(suffix, refresh=False)
        self._bar.refresh()

    def _end_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------------------
# the driver


def squeeze(cg: MemoryCgroup, target: int, steps: int, prog: Progress, wl: Workload) -> dict:
    """Lower the limit from current usage to *target* in *steps*; time it; count EBUSY."""
    start = cg.usage()
    target = min(target, start)
    limits = [start - (start - target) * i // steps for i in range(1, steps + 1)]
    info = {"start_usage": start, "target": target, "limits": limits, "ebusy": 0,
            "step_seconds": [], "error": None}
    swap0 = cg.swap_usage()
    stop = threading.Event()

    def work():
        try:
            for lim in limits:
                if stop.is_set():
                    raise KeyboardInterrupt("squeeze abandoned")
                t = time.monotonic()
                for attempt in range(20):
                    try:
                        if cg.version == 2:
                            # squeeze through memory.high; memory.max stays above the usage we
                            # started from as a safety net (a max it cannot reach OOM-kills)
                            cg.set_limit(lim, max_limit=start + start // 4)
                        else:
                            cg.set_limit(lim)
                        break
                    except LimitBusy:
                        info["ebusy"] += 1
                        time.sleep(0.1)
                else:
                    raise LimitBusy(f"limit {lim}: EBUSY 20 times (usage {cg.usage()})")
                info["step_seconds"].append(round(time.monotonic() - t, 4))
        except BaseException as e:  # reported by the caller
            info["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=work, daemon=True)
    t0 = time.monotonic()
    th.start()
    span = max(start - target, 1)
    try:
        while th.is_alive():
            th.join(0.2)
            try:
                u, s = cg.usage(), cg.swap_usage()
            except OSError:
                continue
            prog.bar((start - u) / span, f"usage {fmt(u)} -> {fmt(target)}, swapped {fmt(s - swap0)}")
    finally:
        stop.set()  # interrupted: no further limit writes after the teardown lifts the limit
    info["seconds"] = time.monotonic() - t0
    prog.bar(1.0 if info["error"] is None else (start - cg.usage()) / span,
             f"usage {fmt(cg.usage())}, swapped {fmt(cg.swap_usage() - swap0)}")
    if cg.version == 2 and info["error"] is None and cg.usage() > target * 1.05:
        # memory.high reclaim gives up after a few passes; memory.max is the safety net only
        info["error"] = f"usage {cg.usage()} still above memory.high {target}"
    if not wl.alive():
        info["error"] = (info["error"] or "") + f" workload died (status {wl.proc.returncode})"
    return info


def _rss_sum(pids: list[int]) -> int:
    return sum(rss_of(p) for p in pids)


def snapshot(backend: SwapBackend, cg: MemoryCgroup | None) -> dict:
    # The cgroup is read before the device: a page reaches the device before its charge moves
    # to swap, so a device read taken after the cgroup's holds at least what the cgroup counts
    # even when reclaim is still trickling on a cgroup at its limit.
    cg_usage = cg.usage() if cg is not None else None
    cg_swap = cg.swap_usage() if cg is not None else None
    mi = meminfo()
    vm = vmstat()
    swaps = proc_swaps()
    pcp = pcp_free_bytes()
    snap = {"mem_free_raw": mi.get("MemFree", 0), "pcp_free": pcp,
            "mem_free": mi.get("MemFree", 0) + pcp,  # free pages, wherever the allocator keeps them
            "mem_available": mi.get("MemAvailable", 0),
            # all user memory on the host (every cgroup's anon + page cache + swap cache)
            "user_mem": mi.get("AnonPages", 0) + mi.get("Cached", 0) + mi.get("SwapCached", 0),
            "swap_used": sum(s["used"] for s in swaps),
            "pswpout": vm.get("pswpout", 0), "pswpin": vm.get("pswpin", 0),
            "server_rss": _rss_sum(backend.server_pids()), "device": backend.stats()}
    if cg is not None:
        snap["cg_usage"] = cg_usage
        snap["cg_swap"] = cg_swap
    return snap


def _mib_s(nbytes: int, seconds: float | None) -> float | None:
    if not seconds or seconds <= 0:
        return None
    return nbytes / MiB / seconds


def run_squeeze(swap_kind="agentzip", mb: float = DEFAULT_MB, *, seed: int = DEFAULT_SEED,
                config=None, config_path: str | None = None, run_dir: str | None = None,
                limit_fraction: float = 0.25,
                steps: int = 8, progress: Progress | None = None, allow_other_swap: bool = False,
                settle: float = 1.0, timeout: float | None = None, zram_size: int | None = None,
                python: str | None = None) -> dict:
    """Squeeze the agent workload into *swap_kind* and back; return every figure measured.

    Raises DemoError when a precondition fails (not root, swap already active, device busy);
    a failure during the run is reported in the result (``ok`` False, ``error``), always after
    teardown: workload killed, cgroup removed, swapoff, device detached.
    """
    with teardown_on_signals():
        return _run_squeeze(swap_kind, mb, seed=seed, config=config, config_path=config_path,
                            run_dir=run_dir, limit_fraction=limit_fraction, steps=steps,
                            progress=progress, allow_other_swap=allow_other_swap, settle=settle,
                            timeout=timeout, zram_size=zram_size, python=python)


@contextlib.contextmanager
def teardown_on_signals():
    """SIGTERM/SIGHUP raise KeyboardInterrupt, so the teardown (swapoff, reset) still runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _run_squeeze(swap_kind, mb, *, seed, config, config_path, run_dir, limit_fraction, steps,
                 progress, allow_other_swap, settle, timeout, zram_size, python) -> dict:
    prog = progress or Progress()
    if os.geteuid() != 0:
        raise DemoError("the demo attaches swap and creates cgroups: run it as root")
    if not os.path.exists(WORKLOAD):
        raise DemoError(f"workload {WORKLOAD} is missing")
    other = proc_swaps()
    if other and not allow_other_swap:
        raise DemoError("swap is already active (" + ", ".join(s["filename"] for s in other) +
                        "): the demo measures its device as the only swap; swapoff it first")
    timeout = timeout or (120 + mb * 0.6)
    zram_size = zram_size or max(1 << 30, int(mb * MiB * 2))
    backend = make_backend(swap_kind, config, run_dir, size=zram_size, config_path=config_path)
    res: dict = {"backend": getattr(backend, "name", str(swap_kind)), "mb": mb, "seed": seed,
                 "limit_fraction": limit_fraction, "steps": steps, "ok": False, "error": None,
                 "zswap_enabled": zswap_enabled()}
    if res["zswap_enabled"]:
        prog.phase("warning: zswap is enabled: it compresses pages before any swap device sees them")
    cg = wl = None
    try:
        prog.phase(f"attach {backend.describe()}")
        t = time.monotonic()
        backend.attach()
        res["attach_seconds"] = time.monotonic() - t
        res["swap_areas"] = proc_swaps()
        res["device_before"] = backend.stats()

        cg = MemoryCgroup.create(f"agentzip-demo-{os.getpid()}-{int(time.time() * 1000) % 100000}")
        cg.allow_swap()
        cg.set_swappiness(100)
        res["cgroup"] = {"path": cg.path, "version": cg.version}
        prog.phase(f"start agent workload: {mb:g} MiB of JSON transcripts (seed {seed}) in {cg.path}")
        t = time.monotonic()
        wl = Workload(cg, mb, seed, python)  # assigned at once: the teardown stops it
        _wait_ready(res, prog, cg, wl, mb, timeout, t)
        before, after = _swap_out(res, prog, backend, cg, wl, limit_fraction, steps, settle)
        v = _swap_in(res, prog, backend, cg, wl, after, timeout)
        _account(res, prog, backend, before, after)
        res["ok"] = v[1] == "ok" and res["workload_status"] == 0
        if not res["ok"]:
            res["error"] = f"VERIFY {v[1]}, workload status {res['workload_status']}"
    except DemoError as e:
        res["error"] = str(e)
    except Exception as e:  # device setup errors, cgroup errors, I/O: reported after teardown
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        _teardown(res, prog, backend, cg, wl)
        res["swaps_after_teardown"] = proc_swaps()
    return res


def _wait_ready(res: dict, prog: Progress, cg: MemoryCgroup, wl: Workload, mb: float,
                timeout: float, started: float) -> None:
    """Wait for the workload's READY (built since `started`) and time one checksum pass."""
    t = started
    est = mb * MiB
    ready = wl.expect("READY", timeout,
                      tick=lambda: prog.bar(cg.usage() / est, f"building, cgroup usage {fmt(cg.usage())}"))
    res["workload_rss"] = int(ready[1])
    res["build_seconds"] = time.monotonic() - t
    wl.send("CHECK")
    check = wl.expect("CHECK", timeout)
    res["checksum"] = check[2]
    res["verify_baseline_seconds"] = float(check[3]) + float(check[4] if len(check) > 4 else 0)
    if check[1] != "ok":
        raise DemoError("workload CHECK failed before any squeeze")
    prog.phase(f"workload READY: rss {fmt(res['workload_rss'])}, built in {res['build_seconds']:.1f}s, "
               f"checksum pass {res['verify_baseline_seconds']:.2f}s")


def _swap_out(res: dict, prog: Progress, backend: SwapBackend, cg: MemoryCgroup, wl: Workload,
              limit_fraction: float, steps: int, settle: float) -> tuple[dict, dict]:
    """Squeeze the idle workload to `limit_fraction` of its RSS; snapshots before and after."""
    time.sleep(settle)
    before = snapshot(backend, cg)
    res["before"] = before
    target = int(res["workload_rss"] * limit_fraction)
    prog.phase(f"squeeze: limit {fmt(before['cg_usage'])} -> {fmt(target)} "
               f"({limit_fraction:.0%} of rss) in {steps} steps")
    sq = squeeze(cg, target, steps, prog, wl)
    res["squeeze"] = sq
    time.sleep(settle)  # let writeback finish before reading the device's counters
    after = snapshot(backend, cg)
    res["after"] = after
    res["swap_out_seconds"] = sq["seconds"]
    res["swapped_cgroup"] = after["cg_swap"] - before["cg_swap"]
    res["swapped_proc_swaps"] = after["swap_used"] - before["swap_used"]
    res["swapped_pswpout"] = (after["pswpout"] - before["pswpout"]) * os.sysconf("SC_PAGE_SIZE")
    res["swap_out_mib_s"] = _mib_s(res["swapped_pswpout"], sq["seconds"])
    prog.phase(f"squeeze done in {sq['seconds']:.2f}s: {fmt(res['swapped_pswpout'])} swapped out "
               f"({res['swap_out_mib_s'] or 0:.0f} MiB/s), cgroup usage {fmt(after['cg_usage'])}, "
               f"EBUSY {sq['ebusy']}")
    if sq["error"]:
        raise DemoError(f"squeeze failed: {sq['error']}")
    return before, after


def _swap_in(res: dict, prog: Progress, backend: SwapBackend, cg: MemoryCgroup, wl: Workload,
             after: dict, timeout: float) -> list[str]:
    """Lift the limit and have the workload read everything back (TOUCH -> VERIFY)."""
    cg.set_limit(None, max_limit=None) if cg.version == 2 else cg.set_limit(None)
    lifted = snapshot(backend, cg)
    prog.phase("limit lifted; TOUCH: the workload reads all of its data back")
    t = time.monotonic()
    wl.send("TOUCH")
    v = wl.expect("VERIFY", timeout,
                  tick=lambda: prog.bar(1 - cg.swap_usage() / max(after["cg_swap"], 1),
                                        f"cgroup usage {fmt(cg.usage())}"))
    res["swap_in_wall_seconds"] = time.monotonic() - t
    touched = snapshot(backend, cg)
    res["touched"] = touched
    res["verify"] = v[1]
    res["swapped_in_pswpin"] = (touched["pswpin"] - lifted["pswpin"]) * os.sysconf("SC_PAGE_SIZE")
    if v[1] == "ok" and len(v) >= 6:
        # the workload read one byte of every anonymous page first, timed on its own:
        # that is the swap-in; the checksum pass after it ran on resident data
        res["swap_in_seconds"] = max(float(v[4]), 1e-6)
        res["touched_pages"] = int(v[5])
        res["verify_seconds"] = float(v[3])
    # cross-check: TOUCH-to-VERIFY wall time minus the same pass timed before the squeeze
    res["swap_in_wall_net_seconds"] = res["swap_in_wall_seconds"] - res["verify_baseline_seconds"]
    res.setdefault("swap_in_seconds", max(res["swap_in_wall_net_seconds"], 1e-3))
    res["swap_in_mib_s"] = _mib_s(res["swapped_in_pswpin"], res["swap_in_seconds"])
    try:
        wl.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    res["workload_status"] = wl.proc.returncode
    prog.phase(f"VERIFY {v[1]} in {res['swap_in_wall_seconds']:.2f}s: {fmt(res['swapped_in_pswpin'])} "
               f"swapped in by the page walk in {res['swap_in_seconds']:.2f}s "
               f"({res['swap_in_mib_s'] or 0:.0f} MiB/s)")
    return v


def _account(res: dict, prog: Progress, backend: SwapBackend, before: dict, after: dict) -> None:
    """What the host got back: the device's ratio, MemFree, the server's RSS, others' share."""
    dev_b, dev_a = before["device"], after["device"]
    res["orig_mem"] = dev_a.get("orig_mem", 0)
    res["stored_mem"] = dev_a.get("stored_mem", 0)
    res["stored_mem_empty"] = dev_b.get("stored_mem", 0)
    res["ratio"] = res["orig_mem"] / res["stored_mem"] if res["stored_mem"] else None
    res["mem_free_gain"] = after["mem_free"] - before["mem_free"]
    res["mem_free_raw_gain"] = after["mem_free_raw"] - before["mem_free_raw"]
    res["mem_available_gain"] = after["mem_available"] - before["mem_available"]
    res["server_rss_before"] = before["server_rss"]
    res["server_rss_after"] = after["server_rss"]
    res["server_rss_growth"] = after["server_rss"] - before["server_rss"]
    potential = res["orig_mem"] - res["stored_mem"]
    res["device_saving"] = potential
    res["saving_fraction"] = res["mem_free_gain"] / potential if potential > 0 else None
    # MemFree is host-wide: other processes allocating or freeing meanwhile move it too.
    # Their share = change of all user memory minus ours (cgroup) and the server's.
    cg_drop = before["cg_usage"] - after["cg_usage"]
    others = (after["user_mem"] - before["user_mem"]) + cg_drop - res["server_rss_growth"]
    res["others_delta"] = others
    res["mem_free_gain_adjusted"] = res["mem_free_gain"] + others
    res["saving_fraction_adjusted"] = (res["mem_free_gain_adjusted"] / potential
                                       if potential > 0 else None)
    # bookkeeping view: what left the cgroup minus what now holds it
    kernel_stored = (res["stored_mem"] - res["stored_mem_empty"]) if backend.stored_in_kernel else 0
    res["accounted_gain"] = cg_drop - res["server_rss_growth"] - kernel_stored
    res["saving_fraction_accounted"] = res["accounted_gain"] / potential if potential > 0 else None
    if potential > 0 and abs(others) > 0.1 * potential:
        prog.phase(f"note: other processes changed host memory by {fmt(others)} meanwhile; "
                   f"MemFree gain adjusted for them: {fmt(res['mem_free_gain_adjusted'])}")


def _teardown(res: dict, prog: Progress, backend: SwapBackend, cg: MemoryCgroup | None,
              wl: Workload | None) -> None:
    """Stop the workload, remove the cgroup, swapoff and detach, each even if one before failed."""
    prog.phase("teardown: stop workload, remove cgroup, swapoff, detach")
    try:
        if wl is not None:
            if wl.alive():
                res.setdefault("workload_stderr", wl.stderr_tail())
            wl.stop()
    finally:
        try:
            if cg is not None:
                try:
                    cg.set_limit(None, max_limit=None) if cg.version == 2 else cg.set_limit(None)
                except (CgroupError, OSError):
                    pass
                res["oom_kills"] = _safe(cg.oom_kills, 0)
                cg.remove()
        finally:
            backend.detach()  # swapoff, then reset / detach; safe after a failed attach


def _safe(fn, default):
    try:
        return fn()
    except Exception:
        return default


def summary(res: dict) -> str:
    """The demo's human report."""
    if res.get("error") and "orig_mem" not in res:
        return f"demo failed: {res['error']}"
    lines = []
    ratio = res.get("ratio")
    lines.append(f"agentzip-blk demo: {res['mb']:g} MiB agent heap in {res['backend']}, "
                 f"squeezed to {res['limit_fraction']:.0%} of its RSS, then read back")
    lines.append(f"  workload   rss {fmt(res.get('workload_rss'))}; swapped out "
                 f"{fmt(res.get('swapped_pswpout'))} in {res.get('swap_out_seconds', 0):.2f}s "
                 f"({res.get('swap_out_mib_s') or 0:.0f} MiB/s), back in {res.get('swap_in_seconds', 0):.2f}s "
                 f"({res.get('swap_in_mib_s') or 0:.0f} MiB/s); VERIFY {res.get('verify', '-')}")
    lines.append(f"  device     orig {fmt(res.get('orig_mem'))}  stored {fmt(res.get('stored_mem'))}  "
                 f"ratio {ratio:.2f}x" if ratio else "  device     no pages stored")
    gain = res.get("mem_free_gain", 0)
    raw = res.get("mem_free_raw_gain", 0)
    lines.append(f"  host       free memory {'+' if gain >= 0 else ''}{fmt(gain)} "
                 f"(MemFree + per-CPU page lists; MemFree alone {'+' if raw >= 0 else ''}{fmt(raw)}); "
                 f"server RSS {fmt(res.get('server_rss_before'))} -> {fmt(res.get('server_rss_after'))}")
    frac = res.get("saving_fraction")
    if frac is not None:
        lines.append(f"  saving     free-memory gain is {frac:.0%} of orig - stored ({fmt(res.get('device_saving'))})"
                     + (f"; {res['saving_fraction_adjusted']:.0%} after removing other processes' "
                        f"{fmt(res['others_delta'])}" if res.get("saving_fraction_adjusted") is not None else "")
                     + (f"; accounted {res['saving_fraction_accounted']:.0%}"
                        if res.get("saving_fraction_accounted") is not None else ""))
    if res.get("error"):
        lines.append(f"  error      {res['error']}")
    return "\n".join(lines)


def main(args) -> int:
    """``agentzip-blk demo``: args.config, args.run_dir, args.mb (optional: swap, seed, json)."""
    mb = getattr(args, "mb", None) or DEFAULT_MB
    seed = getattr(args, "seed", None) or DEFAULT_SEED
    swap = getattr(args, "swap", None) or "agentzip"
    config = None
    try:
        if swap == "agentzip":
            from agentzip_blk.config import load_config
            config = load_config(getattr(args, "config", None))
        res = run_squeeze(swap, mb, seed=seed, config=config, config_path=getattr(args, "config", None),
                          run_dir=getattr(args, "run_dir", None),
                          progress=Progress(sys.stderr if getattr(args, "json", False) else sys.stdout))
    except DemoError as e:
        print(f"agentzip-blk demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("agentzip-blk demo: interrupted (workload stopped, cgroup removed, swap detached)",
              file=sys.stderr)
        return 130
    except Exception as e:  # ConfigError and friends: one line, not a traceback
        if type(e).__name__ == "ConfigError":
            print(f"agentzip-blk demo: {e}", file=sys.stderr)
            return 1
        raise
    if getattr(args, "json", False):
        print(json.dumps(res, indent=2, default=str))
    else:
        print(summary(res))
    return 0 if res.get("ok") else 1


if __name__ == "__main__":  # python -m agentzip_blk.demo.driver [--swap zram-lz4] [--mb N]
    import argparse

    ap = argparse.ArgumentParser(prog="python -m agentzip_blk.demo.driver")
    ap.add_argument("--config")
    ap.add_argument("--run-dir")
    ap.add_argument("--mb", type=float, default=DEFAULT_MB)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--swap", default="agentzip", help="agentzip | zram-lz4 | zram-lzo-rle")
    ap.add_argument("--json", action="store_true")
    sys.exit(main(ap.parse_args()))
