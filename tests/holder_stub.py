"""A stand-in server for the holder's tests (tests/datapath/test_holding.py): it speaks the
holder's protocol (datapath.holding) and takes a recovery's offer (datapath.handover) as the
real server does, and stores no page.

    python holder_stub.py holder=SOCK pids=FILE [mode=M] [content=HEX] [tables=N]
                          [ready=FILE] [out=FILE] [takeover=PATH takeover_pid=PID]

Every stub appends its pid to ``pids`` first (the test kills each by pid at its end).

Without ``takeover``, a first server: a memfd named az-stub holding ``content`` is put as
"pool" with meta {"size": n}, then ``tables`` more as "table0".. (i + 1 bytes of i), the server's meta is {"fuse_connection": 7}, then commit and
``ready`` is written. ``mode``: ``serve`` (default) sleeps until killed; ``handover`` says
bye "handover" and exits; ``drop`` closes its connection and sleeps on.

With ``takeover`` (the holder started it to recover): take the offer, write its header and
each descriptor's bytes (hex) to ``out``, then ``mode`` ``fail`` says fail and exits 3;
otherwise ready, wait for go, hello (recovering), put what it got, commit, write ``ready``,
sleep until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

from agentzip_blk.datapath import handover
from agentzip_blk.datapath.holding import HolderClient


def write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def sleep_until_killed() -> None:
    while True:
        time.sleep(3600)


def first(keys: dict[str, str]) -> None:
    content = bytes.fromhex(keys.get("content", ""))
    fd = os.memfd_create("az-stub")
    os.write(fd, content)
    client = HolderClient(keys["holder"])
    client.hello(os.getpid())
    client.put("pool", fd, {"size": len(content)})
    os.close(fd)  # the holder has its own
    for i in range(int(keys.get("tables", 0))):  # as many as a store's columns
        fd = os.memfd_create(f"az-table{i}")
        os.write(fd, bytes([i]) * (i + 1))
        client.put(f"table{i}", fd, {"rows": i + 1})
        os.close(fd)
    client.meta({"fuse_connection": 7})
    client.commit()
    if "ready" in keys:
        write(keys["ready"], str(os.getpid()))
    mode = keys.get("mode", "serve")
    if mode == "handover":
        client.bye("handover")
        client.close()
        return
    if mode == "drop":
        client.close()
    sleep_until_killed()


def recovering(keys: dict[str, str]) -> None:
    taker = handover.Taker(keys["takeover"])
    offer = taker.take(int(keys["takeover_pid"]), 30.0)
    header = offer.header
    contents = {name: os.pread(fd, os.fstat(fd).st_size, 0).hex()
                for name, fd in zip(header["names"], offer.fds)}
    write(keys["out"], json.dumps({"pid": os.getpid(), "header": header, "contents": contents}))
    if keys.get("mode") == "fail":
        taker.fail("the stub was told to fail")
        taker.close()
        sys.exit(3)
    taker.ready()
    taker.wait_go(30.0)
    taker.close()
    client = HolderClient(keys["holder"])
    client.hello(os.getpid(), recovering=True)
    for name, fd in zip(header["names"], offer.fds):
        client.put(name, fd, header["tables"][name])
    client.meta(header["meta"])
    client.commit()
    if "ready" in keys:
        write(keys["ready"], str(os.getpid()))
    sleep_until_killed()


def main() -> None:
    keys = dict(arg.split("=", 1) for arg in sys.argv[1:])
    with open(keys["pids"], "a", encoding="ascii") as f:
        f.write(f"{os.getpid()}\n")
    if "takeover" in keys:
        recovering(keys)
    else:
        first(keys)


if __name__ == "__main__":
    main()
