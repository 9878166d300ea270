"""Deltas written into their chain's base in place: no fold, no new base.

:func:`apply_chain` writes a chain's deltas into its base's data file in place (the full new rows:
writing one twice is harmless), updates the rows' hashes (:mod:`~elastic_emb.state.rowhash`) and
advances the base's mark (``applied``): the base then stands for that commit and the deltas up to
it are released. ``applying`` tells restore which rows a kill may have torn (it replays those).
:func:`read_base` reads such a base back, every row checked. The thread that runs the applies is
:class:`~elastic_emb.state.applier.Applier`.

Design: ``docs/COMMIT.md`` (section "Applying deltas in place").
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from elastic_emb.errors import ChecksumMismatch
from elastic_emb.events import get_logger
from elastic_emb.state import points
from elastic_emb.state.delta import INDEX
from elastic_emb.state.manifest import CommitId, SnapshotManifest, row_bytes, write_atomic
from elastic_emb.state.paths import check_name
from elastic_emb.state.rowhash import aligned, base_views, hashes_file, row_hashes, write_hashes

log = get_logger("elastic_emb.state")


def manifest_name(m: SnapshotManifest) -> str:
    """The file name of a manifest in its commit directory.

    Args:
        m: the manifest.

    Returns:
        ``rank<r>.json`` or ``rank<r>.replica.json``.
    """
    return f"rank{m.source_rank}{'.replica' if m.replica else ''}.json"


def mark_of(m: SnapshotManifest) -> CommitId:
    """The commit a base stands for.

    Args:
        m: the base's manifest as written.

    Returns:
        Its own commit, or the newest delta written into it.
    """
    return m.applied if m.applied is not None else m.commit


def present(manifests: list[tuple[Path, SnapshotManifest]]) -> list[tuple[Path, SnapshotManifest]]:
    """A node directory's manifests as restore and prune must see them.

    A mutable base is shown as a base of the commit it stands for (its mark), and the deltas of
    its chain up to the mark (written into it) are left out: they are released, not commits a
    restore could still build from this holder.

    Args:
        manifests: ``(data path, manifest)`` pairs of one node directory, as listed.

    Returns:
        The pairs to resolve chains from, in the same order.
    """
    marks = {}
    for _, m in manifests:
        if m.parent is None and m.applied is not None:
            key = (m.source_rank, m.replica, m.fingerprint)
            marks.setdefault(key, []).append((m.commit, m.applied))
    if not marks:
        return manifests
    out = []
    for path, m in manifests:
        if m.parent is None and m.applied is not None:
            a = m.applied
            out.append(
                (path, m.model_copy(update=dict(step=a.step, generation=a.generation, fingerprint=a.fingerprint)))
            )
            continue
        spans = marks.get((m.source_rank, m.replica, m.fingerprint), ())
        if m.parent is not None and any(base < m.commit <= applied for base, applied in spans):
            continue  # written into its base: released
        out.append((path, m))
    return out


def read_base(
    path: Path,
    manifest: SnapshotManifest,
    fill: dict | None = None,
    skip: dict[str, torch.Tensor] | None = None,
    verify: bool = True,
) -> dict[str, dict[str, torch.Tensor]]:
    """Load a mutable base, mapped copy-on-write, every row checked against its hash.

    Args:
        path: the base's data file.
        manifest: its manifest (``row_hashes`` set).
        fill: as :func:`elastic_emb.state.shardfile.read_snapshot`'s: rows copied into
            destinations (after the check).
        skip: table -> local rows whose hash is not checked (the rows the caller replays from the
            deltas of an interrupted apply, which overwrite them with verified bytes).
        verify: check the hashes (False: only map and copy).

    Returns:
        table -> tensor name -> the shard's rows.

    Raises:
        ChecksumMismatch: if the file's or the hash file's size disagrees with the manifest, or a
            row's hash does not match.
    """
    check_name(manifest.row_hashes or "", "row hash file")
    size = path.stat().st_size if path.exists() else -1
    if size != manifest.data_bytes:
        raise ChecksumMismatch(
            f"{path}: {size} bytes on disk, manifest says {manifest.data_bytes}; the base is damaged or "
            f"was replaced: delete {path.parent} to drop it"
        )
    hpath = path.with_name(manifest.row_hashes)
    rows = sum(rec.stop - rec.start for rec in manifest.shards)
    hsize = hpath.stat().st_size if hpath.exists() else -1
    if hsize != rows * 8:
        raise ChecksumMismatch(
            f"{hpath}: {hsize} bytes on disk, {rows * 8} expected ({rows} rows); the base's row hashes are "
            f"damaged: delete {path.parent} to drop it"
        )
    raw = (
        torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        if size
        else torch.empty(0, dtype=torch.uint8)
    )
    stored = (
        torch.from_file(str(hpath), shared=False, size=rows, dtype=torch.int64)
        if rows
        else torch.empty(0, dtype=torch.int64)
    )
    out = base_views(raw, manifest.shards)
    at = 0
    for rec in manifest.shards:
        n = rec.stop - rec.start
        tensors = out[rec.table]
        bad = row_hashes(tensors) != stored[at : at + n] if verify else torch.zeros(n, dtype=torch.bool)
        if skip and rec.table in skip and skip[rec.table].numel():
            bad[skip[rec.table]] = False
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise ChecksumMismatch(
                f"{path}: table {rec.table!r} row {rec.start + first} (and {int(bad.sum()) - 1} more) does not match "
                f"its hash; the base is corrupt: delete {path.parent} to drop it"
            )
        for lo, hi, dsts in (fill or {}).get(rec.table, []):
            for tname, dst in dsts.items():
                dst.copy_(tensors[tname][lo:hi])
        at += n
    return out


class MappedFile:
    """A data file mapped shared and writable (writes reach the file), with its descriptor for
    fsync. Closed by :meth:`close` (the tensors over it must be gone first).

    Args:
        path: the file.
        size: its size in bytes.
        dtype: the element type of :attr:`tensor`, the mapping.

    Raises:
        OSError: if the file cannot be opened.
    """

    def __init__(self, path: Path, size: int, dtype=torch.uint8) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        self.ident = (os.fstat(self.fd).st_ino, size)  # the file it maps: a file replaced is mapped afresh
        self.tensor = torch.from_file(
            str(path), shared=True, size=size // torch.empty((), dtype=dtype).element_size(), dtype=dtype
        )

    def sync(self) -> None:
        """fsync the file: it writes back the pages dirtied through the shared mapping too."""
        os.fsync(self.fd)

    def close(self) -> None:
        """Drop the mapping and close the descriptor."""
        self.tensor = None
        os.close(self.fd)


class ReadBuffer:
    """Memory a reader reuses from one delta to the next: grown to the largest delta read, never
    shrunk. A fresh buffer per delta paid its first touch every time (a 0.5 GB delta read 7x slower
    into new memory than into memory read into before)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of the buffer, grown first if it is smaller.

        Args:
            nbytes: the bytes wanted.

        Returns:
            A uint8 view of them, contents undefined; what an earlier call returned is overwritten
            by the next read into this one.
        """
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(0, dtype=torch.uint8)  # the old one goes first: never both at once
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]


def read_delta(path: Path, m: SnapshotManifest, buffer: ReadBuffer | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """A delta's tensors, read into memory (the applier's reused buffer, or memory of their own),
    every checksum verified first on the checksum threads (a large GPU delta: one thread would
    bound the applier).

    Read, not mapped: mapping a small file privately costs more than reading it, and the applier
    reads every delta once.

    Args:
        path: the delta's data file or log segment.
        m: its manifest.
        buffer: where the bytes go (the tensors returned are views of it, valid until its next
            use); None: memory of their own.

    Returns:
        table -> tensor name -> rows (the index included).

    Raises:
        ChecksumMismatch: if the file or segment range disagrees with the manifest, or a tensor's
            checksum does not match.
    """
    from elastic_emb.state.digest import digest_ranges

    at = m.segment_offset if m.segment is not None else 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if (m.segment is not None and at + m.data_bytes > size) or (m.segment is None and size != m.data_bytes):
            raise ChecksumMismatch(
                f"{path}: {size} bytes on disk do not hold the delta of step {m.step} ({m.data_bytes} bytes at "
                f"{at}); the commit is damaged or foreign: delete {path.parent}"
            )
        raw = buffer.get(m.data_bytes) if buffer is not None else torch.empty(m.data_bytes, dtype=torch.uint8)
        f.seek(at)
        view, got = memoryview(raw.numpy()), 0
        while got < m.data_bytes:
            n = f.readinto(view[got:])
            if not n:
                raise ChecksumMismatch(f"{path}: ended after {got} of {m.data_bytes} bytes; the delta is damaged")
            got += n
    by_alg: dict[str, list] = {}
    for rec in m.shards:
        for tr in rec.tensors:
            if tr.offset + tr.nbytes > m.data_bytes:
                raise ChecksumMismatch(f"{path}: tensor {tr.name!r} lies outside the delta of step {m.step}")
            by_alg.setdefault(tr.algorithm, []).append((rec, tr))
    for alg, items in by_alg.items():
        values = digest_ranges(raw.numpy(), [(tr.offset, tr.nbytes) for _, tr in items], alg)
        for (rec, tr), value in zip(items, values):
            if value != tr.crc32:
                raise ChecksumMismatch(
                    f"{path}: table {rec.table!r} tensor {tr.name!r} of the delta of step {m.step} does not match its "
                    f"checksum; the delta is corrupt: it is not applied, delete {path.parent} to drop the commit"
                )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for rec in m.shards:
        tensors = {}
        for tr in rec.tensors:
            rb = row_bytes([tr.dtype, tr.row_shape])
            b = raw[tr.offset : tr.offset + tr.nbytes]
            dtype = getattr(torch, tr.dtype)
            if tr.offset % torch.empty((), dtype=dtype).element_size():
                b = b.clone()  # a view needs an aligned offset (tensors of mixed element sizes)
            tensors[tr.name] = b.view(dtype).reshape(tr.nbytes // rb if rb else 0, *tr.row_shape)
        out[rec.table] = tensors
    return out


def promote(tier, mpath: Path, raw: bytes, m: SnapshotManifest, data: Path) -> SnapshotManifest | None:
    """Make a base mutable: read it verified (its tensors' checksums), write its per-row hashes,
    then swap its manifest for one naming them (``applied``: its own commit).

    Args:
        tier: the node's snapshot tier (file mode, fold lock).
        mpath: the base's manifest.
        raw: the manifest's bytes as read (the swap happens only if they are unchanged).
        m: the parsed manifest.
        data: the base's data file.

    Returns:
        The new manifest, or None when the manifest changed or vanished meanwhile.

    Raises:
        ChecksumMismatch: if the base is corrupt (it is never promoted).
        OSError: on storage errors.
    """
    from elastic_emb.state.shardfile import read_snapshot

    tables = read_snapshot(data, m)  # verified: a corrupt base never gets fresh hashes
    name = hashes_file(m.data_file)
    hpath = mpath.with_name(name)
    write_hashes(hpath, torch.cat([row_hashes(tables[rec.table]) for rec in m.shards]), tier.file_mode)
    new = m.model_copy(update=dict(row_hashes=name, applied=m.commit, applying=None))
    return new if _swap(tier, mpath, raw, new) else None


def _swap(tier, mpath: Path, raw: bytes, new: SnapshotManifest) -> bytes | None:
    """Replace a manifest by atomic rename if it still holds ``raw``; its new bytes, or None."""
    text = SnapshotManifest.model_validate(new.model_dump()).model_dump_json()
    with tier.fold_lock:  # prune deletes no directory meanwhile
        try:
            if mpath.read_bytes() != raw:
                return None
        except FileNotFoundError:
            return None
        write_atomic(mpath, text, tier.file_mode)
    return text.encode()


def apply_chain(
    tier,
    chain: list[tuple[Path, SnapshotManifest]],
    cancelled=lambda: False,
    maps=None,
    writing=None,
    buffer: ReadBuffer | None = None,
) -> int:
    """Write the deltas of a chain into its base in place and advance the base's mark.

    Args:
        tier: the node's snapshot tier.
        chain: ``(path, manifest)`` from the base (as :func:`present` shows it) to the newest delta
            to apply (``resolve_chains``).
        cancelled: checked between deltas; when it turns true the apply stops, leaving the manifest
            at ``applying`` (restore replays those deltas).
        maps: a dict the caller keeps across calls: the base's mappings stay open in it (mapping a
            large file afresh would fault every page in again at each apply); None: mapped here
            and closed after.
        writing: a lock held while the base is written (from the ``applying`` mark to the
            ``applied`` one): :meth:`Applier.cancel` takes it, so no byte is written into a base
            once a cancel returned (a restore may read it next).
        buffer: the memory each delta is read into (an applier keeps one); None: fresh memory.

    Returns:
        The deltas written.

    Raises:
        ChecksumMismatch: if the base or a delta is corrupt.
        OSError: on storage errors.
    """
    (data, shown), deltas = chain[0], chain[1:]
    if not deltas or shown.data_bytes == 0:
        return 0
    mpath = data.parent / manifest_name(shown)
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        return 0
    m = SnapshotManifest.model_validate_json(raw)
    if m.parent is not None or m.data_file != data.name or mark_of(m) != shown.commit:
        return 0  # replaced or moved on meanwhile
    if not aligned(m.shards):
        log.warning("apply_unsupported", base=str(data), reason="tensors start unaligned: the chain stays as it is")
        return 0
    if m.row_hashes is None:
        m = promote(tier, mpath, raw, m, data)
        if m is None:
            return 0
        raw = SnapshotManifest.model_validate(m.model_dump()).model_dump_json().encode()
        points.reached("apply_promoted", deltas[-1][1].step)
    target = deltas[-1][1].commit
    with writing if writing is not None else contextlib.nullcontext():
        if cancelled():  # (checked under the lock: a cancel that returned is seen here)
            return 0
        return _write_deltas(tier, data, mpath, raw, m, deltas, target, cancelled, maps, buffer)


def _write_deltas(tier, data, mpath, raw, m, deltas, target, cancelled, maps, buffer) -> int:
    """The writing part of :func:`apply_chain`: the ``applying`` mark, the rows, the ``applied`` mark."""
    raw = _swap(tier, mpath, raw, m.model_copy(update=dict(applying=target)))
    if raw is None:
        return 0
    rows = sum(rec.stop - rec.start for rec in m.shards)
    own = maps is None
    maps = {} if own else maps
    base, hashes = _mapped(maps, data, m.data_bytes), _mapped(maps, data.with_name(m.row_hashes), rows * 8, torch.int64)
    done = 0
    try:
        views = base_views(base.tensor, m.shards)
        starts, at = {}, 0
        for rec in m.shards:
            starts[rec.table] = at
            at += rec.stop - rec.start
        for path, dm in deltas:
            if cancelled():
                return done
            d = read_delta(path, dm, buffer)  # verified before a byte of it is written
            for table, tensors in d.items():
                dst = views[table]
                n = next(iter(dst.values())).shape[0]
                idx = tensors[INDEX].reshape(-1)
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) > n):
                    raise ValueError(f"{path}: delta of table {table!r} names rows outside its base")
                keep = idx < n  # a GPU capture's skipped entries name row n
                if not bool(keep.all()):
                    idx, tensors = idx[keep], {k: v[keep] for k, v in tensors.items() if k != INDEX}
                if not idx.numel():
                    continue
                for tname, v in dst.items():
                    v.index_copy_(0, idx, tensors[tname])
                points.reached("apply_half", dm.step)
                # The hashes of the rows as written: the delta's own bytes (a row listed twice by a
                # GPU capture carries the same bytes both times).
                hashes.tensor[starts[table] + idx] = row_hashes({t: tensors[t] for t in dst}, idx)
            done += 1
        base.sync()
        hashes.sync()
        points.reached("apply_before_mark", target.step)
        if _swap(tier, mpath, raw, m.model_copy(update=dict(applied=target, applying=None))) is not None:
            points.reached("apply_mark_advanced", target.step)
        return done
    finally:
        views = None
        if own:
            close_maps(maps)


def _mapped(maps: dict, path: Path, size: int, dtype=torch.uint8) -> MappedFile:
    """``path`` mapped shared and writable, from ``maps`` while it still maps that very file."""
    got = maps.get(path)
    if got is not None:
        try:
            if (os.stat(path).st_ino, size) == got.ident:
                return got
        except FileNotFoundError:
            pass
        maps.pop(path).close()
    maps[path] = MappedFile(path, size, dtype)
    return maps[path]


def close_maps(maps: dict, keep=()) -> None:
    """Close mappings.

    Args:
        maps: path -> mapping (:func:`apply_chain`'s cache); the closed ones are removed.
        keep: the paths whose mappings stay open.
    """
    for path in [p for p in maps if p not in keep]:
        maps.pop(path).close()
