"""`estimate` on a live process agrees with what the store achieves on the same pages.

Tolerance: the estimate's payload ratio (original / compressed bytes) must be within 3% of
the store's `orig_mem / compressed_bytes` for the same pages. The target is idle while it is
read twice, so both see the same bytes; the 3% covers the dictionary selection seeing the
pages in differently cut requests (the estimate skips same-filled and duplicate pages).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentzip_blk.cgroups import procmem
from agentzip_blk.cli.estimate import estimate_pids
from agentzip_blk.codec.estimate import ROLLOUT_MIN_RATIO, estimate_pages
from agentzip_blk.store import PageStore

PAGE = 4096
TOLERANCE = 0.03
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET = r"""
import json, random, sys
r = random.Random(11)
words = ["agent", "tool", "result", "path", "error", "value", "the", "of", "memory"]
keep = []
for i in range(20000):
    d = {"id": i, "role": r.choice(["user", "assistant", "tool"]),
         "text": " ".join(r.choice(words) for _ in range(r.randint(5, 40))),
         "score": r.random(), "tags": [r.choice(words) for _ in range(3)]}
    keep.append((d, json.dumps(d)))
sys.stdout.write("READY\n"); sys.stdout.flush()
sys.stdin.read()
"""


@pytest.fixture
def target():
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("READY")
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def store_ratio(pages: list[bytes], dictionary: str) -> float:
    store = PageStore(len(pages) * PAGE, max_size=1 << 30, dictionary=dictionary)
    for i in range(0, len(pages), 32):
        store.write(b"".join(pages[i:i + 32]), i * PAGE)
    assert bytes(store.read(0, len(pages) * PAGE)) == b"".join(pages)
    st = store.stats()
    return st["orig_mem"] / st["compressed_bytes"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="reads /proc/PID/mem of another process")
def test_estimate_matches_the_store_on_the_same_pages(target):
    est = estimate_pids([target], limit=3000, seed=5, progress=False)
    rows = {r.codec: r for r in est.rows}
    assert est.sampled_pages == 3000 and est.resident_pages >= 3000
    pages = procmem.process_pages([target], limit=3000, seed=5)
    for codec, dictionary in (("zstd 3", "none"), ("zstd 3 + prebuilt", "prebuilt")):
        got = store_ratio(pages, dictionary)
        want = rows[codec].ratio
        assert abs(want / got - 1) <= TOLERANCE, (codec, want, got)
    assert rows["lz4"].ratio < rows["zstd 3"].ratio <= rows["zstd 9"].ratio * 1.01
    assert est.recommendation


def test_recommendation_refuses_below_the_rollout_threshold():
    noise = [os.urandom(PAGE) for _ in range(50)] + [b"a" * PAGE]
    est = estimate_pages(noise, dictionaries=False)
    assert est.recommended is None and "not recommended" in est.recommendation
    assert max(r.ratio for r in est.rows) < ROLLOUT_MIN_RATIO
    text = [(b"agent tool result memory page " * 200)[i:i + PAGE] for i in range(40)]
    est = estimate_pages(text, dictionaries=False)
    assert est.recommended == "zstd 3" and "recommended: zstd 3" in est.recommendation


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="reads /proc/PID/mem of another process")
def test_estimate_cli_prints_progress_table_and_recommendation(target):
    res = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "estimate", "--pid", str(target),
                          "--sample", "2000", "--progress"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "reading memory" in res.stderr and "100%" in res.stderr
    for codec in ("lz4", "lz4hc 9", "zstd 1", "zstd 3", "zstd 9", "zstd 3 + prebuilt"):
        assert f"\n{codec} " in res.stdout
    assert "recommended" in res.stdout


def test_estimate_cli_cgroup_without_processes_or_missing(tmp_path):
    res = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "estimate", "--cgroup",
                          str(tmp_path / "nope")], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "no such cgroup" in res.stderr


def test_the_frames_row_matches_the_store_with_frames():
    """The store's default compresses 16 new pages of a request together: the estimate's
    frames row predicts its payload ratio on the same pages, written in order."""
    r = __import__("random").Random(3)
    words = [b"agent", b"tool", b"result", b"path", b"error", b"value", b"memory", b"{", b"}"]
    blob = b" ".join(r.choice(words) + str(r.randint(0, 999)).encode() for _ in range(200000))
    pages = [blob[i * PAGE:(i + 1) * PAGE] for i in range(256)]
    est = estimate_pages(pages, dictionaries=False)
    rows = {row.codec: row for row in est.rows}
    store = PageStore(len(pages) * PAGE, max_size=1 << 30, frame_pages=16)
    for i in range(0, len(pages), 16):
        store.write(b"".join(pages[i:i + 16]), i * PAGE)
    st = store.stats()
    got = st["orig_mem"] / st["compressed_bytes"]
    want = rows["zstd 3, 16-page frames"].ratio
    assert abs(want / got - 1) <= TOLERANCE, (want, got)
    assert want > rows["zstd 3"].ratio  # what frames are for
