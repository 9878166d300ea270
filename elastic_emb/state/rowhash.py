"""A mutable base's per-row hashes and its typed views.

A base written in place (:mod:`~elastic_emb.state.inplace`) is checked by one 64-bit hash per row
rather than a checksum per tensor, which every apply would have to recompute over the whole shard:
the hash is linear in the row's words, so it is computed for just the rows an apply writes. The
hashes live in a file beside the base's data file (:func:`hashes_file`).

Design: ``docs/COMMIT.md`` (section "Applying deltas in place").
"""

from __future__ import annotations

import functools
import os
import zlib
from pathlib import Path

import torch

from elastic_emb.state.manifest import row_bytes
from elastic_emb.state.paths import open_new

HASHES_SUFFIX = ".rows"  # the per-row hash file of a mutable base: rank<r>[.replica].bin.rows


# Bytes of the int64 temporary a hash works through at a time: a few MiB stays in the caches and
# is allocated once per call (chunks of 65,536 rows, 32 MiB at 512-byte rows, allocated afresh
# each, hashed 10x slower: their pages were faulted in anew every time).
HASH_CHUNK_BYTES = 4 << 20


@functools.lru_cache(maxsize=256)
def _constants(name: str, words: int) -> torch.Tensor:
    """The odd 64-bit multipliers of one tensor's words, and a last one for the row number:
    fixed by the tensor's name and its row width, the same in every process (cached: never
    written to)."""
    seed = zlib.crc32(f"{name}/{words}".encode())
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 62), 1 << 62, (words + 1,), generator=gen, dtype=torch.int64) | 1


def _word_dtype(rb: int) -> torch.dtype:
    """The widest integer word that divides a row: the word size depends on the row width only, so
    a row hashes the same wherever it lies."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if rb % size == 0:
            return dtype
    return torch.uint8


def tensor_row_hashes(name: str, rows: torch.Tensor, numbers: int | torch.Tensor = 0) -> torch.Tensor:
    """One 64-bit hash per row of one tensor: the sum, modulo 2**64, of each word of the row times
    an odd constant of its position, plus the row's number times another.

    A change of any one word (any single bit) changes the hash, since the constant is odd; so does
    a row moved to another number. Linear in the words, so a row's hash is cheap to compute for
    the few rows a delta writes, and vectorized for a whole shard (memory speed).

    Args:
        name: the tensor's name (weight, a slot): it picks the constants.
        rows: ``(n, ...)`` rows of any dtype (CPU).
        numbers: the rows' numbers within their shard: an int (consecutive from it) or an int64
            tensor of ``n`` numbers.

    Returns:
        An int64 tensor of ``n`` hashes.
    """
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return out
    flat = rows.reshape(n, -1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    byte_rows = flat.view(torch.uint8)
    rb = byte_rows.shape[1]
    wd = _word_dtype(rb)
    size = torch.empty((), dtype=wd).element_size()
    words = rb // size
    k = _constants(name, words)
    chunk = max(1, HASH_CHUNK_BYTES // (8 * max(1, words)))
    tmp = torch.empty((min(chunk, n), words), dtype=torch.int64)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        part = byte_rows[lo:hi]
        if part.storage_offset() % size:
            part = part.clone()  # a view of words needs an aligned start
        prod = tmp[: hi - lo]
        if wd == torch.int64:
            torch.mul(part.view(wd), k[:-1], out=prod)
        else:
            prod.copy_(part.view(wd)).mul_(k[:-1])
        torch.sum(prod, 1, out=out[lo:hi])
        nums = (
            torch.arange(numbers + lo, numbers + hi, dtype=torch.int64)
            if isinstance(numbers, int)
            else numbers[lo:hi].to(torch.int64)
        )
        out[lo:hi] += (nums + 1) * k[-1]
    return out


def row_hashes(tensors: dict[str, torch.Tensor], numbers: int | torch.Tensor = 0) -> torch.Tensor:
    """The hash of each row of one table's shard over all its row-wise tensors (the weight and
    every optimizer slot): the sum of :func:`tensor_row_hashes`.

    Args:
        tensors: tensor name -> ``(n, ...)`` rows, the same ``n`` for every tensor.
        numbers: the rows' numbers within the shard (see :func:`tensor_row_hashes`).

    Returns:
        An int64 tensor of ``n`` hashes.
    """
    total = None
    for name in sorted(tensors):
        h = tensor_row_hashes(name, tensors[name], numbers)
        total = h if total is None else total.add_(h)
    return total if total is not None else torch.empty(0, dtype=torch.int64)


def hashes_file(data_file: str) -> str:
    """The name of a mutable base's per-row hash file.

    Args:
        data_file: the base's data file name.

    Returns:
        ``<data_file>.rows``.
    """
    return data_file + HASHES_SUFFIX


def base_views(raw: torch.Tensor, records) -> dict[str, dict[str, torch.Tensor]]:
    """Typed views of a base's bytes, one per table and tensor.

    Args:
        raw: the base's bytes (uint8, CPU: a packed blob or a mapping of its data file).
        records: its :class:`~elastic_emb.state.manifest.ShardRecord` list.

    Returns:
        table -> tensor name -> ``(n, *row_shape)`` view.

    Raises:
        ValueError: if a tensor starts unaligned (see :func:`aligned`).
    """
    out = {}
    for rec in records:
        n = rec.stop - rec.start
        views = {}
        for tr in rec.tensors:
            b = raw[tr.offset : tr.offset + n * row_bytes([tr.dtype, tr.row_shape])]
            dt = getattr(torch, tr.dtype)
            if b.storage_offset() % torch.empty((), dtype=dt).element_size():
                raise ValueError(f"tensor {rec.table}.{tr.name} starts unaligned; it cannot be written in place")
            views[tr.name] = b.view(dt).reshape(n, *tr.row_shape)
        out[rec.table] = views
    return out


def base_hashes(blob: torch.Tensor, records) -> torch.Tensor:
    """The per-row hashes of a base packed in ``blob`` (one int64 per row, tables in record
    order), as the hash file holds them.

    Args:
        blob: the base's bytes (uint8, CPU).
        records: its :class:`~elastic_emb.state.manifest.ShardRecord` list, :func:`aligned`.

    Returns:
        The hashes (int64).
    """
    views = base_views(blob, records)
    parts = [row_hashes(views[rec.table]) for rec in records]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def write_hashes(path: Path, hashes: torch.Tensor, mode: int) -> None:
    """Write a hash file and fsync it.

    Args:
        path: the file (created or truncated).
        hashes: the int64 hashes.
        mode: its permissions.
    """
    with open_new(path, mode) as f:
        f.write(memoryview(hashes.numpy()))
        f.flush()
        os.fsync(f.fileno())


def aligned(records) -> bool:
    """Whether a base can be written in place through typed views.

    Args:
        records: its :class:`~elastic_emb.state.manifest.ShardRecord` list.

    Returns:
        Whether every tensor starts at a multiple of its element size.
    """
    for rec in records:
        for tr in rec.tensors:
            if tr.offset % torch.empty((), dtype=getattr(torch, tr.dtype)).element_size():
                return False
    return True
