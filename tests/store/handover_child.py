"""The other side of tests/store/test_handover.py: a separate process (not a fork: it shares
no mapping with the exporter) that receives an exported store over a unix socket, adopts
it, and reports in one JSON line what it found.

    python handover_child.py SOCKET_FD IMAGE_PATH MODE CONFIG_JSON

The parent sends the header (JSON) with the descriptors (SCM_RIGHTS), then, once it has
released its own store, one byte: only then does this side read anything, so every byte it
verifies was left in place by a release that freed nothing. IMAGE_PATH holds the bytes the
device must read back. MODE: "python" serves in Python, "native" through the native request
path (datapath.native, driven as tests/nativeharness.py does).
"""

from __future__ import annotations

import json
import random
import socket
import sys

PAGE = 4096


def plain_config(data: dict):
    """Config.to_dict() back into a Config, unvalidated (the test uses sizes below the
    config's floors)."""
    from agentzip_blk.config import schema
    return schema.Config(compression=schema.CompressionConfig(**data["compression"]),
                         pool=schema.PoolConfig(**data["pool"]),
                         policy=schema.PolicyConfig(**data["policy"]),
                         device=schema.DeviceConfig(**data["device"]))


def main() -> None:
    # The package the parent runs is first on PYTHONPATH (a worktree, or tools/asan-tests.sh's
    # copy with the ASan build): a venv's editable finder must not map another one ahead of it.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sock_fd, image_path, mode, config_json = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    from agentzip_blk.store import PageStore
    from agentzip_blk.store.handover import Exported

    sock = socket.socket(fileno=sock_fd)
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 8)
    exported = Exported(json.loads(msg), list(fds))
    config = plain_config(json.loads(config_json))
    assert sock.recv(1) == b"g"  # the exporter has released its store
    with open(image_path, "rb") as f:
        model = bytearray(f.read())
    size = len(model)

    lock = None
    if mode == "native":
        from agentzip_blk.datapath import native
        lock = native.make_lock(native.Choice("native", "test"))
    store = PageStore.adopt(size, config, exported, lock=lock)
    import agentzip_blk
    report: dict = {"counters_at_adopt": dict(vars(store.counters)),
                    "package": agentzip_blk.__file__}
    store.check()

    door = path = None
    if mode == "native":
        from agentzip_blk.datapath import native
        from nativeharness import NativeRequests
        path = native.NativePath(store)
        door = NativeRequests(store, path)
    io = door or store

    def verify() -> int:
        bad = 0
        for first in range(0, size // PAGE, 16):
            n = min(16, size // PAGE - first)
            got = io.read(first * PAGE, n * PAGE)
            want = bytes(model[first * PAGE:(first + n) * PAGE])
            if got != want:
                bad += sum(got[i * PAGE:(i + 1) * PAGE] != want[i * PAGE:(i + 1) * PAGE]
                           for i in range(n))
        return bad

    report["bad_pages_at_adopt"] = verify()
    # more writes: new pages, repeats of old ones (dedup against adopted blobs), zeros; a trim
    rnd = random.Random(99)
    pages = size // PAGE
    for first in range(0, pages // 2, 16):
        chunk = bytearray()
        for k in range(16):
            r = rnd.random()
            if r < 0.5:
                page = (b"after the handover %d " % rnd.randrange(500)) * 200
            elif r < 0.7:
                other = rnd.randrange(pages)
                page = bytes(model[other * PAGE:(other + 1) * PAGE])
            elif r < 0.8:
                page = bytes(PAGE)
            else:
                page = rnd.randbytes(PAGE)
            chunk += page[:PAGE].ljust(PAGE, b".")
        io.write(bytes(chunk), first * PAGE)
        model[first * PAGE:first * PAGE + len(chunk)] = chunk
    store.trim(pages // 2 * PAGE, 64 * PAGE)
    model[pages // 2 * PAGE:(pages // 2 + 64) * PAGE] = bytes(64 * PAGE)
    for _ in range(3):
        store.maintain()  # recompression, demotion, sparse frames, compaction
    store.compact()
    store.check()
    report["bad_pages_after_writes"] = verify()
    store.check()
    report["counters"] = dict(vars(store.counters))
    report["pool_arenas"] = store.pool.arena_count
    if door is not None:
        report["native_reads"] = door.native
        report["native_writes"] = door.native_writes
        report["python_writes"] = door.python_writes
        door.close()
        path.close()
    store.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
