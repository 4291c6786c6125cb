"""The layout as a contract: layers point one way (import-linter, `.importlinter`), and no
module uses another module's private names (`_x`): what two modules share is public."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from importgraph import resolve as _resolve

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agentzip_blk"
# Code outside the package that is held to the same rule: it uses the package as a library.
OTHERS = sorted((ROOT / "tools").glob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)




def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path, module: str | None = None) -> list[str]:
    """`from M import _x` and `m._x` (m an imported module of the package) in one file."""
    is_package = path.name == "__init__.py"
    if module is None:
        module = _module_name(path) if path.is_relative_to(PACKAGE) else path.stem
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    aliases: set[str] = set()  # names bound to modules of the package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, is_package)
            if not source.startswith("agentzip_blk"):
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path}:{node.lineno}: from {source} import {alias.name}")
                else:
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("agentzip_blk"):
                    aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and \
                isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    # demo/scripts: standalone programs the demo runs, not modules of the package
    files = [f for f in sorted(PACKAGE.rglob("*.py")) if "scripts" not in f.parts] + OTHERS
    found = [use for f in files for use in private_uses(f)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_finds_a_private_import(tmp_path):
    """The check can fail: both forms are found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .store.pagestore import _ticks\nfrom . import demo\ndemo._x\n")
    found = private_uses(probe, "agentzip_blk.probe")
    assert len(found) == 2 and "_ticks" in found[0] and "demo._x" in found[1]


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports (import-linter) is missing: ./setup.sh installs the test extra")
    return exe


def test_layers_point_one_way():
    """cli -> fleet | demo -> host : cgroups -> datapath -> store -> codec -> config | procfs
    -> errors."""
    res = subprocess.run([_lint_imports(), str(ROOT / ".importlinter")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_contract_catches_an_upward_import(tmp_path):
    """The contract can fail: in a copy of the package, a store module importing the CLI."""
    copy = tmp_path / "agentzip_blk"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "store" / "_probe_upward.py").write_text("from .. import cli  # noqa: F401\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    res = subprocess.run([_lint_imports(), str(ROOT / ".importlinter"), "--no-cache"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "agentzip_blk.store._probe_upward" in res.stdout
