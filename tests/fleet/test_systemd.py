"""The systemd units in deploy/systemd, installed by ``agentzip-blk install-units --prefix``,
pass ``systemd-analyze verify`` with no warning at all, and say what the design needs.

``systemd-analyze verify`` exits 0 on unknown keys and bad values (it only warns), so the test
requires empty output, and a negative control shows that a planted bad key is reported.
It needs no running systemd (measured: works in a container whose PID 1 is not systemd).
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agentzip_blk import cli
from agentzip_blk.fleet import systemd as units_install

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")
UNITS = ["agentzip-blk.service", "agentzip-blk-metrics.service", "agent-sandbox.slice",
         "agent-sandbox-demo.slice"]  # the last: an instance the drop-in applies to


def _bin() -> str:
    # ExecStart must name an existing executable or verify complains
    b = shutil.which("agentzip-blk") or str(Path(cli.__file__).resolve().parents[2] / ".venv/bin/agentzip-blk")
    if not os.access(b, os.X_OK):
        pytest.skip("agentzip-blk console script not installed (pip install -e .)")
    return b


def verify(unit_dir: Path, units: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_COLOR="0")
    return subprocess.run([ANALYZE, "verify", *units], env=env, capture_output=True,
                          text=True, timeout=60)


def unit(path: Path) -> configparser.ConfigParser:
    p = configparser.ConfigParser(strict=False, interpolation=None)
    p.optionxform = str  # keys are case-sensitive
    p.read(path)
    return p


def test_install_units_cli(tmp_path, capsys):
    b = _bin()
    assert cli.main(["install-units", "--prefix", str(tmp_path), "--bin", b]) == 0
    d = tmp_path / "etc/systemd/system"
    names = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert names == ["agent-sandbox-.slice.d/50-agentzip.conf", "agent-sandbox.slice",
                     "agentzip-blk-metrics.service", "agentzip-blk.service"]
    svc = unit(d / "agentzip-blk.service")["Service"]
    assert svc["ExecStart"] == f"{b} up" and svc["ExecStop"] == f"{b} down"
    assert units_install.PLACEHOLDER_BIN not in (d / "agentzip-blk.service").read_text()
    assert "installed" in capsys.readouterr().out


def test_unit_semantics():
    src = units_install.SOURCE
    svc = unit(src / "agentzip-blk.service")["Service"]
    # oneshot up/down; never restarted, and nothing killed on stop but by `down` itself
    assert svc["Type"] == "oneshot" and svc["RemainAfterExit"] == "yes"
    assert svc["Restart"] == "no" and svc["KillMode"] == "process" and svc["SendSIGKILL"] == "no"
    assert svc["ExecStart"].endswith(" up") and svc["ExecStop"].endswith(" down")
    assert svc["OOMScoreAdjust"] == "-1000" and svc["MemorySwapMax"] == "0"
    drop = unit(src / "agent-sandbox-.slice.d/50-agentzip.conf")["Slice"]
    assert drop["MemoryAccounting"] == "yes" and drop["MemorySwapMax"] == "infinity"
    assert drop["MemoryHigh"] == "infinity" and drop["MemoryMax"] == "infinity"
    assert drop["MemoryLow"] == "0"


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    res = units_install.install(str(tmp_path), _bin())
    d = Path(res.unit_dir)
    r = verify(d, UNITS)
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr


@needs_analyze
def test_verify_catches_a_bad_key(tmp_path):
    """Negative control: the check above would see a mistake in the service or the drop-in."""
    res = units_install.install(str(tmp_path), _bin())
    d = Path(res.unit_dir)
    with open(d / "agent-sandbox-.slice.d/50-agentzip.conf", "a") as f:
        f.write("MemorySwapMaxx=1\n")
    svc = d / "agentzip-blk.service"
    svc.write_text(svc.read_text().replace("Type=oneshot", "Type=oneshotx"))
    r = verify(d, UNITS)
    out = r.stdout + r.stderr
    assert "MemorySwapMaxx" in out and "oneshotx" in out
