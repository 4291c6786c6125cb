"""What the kernel knows about our swap area's slots: a copy of its `swap_map`, read from
the running kernel with a BPF program that is loaded but never attached.

Why. The kernel frees swap slots without telling the block device: a loop device only hears
of whole free clusters (512 pages) through discards, so the store keeps copies of pages the
kernel has long forgotten. The kernel's own book of every slot is `si->swap_map`, one byte
per 4 KiB slot of the area (`struct swap_info_struct`, include/linux/swap.h, 6.18):

    0x00            FREE: nothing refers to the slot
    count (1..0x3e) that many swap entries in page tables (and shmem) refer to it
    | 0x40          SWAP_HAS_CACHE: the page is (also) in the swap cache, i.e. in RAM
    0x40 alone      cache only: back in RAM, no page table refers to the slot any more
    0x3f            SWAP_MAP_BAD: the header page (slot 0) and bad pages
    | 0x80          COUNT_CONTINUED: the count goes on in a continuation page
    0xbf            SWAP_MAP_SHMEM: owned by shmem/tmpfs

Only FREE means "the kernel will never read this copy": a cache-only slot is still the
page's valid copy on disk (while the page stays clean, reclaim drops it from RAM without
writing and a later fault reads the slot again). And a FREE byte is a fact about the
instant it was copied: the kernel may allocate and write the slot right after. A caller
may forget a copy only if the device saw no write to that slot since before read() began
(e.g. a per-slot write sequence number taken before the read).

What it reads, and how. `SwapMap.open(device)` finds the area's `swap_info_struct`; each
`read()` runs one small BPF_PROG_TYPE_RAW_TRACEPOINT program per 4 MiB of map through
BPF_PROG_TEST_RUN (nothing is attached to any hook, nothing is pinned; the programs and
maps die with their file descriptors). The program calls bpf_probe_read_kernel() three
times: the struct's head (flags, type, max, swap_map, pages, bdev) and bdev->bd_dev, then
the map bytes into a BPF array map that is mmap()ed here, then the head again. Struct
offsets come from the kernel's own BTF (/sys/kernel/btf/vmlinux), parsed here; the program
is assembled here (56 instructions), so there is no compiler, libbpf or bcc.

Finding the area (`Area.found_by`), each route yields candidates, all checked the same way:
  * "kallsyms": the `swap_info[]` array by its data symbol in /proc/kallsyms (kernels
    built with CONFIG_KALLSYMS_ALL; addresses visible: kptr_restrict, CAP_SYSLOG).
  * "code" (x86-64): the array's address as the displacement of `mov reg,[idx*8+swap_info]`
    in the code of mm/swapfile.c functions found by their text symbols (swap_start,
    swap_next, get_swap_device, ...); a candidate counts only if the array it names holds
    swap_info_structs whose `type` equals their index.
  * "percpu": the per-CPU allocation cache `percpu_swap_cluster.si[]` of every online CPU
    (reached as current->se.cfs_rq->rq - runqueues + percpu_swap_cluster, the program run
    on each CPU), and from any area found there the kernel's list of active areas
    (si->list). It only knows areas that allocated on non-rotational devices.
The area is ours only if: si->bdev->bd_dev is the device's st_rdev, si->flags has SWP_USED
and SWP_WRITEOK (enum values read from BTF), si->pages matches /proc/swaps' size for the
device and si->max is between pages+1 and the device's size, and swap_map[0] reads
SWAP_MAP_BAD (the header slot). Any mismatch raises Unsupported.

Why it is safe. bpf_probe_read_kernel() cannot fault the kernel: a bad address yields
-EFAULT and zeroes. Nothing is written to the kernel; the program cannot loop; it runs
with preemption off for the length of one copy (4 MiB at most, well under a millisecond).
Every read re-checks, in the same program run before and after the copy, that the struct
still describes this area (same bd_dev, flags with SWP_WRITEOK, same max and same swap_map
pointer): swapoff clears SWP_WRITEOK before it frees the map, so a read that raced it is
discarded, and a later swapon of another device that reuses the struct (swap_info[] slots
are reused) has another bd_dev. So a read returns this area's map or raises Unsupported
"... no longer swap"; never another area's bytes. The copy is not one atomic snapshot:
each byte was the slot's value at some instant during the copy (a few hundred
microseconds), which is all a reader racing the kernel can ask for.

Requirements: Linux 5.10 (raw_tp test runs on a chosen CPU) up to CHECKED_UP_TO: what
the map's bytes mean is a #define, not in BTF, so newer kernels are refused until someone
checks them. CONFIG_BPF_SYSCALL and CONFIG_DEBUG_INFO_BTF; x86-64 or arm64 (the bpf(2)
syscall number; the "code" route is x86-64 only); CAP_BPF + CAP_PERFMON, or CAP_SYS_ADMIN
(root); no kernel lockdown in confidentiality mode (it removes bpf_probe_read_kernel); and
one route that works ("code": kallsyms addresses visible; "percpu": CONFIG_FAIR_GROUP_SCHED
for task->se.cfs_rq). The BPF maps (the map's size rounded up to pages, plus a page) are
charged to our memory cgroup. Opening costs ~0.2-0.5 s (BTF, kallsyms); reads are cheap.

How it fails: `Unsupported` with one line an operator can act on ("no BTF ...",
"BPF_MAP_CREATE: EPERM (needs CAP_BPF and CAP_PERFMON, or root)", "swap_info_struct for
7:0 not found (<what each route saw>)", "layout check failed: ...", "kernel 6.19 is newer
than the swap_map format checked here (6.18)", "/dev/loop0 (7:0): no longer swap
(swapoff?)"). The caller disables what it drives from the map; there is no partial or
guessed answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import stat
import struct
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .. import procfs

# include/linux/swap.h (6.18): the swap_map byte
FREE = 0x00
SWAP_MAP_MAX = 0x3E  # the largest count a byte holds (more goes to continuation pages)
SWAP_MAP_BAD = 0x3F  # header page and bad pages
COUNT_MASK = 0x3F  # the count bits (swap_count(x) = x & ~SWAP_HAS_CACHE, without 0x80)
HAS_CACHE = 0x40  # SWAP_HAS_CACHE: the page is in the swap cache
COUNT_CONTINUED = 0x80
SWAP_MAP_SHMEM = 0xBF  # owned by shmem/tmpfs: referenced

BTF_PATH = "/sys/kernel/btf/vmlinux"
KALLSYMS = "/proc/kallsyms"
CHUNK = 4 << 20  # map bytes per program run (slots of 16 GiB of swap)
ROUTES = ("kallsyms", "code", "percpu")  # ways to find the area, in the order tried
# The newest kernel whose swap_map bytes were checked to mean what this module says. The
# swap table rework after 6.18 moves swap-cache state out of swap_map (SWAP_HAS_CACHE): a
# slot held only by the swap cache could then read 0, and "free" would be a lie. Raise it
# only after re-reading mm/swapfile.c of the new release.
CHECKED_UP_TO = (6, 18)


class Unsupported(Exception):
    """The map cannot be read (here, or any more); the message is one line saying why."""


@dataclass(frozen=True)
class Area:
    """The swap area a SwapMap reads."""

    device: str
    dev: str  # "major:minor"
    type: int  # the area's index in swap_info[] (the swp_entry type)
    slots: int  # si->max: length of the map, header slot included
    pages: int  # si->pages: usable slots (max - 1 - bad pages)
    found_by: str  # "kallsyms" | "code" | "percpu"


def classify(swap_map: np.ndarray) -> dict[str, int]:
    """Slot counts of a map: free, cache_only (in RAM, swap copy unreferenced), referenced
    (mapped or owned: a count, with or without the cache bit), bad (header, bad pages)."""
    counts = np.bincount(np.asarray(swap_map, dtype=np.uint8), minlength=256)
    total = int(counts.sum())
    free, bad, cache_only = int(counts[FREE]), int(counts[SWAP_MAP_BAD]), int(counts[HAS_CACHE])
    return {"free": free, "cache_only": cache_only,
            "referenced": total - free - bad - cache_only, "bad": bad}


# -- bpf(2) ------------------------------------------------------------------------------------

_NR_BPF = {"x86_64": 321, "aarch64": 280}
_MAP_CREATE, _MAP_LOOKUP, _PROG_LOAD, _TEST_RUN = 0, 1, 5, 10
_ARRAY, _RAW_TRACEPOINT = 2, 17
_F_MMAPABLE = 1 << 10
_F_TEST_RUN_ON_CPU = 1
_ATTR = 144  # bytes of union bpf_attr we pass (the kernel wants the tail zero)
_FN_LOOKUP, _FN_CURRENT, _FN_PROBE_READ_KERNEL = 1, 35, 113
_libc = ctypes.CDLL(None, use_errno=True)


def _errname(e: int) -> str:
    return errno.errorcode.get(e, str(e))


def _bpf(cmd: int, attr: bytes, what: str) -> int:
    nr = _NR_BPF.get(platform.machine())
    if nr is None:
        raise Unsupported(f"bpf(2) from Python is not wired for {platform.machine()}")
    buf = ctypes.create_string_buffer(attr, _ATTR)
    r = _libc.syscall(nr, cmd, buf, _ATTR)
    if r < 0:
        e = ctypes.get_errno()
        raise _BpfError(e, f"{what}: {_errname(e)}")
    if cmd == _TEST_RUN:
        return struct.unpack_from("<I", buf, 4)[0]  # test.retval
    return r


class _BpfError(Unsupported):
    def __init__(self, err: int, msg: str) -> None:
        super().__init__(msg)
        self.errno = err


class _Map:
    """A BPF array of `entries` values of `size` bytes, mmap()ed read-only."""

    def __init__(self, size: int, entries: int, name: bytes) -> None:
        attr = struct.pack("<IIIIIII16s", _ARRAY, 4, size, entries, _F_MMAPABLE, 0, 0, name)
        try:
            self.fd = _bpf(_MAP_CREATE, attr, "BPF_MAP_CREATE")
        except _BpfError as e:
            if e.errno == errno.EPERM:
                raise Unsupported(f"{e} (needs CAP_BPF and CAP_PERFMON, or root)") from None
            raise
        self.size = (size + 7) // 8 * 8
        length = (self.size * entries + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self.mm = mmap.mmap(self.fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as e:
            os.close(self.fd)
            raise Unsupported(f"mmap of a BPF array: {_errname(e.errno or 0)}") from None

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class _Asm:
    """Just enough of an eBPF assembler: instructions in order, jumps to named labels."""

    def __init__(self) -> None:
        self.out: list[tuple] = []  # (code, dst, src, off|label, imm) or ("label", name)

    def i(self, code: int, dst: int = 0, src: int = 0, off: int | str = 0, imm: int = 0) -> None:
        self.out.append((code, dst, src, off, imm))

    def label(self, name: str) -> None:
        self.out.append(("label", name))

    def map_fd(self, dst: int, fd: int) -> None:  # ld_imm64 dst = map (BPF_PSEUDO_MAP_FD)
        self.i(0x18, dst, 1, 0, fd)
        self.i(0, 0, 0, 0, 0)

    def mov(self, dst: int, src: int) -> None:
        self.i(0xBF, dst, src)

    def movi(self, dst: int, imm: int) -> None:
        self.i(0xB7, dst, 0, 0, imm)

    def addi(self, dst: int, imm: int) -> None:
        self.i(0x07, dst, 0, 0, imm)

    def add(self, dst: int, src: int) -> None:
        self.i(0x0F, dst, src)

    def ldx64(self, dst: int, src: int, off: int) -> None:
        self.i(0x79, dst, src, off)

    def stx64(self, dst: int, off: int, src: int) -> None:
        self.i(0x7B, dst, src, off)

    def stx32(self, dst: int, off: int, src: int) -> None:
        self.i(0x63, dst, src, off)

    def st32(self, dst: int, off: int, imm: int) -> None:
        self.i(0x62, dst, 0, off, imm)

    def jeq(self, dst: int, imm: int, label: str) -> None:
        self.i(0x15, dst, 0, label, imm)

    def jgt(self, dst: int, imm: int, label: str) -> None:  # unsigned
        self.i(0x25, dst, 0, label, imm)

    def call(self, fn: int) -> None:
        self.i(0x85, 0, 0, 0, fn)

    def exit(self) -> None:
        self.i(0x95)

    def lookup(self, out: int, fd: int, key_slot: int, fail: str) -> None:
        """out = &map[*(u32 *)(fp + key_slot)], or goto fail."""
        self.map_fd(1, fd)
        self.mov(2, 10)
        self.addi(2, key_slot)
        self.call(_FN_LOOKUP)
        self.jeq(0, 0, fail)
        self.mov(out, 0)

    def probe_read(self, dst: int, dst_off: int, size: int, src_reg: int, src_off: int) -> None:
        """bpf_probe_read_kernel(dst + dst_off, size, src_reg + src_off) (r0 = result)."""
        self.mov(3, src_reg)
        if src_off:
            self.addi(3, src_off)
        self.mov(1, dst)
        if dst_off:
            self.addi(1, dst_off)
        self.movi(2, size)
        self.call(_FN_PROBE_READ_KERNEL)

    def assemble(self) -> bytes:
        where, n = {}, 0
        for ins in self.out:
            if ins[0] == "label":
                where[ins[1]] = n
            else:
                n += 1
        code, n = [], 0
        for ins in self.out:
            if ins[0] == "label":
                continue
            op, dst, src, off, imm = ins
            if isinstance(off, str):
                off = where[off] - n - 1
            code.append(struct.pack("<BBhi", op, (src << 4) | dst, off, imm))
            n += 1
        return b"".join(code)


def _load(asm: _Asm, name: bytes) -> int:
    prog = asm.assemble()
    insns = ctypes.create_string_buffer(prog, len(prog))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = struct.pack("<IIQQIIQII16s", _RAW_TRACEPOINT, len(prog) // 8,
                       ctypes.addressof(insns), ctypes.addressof(lic), 1, len(log),
                       ctypes.addressof(log), 0, 0, name)
    try:
        return _bpf(_PROG_LOAD, attr, "BPF_PROG_LOAD")
    except _BpfError as e:
        if e.errno == errno.EPERM:
            raise Unsupported(f"{e} (needs CAP_BPF and CAP_PERFMON, or root)") from None
        lines = [ln for ln in log.value.decode(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith(("processed ", "verification time"))]
        hint = f" (verifier: {lines[-1]})" if lines else ""
        raise Unsupported(f"{e}{hint}") from None


def _run(prog_fd: int, args: tuple[int, ...], cpu: int | None = None) -> int:
    ctx = ctypes.create_string_buffer(struct.pack(f"<{len(args)}Q", *args))
    attr = struct.pack("<IIIIQQIIIIQQIII", prog_fd, 0, 0, 0, 0, 0, 0, 0, len(args) * 8, 0,
                       ctypes.addressof(ctx), 0, 0 if cpu is None else _F_TEST_RUN_ON_CPU,
                       cpu or 0, 0)
    return _bpf(_TEST_RUN, attr, "BPF_PROG_TEST_RUN")


# -- BTF -----------------------------------------------------------------------------------------

_INT, _PTR, _ARR, _STRUCT, _UNION, _ENUM, _TYPEDEF, _VOLATILE, _CONST, _RESTRICT = \
    1, 2, 3, 4, 5, 6, 8, 9, 10, 11
_VAR, _DATASEC, _TYPE_TAG, _ENUM64 = 14, 15, 18, 19
_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}  # fixed trailing bytes
_PER_VLEN = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # bytes per member


class _Btf:
    """The kernel's type information: struct member offsets and sizes, enum values, per-CPU
    variable offsets. Parsed once (vmlinux: ~130k types, ~0.1 s)."""

    def __init__(self, path: str = BTF_PATH) -> None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise Unsupported(f"no BTF ({path}: {e.strerror}; needs CONFIG_DEBUG_INFO_BTF)") \
                from None
        if len(data) < 24 or struct.unpack_from("<H", data)[0] != 0xEB9F:
            raise Unsupported(f"no BTF ({path}: not little-endian BTF)")
        hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<IIIII", data, 4)
        self.data = data
        self.strs = data[hdr_len + str_off: hdr_len + str_off + str_len]
        # one pass to find where each type starts (records are variable-length); the fields
        # of all of them are then picked out at once
        start, end = hdr_len + type_off, hdr_len + type_off + type_len
        if start % 4 or end > len(data):
            raise Unsupported(f"no BTF ({path}: unexpected layout)")
        extra, per = [0] * 32, [0] * 32
        for kind, n in _EXTRA.items():
            extra[kind] = n
        for kind, n in _PER_VLEN.items():
            per[kind] = n
        info_at = struct.Struct("<I").unpack_from
        where = [start - 12]  # type 0 is void: a dummy record that is never read
        p = start
        while p < end:
            info, = info_at(data, p + 4)
            where.append(p)
            kind = (info >> 24) & 0x1F
            p += 12 + extra[kind] + per[kind] * (info & 0xFFFF)
        words = np.frombuffer(data, dtype="<u4", count=len(data) // 4)
        at = np.asarray(where, dtype=np.int64) // 4
        at[0] = at[1]
        info = words[at + 1]
        self.names = words[at].copy()
        self.names[0] = 0
        self.kind: list[int] = ((info >> 24) & 0x1F).tolist()
        self.vlen: list[int] = (info & 0xFFFF).tolist()
        self.kflag: list[int] = (info >> 31).tolist()
        self.size_type: list[int] = words[at + 2].tolist()  # size, or the type referred to
        self.body: list[int] = (np.asarray(where, dtype=np.int64) + 12).tolist()
        self.kind[0] = 0

    def name(self, tid: int) -> str:
        off = int(self.names[tid])
        return self.strs[off: self.strs.index(b"\0", off)].decode()

    def _str_off(self, name: str) -> int | None:
        # the kernel's BTF strings are deduplicated: one offset per name
        i = self.strs.find(b"\0" + name.encode() + b"\0")
        return None if i < 0 else i + 1

    def find(self, kind: int, name: str) -> int:
        off = self._str_off(name)
        for tid in np.flatnonzero(self.names == off).tolist() if off is not None else []:
            if self.kind[tid] == kind and self.vlen[tid] > 0:
                return tid
        raise Unsupported(f"layout check failed: BTF has no {name}")

    def resolve(self, tid: int) -> int:
        while self.kind[tid] in (_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG):
            tid = self.size_type[tid]
        return tid

    def sizeof(self, tid: int) -> int:
        tid = self.resolve(tid)
        k = self.kind[tid]
        if k == _PTR:
            return 8
        if k == _ARR:
            elem, _, n = struct.unpack_from("<III", self.data, self.body[tid])
            return n * self.sizeof(elem)
        return self.size_type[tid]  # int, struct, union, enum

    def _members(self, tid: int):
        base = self.body[tid]
        for i in range(self.vlen[tid]):
            name_off, mtype, off = struct.unpack_from("<III", self.data, base + 12 * i)
            bits = off & 0xFFFFFF if self.kflag[tid] else off
            if self.kflag[tid] and off >> 24:
                bits = -1  # a bitfield: no byte offset
            yield name_off, mtype, bits

    def _member(self, tid: int, name: str) -> tuple[int, int] | None:
        want = self._str_off(name)
        for name_off, mtype, bits in self._members(tid):
            if name_off == want and want is not None:
                return mtype, bits
            if name_off == 0 and self.kind[self.resolve(mtype)] in (_STRUCT, _UNION):
                hit = self._member(self.resolve(mtype), name)
                if hit is not None:
                    return hit[0], hit[1] + bits
        return None

    def field(self, struct_name: str, path: str, size: int | None = None) -> int:
        """Byte offset of `path` (a.b.c) in struct `struct_name`; checks its size if given."""
        tid, off = self.find(_STRUCT, struct_name), 0
        for part in path.split("."):
            tid = self.resolve(tid)
            hit = self._member(tid, part) if self.kind[tid] in (_STRUCT, _UNION) else None
            if hit is None:
                raise Unsupported(f"layout check failed: no {struct_name}.{path} in BTF")
            tid, bits = hit
            if bits < 0 or bits % 8:
                raise Unsupported(f"layout check failed: {struct_name}.{path} is a bitfield")
            off += bits // 8
        if size is not None and self.sizeof(tid) != size:
            raise Unsupported(f"layout check failed: {struct_name}.{path} is "
                              f"{self.sizeof(tid)} bytes, not {size}")
        return off

    def array_len(self, struct_name: str, path: str) -> int:
        tid = self.find(_STRUCT, struct_name)
        for part in path.split("."):
            hit = self._member(self.resolve(tid), part)
            if hit is None:
                raise Unsupported(f"layout check failed: no {struct_name}.{path} in BTF")
            tid = hit[0]
        tid = self.resolve(tid)
        if self.kind[tid] != _ARR:
            raise Unsupported(f"layout check failed: {struct_name}.{path} is not an array")
        return struct.unpack_from("<III", self.data, self.body[tid])[2]

    def enum_value(self, name: str) -> int:
        want = self._str_off(name)
        if want is not None:
            for tid, kind in enumerate(self.kind):
                if kind != _ENUM:
                    continue
                base = self.body[tid]
                for i in range(self.vlen[tid]):
                    name_off, value = struct.unpack_from("<Ii", self.data, base + 8 * i)
                    if name_off == want:
                        return value
        raise Unsupported(f"layout check failed: BTF has no enum value {name}")

    def percpu_offset(self, var: str) -> int:
        sec = self.find(_DATASEC, ".data..percpu")
        base = self.body[sec]
        for i in range(self.vlen[sec]):
            vtid, off, _ = struct.unpack_from("<III", self.data, base + 12 * i)
            if self.kind[vtid] == _VAR and self.name(vtid) == var:
                return off
        raise Unsupported(f"BTF has no per-CPU variable {var}")


# -- the kernel's side -------------------------------------------------------------------------

_PEEK = 4096
# kernel pointers are at or above this (x86-64: the upper half; arm64: the linear map starts
# at 0xffff000000000000 with 48-bit VAs, lower with 52-bit)
_KERNEL_HALF = 0xFFF0000000000000 if platform.machine() == "aarch64" else 0xFFFF800000000000


def _kdev(rdev: int) -> int:
    """The kernel's dev_t for a userspace st_rdev (MKDEV: major << 20 | minor)."""
    return (os.major(rdev) << 20) | os.minor(rdev)


@dataclass(frozen=True)
class _Layout:
    """Offsets (bytes) and constants of the running kernel, from BTF."""

    flags: int
    type: int
    max: int
    swap_map: int
    pages: int
    bdev: int
    list_next: int  # si->list.node_list.next
    bd_dev: int
    span: int  # bytes of the struct's head read each time (through bdev)
    used: int  # SWP_USED
    writeok: int  # SWP_WRITEOK

    @classmethod
    def of(cls, btf: _Btf) -> "_Layout":
        f = btf.field
        s = "swap_info_struct"
        bdev = f(s, "bdev", 8)
        lay = cls(flags=f(s, "flags", 8), type=f(s, "type", 1), max=f(s, "max", 4),
                  swap_map=f(s, "swap_map", 8), pages=f(s, "pages", 4), bdev=bdev,
                  list_next=f(s, "list.node_list.next", 8), bd_dev=f("block_device", "bd_dev", 4),
                  span=(bdev + 8 + 7) // 8 * 8, used=btf.enum_value("SWP_USED"),
                  writeok=btf.enum_value("SWP_WRITEOK"))
        if lay.span > 2048 or lay.bd_dev > 4096:
            raise Unsupported(f"layout check failed: swap_info_struct head is {lay.span} bytes")
        return lay


@dataclass(frozen=True)
class _Head:
    """What a swap_info_struct says about itself."""

    flags: int
    type: int
    max: int
    swap_map: int
    pages: int
    bdev: int
    dev: int  # bdev->bd_dev (kernel encoding), 0 when unreadable

    @classmethod
    def parse(cls, raw: bytes, dev: int, lay: _Layout) -> "_Head":
        u = struct.unpack_from
        return cls(flags=u("<Q", raw, lay.flags)[0], type=u("<b", raw, lay.type)[0],
                   max=u("<I", raw, lay.max)[0], swap_map=u("<Q", raw, lay.swap_map)[0],
                   pages=u("<I", raw, lay.pages)[0], bdev=u("<Q", raw, lay.bdev)[0], dev=dev)

    def identity(self) -> tuple[int, int, int, int, int]:
        return (self.type, self.max, self.swap_map, self.bdev, self.dev)


class _Peek:
    """Read kernel memory a piece at a time (finding the area; never on the read path)."""

    def __init__(self) -> None:
        self.map = _Map(_PEEK + 16, 1, b"az_swapmap_peek")
        try:
            a = _Asm()
            a.mov(6, 1)  # r6 = ctx: args[0] address, args[1] length
            a.st32(10, -4, 0)
            a.lookup(7, self.map.fd, -4, "fail")
            a.call(_FN_CURRENT)
            a.stx64(7, _PEEK, 0)  # the task running the program (per-CPU route)
            a.mov(1, 7)
            a.ldx64(2, 6, 8)
            a.jgt(2, _PEEK, "fail")
            a.ldx64(3, 6, 0)
            a.call(_FN_PROBE_READ_KERNEL)
            a.stx64(7, _PEEK + 8, 0)
            a.movi(0, 0)
            a.exit()
            a.label("fail")
            a.movi(0, 1)
            a.exit()
            self.prog = _load(a, b"az_swapmap_peek")
        except BaseException:
            self.map.close()
            raise

    def read(self, addr: int, n: int) -> bytes | None:
        """n bytes at addr, or None where the kernel has nothing mapped there."""
        if not 0 < n <= _PEEK or addr < _KERNEL_HALF:
            return None
        if _run(self.prog, (addr, n)) != 0:
            raise Unsupported("peek program failed")
        rc, = struct.unpack_from("<q", self.map.mm, _PEEK + 8)
        return None if rc else bytes(self.map.mm[:n])

    def current(self, cpu: int) -> int:
        """The task running on `cpu` when the program ran there (it reads nothing)."""
        if _run(self.prog, (_KERNEL_HALF, 0), cpu) != 0:
            raise Unsupported("peek program failed")
        return struct.unpack_from("<Q", self.map.mm, _PEEK)[0]

    def u64(self, addr: int) -> int | None:
        raw = self.read(addr, 8)
        return None if raw is None else struct.unpack("<Q", raw)[0]

    def close(self) -> None:
        os.close(self.prog)
        self.map.close()


class _Finder:
    """Candidate swap_info_structs by every route, each checked against the device."""

    def __init__(self, peek: _Peek, btf: _Btf, lay: _Layout) -> None:
        self.peek, self.btf, self.lay = peek, btf, lay
        self.notes: list[str] = []

    def head(self, si: int) -> _Head | None:
        raw = self.peek.read(si, self.lay.span)
        if raw is None:
            return None
        bdev = struct.unpack_from("<Q", raw, self.lay.bdev)[0]
        dev = 0
        if bdev:
            d = self.peek.read(bdev + self.lay.bd_dev, 4)
            dev = struct.unpack("<I", d)[0] if d else 0
        return _Head.parse(raw, dev, self.lay)

    def in_array(self, base: int) -> list[int]:
        """The swap_info_structs of a swap_info[] candidate: entries up to the first empty
        one, each a struct whose type is its index (else the candidate is not the array)."""
        raw = self.peek.read(base, 32 * 8)
        found: list[int] = []
        for i, (si,) in enumerate(struct.iter_unpack("<Q", raw or b"")):
            if si < _KERNEL_HALF or si % 8:
                break
            h = self.head(si)
            if h is None or h.type != i or not (h.flags == 0 or h.flags & self.lay.used):
                break
            found.append(si)
        return found

    def by_kallsyms(self, syms: dict[str, list[tuple[int, str, int]]]) -> list[int]:
        data = [a for a, t, _ in syms.get("swap_info", []) if t in "bBdD"]
        if not data:
            self.notes.append("kallsyms: no data symbol swap_info (CONFIG_KALLSYMS_ALL off)")
            return []
        if not any(data):
            self.notes.append("kallsyms: addresses hidden (kptr_restrict)")
            return []
        return [si for a in data for si in self.in_array(a)]

    def by_code(self, syms: dict[str, list[tuple[int, str, int]]]) -> list[int]:
        if platform.machine() != "x86_64":
            self.notes.append("code: x86-64 only")
            return []
        votes: Counter[int] = Counter()
        functions = [(addr, size) for fn in _CODE_SYMBOLS
                     for addr, t, size in syms.get(fn, []) if t in "tT"]
        if functions and not any(addr for addr, _ in functions):
            self.notes.append("code: kallsyms addresses hidden (kptr_restrict)")
            return []
        for addr, size in functions:
            code = self.peek.read(addr, min(size or 1024, _PEEK)) if addr else None
            for target in _indexed_loads(code or b""):
                votes[target] += 1
        if not votes:
            self.notes.append("code: no swap_info[] load in mm/swapfile.c text")
            return []
        for base, _ in votes.most_common():
            found = self.in_array(base)
            if found:
                return found
        self.notes.append(f"code: {len(votes)} candidate(s), none a swap_info[] array")
        return []

    def by_percpu(self) -> list[int]:
        try:
            b = self.btf
            se_cfs_rq = b.field("task_struct", "se.cfs_rq", 8)
            cfs_rq_rq = b.field("cfs_rq", "rq", 8)
            rq_cpu = b.field("rq", "cpu", 4)
            psc = b.percpu_offset("percpu_swap_cluster") - b.percpu_offset("runqueues") + \
                b.field("percpu_swap_cluster", "si")
            orders = b.array_len("percpu_swap_cluster", "si")
        except Unsupported as e:
            self.notes.append(f"percpu: {e}")
            return []
        seeds: list[int] = []
        for cpu in _online_cpus():
            try:
                task = self.peek.current(cpu)
            except Unsupported as e:
                self.notes.append(f"percpu: cpu {cpu}: {e}")
                continue
            cfs_rq = self.peek.u64(task + se_cfs_rq) if task else None
            rq = self.peek.u64(cfs_rq + cfs_rq_rq) if cfs_rq else None
            raw = self.peek.read(rq + rq_cpu, 4) if rq else None
            if raw is None or struct.unpack("<i", raw)[0] != cpu:
                continue
            raw = self.peek.read(rq + psc, 8 * orders)
            seeds += [si for (si,) in struct.iter_unpack("<Q", raw or b"") if si]
        if not seeds:
            self.notes.append("percpu: no CPU has a swap area cached")
        # from any area, the list of all active ones (swap_active_head)
        found: list[int] = []
        for seed in dict.fromkeys(seeds):
            node = seed + self.lay.list_next
            for _ in range(64):
                si = node - self.lay.list_next
                if si not in found and si >= _KERNEL_HALF:
                    h = self.head(si)
                    if h is not None and 0 <= h.type < 32 and h.flags & self.lay.used:
                        found.append(si)
                node = self.peek.u64(node) or 0
                if not node or node == seed + self.lay.list_next:
                    break
        return found


# mm/swapfile.c functions that load swap_info[type] (those missing from a build are skipped)
_CODE_SYMBOLS = ("swap_start", "swap_next", "get_swap_device", "_swap_info_get",
                 "__swap_count", "swap_type_of", "swapdev_block", "count_swap_pages")


def _indexed_loads(code: bytes) -> list[int]:
    """Targets of `mov r64, [index*8 + disp32]` (REX.W 8B /r, SIB scale 8, no base) whose
    sign-extended displacement is a kernel-image address."""
    out = []
    for i in range(len(code) - 7):
        rex, op, modrm, sib = code[i: i + 4]
        if rex & 0xF8 == 0x48 and op == 0x8B and modrm & 0xC7 == 0x04 and sib & 0xC7 == 0xC5:
            disp = struct.unpack_from("<i", code, i + 4)[0]
            if disp < 0:
                out.append(disp & 0xFFFFFFFFFFFFFFFF)
    return out


def _online_cpus() -> list[int]:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            spec = f.read().strip()
    except OSError:
        return list(range(os.cpu_count() or 1))
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _kallsyms(names: tuple[str, ...]) -> dict[str, list[tuple[int, str, int]]]:
    """(address, type, bytes up to the next symbol) of each of `names` in /proc/kallsyms
    (sorted by address; 0 addresses where kptr_restrict hides them)."""
    try:
        with open(KALLSYMS, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    found: dict[str, list[tuple[int, str, int]]] = {}
    for name in names:
        needle = f" {name}\n"
        i = text.find(needle)
        while i >= 0:
            line = text[text.rfind("\n", 0, i) + 1: i].split()  # address, type
            nxt = text[i + len(needle): i + len(needle) + 32].split(" ", 1)[0]
            try:
                addr, after = int(line[0], 16), int(nxt or "0", 16)
            except (ValueError, IndexError):
                addr, after = 0, 0
            if len(line) == 2:
                found.setdefault(name, []).append(
                    (addr, line[1], after - addr if after > addr else 0))
            i = text.find(needle, i + 1)
    return found


def _kernel_release() -> tuple[int, int]:
    """(major, minor) of the running kernel, from uname (e.g. "6.18.44-fc" -> (6, 18))."""
    parts = os.uname().release.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "0")
    except (IndexError, ValueError):
        return (0, 0)


def _device_pages(device: str) -> int | None:
    try:
        with open(f"/sys/class/block/{os.path.basename(os.path.realpath(device))}/size") as f:
            return int(f.read()) * 512 // mmap.PAGESIZE
    except (OSError, ValueError):
        return None


# -- the API -----------------------------------------------------------------------------------

class SwapMap:
    """The swap_map of one active swap area. `open`, then `read()` as often as wanted."""

    def __init__(self, area: Area, si: int, head: _Head, lay: _Layout) -> None:
        self.area = area
        self._si, self._head, self._lay = si, head, lay
        self._lock = threading.Lock()
        self._closed = True
        value = min(CHUNK, (head.max + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
        self._value = value
        self._chunks = [(off, min(value, head.max - off)) for off in range(0, head.max, value)]
        hdr = 2 * (lay.span + 8) + 8
        self._hdr = _Map(hdr, 1, b"az_swapmap_head")
        try:
            self._data = _Map(value, len(self._chunks), b"az_swapmap")
        except BaseException:
            self._hdr.close()
            raise
        try:
            self._prog = self._snapshot_prog()
        except BaseException:
            self._data.close()
            self._hdr.close()
            raise
        self._closed = False

    def _snapshot_prog(self) -> int:
        lay, span = self._lay, self._lay.span
        after = span + 8
        rc = 2 * after
        a = _Asm()
        a.mov(6, 1)  # ctx: args[0] si, [1] offset into swap_map, [2] length, [3] chunk
        a.st32(10, -4, 0)
        a.lookup(8, self._hdr.fd, -4, "fail")
        a.ldx64(1, 6, 24)
        a.stx32(10, -8, 1)
        a.lookup(9, self._data.fd, -8, "fail")
        for base in (0, after):
            if base:  # the copy, between the two looks at the struct
                a.ldx64(7, 8, lay.swap_map)
                a.ldx64(1, 6, 8)
                a.add(7, 1)
                a.ldx64(2, 6, 16)
                a.jgt(2, self._value, "fail")
                a.mov(3, 7)
                a.mov(1, 9)
                a.call(_FN_PROBE_READ_KERNEL)
                a.stx64(8, rc, 0)
            a.ldx64(7, 6, 0)
            a.probe_read(8, base, span, 7, 0)
            a.ldx64(7, 8, base + lay.bdev)
            a.probe_read(8, base + span, 4, 7, lay.bd_dev)
        a.movi(0, 0)
        a.exit()
        a.label("fail")
        a.movi(0, 1)
        a.exit()
        return _load(a, b"az_swapmap")

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, device: str, routes: tuple[str, ...] = ROUTES) -> "SwapMap":
        """The map of the active swap area on block device `device` (e.g. /dev/loop0),
        found by the first of `routes` that finds it (see the module's docstring)."""
        unknown = set(routes) - set(ROUTES)
        if unknown:
            raise ValueError(f"unknown routes {sorted(unknown)}; known: {ROUTES}")
        try:
            st = os.stat(device)
        except OSError as e:
            raise Unsupported(f"{device}: {e.strerror}") from None
        if not stat.S_ISBLK(st.st_mode):
            raise Unsupported(f"{device} is not a block device")
        dev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        swap = procfs.swap_area(device)
        if swap is None:
            raise Unsupported(f"{device} ({dev}) is not an active swap area (/proc/swaps)")
        release = _kernel_release()
        if release > CHECKED_UP_TO:
            raise Unsupported(f"kernel {release[0]}.{release[1]} is newer than the swap_map "
                              f"format checked here ({CHECKED_UP_TO[0]}.{CHECKED_UP_TO[1]})")
        btf = _Btf()
        lay = _Layout.of(btf)
        peek = _Peek()
        try:
            si, head, found_by = cls._find(peek, btf, lay, dev, _kdev(st.st_rdev), routes)
            cls._check(peek, lay, head, device, swap.size)
        finally:
            peek.close()
        area = Area(device=device, dev=dev, type=head.type, slots=head.max, pages=head.pages,
                    found_by=found_by)
        self = cls(area, si, head, lay)
        try:
            self.read()
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _find(peek: _Peek, btf: _Btf, lay: _Layout, dev: str, kdev: int,
              routes: tuple[str, ...]) -> tuple[int, _Head, str]:
        finder = _Finder(peek, btf, lay)
        syms = _kallsyms(("swap_info", *_CODE_SYMBOLS))
        by = {"kallsyms": lambda: finder.by_kallsyms(syms),
              "code": lambda: finder.by_code(syms),
              "percpu": finder.by_percpu}
        for name in routes:
            candidates = by[name]()
            for si in candidates:
                h = finder.head(si)
                if h is not None and h.dev == kdev:
                    return si, h, name
            if candidates:
                finder.notes.append(f"{name}: {len(candidates)} area(s), none on {dev}")
        raise Unsupported(f"swap_info_struct for {dev} not found ({'; '.join(finder.notes)})")

    @staticmethod
    def _check(peek: _Peek, lay: _Layout, h: _Head, device: str, size: int) -> None:
        fail = f"layout check failed for {device}:"
        want = lay.used | lay.writeok
        if h.flags & want != want:
            raise Unsupported(f"{fail} flags {h.flags:#x} lack SWP_USED|SWP_WRITEOK")
        if not 0 <= h.type < 32:
            raise Unsupported(f"{fail} type {h.type}")
        if h.pages * mmap.PAGESIZE != size:
            raise Unsupported(f"{fail} {h.pages} pages, /proc/swaps says {size} bytes")
        limit = _device_pages(device)
        if not h.pages < h.max or (limit is not None and h.max > limit):
            raise Unsupported(f"{fail} max {h.max} slots for {h.pages} pages "
                              f"on a device of {limit} pages")
        first = peek.read(h.swap_map, 1) if h.swap_map else None
        if first != bytes([SWAP_MAP_BAD]):
            raise Unsupported(f"{fail} swap_map[0] is {first!r}, not SWAP_MAP_BAD (header)")

    # -- reading ----------------------------------------------------------------------------

    def read(self) -> np.ndarray:
        """A fresh copy of the area's swap_map (uint8, one byte per slot, si->max long)."""
        with self._lock:
            if self._closed:
                raise ValueError("SwapMap is closed")
            span, lay = self._lay.span, self._lay
            after, want = span + 8, lay.used | lay.writeok
            for key, (off, n) in enumerate(self._chunks):
                if _run(self._prog, (self._si, off, n, key)) != 0:
                    raise Unsupported("swap map snapshot program failed")
                mm = self._hdr.mm
                rc = struct.unpack_from("<q", mm, 2 * after)[0]
                for base in (0, after):
                    h = _Head.parse(mm[base: base + span], struct.unpack_from(
                        "<I", mm, base + span)[0], lay)
                    if h.identity() != self._head.identity() or h.flags & want != want:
                        raise Unsupported(f"{self.area.device} ({self.area.dev}): no longer "
                                          "swap (swapoff?)")
                if rc:
                    raise Unsupported(f"reading swap_map of {self.area.device}: "
                                      f"{_errname(-rc)}")
            out = np.frombuffer(self._data.mm, dtype=np.uint8, count=self._head.max).copy()
        if out[0] != SWAP_MAP_BAD:
            raise Unsupported(f"{self.area.device}: swap_map[0] is {out[0]:#x}, not the header")
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._prog)
            self._data.close()
            self._hdr.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):  # at interpreter exit, half torn down
                self.close()

    def __enter__(self) -> "SwapMap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
