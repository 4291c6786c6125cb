"""Shared fixtures. Add, don't rewrite."""

from __future__ import annotations

import pytest

from agentzip_blk import config as config_module


@pytest.fixture(autouse=True)
def _fresh_dictionary_names(monkeypatch):
    """Entry points install the known dictionary names process-wide (config.KNOWN_DICTIONARIES);
    every test starts without them so that test order does not matter."""
    monkeypatch.setattr(config_module, "KNOWN_DICTIONARIES", None)
