"""docs/SECURITY.md writes the side channels down (issue 27, item 7): each channel the issue
names has a row saying what it reveals, who observes it and what turns it off, and every
switch it names is a setting the config accepts (so the page cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from agentzip_blk.config import parse_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "SECURITY.md"
CHANNELS = ("Dedup hits", "Timing through shared caches", "Frames that mix tenants' pages",
            "The `auto` dictionary", "Per-cgroup stored bytes")


def _rows() -> dict[str, list[str]]:
    section = DOC.read_text().split("## What one tenant can learn about another", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| \*\*(.+?)\*\* \|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip("|").split("|")]
    return rows


def test_every_channel_has_a_row_with_who_and_what_turns_it_off():
    rows = _rows()
    for channel in CHANNELS:
        assert channel in rows, f"docs/SECURITY.md: no row for {channel}"
        _, reveals, who, switch = rows[channel]
        assert reveals and who and switch, rows[channel]


def test_every_switch_named_is_a_setting_the_config_accepts():
    named = []
    for cells in _rows().values():
        for section, key, value in re.findall(r"`(\w+)\.(\w+): ([^`]+)`", cells[-1]):
            parse_config({section: {key: yaml.safe_load(value)}})  # raises on a bad name
            named.append(f"{section}.{key}")
    assert {"compression.dedup", "compression.frame_pages", "compression.dictionary",
            "policy.hot_cache_size"} <= set(named), named
    # the missing switches are said to be missing, not silently left out
    text = " ".join(" ".join(c) for c in _rows().values())
    assert text.count("not yet available") >= 2
