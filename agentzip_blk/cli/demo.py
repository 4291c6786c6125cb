"""`agentzip-blk demo`: bring the device up, squeeze a workload into it, report (demo.driver)."""

from __future__ import annotations


def register(sub) -> None:
    s = sub.add_parser("demo", help="bring the device up, squeeze a workload into it, report")
    s.add_argument("--mb", type=float, default=None, help="workload size in MB (default 300)")
    s.add_argument("--seed", type=int, default=None, help="workload random seed (default: fixed)")
    s.add_argument("--swap", default="agentzip",
                   help="agentzip | zram-lz4 | zram-lzo-rle (comparison)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from ..demo import driver  # lazy: pulls in the workload machinery

    return int(driver.main(args) or 0)
