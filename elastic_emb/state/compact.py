"""Compaction in the background: a holder folds a delta chain into a base from its own files.

After the writer completed a delta commit at a fold point (:class:`FoldWindow` says when), each
rank hands the manifests it wrote for it to its :class:`Compactor`, whose thread folds each
(:func:`fold`): the chain is read back verified and written as a new base file, and the delta's
manifest is replaced by atomic rename with one naming that base. Nothing is collective or crosses
the network, and a kill at any point leaves a restorable commit. Log segment deltas are not folded.

Design: ``docs/COMMIT.md`` (section "Folding").
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_emb.errors import _FoldCancelled
from elastic_emb.events import get_logger
from elastic_emb.native_calls import exiting, native_call
from elastic_emb.protocol import ShardData
from elastic_emb.sharding import RowRange
from elastic_emb.state import points
from elastic_emb.state.capture import finished_records
from elastic_emb.state.delta import INDEX, read_chain, resolve_chains
from elastic_emb.state.digest import digest_ranges
from elastic_emb.state.manifest import (
    ShardRecord,
    SnapshotManifest,
    TensorRecord,
    as_bytes,
    row_spec,
    tensor_items,
    write_atomic,
)
from elastic_emb.state.paths import check_name, open_new
from elastic_emb.state.shardfile import read_snapshot

log = get_logger("elastic_emb.state")

BASE_SUFFIX = ".base.bin"  # the data file a fold writes: rank<r>[.replica].base.bin
FOLD_CHECKSUM = "xxh3_64"  # the algorithm of a folded base's checksums (digest.py)
# What reading one delta file costs a restore beyond its bytes, as bytes of a base (mapping,
# manifest, checksum set-up, applying the rows); estimated from restores of long chains on the CPU
# (BENCHMARKS.md).
DELTA_FILE_COST = 2 << 20


@dataclass
class FoldWindow:
    """The deltas since the last base or fold point, per source rank, from the sizes every rank
    exchanged at each commit: the same on every rank, so every rank picks the same fold points
    (the prune at a fold point is collective)."""

    base_bytes: list[int]  # each rank's base (its whole shard)
    delta_bytes: list[int]  # each rank's deltas since
    deltas: int = 0

    @classmethod
    def after_base(cls, sizes: list[int]) -> "FoldWindow":
        """The window that starts at a base.

        Args:
            sizes: each rank's base bytes (its whole shard), in rank order.

        Returns:
            An empty window over those bases.
        """
        return cls(list(sizes), [0] * len(sizes))

    def add(self, sizes: list[int]) -> None:
        """Count one more delta commit.

        Args:
            sizes: each rank's delta bytes, in rank order.
        """
        self.delta_bytes = [a + b for a, b in zip(self.delta_bytes, sizes)]
        self.deltas += 1

    def due(self, ratio: float, max_deltas: int, min_deltas: int = 1) -> bool:
        """Whether the newest commit is a fold point.

        Args:
            ratio: the share of a rank's base that what a restore reads of its deltas (their bytes,
                and :data:`DELTA_FILE_COST` for each file) must reach.
            max_deltas: a fold point after this many deltas, whatever their size.
            min_deltas: never a fold point before this many deltas.

        Returns:
            True after ``max_deltas`` deltas, or once some rank's deltas reach ``ratio`` of its base
            and at least ``min_deltas`` deltas were counted.
        """
        opened = self.deltas * DELTA_FILE_COST
        return self.deltas >= max_deltas or (
            self.deltas >= min_deltas
            and any(b > 0 and d + opened >= ratio * b for d, b in zip(self.delta_bytes, self.base_bytes))
        )

    def restart(self) -> None:
        """Start a new window at a fold point (the bases stay as they are)."""
        self.delta_bytes, self.deltas = [0] * len(self.base_bytes), 0


def _cancelled(path: Path) -> _FoldCancelled:
    return _FoldCancelled(f"fold of {path} cancelled (a resize or the exit): the delta stays as it was")


def fold(tier, manifest_path: Path, cancelled=lambda: False, chains=None) -> int | None:
    """Fold one delta commit of a node directory into a base, in place.

    The chain is read back verified, written as ``*.base.bin`` next to the delta and fsynced, the
    manifest is swapped by atomic rename (under the tier's fold lock, and only if it is unchanged),
    and the delta's data file is removed. Every error leaves the delta as it was.

    Args:
        tier: the node's :class:`~elastic_emb.state.snapshot.SnapshotTier`.
        manifest_path: the delta's manifest in the tier's node directory.
        cancelled: checked before the write and again before the swap.
        chains: the node directory's resolved chains (``resolve_chains(...)[0]``), when the caller
            folds several manifests of one commit (listed once); None: resolved here.

    Returns:
        The bytes of the new data file, or None when there is nothing to fold (already a base, a
        delta in a log segment, or gone or replaced meanwhile).

    Raises:
        FileNotFoundError: if the delta's chain is not complete in the node directory.
        ChecksumMismatch: if a link of the chain is corrupt.
        ValueError: if the manifest names an unsafe data file or a delta names rows outside its shard.
        OSError: on storage errors.
        _FoldCancelled: if ``cancelled()`` turned true before the manifest swap.
    """
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        return None
    m = SnapshotManifest.model_validate_json(raw)
    if m.parent is None or m.segment is not None:
        return None  # a base already, or a GPU delta in a log segment (reused: never folded)
    check_name(m.data_file, "data file")  # (read back from the directory: it names the file removed last)
    key = (m.source_rank, m.replica, m.commit)
    if chains is None:
        chains = resolve_chains(tier.manifests())[0]
    chain = next((c for c in chains.values() if (c[-1][1].source_rank, c[-1][1].replica, c[-1][1].commit) == key), None)
    if chain is None:
        raise FileNotFoundError(
            f"{manifest_path}: the chain of {m.commit} is not complete in {tier.node_dir} "
            f"(a link is missing or was pruned); nothing folded"
        )
    tables = read_chain(chain, read_snapshot)  # verified, link by link
    if cancelled():
        raise _cancelled(manifest_path)
    records, parts, off = [], [], 0
    for rec in m.shards:  # the delta's table order: every table of the shard, as in a base
        got = tables[rec.table]
        shard = ShardData(
            rec.table,
            RowRange(rec.start, rec.stop),
            got["weight"],
            {k: v for k, v in got.items() if k not in ("weight", INDEX)},
        )
        trs = []
        for tname, t in tensor_items(shard):  # a base's order: weight, then the slots by name
            b = as_bytes(t.contiguous())
            spec = row_spec(t)
            trs.append(
                TensorRecord(name=tname, dtype=spec[0], row_shape=spec[1], offset=off, nbytes=int(b.numel()), crc32=-1)
            )
            parts.append(b)
            off += int(b.numel())
        records.append(ShardRecord(table=rec.table, num_rows=rec.num_rows, start=rec.start, stop=rec.stop, tensors=trs))
    data_name = manifest_path.name[: -len(".json")] + BASE_SUFFIX
    path = manifest_path.with_name(data_name)
    path.unlink(missing_ok=True)  # an orphan of a fold killed before its manifest swap
    # Tensor by tensor, from the chain's mapping into the file: no copy of the whole shard in memory.
    with open_new(path, tier.file_mode) as f:
        for b in parts:
            f.write(memoryview(b.numpy()))
        f.flush()
        os.fsync(f.fileno())
    # XXH3-64 (digest.py), not CRC32: several times faster on the same threads, and every later
    # fold verifies this base before it folds it again; a restore checks whichever a record names.
    digests = [digest_ranges(b.numpy(), [(0, int(b.numel()))], FOLD_CHECKSUM)[0] for b in parts]
    records = finished_records(records, None, digests, algorithm=FOLD_CHECKSUM)
    points.reached("fold_data_written", m.step)
    folded = m.model_copy(
        update=dict(
            parent=None,
            folded_from=m.parent,
            data_file=data_name,
            data_bytes=off,
            shards=records,
            segment=None,
            segment_offset=0,
            written_at=time.time(),
        )
    )
    old_data = manifest_path.with_name(m.data_file)
    with tier.fold_lock:  # prune deletes no directory meanwhile
        if cancelled():
            path.unlink(missing_ok=True)
            raise _cancelled(manifest_path)
        try:
            unchanged = manifest_path.read_bytes() == raw  # else replaced or pruned meanwhile: leave it be
        except FileNotFoundError:
            unchanged = False
        if not unchanged:
            path.unlink(missing_ok=True)
            return None
        write_atomic(
            manifest_path, SnapshotManifest.model_validate(folded.model_dump()).model_dump_json(), tier.file_mode
        )
        points.reached("fold_manifest_swapped", m.step)
        if old_data != path:
            old_data.unlink(missing_ok=True)
    return off


class Compactor:
    """Folds the delta commits it is given in a thread of its own, one at a time.

    A fold that fails is logged and changes nothing (the next fold point folds the longer chain).

    Args:
        tier: the node's :class:`~elastic_emb.state.snapshot.SnapshotTier`.
        timeout: how long :meth:`request` and :meth:`wait` wait for the fold under way.
    """

    def __init__(self, tier, timeout: float) -> None:
        self.tier = tier
        self.timeout = timeout
        self.folded = 0  # commits folded (all of one request's manifests)
        self._cv = threading.Condition()
        self._busy = False
        self._epoch = 0  # cancel() moves it on: a fold started in an older epoch is cancelled for good
        self._thread: threading.Thread | None = None

    def request(self, step: int, manifests: list[Path]) -> bool:
        """Start folding a commit's manifests once the fold under way ended.

        Args:
            step: the commit's step (for events).
            manifests: the manifests this rank wrote for it: its own and the replicas it holds.

        Returns:
            Whether the fold started; False when the previous fold still ran after ``timeout``
            (this fold point is skipped, and the next one folds the longer chain).
        """
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            if self._busy:
                log.warning(
                    "fold_skipped", step=step, waited_s=self.timeout, reason="the previous fold is still running"
                )
                return False
            self._busy = True
            self._thread = threading.Thread(
                target=self._run, args=(step, list(manifests), self._epoch), name="elastic_emb-compactor", daemon=True
            )
            self._thread.start()
        return True

    def _run(self, step: int, manifests: list[Path], epoch: int) -> None:
        t0, written, done = time.perf_counter(), 0, 0

        def cancelled() -> bool:
            return self._epoch != epoch or exiting()

        try:
            with native_call():  # tensor ops and file writes: the exit waits for them (or cancels)
                chains = resolve_chains(self.tier.manifests())[0]  # once for the commit's manifests
                for mpath in manifests:
                    if cancelled():
                        raise _cancelled(mpath)
                    got = fold(self.tier, mpath, cancelled, chains)
                    if got is not None:
                        written, done = written + got, done + 1
            if done:
                self.folded += 1
                log.info(
                    "fold_complete",
                    step=step,
                    manifests=done,
                    bytes=written,
                    seconds=round(time.perf_counter() - t0, 6),
                )
        except _FoldCancelled:
            log.info("fold_cancelled", step=step, reason="stopped (a resize or the exit)")
        except Exception as exc:  # the chain stays as it was: restorable, only longer
            log.warning(
                "fold_failed",
                step=step,
                error=f"{type(exc).__name__}: {exc}"[:400],
                remedy="nothing lost: the next fold point folds the longer chain",
            )
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fold under way.

        Args:
            timeout: the most seconds to wait; None: the compactor's timeout.

        Returns:
            Whether no fold runs now.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cv:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return not self._busy

    def cancel(self, timeout: float) -> bool:
        """Cancel the fold under way and wait for its thread.

        The fold stops before its manifest swap, leaving the delta as it was. Later requests fold
        again (a resize cancels the fold of the old generation before it restores).

        Args:
            timeout: the most seconds to wait for the thread.

        Returns:
            Whether no fold runs now.
        """
        with self._cv:
            self._epoch += 1
        ended = self.wait(timeout)
        if not ended:
            log.warning("fold_still_running", seconds=timeout, remedy="it ends at its next check; nothing is lost")
        return ended


def fold_targets(cdir: Path, rank: int, replicas_of: list[int]) -> list[Path]:
    """The manifests one rank wrote for a commit: its own shard's, then the replicas it holds.

    Args:
        cdir: the commit directory.
        rank: the rank.
        replicas_of: the ranks whose replicas it holds.

    Returns:
        The manifest paths.
    """
    return [cdir / f"rank{rank}.json"] + [cdir / f"rank{r}.replica.json" for r in replicas_of]
