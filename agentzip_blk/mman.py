"""The libc memory calls the store and the holder make through ctypes (Python's mmap module
gives no address to madvise, mlock or mincore, and no fallocate punch), declared once."""

from __future__ import annotations

import ctypes
import ctypes.util

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]

PROT_READ = 0x1
PROT_RW = 0x1 | 0x2
MAP_SHARED = 0x01
MAP_FAILED = (1 << 64) - 1  # (void *) -1 as ctypes returns it
MADV_DONTDUMP = 16
MADV_POPULATE_READ = 22  # Linux 5.14
MLOCK_ONFAULT = 1
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
