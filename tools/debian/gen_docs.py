"""Generate the man page and the bash completion from the CLI parser itself
(``agentzip_blk.cli.build_parser``), so neither can drift from ``--help``:

    python tools/debian/gen_docs.py OUT_DIR   ->  OUT_DIR/agentzip-blk.1, OUT_DIR/agentzip-blk.bash

argparse-manpage writes the page, shtab the completion (the ``package`` extra of
pyproject.toml; tools/build-deb.sh runs this at package build time).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import shtab
from argparse_manpage.manpage import Manpage

from agentzip_blk import __version__
from agentzip_blk.cli import PROG, build_parser

SEE_ALSO = """\
[see also]
.BR swapon (8),
.BR zramctl (8),
.BR nbdkit (1),
.BR nbdkit-python-plugin (3),
.BR systemd.resource-control (5)

.PP
The README (/usr/share/doc/agentzip-blk/README.md): setup, configuration, operation.

[files]
.TP
.I /etc/agentzip/config.yaml
The configuration (every key optional; defaults in the README).
.TP
.I /run/agentzip
The run directory: state file, sockets, logs of the attached device.
.TP
.I /usr/lib/systemd/system/agentzip-blk.service
Attaches the device at boot (before swap.target); agentzip-blk-health.timer runs
.B agentzip-blk status
every 30 s and leaves agentzip-blk-health.service failed when the server is not healthy.

[exit status]
0 success; 1 a runtime failure (a tool failed, swapoff refused); 2 bad input or setup
(one line "agentzip-blk: error: ..."); status: 3 nothing attached, 4 attached but not healthy.
"""


def manpage() -> str:
    # the date of the source, not of the build: reproducible (SOURCE_DATE_EPOCH if set)
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))
    include = Path(os.environ.get("TMPDIR", "/tmp")) / f"agentzip-man-{os.getpid()}.txt"
    include.write_text(SEE_ALSO)
    try:
        page = Manpage(build_parser(), _data={
            "project_name": PROG, "version": __version__, "manual_section": 1,
            "manual_title": "agentzip-blk manual",
            "date": time.strftime("%Y-%m-%d", time.gmtime(epoch)),
            "description": "compressed, deduplicating userspace swap device for agent sandboxes",
            "include": str(include),
        }, format="single-commands-section")
        return str(page)
    finally:
        include.unlink()


def completion() -> str:
    return shtab.complete(build_parser(), shell="bash")


def main(out: str) -> int:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{PROG}.1").write_text(manpage())
    (d / f"{PROG}.bash").write_text(completion())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
