"""The workload programs (bench/workloads: standalone scripts a bench starts in a cgroup, all
speaking protocol.py's READY / CHECK / TOUCH / VERIFY) and the table of the four agent
workloads A-D that several benches run."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from dataclasses import dataclass
from types import ModuleType

DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workloads")


def script(name: str) -> str:
    """The path of workload program *name* (``agent_json.py``, ``node_text.js``...)."""
    return os.path.join(DIR, name)


def module(name: str) -> ModuleType:
    """Workload program *name* (without .py) imported as a module, for its helpers (pagewalk's
    probe, browser's find_chromium, agent_json's heap). The programs import each other by
    name, as scripts do, so their directory goes on sys.path."""
    if DIR not in sys.path:
        sys.path.insert(0, DIR)
    return importlib.import_module(name)


@dataclass
class WorkloadSpec:
    key: str  # A..D
    name: str
    title: str
    argv: list[str]
    mb: int
    field_ratio: float  # the field report's baseline RSS / physical after


def workloads(python: str) -> dict[str, WorkloadSpec]:
    """A pandas, B JSON tool calling, C headless Chromium, D Node.js text; *python* runs the
    Python ones."""
    w = DIR
    return {
        "A": WorkloadSpec("A", "pandas", "Python data analysis (pandas/numpy)",
                          [python, os.path.join(w, "pandas_analysis.py")], 300, 8.7),
        "B": WorkloadSpec("B", "agent_json", "multi-round tool calling (Python, JSON)",
                          [python, os.path.join(w, "agent_json.py")], 300, 4.6),
        "C": WorkloadSpec("C", "browser", "headless Chromium (DevTools, local pages)",
                          [python, os.path.join(w, "browser.py")], 650, 3.0),
        "D": WorkloadSpec("D", "node_text", "Node.js text processing",
                          [shutil.which("node") or "node", os.path.join(w, "node_text.js")], 300, 6.5),
    }
