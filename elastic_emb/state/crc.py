"""CRC32 of large buffers on several cores, and a background commit's data file written by them.

* :func:`checksum_ranges`, :func:`crc32_of`: zlib's CRC32, chunk by chunk on the checksum threads
  (:func:`pool`), the chunks joined by :func:`crc32_combine`; equal to ``zlib.crc32`` of the whole.
* :func:`write_and_checksum`: a buffer copied into a new mapped file and checksummed by the same
  threads, each chunk while it is in cache.

Design: ``docs/COMMIT.md`` (section "CRC32 on several threads").
"""

from __future__ import annotations

import mmap
import os
import threading
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
    """The CRC32 of the concatenation ``A + B`` from the CRC32s of its parts.

    Args:
        crc1: the CRC32 of ``A``.
        crc2: the CRC32 of ``B``.
        len2: the length of ``B`` in bytes.

    Returns:
        ``zlib.crc32(A + B)``.
    """
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_ZEROS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


CHUNK = 16 << 20  # per thread job: large enough that the join is negligible, small enough to spread
_pool: ThreadPoolExecutor | None = None
# The checksum threads' nice above the process's: they hash every GPU delta and must never take
# the core the training thread launches from when the host's cores are all busy (data loaders,
# other ranks); with free cores it costs no throughput.
NICE = 10


def threads() -> int:
    """How many checksum-and-write threads the process has.

    Returns:
        All the cores the process may use but two (the training thread and the GPU's feeder), at
        least one.
    """
    return max(1, len(os.sched_getaffinity(0)) - 2)


def _lower_priority() -> None:
    """Run the calling thread at :data:`NICE` more than the process (Linux: per thread), so the
    training thread wins a core these threads also want; a refusal changes nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
    except (AttributeError, OSError):
        pass


def pool() -> ThreadPoolExecutor:
    """The process's checksum-and-write threads, made at the first call.

    Returns:
        A thread pool of :func:`threads` workers, each running at :data:`NICE` below the process.
    """
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(
            max_workers=threads(), thread_name_prefix="elastic_emb-crc", initializer=_lower_priority
        )
    return _pool


def _chunks(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(range number, chunk start, chunk end)`` for every chunk of at most :data:`CHUNK` bytes
    of each ``(off, n)`` of ``ranges``, in order (an empty range has none)."""
    return [(r, c, min(c + CHUNK, off + n)) for r, (off, n) in enumerate(ranges) for c in range(off, off + n, CHUNK)]


def _joined(ranges: list[tuple[int, int]], jobs: list[tuple[int, int, int]], crcs: list[int]) -> list[int]:
    """Each range's CRC32 from its chunks' (in order; an empty range: 0, zlib's CRC of b"")."""
    out = [0] * len(ranges)
    for (r, lo, hi), crc in zip(jobs, crcs):
        if r >= 0:
            out[r] = crc32_combine(out[r], crc, hi - lo) if lo != ranges[r][0] else crc
    return out


def check_ranges(buf: np.ndarray, ranges: list[tuple[int, int]]) -> None:
    """Check that every range lies inside ``buf``.

    Args:
        buf: a uint8 array.
        ranges: ``(offset, length)`` pairs.

    Raises:
        ValueError: naming the first range that is negative or reaches past the end of ``buf``.
    """
    for off, n in ranges:
        if off < 0 or n < 0 or off + n > buf.size:
            raise ValueError(f"range ({off}, {n}) lies outside the {buf.size}-byte buffer; ranges must be inside it")


def checksum_ranges(buf: np.ndarray, ranges: list[tuple[int, int]]) -> list[int]:
    """The CRC32 of each range of ``buf``, read in place, chunk by chunk on the checksum threads.

    This is how the background writer checksums a GPU capture's bytes where they landed (a log
    segment or a pinned buffer), off the training thread.

    Args:
        buf: a uint8 array.
        ranges: ``(offset, length)`` pairs inside ``buf``.

    Returns:
        ``zlib.crc32(buf[off: off + n])`` for each range, in order (0 for an empty one).

    Raises:
        ValueError: if a range lies outside ``buf`` (:func:`check_ranges`).
    """
    check_ranges(buf, ranges)
    jobs = _chunks(ranges)
    if len(jobs) <= 1:  # one chunk: a thread would only add its hand-over
        return _joined(ranges, jobs, [zlib.crc32(memoryview(buf[lo:hi])) for _, lo, hi in jobs])
    crcs = [
        f.result()
        for f in [pool().submit(lambda lo, hi: zlib.crc32(memoryview(buf[lo:hi])), lo, hi) for _, lo, hi in jobs]
    ]
    return _joined(ranges, jobs, crcs)


def crc32_of(buf: np.ndarray) -> int:
    """The CRC32 of a whole buffer, on the checksum threads.

    Args:
        buf: a uint8 array.

    Returns:
        ``zlib.crc32`` of its bytes (0 when empty).
    """
    return checksum_ranges(buf, [(0, buf.size)])[0] if buf.size else 0


def write_and_checksum(path: Path, buf: np.ndarray, ranges: list[tuple[int, int]], opener) -> list[int]:
    """Write ``buf`` to a file and checksum ranges of it, both on the checksum threads.

    The file is sized (a file allocated ahead is trimmed) and mapped; each thread copies its chunks
    into the mapping (the kernel serialises ``write`` calls on one file, but not page faults of a
    mapping) and checksums them while they are in cache. The file is fsynced before this returns.

    Args:
        path: the file.
        buf: the uint8 array to write, whole.
        ranges: disjoint ``(offset, length)`` pairs of ``buf`` to checksum; bytes outside them
            (alignment padding) are copied only.
        opener: ``opener(path)`` opens the file for writing and reading.

    Returns:
        The CRC32 of each range, in order.
    """
    jobs = _chunks(ranges)  # (range number or -1: padding, chunk start, chunk end)
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
                    return zlib.crc32(memoryview(buf[lo:hi])) if r >= 0 else 0

                try:
                    crcs = [fut.result() for fut in [pool().submit(job, *j) for j in jobs]]
                finally:
                    del dst
        os.fsync(fd)
    return _joined(ranges, jobs, crcs)
