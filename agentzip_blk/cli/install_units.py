"""`agentzip-blk install-units [--prefix DIR] [--bin PATH]`: install the systemd units
(fleet.systemd)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..fleet.systemd import PLACEHOLDER_BIN, SOURCE, UNIT_DIR, install
from ._common import CliError


def register(sub) -> None:
    s = sub.add_parser("install-units",
                       help="install the systemd units (service, health timer, sandbox slices)")
    s.add_argument("--prefix", default="/", metavar="DIR",
                   help="install root: units go to DIR/etc/systemd/system (default /)")
    s.add_argument("--unit-dir", default=UNIT_DIR, metavar="REL",
                   help=f"unit directory under the prefix (default {UNIT_DIR}; a package: "
                        "usr/lib/systemd/system)")
    s.add_argument("--bin", metavar="PATH", help="agentzip-blk path for ExecStart (default: this program)")
    s.add_argument("--source", metavar="DIR", help="unit sources (default: the units the package ships)")
    s.set_defaults(func=cmd_install_units)


def cmd_install_units(args) -> int:
    try:
        res = install(args.prefix, args.bin, Path(args.source) if args.source else SOURCE,
                      args.unit_dir)
    except FileNotFoundError as e:
        raise CliError(str(e)) from None
    except PermissionError as e:
        raise CliError(f"cannot write {e.filename}: run as root or pass --prefix DIR") from None
    for f in res.files:
        print(f"installed {f}")
    if res.bin == PLACEHOLDER_BIN and not os.path.exists(PLACEHOLDER_BIN):
        print(f"warning: {PLACEHOLDER_BIN} does not exist: pass --bin PATH", file=sys.stderr)
    if os.path.abspath(args.prefix) == "/":
        # the service Wants= its health timer: enabling the service is enough for both
        print("next: systemctl daemon-reload && systemctl enable --now agentzip-blk.service "
              "[agentzip-blk-metrics.service]")
    return 0
