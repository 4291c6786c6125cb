"""A store handed to another process without copying the pool (store.handover, issue 28).

One process fills a store (text pages in warm form packed into frames by the recompressor,
raw pages, zero and same-filled pages, repeats shared by dedup, pages demoted to or written
straight into the disk tier by a small pool cap, trimmed ranges), exports it and releases
it; a separate process (tests/store/handover_child.py, started fresh: it shares no mapping
with the exporter) receives the descriptors over a unix socket, adopts the store, checks it,
reads every page back byte for byte, writes, trims, recompresses, demotes and compacts, and
reads everything back again, in Python or through the native request path. A changed
layout key is refused with the key named, leaving the exporter as it was. The pool's memory
is a memfd whose freed arenas are hole-punched, on both request paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import struct
import subprocess
import sys
import time

import pytest

import agentzip_blk
from agentzip_blk.config.schema import Config
from agentzip_blk.datapath import native
from agentzip_blk.errors import StoreError
from agentzip_blk.store import PageStore
from agentzip_blk.store.handover import LAYOUT_KEYS, Exported, unchangeable

PAGE = 4096
PAGES = 2048  # an 8 MiB device
HERE = os.path.dirname(os.path.abspath(__file__))


def make_config(tmp_path, frame_pages: int = 16, warm: str = "lz4") -> Config:
    config = Config()
    config.device.size = PAGES * PAGE
    config.compression.frame_pages = frame_pages
    config.compression.warm_algorithm = warm
    config.compression.dictionary = "none"
    config.pool.max_size = 1 << 20  # ~2000 pages do not fit: demotion, and direct to disk
    config.pool.reclaim_threshold = 60
    config.pool.swap_out_path = str(tmp_path / "tier")
    config.policy.cold_grace_period = 0.01  # everything is cold at once: packed, demotable
    config.policy.recompress_cpu = 1.0
    return config


def text_page(rnd: random.Random) -> bytes:
    words = [b"tool_call", b"arguments", b'{"role": "user"}', b"%d" % rnd.randrange(999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 6))[:PAGE].ljust(PAGE, b".")


def fill(store: PageStore, seed: int = 7) -> bytearray:
    """Mixed pages over the device, maintenance between bursts; returns the image."""
    rnd = random.Random(seed)
    model = bytearray(PAGES * PAGE)
    written: list[bytes] = []
    for first in range(0, PAGES, 16):
        chunk = bytearray()
        for _ in range(16):
            r = rnd.random()
            if r < 0.45:
                page = text_page(rnd)
            elif r < 0.60:
                page = rnd.randbytes(PAGE)
            elif r < 0.70:
                page = bytes(PAGE)
            elif r < 0.75:
                page = struct.pack("<Q", rnd.getrandbits(64)) * (PAGE // 8)
            elif written:
                page = rnd.choice(written)  # a repeat: dedup shares it
            else:
                page = text_page(rnd)
            written.append(page)
            chunk += page
        store.write(bytes(chunk), first * PAGE)
        model[first * PAGE:(first + 16) * PAGE] = chunk
        if first % 256 == 240:
            time.sleep(0.02)  # past the grace period: packed, then demoted
            store.maintain()
    for first, n in ((100, 40), (700, 3), (1500, 200)):
        store.trim(first * PAGE, n * PAGE)
        model[first * PAGE:(first + n) * PAGE] = bytes(n * PAGE)
    time.sleep(0.02)
    store.maintain()
    return model


def verify(store: PageStore, model: bytearray) -> None:
    for first in range(0, PAGES, 64):
        assert store.read(first * PAGE, 64 * PAGE) == model[first * PAGE:(first + 64) * PAGE], first


@pytest.fixture
def filled(tmp_path):
    config = make_config(tmp_path)
    store = PageStore.from_config(config.device.size, config)
    model = fill(store)
    store.check()
    verify(store, model)
    c = store.counters
    # the mix this test is about: every kind of book has something in it
    assert c.recompressed_pages > 0 and c.dedup_hits > 0
    assert c.demotions + c.direct_to_disk > 0
    assert store.slots.same_pages > 0 and store.blobs.count > 0
    return config, store, model


def hand_to_child(tmp_path, config: Config, store: PageStore, model: bytearray,
                  mode: str, new_config: Config | None = None) -> dict:
    """Export, send to a new process (which adopts it with `new_config`, by default the
    same), release ours, let it go on; its report."""
    image = tmp_path / "image"
    image.write_bytes(bytes(model))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    # the package this test imports (a worktree, or the ASan copy), and tests/ (nativeharness)
    root = os.path.dirname(os.path.dirname(os.path.abspath(agentzip_blk.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.dirname(HERE)])
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "handover_child.py"), str(theirs.fileno()),
         str(image), mode, json.dumps((new_config or config).to_dict())],
        pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    theirs.close()
    try:
        exported = store.export()
        socket.send_fds(ours, [json.dumps(exported.header).encode()], exported.fds)
        for fd in exported.fds:
            os.close(fd)
        store.release()  # frees nothing: the child reads everything after this
        assert os.path.exists(config.pool.swap_out_path)
        ours.sendall(b"g")
        out, err = child.communicate(timeout=300)
    finally:
        ours.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().splitlines()[-1])
    assert report["package"] == agentzip_blk.__file__  # the code under test, on both sides
    return report


def test_a_store_adopted_by_another_process_reads_back_every_byte_and_goes_on(tmp_path, filled):
    config, store, model = filled
    before = dataclasses.asdict(store.counters)
    report = hand_to_child(tmp_path, config, store, model, "python")
    assert report["bad_pages_at_adopt"] == 0
    assert report["bad_pages_after_writes"] == 0
    assert report["counters_at_adopt"] == before  # counters go on from where they were
    after = report["counters"]
    assert after["writes"] > before["writes"] and after["reads"] > before["reads"]
    assert after["recompressed_pages"] > before["recompressed_pages"]
    assert after["demotions"] + after["direct_to_disk"] > before["demotions"] + before["direct_to_disk"]
    assert after["compactions"] + after["frames_rewritten"] > before["compactions"] + before["frames_rewritten"]
    # the adopter closed (and removed) the tier file at its end, as a server that stops does
    assert not os.path.exists(config.pool.swap_out_path)


@pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")
def test_the_native_path_serves_an_adopted_store(tmp_path):
    config = make_config(tmp_path)
    lock = native.make_lock(native.Choice("native", "test"))
    store = PageStore.from_config(config.device.size, config, lock=lock)
    model = fill(store)
    store.check()
    # a pool cap raised in place: the native path stores in the pool (the disk tier is
    # Python's), so it gets room to write
    roomy = make_config(tmp_path)
    roomy.pool.max_size = 64 << 20
    report = hand_to_child(tmp_path, config, store, model, "native", roomy)
    assert report["bad_pages_at_adopt"] == 0
    assert report["bad_pages_after_writes"] == 0
    assert report["native_reads"] > 0 and report["native_writes"] > 0


def test_a_changed_layout_key_is_refused_naming_it_and_the_exporter_goes_on(tmp_path, filled):
    config, store, model = filled
    changes = {
        "compression.frame_pages": lambda c: setattr(c.compression, "frame_pages", 8),
        "compression.dedup": lambda c: setattr(c.compression, "dedup", "off"),
        "pool.swap_out_path": lambda c: setattr(c.pool, "swap_out_path", str(tmp_path / "x")),
    }
    import gc
    gc.collect()  # what earlier tests left to the collector goes first
    open_fds = len(os.listdir("/proc/self/fd"))
    for key, change in changes.items():
        new = make_config(tmp_path)
        change(new)
        assert unchangeable(config, new) == [key]
        with pytest.raises(StoreError, match=key.replace(".", r"\.")):
            PageStore.adopt(config.device.size, new, store.export())
    with pytest.raises(StoreError, match=r"device\.size"):
        PageStore.adopt(config.device.size * 2, config, store.export())
    new = make_config(tmp_path)
    new.pool.max_size = 64 << 10  # below what the pool holds
    with pytest.raises(StoreError, match=r"pool\.max_size"):
        PageStore.adopt(config.device.size, new, store.export())
    # another version's layout (here: its classes' span), or a header that is not one
    exported = store.export()
    exported.header["internal"]["span"] += 4096
    with pytest.raises(StoreError, match="layout differs .*span"):
        PageStore.adopt(config.device.size, config, exported)
    exported = store.export()
    del exported.header["pool"]
    with pytest.raises(StoreError, match="malformed header"):
        PageStore.adopt(config.device.size, config, exported)
    exported = store.export()
    exported.header["tables_xxh3"] = "0" * 16
    with pytest.raises(StoreError, match="checksum"):
        PageStore.adopt(config.device.size, config, exported)
    exported = store.export()
    exported.header["tables"]["blob_ref"][0] = "|O"  # an object array: never read
    with pytest.raises(StoreError, match="not plain numbers"):
        PageStore.adopt(config.device.size, config, exported)
    exported = store.export()
    exported.header["tables"]["blob_ref"][2] += 1 << 30
    with pytest.raises(StoreError, match="outside the tables"):
        PageStore.adopt(config.device.size, config, exported)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == open_fds  # a refusal closes what it was given
    # the exporter was not touched: it goes on serving
    store.check()
    verify(store, model)
    store.write(text_page(random.Random(1)) * 4, 0)
    store.check()
    store.close()


def test_what_can_change_in_place_is_taken_from_the_new_config(tmp_path, filled):
    config, store, model = filled
    new = make_config(tmp_path)
    new.compression.level = 9
    new.pool.max_size = 4 << 20
    new.policy.hot_cache_size = 1 << 20
    new.policy.recompress_cpu = 0.5
    new.compression.warm_algorithm = "none"
    assert unchangeable(config, new) == []
    exported = store.export()
    json.dumps(exported.header)  # plain data only
    assert len(exported.fds) == 3
    adopted = PageStore.adopt(config.device.size, new, exported)
    store.release()
    adopted.check()
    verify(adopted, model)
    assert adopted.pool.max_size == 4 << 20
    assert adopted.codecs.writer.level == 9
    assert adopted.hot.capacity_bytes == 1 << 20
    assert adopted.recompressor.cpu_budget == 0.5
    assert adopted.warm_codec is None
    adopted.write(bytes(range(256)) * 16 * 16, 0)  # frames at once now
    model[:16 * PAGE] = bytes(range(256)) * 16 * 16
    adopted.check()
    verify(adopted, model)
    adopted.close()


def test_the_header_holds_no_secret_and_the_tables_are_sealed(tmp_path, filled):
    import fcntl
    config, store, _model = filled
    exported = store.export()
    text = json.dumps(exported.header)
    seed = store.placer.hasher.seed
    assert str(seed) not in text
    key, _prefix, _n = store.disk._sealer.secrets()
    assert key.hex() not in text and str(list(key)) not in text
    seals = fcntl.fcntl(exported.fds[1], fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_GROW
    with pytest.raises(OSError):
        os.write(exported.fds[1], b"x")
    for fd in exported.fds:
        os.close(fd)
    store.close()


def test_unchangeable_names_the_layout_keys_only():
    old, new = Config(), Config()
    assert unchangeable(old, new) == []
    new.device.size *= 2
    new.compression.frame_pages = 4
    new.compression.level = 1
    new.pool.max_size = 1 << 30
    assert unchangeable(old, new) == ["device.size", "compression.frame_pages"]
    assert set(unchangeable(old, new)) <= set(LAYOUT_KEYS)


def test_freed_arenas_give_their_memory_back(tmp_path):
    """The pool's memory is its memfd's: an arena unmapped is also punched (a shared
    mapping's munmap alone frees nothing), on the Python path..."""
    store = PageStore(PAGES * PAGE, frame_pages=1)
    rnd = random.Random(3)
    for first in range(0, 1024, 16):
        store.write(b"".join(text_page(rnd) for _ in range(16)), first * PAGE)
    held = os.fstat(store.pool.memfd).st_blocks * 512
    assert held >= store.pool.resident_bytes > 0
    store.trim(0, PAGES * PAGE)
    assert store.pool.arena_count == 0
    assert os.fstat(store.pool.memfd).st_blocks == 0
    store.check()
    store.close()


@pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")
def test_freed_arenas_give_their_memory_back_on_the_native_path():
    """...and on the native one, where a write over a page frees its blob and arena."""
    from nativeharness import NativeRequests, native_store
    store = native_store(size=PAGES * PAGE, warm_algorithm="lz4")
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    rnd = random.Random(4)
    for first in range(0, 512, 16):
        door.write(b"".join(text_page(rnd) for _ in range(16)), first * PAGE)
    assert door.native_writes > 0
    assert os.fstat(store.pool.memfd).st_blocks > 0
    for first in range(0, 512, 16):
        door.write(bytes(16 * PAGE), first * PAGE)  # zero pages: every blob freed natively
    assert door.python_writes == 0
    assert store.pool.arena_count == 0
    assert os.fstat(store.pool.memfd).st_blocks == 0
    store.check()
    door.close()
    path.close()
    store.close()


def test_an_exported_store_without_a_disk_tier_hands_two_descriptors(tmp_path):
    store = PageStore(PAGES * PAGE, frame_pages=4)
    store.write(b"".join(text_page(random.Random(5)) for _ in range(8)), 0)
    exported = store.export()
    assert len(exported.fds) == 2
    config = Config()
    config.device.size = PAGES * PAGE
    config.compression.frame_pages = 4
    config.compression.warm_algorithm = "none"
    config.compression.dictionary = "none"
    config.pool.swap_out_path = None
    adopted = PageStore.adopt(PAGES * PAGE, config, Exported(exported.header, exported.fds))
    store.release()
    adopted.check()
    assert adopted.read(0, 8 * PAGE) == b"".join(text_page(random.Random(5)) for _ in range(8))
    adopted.close()


def dict_store(setting: str) -> tuple[PageStore, bytes, Config]:
    """A store whose frames were compressed with a dictionary of this host's (registered
    beside the setting's), and the config it was built with."""
    config = Config()
    config.device.size = PAGES * PAGE
    config.compression.frame_pages = 16
    config.compression.warm_algorithm = "none"
    config.compression.dictionary = setting
    config.pool.swap_out_path = None
    store = PageStore.from_config(PAGES * PAGE, config)
    sel = store.dicts.frame_selector
    sel.budget = sel.max_budget = sel.min_budget = 10.0  # a trial on every request
    sel.margin = 0.0
    rnd = random.Random(11)
    content = b" ".join(text_page(rnd)[:2048] for _ in range(8))
    entry = store.dicts.registry.add("json", content, "host", {"why": "test"})
    data = b"".join(text_page(rnd) for _ in range(64))
    store.write(data, 0)
    assert entry.id in set(store.blobs.dict_id[store.blobs.live()].tolist())
    return store, data, config


@pytest.mark.parametrize("new_setting", ["prebuilt", "none"])
def test_dictionaries_come_along_under_their_ids(new_setting):
    """Blobs name their dictionary by id: the registry comes with its content (an upgrade's
    file of that name may differ). Another compression.dictionary keeps the old ones for
    reading only, and the new setting's are the candidates."""
    store, data, config = dict_store("prebuilt")
    old = {e.id: (e.name, e.content, e.candidate) for e in store.dicts.registry.loaded()}
    new = dataclasses.replace(config, compression=dataclasses.replace(
        config.compression, dictionary=new_setting))
    adopted = PageStore.adopt(PAGES * PAGE, new, store.export())
    store.release()
    adopted.check()
    assert adopted.read(0, 64 * PAGE) == data
    registry = adopted.dicts.registry
    got = {e.id: (e.name, e.content, e.candidate) for e in registry.loaded()}
    if new_setting == "prebuilt":
        assert got == old
    else:
        assert {i: (n, c) for i, (n, c, _) in got.items()} == {i: (n, c) for i, (n, c, _) in old.items()}
        assert not registry.candidates and not any(e.candidate for e in registry.loaded())
    adopted.write(data[::-1], 100 * PAGE)
    assert adopted.read(100 * PAGE, 64 * PAGE) == data[::-1]
    adopted.check()
    adopted.close()


def test_an_adopter_that_gives_up_leaves_the_exporter_whole(tmp_path, filled):
    """A new server that fails after adopt (its check, its start) releases what it mapped:
    nothing is freed, the tier file stays (still locked by the exporter's descriptor), and
    the old server goes on serving every page."""
    from agentzip_blk.store.disk import DiskError, DiskTier
    config, store, model = filled
    adopted = PageStore.adopt(config.device.size, config, store.export())
    adopted.check()
    with pytest.raises(DiskError, match="in use"):  # the flock came along with the file
        DiskTier(config.pool.swap_out_path)
    adopted.release()
    assert os.path.exists(config.pool.swap_out_path)
    with pytest.raises(DiskError, match="in use"):  # and stays with the exporter's
        DiskTier(config.pool.swap_out_path)
    store.check()
    verify(store, model)
    store.write(bytes(range(256)) * 16, 5 * PAGE)
    model[5 * PAGE:6 * PAGE] = bytes(range(256)) * 16
    store.maintain()
    verify(store, model)
    store.check()
    store.close()
    assert not os.path.exists(config.pool.swap_out_path)


def test_a_store_with_requests_in_flight_is_not_exported(tmp_path, filled):
    _config, store, _model = filled
    store._begin()  # a request between its start and its end
    try:
        with pytest.raises(StoreError, match="in flight"):
            store.export()
    finally:
        store._end()
    exported = store.export()
    for fd in exported.fds:
        os.close(fd)
    store.close()


def test_the_exporter_and_its_successor_never_share_a_nonce(tmp_path, filled):
    """The successor seals from the counter it was given; the exporter, should it go on
    (its successor failed), seals from far beyond: AES-GCM nonces are never reused."""
    from agentzip_blk.store.disk import HANDOVER_GAP, NONCE_BYTES
    config, store, _model = filled
    exported = store.export()
    adopted = PageStore.adopt(config.device.size, config, exported)
    theirs = adopted.disk.seal(0, b"x" * 100, 1, 1)[:NONCE_BYTES]
    ours = store.disk.seal(0, b"x" * 100, 1, 1)[:NONCE_BYTES]
    assert theirs[:4] == ours[:4]  # one key, one prefix
    gap = int.from_bytes(ours[4:], "little") - int.from_bytes(theirs[4:], "little")
    assert gap == HANDOVER_GAP
    adopted.release()
    store.close()


@pytest.mark.skipif(not native.available(), reason=native.MISSING or "built")
def test_the_native_paths_request_counters_go_on_in_the_adopter(tmp_path):
    """The native path counts its requests apart (PageStore.outside): what the old server's
    counted is carried into the adopter's counters, so that stats never go back at a restart."""
    from nativeharness import NativeRequests

    config = make_config(tmp_path)
    config.pool.max_size = 64 << 20
    lock = native.make_lock(native.Choice("native", "test"))
    store = PageStore.from_config(config.device.size, config, lock=lock)
    path = native.NativePath(store)
    door = NativeRequests(store, path)
    rnd = random.Random(8)
    for first in range(0, 256, 16):
        door.write(b"".join(text_page(rnd) for _ in range(16)), first * PAGE)
    assert door.native_writes > 0
    before = store.stats()
    assert before["writes"] >= door.native_writes
    door.close()
    path.close()
    exported = store.export()
    adopted = PageStore.adopt(config.device.size, config, exported)
    try:
        after = adopted.stats()
        for key in ("writes", "bytes_written", "reads", "bytes_read"):
            assert after[key] == before[key], key
    finally:
        adopted.release()
        store.close()
