"""Blob checksums: what the kernel wrote is verified by every read, end to end.

- A page stored alone (warm lz4, raw, a dense page): the blob's 32-bit checksum covers the
  page as written, and is checked after decoding (`Objects.decode_checked`): a corrupt
  cell, a codec bug or a wrong dictionary id all read as a mismatch.
- A multi-page frame: the blob's checksum covers the stored bytes (checked before decoding),
  and the frame carries zstd's content checksum (codecs._page_params), checked by the
  decode itself: 4 bytes a frame, 0.25 a page.
In the disk tier the stored bytes are also sealed (AES-GCM). The checksum is the low 32
bits of xxh3_64, chosen by measurement (tools/bench_integrity.py and BENCHMARKS.md): ~0.3 us
for a 4 KiB page where zlib.crc32 took ~4.4 us on these hosts. A mismatch is EIO
(`Corrupt`), counted in `checksum_errors` and logged, never wrong bytes.
"""

from __future__ import annotations

import sys

import xxhash

from ..errors import StoreError

# For tools/bench_integrity.py only: with this off, blobs are stored with checksum 0 and
# reads skip the check, so that the benchmark can measure what the checks cost.
CHECKSUMS = True

_MASK = 0xFFFFFFFF
_LOG_EVERY = 1000  # past the first _LOG_EVERY mismatches, log one in _LOG_EVERY


class Corrupt(StoreError):
    """A blob's bytes do not match its checksum (or its AEAD tag): the read fails (EIO)."""


def checksum(data) -> int:
    if not CHECKSUMS:
        return 0
    return xxhash.xxh3_64_intdigest(data) & _MASK


def matches(data, expected: int) -> bool:
    return not CHECKSUMS or (xxhash.xxh3_64_intdigest(data) & _MASK) == expected


def log_line(message: str, count: int) -> None:
    """One line in the server's log (nbdkit's stderr) per mismatch, thinned out in a storm."""
    if count <= _LOG_EVERY or count % _LOG_EVERY == 0:
        print(f"agentzip: {message} (mismatch #{count})", file=sys.stderr, flush=True)
