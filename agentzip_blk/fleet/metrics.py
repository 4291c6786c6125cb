"""Prometheus exporter: ``agentzip-blk metrics [--listen HOST:PORT]`` (default metrics.listen,
127.0.0.1:9479: not OpenTelemetry's 9464), /metrics only (404 elsewhere).

Placement: a separate process that asks the server's control socket for ``stats`` on every
scrape, not an HTTP endpoint inside nbdkit. Why:

- The server is the one process that must never die or stall while swap points at it
  (processes get SIGBUS). An HTTP stack, prometheus_client and a scrape-driven thread inside
  it add code, threads and mlocked memory to that process for no data-path benefit; a bug or
  a slow client in the exporter here costs a scrape, never a page.
- The exporter can be restarted, upgraded, or run under another user/unit at any time; the
  server (``agentzip-blk.service``) must not restart while swap is attached.
- Per-cgroup figures need ``/proc/PID/pagemap`` of the sandboxes (root) and a walk of the
  cgroup tree: that is CLI-side work (``cgstats``), not the server's.
- Cost: one ``stats`` call per scrape, O(slots) numpy work under the store lock. Measured
  (1 GiB device, 65536 pages stored): ``stats`` 4.9 ms, a whole scrape over HTTP 16 ms; at a
  15 s scrape interval that is ~0.03 % of one core and one 5 ms pause of the request path.
  Latency, which a poller cannot sample, is kept in fixed buckets inside the server
  (``agentzip_blk.latency``, measured ~0.3 us per request on top of two perf_counter calls)
  and only copied out here.

Nothing is cached between scrapes except the per-cgroup table (``--cgroup-interval``,
default 30 s), because walking pagemaps is the expensive part.

Three things come from the exporter's side, not from ``stats``, because they must be known
while the server is down: ``agentzip_swap_attached`` (the run state's device is in
/proc/swaps: the alert "server down while swap is attached" needs it), the disk tier's
filesystem space and cap (``agentzip_disk_filesystem_*``, ``agentzip_disk_max_bytes``), and
``agentzip_build_info{version,server_version,python,nbdkit}`` (the exporter's package
version and Python, nbdkit from ``nbdkit --version`` once; server_version from ``stats``, the
code the server runs, which differs after an upgrade until a restart). ``agentzip_start_time_seconds`` is the server's start
(Unix time, from ``stats``): Prometheus derives uptime from it (``time() - ...``), and a
restart is a step in it, where an uptime gauge would only dip between two scrapes.

Names follow the Prometheus conventions: ``agentzip_`` prefix, base units (bytes, seconds),
``_total`` for counters (``_pages_total`` for pages), labels for kinds
(``agentzip_requests_total{op}``, ``agentzip_store_errors_total{reason}``), ``_ratio`` only for
a 0-1 share (``agentzip_memory_saving_ratio``). The names they replace are exported one more
release, "Deprecated" in their HELP (DEPRECATED_COUNTERS). ``agentzip_up`` is 0 when the server does not answer
its ``health`` verb within ``HEALTH_TIMEOUT`` (dead, stopped, or wedged behind the store lock),
and nothing else from the server is exported then.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Callable, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import MetricsHandler

log = logging.getLogger(__name__)

NS = "agentzip"
HEALTH_TIMEOUT = 2.0  # the same wait as `status` (host.health.HEALTH_TIMEOUT)
STATS_MAX_AGE = 5.0  # s: scrapes take the server's cached stats up to this old

# stats key -> (metric name, help). Gauges in bytes.
BYTE_GAUGES = [
    ("orig_mem", "orig_bytes", "Uncompressed size of the pages the device holds."),
    ("stored_mem", "stored_bytes",
     "Memory the store uses for them: pool arenas as allocated, metadata, dictionaries, hot cache."),
    ("pool_bytes", "pool_bytes", "Pool arenas as allocated."),
    ("pool_live_bytes", "pool_live_bytes", "Live cells in the pool arenas."),
    ("compressed_bytes", "compressed_bytes", "Compressed payload of all live blobs (pool and disk)."),
    ("meta_bytes", "meta_bytes", "Slot table, blob table and dedup index."),
    ("hot_cache_bytes", "hot_cache_bytes", "Uncompressed copies of hot pages."),
    ("max_size", "pool_max_bytes", "Hard cap of the in-memory pool (pool.max_size)."),
    ("disk_mem", "disk_bytes", "Size of the disk-tier file."),
    ("size", "device_size_bytes", "Logical size of the device."),
]
# stats key -> counter name (without _total), help
COUNTERS = [
    ("bytes_read", "read_bytes", "Bytes read by the client."),
    ("bytes_written", "written_bytes", "Bytes written by the client."),
    ("dedup_hits", "dedup_pages", "Pages stored as a reference to an identical page."),
    ("demotions", "demoted_pages", "Pages moved from the pool to the disk tier."),
    ("returned_demotions", "returned_demoted_pages",
     "Of the demoted pages, copies of pages read back and kept in RAM "
     "(policy.returned_to_disk)."),
    ("promotions", "promoted_pages", "Pages moved from the disk tier back to the pool."),
    ("pingpong", "pingpong_pages", "Pages written again within hot_threshold_ms of being read."),
    ("hot_hits", "hot_cache_hits", "Reads served from the hot-page cache."),
    ("direct_to_disk", "direct_to_disk_pages", "New pages written straight to disk (pool full)."),
    ("compactions", "compactions", "Pool compaction rounds."),
    ("pages_moved", "compaction_moved_pages", "Cells moved by compaction."),
    ("recompressed_pages_total", "recompressed_pages",
     "Warm pages the recompressor packed into the dense (cold) form."),
    ("recompress_cpu_seconds_total", "recompress_cpu_seconds",
     "CPU seconds the recompressor spent (policy.recompress_cpu bounds it)."),
]
# agentzip_requests_total{op}: stats key -> op
REQUEST_OPS = [("reads", "read"), ("writes", "write"), ("trims", "trim"), ("zeroes", "zero"),
               ("flushes", "flush")]
# agentzip_store_errors_total{reason}: stats key -> reason (checksum: checksum_errors())
ERROR_REASONS = [("errors", "io"), ("enospc", "no_space"), ("disk_full", "disk_full"),
                 ("disk_errors", "disk_io")]
# The names before 0.1.0's review (issue 29), exported one more release beside the new ones,
# "Deprecated" in their HELP: old counter name (without _total) -> (stats key, its successor).
DEPRECATED_COUNTERS = [
    ("reads", "reads", 'agentzip_requests_total{op="read"}'),
    ("writes", "writes", 'agentzip_requests_total{op="write"}'),
    ("trims", "trims", 'agentzip_requests_total{op="trim"}'),
    ("zeroes", "zeroes", 'agentzip_requests_total{op="zero"}'),
    ("flushes", "flushes", 'agentzip_requests_total{op="flush"}'),
    ("errors", "errors", 'agentzip_store_errors_total{reason="io"}'),
    ("enospc", "enospc", 'agentzip_store_errors_total{reason="no_space"}'),
    ("disk_full", "disk_full", 'agentzip_store_errors_total{reason="disk_full"}'),
    ("disk_errors", "disk_errors", 'agentzip_store_errors_total{reason="disk_io"}'),
    ("dedup_hits", "dedup_hits", "agentzip_dedup_pages_total"),
    ("demotions", "demotions", "agentzip_demoted_pages_total"),
    ("returned_demotions", "returned_demotions", "agentzip_returned_demoted_pages_total"),
    ("promotions", "promotions", "agentzip_promoted_pages_total"),
    ("pingpong", "pingpong", "agentzip_pingpong_pages_total"),
]
DEPRECATION = "Deprecated: use {new}; this name goes in the next release. "


def _n(name: str) -> str:
    return f"{NS}_{name}"


def stats_metrics(st: dict) -> Iterator[Metric]:
    """Metric families for one ``stats`` reply (pure: tests call it directly)."""
    for key, name, doc in BYTE_GAUGES:
        if key in st:
            yield GaugeMetricFamily(_n(name), doc, value=float(st[key]))
    orig, stored = float(st.get("orig_mem", 0) or 0), float(st.get("stored_mem", 0) or 0)
    yield GaugeMetricFamily(_n("memory_saving_ratio"), "Share of the swapped pages' size the "
                            "store saves, 0-1: 1 - stored_bytes / orig_bytes; 0 when empty or "
                            "when the store uses more than the pages' size (a few pages and "
                            "its tables). orig_bytes / stored_bytes is the compression factor.",
                            value=max(0.0, 1.0 - stored / orig) if orig > 0 else 0.0)
    yield GaugeMetricFamily(_n("compression_ratio"), DEPRECATION.format(
        new="agentzip_orig_bytes / agentzip_stored_bytes or agentzip_memory_saving_ratio")
        + "orig_bytes / stored_bytes (0 when empty).", value=float(st.get("ratio", 0.0)))
    yield GaugeMetricFamily(_n("pool_fragmentation_ratio"),
                            "Share of the allocated pool arenas not holding live cells.",
                            value=float(st.get("fragmentation", 0.0)))

    pages = GaugeMetricFamily(_n("pages"), "Pages on the device by kind.", labels=["kind"])
    for kind in ("same", "raw", "compressed"):
        pages.add_metric([kind], float(st.get(f"{kind}_pages", 0)))
    yield pages
    yield GaugeMetricFamily(_n("shared_pages"), "Pages that share a blob with another page.",
                            value=float(st.get("shared_pages", 0)))
    yield GaugeMetricFamily(_n("unique_blobs"), "Distinct stored blobs (after dedup).",
                            value=float(st.get("unique_blobs", 0)))

    codec = GaugeMetricFamily(_n("codec_pages"), "Pages by codec.", labels=["codec"])
    for name, n in sorted((st.get("codec_pages") or {}).items()):
        codec.add_metric([name], float(n))
    yield codec

    tiers = st.get("tiers") or {}
    tp = GaugeMetricFamily(_n("tier_pages"), "Pages by tier.", labels=["tier"])
    to = GaugeMetricFamily(_n("tier_orig_bytes"), "Uncompressed bytes by tier.", labels=["tier"])
    ts = GaugeMetricFamily(_n("tier_stored_bytes"), "Stored bytes by tier.", labels=["tier"])
    for tier in ("pool", "disk"):
        t = tiers.get(tier) or {}
        tp.add_metric([tier], float(t.get("pages", 0)))
        to.add_metric([tier], float(t.get("orig_bytes", 0)))
        ts.add_metric([tier], float(t.get("stored_bytes", 0)))
    yield from (tp, to, ts)

    form_pages = GaugeMetricFamily(_n("form_pages"), "Pages by form: warm (alone, fast codec), "
                                   "cold (dense frames), same-filled, disk.", labels=["form"])
    form_stored = GaugeMetricFamily(_n("form_stored_bytes"), "Compressed bytes by form "
                                    "(pool only).", labels=["form"])
    for form in ("warm", "cold"):
        form_pages.add_metric([form], float(st.get(f"{form}_pages", 0)))
        form_stored.add_metric([form], float(st.get(f"{form}_stored", 0)))
    form_pages.add_metric(["same"], float(st.get("same_pages", 0)))
    form_pages.add_metric(["disk"], float(st.get("disk_pages", 0)))
    yield from (form_pages, form_stored)
    yield GaugeMetricFamily(_n("recompress_backlog_pages"),
                            "Warm pages older than policy.cold_grace_period, not yet packed.",
                            value=float(st.get("recompress_backlog", 0)))
    returned = GaugeMetricFamily(_n("returned_pages"), "Pages read back and not written since, "
                                 "by where their copy is (pool or disk).", labels=["tier"])
    in_pool = st.get("returned_pool_pages", 0)
    returned.add_metric(["pool"], float(in_pool))
    returned.add_metric(["disk"], float(st.get("returned_pages", 0) - in_pool))
    yield returned

    temp = GaugeMetricFamily(_n("temperature_pages"), "Pages by temperature.",
                             labels=["temperature"])
    for name, n in sorted((st.get("temperature") or {}).items()):
        temp.add_metric([name], float(n))
    yield temp

    dp = GaugeMetricFamily(_n("dictionary_pages"), "Pages compressed with each loaded dictionary.",
                           labels=["dictionary", "source"])
    ds = GaugeMetricFamily(_n("dictionary_stored_bytes"),
                           "Compressed bytes of the pages using each dictionary.",
                           labels=["dictionary", "source"])
    for d in (st.get("dictionaries") or {}).get("in_use", []):
        labels = [str(d.get("name")), str(d.get("source", ""))]
        dp.add_metric(labels, float(d.get("pages", 0)))
        ds.add_metric(labels, float(d.get("stored_bytes", 0)))
    yield from (dp, ds)

    for key, name, doc in COUNTERS:
        if isinstance(st.get(key), (int, float)):
            yield CounterMetricFamily(_n(name), doc, value=float(st[key]))
    requests = CounterMetricFamily(_n("requests"), "Requests the server answered, by op "
                                   "(read: swap-in, write: swap-out, trim: discard).",
                                   labels=["op"])
    for key, op in REQUEST_OPS:
        requests.add_metric([op], float(_number(st.get(key))))
    yield requests
    # every reason always exported (0 from a server that does not count one), so that the
    # alerts have a series to watch
    errors = CounterMetricFamily(_n("store_errors"), "Failures by reason: io (a request "
                                 "answered EIO), no_space (a write refused: the store is "
                                 "full), disk_full (the disk tier refused an extent), disk_io (a "
                                 "disk-tier I/O error), checksum (a blob not matching its "
                                 "checksum or AEAD tag: EIO, never wrong bytes).",
                                 labels=["reason"])
    for key, reason in ERROR_REASONS:
        errors.add_metric([reason], float(_number(st.get(key))))
    errors.add_metric(["checksum"], float(checksum_errors(st)))
    yield errors
    for name, key, new in DEPRECATED_COUNTERS:
        if isinstance(st.get(key), (int, float)) and not isinstance(st.get(key), bool):
            yield CounterMetricFamily(_n(name), DEPRECATION.format(new=new), value=float(st[key]))
    yield CounterMetricFamily(_n("checksum_errors"), DEPRECATION.format(
        new='agentzip_store_errors_total{reason="checksum"}'), value=float(checksum_errors(st)))

    lat = st.get("latency")
    if lat:
        yield from latency_metrics(lat)

    srv = st.get("server") or {}
    if "rss_bytes" in srv:
        yield GaugeMetricFamily(_n("server_resident_bytes"), "Resident memory of the server.",
                                value=float(srv["rss_bytes"] or 0))
    if "locked_bytes" in srv:
        yield GaugeMetricFamily(_n("server_locked_bytes"), "mlocked memory of the server.",
                                value=float(srv["locked_bytes"] or 0))
    if "start_time_s" in srv:
        yield GaugeMetricFamily(_n("start_time_seconds"), "Unix time the server started.",
                                value=float(srv["start_time_s"]))
    if "restarts" in srv:  # handovers without swapoff (agentzip-blk restart)
        yield CounterMetricFamily(_n("server_restarts"), "Restarts of the server that kept "
                                  "its store (agentzip-blk restart).",
                                  value=float(srv["restarts"]))
    if "recoveries" in srv:  # a server started again by the holder after a crash
        yield CounterMetricFamily(_n("server_recoveries"), "Servers started again after a "
                                  "crash of the last one, from its memory (host.holder).",
                                  value=float(srv["recoveries"]))


def _number(v: object) -> float:
    """A counter's value from stats; 0 for what is missing or not a number."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def checksum_errors(st: dict) -> int:
    """The store's checksum-failure count, wherever its ``stats`` keeps it: a flat
    ``checksum_errors`` key, or ``errors`` as a dict with a ``checksum`` entry; 0 without one."""
    v = st.get("checksum_errors")
    if v is None and isinstance(st.get("errors"), dict):
        v = st["errors"].get("checksum")
    return int(v) if isinstance(v, (int, float)) else 0


def latency_metrics(lat: dict) -> Iterator[Metric]:
    """``agentzip_request_duration_seconds{op}`` from the server's non-cumulative buckets."""
    h = HistogramMetricFamily(_n("request_duration_seconds"),
                              "Time the store takes to serve a read (swap-in), write "
                              "(swap-out), trim or zero request, inside the server.",
                              labels=["op"])
    bounds = [float(b) for b in lat["buckets_s"]] + [float("inf")]
    for op in ("read", "write", "trim", "zero"):
        hist = lat.get(op)
        if not hist:
            continue
        cum, buckets = 0, []
        for bound, c in zip(bounds, hist["counts"]):
            cum += c
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cum)))
        h.add_metric([op], buckets, sum_value=float(hist["sum_s"]))
    yield h


def cgroup_metrics(res: dict) -> Iterator[Metric]:
    """Per scoped cgroup, from ``cgstats.collect``'s result."""
    o = GaugeMetricFamily(_n("cgroup_orig_bytes"), "Uncompressed bytes of a cgroup's pages on "
                          "the device (kernel zero pages included).", labels=["cgroup"])
    s = GaugeMetricFamily(_n("cgroup_stored_bytes"), "Compressed bytes of a cgroup's pages; a "
                          "blob shared by N slots counts 1/N.", labels=["cgroup"])
    p = GaugeMetricFamily(_n("cgroup_pages"), "A cgroup's swap entries on the device.",
                          labels=["cgroup"])
    for row in res.get("cgroups", []):
        o.add_metric([row["cgroup"]], float(row["orig_mem"]))
        s.add_metric([row["cgroup"]], float(row["stored_mem"]))
        p.add_metric([row["cgroup"]], float(row["pages"]))
    yield from (o, s, p)


@dataclass
class CgroupSource:
    """Per-cgroup figures for the enabled scopes, recomputed at most every *interval* s."""

    run_dir: str
    config_path: str | None = None
    cgroup_root: str = "/"
    interval: float = 30.0
    _at: float = field(default=-1e18, repr=False)
    _last: dict | None = field(default=None, repr=False)
    last_error: str | None = field(default=None, repr=False)

    def __call__(self) -> dict | None:
        now = time.monotonic()
        if now - self._at < self.interval:
            return self._last
        self._at = now
        try:
            self._last = self._collect()
            self.last_error = None
        except Exception as e:  # a scrape must still return the device metrics
            self._last, self.last_error = None, f"{type(e).__name__}: {e}"
            log.warning("per-cgroup stats: %s", self.last_error)
        return self._last

    def _collect(self) -> dict | None:
        from .. import procfs
        from ..cgroups import cgstats
        from ..cgroups.backends import open_backend
        from ..config import load_config
        from ..host.runstate import RunState

        state = RunState.load(self.run_dir)
        if state is None or not state.device or not state.control_socket:
            return None
        if procfs.swap_area(state.device) is None:
            return None
        globs = [s.cgroup for s in load_config(self.config_path).scopes if s.enabled]
        if not globs:
            return {"cgroups": []}
        return cgstats.collect(open_backend(self.cgroup_root), globs, state.control_socket,
                               state.device)


@dataclass
class HostSource:
    """What the exporter learns without the server: is our device swap now, and how full is
    the filesystem under the disk tier. Read on every scrape (a stat and /proc/swaps)."""

    run_dir: str
    config_path: str | None = None

    def __call__(self) -> dict:
        from .. import procfs
        from ..config import load_config
        from ..errors import SetupError
        from ..host.chain import stray_loops
        from ..host.runstate import RunState

        try:
            state = RunState.load(self.run_dir)
            attached = bool(state and procfs.swap_area(state.device))
        except SetupError:
            # state.json is root's: an exporter that is not (the DaemonSet's, the non-root
            # drop-in) finds our area by its loop device, whose backing file (world-readable
            # in sysfs) lies in RUN/mnt; so the server-down alert still has its series
            state = None
            attached = any(procfs.swap_area(loop) for loop in stray_loops(self.run_dir))
        out: dict = {"swap_attached": attached}
        try:
            # the config the server was started with, when the run state names it
            config = load_config((state and state.config_path) or self.config_path)
        except Exception as e:  # a bad config must not cost the scrape
            log.warning("config: %s", e)
            return out
        out["disk_max_bytes"] = config.pool.swap_out_max_size
        d = os.path.dirname(os.path.abspath(config.pool.swap_out_path))
        try:
            vfs = os.statvfs(d)
        except OSError:
            return out
        out["disk_fs_size_bytes"] = vfs.f_blocks * vfs.f_frsize
        out["disk_fs_avail_bytes"] = vfs.f_bavail * vfs.f_frsize
        return out


def host_metrics(h: dict) -> Iterator[Metric]:
    yield GaugeMetricFamily(_n("swap_attached"), "1 when the run state's device is active swap "
                            "(/proc/swaps), whether or not the server answers.",
                            value=1.0 if h.get("swap_attached") else 0.0)
    if "disk_max_bytes" in h:
        yield GaugeMetricFamily(_n("disk_max_bytes"), "Cap of the disk-tier file "
                                "(pool.swap_out_max_size; 0 = the filesystem's space).",
                                value=float(h["disk_max_bytes"]))
    if "disk_fs_size_bytes" in h:
        yield GaugeMetricFamily(_n("disk_filesystem_size_bytes"),
                                "Size of the filesystem holding the disk-tier file.",
                                value=float(h["disk_fs_size_bytes"]))
        yield GaugeMetricFamily(_n("disk_filesystem_avail_bytes"), "Space left for the disk "
                                "tier on its filesystem (statvfs f_bavail).",
                                value=float(h["disk_fs_avail_bytes"]))


def _nbdkit_version() -> str:
    exe = shutil.which("nbdkit")
    if not exe:
        return "none"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    parts = out.split()
    return parts[1] if len(parts) >= 2 else "unknown"  # "nbdkit 1.32.5"


@dataclass(frozen=True)
class BuildInfo:
    version: str
    python: str
    nbdkit: str

    @classmethod
    def detect(cls) -> BuildInfo:
        from .. import __version__

        return cls(__version__, platform.python_version(), _nbdkit_version())

    def metric(self, server_version: str | None = None) -> Metric:
        m = GaugeMetricFamily(_n("build_info"), "Always 1; the labels name the exporter's "
                              "agentzip-blk version, the server's (the code serving the "
                              "device: older until a restart after an upgrade; unknown while "
                              "it does not answer), the Python and the nbdkit on this host.",
                              labels=["version", "server_version", "python", "nbdkit"])
        m.add_metric([self.version, server_version or "unknown", self.python, self.nbdkit], 1.0)
        return m


class Collector:
    """prometheus_client custom collector: one ``stats`` request per scrape."""

    def __init__(self, stats_fn: Callable[[], dict],
                 cgroups_fn: Callable[[], dict | None] | None = None,
                 host_fn: Callable[[], dict] | None = None,
                 build: BuildInfo | None = None) -> None:
        self.stats_fn = stats_fn
        self.cgroups_fn = cgroups_fn
        self.host_fn = host_fn
        self.build = build

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        try:
            st = self.stats_fn()
        except Exception as e:  # server down: say so, export nothing stale
            log.warning("stats: %s", e)
            st = None
        yield GaugeMetricFamily(_n("up"), "1 when the server answered the health verb (which "
                                "waits for the store lock) and stats; 0 when it is dead, "
                                "stopped or wedged.", value=1.0 if st is not None else 0.0)
        if st is not None:
            yield from stats_metrics(st)
        if self.build is not None:
            yield self.build.metric(((st or {}).get("server") or {}).get("version"))
        if self.host_fn is not None:
            try:
                yield from host_metrics(self.host_fn())
            except Exception as e:  # /proc or the run state unreadable: the rest still counts
                log.warning("host figures: %s", e)
        if self.cgroups_fn is not None:
            res = self.cgroups_fn()
            ok = GaugeMetricFamily(_n("cgroup_stats_available"),
                                   "1 when per-cgroup figures were computed (device attached, "
                                   "running as root).", value=1.0 if res is not None else 0.0)
            yield ok
            if res is not None:
                yield from cgroup_metrics(res)
        yield GaugeMetricFamily(_n("scrape_duration_seconds"),
                                "Time this exporter spent collecting.",
                                value=time.perf_counter() - t0)


def control_stats(path: str) -> Callable[[], dict]:
    from ..datapath import control

    lock = threading.Lock()
    last: list = [None, float("-inf")]  # the last reply and when its fetch finished

    def fetch() -> dict:
        # Scrapes that come while a fetch is under way share its reply: a storm of
        # concurrent scrapes sends the server one health and one stats, not one each. A
        # scrape that finds no fetch running makes its own (so `up` follows the server).
        arrived = time.monotonic()
        with lock:
            if last[0] is not None and last[1] >= arrived:
                return dict(last[0])
            # ping is answered even while requests are wedged behind the store lock; health is not
            control.request(path, "health", timeout=HEALTH_TIMEOUT)
            # a cached snapshot (the server's maintainer keeps it young): scrapes scan nothing
            reply = dict(control.request(path, "stats", max_age=STATS_MAX_AGE))
            reply.pop("ok", None)
            last[0], last[1] = reply, time.monotonic()
            return dict(reply)
    return fetch


METRICS_PATH = "/metrics"


class _MetricsOnly(MetricsHandler):
    """The exposition on /metrics (any query string), 404 on every other path: a scraper
    pointed at the wrong path learns so, instead of a page of metrics that looks right."""

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path != METRICS_PATH:
            self.send_error(404, f"not found: agentzip-blk serves {METRICS_PATH} only")
            return
        super().do_GET()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        pass  # a scrape every 15 s is no news; errors still reach the log through `log`


def make_server(listen: tuple[str, int], collector: Collector) -> ThreadingHTTPServer:
    """An HTTP server answering /metrics with the exposition of *collector* alone (no
    process/platform collectors: this exporter is about the device). Port 0 picks one."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    handler = type("AgentzipMetricsHandler", (_MetricsOnly,), {"registry": registry})
    family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
    server_class = type("AgentzipHTTPServer", (ThreadingHTTPServer,),
                        {"address_family": family})
    server = server_class(listen, handler)
    server.daemon_threads = True
    return server


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (metrics.listen's syntax); ValueError naming --listen."""
    from ..config.load import parse_listen as parse
    from ..errors import ConfigError
    try:
        return parse(text, "--listen")
    except ConfigError as e:
        raise ValueError(str(e)) from None
