"""The .deb's lifecycle on this machine, as an operator runs it (issue 29, item 1): install,
`up` with the packaged defaults and swap in use, upgrade to a second build (the server keeps
serving on its old code and `status` says so), `dpkg -r` refused with one line, `down`,
remove, purge (what the programs wrote is gone). Every step is its own process: dpkg, or
/usr/bin/agentzip-blk on Debian's python3.

It installs on the machine itself (no chroot: debootstrap needs minutes and a mirror), so it
runs only where it can put the machine back as it found it: root, the package not installed,
no /etc/agentzip, /var/lib/agentzip or /run/agentzip, no swap area; it holds the swap lock
(the packaged defaults use /run/agentzip), and its finally purges the package, whatever
happened. systemd is not PID 1 here, so the maintainer scripts' systemctl calls are skipped
(their `[ -d /run/systemd/system ]` guard); the units' order is tests/fleet/test_systemd.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentzip_blk import __version__, procfs
from agentzip_blk.cgroups.fs import LimitBusy, MemoryCgroup
from agentzip_blk.demo.workload import Workload
from agentzip_blk.host.procs import tail

ROOT = Path(__file__).resolve().parents[1]
PKG = "agentzip-blk"
BIN = "/usr/bin/agentzip-blk"
V2 = f"{__version__}+lifecycle1"  # the second build: dpkg orders it after the first
TOUCHED = ("/etc/agentzip", "/var/lib/agentzip", "/run/agentzip")

pytestmark = [
    pytest.mark.swap,  # conftest: /tmp/agentzip-swap.lock for the whole test
    pytest.mark.skipif(os.geteuid() != 0, reason="installs a package: root only"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in ("dpkg", "dpkg-deb", "cc",
                                                             "nbdkit", "losetup")),
                       reason="needs dpkg, cc, nbdkit, util-linux (./setup.sh test)"),
]


def run(cmd, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def clean_env() -> dict[str, str]:
    """An operator's shell: Debian's python3 first, nothing of the venv or this checkout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "AGENTZIP_", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def az(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run([BIN, *args], timeout=timeout, env=clean_env(), cwd="/")


def dpkg(*args: str) -> subprocess.CompletedProcess:
    return run(["dpkg", *args], env=clean_env(), timeout=600)


def status_of_package() -> str:
    r = run(["dpkg-query", "-W", "-f", "${Status}", PKG])
    return r.stdout.strip() if r.returncode == 0 else "not installed"


def build(tree: Path, out: Path) -> Path:
    r = run([str(tree / "tools/build-deb.sh"), str(out)], timeout=600,
            env=dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(tree)))
    assert r.returncode == 0, r.stdout + r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def second_tree(tmp: Path) -> Path:
    """This checkout's tracked files, calling themselves V2 (pyproject, __init__, changelog)."""
    tracked = run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    dst = tmp / "v2"
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel, follow_symlinks=False)
        elif (ROOT / rel).is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(ROOT / rel), dst / rel)
    for rel in ("pyproject.toml", "agentzip_blk/__init__.py"):
        p = dst / rel
        p.write_text(p.read_text().replace(f'"{__version__}"', f'"{V2}"', 1))
    changelog = dst / "tools/debian/changelog"
    changelog.write_text(
        f"{PKG} ({V2}) bookworm; urgency=medium\n\n  * A second build, for the upgrade test.\n\n"
        f" -- agentzip-blk maintainers <agentzip-blk@example.org>  Wed, 02 Dec 2026 17:00:00 "
        f"+0000\n\n" + changelog.read_text())
    return dst


@pytest.fixture
def machine():
    """Skip unless the machine can be put back exactly; put it back afterwards."""
    if status_of_package() != "not installed":
        pytest.skip(f"{PKG} is installed on this machine: this test would replace it")
    # an empty directory is put back as it was (another run's server may have made
    # /var/lib/agentzip for its disk tier); anything with content would be lost: skip
    empty = {p: os.stat(p) for p in TOUCHED if os.path.isdir(p) and not os.listdir(p)}
    there = [p for p in TOUCHED if os.path.exists(p) and p not in empty]
    if there:
        pytest.skip(f"{', '.join(there)} exist: this test would change them")
    if procfs.swaps():
        pytest.skip("a swap area is active: this test must own swap")
    cleanup: list = []
    yield cleanup
    for step in reversed(cleanup):
        try:
            step()
        except Exception as e:  # keep going: the package must be purged whatever failed
            print(f"cleanup: {e}", file=sys.stderr)
    if os.path.exists("/run/agentzip/state.json"):
        cli = [BIN] if os.path.exists(BIN) else [os.path.join(os.path.dirname(sys.executable),
                                                               PKG)]
        run([*cli, "--run-dir", "/run/agentzip", "down", "--force"], timeout=600)
    if status_of_package() != "not installed":
        run(["dpkg", "--purge", "--force-remove-reinstreq", PKG])
    for p in TOUCHED:
        shutil.rmtree(p, ignore_errors=True)
    for p, st in empty.items():
        os.makedirs(p, exist_ok=True)
        os.chmod(p, st.st_mode & 0o7777)
        os.chown(p, st.st_uid, st.st_gid)
    assert status_of_package() == "not installed"
    assert not procfs.swaps(), procfs.swaps()


def test_install_up_upgrade_refused_remove_down_remove_purge(machine, tmp_path):
    v1 = build(ROOT, tmp_path / "dist1")
    v2 = build(second_tree(tmp_path), tmp_path / "dist2")
    assert v2.name == f"{PKG}_{V2}_{v1.name.rsplit('_', 1)[1].removesuffix('.deb')}.deb"

    # install; the Depends are the host's (dpkg -i installs nothing else)
    r = dpkg("-i", str(v1))
    if r.returncode != 0 and "dependency problems" in r.stdout + r.stderr:
        pytest.skip("the .deb's Depends are not installed here (./setup.sh test installs them)")
    assert r.returncode == 0, r.stdout + r.stderr
    assert status_of_package() == "install ok installed"
    assert az("--version").stdout.split()[-1] == __version__

    # up with the packaged defaults (/etc/agentzip/config.yaml, all commented out)
    r = az("up")
    assert r.returncode == 0, r.stdout + r.stderr
    machine.append(lambda: az("down", "--force", timeout=600))

    # swap in use: a workload in a cgroup below ours, squeezed into the device
    cg = MemoryCgroup.create(f"azt-deb-{os.getpid()}")
    machine.append(lambda: cg.remove(timeout=60))
    cg.allow_swap()
    wl = Workload(cg, 96, seed=29)
    machine.append(wl.stop)
    wl.expect("READY", timeout=300)
    target = int(cg.usage() * 0.3)
    for _ in range(50):
        try:
            cg.set_limit(target)
            break
        except LimitBusy:
            time.sleep(0.2)
    used = procfs.swaps()[0].used
    assert used > 16 << 20, procfs.swaps()

    # upgrade under it: postinst hands the store to a server of the new code (restart), with
    # swap in use and no swapoff; status then shows one version, the new one
    old_pid = json.loads(az("status", "--json").stdout)["state"]["nbdkit_pid"]
    r = dpkg("-i", str(v2))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restarted: server pid" in r.stdout, r.stdout + r.stderr
    assert az("--version").stdout.split()[-1] == V2
    r = az("status")
    assert r.returncode == 0, r.stdout + r.stderr
    warn = [line for line in (r.stdout + r.stderr).splitlines() if "installed agentzip-blk" in line]
    assert warn == [], r.stdout + r.stderr
    st = json.loads(az("status", "--json").stdout)
    assert st["state"]["nbdkit_pid"] != old_pid and st["server"]["version"] == V2, st
    assert procfs.swaps()[0].used > 0  # the same swap area, still in use

    # a crash of the new server (issue 28): the holder starts another from its memory, on
    # the packaged code and paths; every page is checked below, after down
    dead = st["state"]["nbdkit_pid"]
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        st = json.loads(az("status", "--json").stdout)
        if (st["state"]["nbdkit_pid"] != dead and st["healthy"] is True
                and st["server"]["recoveries"] == 1):
            break
        assert time.monotonic() < deadline, (st, tail("/run/agentzip/holder.log"))
        time.sleep(0.5)
    assert st["server"]["version"] == V2 and procfs.swaps()[0].used > 0, st

    # remove refused: one line that says what to run; nothing removed
    r = dpkg("-r", PKG)
    assert r.returncode != 0
    ours = [line for line in r.stderr.splitlines() if line.startswith("agentzip-blk: error:")]
    assert len(ours) == 1 and "systemctl stop agentzip-blk" in ours[0], r.stderr
    # dpkg records the wish (deinstall) but the package stays installed and configured
    assert status_of_package().endswith(" ok installed"), status_of_package()
    assert os.path.exists(BIN) and procfs.swaps()

    # a tool writes its drop-in (purge must take it), then down brings every page back
    assert az("scope", "add", "--cgroup", "lifecycle-test-*.slice").returncode == 0
    assert os.path.exists("/etc/agentzip/config.d/90-scopes.yaml")
    cg.set_limit(None)
    r = az("down")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not procfs.swaps()
    wl.send("TOUCH")
    assert wl.expect("VERIFY", timeout=600)[1] == "ok"  # nothing lost over the upgrade

    # remove: the program goes, the conffile stays
    r = dpkg("-r", PKG)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not os.path.exists(BIN)
    assert os.path.exists("/etc/agentzip/config.yaml")
    assert status_of_package().startswith("deinstall ok config-files")

    # purge: nothing of ours left
    r = dpkg("-P", PKG)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status_of_package() == "not installed"
    left = [p for p in TOUCHED if os.path.exists(p)]
    assert not left, left  # (an empty one that was there before comes back after the test)
    assert not os.path.exists("/usr/lib/agentzip-blk")
