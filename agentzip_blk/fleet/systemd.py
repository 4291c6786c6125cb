"""The systemd units and their installer (``agentzip-blk install-units``, cli.install_units).

Copies the units (``fleet/units/``, package data; ``deploy/systemd`` in the tree links to
it): agentzip-blk.service, its watchdog agentzip-blk-health.service + .timer,
agentzip-blk-metrics.service, agent-sandbox.slice and the agent-sandbox-.slice.d/ drop-in,
into ``PREFIX/etc/systemd/system`` (PREFIX defaults to ``/``; a staging root for packages or
tests otherwise; the .deb puts them in ``usr/lib/systemd/system``, ``unit_dir``), with the
agentzip-blk path in ``ExecStart=``/``ExecStop=`` replaced by the installed program (``--bin``,
default: this program). It does not run systemctl: it prints the commands to do so.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

PLACEHOLDER_BIN = "/usr/local/bin/agentzip-blk"
UNIT_DIR = "etc/systemd/system"  # the administrator's units (install-units)
SOURCE = Path(__file__).resolve().parent / "units"


@dataclass
class Installed:
    unit_dir: str
    files: list[str]
    bin: str


def default_bin() -> str:
    """The agentzip-blk being run (console script), else the one on PATH, else the default."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "agentzip-blk" and os.access(argv0, os.X_OK):
        return argv0
    return shutil.which("agentzip-blk") or PLACEHOLDER_BIN


def unit_files(source: Path = SOURCE) -> list[Path]:
    if not source.is_dir():
        raise FileNotFoundError(f"unit sources {source} not found: pass --source DIR "
                                f"(deploy/systemd of the agentzip-blk source tree)")
    return sorted(p for p in source.rglob("*") if p.is_file())


def install(prefix: str = "/", bin_path: str | None = None, source: Path = SOURCE,
            unit_dir: str = UNIT_DIR) -> Installed:
    bin_path = os.path.abspath(bin_path or default_bin())
    unit_dir = os.path.join(prefix, unit_dir.lstrip("/"))
    out = []
    for src in unit_files(source):
        rel = src.relative_to(source)
        dst = Path(unit_dir) / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        text = src.read_text().replace(PLACEHOLDER_BIN, bin_path)
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)  # atomic: systemd never reads half a unit
        out.append(str(dst))
    return Installed(unit_dir, out, bin_path)
