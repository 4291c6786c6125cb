"""`status`, `doctor`, `scope list` print one JSON object with --json, with the top-level keys
docs/JSON.md documents (`stats --json` is checked against a real server in test_metrics)."""

from __future__ import annotations

import contextlib
import io
import json

from agentzip_blk import cli


def run_json(argv: list[str]) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    return rc, json.loads(buf.getvalue())


def test_status_json(tmp_path):
    rc, st = run_json(["--run-dir", str(tmp_path), "status", "--json"])
    assert rc == cli.EXIT_NOT_ATTACHED
    assert set(st) == {"run_dir", "attached", "state", "server", "nbdfuse", "device", "mode",
                       "loop", "mount", "swap", "other_swaps", "higher_priority_swaps",
                       "zswap_enabled", "kernel_nbd", "warnings", "healthy", "health"}
    assert st["attached"] is False and st["run_dir"] == str(tmp_path)


def test_doctor_json(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("compression:\n  level: 3\n")
    rc, d = run_json(["--config", str(cfg), "--run-dir", str(tmp_path), "doctor", "--json"])
    assert set(d) == {"status", "checks"} and d["status"] in ("pass", "warn", "fail")
    assert rc == (1 if d["status"] == "fail" else 0)
    assert d["checks"] and all(set(c) == {"name", "status", "detail", "fix"} for c in d["checks"])


def test_scope_list_json(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scopes:\n  - cgroup: agent-sandbox-*.slice\n    enabled: false\n")
    rc, d = run_json(["--config", str(cfg), "--run-dir", str(tmp_path), "scope", "list", "--json"])
    assert rc == 0 and set(d) == {"config", "hierarchy", "scopes", "tuned"}
    assert d["scopes"] == [{"cgroup": "agent-sandbox-*.slice", "enabled": False,
                            "matches": d["scopes"][0]["matches"]}]
