#!/usr/bin/env python3
"""Density: how many agent sandboxes fit in the same memory, at the same service level.

    .venv/bin/python -m bench density            # the full run (~60 min), as root
    .venv/bin/python -m bench density --quick    # smoke test: two N, short loops (~2 min)

**The host.** A parent memory cgroup below our own stands in for the host's RAM: limit L
(``--limit``, 1.5 GiB) from the start. The memory a swap device keeps in RAM comes out of
the same host, so while swap is attached the parent's limit is L minus what the device
holds (zram: ``mm_stat`` mem_used_total, kernel memory; agentzip-blk: the RSS of its server
process(es), as ``agentzip-blk status --json`` names them), updated twice a second. Without
that, swap would be free memory and the compression ratio would not matter.

**Sandboxes.** N child cgroups of the parent, each running one of the project's workloads
(bench/workloads: Python JSON tool calling, pandas, Node.js text; a seeded, balanced mix;
sandbox i is the same program with the same data in every trial) started with
``--agent-loop``. Once all are built, each runs an agent loop for ``--duration`` seconds:
*think* (sleep a seeded 2-8 s, the wait on a model), then *act* (protocol ROUND: re-read a
seeded, skewed 3% of its retained items -- 4 picks in 5 from the newest fifth -- verify
their digests, allocate and process a 4 MiB transient buffer made from them, free it). A
round's wall time is think + act (what an agent's user waits for per step); act alone is
reported too. Any digest mismatch fails the whole run. Every round is kept in the trial's
``round_log`` (when its act started, think, act, the sandbox's major faults during the act),
with the mean and max of the *first* acts apart from the later ones: a sandbox's first act
faults back what the build pushed out while it idled, the burst that sets the p99 of a slow
swap device (BENCHMARKS.md, "The first act").

**Configurations** (each the only swap while it runs, started by separate commands as an
operator would): ``noswap``; ``zram`` (lz4, /dev/zram0); ``agentzip`` (``agentzip-blk up``
at its defaults, ``down`` after); ``agentzip-tuned`` (``agentzip-blk scope add`` of the
sandboxes' glob, ``up --tune``). A configuration *holds* at N when no sandbox was OOM-killed
or died, every round verified, and the p99 round time is at most 1.25x the p99 of the same
N with no memory limit and no swap (``nolimit``, measured in the same run, so CPU
contention on 2 cores is not blamed on memory). Density = the largest N that holds: N
doubles from a start (``--start``; each later configuration starts at the largest density
found so far), then bisects until hi - lo <= max(1, 15% of lo).

Writes ``results/bench_density.json``, ``docs/density.png`` and the section of BENCHMARKS.md
between ``<!-- bench_density:begin -->`` and ``<!-- bench_density:end -->`` (``--from-json``
regenerates the section and plot). Holds /tmp/agentzip-swap.lock for the whole run (says so
while it waits); refuses to start while any other swap area is active. Every trial tears
down in order: kill the workloads, remove their cgroups, swapoff / ``agentzip-blk down``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import queue
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from agentzip_blk import procfs
from bench.harness.host import child_cgroup, joiner, oom_kills, set_limit_quiet
from bench.harness.lock import SWAP_LOCK, swap_lock
from bench.harness.md import replace_block
from bench.harness.results import REPO, write_json
from bench.harness.workloads import script

BEGIN, END = "<!-- bench_density:begin -->", "<!-- bench_density:end -->"
MiB = 1 << 20
GiB = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
CONFIGS = ("noswap", "zram", "agentzip", "agentzip-tuned")
# --set SECTION.KEY=VALUE: config keys for the agentzip configurations (compression, policy)
EXTRA_CONFIG: dict[str, dict[str, str]] = {}
BOUND = 1.25  # p99 round time at most this times the no-limit p99 of the same N
KINDS = ("agent_json", "pandas", "node_text")


def peak_held(samples: list[dict]) -> dict | None:
    """At the 8 s sample with the most swapped out (the sandboxes' cgroups): what the device
    held in memory and on disk against it, and the device's memory per byte swapped out
    (issue "Hold only what the kernel still needs")."""
    held = [x for x in samples if "held_pool" in x and x["swap"]]
    if not held:
        return None
    x = max(held, key=lambda x: x["swap"])
    return {"t": x["t"], "swap_mib": round(x["swap"] / MiB, 1),
            "pool_mib": round(x["held_pool"] / MiB, 1),
            "disk_mib": round(x.get("held_disk", 0) / MiB, 1),
            "proc_swaps_mib": round(x["proc_swaps"] / MiB, 1),
            "pool_over_swap": round(x["held_pool"] / x["swap"], 3),
            "device_mem_per_swap": round(x["store"] / x["swap"], 3)}


def log(msg: str) -> None:
    print(f"bench_density: {msg}", file=sys.stderr, flush=True)


class VerifyError(RuntimeError):
    """A sandbox read back data that differs from what it built: the run has failed."""


# ---------------------------------------------------------------------------------------
# options


@dataclass
class Options:
    limit: int = 1536 * MiB  # L: the host's RAM
    duration: float = 60.0  # seconds of agent loop per trial (after every sandbox is built)
    think: tuple[float, float] = (2.0, 8.0)
    ws_fraction: float = 0.03  # share of a sandbox's items one act touches
    transient_mib: float = 4.0
    # sizes for ~10 sandboxes in L without swap (cgroup usage ~150 MiB each, measured)
    mb: dict = field(default_factory=lambda: {"agent_json": 160, "pandas": 180, "node_text": 170})
    seed: int = 1
    start: int = 4
    max_n: int = 64
    resolution: float = 0.15  # bisect until hi - lo <= max(1, lo * resolution)
    build_parallel: int = 2  # sandboxes building at once (2 cores)
    build_timeout: float = 240.0  # per sandbox; longer counts as not holding
    round_timeout: float = 120.0
    swap_size: int = 8 * GiB  # zram disksize and agentzip device size alike
    configs: tuple = CONFIGS
    quick_ns: tuple = ()  # quick mode: exactly these N, no search
    workdir: str = "/tmp"


def quick_options() -> Options:
    return Options(limit=224 * MiB, duration=8.0, think=(0.3, 1.2), transient_mib=2.0,
                   mb={"agent_json": 40, "pandas": 90, "node_text": 40}, quick_ns=(2, 4),
                   build_timeout=120.0, round_timeout=60.0, swap_size=1 * GiB)


# ---------------------------------------------------------------------------------------
# small readers


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (index 0 is field 3, the state);
    [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return []


def proc_majflt(pid: int) -> int:
    """Major faults of a whole process (all its threads), field 12."""
    p = proc_stat(pid)
    return int(p[9]) if p else 0


def proc_cpu(pid: int) -> float:
    p = proc_stat(pid)
    return (int(p[11]) + int(p[12])) / TICK if p else 0.0


def proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def machine_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v[:8]) - idle) / TICK, sum(v[:8]) / TICK


def active_swaps() -> list[str]:
    with open("/proc/swaps") as f:
        return [line.split()[0] for line in f.read().splitlines()[1:] if line.strip()]


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (no interpolation: a p99 is a round that happened)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


# ---------------------------------------------------------------------------------------
# sandboxes (their cgroups: bench/harness/host.py)


@dataclass
class SandboxSpec:
    index: int
    kind: str
    seed: int
    argv: list[str]


def sandbox_specs(n: int, opts: Options, python: str) -> list[SandboxSpec]:
    """Sandbox i is the same in every trial: kinds in seeded blocks of three (a balanced mix)."""
    out = []
    node = shutil.which("node") or "node"
    for i in range(n):
        block = list(KINDS)
        random.Random(opts.seed * 1000 + i // 3).shuffle(block)
        kind = block[i % 3]
        seed = opts.seed * 1000 + i
        mb = str(opts.mb[kind])
        if kind == "agent_json":
            argv = [python, script("agent_json.py")]
        elif kind == "pandas":
            argv = [python, script("pandas_analysis.py")]
        else:
            argv = [node, script("node_text.js")]
        out.append(SandboxSpec(i, kind, seed, [*argv, "--mb", mb, "--seed", str(seed), "--agent-loop"]))
    return out


class Sandbox:
    """One workload process in its cgroup; stdout lines on a queue."""

    def __init__(self, spec: SandboxSpec, cg, stderr_dir: str):
        self.spec, self.cg = spec, cg
        self.err_path = os.path.join(stderr_dir, f"sandbox{spec.index}.err")
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(spec.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, preexec_fn=joiner(cg), close_fds=True,
                                         env=dict(os.environ, PYTHONHASHSEED="0"))
        self.lines: queue.Queue = queue.Queue()
        self.ready_bytes = 0
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(None)

    def expect(self, word: str, timeout: float, abort: threading.Event) -> list[str] | None:
        """The next line starting with *word*; None on EOF, timeout or abort."""
        deadline = time.monotonic() + timeout
        while not abort.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                parts = self.lines.get(timeout=min(left, 0.25))
            except queue.Empty:
                continue
            if parts is None:
                return None
            if parts and parts[0] == word:
                return parts
        return None

    def send(self, line: str) -> bool:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def stderr_tail(self, n: int = 300) -> str:
        try:
            with open(self.err_path) as f:
                return f.read()[-n:].strip().replace("\n", " | ")
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its pid
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                f.close()


# ---------------------------------------------------------------------------------------
# swap configurations


class NoSwap:
    name = "noswap"

    def attach(self) -> None:
        pass

    def detach(self) -> None:
        pass

    def store_bytes(self) -> int:
        return 0

    def server_pids(self) -> list[int]:
        return []

    def stats(self) -> dict:
        return {}

    def held(self) -> dict:
        """Bytes of pages the device holds in memory and on disk, for the 8 s samples."""
        return {}


class Zram(NoSwap):
    """/dev/zram0 with lz4 as the only swap (agentzip_blk.demo.backends.ZramSwap: attach, swapoff, reset)."""

    name = "zram"

    def __init__(self, size: int):
        from agentzip_blk.demo.backends import ZramSwap

        self.z = ZramSwap("lz4", size=size)

    def attach(self) -> None:
        try:
            self.z.attach()
        except Exception:
            self.z.detach()
            raise

    def detach(self) -> None:
        self.z.detach()

    def store_bytes(self) -> int:
        try:
            with open(os.path.join(self.z.sysfs, "mm_stat")) as f:
                return int(f.read().split()[2])  # mem_used_total
        except (OSError, ValueError, IndexError):
            return 0

    def held(self) -> dict:
        try:
            with open(os.path.join(self.z.sysfs, "mm_stat")) as f:
                return {"held_pool": int(f.read().split()[0])}  # orig_data_size
        except (OSError, ValueError, IndexError):
            return {}

    def stats(self) -> dict:
        st = self.z.stats()
        return {"orig_mem": st["orig_mem"], "stored_mem": st["stored_mem"], "ratio": st["ratio"]}


class Agentzip(NoSwap):
    """``agentzip-blk up`` / ``down`` as separate commands, the way an operator runs them."""

    def __init__(self, tmp: str, size: int, tuned: bool, scope_glob: str):
        self.name = "agentzip-tuned" if tuned else "agentzip"
        self.tuned, self.size, self.glob = tuned, size, scope_glob
        self.dir = os.path.join(tmp, "t" if tuned else "a")  # short: the run dir holds unix sockets
        self.run_dir = os.path.join(self.dir, "run")
        self.cfg = os.path.join(self.dir, "config.yaml")
        self.cli = self._cli()
        self.pids: list[int] = []
        self.up_s = self.down_s = 0.0
        self.attached = False

    @staticmethod
    def _cli() -> list[str]:
        exe = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
        return [exe] if os.path.exists(exe) else [sys.executable, "-m", "agentzip_blk.cli"]

    def _run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = [*self.cli, "--config", self.cfg, *args]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if check and p.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv[len(self.cli) - 1:])}: exit {p.returncode}: "
                               f"{(p.stderr or p.stdout).strip()[-600:]}")
        return p

    def attach(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        # the defaults, except where this run's state lives; no scope unless tuned (the default
        # scope glob would match other runs' agent-sandbox-*.slice cgroups on this host)
        with open(self.cfg, "w") as f:
            device = "".join(f"  {k}: {v}\n" for k, v in EXTRA_CONFIG.get("device", {}).items())
            f.write(f"pool:\n  swap_out_path: {os.path.join(self.dir, 'disk-tier')}\n"
                    f"device:\n  run_dir: {self.run_dir}\n{device}scopes: []\n")
            for section, values in EXTRA_CONFIG.items():  # --set (the pool key not among them)
                if section != "device":
                    f.write(f"{section}:\n" + "".join(f"  {k}: {v}\n" for k, v in values.items()))
        if self.tuned:
            self._run("scope", "add", "--cgroup", self.glob)
        t = time.monotonic()
        self.attached = True  # from here on, detach runs `down`
        self._run("up", "--size", str(self.size), *(["--tune"] if self.tuned else []))
        self.up_s = time.monotonic() - t
        st = json.loads(self._run("status", "--json", check=False).stdout or "{}")
        if not st.get("attached"):
            raise RuntimeError(f"{self.name}: `agentzip-blk up` returned but status says not attached: "
                               f"{json.dumps(st.get('warnings'))}; server {st.get('server')}")
        self.pids = [p["pid"] for p in (st.get("server"), st.get("nbdfuse")) if p and p.get("pid")]

    def detach(self) -> None:
        if not self.attached:
            return
        t = time.monotonic()
        p = self._run("down", timeout=600, check=False)
        if p.returncode != 0:
            log(f"{self.name}: `agentzip-blk down` failed ({p.stderr.strip()[-300:]}); retrying --force")
            p = self._run("down", "--force", timeout=600, check=False)
            if p.returncode != 0:
                raise RuntimeError(f"{self.name}: cannot detach: {p.stderr.strip()[-300:]}; state in "
                                   f"{self.run_dir}: agentzip-blk --config {self.cfg} down")
        self.down_s = time.monotonic() - t
        self.attached = False

    def store_bytes(self) -> int:
        return sum(proc_rss(p) for p in self.pids)

    def server_pids(self) -> list[int]:
        return list(self.pids)

    def stats(self) -> dict:
        p = self._run("stats", "--json", check=False, timeout=60)
        try:
            st = json.loads(p.stdout)
        except ValueError:
            return {"error": (p.stderr or p.stdout).strip()[-300:]}
        out = {k: st.get(k) for k in ("orig_mem", "stored_mem", "ratio", "errors", "reads", "writes",
                                      "pingpong", "warm_pages", "cold_pages", "same_pages",
                                      "pool_pages", "disk_pages", "returned_pages",
                                      "returned_pool_pages", "returned_demotions",
                                      "recompress_backlog", "recompressed_pages_total",
                                      "recompress_cpu_seconds_total", "kernel_freed_pages",
                                      "warm_stored", "cold_stored", "meta_bytes", "meta",
                                      "pool_resident_bytes", "pool_bytes", "hot_cache_bytes",
                                      "unique_blobs", "dedup_hits")}
        server = st.get("server") or {}
        out["datapath"] = server.get("datapath")
        out["swap_map"] = server.get("swap_map")
        out["server_rss"] = self.store_bytes()
        return out

    def held(self) -> dict:
        # the control socket, not a CLI process: a sample must not cost the sandboxes a CPU
        from agentzip_blk.datapath.control import request

        try:
            st = request(os.path.join(self.run_dir, "control.sock"), "stats", timeout=30)
        except Exception:  # noqa: BLE001 - a missed sample, not a failed trial
            return {}
        return {"held_pool": st.get("pool_pages", 0) * PAGE, "held_disk": st.get("disk_pages", 0) * PAGE,
                "held_returned_pool": st.get("returned_pool_pages", 0) * PAGE}

    def tuner_log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.run_dir, "tuner.log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------
# one trial: N sandboxes in the host under one configuration


class Trial:
    def __init__(self, bench: "Bench", n: int, swap, limited: bool):
        self.b, self.n, self.swap, self.limited = bench, n, swap, limited
        self.o = bench.opts
        self.abort = threading.Event()
        self.reason: str | None = None
        self.kind: str | None = None
        self.verify_error: str | None = None
        self.rounds: list[dict] = []
        self.lock = threading.Lock()
        self.host = None
        self.children: list = []
        self.sandboxes: list[Sandbox] = []
        self.limit_now: int | None = None
        self.loop_t0 = 0.0
        self.samples: list[dict] = []

    def fail(self, reason: str, kind: str) -> None:
        """End the trial: *kind* oom | died | build-timeout | round-timeout | verify."""
        with self.lock:
            if self.reason is None:
                self.reason, self.kind = reason, kind
                log(f"  {self.label()}: {reason}")
        self.abort.set()

    def label(self) -> str:
        return f"{self.swap.name if self.limited else 'nolimit'} N={self.n}"

    # -- the host's accountant and the watchdog ---------------------------------------------------

    def _watch(self, stop: threading.Event) -> None:
        """Twice a second: the host limit follows L - what swap keeps in RAM; deaths and OOM kills
        end the trial."""
        while not stop.wait(0.5):
            if self.limited:
                store = self.swap.store_bytes()
                want = max(self.o.limit // 8, self.o.limit - store)
                if self.limit_now is None or abs(want - self.limit_now) >= MiB:
                    if set_limit_quiet(self.host, want):
                        self.limit_now = want
            kills = oom_kills(self.host) + sum(oom_kills(c) for c in self.children)
            if kills:
                self.fail(f"OOM kill ({kills})", "oom")
            for sb in list(self.sandboxes):
                rc = sb.proc.poll()
                if rc is not None and not self.abort.is_set():
                    time.sleep(0.3)  # an OOM kill is counted just after the death
                    if oom_kills(self.host) + sum(oom_kills(c) for c in self.children):
                        continue  # the next tick names it
                    self.fail(f"sandbox {sb.spec.index} ({sb.spec.kind}) exited with {rc}"
                              f"{' (SIGBUS: swap I/O error)' if rc == -7 else ''}: {sb.stderr_tail()}",
                              "died")

    # -- phases -------------------------------------------------------------------------------------

    def _build(self, specs: list[SandboxSpec]) -> float:
        t0 = time.monotonic()
        todo = list(specs)
        todo_lock = threading.Lock()

        def worker() -> None:
            while not self.abort.is_set():
                with todo_lock:
                    if not todo:
                        return
                    spec = todo.pop(0)
                cg = child_cgroup(self.host, f"sandbox-{spec.index}")
                self.children.append(cg)
                cg.allow_swap()
                cg.set_swappiness(100)
                sb = Sandbox(spec, cg, self.b.tmp)
                self.sandboxes.append(sb)
                ready = sb.expect("READY", self.o.build_timeout, self.abort)
                if ready is None:
                    if not self.abort.is_set():
                        if sb.proc.poll() is None:
                            self.fail(f"sandbox {spec.index} ({spec.kind}) not built within "
                                      f"{self.o.build_timeout:.0f}s", "build-timeout")
                        else:
                            time.sleep(1.5)  # let the watchdog name the OOM kill first
                            self.fail(f"sandbox {spec.index} ({spec.kind}) exited while building "
                                      f"({sb.proc.returncode}): {sb.stderr_tail()}", "died")
                    return
                sb.ready_bytes = int(ready[1])

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.o.build_parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    def _agent(self, sb: Sandbox, t_end: float) -> None:
        """The agent loop of one sandbox: think, act, record; the same seeded rounds in every trial."""
        rng = random.Random(f"{self.o.seed}-{sb.spec.index}")
        k = 0
        while not self.abort.is_set():
            think = rng.uniform(*self.o.think)
            round_seed = rng.randrange(1 << 30)
            t0 = time.monotonic()
            if t0 + think >= t_end or self.abort.wait(think):
                return
            t1 = time.monotonic()
            flt0 = proc_majflt(sb.proc.pid)
            if not sb.send(f"ROUND {round_seed} {self.o.ws_fraction} {self.o.transient_mib}"):
                return  # died: the watchdog reports it
            parts = sb.expect("ROUND", self.o.round_timeout, self.abort)
            t2 = time.monotonic()
            faults = proc_majflt(sb.proc.pid) - flt0
            if parts is None:
                if not self.abort.is_set() and sb.proc.poll() is None:
                    self.fail(f"sandbox {sb.spec.index}: no ROUND reply within {self.o.round_timeout:.0f}s",
                              "round-timeout")
                return
            if parts[1] != "ok":
                msg = f"sandbox {sb.spec.index} ({sb.spec.kind}) round {k}: {' '.join(parts)}"
                with self.lock:
                    self.verify_error = self.verify_error or msg
                self.fail(f"VERIFY FAILED: {msg}", "verify")
                return
            with self.lock:
                self.rounds.append({"sandbox": sb.spec.index, "kind": sb.spec.kind, "k": k,
                                    "at_s": t1 - self.loop_t0, "think_s": t1 - t0,
                                    "act_s": t2 - t1, "round_s": t2 - t0, "majflt": faults,
                                    "act_inner_s": float(parts[2]), "items": int(parts[3]),
                                    "bytes": int(parts[4])})
            k += 1

    def _sampler(self, stop: threading.Event, t_start: float) -> None:
        pids = self.swap.server_pids()
        n = 0
        while not stop.wait(2.0):
            sample = {"t": round(time.monotonic() - t_start, 1), "usage": self.host.usage(),
                      "limit": self.limit_now, "store": self.swap.store_bytes(),
                      "swap": self.host.swap_usage(),
                      "server_cpu_s": sum(proc_cpu(p) for p in pids)}
            if n % 4 == 0:  # every 8 s, as the issue sampled it: what the store holds where
                sample.update(self.swap.held())
                sample["proc_swaps"] = sum(a.used for a in procfs.swaps())
            self.samples.append(sample)
            n += 1

    def run(self) -> dict:
        from agentzip_blk.cgroups.fs import MemoryCgroup

        o = self.o
        specs = sandbox_specs(self.n, o, self.b.python)
        res: dict = {"n": self.n, "config": self.swap.name if self.limited else "nolimit"}
        t_trial = time.monotonic()
        stop = threading.Event()
        watchdog = None
        try:
            self.host = MemoryCgroup.create(self.b.host_name)
            self.host.allow_swap()
            self.host.set_swappiness(100)
            if self.limited:
                self.host.set_limit(o.limit)
                self.limit_now = o.limit
            watchdog = threading.Thread(target=self._watch, args=(stop,), daemon=True)
            watchdog.start()
            res["build_s"] = round(self._build(specs), 1)
            res["ready_mib"] = round(sum(sb.ready_bytes for sb in self.sandboxes) / MiB, 1)
            res["usage_after_build_mib"] = round(self.host.usage() / MiB, 1)
            if not self.abort.is_set():
                self._loop(res)
        finally:
            stop.set()
            if watchdog:
                watchdog.join()
            self.release()
        res["trial_s"] = round(time.monotonic() - t_trial, 1)
        res["failure"] = self.reason
        res["failure_kind"] = self.kind
        res["verify_error"] = self.verify_error
        acts = [r["act_s"] for r in self.rounds]
        wall = [r["round_s"] for r in self.rounds]
        res.update(rounds=len(self.rounds), sandboxes_built=len([s for s in self.sandboxes if s.ready_bytes]),
                   p50_round_s=pct(wall, 50), p99_round_s=pct(wall, 99), max_round_s=max(wall, default=None),
                   p50_act_s=pct(acts, 50), p99_act_s=pct(acts, 99), max_act_s=max(acts, default=None),
                   per_kind_p99_act_s={k: pct([r["act_s"] for r in self.rounds if r["kind"] == k], 99)
                                       for k in KINDS})
        # A sandbox's first act faults back what the build pushed out while it idled: the
        # burst that sets the p99 on a slow swap device (BENCHMARKS.md, "The first act")
        first = [r["act_s"] for r in self.rounds if r["k"] == 0]
        later = [r["act_s"] for r in self.rounds if r["k"] > 0]
        res.update(first_act_mean_s=sum(first) / len(first) if first else None,
                   first_act_max_s=max(first, default=None),
                   later_act_mean_s=sum(later) / len(later) if later else None)
        return res

    def _loop(self, res: dict) -> None:
        o = self.o
        vm0, cpu0 = vmstat(), machine_busy()
        pids = self.swap.server_pids()
        srv0 = sum(proc_cpu(p) for p in pids)
        t0 = self.loop_t0 = time.monotonic()
        t_end = t0 + o.duration
        stop = threading.Event()
        sampler = threading.Thread(target=self._sampler, args=(stop, t0), daemon=True)
        sampler.start()
        agents = [threading.Thread(target=self._agent, args=(sb, t_end), daemon=True) for sb in self.sandboxes]
        for a in agents:
            a.start()
        for a in agents:
            a.join()
        stop.set()
        sampler.join()
        dt = max(1e-6, time.monotonic() - t0)
        vm1, cpu1 = vmstat(), machine_busy()
        srv1 = sum(proc_cpu(p) for p in pids)
        res.update(
            loop_s=round(dt, 1),
            loop_t0_monotonic=round(t0, 4),
            swap_in_mib_s=round((vm1["pswpin"] - vm0["pswpin"]) * PAGE / MiB / dt, 2),
            swap_out_mib_s=round((vm1["pswpout"] - vm0["pswpout"]) * PAGE / MiB / dt, 2),
            # the kernel's swap readahead over the loop: pages read ahead, and how many of
            # them a fault then found (zram reads no pages ahead)
            swap_ra_pages=vm1.get("swap_ra", 0) - vm0.get("swap_ra", 0),
            swap_ra_hits=vm1.get("swap_ra_hit", 0) - vm0.get("swap_ra_hit", 0),
            server_cpu=round((srv1 - srv0) / dt, 3) if pids else None,
            machine_cpu=round((cpu1[0] - cpu0[0]) / max(1e-6, cpu1[1] - cpu0[1]), 3),
            majflt=sum(c.stat().get("total_pgmajfault", c.stat().get("pgmajfault", 0)) for c in self.children),
            usage_end_mib=round(self.host.usage() / MiB, 1),
            swap_end_mib=round(self.host.swap_usage() / MiB, 1),
            store_end_mib=round(self.swap.store_bytes() / MiB, 1),
            # what the kernel's swap areas hold (stale slots included), against the store's
            # orig_mem and the sandboxes' swap (swap_end_mib): issue "hold only what the
            # kernel still needs"
            proc_swaps_used_mib=round(sum(a.used for a in procfs.swaps()) / MiB, 1),
            limit_end_mib=round(self.limit_now / MiB, 1) if self.limit_now else None,
            device=self.swap.stats() if self.limited else {},
            peak=peak_held(self.samples),
            samples=self.samples,
            # every round, for finding when the slow ones ran (at_s: the act's start, from
            # the start of the loop)
            round_log=[{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                       for r in self.rounds],
        )

    def release(self) -> None:
        """Kill our workloads and remove their cgroups and the host (limits lifted first)."""
        for sb in self.sandboxes:
            sb.kill()
        for cg in reversed(self.children):
            try:
                cg.remove()
            except Exception as e:  # noqa: BLE001 - report, keep cleaning
                log(f"cannot remove {cg.path}: {e}")
        self.children.clear()
        if self.host is not None:
            try:
                set_limit_quiet(self.host, None)
                self.host.remove()
            except Exception as e:  # noqa: BLE001
                log(f"cannot remove {self.host.path}: {e}")
            self.host = None


# ---------------------------------------------------------------------------------------
# the search


class Bench:
    def __init__(self, opts: Options, tmp: str):
        self.opts, self.tmp = opts, tmp
        self.python = sys.executable
        self.host_name = f"azdens-{os.getpid()}"
        self.baseline: dict[int, dict] = {}
        self.results: dict[str, dict] = {}
        self.t0 = time.monotonic()

    def elapsed(self) -> str:
        return f"{(time.monotonic() - self.t0) / 60:.1f} min"

    def make_swap(self, name: str):
        o = self.opts
        if name == "noswap":
            return NoSwap()
        if name == "zram":
            return Zram(o.swap_size)
        glob = f"{self.host_name}/sandbox-*"
        return Agentzip(self.tmp, o.swap_size, tuned=name == "agentzip-tuned", scope_glob=glob)

    def trial(self, swap, n: int, limited: bool) -> dict:
        others = active_swaps()
        if others:
            raise SystemExit(f"bench_density: other swap areas are active ({', '.join(others)}); "
                             "each configuration must be the only swap")
        log(f"[{self.elapsed()}] {swap.name if limited else 'nolimit'} N={n}: start")
        res: dict = {}
        try:
            swap.attach()
            res = Trial(self, n, swap, limited).run()
        finally:
            swap.detach()
            left = active_swaps()
            if left:
                raise RuntimeError(f"swap areas left after {swap.name}: {left}")
        for attr in ("up_s", "down_s"):
            if hasattr(swap, attr):
                res[attr] = round(getattr(swap, attr), 1)
        if getattr(swap, "tuned", False):
            res["tuner_log_tail"] = swap.tuner_log_tail()
        if res.get("verify_error"):
            raise VerifyError(res["verify_error"])
        return res

    def base(self, n: int) -> dict:
        if n not in self.baseline:
            r = self.trial(NoSwap(), n, limited=False)
            if r["failure"]:
                raise RuntimeError(f"the no-limit baseline failed at N={n}: {r['failure']}")
            self.baseline[n] = r
            log(f"  nolimit N={n}: p99 round {r['p99_round_s']:.2f}s, act {r['p99_act_s']:.3f}s, "
                f"{r['rounds']} rounds, machine CPU {r['machine_cpu']:.0%}")
        return self.baseline[n]

    def holds(self, name: str, n: int) -> bool:
        base = self.base(n)
        r = self.trial(self.make_swap(name), n, limited=True)
        bound = BOUND * base["p99_round_s"]
        r["bound_s"] = round(bound, 4)
        r["baseline_p99_round_s"] = base["p99_round_s"]
        ok = r["failure"] is None and r["rounds"] > 0 and r["p99_round_s"] <= bound
        if r["failure"] is None and not ok:
            r["failure_kind"] = "p99"
            r["failure"] = f"p99 round {r['p99_round_s']:.2f}s > {BOUND}x {base['p99_round_s']:.2f}s"
        r["holds"] = ok
        # the stricter reading, reported beside it: act alone (no think) against the baseline's act
        r["act_ratio"] = round(r["p99_act_s"] / base["p99_act_s"], 3) if r["p99_act_s"] else None
        r["holds_on_act"] = (r["failure_kind"] in (None, "p99") and r["rounds"] > 0
                             and r["p99_act_s"] <= BOUND * base["p99_act_s"])
        self.results.setdefault(name, {"trials": {}})["trials"][n] = r
        p99 = f"{r['p99_round_s']:.2f}s" if r["p99_round_s"] is not None else "-"
        log(f"  {name} N={n}: {'HOLDS' if ok else 'fails'}: p99 round {p99} (bound {bound:.2f}s), "
            f"p99 act {r['p99_act_s'] or 0:.3f}s vs {base['p99_act_s']:.3f}s, first acts "
            f"{r['first_act_mean_s'] or 0:.2f}s (max {r['first_act_max_s'] or 0:.2f}s), later "
            f"{r['later_act_mean_s'] or 0:.2f}s, swap in/out "
            f"{r.get('swap_in_mib_s', 0)}/{r.get('swap_out_mib_s', 0)} MiB/s, server CPU "
            f"{r.get('server_cpu')}, device ratio {_fmt((r.get('device') or {}).get('ratio'))}"
            + (f"; {r['failure']}" if r["failure"] else ""))
        if r.get("peak"):
            pk = r["peak"]
            log(f"    at peak swap ({pk['swap_mib']} MiB out, t={pk['t']}s): in memory {pk['pool_mib']} MiB "
                f"({pk['pool_over_swap']}x), on disk {pk['disk_mib']} MiB, /proc/swaps {pk['proc_swaps_mib']} MiB, "
                f"device memory {pk['device_mem_per_swap']} MiB per MiB out")
        return ok

    def search(self, name: str, start: int) -> int:
        o = self.opts
        if o.quick_ns:
            held = [n for n in o.quick_ns if self.holds(name, n)]
            return max(held, default=0)
        lo, hi, n = 0, None, max(1, start)
        while hi is None and n <= o.max_n:
            if self.holds(name, n):
                lo, n = n, n * 2
            else:
                hi = n
        if hi is None:
            return lo
        while hi - lo > max(1, int(lo * o.resolution)):
            mid = (lo + hi) // 2
            if self.holds(name, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def run(self) -> dict:
        start = self.opts.start
        for name in self.opts.configs:
            d = self.search(name, start)
            self.results.setdefault(name, {"trials": {}})["density"] = d
            log(f"[{self.elapsed()}] {name}: density {d}")
            start = max(start, d)  # the next configuration starts where this one held
        return self.results


# ---------------------------------------------------------------------------------------
# report


def summarize(results: dict, baseline: dict, opts: Options) -> dict:
    dens = {k: v.get("density", 0) for k, v in results.items()}
    L = opts.limit
    out = {}
    for k, d in dens.items():
        out[k] = {"density": d, "memory_per_sandbox_mib": round(L / d / MiB, 1) if d else None,
                  "vs_noswap": round(d / dens["noswap"], 2) if dens.get("noswap") else None,
                  "vs_zram": round(d / dens["zram"], 2) if dens.get("zram") else None}
        out[k]["p99_round_s_by_n"] = {int(n): r["p99_round_s"] for n, r in results[k]["trials"].items()}
        acts = [n for n, r in results[k]["trials"].items() if r.get("holds_on_act")]
        out[k]["act_only_largest_n"] = max(acts, default=0)
        d_az = dens.get("agentzip")
        at_az = results[k]["trials"].get(d_az) if d_az else None
        if at_az:
            out[k]["p99_round_s_at_defaults_density"] = at_az["p99_round_s"]
        held = results[k]["trials"].get(d) if d else None
        if held:
            out[k]["p99_round_s_at_density"] = held["p99_round_s"]
            out[k]["p99_act_s_at_density"] = held["p99_act_s"]
    return out


def _fmt(x, spec=".2f", dash="-"):
    return dash if x is None else format(x, spec)


def markdown(doc: dict) -> str:
    o = doc["options"]
    s = doc["summary"]
    lines = [BEGIN, "## Density: how many agent sandboxes fit in the same memory", "",
             f"Generated by `bench/density.py` on {doc['finished']}; machine: Linux "
             f"{doc['machine']['kernel']}, {doc['machine']['cpus']} CPUs. Command (as root; it holds "
             f"{SWAP_LOCK} for the whole run), wall time **{doc['wall_s'] / 60:.1f} min**:", "",
             f"    {doc['command']}", "",
             f"The host: a memory cgroup with limit L = {o['limit'] / MiB:.0f} MiB, minus what the swap "
             "device keeps in RAM (zram's mem_used_total, the agentzip-blk server's RSS), re-set twice a "
             "second. N sandboxes in child cgroups, a balanced seeded mix of JSON tool calling "
             f"({o['mb']['agent_json']} MiB), pandas ({o['mb']['pandas']} MiB) and Node.js text "
             f"({o['mb']['node_text']} MiB) (no Chromium: the time budget). Each runs an agent loop for "
             f"{o['duration']:.0f} s once all are built: think {o['think'][0]:g}-{o['think'][1]:g} s, then "
             f"act: verify the digests of a skewed {o['ws_fraction']:.0%} of its items (4 in 5 from the "
             f"newest fifth) and process a {o['transient_mib']:g} MiB transient copy of them. Round = think "
             f"+ act. A configuration holds at N when no sandbox was OOM-killed or died, every round "
             f"verified and p99 round <= {BOUND}x the p99 of the same N without limit or swap "
             "(measured in the same run). N doubles, then bisects.", "",
             "| configuration | density (sandboxes) | memory per sandbox (L / density) | vs no swap "
             "| vs zram | p99 round at density | p99 act at density | largest N tried holding on act alone |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in CONFIGS:
        if k not in s:
            continue
        v = s[k]
        lines.append(f"| {k} | {v['density']} | {_fmt(v['memory_per_sandbox_mib'], '.0f')} MiB | "
                     f"{_fmt(v['vs_noswap'])}x | {_fmt(v['vs_zram'])}x | "
                     f"{_fmt(v.get('p99_round_s_at_density'))} s | {_fmt(v.get('p99_act_s_at_density'), '.3f')} s | "
                     f"{v.get('act_only_largest_n', '-')} |")
    lines += ["", "Every trial (nolimit = the baseline; rates over the loop phase; server CPU is a share "
              "of one CPU; device ratio = orig / stored at the end of the loop):", "",
              "| configuration | N | holds | p50 / p99 round s | bound s | p50 / p99 act s | act p99 vs "
              "baseline | rounds | swap in / out MiB/s | server CPU | machine CPU | device ratio | store MiB "
              "| build s | why not |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = [("nolimit", n, r) for n, r in sorted(doc["baseline"].items(), key=lambda x: int(x[0]))]
    for k in CONFIGS:
        for n, r in sorted(doc["configs"].get(k, {}).get("trials", {}).items(), key=lambda x: int(x[0])):
            rows.append((k, n, r))
    for k, n, r in rows:
        dev = r.get("device") or {}
        lines.append(
            f"| {k} | {n} | {'-' if k == 'nolimit' else ('yes' if r.get('holds') else 'no')} | "
            f"{_fmt(r.get('p50_round_s'))} / {_fmt(r.get('p99_round_s'))} | {_fmt(r.get('bound_s'))} | "
            f"{_fmt(r.get('p50_act_s'), '.3f')} / {_fmt(r.get('p99_act_s'), '.3f')} | "
            f"{_fmt(r.get('act_ratio'))}{'x' if r.get('act_ratio') else ''} | {r.get('rounds', 0)} | "
            f"{_fmt(r.get('swap_in_mib_s'), '.1f')} / {_fmt(r.get('swap_out_mib_s'), '.1f')} | "
            f"{_fmt(r.get('server_cpu'), '.0%')} | {_fmt(r.get('machine_cpu'), '.0%')} | "
            f"{_fmt(dev.get('ratio'))} | {_fmt(r.get('store_end_mib'), '.0f')} | {_fmt(r.get('build_s'), '.0f')} | "
            f"{(r.get('failure') or '').replace('|', '/')[:90]} |")
    lines += ["", "![p99 round time against N per configuration](docs/density.png)", ""]
    lines += targets(s)
    lines += doc.get("notes", [])
    lines.append(END)
    return "\n".join(lines)


def targets(s: dict) -> list[str]:
    """The issue's targets, met or missed, with the figures."""
    if not all(k in s for k in CONFIGS):
        return []
    az, tz, z, ns = s["agentzip"], s["agentzip-tuned"], s["zram"], s["noswap"]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    out = ["Targets (issue 18):", ""]
    if ns["density"] and z["density"]:
        out.append(f"- agentzip-blk >= 2.5x the sandboxes of no swap: {verdict(az['vs_noswap'] >= 2.5)} "
                   f"({az['density']} vs {ns['density']}: {az['vs_noswap']:.2f}x; with the tuner "
                   f"{tz['vs_noswap']:.2f}x)")
        out.append(f"- agentzip-blk >= 1.4x the sandboxes of zram lz4: {verdict(az['vs_zram'] >= 1.4)} "
                   f"({az['density']} vs {z['density']}: {az['vs_zram']:.2f}x; with the tuner "
                   f"{tz['vs_zram']:.2f}x)")
    # the p99 of both at the tuner's density (the defaults were tried there on the way down)
    n = tz["density"]
    p_t = {int(k): v for k, v in tz.get("p99_round_s_by_n", {}).items()}.get(n)
    p_a = {int(k): v for k, v in az.get("p99_round_s_by_n", {}).items()}.get(n)
    lower = p_t is not None and p_a is not None and p_t < p_a
    out.append(f"- the tuner holds at least as many as the defaults, at a lower p99: "
               f"{verdict(tz['density'] >= az['density'] and lower)} ({tz['density']} vs {az['density']}; "
               f"p99 round at N = {n}: {_fmt(p_t)} s with the tuner vs {_fmt(p_a)} s at the defaults)")
    out.append("")
    return out


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"nolimit": "#444444", "noswap": "#d62728", "zram": "#1f77b4", "agentzip": "#2ca02c",
              "agentzip-tuned": "#9467bd"}
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    base = sorted((int(n), r["p99_round_s"]) for n, r in doc["baseline"].items())
    if base:
        xs, ys = zip(*base)
        ax.plot(xs, ys, "o-", color=colors["nolimit"], label="no limit, no swap (baseline)")
        ax.plot(xs, [BOUND * y for y in ys], "--", color=colors["nolimit"], alpha=0.7,
                label=f"{BOUND}x baseline p99 (the bound)")
    allp = [BOUND * y for _, y in base] + [r["p99_round_s"] for k in CONFIGS
                                           for r in doc["configs"].get(k, {}).get("trials", {}).values()
                                           if r.get("p99_round_s") is not None]
    ymax = max(allp or [1.0]) * 1.35
    ymin = min(allp or [1.0]) * 0.6
    for k in CONFIGS:
        trials = doc["configs"].get(k, {}).get("trials", {})
        pts = sorted((int(n), r) for n, r in trials.items())
        if not pts:
            continue
        measured = [(n, r) for n, r in pts if r.get("p99_round_s") is not None]
        ax.plot([n for n, _ in measured], [r["p99_round_s"] for _, r in measured], "o-", color=colors[k],
                label=f"{k} (density {doc['configs'][k].get('density')})")
        for n, r in pts:
            if r.get("holds"):
                continue
            if r.get("p99_round_s") is not None:
                ax.plot([n], [r["p99_round_s"]], "x", color=colors[k], markersize=11, mew=2.5)
            else:  # ended before any round: OOM kill (or thrashing), drawn at the top
                y = ymax / 1.25
                ax.plot([n], [y], "x", color=colors[k], markersize=11, mew=2.5)
                ax.annotate((r.get("failure_kind") or "failed").replace("oom", "OOM"), (n, y),
                            textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7,
                            color=colors[k])
    ax.set_yscale("log")
    ax.set_ylim(ymin, ymax)
    ticks = [t for t in (1, 2, 3, 5, 8, 10, 12, 15, 20, 30, 50, 80, 100, 200) if ymin <= t <= ymax]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("sandboxes in the host (N)")
    ax.set_ylabel("p99 round time, think + act (s, log scale) - lower is better")
    ax.set_title(f"Agent sandboxes in {doc['options']['limit'] / MiB:.0f} MiB: p99 round time vs N "
                 "(x = does not hold)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: two N values, short loops")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--limit", type=int, metavar="MiB", help="L, the host's memory (1536)")
    ap.add_argument("--duration", type=float, metavar="S", help="agent loop seconds per trial (60)")
    ap.add_argument("--start", type=int, help="first N of the doubling (4)")
    ap.add_argument("--max-n", type=int, help="largest N tried (64)")
    ap.add_argument("--ns", help="quick/fixed mode: comma list of N (no search)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--swap-size", type=int, metavar="MiB",
                    help="zram's disksize and agentzip-blk's device.size (8192): above half "
                         "full, the kernel frees a slot at swap-in (vm_swap_full)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config key for agentzip-blk (compression, policy or device), e.g. "
                         "compression.warm_algorithm=none; repeatable")
    ap.add_argument("--workdir", help="where the run's temporary state goes (/tmp)")
    ap.add_argument("--json", default=None, help="results/bench_density.json (quick: none)")
    ap.add_argument("--png", default=None, help="docs/density.png (quick: none)")
    ap.add_argument("--md", default=os.path.join(REPO, "BENCHMARKS.md"))
    ap.add_argument("--no-md", action="store_true",
                    help="do not touch BENCHMARKS.md or its chart (docs/density.png) unless --png")
    ap.add_argument("--from-json", metavar="PATH", help="only regenerate the section and plot")
    return ap.parse_args(argv)


def options_from(a) -> Options:
    o = quick_options() if a.quick else Options()
    o.configs = tuple(c for c in a.configs.split(",") if c)
    bad = [c for c in o.configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"bench_density: unknown configuration(s) {', '.join(bad)}")
    if a.limit:
        o.limit = a.limit * MiB
    if a.swap_size:
        o.swap_size = a.swap_size * MiB
    for k in ("duration", "start", "max_n", "seed", "workdir"):
        if getattr(a, k) is not None:
            setattr(o, k, getattr(a, k))
    if a.ns:
        o.quick_ns = tuple(int(x) for x in a.ns.split(","))
    return o


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    for item in a.set:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in ("compression", "policy", "device") \
                or key in ("device.run_dir", "device.size"):
            print(f"bench_density: --set {item!r}: use compression.KEY=VALUE, policy.KEY=VALUE "
                  "or device.KEY=VALUE (not run_dir or size: the bench sets those)",
                  file=sys.stderr)
            return 2
        EXTRA_CONFIG.setdefault(section, {})[name] = value
    if a.from_json:
        with open(a.from_json) as f:
            doc = json.load(f)
        results = {k: {"density": v["density"], "trials": {int(n): r for n, r in v["trials"].items()}}
                   for k, v in doc["configs"].items()}
        opts = Options(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in doc["options"].items()})
        doc["summary"] = summarize(results, {}, opts)
        if a.json:
            write_json(a.json, doc)
        if a.png or not a.no_md:
            plot(doc, a.png or os.path.join(REPO, "docs", "density.png"))
        if not a.no_md:
            replace_block(a.md, markdown(doc), BEGIN, END)
        return 0
    if os.geteuid() != 0:
        log("must run as root (cgroups, swap)")
        return 2
    opts = options_from(a)
    json_path = a.json or (None if a.quick else os.path.join(REPO, "results", "bench_density.json"))
    # the chart is the section's: a trial with --no-md leaves both as they are
    png_path = a.png or (None if a.quick or a.no_md else os.path.join(REPO, "docs", "density.png"))
    t0 = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc)
    tmp = tempfile.mkdtemp(prefix="azd-", dir=opts.workdir)
    doc: dict = {"command": "sudo .venv/bin/python -m bench density " + shlex.join(argv),
                 "started": started.strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": {"kernel": platform.release(), "cpus": os.cpu_count()},
                 "options": asdict(opts)}
    rc = 0
    bench = None

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with swap_lock(log) as waited:
            doc["lock_wait_s"] = round(waited, 1)
            t0 = time.monotonic()  # the run's wall time starts once the lock is ours
            bench = Bench(opts, tmp)
            try:
                bench.run()
            except VerifyError as e:
                log(f"FAILED: a sandbox read back wrong data: {e}")
                doc["verify_error"] = str(e)
                rc = 1
            except Exception as e:  # noqa: BLE001 - keep what was measured, say what broke
                log(f"FAILED: {type(e).__name__}: {e}")
                doc["error"] = f"{type(e).__name__}: {e}"
                rc = 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if active_swaps():  # never delete the state of a device that is still attached
            log(f"swap still active ({', '.join(active_swaps())}); keeping {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["finished"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc["baseline"] = {str(n): r for n, r in bench.baseline.items()}
    doc["configs"] = {k: {"density": v.get("density", 0),
                          "trials": {str(n): r for n, r in v["trials"].items()}}
                      for k, v in bench.results.items()}
    doc["summary"] = summarize(bench.results, bench.baseline, opts)
    doc["all_rounds_verified"] = "verify_error" not in doc
    doc["rounds_total"] = sum(r.get("rounds", 0) for r in bench.baseline.values()) + sum(
        r.get("rounds", 0) for v in bench.results.values() for r in v["trials"].values())
    print(json.dumps({"summary": doc["summary"], "wall_s": doc["wall_s"],
                      "all_rounds_verified": doc["all_rounds_verified"],
                      "rounds_total": doc["rounds_total"]}, indent=1))
    if json_path:
        write_json(json_path, doc)
    if png_path:
        plot(doc, png_path)
    if not a.quick and not a.no_md:
        replace_block(a.md, markdown(doc), BEGIN, END)
    return rc


if __name__ == "__main__":
    sys.exit(main())
