"""The demo's workload: a process in a memory cgroup, driven over the READY / CHECK / TOUCH /
VERIFY protocol of its script.

The default script, ``scripts/agent_json.py`` (an agent-like Python heap: JSON tool
transcripts, dicts, strings), ships in the package with the ``protocol.py`` and
``pagewalk.py`` it imports; ``tools/workloads`` links to them.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from ..cgroups.fs import CgroupError, MemoryCgroup
from .common import DemoError

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "agent_json.py")
DEFAULT_MB = 300
DEFAULT_SEED = 1


class Workload:
    """A workload (default: the agent-like heap, WORKLOAD) in a cgroup, its stdout lines in a queue.

    *argv*: another program speaking the same READY/CHECK/TOUCH protocol (tools/bench.py's
    workloads); *mb* and *seed* are then already in it.
    """

    def __init__(self, cg: MemoryCgroup, mb: float, seed: int, python: str | None = None,
                 argv: list[str] | None = None):
        self.cg = cg
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, PYTHONHASHSEED="0")
        procs = cg.file("cgroup.procs")

        def join_cgroup():  # runs in the child before exec: every allocation is charged there
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

        self.proc = subprocess.Popen(
            argv or [python or sys.executable, WORKLOAD, "--mb", str(mb), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env=env, preexec_fn=join_cgroup, close_fds=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout: float, tick=None) -> list[str]:
        """The next stdout line starting with *word*, split; DemoError on EOF or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoError(f"workload: no {word} within {timeout:.0f}s")
            try:
                line = self.lines.get(timeout=min(left, 0.25))
            except queue.Empty:
                if tick:
                    tick()
                continue
            if line is None:
                self.proc.wait(timeout=5)
                raise DemoError(f"workload exited (status {self.proc.returncode}) before {word}"
                                f"{self._oom_hint()}: {self.stderr_tail()}")
            parts = line.split()
            if parts and parts[0] == word:
                return parts

    def _oom_hint(self) -> str:
        try:
            n = self.cg.oom_kills()
        except (OSError, CgroupError):
            return ""
        return f", OOM-killed (oom_kill {n})" if n else ""

    def stderr_tail(self, n: int = 400) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read()[-n:].strip()
        except (OSError, ValueError):
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its pid
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except (OSError, ValueError, BrokenPipeError):
                pass
        self.stderr.close()
