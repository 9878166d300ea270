"""Incremental commits: a base image plus a bounded chain of deltas of the rows that changed.

An embedding step writes few rows of a large table, so a commit need only carry those rows. A
context that tracks its writes (``tracks_changes``, ``take_changes()``: per table a bool mask of
the rows written since the last call) lets the snapshot tier write, after a full *base* commit,
*delta* commits: per table the local row numbers that changed (an ``index`` tensor, int64) and
those rows of the weight and of every optimizer slot, each with its CRC32, in the same file and
manifest format as a base. A delta's manifest names its ``parent`` commit, so every delta links to
the one before it, back to a base of the same generation (a new generation, a new layout, always
starts with a base).

A delta captured on the GPU (:mod:`elastic_emb.state.capture`) has the same format; its index
may list a row more than once (with the same bytes) and holds the shard's row count for entries
that stand for no row, which :func:`read_chain` skips.

Restore materializes a delta commit of one source rank from the files one holder keeps: the
base, then every delta in order, each verified against its CRC32s before it is applied
(:func:`read_chain`). A delta whose manifest was never written (a crash in the middle of a
commit) is not a commit: the chain simply ends one step earlier (a torn tail is ignored). A link
missing in the *middle* of a chain, where later deltas exist, is reported by
:func:`resolve_chains` as a gap, and restore refuses to skip over it silently.

Bound, two ways of ending a chain. Folding (the default for chains captured on the host;
:mod:`.compact` says when a commit is a fold point): each holder folds the chain into a base,
from its own files, in the background; the chain goes on from it, and the full prune at the next
fold point frees the
older base and its deltas: a node directory then holds at most two bases per shard it stores
(own or replica) and the deltas of two fold windows, plus the commits in flight (with a fold point
every ``f`` deltas, ``2 * f - 2`` deltas after each prune). Re-basing (the GPU capture path, or
``LifecycleConfig(fold=False)``): the chain is at most ``max_chain`` deltas long and the commit
after that is a new base captured from the context (a complete commit of its own, so a crash at
any point leaves the previous base and chain restorable until the new base is complete); with
``keep`` complete commits kept and their chains (``keep <= max_chain + 1``), after each commit's
prune a node directory holds at most two bases and ``max_chain + keep - 2`` deltas per shard it
stores, plus the one commit in flight (tests/test_state.py checks both bounds over a long run).
"""

from __future__ import annotations

from pathlib import Path

import torch

from elastic_emb.protocol import ShardData
from elastic_emb.state.crc import crc32_of
from elastic_emb.state.manifest import CommitId, ShardRecord, SnapshotManifest, TensorRecord, as_bytes, row_spec, tensor_items

INDEX = "index"  # the tensor of a delta record holding the changed rows' local row numbers (int64)


def changed_index(name: str, change: torch.Tensor | None, n: int) -> torch.Tensor:
    """The local rows of one table a commit carries, from what the context reported: a bool
    mask of shape ``(n,)`` (``take_changes``), a sorted int64 tensor of distinct local rows
    (``take_changed_rows``), or None (every row). Checked: a row outside ``[0, n)`` or an
    unsorted / duplicated index is refused (O(rows changed))."""
    if change is None:
        return torch.arange(n, dtype=torch.int64)
    if change.dtype == torch.bool:
        if change.shape != (n,):
            raise ValueError(f"take_changes()[{name!r}] must be a bool mask of shape ({n},), got {tuple(change.shape)}")
        return change.nonzero().flatten()
    if change.dtype != torch.int64 or change.dim() != 1:
        raise ValueError(f"changes[{name!r}] must be a bool mask of shape ({n},) or a 1-D int64 tensor of local rows, "
                         f"got {(tuple(change.shape), change.dtype)}")
    if change.numel() and (int(change[0]) < 0 or int(change[-1]) >= n or bool((change[1:] <= change[:-1]).any())):
        raise ValueError(f"changes[{name!r}]: the changed rows must be distinct, sorted and within [0, {n}) "
                         f"(take_changed_rows(unique=True) gives them so)")
    return change


def pack_delta(shards: dict[str, ShardData], changes: dict[str, torch.Tensor | None],
               num_rows: dict[str, int]) -> tuple[list[ShardRecord], torch.Tensor, int]:
    """The changed rows of every table back to back in one byte buffer, with their records.
    ``changes``: per table a bool mask or the sorted distinct changed rows (see
    :func:`changed_index`). Returns (records, buffer, number of changed rows over all tables)."""
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
            trs.append(TensorRecord(name=tname, dtype=spec[0], row_shape=spec[1], offset=off, nbytes=int(b.numel()),
                                    crc32=crc32_of(b.numpy())))
            parts.append(b)
            off += int(b.numel())
        records.append(ShardRecord(table=name, num_rows=num_rows[name], start=sd.rows.start, stop=sd.rows.stop,
                                   tensors=trs))
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return records, blob, total


def resolve_chains(manifests: list[tuple[Path, SnapshotManifest]]):
    """For every manifest one holder has: the files restoring it takes, base first.

    Returns (chains, gaps): ``chains`` maps (path of the manifest's data file) to the list of
    (path, manifest) from the base to it, for every manifest whose chain is complete; ``gaps``
    lists (manifest, the parent commit that is missing) for those whose chain is broken."""
    by_key = {(m.source_rank, m.replica, m.commit): (p, m) for p, m in manifests}
    # A manifest's chain is its parent's plus itself, so each is resolved once, oldest commit first
    # (its parent, always older, is resolved by then): walking every chain from its tip instead
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
        else:
            chains[path] = chain
    return chains, gaps


def read_chain(chain: list[tuple[Path, SnapshotManifest]], read, fill: dict | None = None,
               materialize: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Materialize a shard from its base and deltas, in order; ``read(path, manifest, fill=)``
    reads and verifies one file (:func:`elastic_emb.state.shardfile.read_snapshot`). The base is
    mapped copy-on-write, so applying the deltas never changes a committed file.

    ``fill`` (as :func:`~elastic_emb.state.shardfile.read_snapshot`'s): rows that stay on the
    reading rank are copied out of the base in its checksum pass, and every delta is applied to
    them too. ``materialize=False``: only ``fill`` is wanted (every row of this shard stays on
    this rank), so the deltas are not also applied to the base's mapping (whose pages would be
    copied on write): the tensors returned then hold the base's rows only. The same caveat as
    ``read_snapshot``'s: on ChecksumMismatch the destinations hold unverified rows."""
    (base_path, base_m), deltas = chain[0], chain[1:]
    out = read(base_path, base_m, fill=fill)
    for path, m in deltas:
        d = read(path, m)
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
