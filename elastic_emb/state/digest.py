"""The checksum of a tensor's bytes in a manifest: which algorithm, computed in parallel or streamed.

Every :class:`~elastic_emb.state.manifest.TensorRecord` names one of :data:`ALGORITHMS`:
``"crc32"`` (zlib's CRC32; host-side commits) or ``"xxh3_64"`` (the XXH3-64 of the XXH3-64s of
the bytes' :data:`TREE_CHUNK` chunks; GPU deltas in log segments and folded bases).
:func:`digest_ranges` computes either on the checksum threads, as a copy lands; :class:`Digest`
streams one for restore's single pass over a file.

Design: ``docs/COMMIT.md`` (section "Checksums").
"""

from __future__ import annotations

import zlib

import numpy as np

from elastic_emb.state import crc

ALGORITHMS = ("crc32", "xxh3_64")
NAMES = {"crc32": "CRC32", "xxh3_64": "XXH3-64"}  # as messages name them
TREE_CHUNK = 16 << 20  # part of "xxh3_64": the chunk each digest of the first level covers


def _xxhash():
    import xxhash  # a dependency (pyproject); imported late so a CRC32-only reader never needs it

    return xxhash


def _tree(digests: list[int]) -> int:
    return _xxhash().xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


class Digest:
    """The checksum of a stream of bytes fed in order (``update``), for restore's one pass over
    a file (it copies rows block by block and checksums the same blocks while in cache).

    Args:
        algorithm: one of :data:`ALGORITHMS`.

    Raises:
        ValueError: if ``algorithm`` is not one of :data:`ALGORITHMS`.
    """

    def __init__(self, algorithm: str) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"checksum algorithm {algorithm!r} is not one of {ALGORITHMS}")
        self.algorithm = algorithm
        self._crc = 0
        self._digests: list[int] = []
        self._chunk = None  # the XXH3-64 state of the chunk being fed
        self._fed = 0  # bytes of that chunk so far

    def update(self, data) -> None:
        """Feed the next bytes.

        Args:
            data: a buffer (numpy uint8 array, bytes, memoryview).
        """
        if self.algorithm == "crc32":
            self._crc = zlib.crc32(data, self._crc)
            return
        view = memoryview(data).cast("B")
        while len(view):
            if self._chunk is None:
                self._chunk, self._fed = _xxhash().xxh3_64(), 0
            take = min(TREE_CHUNK - self._fed, len(view))
            self._chunk.update(view[:take])
            self._fed += take
            view = view[take:]
            if self._fed == TREE_CHUNK:
                self._digests.append(self._chunk.intdigest())
                self._chunk = None

    def value(self) -> int:
        """The checksum of every byte fed so far.

        Returns:
            The value a :class:`~elastic_emb.state.manifest.TensorRecord` of this algorithm holds.
        """
        if self.algorithm == "crc32":
            return self._crc
        tail = [self._chunk.intdigest()] if self._chunk is not None else []
        return _tree(self._digests + tail)


def digest(data, algorithm: str) -> int:
    """The checksum of one buffer.

    Args:
        data: the bytes (numpy uint8 array, bytes, memoryview).
        algorithm: one of :data:`ALGORITHMS`.

    Returns:
        Its checksum by ``algorithm``.
    """
    d = Digest(algorithm)
    d.update(data)
    return d.value()


def digest_ranges(buf: np.ndarray, ranges: list[tuple[int, int]], algorithm: str, landed=None) -> list[int]:
    """The checksum of each range of ``buf``, read in place, chunk by chunk on the checksum threads.

    This is how the background writer checksums a GPU capture (both libraries release the GIL).

    Args:
        buf: a uint8 array.
        ranges: ``(offset, length)`` pairs inside ``buf``.
        algorithm: one of :data:`ALGORITHMS`.
        landed: for XXH3-64, an iterable of growing byte counts, each yielded once ``buf[:count]``
            holds its final bytes (a copy landing piece by piece): each chunk goes to the threads
            as soon as it has landed. Every count is consumed before the result, for either
            algorithm (CRC32 starts after the last one).

    Returns:
        The checksum of ``buf[off: off + n]`` for each range, in order.

    Raises:
        ValueError: if ``algorithm`` is unknown or a range lies outside ``buf``.
    """
    if algorithm == "crc32":
        for _ in landed or ():
            pass  # CRC32 chunks are joined in order by crc.checksum_ranges: after the whole copy
        return crc.checksum_ranges(buf, ranges)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"checksum algorithm {algorithm!r} is not one of {ALGORITHMS}")
    crc.check_ranges(buf, ranges)
    xxh = _xxhash()
    jobs = [
        (r, c, min(c + TREE_CHUNK, off + n))
        for r, (off, n) in enumerate(ranges)
        for c in range(off, off + n, TREE_CHUNK)
    ]
    jobs.sort(key=lambda j: j[2])  # by the byte each chunk ends at: the order it lands in

    def run(lo, hi):
        return xxh.xxh3_64_intdigest(memoryview(buf[lo:hi]))

    futures = []
    for mark in landed or ():
        while len(futures) < len(jobs) and jobs[len(futures)][2] <= mark:
            futures.append(crc.pool().submit(run, *jobs[len(futures)][1:]))
    futures += [crc.pool().submit(run, lo, hi) for _, lo, hi in jobs[len(futures) :]]
    per: list[list[int]] = [[] for _ in ranges]
    for (r, _, _), fut in zip(jobs, futures):
        per[r].append(fut.result())
    return [_tree(d) for d in per]
