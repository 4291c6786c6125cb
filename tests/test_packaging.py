"""A normal (non-editable) install carries what the program needs at run time, and declares
the third-party packages it imports: the wheel is built from a copy of the tree and read."""

from __future__ import annotations

import ast
import email
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agentzip_blk.datapath import native

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, for the packages whose names differ
DISTRIBUTION = {"yaml": "pyyaml", "ruamel": "ruamel.yaml", "prometheus_client": "prometheus-client"}
# modules that are not on PyPI: nbdkit's embedded interpreter provides `nbdkit` to the plugin
# (Debian's nbdkit-plugin-python, a setup.sh package)
NOT_FROM_PYPI = {"nbdkit"}
RUNTIME_FILES = [
    "agentzip_blk/codec/dicts/manifest.json",
    "agentzip_blk/codec/dicts/python312.dict",
    "agentzip_blk/demo/scripts/agent_json.py",  # the demo's workload and the modules it imports
    "agentzip_blk/demo/scripts/protocol.py",
    "agentzip_blk/demo/scripts/pagewalk.py",
    "agentzip_blk/fleet/units/agentzip-blk.service",  # systemd units
    "agentzip_blk/fleet/units/agentzip-blk-metrics.service",
    "agentzip_blk/fleet/units/agentzip-blk-health.service",  # the watchdog and its timer
    "agentzip_blk/fleet/units/agentzip-blk-health.timer",
    "agentzip_blk/fleet/units/agent-sandbox.slice",
    "agentzip_blk/fleet/units/agent-sandbox-.slice.d/50-agentzip.conf",
    "agentzip_blk/datapath/nbdkit_plugin.py",  # the plugin nbdkit loads
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():  # a file deleted in the work tree is not built
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True, timeout=300)
    (path,) = out.glob("agentzip_blk-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_carries_the_runtime_files(wheel):
    names = set(wheel.namelist())
    missing = [f for f in RUNTIME_FILES if f not in names]
    assert not missing, f"not in the wheel: {missing}"
    manifest = wheel.read("agentzip_blk/codec/dicts/manifest.json")
    for entry in json.loads(manifest)["dictionaries"]:
        assert f"agentzip_blk/codec/dicts/{entry['file'] or entry['name'] + '.dict'}" in names


def test_every_package_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    for init in (ROOT / "agentzip_blk").rglob("__init__.py"):
        rel = init.relative_to(ROOT).as_posix()
        assert rel in names, rel


def _third_party_imports() -> set[str]:
    found = set()
    for path in (ROOT / "agentzip_blk").rglob("*.py"):
        if "scripts" in path.parts:  # standalone programs, run by any python
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found
            if m not in sys.stdlib_module_names and m != "agentzip_blk" and m not in NOT_FROM_PYPI}


def test_runtime_dependencies_are_declared(wheel):
    (meta_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(wheel.read(meta_name))
    declared = set()
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue  # test, bench, corpus: not what the program runs on
        declared.add(re.match(r"[A-Za-z0-9._-]+", req).group(0).lower())
    imports = _third_party_imports()
    assert "sortedcontainers" in imports  # the check sees the imports it is about
    undeclared = sorted(m for m in imports if DISTRIBUTION.get(m, m).lower() not in declared)
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_the_installed_wheel_runs_without_the_tree(wheel, tmp_path):
    """Unpacked elsewhere, the package finds its own files: dictionaries, the workload, the
    plugin and the systemd units."""
    target = tmp_path / "site"
    wheel.extractall(target)
    probe = (
        "import os, agentzip_blk\n"
        "from agentzip_blk.codec.dictionaries import known_names\n"
        "from agentzip_blk.demo.workload import WORKLOAD\n"
        "from agentzip_blk.fleet.systemd import unit_files\n"
        "from agentzip_blk.host.servercmd import default_plugin_path\n"
        f"assert agentzip_blk.__file__.startswith({str(target)!r}), agentzip_blk.__file__\n"
        "assert 'python312' in known_names()\n"
        f"assert WORKLOAD.startswith({str(target)!r}) and os.path.isfile(WORKLOAD)\n"
        f"assert default_plugin_path().startswith({str(target)!r})\n"
        "assert os.path.isfile(default_plugin_path())\n"
        "assert {u.name for u in unit_files()} >= {'agentzip-blk.service', '50-agentzip.conf'}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "AGENTZIP_PLUGIN"}
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not all(os.path.exists(h) for h in ("/usr/include/lz4.h", "/usr/include/xxhash.h")),
                    reason="liblz4-dev / libxxhash-dev missing")
def test_the_extension_is_built_where_its_headers_are():
    assert native.available(), native.MISSING
