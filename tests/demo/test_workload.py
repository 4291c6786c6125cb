"""The demo's workload script (agentzip_blk/demo/scripts/agent_json.py): its agent-like heap
and its READY/TOUCH/VERIFY protocol."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentzip_blk.demo.workload import WORKLOAD

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)


def start(*args):
    return subprocess.Popen([sys.executable, WORKLOAD, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONHASHSEED="0"))


def ready(p) -> int:
    line = p.stdout.readline().split()
    assert line and line[0] == "READY", (line, p.stderr.read() if p.poll() is not None else "")
    return int(line[1])


def send(p, cmd) -> list[str]:
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    return p.stdout.readline().split()


def finish(p, timeout=60) -> int:
    try:
        rc = p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            try:
                f.close()
            except (OSError, BrokenPipeError):
                pass
    return rc


def run_to_verify(*args) -> tuple[int, list[str], list[str], int]:
    p = start(*args)
    try:
        rss = ready(p)
        check = send(p, "CHECK")
        verify = send(p, "TOUCH")
    finally:
        rc = finish(p)
    return rss, check, verify, rc


def test_ready_touch_verify_ok():
    rss, check, verify, rc = run_to_verify("--mb", "20", "--seed", "7")
    assert rss > 20 << 20  # interpreter + ~20 MiB of live heap
    assert rss < 120 << 20
    assert check[:2] == ["CHECK", "ok"]
    assert verify[:2] == ["VERIFY", "ok"]
    assert verify[2] == check[2]  # same checksum before and after
    assert float(verify[3]) >= 0  # checksum pass seconds
    assert float(verify[4]) >= 0  # page-walk (swap-in) seconds
    assert int(verify[5]) * 4096 >= 20 << 20  # pages walked: at least the heap
    assert rc == 0


def test_same_seed_same_data_other_seed_other_data():
    a = run_to_verify("--mb", "4", "--seed", "3")
    b = run_to_verify("--mb", "4", "--seed", "3")
    c = run_to_verify("--mb", "4", "--seed", "4")
    assert a[2][1] == b[2][1] == c[2][1] == "ok"
    assert a[2][2] == b[2][2]
    assert a[2][2] != c[2][2]


def test_size_follows_mb():
    small, *_ = run_to_verify("--mb", "5")
    big, *_ = run_to_verify("--mb", "45")
    assert 30 << 20 <= big - small <= 55 << 20


def test_corruption_is_reported_as_fail():
    p = start("--mb", "10", "--corrupt-for-test")
    try:
        ready(p)
        assert send(p, "CHECK")[:2] == ["CHECK", "ok"]  # corrupted only at TOUCH
        verify = send(p, "TOUCH")
    finally:
        rc = finish(p)
    assert verify[:2] == ["VERIFY", "FAIL"]
    assert verify[2] != verify[3]
    assert rc == 1


def test_eof_before_touch_exits_2():
    p = start("--mb", "2")
    try:
        ready(p)
        p.stdin.close()
        rc = p.wait(timeout=30)
    finally:
        finish(p)
    assert rc == 2


def test_content_is_agent_like():
    """Nested tool-call JSON, escaped code, numbers: the heap the design measured ratios on."""
    sys.path.insert(0, os.path.dirname(WORKLOAD))
    try:
        import agent_json
    finally:
        sys.path.pop(0)
    h = agent_json.Heap(seed=1, mb=1)
    h.build()
    raw = "".join(h.raw)
    assert '"tool_calls"' in raw and '"arguments"' in raw
    assert "\\n" in raw and '\\"' in raw  # escaped multi-line strings, JSON inside JSON
    assert "def " in raw and ("Traceback" in raw or "PASSED" in raw)
    msgs = [m for s in h.sessions for m in s["messages"]]
    assert {m["role"] for m in msgs} >= {"system", "user", "assistant", "tool"}
    assert any(isinstance(v, float) for s in h.sessions for r in s["rounds"]
               for v in [r["latency_ms"]])
    assert len(h.pool) > 20
