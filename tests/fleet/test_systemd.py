"""The systemd units in deploy/systemd, installed by ``agentzip-blk install-units --prefix``,
pass ``systemd-analyze verify`` with no warning at all, and say what the design needs.

``systemd-analyze verify`` exits 0 on unknown keys and bad values (it only warns), so the test
requires empty output, and a negative control shows that a planted bad key is reported.
It needs no running systemd (measured: works in a container whose PID 1 is not systemd).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agentzip_blk import cli
from agentzip_blk.fleet import systemd as units_install
from agentzip_blk.host import swapunit

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")
UNITS = ["agentzip-blk.service", "agentzip-blk-health.service", "agentzip-blk-health.timer",
         "agentzip-blk-metrics.service", "agent-sandbox.slice",
         "agent-sandbox-demo.slice"]  # the last: an instance the drop-in applies to


def _bin() -> str:
    # ExecStart must name an existing executable or verify complains
    b = shutil.which("agentzip-blk") or str(Path(cli.__file__).resolve().parents[2] / ".venv/bin/agentzip-blk")
    if not os.access(b, os.X_OK):
        pytest.skip("agentzip-blk console script not installed (pip install -e .)")
    return b


def verify(unit_dir: Path, units: list[str]) -> subprocess.CompletedProcess:
    # --man=no: Documentation=man:agentzip-blk(1) is installed by the .deb, not by
    # install-units (tests/test_deb.py renders it); the trailing ":" keeps the system's units
    # (swap.target, sysinit.target...), so ordering cycles with them are found too
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_COLOR="0")
    return subprocess.run([ANALYZE, "verify", "--man=no", *units], env=env,
                          capture_output=True, text=True, timeout=60)


def directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value, split on whitespace: systemd adds up list settings
    given on several lines (Before=, After=, Wants=), which configparser would overwrite."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            section.setdefault(key.strip(), []).extend(value.split())
    return out


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
                     "agentzip-blk-health.service", "agentzip-blk-health.timer",
                     "agentzip-blk-metrics.service", "agentzip-blk.service"]
    svc = unit(d / "agentzip-blk.service")["Service"]
    assert svc["ExecStart"] == f"{b} up" and svc["ExecStop"] == f"{b} down"
    assert unit(d / "agentzip-blk-health.service")["Service"]["ExecStart"] == f"{b} status"
    for f in d.rglob("*"):
        if f.is_file():
            assert units_install.PLACEHOLDER_BIN not in f.read_text(), f
    assert "installed" in capsys.readouterr().out


def test_install_units_unit_dir_in_a_separate_process(tmp_path):
    """The .deb's layout (tools/build-deb.sh): --unit-dir puts the units under the prefix."""
    b = _bin()
    r = subprocess.run([b, "install-units", "--prefix", str(tmp_path), "--unit-dir",
                        "usr/lib/systemd/system", "--bin", "/usr/bin/agentzip-blk"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "usr/lib/systemd/system"
    assert unit(d / "agentzip-blk.service")["Service"]["ExecStart"] == "/usr/bin/agentzip-blk up"
    assert not (tmp_path / "etc").exists()


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


def test_boot_and_shutdown_order():
    """The device is swap before swap.target and the kubelet; the sandboxes come after it
    (so stop before its swapoff); systemd-oomd leaves them alone; a health timer shows a
    dead server."""
    src = units_install.SOURCE
    svc = directives(src / "agentzip-blk.service")
    u = svc["Unit"]
    assert {"swap.target", "kubelet.service", "shutdown.target"} <= set(u["Before"])
    # Before=swap.target with the default After=sysinit.target would be a cycle
    assert u["DefaultDependencies"] == ["no"]
    assert "man:agentzip-blk(1)" in u["Documentation"]
    assert "agentzip-blk-health.timer" in u["Wants"]
    for f in ("agent-sandbox.slice", "agent-sandbox-.slice.d/50-agentzip.conf"):
        d = directives(src / f)
        assert "agentzip-blk.service" in d["Unit"]["After"], f
        assert "agentzip-blk.service" in d["Unit"]["Wants"], f
        assert d["Slice"]["ManagedOOMPreference"] == ["omit"], f
        assert "slices.target" not in d["Unit"].get("Before", []), f
    health = directives(src / "agentzip-blk-health.service")
    assert health["Service"]["Type"] == ["oneshot"]
    assert health["Service"]["ExecStart"][1:] == ["status"]  # exit 3/4 -> unit failed
    assert health["Unit"]["Requisite"] == ["agentzip-blk.service"]
    timer = directives(src / "agentzip-blk-health.timer")
    assert timer["Timer"]["OnUnitActiveSec"] == ["30s"]
    assert timer["Unit"]["PartOf"] == ["agentzip-blk.service"]
    for f in src.rglob("*"):
        if f.is_file() and "Description" in f.read_text():
            assert "Documentation" in directives(f)["Unit"], f


@needs_analyze
def test_verify_catches_an_ordering_cycle(tmp_path):
    """Negative control for the order: without DefaultDependencies=no, Before=swap.target
    closes a cycle through sysinit.target, and verify (on the system's units too) says so."""
    res = units_install.install(str(tmp_path), _bin())
    svc = Path(res.unit_dir) / "agentzip-blk.service"
    svc.write_text(svc.read_text().replace("DefaultDependencies=no\n", ""))
    r = verify(Path(res.unit_dir), ["agentzip-blk.service"])
    assert "ordering cycle" in r.stdout + r.stderr


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


def test_a_stop_does_not_hang_a_reboot_for_half_an_hour():
    svc = directives(units_install.SOURCE / "agentzip-blk.service")["Service"]
    assert svc["TimeoutStopSec"] == ["5min"]


def test_the_swap_unit_drop_in_is_what_systemd_escapes(tmp_path):
    path = swapunit.write_order("/dev/loop12", str(tmp_path))
    assert path == str(tmp_path / "dev-loop12.swap.d" / "50-agentzip.conf")
    assert directives(Path(path))["Unit"]["Before"] == ["agentzip-blk.service"]
    escape = shutil.which("systemd-escape")
    if escape:
        r = subprocess.run([escape, "--path", "--suffix=swap", "/dev/loop12"],
                           capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == swapunit.unit_name("/dev/loop12")
    swapunit.remove_order("/dev/loop12", str(tmp_path))
    assert not (tmp_path / "dev-loop12.swap.d").exists()


def _with_swap_unit(tmp_path: Path) -> Path:
    """Our units plus the swap unit systemd would make of /proc/swaps for /dev/loop0 (verify
    needs a file for it), and a probe: ordered after agentzip-blk.service and before the swap
    unit, and pulling both into its start. Only if the swap unit is ordered before
    agentzip-blk.service does that close a cycle, so verify's word on the probe shows the order
    the drop-in gives."""
    d = Path(units_install.install(str(tmp_path), _bin()).unit_dir)
    (d / "dev-loop0.swap").write_text("[Unit]\nDescription=agentzip swap (test)\n"
                                      "[Swap]\nWhat=/dev/loop0\n")
    (d / "order-probe.service").write_text(
        "[Unit]\nDescription=order probe\nWants=agentzip-blk.service dev-loop0.swap\n"
        "After=agentzip-blk.service\nBefore=dev-loop0.swap\n"
        "[Service]\nType=oneshot\nExecStart=/bin/true\n")
    return d


@needs_analyze
def test_the_drop_in_orders_the_swap_unit_stop_after_down(tmp_path):
    d = _with_swap_unit(tmp_path)
    swapunit.write_order("/dev/loop0", str(d))
    r = verify(d, UNITS + ["dev-loop0.swap"])  # clean with the drop-in: no cycle, no warning
    assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr
    r = verify(d, ["order-probe.service"])
    assert "ordering cycle" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "dev-loop0.swap" in r.stdout + r.stderr


@needs_analyze
def test_without_the_drop_in_the_swap_unit_has_no_order(tmp_path):
    """The negative control: the probe is fine when nothing orders the swap unit."""
    d = _with_swap_unit(tmp_path)
    r = verify(d, ["order-probe.service"])
    assert "ordering cycle" not in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.skipif(not swapunit.systemd_running(),
                    reason="systemd is not PID 1 here: no real start/stop (the order is "
                           "verified with systemd-analyze above)")
@pytest.mark.swap
def test_a_real_stop_swaps_off_in_down_before_the_swap_unit(tmp_path):  # pragma: no cover
    """Where systemd runs: the units in /run/systemd/system with a test config, start, then
    stop; `down` (ExecStop) did the swapoff, with its lines in the journal, and the swap
    unit is inactive after it."""
    from agentzip_blk import procfs
    if procfs.swaps():
        pytest.skip("a swap area is active: this test must own swap")
    b = _bin()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"device: {{size: 256M, run_dir: {tmp_path / 'run'}}}\n"
                   f"pool: {{swap_out_path: {tmp_path / 'tier'}}}\n")
    res = units_install.install("/", b, unit_dir="run/systemd/system")
    drop = Path("/run/systemd/system/agentzip-blk.service.d")
    drop.mkdir(exist_ok=True)
    (drop / "90-test.conf").write_text(f"[Service]\nExecStart=\nExecStart={b} --config {cfg} up\n"
                                       f"ExecStop=\nExecStop={b} --config {cfg} down\n")

    def ctl(*args):
        return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=600)
    try:
        ctl("daemon-reload")
        assert ctl("start", "agentzip-blk.service").returncode == 0
        (area,) = procfs.swaps()
        unit = swapunit.unit_name(area.filename)
        after = ctl("show", "-p", "After", "agentzip-blk.service").stdout
        assert unit in after, after
        assert ctl("stop", "agentzip-blk.service").returncode == 0
        assert not procfs.swaps()
        assert ctl("show", "-p", "ActiveState", unit).stdout.strip() == "ActiveState=inactive"
        journal = subprocess.run(["journalctl", "-u", "agentzip-blk.service", "-n", "50",
                                  "--no-pager"], capture_output=True, text=True).stdout
        assert f"swapoff {area.filename}" in journal
    finally:
        ctl("stop", "agentzip-blk.service")
        for f in res.files:
            Path(f).unlink(missing_ok=True)
        shutil.rmtree(drop, ignore_errors=True)
        ctl("daemon-reload")


def _exposure(unit_dir: Path, unit: str) -> tuple[float, str]:
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_COLOR="0")
    r = subprocess.run([ANALYZE, "security", "--offline=true", "--no-pager", unit], env=env,
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1)), r.stdout


EXAMPLES = Path(__file__).resolve().parents[2] / "tools/debian/examples"


@needs_analyze
def test_the_exporter_unit_is_confined(tmp_path):
    """`systemd-analyze security`: 9.6 UNSAFE before issue 29 (root, nothing taken away); now
    root with two capabilities and a read-only view of the system, and with the shipped
    non-root drop-in no capability at all."""
    d = Path(units_install.install(str(tmp_path), _bin()).unit_dir)
    score, out = _exposure(d, "agentzip-blk-metrics.service")
    assert score <= 2.5, out
    svc = directives(d / "agentzip-blk-metrics.service")["Service"]
    assert set(svc["CapabilityBoundingSet"]) == {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE"}
    assert svc["ProtectSystem"] == ["strict"] and svc["NoNewPrivileges"] == ["yes"]
    assert svc["ExecStart"][1:] == ["metrics"]  # the address is metrics.listen's
    drop = d / "agentzip-blk-metrics.service.d"
    drop.mkdir()
    text = (EXAMPLES / "agentzip-blk-metrics-nonroot.conf").read_text()
    (drop / "50-nonroot.conf").write_text(text.replace("/usr/bin/agentzip-blk", _bin()))
    nonroot, out = _exposure(d, "agentzip-blk-metrics.service")
    assert nonroot < score and nonroot <= 1.5, out
    r = verify(d, ["agentzip-blk-metrics.service"])
    assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr
