"""Fixtures of the reliability suite and its report line at the end of a pytest run."""

from __future__ import annotations

import os
import shutil

import pytest

from . import support


def skip_reason(*tools: str, root: bool = True, nbd: bool = True) -> str | None:
    if root and os.geteuid() != 0:
        return "needs root"
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        return f"missing tools: {', '.join(missing)} (./setup.sh installs them)"
    if nbd:
        import importlib.util

        if importlib.util.find_spec("nbd") is None:
            return "python3-libnbd not installed"
    return None


@pytest.fixture
def swap_locked():
    """Hold the machine-wide swap lock for the test (see docs/CONTRIBUTING.md)."""
    with support.swap_lock():
        yield


def pytest_terminal_summary(terminalreporter):
    totals = support.totals()
    if totals:
        parts = ", ".join(f"{k}={v}" for k, v in sorted(totals.items()))
        terminalreporter.write_line(f"reliability: {parts}")
