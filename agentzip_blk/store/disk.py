"""The disk tier: compressed blobs in one file, with its own free-space map, encrypted.

Space is handed out in 64-byte steps (ALLOC_STEP) from free extents (best fit; neighbours coalesce on
free) or from the end of the file, which grows with fallocate so that a full filesystem
is found before any data is written. Swap content does not outlive the server, so the
file starts empty every time (an existing file is truncated at open: the next `up` leaves
nothing of the last run). Freed extents wait for the maintainer, which makes them reusable
as they are while the file's free space stays within its slack (PUNCH_SLACK_BYTES, or
PUNCH_SLACK_SHARE of the live bytes): under load, extents are freed and taken again ~1000
times a second, and a punch costs 34 us of CPU and 126 us of wall time, and the write into
the hole 8 us more (ext4 on this VM). Beyond the slack it hole-punches them, outside the
store lock, first, so the file gives its space back to the filesystem.

Encryption at rest: every extent is sealed with AES-256-GCM under a key drawn at random when
the server starts and never written anywhere, so the file of a crashed server is
unreadable. An extent holds a 12-byte nonce (a random prefix and a counter: never reused
under one key), the ciphertext and the 16-byte tag; the associated data binds it to its
offset, length, blob id and the blob row's generation, so extents cannot be swapped
around or replayed into another blob. The tag is the integrity check of disk pages.
AES-GCM over ChaCha20-Poly1305 by measurement (AES-NI here: 23 us against 41 us per 4 KiB
call with python3-cryptography 38, tools/bench_integrity.py).

The file is opened with O_NOFOLLOW and must be a regular file of ours with mode 0600 and one
link: a path planted by someone else is refused (DiskError), never truncated. It starts with
a header (TIER_MAGIC, one ALLOC_STEP long; extents follow it): an existing file is truncated
only when it carries that header, so a file that merely sits at the path with the right
owner and mode (the operator's, another program's) is refused too, and `down` can tell a
leftover tier from anything else before it removes one.

The file's page cache would hold a second, uncompressed-on-disk copy of what we just
demoted, in memory: after each batch of writes the cached pages are written back and
dropped (fdatasync + POSIX_FADV_DONTNEED); reads drop what they pulled in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import itertools
import os
import stat
import struct
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sortedcontainers import SortedDict, SortedList

from .integrity import Corrupt

ALLOC_STEP = 64  # bytes: extents are whole steps
_GROW_STEP = 1 << 20
PUNCH_SLACK_BYTES = 16 << 20  # free bytes in the file kept allocated for reuse...
PUNCH_SLACK_SHARE = 4  # ...or a quarter of the live bytes, whichever is more
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES  # bytes an encrypted extent holds beyond its blob
_AAD = struct.Struct("<QIII")  # offset, length, blob id, blob generation
# nonce counter values left to a successor at each handover (a 64-bit counter: 2^32 of them)
HANDOVER_GAP = 1 << 32
# The first bytes of every tier file; the header takes one allocation step.
TIER_MAGIC = b"agentzip disk tier v1\n"
TIER_HEADER = TIER_MAGIC.ljust(ALLOC_STEP, b"\0")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


class DiskFull(Exception):
    """The file cannot grow: its size cap or the filesystem is full."""


class DiskError(Exception):
    """Reading or writing the file failed (I/O error); the blob's data is unreachable."""


def _round(n: int) -> int:
    return -(-n // ALLOC_STEP) * ALLOC_STEP


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with its mode flags (Python 3.11's os module has none)."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _no_readahead(fd: int) -> None:
    # Extents are read one at a time and dropped from the page cache after. Extents
    # demoted together lie side by side, and reads of a few of them in a row made the
    # kernel read ahead from disk what was then dropped unread (3 reads of adjacent 8 KiB
    # extents: 43 pages cached instead of 7, mincore). The mode belongs to the open file,
    # which the native request path reads through too.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def open_tier_file(path: str) -> int:
    """The tier file's descriptor: created 0600 if absent; an existing path must be a regular
    file of this user, mode 0600, with no other link, that starts with our header
    (TIER_MAGIC). Never follows a symbolic link, so a link planted at the path cannot make
    us truncate its target."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    what = "refusing it as the disk tier (pool.swap_out_path): remove it, or set another path"
    existed = False
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask took away or left
    except FileExistsError:
        existed = True
        try:
            # O_NONBLOCK: opening a FIFO or a device planted there must not block
            fd = os.open(path, flags | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DiskError(f"{path} is a symbolic link: {what}") from None
            raise DiskError(f"{path}: {exc.strerror}: {what}") from None
    except OSError as exc:
        raise DiskError(f"{path}: {exc.strerror}: {what}") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"owned by uid {st.st_uid}, not {os.geteuid()}"
    elif stat.S_IMODE(st.st_mode) != 0o600:
        problem = f"mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
    elif st.st_nlink != 1:
        problem = f"{st.st_nlink} hard links"
    elif existed and os.pread(fd, len(TIER_MAGIC), 0) != TIER_MAGIC:
        problem = "not an agentzip disk tier (no tier header)"
    if problem:
        os.close(fd)
        raise DiskError(f"{path}: {problem}: {what}")
    return fd


class _Sealer:
    """AES-256-GCM with this server's key. The key lives only in this process's memory,
    which the server locks (datapath.protect.lock_memory: mlockall(MCL_CURRENT|MCL_FUTURE|
    MCL_ONFAULT)), so it never reaches a swap device or a file; it dies with the process."""

    def __init__(self, key: bytes | None = None, prefix: bytes | None = None,
                 counter: int = 1) -> None:
        """A new key, or (a handover: store.handover) the key, nonce prefix and next
        counter of the server this one replaces."""
        # os.urandom inside generate_key
        self._key = key if key is not None else AESGCM.generate_key(bit_length=256)
        self._aead = AESGCM(self._key)
        self._prefix = prefix if prefix is not None else os.urandom(NONCE_BYTES - 8)
        self._counter = itertools.count(counter)  # next() is atomic under the GIL

    @property
    def key(self) -> bytes:
        return self._key

    def secrets(self) -> tuple[bytes, bytes, int]:
        """(key, nonce prefix, next counter) for a handover. The successor counts from that
        value; this sealer jumps HANDOVER_GAP ahead of it, so that if the successor fails
        after sealing a few extents and this server goes on (or exports again), no nonce is
        ever used twice under the key."""
        counter = next(self._counter)
        self._counter = itertools.count(counter + HANDOVER_GAP)
        return self._key, self._prefix, counter

    def seal(self, data, aad: bytes) -> bytes:
        nonce = self._prefix + next(self._counter).to_bytes(8, "little")
        return nonce + self._aead.encrypt(nonce, bytes(data), aad)

    def open(self, extent: bytes, aad: bytes) -> bytes:
        return self._aead.decrypt(extent[:NONCE_BYTES], extent[NONCE_BYTES:], aad)


# For tools/bench_integrity.py only: with this off, new tiers store extents in the clear,
# so that the benchmark can measure what encryption costs.
ENCRYPT = True


class DiskTier:
    def __init__(self, path: str, max_size: int = 0) -> None:
        encrypt = ENCRYPT
        self.path = path
        self.max_size = max_size  # 0: as large as the filesystem allows
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        self._fd = open_tier_file(path)
        _no_readahead(self._fd)
        try:
            # Two servers on one file would overwrite each other's pages.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DiskError(f"{path} is in use by another agentzip server (pool.swap_out_path)") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, TIER_HEADER, 0)
        self._sealer = _Sealer() if encrypt else None
        self.overhead = SEAL_OVERHEAD if encrypt else 0
        self._by_offset: SortedDict = SortedDict()  # offset -> length of free extents
        self._by_size: SortedList = SortedList()  # (length, offset) for best fit
        self.end = len(TIER_HEADER)  # bytes handed out from the start of the file
        self.file_size = 0  # bytes fallocated
        self.live_bytes = 0  # sum of allocated extents
        self.reads = 0
        self.writes = 0
        self.punch_errors = 0
        self.punch_slack = PUNCH_SLACK_BYTES
        self.free_bytes = 0  # in the free map
        self._pending: list[tuple[int, int]] = []  # freed extents, not yet reusable
        self._dirty = False
        # extents freed outside Python: the native request path's writes over disk blobs
        # (datapath.native), as (offset, blob length); `settle` frees them here
        self.freed_outside: Callable[[], list[tuple[int, int]]] = list

    # -- handover (store.handover): the open file and its books to another process ------

    @property
    def fd(self) -> int:
        """The tier file's descriptor: handed over (store.handover), and read by the native
        request path (pread(2) of an extent, opened with `key`); open until `close`."""
        return self._fd

    def handover_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Under the store lock, quiesced: the scalars (plain data) and the arrays (free
        extents, extents waiting for their punch, the sealer's key and nonce state) a tier
        handed over needs besides its descriptor."""
        self.settle()
        scalars = {"path": self.path, "max_size": self.max_size, "end": self.end,
                   "file_size": self.file_size, "live_bytes": self.live_bytes,
                   "reads": self.reads, "writes": self.writes,
                   "punch_errors": self.punch_errors, "dirty": self._dirty,
                   "encrypted": self._sealer is not None, "counter": 0}
        free = np.array(list(self._by_offset.items()), dtype=np.int64).reshape(-1, 2)
        pending = np.array(self._pending, dtype=np.int64).reshape(-1, 2)
        arrays = {"disk_free": free, "disk_pending": pending}
        if self._sealer is not None:
            key, prefix, counter = self._sealer.secrets()
            scalars["counter"] = counter
            arrays["disk_key"] = np.frombuffer(key, dtype=np.uint8).copy()
            arrays["disk_nonce_prefix"] = np.frombuffer(prefix, dtype=np.uint8).copy()
        return scalars, arrays

    @classmethod
    def adopt(cls, fd: int, max_size: int, scalars: dict,
              arrays: dict[str, np.ndarray]) -> DiskTier:
        """The tier of the server this one replaces, on its open descriptor `fd` (its flock
        comes with it: a lock belongs to the open file, not to a process). Nothing is
        truncated or rewritten. `max_size`: the new config's cap (the caller checked it
        holds what is there)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or os.pread(fd, len(TIER_MAGIC), 0) != TIER_MAGIC:
            raise DiskError("the disk tier handed over is not a tier file")
        tier = cls.__new__(cls)
        tier.path = scalars["path"]
        tier.max_size = max_size
        tier._fd = fd
        _no_readahead(fd)
        if scalars["encrypted"]:
            tier._sealer = _Sealer(bytes(arrays["disk_key"]), bytes(arrays["disk_nonce_prefix"]),
                                   int(scalars["counter"]))
        else:
            tier._sealer = None
        tier.overhead = SEAL_OVERHEAD if tier._sealer is not None else 0
        tier._by_offset = SortedDict()
        tier._by_size = SortedList()
        tier.free_bytes = 0
        tier.punch_slack = PUNCH_SLACK_BYTES
        for offset, size in arrays["disk_free"].tolist():
            tier._add_free(offset, size)
        tier.end = int(scalars["end"])
        tier.file_size = int(scalars["file_size"])
        tier.live_bytes = int(scalars["live_bytes"])
        tier.reads = int(scalars["reads"])
        tier.writes = int(scalars["writes"])
        tier.punch_errors = int(scalars["punch_errors"])
        tier._pending = [(int(o), int(n)) for o, n in arrays["disk_pending"].tolist()]
        tier._dirty = bool(scalars["dirty"])
        tier.freed_outside = list
        return tier

    def key(self) -> bytes | None:
        """The sealer's key (None: not encrypted), for the shared tables (store.shared): a
        server that recovers from a crash reads the extents with it."""
        return self._sealer.key if self._sealer is not None else None

    @classmethod
    def recover(cls, fd: int, path: str, max_size: int, key: bytes | None,
                extents: np.ndarray) -> DiskTier:
        """The tier of a server that died, on its descriptor `fd` (the holder kept it), with
        its `key`; `extents`: (offset, bytes) of every extent a live blob names. The free
        map is what lies between them; the nonce prefix is new (the dead server's counter
        is unknown, and a new prefix never meets an old nonce)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or os.pread(fd, len(TIER_MAGIC), 0) != TIER_MAGIC:
            raise DiskError("the disk tier held for recovery is not a tier file")
        tier = cls.__new__(cls)
        tier.path = path
        tier.max_size = max_size
        tier._fd = fd
        _no_readahead(fd)
        tier._sealer = _Sealer(key) if key is not None else None
        tier.overhead = SEAL_OVERHEAD if key is not None else 0
        tier._by_offset = SortedDict()
        tier._by_size = SortedList()
        tier.free_bytes = 0
        tier.punch_slack = PUNCH_SLACK_BYTES
        at = len(TIER_HEADER)
        live = 0
        for offset, size in sorted((int(o), int(n)) for o, n in extents.tolist()):
            if offset < at:
                raise DiskError(f"disk extents overlap at {offset}")
            if offset > at:
                tier._add_free(at, offset - at)
            at = offset + size
            live += size
        tier.end = at
        tier.file_size = max(st.st_size, at)
        tier.live_bytes = live
        tier.reads = tier.writes = tier.punch_errors = 0
        tier._pending = []
        tier._dirty = False
        tier.freed_outside = list
        return tier

    def release(self) -> None:
        """Close the descriptor and leave the file as it is: after a handover another
        server holds it (and its flock), and removes it when it stops."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def extent_size(self, length: int) -> int:
        """Bytes of file an extent for a blob of `length` bytes takes."""
        return _round(length + self.overhead)

    # -- space -----------------------------------------------------------------------

    def alloc(self, length: int) -> int:
        """An extent for a blob of `length` bytes (with its nonce and tag)."""
        need = self.extent_size(length)
        i = self._by_size.bisect_left((need, -1))
        if i < len(self._by_size):
            size, offset = self._by_size.pop(i)
            del self._by_offset[offset]
            self.free_bytes -= size
            if size > need:
                self._add_free(offset + need, size - need)
        else:
            offset = self.end
            self._grow_to(self.end + need)
            self.end += need
        self.live_bytes += need
        return offset

    def free(self, offset: int, length: int) -> None:
        """Give back the extent of a blob of `length` bytes. It is not reusable yet: it waits
        for the maintainer (`take_pending`, then `punch` if `over_slack`, then `reuse`),
        which punches without the store lock, since a punch costs 0.1-0.4 ms (measured,
        ext4 under load)."""
        size = self.extent_size(length)
        self.live_bytes -= size
        self._pending.append((offset, size))

    def settle(self) -> None:
        """Under the store lock: the extents freed outside Python (`freed_outside`) freed
        in these books, before anything reads them (the punch, the handover, the stats and
        the check)."""
        for offset, length in self.freed_outside():
            self.free(offset, length)

    def take_pending(self) -> list[tuple[int, int]]:
        """The freed extents waiting for their punch, as ranges to punch (under the store
        lock). Their free neighbours join them, out of the free map until `reuse`: a punch
        gives back only the blocks wholly inside its range, and extents are not block
        aligned, so a block shared by two free extents needs one range over both."""
        self.settle()
        pending, self._pending = self._pending, []
        ranges = list(pending)
        for offset, size in pending:
            i = self._by_offset.bisect_left(offset)
            if i > 0:
                prev = self._by_offset.keys()[i - 1]
                if prev + self._by_offset[prev] == offset:
                    ranges.append((prev, self._remove_free(prev)))
            if offset + size in self._by_offset:
                ranges.append((offset + size, self._remove_free(offset + size)))
        merged: list[tuple[int, int]] = []
        for offset, size in sorted(ranges):
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        return merged

    def over_slack(self, extents: list[tuple[int, int]]) -> bool:
        """Whether these ranges (from `take_pending`) must be punched before their reuse:
        the file's free space with them is more than it keeps allocated for reuse."""
        free = self.free_bytes + sum(size for _offset, size in extents)
        return free > max(self.punch_slack, self.live_bytes // PUNCH_SLACK_SHARE)

    def punch(self, extents: list[tuple[int, int]]) -> None:
        """Hole-punch freed extents (no lock needed: nothing else touches them): whole
        blocks go back to the filesystem, the partial ones at the edges are zeroed, so no
        ciphertext stays behind."""
        for offset, size in extents:
            try:
                _fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, size)
            except OSError:
                self.punch_errors += 1  # best effort: the extent is sealed, and reused later

    def reuse(self, extents: list[tuple[int, int]]) -> None:
        """Ranges from `take_pending`, punched or within the slack, into the free map (under
        the store lock). `write` allocates a range again before it writes into it."""
        for offset, size in extents:
            self._give_back(offset, size)

    def _give_back(self, offset: int, size: int) -> None:
        # Coalesce with the free neighbours on either side.
        i = self._by_offset.bisect_left(offset)
        if i > 0:
            prev_off = self._by_offset.keys()[i - 1]
            prev_len = self._by_offset[prev_off]
            if prev_off + prev_len == offset:
                self._remove_free(prev_off)
                offset, size = prev_off, size + prev_len
        nxt = offset + size
        if nxt in self._by_offset:
            size += self._remove_free(nxt)
        if offset + size == self.end:
            self.end = offset  # give the tail back rather than keep it as a free extent
        else:
            self._add_free(offset, size)

    def _add_free(self, offset: int, size: int) -> None:
        self._by_offset[offset] = size
        self._by_size.add((size, offset))
        self.free_bytes += size

    def _remove_free(self, offset: int) -> int:
        size = self._by_offset.pop(offset)
        self._by_size.remove((size, offset))
        self.free_bytes -= size
        return size

    def _grow_to(self, end: int) -> None:
        if self.max_size and end > self.max_size:
            raise DiskFull(f"disk tier {self.path} at its cap of {self.max_size} bytes")
        if end <= self.file_size:
            return
        new_size = max(end, self.file_size + _GROW_STEP)
        if self.max_size:
            new_size = min(new_size, self.max_size)
        try:
            os.posix_fallocate(self._fd, self.file_size, new_size - self.file_size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFull(f"disk tier {self.path}: {exc.strerror}") from None
            raise DiskError(f"disk tier {self.path}: {exc.strerror}") from None
        self.file_size = new_size

    # -- data ------------------------------------------------------------------------

    def _aad(self, offset: int, length: int, blob: int, gen: int) -> bytes:
        return _AAD.pack(offset, length, blob & 0xFFFFFFFF, gen & 0xFFFFFFFF)

    def seal(self, offset: int, data, blob: int, gen: int) -> bytes:
        """The extent to write at `offset` for blob `blob` (generation `gen`): nonce,
        ciphertext, tag. Needs no lock (the demotion seals outside the store lock)."""
        if self._sealer is None:
            return bytes(data)
        return self._sealer.seal(data, self._aad(offset, len(data), blob, gen))

    def write(self, offset: int, extent, batch: bool = False) -> None:
        """Write a sealed extent. Its range is allocated again first: a reused free extent
        was hole-punched, and a write into a hole could fail for want of space. `batch`:
        written outside the store lock (the demotion), which counts and syncs it itself."""
        try:
            _fallocate(self._fd, 0, offset, len(extent))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskError(f"disk tier {self.path}: {exc.strerror}") from None
            if exc.errno != errno.EOPNOTSUPP:
                raise DiskError(f"fallocate {self.path} at {offset}: {exc.strerror}") from None
        try:
            written = os.pwrite(self._fd, extent, offset)
        except OSError as exc:
            raise DiskError(f"write to {self.path} at {offset}: {exc.strerror}") from None
        if written != len(extent):
            raise DiskError(f"short write to {self.path} at {offset}")
        if not batch:
            self.writes += 1
            self._dirty = True

    def put(self, offset: int, data, blob: int, gen: int, batch: bool = False) -> None:
        self.write(offset, self.seal(offset, data, blob, gen), batch)

    def read(self, offset: int, length: int, blob: int, gen: int) -> bytes:
        """Blob `blob`'s `length` bytes, decrypted; Corrupt when its tag does not match (a
        flipped bit, an extent moved or replayed, a file from another server start)."""
        size = length + self.overhead
        try:
            data = os.pread(self._fd, size, offset)
        except OSError as exc:
            raise DiskError(f"read from {self.path} at {offset}: {exc.strerror}") from None
        if len(data) != size:
            raise DiskError(f"short read from {self.path} at {offset}")
        self._drop_cache(offset, size)
        if self._sealer is None:
            return data
        try:
            return self._sealer.open(data, self._aad(offset, length, blob, gen))
        except InvalidTag:
            raise Corrupt(f"blob {blob}: AEAD tag mismatch in the disk tier at {offset}") from None

    def reads_done(self, n: int) -> None:
        """Count reads (under the store lock: `read` itself may run without it)."""
        self.reads += n

    def sync_written(self) -> None:
        """Write back and drop the cached pages of what was written, without the store
        lock (the demotion's batch): fdatasync, then POSIX_FADV_DONTNEED on the file."""
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise DiskError(f"fdatasync {self.path}: {exc.strerror}") from None
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def drop_cache(self) -> None:
        """Write back and drop the file's cached pages (after a batch of writes)."""
        if self._dirty:
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                raise DiskError(f"fdatasync {self.path}: {exc.strerror}") from None
            self._dirty = False
            self._drop_cache(0, 0)

    def _drop_cache(self, offset: int, length: int) -> None:
        if not self._dirty:
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def check(self) -> None:
        """The free map's books (store.check): extents apart, the free bytes counted, all
        below the end."""
        assert self.free_bytes == sum(self._by_offset.values()), "disk free bytes miscounted"
        assert len(self._by_offset) == len(self._by_size), "disk free map and index differ"
        at = 0
        for offset, size in self._by_offset.items():
            assert offset >= at and size > 0, f"disk free extents overlap at {offset}"
            at = offset + size
        assert at <= self.end, "a free extent past the end"

    def meta_bytes(self) -> int:
        # A SortedDict entry plus a SortedList tuple: ~150 bytes per free extent; a tuple in
        # a list per extent waiting for its punch.
        return 150 * len(self._by_offset) + 80 * len(self._pending)

    def close(self) -> None:
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
