#!/usr/bin/env python3
"""Run the reliability suite (tests/reliability) and report what it proved.

    .venv/bin/python tools/reliability.py           # everything, incl. the slow tests
    .venv/bin/python tools/reliability.py --fast    # the fast subset (what CI runs)

Holds /tmp/agentzip-swap.lock for the whole run (the swap tests see it held by their
ancestor and do not take it again). The report: bytes verified byte for byte (fio crc32c,
model checks, stress-ng --verify swap-ins, fault tests), faults injected, hostile inputs
tried (NBD requests, control lines, configs), pages found wrong (must be 0), and the test
outcome; also written to results/reliability.json. Exit status 0 only when every test
passed and no data was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.harness.lock import swap_lock  # noqa: E402


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _junit_counts(path: str) -> dict:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {**counts, "failed": ["(no junit report: pytest did not finish)"]}
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failed": failed}


def run(fast: bool, examples: int | None, extra: list[str]) -> dict:
    tmp = tempfile.mkdtemp(prefix="azrel-report-")
    ledger = os.path.join(tmp, "ledger.jsonl")
    junit = os.path.join(tmp, "junit.xml")
    env = dict(os.environ, AGENTZIP_RELIABILITY_LEDGER=ledger)
    env["AGENTZIP_FUZZ_EXAMPLES"] = str(examples or (120 if fast else 600))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           os.path.join(REPO, "tests", "reliability"), "-m", "not long" if fast else "",
           f"--junitxml={junit}", *extra]
    t0 = time.monotonic()
    with swap_lock(lambda msg: print(f"reliability: {msg}", file=sys.stderr, flush=True)):
        print(f"reliability: {' '.join(cmd)}", file=sys.stderr, flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    seconds = time.monotonic() - t0
    by_area: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    if os.path.exists(ledger):
        with open(ledger) as f:
            for line in f:
                entry = json.loads(line)
                area = entry.pop("test")
                for key, value in entry.items():
                    by_area[area][key] += value
    totals: dict[str, int] = defaultdict(int)
    for counts in by_area.values():
        for key, value in counts.items():
            totals[key] += value
    tests = _junit_counts(junit)
    shutil.rmtree(tmp, ignore_errors=True)
    ok = rc == 0 and totals.get("data_lost", 0) == 0 and not tests["failed"]
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mode": "fast" if fast else "full",
        "ok": ok,
        "pytest_exit": rc,
        "seconds": round(seconds, 1),
        "tests": tests,
        "bytes_verified": totals.get("bytes_verified", 0),
        "faults_injected": totals.get("faults_injected", 0),
        "hostile_inputs": totals.get("hostile_inputs", 0),
        "data_lost": totals.get("data_lost", 0),
        "by_area": {k: dict(v) for k, v in sorted(by_area.items())},
    }


def report(res: dict) -> str:
    t = res["tests"]
    passed = t["tests"] - t["failures"] - t["errors"] - t["skipped"]
    lines = [
        f"agentzip-blk reliability report ({res['mode']}, {res['when']}, {res['seconds']:.0f} s)",
        f"  tests:            {passed} passed, {t['failures'] + t['errors']} failed, "
        f"{t['skipped']} skipped",
        f"  bytes verified:   {res['bytes_verified']} ({_fmt_bytes(res['bytes_verified'])})",
        f"  faults injected:  {res['faults_injected']}",
        f"  hostile inputs:   {res['hostile_inputs']}",
        f"  data lost:        {res['data_lost']}"
        + ("  (zero data lost)" if res["data_lost"] == 0 and res["ok"] else ""),
        "  by area:",
    ]
    for area, counts in res["by_area"].items():
        parts = ", ".join(f"{k} {_fmt_bytes(v) if k == 'bytes_verified' else v}"
                          for k, v in sorted(counts.items()))
        lines.append(f"    {area:22} {parts}")
    for name in t["failed"]:
        lines.append(f"  FAILED {name}")
    lines.append("  result: " + ("OK" if res["ok"] else "FAILED"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the fast subset (CI)")
    ap.add_argument("--examples", type=int, help="hypothesis examples per fuzz test")
    ap.add_argument("--json", default=os.path.join(REPO, "results", "reliability.json"),
                    help="where to write the report (default results/reliability.json)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("reliability: must run as root (swap, loop devices, FUSE, cgroups)", file=sys.stderr)
        return 2
    res = run(args.fast, args.examples, args.pytest_args)
    print(report(res))
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
