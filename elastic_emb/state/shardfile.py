"""The data file of one shard: packed, written, and read back verified.

A data file is every table's row-wise tensors back to back (:func:`pack_shard`), written and
fsynced before any manifest names it (:func:`write_blob`). :func:`read_snapshot` maps it (or a
log segment's range) copy-on-write, verifies every tensor's checksum and copies the rows that
stay on the reading rank in the same pass.

Design: ``docs/COMMIT.md`` (section "The data file").
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

from elastic_emb.errors import ChecksumMismatch
from elastic_emb.protocol import ShardData
from elastic_emb.state.crc import crc32_of
from elastic_emb.state.digest import NAMES, Digest
from elastic_emb.state.manifest import (
    ShardRecord,
    SnapshotManifest,
    TensorRecord,
    as_bytes,
    row_bytes,
    row_spec,
    tensor_items,
)
from elastic_emb.state.paths import FILE_MODE, open_new


def pack_shard(
    shards: dict[str, ShardData], num_rows: dict[str, int], checksums: bool = True
) -> tuple[list[ShardRecord], torch.Tensor]:
    """Every table's row-wise tensors back to back in one byte buffer, with their records.

    Args:
        shards: table -> this rank's shard (tables in name order, tensors in
            :func:`~elastic_emb.state.manifest.tensor_items` order).
        num_rows: table -> rows in the whole table.
        checksums: compute each tensor's CRC32; False: -1 (a base checked by its per-row hashes
            instead, :mod:`elastic_emb.state.inplace`, computed by the writer).

    Returns:
        ``(records, buffer)``: one :class:`ShardRecord` per table with each tensor's offset,
        length and CRC32, and the uint8 CPU buffer.
    """
    records, parts, off = [], [], 0
    for name in sorted(shards):
        sd = shards[name]
        trs = []
        for tname, t in tensor_items(sd):
            b = as_bytes(t)
            trs.append(
                TensorRecord(
                    name=tname,
                    dtype=row_spec(t)[0],
                    row_shape=row_spec(t)[1],
                    offset=off,
                    nbytes=int(b.numel()),
                    crc32=crc32_of(b.numpy()) if checksums else -1,
                )
            )
            parts.append(b)
            off += int(b.numel())
        records.append(
            ShardRecord(table=name, num_rows=num_rows[name], start=sd.rows.start, stop=sd.rows.stop, tensors=trs)
        )
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return records, blob


def write_blob(path: Path, blob: torch.Tensor, mode: int = FILE_MODE) -> None:
    """Write a byte buffer to a new file and fsync it.

    Args:
        path: the file (created or truncated).
        blob: a uint8 CPU tensor.
        mode: the file's permissions.
    """
    with open_new(path, mode) as f:
        f.write(memoryview(blob.numpy()))
        f.flush()
        os.fsync(f.fileno())


# A block of a snapshot tensor copied into its destination and checksummed while it is in cache:
# the file's bytes then come from memory once, not once for the CRC32 and again for the copy.
# 2 MiB: the fastest block size tried, with two ranks reading at once through one shared L3.
VERIFY_CHUNK = 2 << 20


def read_snapshot(
    path: Path,
    manifest: SnapshotManifest,
    verify: bool = True,
    fill: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Load one shard file (or a log segment's range) and check every tensor's checksum.

    The file is mapped privately (copy-on-write), so it works on read-only storage and nothing done
    to the tensors returned changes the file.

    Args:
        path: the data file or log segment.
        manifest: the manifest naming it (sizes, offsets, checksums, the segment range).
        verify: check the checksums (False: only map and copy).
        fill: table -> ``[(row_lo, row_hi, {tensor name: destination rows})]``, rows counted from
            the shard's first row: those rows are also copied into the (contiguous) destinations,
            in the same pass as the checksum. The copies happen before the verdict: after a
            ChecksumMismatch the destinations hold unverified bytes, which the caller must
            overwrite or discard.

    Returns:
        table -> tensor name -> tensor (the shard's rows for a base, the changed rows for a delta).

    Raises:
        ChecksumMismatch: if the file's size or the segment range disagrees with the manifest, or a
            tensor's checksum does not match.
    """
    if manifest.row_hashes is not None:  # a base written in place: checked row by row (state/inplace.py)
        from elastic_emb.state.inplace import read_base

        return read_base(path, manifest, fill=fill, verify=verify)
    size = path.stat().st_size if path.exists() else -1
    at = manifest.segment_offset if manifest.segment is not None else 0
    if manifest.segment is not None:  # a log segment holds more than this commit: the range must lie in it
        if manifest.data_bytes < 0 or at + manifest.data_bytes > size:
            raise ChecksumMismatch(
                f"{path}: the manifest's range [{at}, {at + manifest.data_bytes}) lies outside the "
                f"log segment ({size} bytes); the commit is damaged or foreign: delete it"
            )
    elif size != manifest.data_bytes:
        raise ChecksumMismatch(
            f"{path}: {size} bytes on disk, manifest says {manifest.data_bytes}; the file is "
            f"damaged or was replaced: delete {path.parent} to drop this commit"
        )
    # Map the file rather than read it: on /dev/shm the pages are already in memory, so the
    # checksum and the row copies read them in place (no read copy, no fresh pages).
    # Private (copy-on-write) mapping: the file is opened read-only, so restore works from a
    # read-only state directory, and nothing restore does can change a committed file.
    raw = (
        torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        if size > 0
        else torch.empty(0, dtype=torch.uint8)
    )
    if manifest.segment is not None:
        raw = raw[at : at + manifest.data_bytes]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for rec in manifest.shards:
        tensors = {}
        for tr in rec.tensors:
            b = raw[tr.offset : tr.offset + tr.nbytes]
            rb = row_bytes([tr.dtype, tr.row_shape])
            n = tr.nbytes // rb if rb else 0  # the shard's rows (a base) or the changed rows (a delta)
            copies = [
                (lo * rb, dsts[tr.name].reshape(-1).view(torch.uint8))
                for lo, hi, dsts in (fill or {}).get(rec.table, [])
                if tr.name in dsts
            ]
            if verify:
                got = _crc_and_copy(b, copies, tr.algorithm)
                if got != tr.crc32:
                    raise ChecksumMismatch(
                        f"{path}: table {rec.table!r} tensor {tr.name!r} rows [{rec.start}, {rec.stop}) has "
                        f"{NAMES[tr.algorithm]} {got:#x}, manifest says {tr.crc32:#x}; the snapshot is corrupt: delete {path.parent}"
                    )
            else:
                for off, dst in copies:
                    dst.copy_(b[off : off + dst.numel()])
            dtype = getattr(torch, tr.dtype)
            if (at + tr.offset) % torch.empty((), dtype=dtype).element_size():
                b = b.clone()  # a view needs an aligned offset (tensors of mixed element sizes)
            tensors[tr.name] = b.view(dtype).reshape(n, *tr.row_shape)
        out[rec.table] = tensors
    return out


def _crc_and_copy(b: torch.Tensor, copies: list[tuple[int, torch.Tensor]], algorithm: str = "crc32") -> int:
    """The checksum (``algorithm``, :mod:`elastic_emb.state.digest`) of the bytes ``b``; meanwhile
    copy ``b[off: off + len(dst)]`` into each flat ``dst``. Block by block: each block is copied
    first (which brings it into cache), then checksummed."""
    total = b.numel()
    if algorithm != "crc32":
        d = Digest(algorithm)
        for c0 in range(0, total, VERIFY_CHUNK):
            c1 = min(c0 + VERIFY_CHUNK, total)
            _copy_block(b, copies, c0, c1)
            d.update(b[c0:c1].numpy())
        return d.value()
    crc = 0
    if not copies:
        return zlib.crc32(b.numpy()) if total else 0
    for c0 in range(0, total, VERIFY_CHUNK):
        c1 = min(c0 + VERIFY_CHUNK, total)
        _copy_block(b, copies, c0, c1)
        crc = zlib.crc32(b[c0:c1].numpy(), crc)
    return crc


def _copy_block(b: torch.Tensor, copies: list[tuple[int, torch.Tensor]], c0: int, c1: int) -> None:
    """The part of each ``(off, dst)`` of ``copies`` that lies in ``b[c0:c1]``, copied."""
    for off, dst in copies:
        lo, hi = max(c0, off), min(c1, off + dst.numel())
        if lo < hi:
            dst[lo - off : hi - off].copy_(b[lo:hi])
