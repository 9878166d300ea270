"""Incremental commits: a base image plus a bounded chain of deltas of the rows that changed.

A delta carries, per table, the local row numbers that changed (the :data:`INDEX` tensor) and
those rows of the weight and of every optimizer slot, in a base's file and manifest format, and
names its parent commit. :func:`pack_delta` builds one on the host; :func:`resolve_chains` links
one holder's manifests into chains back to their bases (and finds gaps); :func:`read_chain`
materializes a chain, verified link by link.

Design: ``docs/COMMIT.md`` (section "Deltas").
"""

from __future__ import annotations

from pathlib import Path

import torch

from elastic_emb.protocol import ShardData
from elastic_emb.state.crc import crc32_of
from elastic_emb.state.manifest import (
    CommitId,
    ShardRecord,
    SnapshotManifest,
    TensorRecord,
    as_bytes,
    row_spec,
    tensor_items,
)

INDEX = "index"  # the tensor of a delta record holding the changed rows' local row numbers (int64)


def changed_index(name: str, change: torch.Tensor | None, n: int) -> torch.Tensor:
    """The local rows of one table a commit carries, from what the context reported.

    Args:
        name: the table, for error messages.
        change: a bool mask of shape ``(n,)`` (``take_changes``), a sorted int64 tensor of distinct
            local rows (``take_changed_rows``), or None (every row).
        n: the rows of this rank's shard of the table.

    Returns:
        The changed local rows, a sorted 1-D int64 tensor.

    Raises:
        ValueError: if a mask has the wrong shape, the tensor has another dtype or shape, or the
            rows are not distinct, sorted and within ``[0, n)`` (checked in O(rows changed)).
    """
    if change is None:
        return torch.arange(n, dtype=torch.int64)
    if change.dtype == torch.bool:
        if change.shape != (n,):
            raise ValueError(f"take_changes()[{name!r}] must be a bool mask of shape ({n},), got {tuple(change.shape)}")
        return change.nonzero().flatten()
    if change.dtype != torch.int64 or change.dim() != 1:
        raise ValueError(
            f"changes[{name!r}] must be a bool mask of shape ({n},) or a 1-D int64 tensor of local rows, "
            f"got {(tuple(change.shape), change.dtype)}"
        )
    if change.numel() and (int(change[0]) < 0 or int(change[-1]) >= n or bool((change[1:] <= change[:-1]).any())):
        raise ValueError(
            f"changes[{name!r}]: the changed rows must be distinct, sorted and within [0, {n}) "
            f"(take_changed_rows(unique=True) gives them so)"
        )
    return change


def pack_delta(
    shards: dict[str, ShardData], changes: dict[str, torch.Tensor | None], num_rows: dict[str, int]
) -> tuple[list[ShardRecord], torch.Tensor, int]:
    """The changed rows of every table back to back in one byte buffer, with their records.

    Args:
        shards: table -> this rank's shard.
        changes: table -> a bool mask or the sorted distinct changed rows (see
            :func:`changed_index`); every table of ``shards`` must be there.
        num_rows: table -> rows in the whole table.

    Returns:
        ``(records, buffer, rows)``: the records with each tensor's CRC32, the uint8 CPU buffer,
        and the number of changed rows over all tables.

    Raises:
        ValueError: if a table lacks its changes, or they are malformed (:func:`changed_index`).
    """
    records, parts, off, total = [], [], 0, 0
    for name in sorted(shards):
        sd = shards[name]
        if name not in changes:
            raise ValueError(f"changes lack table {name!r}: every table of the shard needs its changed rows")
        idx = changed_index(name, changes[name], len(sd.rows))
        total += int(idx.numel())
        trs = []
        for tname, t in [(INDEX, idx.to(torch.int64))] + [(n, t[idx.to(t.device)]) for n, t in tensor_items(sd)]:
            b = as_bytes(t)
            spec = row_spec(t)
            trs.append(
                TensorRecord(
                    name=tname,
                    dtype=spec[0],
                    row_shape=spec[1],
                    offset=off,
                    nbytes=int(b.numel()),
                    crc32=crc32_of(b.numpy()),
                )
            )
            parts.append(b)
            off += int(b.numel())
        records.append(
            ShardRecord(table=name, num_rows=num_rows[name], start=sd.rows.start, stop=sd.rows.stop, tensors=trs)
        )
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return records, blob, total


def resolve_chains(manifests: list[tuple[Path, SnapshotManifest]]):
    """For every manifest one holder has: the files restoring it takes, base first.

    Args:
        manifests: ``(data file path, manifest)`` pairs of one node directory.

    Returns:
        ``(chains, gaps)``: ``chains`` maps the data file path of every manifest whose chain is
        complete to the ``(path, manifest)`` list from its base to it; ``gaps`` lists
        ``(manifest, missing parent commit)`` for those whose chain is broken (a parent that is not
        older than its child counts as missing).
    """
    by_key = {(m.source_rank, m.replica, m.commit): (p, m) for p, m in manifests}
    # A manifest's chain is its parent's plus itself, so each is resolved once, oldest commit first
    # (its parent, always older, is resolved by then): walking every chain from its tip would
    # cost O(length) per manifest, quadratic in a long chain.
    done: dict[tuple, list[tuple[Path, SnapshotManifest]] | None] = {}
    missing: dict[tuple, CommitId] = {}  # for a broken chain: the first parent commit it lacks

    def extend(path: Path, m: SnapshotManifest):
        if m.parent is None:
            return [(path, m)], None
        pkey = (m.source_rank, m.replica, m.parent)
        if pkey not in by_key or m.parent >= m.commit:  # a gap (a parent not older is one too: no cycles)
            return None, m.parent
        up = done[pkey]
        return (None, missing[pkey]) if up is None else (up + [(path, m)], None)

    for key in sorted(by_key, key=lambda k: k[2]):
        done[key], gap = extend(*by_key[key])
        if gap is not None:
            missing[key] = gap
    chains: dict[Path, list[tuple[Path, SnapshotManifest]]] = {}
    gaps: list[tuple[SnapshotManifest, CommitId]] = []
    for path, m in manifests:
        chain, gap = extend(path, m)
        if chain is None:
            gaps.append((m, gap))
        elif chain[0][1].applying is not None and m.commit < chain[0][1].applying:
            # Its base is being written through a newer delta (state/inplace.py): rows of that delta
            # may already be in the base, so only commits from it on can be built from here.
            continue
        else:
            chains[path] = chain
    return chains, gaps


def read_chain(
    chain: list[tuple[Path, SnapshotManifest]], read, fill: dict | None = None, materialize: bool = True
) -> dict[str, dict[str, torch.Tensor]]:
    """Materialize a shard from its base and deltas, in order, each verified before it is applied.

    The base is mapped copy-on-write, so applying the deltas never changes a committed file.
    Delta entries equal to the shard's row count (a GPU capture's skipped entries) are skipped.

    Args:
        chain: ``(path, manifest)`` from the base to the newest delta (:func:`resolve_chains`).
        read: ``read(path, manifest, fill=)`` reads and verifies one file
            (:func:`elastic_emb.state.shardfile.read_snapshot`).
        fill: as ``read_snapshot``'s: rows that stay on the reading rank, copied out of the base in
            its checksum pass, with every delta applied to them too. On ChecksumMismatch the
            destinations hold unverified rows.
        materialize: apply the deltas to the base's mapping too; False when only ``fill`` is
            wanted (the tensors returned then hold the base's rows only).

    Returns:
        table -> tensor name -> tensor, the base's with the deltas applied.

    Raises:
        ValueError: if a delta names rows outside its shard.
        ChecksumMismatch: if ``read`` finds a file corrupt.
    """
    (base_path, base_m), deltas = chain[0], chain[1:]
    got = [read(path, m) for path, m in deltas]  # verified first: a mutable base needs their rows
    if base_m.row_hashes is not None:  # written in place (state/inplace.py): checked row by row
        from elastic_emb.state.inplace import read_base

        skip = None
        if base_m.applying is not None:  # an apply cut short: the rows it may have torn are replayed below
            skip = {}
            for d in got:
                for table, tensors in d.items():
                    skip.setdefault(table, []).append(tensors[INDEX].reshape(-1))
            skip = {t: torch.cat(v) for t, v in skip.items()}
            n_of = {rec.table: rec.stop - rec.start for rec in base_m.shards}
            skip = {t: v[(v >= 0) & (v < n_of.get(t, 0))] for t, v in skip.items()}
        out = read_base(base_path, base_m, fill=fill, skip=skip)
    else:
        out = read(base_path, base_m, fill=fill)
    for (path, _), d in zip(deltas, got):
        for table, tensors in d.items():
            idx, n = tensors[INDEX].reshape(-1), out[table]["weight"].shape[0]
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) > n):
                raise ValueError(f"{path}: delta of table {table!r} names rows outside its shard")
            # A GPU capture (elastic_emb.state.capture) may list a row twice (same bytes) and
            # entries equal to n (no row): those are skipped.
            keep = idx < n
            if not bool(keep.all()):
                idx, tensors = idx[keep], {k: v[keep] for k, v in tensors.items() if k != INDEX}
            for lo, hi, dsts in (fill or {}).get(table, []):
                sel = ((idx >= lo) & (idx < hi)).nonzero().flatten()
                for tname, dst in dsts.items():
                    dst[idx[sel] - lo] = tensors[tname][sel]
            if materialize:
                for tname, rows in tensors.items():
                    if tname != INDEX:
                        out[table][tname][idx] = rows
    return out
