"""4 KiB read latency through the real server, with and without a scrape storm.

    .venv/bin/python -m bench scrape [--fill 256M] [--reads 3000] [--scrapers 50]

Starts nbdkit with the agentzip plugin (no swap, no loop device), fills the device with
agent-like pages, then times random 4 KiB NBD reads one at a time in three phases of the same
run, interleaved in `--rounds` rounds (each round runs every phase for a slice of the reads):

- ``quiet``: no scrapes (the reference);
- ``exporter``: `--scrapers` threads (in a process of their own, as the exporter is) each
  running the metrics exporter's fetch
  (fleet.metrics.control_stats: health, then `stats` with max_age, the cached snapshot) back
  to back, while the reads run;
- ``fresh``: the same threads sending plain `stats` (a snapshot taken after each request,
  shared by the requests waiting for one scan): what every scrape cost before the cache.

Prints p50/p99 per phase and the ratio to ``quiet``, and the scrapes answered.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sysconfig
import tempfile
import threading
import time

from agentzip_blk.config.quantities import parse_size
from agentzip_blk.datapath import control
from agentzip_blk.fleet.metrics import control_stats
from bench.harness.results import REPO as ROOT

PAGE = 4096


def page(n: int) -> bytes:
    rnd = random.Random(n)
    words = [b'{"role": "tool",', b'"content":', b'"result"', b"value", b"42,", str(n).encode()]
    return b" ".join(rnd.choice(words) for _ in range(PAGE))[:PAGE]


def start(tmp: str, size: int, dictionary: str) -> tuple[subprocess.Popen, str, str]:
    nbd_sock, ctl = os.path.join(tmp, "nbd.sock"), os.path.join(tmp, "control.sock")
    config = os.path.join(tmp, "config.yaml")
    with open(config, "w") as f:
        f.write(f"pool:\n  swap_out_path: {tmp}/disk-tier\n  max_size: 4G\n"
                f"compression:\n  dictionary: {dictionary}\n")
    # the venv's packages first, as `up` does (host.servercmd): Debian's python3-zstandard
    # 0.20 cannot read back the frames written (EIO on every frame read)
    paths = [ROOT, sysconfig.get_paths()["purelib"], os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p),
               OPENBLAS_NUM_THREADS="1")
    log = open(os.path.join(tmp, "nbdkit.log"), "wb")
    proc = subprocess.Popen(["nbdkit", "-f", "-U", nbd_sock, "python",
                             os.path.join(ROOT, "nbdkit", "agentzip_plugin.py"), f"size={size}",
                             f"control={ctl}", f"config={config}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while not (os.path.exists(nbd_sock) and os.path.exists(ctl)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"nbdkit did not come up: {open(log.name).read()[-2000:]}")
        time.sleep(0.05)
    return proc, nbd_sock, ctl


def timed_reads(h, pages: int, reads: int, seed: int) -> list[float]:
    rnd = random.Random(seed)
    out = []
    for _ in range(reads):
        slot = rnd.randrange(pages)
        t0 = time.perf_counter()
        data = h.pread(PAGE, slot * PAGE)
        out.append(time.perf_counter() - t0)
        if data != page(slot):
            raise SystemExit(f"slot {slot} read back wrong")
    return out


def _scrape_fn(kind: str, ctl: str):
    if kind == "exporter":
        return control_stats(ctl)
    return lambda: control.request(ctl, "stats", timeout=120)


def _storm_process(kind: str, ctl: str, scrapers: int, period: float, stop, answered) -> None:
    """In a process of its own, as the exporter is: `scrapers` threads that each scrape
    once per `period` seconds, all at the same time (a burst of `scrapers` concurrent
    requests each period); period 0: back to back."""
    fetch = _scrape_fn(kind, ctl)
    go = threading.Barrier(scrapers)

    def loop() -> None:
        while not stop.is_set():
            try:
                go.wait(timeout=period + 5)
            except threading.BrokenBarrierError:
                return
            t0 = time.monotonic()
            fetch()
            with answered.get_lock():
                answered.value += 1
            stop.wait(max(0.0, period - (time.monotonic() - t0)))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(scrapers)]
    for t in threads:
        t.start()
    stop.wait()
    go.abort()
    for t in threads:
        t.join(120)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q < 100 else max(values)


def main() -> int:
    import nbd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fill", default="256M")
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--scrapers", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the phases")
    ap.add_argument("--period", type=float, default=1.0,
                    help="seconds between one scraper's requests (0: back to back)")
    ap.add_argument("--dictionary", default="auto", help="compression.dictionary")
    args = ap.parse_args()
    fill = parse_size(args.fill)
    pages = fill // PAGE
    with tempfile.TemporaryDirectory(prefix="bench-scrape-") as tmp:
        proc, nbd_sock, ctl = start(tmp, max(2 * fill, 64 << 20), args.dictionary)
        try:
            h = nbd.NBD()
            h.connect_unix(nbd_sock)
            step = 64
            for first in range(0, pages, step):
                h.pwrite(b"".join(page(n) for n in range(first, min(first + step, pages))),
                         first * PAGE)
            t0 = time.perf_counter()
            control.request(ctl, "stats", timeout=120)
            scan = time.perf_counter() - t0
            timed_reads(h, pages, args.reads // args.rounds, seed=99)  # warm up
            phases = ["quiet", "exporter", "fresh"]
            lat: dict[str, list[float]] = {name: [] for name in phases}
            answered = {name: multiprocessing.Value("i", 0) for name in phases}
            # Interleaved: every round runs each phase for a slice of the reads, so that the
            # drift of a shared machine lands on all phases alike.
            for r in range(args.rounds):
                for n, name in enumerate(phases):
                    stop, proc_storm = multiprocessing.Event(), None
                    if name != "quiet":
                        proc_storm = multiprocessing.Process(
                            target=_storm_process,
                            args=(name, ctl, args.scrapers, args.period, stop, answered[name]))
                        proc_storm.start()
                        time.sleep(0.3)  # the threads up; the first burst comes then
                    lat[name] += timed_reads(h, pages, args.reads // args.rounds,
                                             seed=r * 10 + n)
                    stop.set()
                    if proc_storm is not None:
                        proc_storm.join(120)
            results = {name: (pct(v, 50), pct(v, 99), answered[name].value)
                       for name, v in lat.items()}
            h.shutdown()
        except BaseException:
            print(open(os.path.join(tmp, "nbdkit.log"), errors="replace").read()[-3000:])
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"fill {args.fill} ({pages} pages), {args.reads} reads per phase in {args.rounds} "
          f"interleaved rounds, "
          f"{args.scrapers} scrapers every {args.period} s; one full stats scan {scan * 1e3:.1f} ms")
    q50, q99, _ = results["quiet"]
    print(f"{'phase':10} {'p50 us':>8} {'p99 us':>8} {'p50 x':>6} {'p99 x':>6} {'scrapes':>8}")
    for name, (p50, p99, answered) in results.items():
        print(f"{name:10} {p50 * 1e6:8.0f} {p99 * 1e6:8.0f} {p50 / q50:6.2f} {p99 / q99:6.2f} "
              f"{answered:8d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
