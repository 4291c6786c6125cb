"""Honest figures (issue 27, item 8): a reliability test records what it verified and lost
before its asserts, so a failing run reports its losses (and tools/reliability.py fails on
them) instead of reporting nothing; stress-ng's verified bytes are its own, not the
machine-wide swap-in count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import support
from .conftest import skip_reason
from .test_swap_stress import own_verified_bytes

ROOT = Path(__file__).resolve().parents[2]

# A pytest plugin for the run below: Device.read of slot 5 returns a flipped byte, as a
# device that lost a page would.
CORRUPT = '''
import pytest

@pytest.fixture(autouse=True)
def _corrupt_slot_5(request, monkeypatch):
    device = getattr(request.module, "Device", None)
    if device is not None:
        real = device.read

        def read(self, slot):
            got = real(self, slot)
            return bytes([got[0] ^ 1]) + got[1:] if slot == 5 and isinstance(got, bytes) else got

        monkeypatch.setattr(device, "read", read)
'''


def test_a_block_that_fails_still_records_its_losses(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(support.LEDGER_ENV, str(ledger))
    monkeypatch.setattr(support, "_totals", {})  # made-up losses: not in this run's report
    counts = {"bytes_verified": 4096, "data_lost": 0}
    with pytest.raises(AssertionError):
        with support.recorded("unit", lambda: counts):
            counts["data_lost"] = 3
            assert counts["data_lost"] == 0
    assert json.loads(ledger.read_text()) == {"test": "unit", "bytes_verified": 4096,
                                              "data_lost": 3}


@pytest.mark.skipif(skip_reason("nbdkit", "nbdfuse", "losetup", "fusermount3") is not None,
                    reason=str(skip_reason("nbdkit", "nbdfuse", "losetup", "fusermount3")))
@pytest.mark.slow
def test_a_failing_fault_run_reports_what_it_lost(tmp_path):
    """test_faults' pool-full run on a device that corrupts one page: the run fails, and the
    ledger holds the loss it found."""
    (tmp_path / "corrupt_plugin.py").write_text(CORRUPT)
    ledger = tmp_path / "ledger"
    env = {**os.environ, support.LEDGER_ENV: str(ledger),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "corrupt_plugin",
                          "tests/reliability/test_faults.py::test_pool_full_is_enospc_and_keeps_pages"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [json.loads(line) for line in ledger.read_text().splitlines()] \
        if ledger.exists() else []
    pool_full = [e for e in lines if e["test"] == "pool_full"]
    assert pool_full and pool_full[0]["data_lost"] >= 1, (lines, run.stdout[-2000:])


def test_stress_ng_counts_the_bytes_it_read_back_itself():
    # a page per major fault of its own cgroup, never more than the device returned
    assert own_verified_bytes(10, 1 << 30) == 10 * support.PAGE
    assert own_verified_bytes(10, 3 * support.PAGE) == 3 * support.PAGE
    assert own_verified_bytes(0, 1 << 30) == 0
