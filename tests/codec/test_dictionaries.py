"""Dictionaries: shipped files load and verify, every page round-trips byte-exact, old blobs
stay readable after another dictionary is adopted, bad files stop startup."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest

from agentzip_blk.cgroups import procmem
from agentzip_blk.codec.codecs import ZstdCodec, ZstdDictCodec
from agentzip_blk.codec.dictionaries import files as dicts
from agentzip_blk.codec.dictionaries import known_names
from agentzip_blk.codec.dictionaries.registry import DictionaryRegistry
from agentzip_blk.codec.dictionaries.selector import Selector
from agentzip_blk.codec.dictionaries.trainer import HostTrainer, train_content
from agentzip_blk.config import ConfigError, parse_config
from agentzip_blk.store import PageStore

PAGE = 4096


def heap_pages(n: int = 400) -> list[bytes]:
    """Real pages: this Python process's own resident anonymous memory (minus same-filled)."""
    blob = [{"tool": "read_file", "args": {"path": f"src/m{i}.py"}, "result": "def f(x):\n" * (i % 7)}
            for i in range(3000)]
    pages = procmem.process_pages([os.getpid()], limit=4 * n, seed=1)
    out = []
    for p in pages:
        w = np.frombuffer(p, dtype=np.uint64)
        if not (w == w[0]).all():
            out.append(p)
    assert blob  # keep the heap content alive while we read it
    return out[:n]


def text_pages(n: int, seed: int) -> list[bytes]:
    r = random.Random(seed)
    words = ["agent", "tool_call", '"arguments"', "result", "error", "{", "}", "path", "42", "\\n"]
    return [json.dumps([r.choice(words) + str(r.randint(0, 999)) for _ in range(900)]).encode()[:PAGE]
            for _ in range(n)]


def test_manifest_lists_the_shipped_dictionaries_and_they_verify():
    infos = dicts.load_manifest()
    names = {i.name for i in infos}
    assert {"python311", "v8", "chromium"} <= names
    for info in infos:
        content = dicts.load_content(info)
        assert 16 * 1024 <= len(content) <= 64 * 1024
        assert info.runtime and info.version and info.corpus and info.params and info.gain


def test_every_page_round_trips_with_every_dictionary():
    pages = heap_pages(300) + text_pages(50, 1) + [os.urandom(PAGE)]
    for info in dicts.load_manifest():
        codec = ZstdDictCodec(dicts.load_content(info), 3)
        for p in pages:
            assert codec.decompress(codec.compress(p)) == p


def test_config_rejects_an_unknown_name_listing_the_known_ones():
    known = known_names()  # what the server and the CLI pass when they load a config
    assert known == {i.name for i in dicts.load_manifest()}
    assert parse_config({"compression": {"dictionary": "python311,v8"}},
                        known_dictionaries=known).compression.dictionary == ["python311", "v8"]
    with pytest.raises(ConfigError) as e:
        parse_config({"compression": {"dictionary": "python311,cobol"}}, known_dictionaries=known)
    assert "cobol" in str(e.value) and "python311" in str(e.value) and "chromium" in str(e.value)


@pytest.fixture
def dict_copy(tmp_path, monkeypatch):
    d = tmp_path / "dicts"
    shutil.copytree(dicts.PACKAGE_DIR, d)
    monkeypatch.setenv("AGENTZIP_DICT_DIR", str(d))
    return d


def test_corrupt_dictionary_stops_startup_with_a_clear_error(dict_copy):
    path = dict_copy / "v8.dict"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(dicts.DictionaryError, match=r"dictionary 'v8'.*v8\.dict is corrupt"):
        PageStore(64 * PAGE, max_size=16 << 20, dictionary="prebuilt")
    # a list without it still starts
    PageStore(64 * PAGE, max_size=16 << 20, dictionary=["python311"]).close()


def test_missing_dictionary_or_manifest_stops_startup(dict_copy):
    (dict_copy / "chromium.dict").unlink()
    with pytest.raises(dicts.DictionaryError, match=r"chromium.*missing"):
        PageStore(64 * PAGE, max_size=16 << 20, dictionary="auto")
    (dict_copy / "manifest.json").write_text("{not json")
    with pytest.raises(dicts.DictionaryError, match="corrupt dictionary manifest"):
        PageStore(64 * PAGE, max_size=16 << 20, dictionary="prebuilt")


def test_store_with_dictionaries_round_trips_and_records_dict_ids():
    pages = heap_pages(256)
    store = PageStore(len(pages) * PAGE, max_size=64 << 20, dictionary="prebuilt")
    store.dicts.selector.budget = store.dicts.selector.max_budget = 10.0  # trial every request
    for i in range(0, len(pages), 8):
        store.write(b"".join(pages[i:i + 8]), i * PAGE)
    assert bytes(store.read(0, len(pages) * PAGE)) == b"".join(pages)
    store.check()
    st = store.stats()["dictionaries"]
    assert st["selection"]["trials"] >= len(pages) // 8 - 1
    used = {d["name"]: d["pages"] for d in st["in_use"]}
    assert set(used) == {i.name for i in dicts.load_manifest()}
    # `pages` counts slots: a page this process holds twice is one deduplicated blob and two
    # pages, so the figure is checked against the slot table, not the blob table.
    held = store.slots.blob_slots()
    slot_dicts = store.blobs.dict_id[store.slots.handle[held].astype(np.int64)]
    ids = {d["name"]: d["id"] for d in st["in_use"]}
    for name, pages in used.items():
        assert pages == int(np.count_nonzero(slot_dicts == ids[name])), name
    assert sum(used.values()) == int(np.count_nonzero(slot_dicts)) > 0


def test_page_written_with_one_dictionary_reads_back_after_another_is_adopted():
    a_pages = text_pages(40, 1)
    b_pages = text_pages(40, 2)
    store = PageStore(128 * PAGE, max_size=64 << 20, dictionary="none")
    registry = store.dicts.registry
    old = registry.add("first", train_content(text_pages(300, 10), 16384), "host")
    store.write(b"".join(a_pages), 0)
    assert set(store.blobs.dict_id[store.blobs.live()].tolist()) == {old.id}
    # adopt another one (what HostTrainer does): the old leaves the candidates, stays loaded
    new = registry.add("second", train_content(text_pages(300, 20), 16384), "host")
    registry.retire(old.id)
    store.write(b"".join(b_pages), 40 * PAGE)
    ids = store.blobs.dict_id[store.slots.handle[40:80].astype(np.int64)]
    assert set(ids.tolist()) == {new.id}
    store.dicts._next_collect = 0
    store.write(b"\1" * PAGE, 100 * PAGE)  # a write runs the collection of unused dictionaries
    assert registry.get(old.id) is old  # still referenced: still loaded
    assert bytes(store.read(0, 80 * PAGE)) == b"".join(a_pages + b_pages)
    store.trim(0, 40 * PAGE)  # no blob uses the old one any more
    store.dicts._next_collect = 0
    store.write(b"\2" * PAGE, 101 * PAGE)
    assert old.id not in {e.id for e in registry.loaded()}
    assert bytes(store.read(40 * PAGE, 40 * PAGE)) == b"".join(b_pages)
    store.check()


@pytest.mark.slow
def test_auto_trains_and_adopts_a_host_dictionary_that_wins(monkeypatch):
    store = PageStore(2048 * PAGE, max_size=64 << 20, dictionary="auto")
    trainer = store.dicts.trainer
    trainer.background = False
    trainer.sample_every, trainer.train_pages, trainer.heldout_pages = 1, 400, 100
    trainer.heldout_every, trainer.heldout_delay = 1, 0  # held-out: the pages written next
    pages = text_pages(400, 5) + text_pages(200, 15)  # a first run, then a later one
    for i in range(0, 600, 4):
        store.write(b"".join(pages[i:i + 4]), i * PAGE)
    assert trainer.stats.rounds == 1 and trainer.stats.adopted == 1, trainer.summary()
    assert trainer.stats.last_gain >= trainer.min_gain
    hosts = [e for e in store.dicts.registry.candidates if e.source == "host"]
    assert len(hosts) == 1
    more = text_pages(200, 6)
    for i in range(0, 200, 4):
        store.write(b"".join(more[i:i + 4]), (1024 + i) * PAGE)
    assert bytes(store.read(0, 600 * PAGE)) == b"".join(pages)
    assert bytes(store.read(1024 * PAGE, 200 * PAGE)) == b"".join(more)
    store.check()


def test_auto_does_not_adopt_a_dictionary_that_does_not_win():
    registry = DictionaryRegistry.from_setting("none")
    trainer = HostTrainer(registry, background=False)
    rnd = random.Random(3)
    noise = [rnd.randbytes(PAGE) for _ in range(500)]
    assert trainer.train_and_maybe_adopt(noise[:400], noise[400:]) is False
    assert registry.candidates == ()


def test_selection_picks_none_when_dictionaries_do_not_help():
    registry = DictionaryRegistry.from_setting("prebuilt")
    selector = Selector(ZstdCodec(3), registry, budget=10.0)
    rnd = random.Random(4)
    noise = [bytes(rnd.randrange(4) for _ in range(PAGE)) for _ in range(8)]
    choice = selector.choose(noise)
    assert choice.dict_id == 0 and choice.sample_out == ZstdCodec(3).compress(noise[4])


def test_file_format_round_trip_and_corruption(tmp_path):
    content = train_content(text_pages(300, 7), 16384)
    path = tmp_path / "h.dict"
    dicts.write_file(str(path), content, {"name": "h"})
    got, meta = dicts.read_file(str(path))
    assert got == content and meta["name"] == "h" and meta["size"] == len(content)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(dicts.DictionaryError, match="corrupt"):
        dicts.read_file(str(path))


def test_server_refuses_to_start_on_a_corrupt_dictionary(dict_copy, tmp_path, monkeypatch):
    """nbdkit's config_complete path: Server.from_keys checks the files before listening."""
    from agentzip_blk.datapath.server import Server
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"compression: {{dictionary: prebuilt}}\npool: {{swap_out_path: {tmp_path}/swap}}\n")
    Server.from_keys({"config": str(cfg), "size": str(1 << 20)})  # intact copy: fine
    path = dict_copy / "python311.dict"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(dicts.DictionaryError, match="python311.*corrupt"):
        Server.from_keys({"config": str(cfg), "size": str(1 << 20)})
