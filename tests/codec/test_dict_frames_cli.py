"""Dictionaries in frames through the real server: nbdkit with the plugin (its own process),
a libnbd client writing JSON-like pages, and the installed CLI (`agentzip-blk stats --json`,
another process) reporting which dictionaries frames used and which are loaded."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from agentzip_blk.codec.dictionaries import files
from nbdkit_server import nbdkit_available, start_server

nbd = pytest.importorskip("nbd", reason="python3-libnbd not installed")
pytestmark = [
    pytest.mark.nbdkit,
    pytest.mark.skipif(nbdkit_available() is not None, reason=str(nbdkit_available())),
]

PAGE = 4096
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_CHUNKS = [random.Random(n).randbytes(256) for n in range(160)]  # 40 KiB every run shares


def json_page(seed: int) -> bytes:
    """A page of 16 chunks (tool-call records, say) out of a set every run of the program
    shares: a frame finds the chunks of its earlier pages, a dictionary holding the set
    also those of its first pages."""
    rnd = random.Random(seed)
    return b"".join(rnd.choice(_CHUNKS) for _ in range(16))


def cli_stats(control: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "stats", "--json",
                          "--control", control], capture_output=True, text=True, env=env,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def dict_dir_with_json(tmp_path) -> None:
    """The shipped dictionaries plus `json` (raw content), in a dictionary directory
    (AGENTZIP_DICT_DIR, as an operator would point at one)."""
    d = tmp_path / "dicts"
    shutil.copytree(files.PACKAGE_DIR, d)
    content = b"".join(_CHUNKS)  # raw content: the shared records themselves
    (d / "json.dict").write_bytes(content)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["dictionaries"].append({"name": "json", "size": len(content), "file": "json.dict",
                                     "sha256": hashlib.sha256(content).hexdigest()})
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_server_frames_use_a_chosen_dictionary_and_only_it_is_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTZIP_DICT_DIR", str(dict_dir_with_json(tmp_path)))
    config = tmp_path / "config.yaml"
    config.write_text("compression:\n  dictionary: prebuilt\n  frame_pages: 16\n"
                      "  warm_algorithm: none\n"  # frames as written: the choice is on write
                      f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n")
    srv = start_server(tmp_path, size=str(8 << 20), config=config)
    try:
        before = cli_stats(srv.control_socket)["dictionaries"]
        assert before["loaded"] == []  # registered, none chosen yet
        assert {d["name"] for d in before["in_use"]} >= {"python311", "v8", "chromium"}
        h = nbd.NBD()
        h.connect_unix(srv.nbd_socket)
        data = b"".join(json_page(i) for i in range(512))
        for off in range(0, len(data), 32 * PAGE):  # 32-page requests: two frames each
            h.pwrite(data[off:off + 32 * PAGE], off)
        assert h.pread(len(data), 0) == data
        h.shutdown()
        after = cli_stats(srv.control_socket)["dictionaries"]
        sel = after["frame_selection"]
        assert sel["trials"] >= 1 and sel["requests"] == 16
        won = {name for name, n in sel["wins"].items() if n and name != "none"}
        assert "json" in won
        # whatever won is loaded; what never won (for frames or pages) is not
        page_won = {name for name, n in after["selection"]["wins"].items() if n and name != "none"}
        assert set(after["loaded"]) == won | page_won
        assert {"v8", "chromium"}.isdisjoint(after["loaded"])  # never won: never loaded
        used = {d["name"]: d["pages"] for d in after["in_use"] if d["pages"]}
        assert set(used) <= won | page_won and used.get("json", 0) >= 16  # frames used it
    finally:
        srv.stop()
