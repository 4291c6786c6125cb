"""No import cycles, in the package or in the benchmarks, ``TYPE_CHECKING`` imports included
(tests/importgraph.py reads every import from the source). import-linter's layers contract
(tests/test_architecture.py) orders the subpackages; this orders the modules inside them."""

from __future__ import annotations

from pathlib import Path

import pytest

import importgraph

ROOT = importgraph.ROOT

# Cycles that exist today and have an issue that removes them. Each entry must still be a
# cycle (the test fails when one is gone, so that the entry goes too); nothing may be added
# here without such an issue.
KNOWN: set[frozenset[str]] = set()


def _bench_modules() -> dict[str, Path]:
    """The benchmarks: the bench package where it exists, else the scripts in tools/ (which
    import each other by bare name, tools/ being on their sys.path)."""
    if (ROOT / "bench" / "__init__.py").exists():
        return importgraph.modules(ROOT, "bench")
    return {p.stem: p for p in sorted((ROOT / "tools").glob("*.py"))}


def _graph() -> dict[str, set[str]]:
    files = {**importgraph.modules(), **_bench_modules()}
    known = set(files)
    return {name: importgraph.imports(path, name, known) for name, path in files.items()}


def test_no_import_cycles():
    found = {frozenset(group) for group in importgraph.cycles(_graph())}
    new = [sorted(group) for group in found - KNOWN]
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(g) for g in sorted(new))
    gone = [sorted(group) for group in KNOWN - found]
    assert not gone, ("these known cycles are gone, remove them from KNOWN:\n"
                      + "\n".join(" <-> ".join(g) for g in sorted(gone)))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_finds_a_cycle_through_type_checking_and_a_function(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "from pkg.a import thing\n",
        "pkg/d.py": "from . import a\n",  # into the cycle, not part of it
    })
    edges = importgraph.graph(tmp_path, "pkg")
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.c"}
    assert importgraph.cycles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("text", ["from .. import sub\n", "import pkg.sub.x\n",
                                  "from ..sub.x import name\n"])
def test_imports_resolve_to_modules(tmp_path, text):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "",
                      "pkg/sub/x.py": "", "pkg/other/__init__.py": "",
                      "pkg/other/y.py": text})
    edges = importgraph.graph(tmp_path, "pkg")
    assert edges["pkg.other.y"] <= {"pkg.sub", "pkg.sub.x"} and edges["pkg.other.y"]
