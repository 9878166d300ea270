"""CRC32 of large buffers on several cores, and a background commit's data file written by them.

A delta captured on the GPU lands in pinned host memory and is checksummed and written by the
background writer (:mod:`elastic_emb.state.capture`). zlib's CRC32 runs at about 1 GB/s on one
core, so a 0.5 GB delta would take half a second: too slow for a commit every 20 ms step. CRC32
is linear, so the buffer is cut into chunks, each chunk's CRC32 is computed on a thread of its own
(``zlib.crc32`` releases the GIL), and the chunks' CRCs are joined (:func:`crc32_combine`): the
CRC of ``A + B`` is the CRC of ``A`` advanced over ``len(B)`` zero bytes, xor the CRC of ``B``.
Advancing over ``m`` zero bytes is a linear map on the 32 bits of the CRC; the maps for 1, 2, 4,
... bytes are built once by squaring (``_ZEROS``), so a join costs at most one 32x32 bit-matrix
product per set bit of ``m``. The same threads copy their chunk into the file, mapped (numpy's
copy releases the GIL too), and checksum it while it is in cache. The result equals ``zlib.crc32`` of the whole
buffer, so a manifest written this way is read back by the same code as any other.
"""

from __future__ import annotations

import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

_POLY = 0xEDB88320  # CRC32 (zlib, IEEE 802.3), reflected


def _times(mat: list[int], vec: int) -> int:
    """The 32x32 bit matrix ``mat`` (column i = image of bit i) applied to ``vec``."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, col) for col in mat]


def _zero_maps(count: int = 48) -> list[list[int]]:
    """Maps advancing a CRC over 2**k zero bytes, k = 0 .. count-1."""
    one_bit = [_POLY] + [1 << (i - 1) for i in range(1, 32)]  # one zero bit
    m = one_bit
    for _ in range(3):  # 2, 4, 8 bits: one byte
        m = _square(m)
    maps = [m]
    for _ in range(count - 1):
        maps.append(_square(maps[-1]))
    return maps


_ZEROS = _zero_maps()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc1`` = CRC32(A), ``crc2`` = CRC32(B) and ``len2`` = len(B)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_ZEROS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


CHUNK = 16 << 20  # per thread job: large enough that the join is negligible, small enough to spread
_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The process's checksum-and-write threads: all the cores this process may use but two
    (the training thread and the GPU's feeder), at least one."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)) - 2),
                                   thread_name_prefix="elastic_emb-crc")
    return _pool


def write_and_checksum(path: Path, buf: np.ndarray, ranges: list[tuple[int, int]], opener,
                       checksum: bool = True) -> list[int]:
    """Write the uint8 array ``buf`` to a new file ``path`` (``opener(path)`` opens it for
    writing and reading) and fsync it; return the CRC32 of ``buf[off: off + n]`` for each
    ``(off, n)`` of ``ranges`` (disjoint). Both on the pool's threads, chunk by chunk: the file is
    sized first and mapped, and each thread copies its chunks into the mapping (a ``write`` of
    one file is serialised by the kernel's lock on it; page faults of a mapping are not) and
    checksums them while they are in cache. ``checksum=False``: the copy alone (the checksums
    were computed elsewhere); returns []."""
    jobs: list[tuple[int, int, int]] = []  # (range number or -1: padding, chunk start, chunk end)
    for r, (off, n) in enumerate(ranges):
        for c in range(off, off + n, CHUNK):
            jobs.append((r, c, min(c + CHUNK, off + n)))
    at = 0
    for lo, hi in sorted((off, off + n) for off, n in ranges):
        if lo > at:
            jobs.append((-1, at, lo))  # bytes outside every range (alignment padding): copied only
        at = max(at, hi)
    if at < buf.size:
        jobs.append((-1, at, buf.size))
    with opener(path) as f:
        fd = f.fileno()
        crcs: list[int] = []
        os.ftruncate(fd, buf.size)  # also trims a file allocated ahead to this size
        if buf.size:
            with mmap.mmap(fd, buf.size) as mm:
                dst = np.frombuffer(mm, dtype=np.uint8, count=buf.size)

                def job(r: int, lo: int, hi: int) -> int:
                    np.copyto(dst[lo:hi], buf[lo:hi])
                    return zlib.crc32(memoryview(buf[lo:hi])) if r >= 0 and checksum else 0

                try:
                    crcs = [fut.result() for fut in [pool().submit(job, *j) for j in jobs]]
                finally:
                    del dst
        os.fsync(fd)
    if not checksum:
        return []
    out = [0] * len(ranges)
    for (r, lo, hi), crc in zip(jobs, crcs):
        if r >= 0:
            out[r] = crc32_combine(out[r], crc, hi - lo) if lo != ranges[r][0] else crc
    return out
