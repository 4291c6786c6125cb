"""Start the real nbdkit with the agentzip plugin on temp sockets, inside the test process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "nbdkit" / "agentzip_plugin.py"


def nbdkit_available() -> str | None:
    """None when nbdkit and its python plugin are usable, else why not."""
    if not shutil.which("nbdkit"):
        return "nbdkit not installed (apt-get install nbdkit nbdkit-plugin-python)"
    probe = subprocess.run(["nbdkit", "python", "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "nbdkit python plugin missing (apt-get install nbdkit-plugin-python)"
    return None


def plugin_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), sysconfig.get_paths()["purelib"]]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OPENBLAS_NUM_THREADS"] = "1"
    return env


@dataclass
class RunningServer:
    proc: subprocess.Popen
    nbd_socket: str
    control_socket: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_server(tmp: Path, size: str = "64M", config: Path | None = None,
                 timeout: float = 20.0, extra_keys: tuple[str, ...] = (),
                 wait_for: tuple[str, ...] = ()) -> RunningServer:
    nbd_socket = str(tmp / "nbd.sock")
    control_socket = str(tmp / "control.sock")
    log = tmp / "nbdkit.log"
    if config is None:
        # Never the default /var/lib path: tests must not share a disk tier file.
        config = tmp / "config.yaml"
        config.write_text(f"pool:\n  swap_out_path: {tmp / 'disk-tier'}\n")
    cmd = ["nbdkit", "-f", "-U", nbd_socket, "python", str(PLUGIN), f"size={size}",
           f"control={control_socket}", f"config={config}", *extra_keys]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=plugin_env())
    server = RunningServer(proc, nbd_socket, control_socket, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nbdkit exited {proc.returncode}: {server.log_text()}")
        if all(os.path.exists(p) for p in (nbd_socket, control_socket, *wait_for)):
            return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"nbdkit did not come up in {timeout}s: {server.log_text()}")


def python() -> str:
    return sys.executable
