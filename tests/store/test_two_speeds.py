"""The two forms (docs/ARCHITECTURE.md, "Two forms"): pages arrive warm, alone with the fast
codec; the recompressor packs those nobody read for the grace period into dense frames.
Every page is checked byte for byte, and the books after every sequence (store.check())."""

from __future__ import annotations

import random
import threading
import time

import pytest

from agentzip_blk.codec import codecs
from agentzip_blk.config import ConfigError, parse_config
from agentzip_blk.store.blobs import WARM
from agentzip_blk.store.pagestore import PageStore
from agentzip_blk.store.tiering import Tiering

PAGE = 4096


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def text_page(rnd: random.Random, salt: int = 0) -> bytes:
    words = [b"tool_call", b"arguments", b"result", b'{"role": "user"}', b"%d" % salt,
             b"%d" % rnd.randrange(9999)]
    return b" ".join(rnd.choice(words) for _ in range(PAGE // 7))[:PAGE].ljust(PAGE, b".")


def make(clock=None, grace: float = 30.0, cpu: float = 1.0, frame_pages: int = 16,
         size: int = 16 << 20, **kw) -> PageStore:
    tiering = Tiering(cold_grace_period=grace, recompress_cpu=cpu, max_size=kw.pop("max_size", 64 << 20))
    extra = {"clock": clock} if clock is not None else {}
    return PageStore(size, frame_pages=frame_pages, warm_algorithm=kw.pop("warm", "lz4"),
                     tiering=tiering, **extra, **kw)


def forms_add_up(st: PageStore) -> dict:
    s = st.stats()
    assert s["warm_pages"] + s["cold_pages"] + s["same_pages"] + s["disk_pages"] == s["pages"]
    return s


def fill(st: PageStore, rnd: random.Random, first: int, count: int, per_request: int = 8) -> dict[int, bytes]:
    model = {}
    for slot in range(first, first + count, per_request):
        n = min(per_request, first + count - slot)
        pages = [text_page(rnd, slot + k) for k in range(n)]
        st.write(b"".join(pages), slot * PAGE)
        model.update({slot + k: p for k, p in enumerate(pages)})
    return model


def drain(st: PageStore) -> None:
    """Passes until the recompressor finds nothing to pack (no budget, no clock)."""
    while st.recompressor.pass_once():
        pass


def verify(st: PageStore, model: dict[int, bytes]) -> None:
    for slot, data in model.items():
        assert st.read(slot * PAGE, PAGE) == data, f"slot {slot}"


def test_a_written_page_is_warm_and_a_fault_decodes_one_page():
    st = make()
    model = fill(st, random.Random(1), 0, 64)
    s = forms_add_up(st)
    assert s["warm_pages"] == 64 and s["cold_pages"] == 0 and s["units"] == 0
    assert s["codec_pages"] == {"lz4": 64}
    before = st.counters.decoded_bytes
    assert st.read(17 * PAGE, PAGE) == model[17]
    assert st.counters.decoded_bytes - before == PAGE  # one page decoded, not a frame
    st.check()


def test_warm_none_frames_at_once():
    st = make(warm="none")
    fill(st, random.Random(1), 0, 64, per_request=16)
    s = forms_add_up(st)
    assert s["warm_pages"] == 0 and s["cold_pages"] == 64 and s["units"] == 4


def test_pages_past_the_grace_period_are_packed_dense():
    clock = Clock()
    st = make(clock, grace=30.0)
    rnd = random.Random(2)
    model = fill(st, rnd, 0, 200)
    model[300] = model[301] = text_page(rnd, 77)  # one content in two slots (dedup)
    st.write(model[300], 300 * PAGE)
    st.write(model[301], 301 * PAGE)
    st.write(bytes(PAGE), 400 * PAGE)  # same-filled: no blob, nothing to pack
    model[400] = bytes(PAGE)
    warm = forms_add_up(st)
    assert st.recompressor.run(seconds=5) == 0  # nothing is past the grace period yet
    clock.t += 31
    assert forms_add_up(st)["recompress_backlog"] == 202
    drain(st)
    cold = forms_add_up(st)
    assert cold["warm_pages"] == 0 and cold["recompress_backlog"] == 0
    assert cold["cold_pages"] == 202 and cold["same_pages"] == 1
    assert cold["recompressed_pages_total"] == 202
    assert cold["units"] >= 200 // 16
    assert cold["compressed_bytes"] < warm["compressed_bytes"]
    assert cold["cold_stored"] < warm["warm_stored"]
    verify(st, model)
    st.check()


def test_a_cold_run_retouched_decodes_each_frame_once():
    clock = Clock()
    st = make(clock, grace=1.0)
    model = fill(st, random.Random(3), 0, 64, per_request=64)
    clock.t += 2
    drain(st)
    assert st.stats()["units"] == 4
    before = st.counters.decoded_bytes
    for slot in range(64):
        assert st.read(slot * PAGE, PAGE) == model[slot]
    assert st.counters.decoded_bytes - before == 64 * PAGE  # four 16-page frames, once each


def test_a_page_written_again_is_warm_again():
    clock = Clock()
    st = make(clock, grace=1.0)
    rnd = random.Random(4)
    model = fill(st, rnd, 0, 32)
    clock.t += 2
    drain(st)
    model[5] = text_page(rnd, 555)
    st.write(model[5], 5 * PAGE)
    s = forms_add_up(st)
    assert s["warm_pages"] == 1 and s["cold_pages"] == 31
    assert st.blobs.form[int(st.slots.handle[5])] == WARM
    verify(st, model)
    st.check()


def test_a_slot_rewritten_while_its_frame_is_built_keeps_the_new_bytes():
    clock = Clock()
    st = make(clock, grace=1.0)
    rnd = random.Random(5)
    model = fill(st, rnd, 0, 32)
    clock.t += 2
    rec = st.recompressor
    compress = rec._compress
    new = text_page(rnd, 999)

    def rewrite_then_compress(pages, groups):
        st.write(new, 3 * PAGE)  # a request between the pick and the switch
        st.trim(20 * PAGE, PAGE)
        return compress(pages, groups)

    rec._compress = rewrite_then_compress
    switched = rec.pass_once()
    rec._compress = compress
    model[3], model[20] = new, bytes(PAGE)
    assert switched == 0 and rec.raced == 2  # both 16-page groups changed: left as they were
    verify(st, model)  # reads: every page is young again
    st.check()
    clock.t += 2
    drain(st)
    s = forms_add_up(st)
    assert s["recompress_backlog"] == 0 and s["cold_pages"] == 31  # 3's new bytes packed too
    verify(st, model)
    st.check()


def test_pool_pressure_packs_the_oldest_warm_pages_at_any_age():
    clock = Clock()
    st = make(clock, grace=3600.0)
    rnd = random.Random(6)
    old = fill(st, rnd, 0, 16)
    clock.t += 10
    young = fill(st, rnd, 100, 300)
    assert st.recompressor.pass_once(pressure=False) == 0
    st.recompressor.pass_once(pressure=True)
    form = st.blobs.form
    assert all(form[int(st.slots.handle[s])] != WARM for s in old)  # the oldest went first
    verify(st, {**old, **young})
    st.check()


@pytest.mark.slow
@pytest.mark.parametrize("frame_pages", [1, 16])
def test_recompression_under_concurrent_writes_trims_and_reads(frame_pages):
    regions, region = 3, 128
    st = make(grace=0.01, frame_pages=frame_pages, size=regions * region * PAGE)
    models = [dict() for _ in range(regions)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(t: int) -> None:
        rnd = random.Random(40 + t)
        base = t * region
        model = models[t]
        try:
            for _ in range(250):
                first = rnd.randrange(region)
                count = min(rnd.randint(1, 24), region - first)
                op = rnd.random()
                if op < 0.5:
                    pages = [text_page(rnd, rnd.randrange(40)) for _ in range(count)]
                    st.write(b"".join(pages), (base + first) * PAGE)
                    model.update({first + k: p for k, p in enumerate(pages)})
                elif op < 0.65:
                    st.trim((base + first) * PAGE, count * PAGE)
                    model.update({first + k: bytes(PAGE) for k in range(count)})
                else:
                    got = st.read((base + first) * PAGE, count * PAGE)
                    want = b"".join(model.get(first + k, bytes(PAGE)) for k in range(count))
                    assert got == want, f"thread {t} pages {first}+{count}"
                time.sleep(0.001 * rnd.random())
        except BaseException as exc:
            errors.append(exc)

    def recompressor() -> None:
        try:
            while not stop.is_set():
                st.recompressor.pass_once()
                st.recompressor.pass_once(pressure=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(regions)]
    packer = threading.Thread(target=recompressor)
    packer.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    packer.join()
    assert not errors, errors[0]
    assert st.counters.recompressed_pages > 0
    time.sleep(0.02)
    drain(st)
    for t in range(regions):
        verify(st, {t * region + k: p for k, p in models[t].items()})
    assert forms_add_up(st)["recompress_backlog"] == 0
    st.check()


@pytest.mark.slow
def test_the_budget_holds():
    clock = Clock()
    st = make(clock, grace=1.0, cpu=0.25, size=64 << 20)
    fill(st, random.Random(8), 0, 12000, per_request=32)
    clock.t += 2
    rec = st.recompressor
    wall0 = time.monotonic()
    rec.run(seconds=1.0)
    wall = time.monotonic() - wall0
    assert rec.pages_total > 256  # several passes, each followed by its rest
    # a pass that spent d of CPU rests d * (1/0.25 - 1) before the next: at most a quarter
    # of the wall time, plus what the last pass spent beyond its share (10% for the clocks)
    assert rec.cpu_seconds <= 0.25 * wall * 1.1 + 0.75 * rec.last_pass_cpu, (
        rec.cpu_seconds, wall, rec.last_pass_cpu)
    st.check()


def test_no_recompression_with_budget_zero():
    clock = Clock()
    st = make(clock, grace=1.0, cpu=0.0)
    fill(st, random.Random(9), 0, 32)
    clock.t += 5
    assert st.maintain()["recompressed"] == 0
    assert forms_add_up(st)["warm_pages"] == 32


def test_the_maintainer_drains_the_backlog():
    clock = Clock()
    st = make(clock, grace=1.0)
    model = fill(st, random.Random(10), 0, 600, per_request=32)
    clock.t += 2
    for _ in range(20):
        st.maintain()
    s = forms_add_up(st)
    assert s["recompress_backlog"] == 0 and s["cold_pages"] == 600
    verify(st, model)
    st.check()


def test_config_keys():
    config = parse_config({"compression": {"warm_algorithm": "none"},
                           "policy": {"recompress_cpu": 0.5}})
    assert config.compression.warm_algorithm == "none" and config.policy.recompress_cpu == 0.5
    assert parse_config({}).compression.warm_algorithm == "none"  # BENCHMARKS.md "Two speeds"
    with pytest.raises(ConfigError, match="compression.warm_algorithm"):
        parse_config({"compression": {"warm_algorithm": "brotli"}})
    with pytest.raises(ConfigError, match="policy.recompress_cpu"):
        parse_config({"policy": {"recompress_cpu": -1}})
    store = PageStore.from_config(16 << 20, parse_config({"pool": {"swap_out_path": None},
                                                           "compression": {"warm_algorithm": "lz4"}}))
    assert store.warm_codec is not None and store.warm_codec.id == codecs.LZ4
    store = PageStore.from_config(16 << 20, parse_config({"pool": {"swap_out_path": None}}))
    assert store.warm_codec is None


@pytest.mark.slow
def test_packed_warm_rows_go_back_to_the_kernel():
    """A warm page costs a blob row (~100 B); once 16 of them are one frame, the frames are
    moved down and the free top of the blob table is released, generations kept."""
    clock = Clock()
    st = make(clock, grace=1.0, size=64 << 20)
    model = fill(st, random.Random(11), 0, 6000, per_request=32)
    warm_rows = st.blobs.rows
    clock.t += 2
    for _ in range(40):
        st.maintain()
    s = forms_add_up(st)
    assert s["recompress_backlog"] == 0
    assert st.blobs.rows <= s["unique_blobs"] + 16 < warm_rows // 8
    assert s["meta"]["blob_table"] == st.blobs.used_bytes
    assert (st.blobs.gen[s["unique_blobs"] + 16 : warm_rows] > 0).all()  # still counting
    verify(st, model)
    st.check()
    more = fill(st, random.Random(12), 6000, 100)  # rows above the top are handed out again
    verify(st, {**model, **more})
    st.check()


def test_a_returned_page_is_packed_at_once_and_reads_back_until_rewritten():
    """Read back since written ("returned"): the page is in RAM again and its copy is needed
    only for a clean eviction, so it goes dense without waiting for the grace period; it
    still reads its last written bytes until the kernel writes or discards the slot."""
    clock = Clock()
    st = make(clock, grace=3600.0)
    rnd = random.Random(13)
    model = fill(st, rnd, 0, 64)
    for slot in range(16, 48):
        assert st.read(slot * PAGE, PAGE) == model[slot]
    s = forms_add_up(st)
    assert s["returned_pages"] == 32 and s["recompress_backlog"] == 32
    drain(st)
    s = forms_add_up(st)
    assert s["cold_pages"] == 32 and s["warm_pages"] == 32 and s["recompress_backlog"] == 0
    assert s["returned_pages"] == 32  # packing is not a write: still returned
    verify(st, model)  # now all 64 are returned
    model[20] = text_page(rnd, 2020)
    st.write(model[20], 20 * PAGE)  # the kernel writes it again: warm, not returned
    st.trim(30 * PAGE, PAGE)  # or discards it
    model[30] = bytes(PAGE)
    s = forms_add_up(st)
    assert s["warm_pages"] == 33  # the 32 never packed, and the rewritten page
    assert s["returned_pages"] == 62  # neither the rewritten page nor the trimmed one
    verify(st, model)
    st.check()
