"""The /etc/agentzip/config.yaml schema: its sections as dataclasses, their defaults and limits.

Validation and loading are in `agentzip_blk.config.load`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CONFIG_PATH = "/etc/agentzip/config.yaml"

ALGORITHMS = ("zstd", "lz4", "lz4hc")
# Allowed compression levels per algorithm:
# - zstd 1-19: 20-22 ("ultra") need huge windows that buy nothing on 4 KiB pages; negative
#   "fast" levels are what lz4 is for.
# - lz4 0-16: plain lz4 has no level, so it is ignored, but it is still checked (lz4.frame's
#   range) so a typo is caught and switching algorithm back does not silently keep a bad value.
# - lz4hc 1-12: LZ4HC_CLEVEL_MAX is 12.
LEVEL_RANGES: dict[str, tuple[int, int]] = {"zstd": (1, 19), "lz4": (0, 16), "lz4hc": (1, 12)}
DICTIONARY_MODES = ("auto", "prebuilt", "none")
DEDUP_MODES = ("on", "off")
# The store, the codec framing and swap itself all work in 4 KiB pages; nothing else is supported.
SUPPORTED_PAGE_SIZE = 4096
MAX_FRAME_PAGES = 16  # pages one compressed frame may hold (the blob table's `sub` column)
MIN_SIZE = 1 << 20  # 1 MiB: anything smaller cannot hold a useful amount of swap
# 512 GiB (2^27 pages): the store names blobs with 32-bit ids, a page of a blob in 32 bits
# (store/dedup.py: 2^28 blobs of up to 16 pages); half of that for the slots leaves the other
# half for the blobs requests in flight stage before they release the old ones.
MAX_DEVICE_SIZE = 1 << 39
SWAP_PRIORITY_RANGE = (-1, 32767)  # swapon(8): -1 = kernel default, 0..32767 explicit

# Old spellings of keys, still accepted: (section, old key) -> new key. `doctor` flags them.
KEY_ALIASES: dict[tuple[str, str], str] = {("compression", "unit_pages"): "frame_pages"}


@dataclass
class CompressionConfig:
    algorithm: str = "zstd"
    level: int = 3
    dictionary: str | list[str] = "auto"  # "auto" | "prebuilt" | "none" | list of names
    page_size: int = SUPPORTED_PAGE_SIZE
    # pages per compressed frame (adjacent new pages of one write request); 1 = each alone
    frame_pages: int = 16
    # Share identical pages between slots (bytes compared, keyed hash: store/dedup.py). off:
    # no page is shared between slots, so whether another tenant holds a page cannot show.
    dedup: str = "on"
    # The fast codec a page is stored with alone when the kernel writes it (the warm form:
    # a fault decodes one page); the recompressor packs it into frames of `algorithm` once
    # nobody read it for policy.cold_grace_period. none: frames at once (one speed), the
    # default while packing costs more CPU than 2 shared vCPUs have under sustained swap:
    # lz4 halves the fault but lost the density benchmark (BENCHMARKS.md, "Two speeds").
    warm_algorithm: str = "none"


WARM_ALGORITHMS = ("lz4", "zstd", "none")  # zstd warm: level 1, no dictionary


@dataclass
class PoolConfig:
    max_size: int = 8 << 30
    reclaim_threshold: int = 80  # percent of max_size
    # the disk tier's file (AEAD-encrypted, recreated empty at start); None (null): no tier,
    # a full pool answers ENOSPC and the kernel keeps the page
    swap_out_path: str | None = "/var/lib/agentzip/swapfile"
    swap_out_max_size: int = 0  # bytes of disk tier; 0 = as much as the filesystem holds
    defrag: bool = True


@dataclass
class PolicyConfig:
    hot_threshold_ms: int = 1000
    warm_threshold_ms: int = 10000
    cold_grace_period: float = 30.0  # seconds
    hot_cache_size: int = 4 << 20  # bytes of uncompressed hot pages kept; 0 = no cache
    # the tuner's goal: percent of wall time some task of a scoped cgroup stalls on memory
    # (PSI "some"; on v1 estimated from refaults and major faults); it squeezes below it
    pressure_target: float = 0.1
    # CPUs' worth of thread time the recompressor may spend packing warm pages cold
    # (measured on its thread's CPU clock); 0: pages stay warm
    recompress_cpu: float = 0.25
    # Where a copy goes once its page has been read back and stayed in RAM for
    # warm_threshold_ms (docs/ARCHITECTURE.md, "What the kernel tells the device"): to the
    # disk tier while the host is under memory pressure (PSI), always, or never. `never` by
    # default: with `pressure` the density benchmark lost at N = 12 (refaults from the disk
    # tier are Python's slow path; BENCHMARKS.md "Returned copies").
    returned_to_disk: str = "never"


RETURNED_TO_DISK = ("pressure", "always", "never")


@dataclass
class Scope:
    cgroup: str  # fnmatch-style glob
    enabled: bool = True


@dataclass
class DeviceConfig:
    size: int = 8 << 30  # logical size of the block device
    swap_priority: int = 100
    run_dir: str = "/run/agentzip"
    # Flag the loop device rotational: the kernel then reads ahead neighbouring swap slots
    # (cluster readahead) instead of following the faulting process (VMA readahead). Fewer,
    # larger reads: a whole re-touch of A-like heaps 1.7x faster, but the single-fault
    # probe slower (8 slots per fault, often two frames to decompress) and B/D no faster.
    # It does not cause the memory-cgroup OOM kills once blamed on it (0 in 3 load runs with
    # it, 1 in 3 without: BENCHMARKS.md "Readahead"). Off by default; safe to turn on.
    rotational: bool = False
    # How the kernel reaches the server: kernel nbd (/dev/nbdN), or a loop device over a file
    # served by FUSE from the server process itself ("fuse"), or by nbdfuse over NBD
    # ("nbdfuse", the old chain, kept for comparison). auto: nbd where /dev/nbd0 exists.
    frontend: str = "auto"
    # Who answers the FUSE front door's reads of warm pages: the C extension's threads
    # without the GIL ("native", docs/ARCHITECTURE.md "The native request path"), or Python
    # ("python", the reference). auto: native where the extension was built.
    datapath: str = "auto"
    # Read the kernel's own book of our swap area's slots (si->swap_map, through a BPF
    # program that is loaded but never attached: datapath/swapmap.py) and forget the copies
    # of slots the kernel freed without telling the device (docs/ARCHITECTURE.md, "What the
    # kernel tells the device"). auto: where the kernel allows it (status says why not).
    swap_map: str = "auto"
    # The scheduling class of the FUSE workers while they wait for and answer reads on the
    # native path: "realtime" is SCHED_FIFO at priority 1, the lowest real-time one, so a
    # sandbox's fault is answered as soon as the request arrives instead of after the
    # sandboxes' slices (zram decompresses in the faulting task itself). Writes and anything
    # handed to Python run at the normal priority; the kernel's real-time throttling
    # (sched_rt_runtime_us) bounds the rest. Refused (no CAP_SYS_NICE, a cgroup without
    # real-time time): the workers run "normal", and doctor and status say so. Not the
    # default: it cut a read's time in FUSE 5x at 16 sandboxes, but the sustained load
    # moved less with it and the density rounds were no faster (BENCHMARKS.md "Faults
    # answered first").
    request_priority: str = "normal"
    # A group whose members may use the read-only control verbs on control.sock
    # (datapath.server.READ_ONLY_VERBS), e.g. a metrics exporter that is not root.
    # None: root only. nbd.sock stays root's alone whatever this says.
    control_group: str | None = None


# The exporter's port: not OpenTelemetry's 9464 (the default of every OTel SDK's Prometheus
# exporter, often on the same node); Prometheus' allocation list covers 9100-9999 whole.
METRICS_PORT = 9479


@dataclass
class MetricsConfig:
    # where `agentzip-blk metrics` serves /metrics unless --listen says otherwise: loopback,
    # because /metrics has no authentication (docs/KUBERNETES.md "Metrics")
    listen: str = f"127.0.0.1:{METRICS_PORT}"


FRONTENDS = ("auto", "fuse", "nbdfuse", "nbd")
DATAPATHS = ("auto", "native", "python")
SWAP_MAP_MODES = ("auto", "off")
REQUEST_PRIORITIES = ("realtime", "normal")


def default_scopes() -> list[Scope]:
    return [Scope("agent-sandbox-*.slice")]


@dataclass
class Config:
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scopes: list[Scope] = field(default_factory=default_scopes)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, Any]:
        """Normalized plain-dict form (sizes in bytes, durations in seconds); parse_config accepts it."""
        return dataclasses.asdict(self)
