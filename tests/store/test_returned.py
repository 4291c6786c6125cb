"""Returned copies (pages read back and not written since) go to the disk tier under the
host's memory pressure, and are never lost: issue "Hold only what the kernel still needs"."""

from __future__ import annotations

import random
import threading

import pytest

from agentzip_blk.config import ConfigError, parse_config
from agentzip_blk.datapath.pressure import HOLD, HostPressure
from agentzip_blk.procfs import memory_stall_us
from agentzip_blk.store.pagestore import PageStore
from agentzip_blk.store.tiering import Tiering

from .test_two_speeds import Clock, fill, text_page, verify

PAGE = 4096


def make(tmp_path, clock: Clock, mode: str = "pressure", warm: str = "none",
         frame_pages: int = 16) -> PageStore:
    tiering = Tiering(max_size=64 << 20, swap_out_path=str(tmp_path / "disk-tier"),
                      warm_threshold_ms=10_000, cold_grace_period=30.0, returned_to_disk=mode)
    return PageStore(16 << 20, frame_pages=frame_pages, warm_algorithm=warm, tiering=tiering,
                     clock=clock)


def read_back(st: PageStore, model: dict[int, bytes], slots) -> None:
    for slot in slots:
        assert st.read(slot * PAGE, PAGE) == model[slot], f"slot {slot}"


def settle(st: PageStore) -> None:
    """Maintenance rounds until nothing moves (packing, demotion, compaction)."""
    for _ in range(50):
        result = st.maintain()
        if not any(result.values()):
            return
    raise AssertionError("maintenance did not settle")


@pytest.mark.parametrize("warm", ["none", "lz4"])
def test_returned_pages_go_to_disk_under_pressure_and_read_back_exactly(tmp_path, warm):
    clock = Clock()
    st = make(tmp_path, clock, warm=warm)
    st.pressure = lambda: True
    rnd = random.Random(1)
    model = fill(st, rnd, 0, 256, per_request=16)
    read_back(st, model, range(0, 128))  # the first half is back in RAM
    settle(st)
    before = st.stats()
    assert before["returned_pages"] == 128
    assert before["returned_pool_pages"] == 128  # read just now: not yet
    clock.t += 11  # past warm_threshold_ms
    settle(st)
    after = st.stats()
    assert after["returned_pool_pages"] == 0
    assert after["returned_pages"] == 128
    assert after["disk_pages"] == 128
    assert after["pool_pages"] == before["pool_pages"] - 128
    assert after["returned_demotions"] > 0
    assert after["returned_demotions"] == after["demotions"]
    st.check()
    verify(st, model)  # every page, the returned ones from disk (a clean eviction's refault)
    st.check()


def test_no_pressure_no_move_and_never_means_never(tmp_path):
    for mode, pressed, moves in (("pressure", False, False), ("never", True, False),
                                 ("always", False, True)):
        clock = Clock()
        (tmp_path / mode).mkdir()
        st = make(tmp_path / mode, clock, mode=mode)
        st.pressure = lambda pressed=pressed: pressed
        model = fill(st, random.Random(2), 0, 64, per_request=16)
        read_back(st, model, range(64))
        clock.t += 11
        settle(st)
        s = st.stats()
        assert (s["returned_pool_pages"] == 0) is moves, (mode, s["returned_pool_pages"])
        assert s["disk_pages"] == (64 if moves else 0), mode
        verify(st, model)
        st.check()


def test_a_frame_with_a_page_still_out_stays_in_memory(tmp_path):
    clock = Clock()
    st = make(tmp_path, clock, mode="always")
    model = fill(st, random.Random(3), 0, 32, per_request=16)  # two frames of 16
    read_back(st, model, [n for n in range(32) if n != 5])  # slot 5's page is still out
    clock.t += 11
    settle(st)
    s = st.stats()
    assert s["disk_pages"] == 16  # the second frame only
    assert s["returned_pool_pages"] == 15  # the first frame's read pages wait with slot 5
    verify(st, model)


def test_a_rewrite_after_the_move_wins_and_a_reread_comes_back(tmp_path):
    clock = Clock()
    st = make(tmp_path, clock, mode="always")
    rnd = random.Random(4)
    model = fill(st, rnd, 0, 64, per_request=16)
    read_back(st, model, range(64))
    clock.t += 11
    settle(st)
    assert st.stats()["disk_pages"] == 64
    new = text_page(rnd, 999)
    st.write(new, 7 * PAGE)  # the kernel writes the page out again
    model[7] = new
    st.trim(8 * PAGE, PAGE)
    model[8] = bytes(PAGE)
    with st.lock:
        st.frames.clear()  # the decoded frames of the first read-back are gone by now
    read_back(st, model, range(16, 32))  # refaults after clean evictions: promoted
    s = st.stats()
    assert s["promotions"] > 0
    verify(st, model)
    st.check()


@pytest.mark.slow
def test_concurrent_requests_while_returned_copies_move(tmp_path):
    """Writers, readers and trims against the maintainer moving returned copies (mode
    always, the clock racing ahead): every page exact, the books consistent."""
    clock = Clock()
    st = make(tmp_path, clock, mode="always", warm="lz4")
    rnd = random.Random(5)
    model = fill(st, rnd, 0, 512, per_request=8)
    lock = threading.Lock()  # the model's, held across the store call it describes
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not stop.is_set():
                slot = r.randrange(512)
                op = r.random()
                with lock:
                    if op < 0.3:
                        data = text_page(r, slot * 7 + seed)
                        st.write(data, slot * PAGE)
                        model[slot] = data
                    elif op < 0.35:
                        st.trim(slot * PAGE, PAGE)
                        model[slot] = bytes(PAGE)
                    else:
                        assert st.read(slot * PAGE, PAGE) == model[slot], f"slot {slot}"
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(40):
            clock.t += 3
            st.maintain()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    st.check()
    verify(st, model)
    # Whether the racing rounds found copies to move depends on the threads' interleaving;
    # one quiet round after every page was read back must move some.
    if not st.stats()["returned_demotions"]:
        verify(st, model)
        clock.t += 30
        st.maintain()
    assert st.stats()["returned_demotions"] > 0
    st.check()
    verify(st, model)


def test_host_pressure_follows_the_stall_share():
    now = [0.0]
    total = [0]
    pressure = HostPressure(stall_us=lambda: total[0], clock=lambda: now[0])
    assert pressure() is False  # a first look has nothing to compare with
    now[0] += 1.0
    total[0] += 500  # 0.05% of the second: below the share
    assert pressure() is False
    now[0] += 1.0
    total[0] += 5_000  # 0.5%
    assert pressure() is True
    assert pressure.seen == 1
    now[0] += HOLD - 1  # no new stall, but within the hold
    assert pressure() is True
    now[0] += 2
    assert pressure() is False


def test_host_pressure_without_psi_reads_memavailable():
    low = HostPressure(stall_us=lambda: None,
                       meminfo=lambda: {"MemTotal": 1000, "MemAvailable": 100})
    high = HostPressure(stall_us=lambda: None,
                        meminfo=lambda: {"MemTotal": 1000, "MemAvailable": 900})
    assert low() is True and high() is False


def test_the_machine_psi_file_parses():
    value = memory_stall_us()
    assert value is None or value >= 0
    assert memory_stall_us("/nonexistent/pressure") is None


def test_config_key():
    assert parse_config({}).policy.returned_to_disk == "never"
    assert parse_config({"policy": {"returned_to_disk": "always"}}).policy.returned_to_disk == "always"
    with pytest.raises(ConfigError, match="policy.returned_to_disk"):
        parse_config({"policy": {"returned_to_disk": "sometimes"}})
