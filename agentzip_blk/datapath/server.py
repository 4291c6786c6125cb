"""What runs inside nbdkit: the page store, its protection and its control socket.

The nbdkit plugin hands its config keys to `Server.from_keys`. Server is the one request
path behind both front doors: the plugin forwards every NBD request to `pread`, `pwrite`,
`trim`, `zero` and `flush`, and the FUSE door (`datapath.fuse`, started here with the
``fuse=`` key) calls the same methods for every request the native path hands up. Each door
answers a failed request with `errors.errno_of`.
"""

from __future__ import annotations

import grp
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from time import perf_counter

from .. import __version__, procfs
from ..codec import dictionaries
from ..config import Config, load_config, load_file
from ..config.quantities import parse_size
from ..store import PageStore
from ..store.handover import Exported
from ..store.recovery import Held
from ..store.tiering import Maintainer
from . import handover, latency, native, protect
from .control import ControlServer
from .freed import FreedSlots
from .guard import SignalGuard
from .pressure import HostPressure

PLUGIN_KEYS = ("config", "config_sha256", "size", "control", "fuse", "fuse_threads", "takeover",
               "takeover_pid", "holder")
HANDOVER_TIMEOUT = 120.0  # s the old server waits for the new one's check (a big store's)
MAX_STATS_AGE = 3600  # s: the oldest cached stats a `stats` request may ask for
# s: the youngest stats a member of the control group gets. A fresh one is a scan of the
# slot table under the store lock (15-40 ms at 64Ki pages); asked for with max_age 0 in a
# loop, that lock would be the group's to hold. So the group's requests force at most one
# scan per this many seconds, together (the exporter asks for 5 s old anyway).
GROUP_STATS_MIN_AGE = 5.0

# The control verbs that only read: what members of device.control_group may use (a
# metrics exporter that is not root). The others change the device or stop the server.
READ_ONLY_VERBS = ("ping", "health", "stats", "slots")


@dataclass
class ServerOptions:
    config_path: str | None = None
    # `up` pins the effective config it wrote into the run directory by its digest: then
    # that one file is read, without drop-ins (config.load_file)
    config_sha256: str | None = None
    size: int | None = None
    control: str | None = None
    fuse: str | None = None  # mount point of the FUSE front door (datapath.fuse)
    fuse_threads: int | None = None
    # a restart: the socket on which the running server (pid takeover_pid) hands over its
    # FUSE connection and its store (datapath.handover); nothing is mounted or built anew
    takeover: str | None = None
    takeover_pid: int | None = None
    # the holder's socket (host.holder): it keeps our descriptors so that they outlive a
    # crash, and starts a server that recovers from them (store.recovery)
    holder: str | None = None

    @classmethod
    def from_keys(cls, keys: dict[str, str]) -> ServerOptions:
        unknown = set(keys) - set(PLUGIN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown plugin key(s) {', '.join(sorted(unknown))} (known: {', '.join(PLUGIN_KEYS)})"
            )
        size = parse_size(keys["size"]) if "size" in keys else None
        threads = int(keys["fuse_threads"]) if "fuse_threads" in keys else None
        takeover_pid = int(keys["takeover_pid"]) if "takeover_pid" in keys else None
        if ("takeover" in keys) != (takeover_pid is not None):
            raise ValueError("takeover= and takeover_pid= go together")
        if "takeover" in keys and not (keys.get("fuse") and keys.get("control")):
            raise ValueError("takeover= needs fuse= and control= (a restart of the FUSE door)")
        return cls(config_path=keys.get("config"), config_sha256=keys.get("config_sha256"),
                   size=size, control=keys.get("control"), fuse=keys.get("fuse"),
                   fuse_threads=threads, takeover=keys.get("takeover"),
                   takeover_pid=takeover_pid, holder=keys.get("holder"))


@dataclass
class Protection:
    memory_locked: str | None = "not tried"
    oom_score: str | None = "not tried"
    io_flusher: str | None = "not tried"
    io_flusher_threads: set[int] = field(default_factory=set)
    parent_death_signal: str | None = "not tried"
    core_dumps: str | None = "not tried"  # None: forbidden (protect.forbid_core_dumps)


class Server:
    def __init__(self, options: ServerOptions, config: Config) -> None:
        self.options = options
        self.config = config
        size = options.size if options.size is not None else config.device.size
        if size % config.compression.page_size:
            raise ValueError(f"size {size} is not a multiple of {config.compression.page_size}")
        self.size = size
        self.store: PageStore | None = None
        self.control: ControlServer | None = None
        self.maintainer: Maintainer | None = None
        self.pressure: HostPressure | None = None
        self.freed: FreedSlots | None = None
        self.fuse = None  # datapath.fuse.FuseFile (serving from this Server) with fuse=
        # who answers the FUSE door's warm reads (datapath.native); NBD requests are Python's
        self.datapath: native.Choice = (native.choose(config.device.datapath) if options.fuse
                                        else native.Choice("python", "the NBD door"))
        self.native: native.NativePath | None = None
        self.protection = Protection()
        self.latency = latency.Latency()  # pread/pwrite/trim/zero time themselves into it
        self.started = time.time()
        self._flusher_lock = threading.Lock()
        self.guard: SignalGuard | None = None
        # the last `stats` reply, the age of its snapshot then, and when it was built
        self._stats_reply: tuple[dict, float, float] | None = None
        # restarts: handovers this store has been through (from the first server on), and
        # when that first server started; handed_over: ours went to the next server
        self.restarts = 0
        self.first_started = self.started
        self.handed_over = False
        self._handover_lock = threading.Lock()
        # crash recoveries this store has been through, and what the last one repaired
        self.recoveries = 0
        self.repair: dict | None = None
        self.holder = None  # datapath.holding.HolderClient once connected

    @classmethod
    def from_keys(cls, keys: dict[str, str]) -> Server:
        options = ServerOptions.from_keys(keys)
        # unknown dictionary names become config errors
        known = dictionaries.known_names()
        if options.config_sha256:
            if not options.config_path:
                raise ValueError("config_sha256= needs config=")
            config = load_file(options.config_path, sha256=options.config_sha256,
                               known_dictionaries=known)
        else:  # the operator's own file and its drop-ins (`serve --config`)
            config = load_config(options.config_path, known_dictionaries=known)
        dictionaries.check_setting(config)  # a bad dictionary file stops nbdkit before it listens
        return cls(options, config)

    def start(self, stop: Callable[[], None] | None = None) -> None:
        """After nbdkit forked, in its main thread: refuse polite signals, lock memory,
        build the store, open the control socket. ``stop`` asks the host process to exit
        (nbdkit.shutdown); without it signals keep their old meaning."""
        if stop is not None:
            self.guard = SignalGuard(stop, _say)
            self.guard.install()
        self.protection.parent_death_signal = protect.clear_parent_death_signal()
        self.protection.core_dumps = protect.forbid_core_dumps()
        if self.protection.core_dumps is not None:
            _say(f"agentzip: core dumps not forbidden: {self.protection.core_dumps}")
        if not protect.bound_malloc():
            _say("agentzip: mallopt refused a setting: freed memory may stay locked in malloc")
        # mlockall is undone by fork(): lock again in the process that serves.
        self.protection.memory_locked = protect.lock_memory()
        protect.require_locked(self.protection.memory_locked, self.config.pool.swap_out_path)
        if self.protection.memory_locked is not None:
            _say(f"agentzip: memory NOT locked (mlockall: {self.protection.memory_locked}): a "
                 "server page swapped onto its own device deadlocks the swap-in; raise "
                 "RLIMIT_MEMLOCK (LimitMEMLOCK=infinity)")
        self.protection.oom_score = protect.lower_oom_score()
        self.protection.io_flusher = protect.set_io_flusher()
        taken = None
        if self.options.takeover:
            taken = self._take_over()  # the store and the FUSE connection of the old server
        else:
            self.store = PageStore.from_config(self.size, self.config,
                                               lock=native.make_lock(self.datapath))
        self.pressure = HostPressure()
        self.store.pressure = self.pressure
        # the slots the kernel freed without telling us, from its swap map of our area
        # (the area is the device `up` names to the guard before swapon)
        self.freed = FreedSlots(self.config.device.swap_map,
                                lambda: self.guard.device if self.guard else None)
        self.store.kernel_map = self.freed.read
        self.maintainer = Maintainer(self.store.parts, self.store.maintain)
        self.maintainer.start()
        if taken is not None:
            self._serve_taken(*taken)
            return
        if self.options.control:
            self.control = self._control(self.options.control)
            self.control.start()
        if self.options.fuse:
            self._start_fuse()
            self._commit_to_holder(self.fuse.descriptor, self.fuse.connection)

    def _control(self, path: str) -> ControlServer:
        group = self.config.device.control_group
        return ControlServer(path, self.handlers(), read_only=READ_ONLY_VERBS,
                             group_gid=grp.getgrnam(group).gr_gid if group else None,
                             group_handlers={"stats": self._group_stats})

    def _start_fuse(self, adopt_fd: int | None = None, conn: int | None = None) -> None:
        from . import fuse

        threads = self.options.fuse_threads or fuse.DEFAULT_THREADS
        if self.datapath.path == "native":
            self.native = native.NativePath(self.store)
            self.latency.read.sources.append(self.native.read_latency)
            self.latency.write.sources.append(self.native.write_latency)
        # The door serves from this Server, as the plugin does: the same latency
        # histograms, per-thread protection (on_thread also marks the workers whose
        # requests the native path serves without calling us) and errno mapping.
        door = fuse.FuseFile(self.options.fuse, self.size, self, threads=threads,
                             on_thread=self.on_request_thread, native=self.native,
                             request_priority=self.config.device.request_priority)
        if adopt_fd is not None:  # a restart: the connection the old server mounted
            door.adopt(adopt_fd, conn)
        else:
            door.start()
        self.fuse = door

    # -- a restart: the new server's side ------------------------------------------------

    def _take_over(self) -> tuple[handover.Taker, int, dict]:
        """Take the old server's store and FUSE connection (datapath.handover): map, check,
        say ready. Raises (and the new nbdkit exits) on anything wrong; the old one then
        resumes, since it heard no "ready"."""
        taker = handover.Taker(self.options.takeover)
        fds: list[int] = []
        try:
            offer = taker.take(self.options.takeover_pid, HANDOVER_TIMEOUT)
            fds = offer.fds
            header = offer.header
            if len(fds) < 1:
                raise handover.HandoverError("an offer without the FUSE descriptor")
            if header.get("recover"):
                return taker, *self._recover(taker, header, fds)
            exported = Exported(header["store"], fds[1:])
            fds = fds[:1]  # adopt owns the store's descriptors, and closes them on failure
            self.store = PageStore.adopt(self.size, self.config, exported,
                                         lock=native.make_lock(self.datapath))
            self.store.check()
            self.restarts = int(header.get("restarts", 0)) + 1
            self.recoveries = int(header.get("recoveries", 0))
            self.first_started = float(header.get("first_started", self.started))
            taker.ready()
            return taker, fds[0], header
        except BaseException as exc:
            why = f"{type(exc).__name__}: {exc}"
            # in the log first: `restart` kills this process as soon as it hears "fail", and
            # keeps the log for the operator (host/restart.py FAILED_LOG)
            _say(f"agentzip: takeover from pid {self.options.takeover_pid} failed: {why}")
            taker.fail(why)
            taker.close()
            if self.store is not None:
                self.store.release()  # the old server's memory and tier file stay its own
                self.store = None
            for fd in fds:
                os.close(fd)
            raise

    def _recover(self, taker: handover.Taker, header: dict,
                 fds: list[int]) -> tuple[int, dict]:
        """The holder's offer after a crash (host.holder): the store rebuilt from the dead
        server's memory (store.recovery), checked; says ready. Returns the FUSE descriptor
        (a duplicate: the offer's are closed by the caller's cleanup on failure, here on
        success) and the header `_serve_taken` reads."""
        names = header.get("names")
        if not isinstance(names, list) or len(names) != len(fds) or "fuse" not in names:
            raise handover.HandoverError("a recovery offer without its names or the FUSE "
                                         "descriptor")
        metas = header.get("tables") or {}
        held = Held(dict(zip(names, fds)), {n: metas.get(n, {}) for n in names})
        self.store, repair = PageStore.recover(self.size, self.config, held,
                                               lock=native.make_lock(self.datapath))
        meta = header.get("meta") or {}
        self.restarts = int(meta.get("restarts", 0))
        self.first_started = float(meta.get("first_started", self.started))
        self.recoveries = int(header.get("recoveries", 1))
        self.repair = asdict(repair)
        fuse_fd = os.dup(held.fds["fuse"])
        for fd in fds:  # the store keeps duplicates of what it needs
            os.close(fd)
        fds.clear()
        _say(f"agentzip: recovered the store of a server that died (recovery "
             f"{self.recoveries}): {self.repair}")
        taker.ready()
        return fuse_fd, {"guard_device": meta.get("guard_device"),
                         "fuse_connection": meta.get("fuse_connection"), "recovered": True}

    def _serve_taken(self, taker: handover.Taker, fuse_fd: int, header: dict) -> None:
        """After "ready": wait for the old server's "go", then serve; the control socket
        replaces the old one's path at once (rename), so `status` reaches this server."""
        try:
            taker.wait_go(HANDOVER_TIMEOUT)
        except BaseException:
            taker.close()
            self.store.release()
            self.store = None
            os.close(fuse_fd)
            raise
        taker.close()
        device = header.get("guard_device")
        if device and self.guard is not None:
            self.guard.arm(device)
        # the holder has our tables before the first request is served: a crash from
        # here on recovers from them, not from the old server's
        self._commit_to_holder(fuse_fd, header.get("fuse_connection"))
        self._start_fuse(adopt_fd=fuse_fd, conn=header.get("fuse_connection"))
        if header.get("recovered"):
            # what the dead server had read and not answered, the kernel sends again
            self.fuse.resend()
        staged = self.options.control + ".next"
        self.control = self._control(staged)
        self.control.start()
        self.control.move_to(self.options.control)
        _say(f"agentzip: serving after a handover from pid {self.options.takeover_pid} "
             f"(restart {self.restarts})")

    # -- the holder: our descriptors outlive us (host.holder, store.recovery) ---------------

    def _commit_to_holder(self, fuse_fd: int | None, conn: int | None) -> None:
        """Give the holder every descriptor a recovery needs (the FUSE connection, the
        pool, the shared tables, the tier) and what to tell the next server; from then on
        the new ones as they come. Without a holder (holder= not given) a crash loses every
        page, as before; a holder that cannot be reached stops the server from serving."""
        if not self.options.holder or fuse_fd is None:
            return
        from .holding import HolderClient

        client = HolderClient(self.options.holder)
        client.hello(os.getpid())
        client.put("fuse", fuse_fd, {"kind": "fuse"})
        self.store.attach_holder(client.put, client.drop)
        client.meta({**self._holder_meta(), "fuse_connection": conn})
        client.commit()
        self.holder = client

    def _holder_meta(self) -> dict:
        return {"fuse_connection": self.fuse.connection if self.fuse else None,
                "guard_device": self.guard.device if self.guard else None,
                "restarts": self.restarts, "first_started": self.first_started,
                "recoveries": self.recoveries}

    def _bye(self, why: str) -> None:
        """Tell the holder this server stops on purpose (no recovery follows)."""
        client, self.holder = self.holder, None
        if client is None:
            return
        self.store.shared.detach()
        try:
            client.bye(why)
        except Exception as exc:  # the holder is gone: nothing to tell
            _say(f"agentzip: could not tell the holder ({why}): {exc}")
        client.close()

    def stop(self) -> None:
        if self.holder is not None and self.store is not None:
            self._bye("handover" if self.handed_over else "shutdown")
        if self.fuse is not None:
            # unmounts (lazily if the loop device still holds it); after a handover it only
            # closes our descriptor: the connection is the next server's
            self.fuse.stop()
        if self.native is not None:
            self.native.close()
        if self.control is not None:
            self.control.stop()  # unlinks its path only while the path is still its socket
        if self.maintainer is not None:
            self.maintainer.stop()
        if self.freed is not None:
            self.freed.close()
        if self.store is not None:
            if self.handed_over:
                self.store.release()  # the pool, tables and tier file are the next server's
            else:
                self.store.close()  # removes the disk tier file

    def on_request_thread(self) -> None:
        """PR_SET_IO_FLUSHER is per thread; mark each nbdkit worker the first time it calls."""
        ident = threading.get_ident()
        if ident not in self.protection.io_flusher_threads:
            with self._flusher_lock:
                self.protection.io_flusher_threads.add(ident)
            protect.set_io_flusher()

    # -- requests: both front doors call these (the nbdkit plugin and the FUSE door) ---

    def pread(self, buf, offset: int) -> None:
        self.on_request_thread()
        t0 = perf_counter()
        self.store.readinto(buf, offset)
        self.latency.read.observe(perf_counter() - t0)

    def pwrite(self, buf, offset: int) -> None:
        self.on_request_thread()
        t0 = perf_counter()
        self.store.write(buf, offset)
        self.latency.write.observe(perf_counter() - t0)

    def trim(self, offset: int, length: int) -> None:
        self.on_request_thread()
        t0 = perf_counter()
        self.store.trim(offset, length)
        self.latency.trim.observe(perf_counter() - t0)

    def zero(self, offset: int, length: int) -> None:
        self.on_request_thread()
        t0 = perf_counter()
        self.store.zero(offset, length)
        self.latency.zero.observe(perf_counter() - t0)

    def flush(self) -> None:
        # Not timed: the store only counts it (nothing is buffered), and the latency
        # histograms of `stats` and the exporter have no flush kind (docs/JSON.md).
        self.on_request_thread()
        self.store.flush()

    # -- control verbs ---------------------------------------------------------------

    def handlers(self) -> dict:
        return {
            "stats": self._stats,
            "ping": lambda req: {"pid": os.getpid()},
            "defrag": self._defrag,
            "reclaim": self._reclaim,
            "slots": self._slots,
            "health": self._health,
            "guard": self._guard,
            "owned": self._owned,
            "shutdown": self._shutdown,
            "handover": self._handover,
        }

    def _health(self, request: dict) -> dict:
        """Unlike ping, this waits for the store lock: a wedged request path times out. It
        says which code serves: the version imported when this process started (an upgrade
        of the package on disk does not change it) and the start time (Unix)."""
        return {"pid": os.getpid(), "store": self.store.health(),
                "guarded": self.guard is not None and self.guard.guarded(),
                "datapath": self.datapath.path, "version": __version__,
                "started": round(self.started, 3), "restarts": self.restarts,
                "recoveries": self.recoveries, "holder": self.holder is not None,
                "last_repair": self.repair,
                "memory_locked": self.protection.memory_locked is None,
                # why mlockall failed (status and doctor say it), None when locked
                "memory_lock_error": self.protection.memory_locked,
                # what the FUSE workers answer reads at (datapath.priority), and why not
                # realtime when that was asked and refused
                "request_priority": self.fuse.priority_in_effect if self.fuse else None,
                "request_priority_refused": (self.fuse.stats.priority_refused
                                             if self.fuse else None)}

    def _guard(self, request: dict) -> dict:
        """`up` names the device before swapon: polite signals are refused while it is swap."""
        device = request.get("device")
        if not isinstance(device, str) or not device.startswith("/dev/"):
            raise ValueError('"device" must be a /dev path')
        if self.guard is None:
            raise ValueError("this server was started without a signal guard")
        self.guard.arm(device)  # once: another device is refused (SignalGuard.arm)
        if self.holder is not None:  # the next server after a crash guards it too
            self.holder.meta({"guard_device": device})
        return {"device": device}

    def _owned(self, request: dict) -> dict:
        """What this server owns, from its own memory: the device `up` armed the guard with
        (the swap area over this server) and the file of its disk tier (device and inode of
        the descriptor the tier holds). `down` asks before it acts: it swaps off and detaches
        only that device, and removes only that file (host.tierfile), never what a file in
        the run directory names (state.json, RUN/config.yaml, RUN/config.d)."""
        disk = self.store.disk if self.store is not None else None
        tier = None
        if disk is not None:
            held = _held_file(disk.path)
            tier = {"path": disk.path, "dev": held.st_dev if held else None,
                    "ino": held.st_ino if held else None}
        return {"device": self.guard.device if self.guard is not None else None, "tier": tier}

    def _shutdown(self, request: dict) -> dict:
        """The regular stop, sent by `down` after swapoff; refused while swap is on."""
        if self.guard is None:
            raise ValueError("this server was started without a signal guard: stop it with SIGTERM")
        if self.guard.guarded():
            raise ValueError(f"{self.guard.device} is still swap: swapoff first (agentzip-blk down)")
        # Not only the device `up` named: any swap area over our FUSE file, whatever the
        # guard was told (a peer that armed it with another device cannot stop us this way).
        ours = self._swap_over_our_file()
        if ours is not None:
            raise ValueError(f"{ours} is swap over {self.fuse.path}: swapoff first "
                             "(agentzip-blk down)")
        _say("agentzip: shutdown requested over the control socket")
        self.guard.stop()
        return {"pid": os.getpid()}

    def _handover(self, request: dict) -> dict:
        """A restart (`agentzip-blk restart`): give the store and the FUSE connection to the
        new server listening on request["to"] as pid request["pid"] (datapath.handover).
        The FUSE workers and the maintainer pause; requests wait in the kernel's queue. On
        any failure before "go" they resume, and the reply says so: handed_over false and
        why (a result, not an error: this server serves on)."""
        to, pid = request.get("to"), request.get("pid")
        if not isinstance(to, str) or not isinstance(pid, int) or isinstance(pid, bool):
            raise ValueError('"to" must be a socket path and "pid" a process id')
        if self.fuse is None or self.store is None:
            raise ValueError("only a server of the FUSE front door can hand over")
        if not self._handover_lock.acquire(blocking=False):
            raise ValueError("a handover is already under way")
        try:
            if self.handed_over:
                raise ValueError("this server has handed over already")
            return self._give(to, pid)
        finally:
            self._handover_lock.release()

    def _give(self, to: str, pid: int) -> dict:
        giver = handover.Giver(to, pid, HANDOVER_TIMEOUT)
        t0 = time.monotonic()
        try:
            self.fuse.pause()
        except BaseException:
            self.fuse.resume()
            giver.close()
            raise
        self.maintainer.stop()
        exported = None
        try:
            exported = self.store.export()  # under the store lock: no verb is inside it
            header = {"store": exported.header, "restarts": self.restarts,
                      "recoveries": self.recoveries, "first_started": self.first_started,
                      "guard_device": self.guard.device if self.guard else None,
                      "fuse_connection": self.fuse.connection}
            giver.offer(handover.Offer(header, [self.fuse.descriptor, *exported.fds]))
            giver.verdict()
            # the new server serves once it reads this: never resume after it is sent (a
            # "go" that cannot be sent was not read: the new server exits without serving)
            giver.go()
        except Exception as exc:
            giver.close()
            self.maintainer = Maintainer(self.store.parts, self.store.maintain)
            self.maintainer.start()
            self.fuse.resume()
            _say(f"agentzip: handover to pid {pid} failed, serving on: {exc}")
            return {"pid": os.getpid(), "handed_over": False, "why": str(exc)}
        finally:
            if exported is not None:
                for fd in exported.fds:  # duplicates: the store keeps its own
                    os.close(fd)
        giver.close()
        self.handed_over = True
        self.fuse.hand_over()
        paused_ms = (time.monotonic() - t0) * 1e3
        _say(f"agentzip: handed over to pid {pid} after {paused_ms:.0f} ms; exiting")
        if self.guard is not None:
            threading.Timer(0.2, self.guard.stop).start()  # after this reply is sent
        return {"pid": os.getpid(), "handed_over": True, "to_pid": pid,
                "paused_ms": round(paused_ms, 1)}

    def _swap_over_our_file(self) -> str | None:
        """A swap area in /proc/swaps that is a loop device backed by our FUSE file."""
        if self.fuse is None:
            return None
        ours = os.path.realpath(self.fuse.path)
        for area in procfs.swaps():
            backing = procfs.loop_backing(area.filename)
            if backing is not None and os.path.realpath(backing) == ours:
                return area.filename
        return None

    def _slots(self, request: dict) -> dict:
        """Per-slot sizes for `stats --cgroup`: request {"slots": [n, ...]}. A request line is
        at most control.MAX_LINE (64 KiB, ~9000 slot numbers); cgstats splits larger sets."""
        slots = request.get("slots")
        if not isinstance(slots, list) or len(slots) > 1 << 20 or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in slots
        ):
            raise ValueError('"slots" must be a list of at most 1048576 integers')
        return {"page_size": self.store.page_size, **self.store.slot_sizes(slots)}

    def _defrag(self, request: dict) -> dict:
        before = self.store.pool.allocated_bytes
        moved = self.store.compact()
        return {"pages_moved": moved, "pool_bytes_before": before,
                "pool_bytes_after": self.store.pool.allocated_bytes}

    def _reclaim(self, request: dict) -> dict:
        """Run one maintenance round now (demotion above the threshold, compaction)."""
        return self.store.maintain()

    def _group_stats(self, request: dict) -> dict:
        """`stats` for the control group: never younger than GROUP_STATS_MIN_AGE."""
        max_age = _max_age(request)
        return self._stats({**request, "max_age": max(max_age, GROUP_STATS_MIN_AGE)})

    def _stats(self, request: dict) -> dict:
        """Store stats from the cached snapshot (store.accounting.StatsCache): request
        {"max_age": s} takes one up to s seconds old (the exporter does: a scrape storm then
        scans nothing); without it, one taken after the request came, shared with the
        requests waiting for the same scan. The reply says how old it is."""
        max_age = _max_age(request)
        now = time.monotonic()
        last = self._stats_reply
        if max_age > 0 and last is not None and last[1] + (now - last[2]) <= max_age:
            # The whole reply, server figures included, is reused while young enough: a
            # scrape storm then costs each request a dict copy (procfs reads took ~0.3 ms).
            return _aged(last[0], last[1] + (now - last[2]), max_age)
        cached, age = self.store.cached_stats(float(max_age))
        stats = dict(cached)  # the snapshot is shared between replies
        stats["snapshot"] = {"age_s": round(age, 3), "max_age_s": max_age,
                             "scan_ms": round(self.store.snapshots.scan_seconds * 1e3, 2)}
        stats["latency"] = self.latency.snapshot()
        stats["server"] = {
            "pid": os.getpid(),
            "version": __version__,  # the code this process runs (health says it too)
            "rss_bytes": procfs.process_rss(os.getpid()),
            "locked_bytes": procfs.process_locked(os.getpid()),
            "uptime_s": round(time.time() - self.started, 1),
            # Unix time (wall clock): a restart shows as a step, unlike an uptime that resets
            "start_time_s": round(self.started, 3),
            # restarts without swapoff this store has been through (`agentzip-blk restart`)
            "restarts": self.restarts,
            # servers started again after a crash, from the dead one's memory (host.holder)
            "recoveries": self.recoveries,
            "store_start_time_s": round(self.first_started, 3),
            "memory_locked": self.protection.memory_locked is None,
            "oom_score_lowered": self.protection.oom_score is None,
            "io_flusher": self.protection.io_flusher is None,
            "parent_death_signal_cleared": self.protection.parent_death_signal is None,
            "core_dumps_forbidden": self.protection.core_dumps is None,
            "guarded_device": self.guard.device if self.guard else None,
            "signals_refused": dict(self.guard.refused) if self.guard else {},
            "maintenance_rounds": self.maintainer.rounds if self.maintainer else 0,
            # maintenance rounds that found the host under memory pressure (datapath.pressure)
            "host_pressure_seen": self.pressure.seen if self.pressure else 0,
            "maintenance_error": self.maintainer.last_error if self.maintainer else None,
            "control_refused": self.control.refused if self.control else 0,
            # connections turned away because too many were open (control.MAX_*)
            "control_busy": self.control.busy if self.control else 0,
            "datapath": self._datapath(),
            "swap_map": self.freed.describe() if self.freed else None,
        }
        if self.fuse is not None:
            from . import fuse

            stats["server"]["fuse"] = fuse.describe(self.fuse)
        self._stats_reply = (stats, age, time.monotonic())
        return stats


    def _datapath(self) -> dict:
        """Which request path serves, why, and what the native one served."""
        out = {"path": self.datapath.path, "reason": self.datapath.reason}
        if self.native is not None:
            counters = self.native.counters()
            out["native_writes_served"] = self.native.writes
            out["native_packs_served"] = self.native.packs
            for key in ("reads", "pages_read", "bytes_read", "writes", "pages_written",
                        "bytes_written", "packed_pages", "frame_cache_hits",
                        "frame_cache_misses", "disk_reads", "handed_up", "handed_up_by",
                        "reply_errors", "writes_queued", "writes_inline"):
                out[f"native_{key}"] = counters[key]
        return out


def _max_age(request: dict) -> float:
    max_age = request.get("max_age", 0)
    if isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or not (
            0 <= max_age <= MAX_STATS_AGE):
        raise ValueError(f'"max_age" must be a number of seconds, 0-{MAX_STATS_AGE}')
    return max_age


def _held_file(path: str) -> os.stat_result | None:
    """The stat of the file this process holds open at ``path`` (through /proc/self/fd,
    so it is the file we hold, whatever has happened to the path since)."""
    # the kernel names the file by its canonical path (a directory above may be a link)
    names = {path, os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))}
    for name in os.listdir("/proc/self/fd"):
        link = f"/proc/self/fd/{name}"
        try:
            if os.readlink(link).removesuffix(" (deleted)") in names:
                return os.stat(link)
        except OSError:
            continue
    return None


def _aged(reply: dict, age: float, max_age: float) -> dict:
    """A copy of a cached stats reply, with its age now."""
    out = dict(reply)
    out["snapshot"] = {**reply["snapshot"], "age_s": round(age, 3), "max_age_s": max_age}
    return out


def _say(message: str) -> None:
    """One line in the server's log (nbdkit's stderr is RUN/nbdkit.log)."""
    print(message, file=sys.stderr, flush=True)
