"""The run directory gives no orders (issue 27, item 1), through the installed CLI, every
step its own process as an operator runs it. A container that mounts the run directory
read-write (the tuner's) can write any file there; none of them may make `up`'s server or
`down` act on anything but what `up` set up: not a drop-in in RUN/config.d, not an edited
RUN/config.yaml, not a state.json that names another swap area."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from agentzip_blk import procfs
from agentzip_blk.datapath import control
from agentzip_blk.host import facts, procs
from agentzip_blk.store.disk import TIER_HEADER
from host.test_device import assert_clean, leftovers

AZ = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
TREE = str(Path(__file__).resolve().parents[2])

pytestmark = [
    pytest.mark.swap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (swapon, loop, FUSE)"),
    pytest.mark.skipif(bool(facts.missing_tools(["nbdkit", "losetup", "mkswap", "swapon",
                                                 "fusermount3"])),
                       reason="nbdkit/util-linux/fuse3 missing (./setup.sh installs them)"),
    pytest.mark.skipif(not os.path.exists(AZ), reason="the agentzip-blk entry point is not installed"),
]


class Host:
    """A config of the operator's (outside the run directory), a run directory, the CLI."""

    def __init__(self) -> None:
        self.base = tempfile.mkdtemp(prefix="azord-", dir="/tmp")
        self.run_dir = os.path.join(self.base, "run")
        self.config = os.path.join(self.base, "config.yaml")
        self.tier = os.path.join(self.base, "tier")
        with open(self.config, "w") as f:
            yaml.safe_dump({"device": {"size": "64M", "run_dir": self.run_dir},
                            "pool": {"swap_out_path": self.tier}}, f)

    def az(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([AZ, "--config", self.config, *args], capture_output=True,
                              text=True, timeout=180, env={**os.environ, "PYTHONPATH": TREE},
                              stdin=subprocess.DEVNULL, cwd="/")
        if check:
            assert proc.returncode == 0, f"{args}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
        return proc

    def plant(self, name: str, data: dict) -> None:
        """What a container with the run directory mounted read-write can do."""
        os.makedirs(os.path.join(self.run_dir, "config.d"), exist_ok=True)
        with open(os.path.join(self.run_dir, "config.d", name), "w") as f:
            yaml.safe_dump(data, f)

    def victim(self, name: str, data: bytes = b"precious\n", mode: int = 0o644) -> str:
        path = os.path.join(self.base, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        return path

    def state(self) -> dict:
        return json.loads(Path(self.run_dir, "state.json").read_text())

    def close(self) -> None:
        if os.path.exists(os.path.join(self.run_dir, "state.json")):
            if self.az("down", "--force", check=False).returncode != 0:
                from agentzip_blk.host import attach
                attach.down(self.run_dir, force=True, timeout=30)
        clean = not any(leftovers(self.run_dir).values())
        if clean:
            shutil.rmtree(self.base, ignore_errors=True)
        assert_clean(self.run_dir)


@pytest.fixture
def host():
    h = Host()
    try:
        yield h
    finally:
        h.close()


def test_a_dropin_in_the_run_directory_does_not_reach_the_server(host):
    """A drop-in in RUN/config.d before `up` does not reach the server's config."""
    os.makedirs(host.run_dir, mode=0o700)
    host.plant("50-x.yaml", {"compression": {"dedup": "off"}})
    host.az("up")
    stats = json.loads(host.az("stats", "--json").stdout)
    assert stats["dedup"] is True, "the server read RUN/config.d"
    # what `down` acts on comes from the server's memory: the device up armed, its tier file
    st = os.stat(host.tier)
    reply = control.request(host.state()["control_socket"], "owned")
    assert reply == {"device": host.state()["device"],
                     "tier": {"path": host.tier, "dev": st.st_dev, "ino": st.st_ino}}
    host.az("down")


def test_a_dropin_in_the_run_directory_cannot_make_down_delete_a_file(host):
    """One written while the device is up, naming a file as the tier (the attack: a file
    such as /etc/shadow), does not make `down` delete that file; the real tier goes."""
    host.az("up")
    assert os.path.exists(host.tier)
    victim = host.victim("shadow")
    host.plant("60-y.yaml", {"pool": {"swap_out_path": victim}})
    host.az("down")
    assert Path(victim).read_bytes() == b"precious\n", "down deleted the file a drop-in named"
    assert not os.path.exists(host.tier), "down left the real tier file behind"


def test_an_edited_run_config_is_not_where_down_looks_for_a_dead_servers_tier(host):
    """The server dies (after swapoff: no page is lost), the run directory's config.yaml
    now names another file, even one carrying the tier header: `down --force` removes the
    tier that the operator's config names, and leaves the other file alone."""
    host.az("up")
    state = host.state()
    victim = host.victim("looks-like-a-tier", TIER_HEADER + b"someone's data", 0o600)
    run_config = os.path.join(host.run_dir, "config.yaml")
    data = yaml.safe_load(Path(run_config).read_text())
    data["pool"]["swap_out_path"] = victim
    Path(run_config).write_text(yaml.safe_dump(data))
    subprocess.run(["swapoff", state["device"]], check=True, timeout=120)
    os.kill(state["nbdkit_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while procs.pid_alive(state["nbdkit_pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(host.tier), "a killed server leaves its tier file"
    down = host.az("down", "--force")
    assert "tier file left" not in down.stderr, down.stderr
    assert not os.path.exists(host.tier), "the operator's tier path was not cleaned"
    assert Path(victim).read_bytes() == TIER_HEADER + b"someone's data"


def test_a_changed_run_config_stops_the_server_from_starting(tmp_path):
    """The server reads the file `up` wrote only with the bytes `up` wrote (its digest on
    the command line): a config.yaml edited in between is refused in one line."""
    from agentzip_blk.config import Config, ConfigError, load_file
    from agentzip_blk.datapath.server import Server
    from agentzip_blk.host.chain import write_effective_config

    path, digest = write_effective_config(Config(), str(tmp_path))
    assert load_file(path, sha256=digest).compression.dedup == "on"
    with open(path, "a") as f:
        f.write("compression: {dedup: 'off'}\n")
    with pytest.raises(ConfigError, match="SHA-256 differs"):
        Server.from_keys({"config": path, "config_sha256": digest, "size": "64M"})
    (tmp_path / "config.d").mkdir()
    (tmp_path / "config.d" / "x.yaml").write_text("compression: {dedup: 'off'}\n")
    path, digest = write_effective_config(Config(), str(tmp_path))
    server = Server.from_keys({"config": path, "config_sha256": digest, "size": "64M"})
    assert server.config.compression.dedup == "on", "a drop-in beside the pinned file counted"


@pytest.fixture
def other_swap(tmp_path):
    """Another swap area on this host (another run directory's, a zram, the operator's
    own): a loop device over a small file, swapped on at the lowest priority, for seconds."""
    backing = tmp_path / "other-swap"
    with open(backing, "wb") as f:
        f.truncate(16 << 20)
    loop = subprocess.run(["losetup", "--show", "-f", str(backing)], capture_output=True,
                          text=True, check=True).stdout.strip()
    try:
        subprocess.run(["mkswap", loop], capture_output=True, check=True)
        subprocess.run(["swapon", "-p", "0", loop], check=True)
        yield loop
    finally:
        if procfs.swap_area(loop) is not None:
            subprocess.run(["swapoff", loop], check=False, timeout=120)
        subprocess.run(["losetup", "-d", loop], check=False)


def test_a_forged_state_cannot_make_down_swap_off_another_device(host, other_swap):
    """state.json names another swap area as ours (the run directory holds no device at
    all): `down` refuses in one line, exit 2, and the other area stays on."""
    os.makedirs(host.run_dir, mode=0o700)
    forged = {"run_dir": host.run_dir, "plugin": "memory", "mode": "fuse", "frontend": "fuse",
              "nbd_socket": os.path.join(host.run_dir, "nbd.sock"),
              "device": other_swap, "loop_device": other_swap, "swap_on": True,
              "mountpoint": os.path.join(host.run_dir, "mnt"),
              "fuse_file": os.path.join(host.run_dir, "mnt", "device")}
    Path(host.run_dir, "state.json").write_text(json.dumps(forged))
    os.chmod(os.path.join(host.run_dir, "state.json"), 0o600)
    down = host.az("down", "--force", check=False)
    assert procfs.swap_area(other_swap) is not None, "down swapped off another device"
    assert down.returncode == 2, down.stdout + down.stderr
    lines = down.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentzip-blk: error: "), down.stderr
    assert other_swap in lines[0] and "refusing" in lines[0], lines[0]
    assert subprocess.run(["losetup", other_swap], capture_output=True).returncode == 0
    os.unlink(os.path.join(host.run_dir, "state.json"))  # the operator's fix, as the error says
