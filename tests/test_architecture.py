"""The layout as a contract: layers point one way (import-linter, `.importlinter`), and no
module uses another module's private names (`_x`): what two modules share is public. Both hold
for the package and for the benchmarks (bench/: no bench imports another, the harness is below
them, the package never imports them)."""

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
BENCH = ROOT / "bench"
ROOTS = ("agentzip_blk", "bench")  # the packages whose private names stay private
# The benchmarks, held to the same rule; bench/workloads: standalone programs a bench starts
BENCHES = [f for f in sorted(BENCH.rglob("*.py")) if "workloads" not in f.relative_to(BENCH).parts]
# Code outside both packages that is held to it too: it uses them as libraries.
OTHERS = sorted((ROOT / "tools").rglob("*.py"))


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
        inside = path.is_relative_to(PACKAGE) or path.is_relative_to(BENCH)
        module = _module_name(path) if inside else path.stem
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    aliases: set[str] = set()  # names bound to modules of the package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, is_package)
            if source.split(".")[0] not in ROOTS:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path}:{node.lineno}: from {source} import {alias.name}")
                else:
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and \
                isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    # demo/scripts: standalone programs the demo runs, not modules of the package
    files = [f for f in sorted(PACKAGE.rglob("*.py")) if "scripts" not in f.parts] + BENCHES + OTHERS
    found = [use for f in files for use in private_uses(f)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_finds_a_private_import(tmp_path):
    """The check can fail: both forms are found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .store.pagestore import _ticks\nfrom . import demo\ndemo._x\n")
    found = private_uses(probe, "agentzip_blk.probe")
    assert len(found) == 2 and "_ticks" in found[0] and "demo._x" in found[1]


def test_the_check_finds_a_private_import_between_benches(tmp_path):
    """Between benches too (bench_report once imported the demo bench's `_f, _m, _x`)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .demo import _f\nfrom bench import swap\nswap._kill_all\n")
    found = private_uses(probe, "bench.probe")
    assert len(found) == 2 and "bench.demo import _f" in found[0] and "swap._kill_all" in found[1]


def test_the_benches_are_covered():
    """Every bench module is in the private-name check, and not only the package."""
    names = {f.relative_to(ROOT).as_posix() for f in BENCHES}
    assert {"bench/swap.py", "bench/harness/lock.py", "bench/cli.py"} <= names
    assert not any(n.startswith("bench/workloads/") for n in names)


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


def _lint_a_copy(tmp_path: Path, probe: str, text: str) -> subprocess.CompletedProcess:
    """lint-imports on a copy of both packages, with *text* appended to the copy's *probe*."""
    for pkg in (PACKAGE, BENCH):
        shutil.copytree(pkg, tmp_path / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / probe, "a", encoding="utf-8") as f:
        f.write(text)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([_lint_imports(), str(ROOT / ".importlinter"), "--no-cache"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_every_bench_is_in_the_contract():
    """A bench left out of the benchmarks' layers would be free to import any other."""
    import configparser

    sys.path.append(str(ROOT))
    from bench.cli import BENCHES

    ini = configparser.ConfigParser()
    ini.read(ROOT / ".importlinter")
    layers = ini["importlinter:contract:benchmarks"]["layers"].split("\n")
    independent = next(layer for layer in layers if "bench.swap |" in layer or "| bench.swap" in layer)
    assert sorted(m.strip() for m in independent.split("|")) == sorted(f"bench.{n}" for n in BENCHES)


def test_the_contract_catches_an_upward_import(tmp_path):
    """The contract can fail: in a copy of the package, a store module importing the CLI."""
    res = _lint_a_copy(tmp_path, "agentzip_blk/store/_probe_upward.py",
                       "from .. import cli  # noqa: F401\n")
    assert res.returncode != 0 and "agentzip_blk.store._probe_upward" in res.stdout


def test_the_contract_keeps_the_store_facade_on_top(tmp_path):
    """Inside the store, the tiers, the accounting and the recompressor get the store's
    parts (store/parts.py), never the facade: not even a TYPE_CHECKING import of it."""
    res = _lint_a_copy(tmp_path, "agentzip_blk/store/tiering.py",
                       "if TYPE_CHECKING:\n    from .pagestore import PageStore  # noqa: F401\n")
    assert res.returncode != 0, res.stdout
    assert "agentzip_blk.store.tiering -> agentzip_blk.store.pagestore" in res.stdout, res.stdout


def test_the_contract_catches_a_bench_importing_another(tmp_path):
    """And for the benchmarks: a bench importing another bench, the harness importing a
    bench, the package importing the benchmarks."""
    res = _lint_a_copy(tmp_path, "bench/hash.py", "from bench import demo  # noqa: F401,E402\n")
    assert res.returncode != 0 and "bench.hash -> bench.demo" in res.stdout, res.stdout


def test_the_contract_catches_the_harness_importing_a_bench(tmp_path):
    res = _lint_a_copy(tmp_path, "bench/harness/md.py", "from bench import swap  # noqa: F401,E402\n")
    assert res.returncode != 0 and "bench.harness.md -> bench.swap" in res.stdout, res.stdout


def test_the_contract_catches_the_package_importing_a_bench(tmp_path):
    res = _lint_a_copy(tmp_path, "agentzip_blk/procfs.py", "import bench.harness  # noqa: F401,E402\n")
    assert res.returncode != 0 and "agentzip_blk.procfs -> bench.harness" in res.stdout, res.stdout
