"""Compaction in the background: a holder folds a delta chain into a base from its own files.

Without it, a chain of host-captured deltas would end in a new full base captured from the
context: the training thread copies the whole shard, and the writer writes it, sends it to the
replica holders and writes it there, while the next commit waits for all of that. Every holder
already has what a new base needs: the previous base and the deltas since, in its own node
directory. So, after the writer completed a delta commit at a *fold point*, each rank hands the
manifests it wrote for that commit (its own shard's, and the replicas it holds) to its
:class:`Compactor`, whose thread, for each:

1. reads the chain back verified (:func:`~elastic_emb.state.delta.read_chain`: every CRC of the
   base and of every delta is checked, so a corrupt file is never folded into a fresh checksum);
2. writes the materialized shard (the base's copy-on-write mapping with the deltas applied),
   tensor by tensor, as a new data file next to the delta's (``*.base.bin``), and fsyncs it; its
   checksums are XXH3-64 (:mod:`.digest`: several times faster than CRC32, and the next fold
   verifies this base again);
3. replaces the delta's manifest, by atomic rename, with one that names the new file and no
   parent: from then on the commit is a base, and prune frees the old base and the deltas
   before it (:meth:`SnapshotTier.prune`);
4. removes the delta's own data file (a base needs nothing else).

When: a fold costs a pass over the whole shard, so fold points are spaced by what a restore
would read of the deltas, not by their count alone (:class:`FoldWindow`): a commit is a fold point
once some rank's deltas since the last one, their bytes plus :data:`DELTA_FILE_COST` per file,
reach ``fold_ratio`` (0.25) of its shard's bytes, or after ``fold_max_deltas`` (32) deltas, and
never sooner than ``max_chain`` (8) deltas after the last (a fold is a pass over the shard like a
captured base: never more often than the bases it replaces). The fold's share of every step then
grows with the rows a step writes, not with the table, and a restore reads at most about
``2 * fold_ratio`` of a shard's worth in deltas on top of its base (the chain since the older base
while a fold runs): at most about 1.5 times a restore of the base alone, unless the ``max_chain``
spacing holds the fold back (small shards with large deltas).

Nothing crosses the network, nothing is collective and the training thread does not take part:
the next commits are deltas on the same parent as before, whatever their holders' compactors
are doing. A kill at any point leaves a restorable commit: before step 3 the delta and its chain
are intact (the partial ``*.base.bin`` is an orphan the commit directory's prune removes), after
it the base is complete (a leftover delta file is an orphan too). Holders fold at their own pace,
so one node may hold a commit as a base while another holds it as a delta: both are complete,
and prune keeps a chain while any node still lists it.

Bound: a fold starts only once the previous one ended (the writer waits for it at the next fold
point, bounded), so a holder keeps at most two bases of a shard (the older one until the prune at
the next fold point) and the deltas of two windows. A fold that fails (storage full, a corrupt
link) is logged and changes nothing: the chain stays as it was, and the next fold point folds the
longer chain. Deltas captured on the GPU into log segments are not folded: on that path a base
is still captured every ``max_chain + 1`` commits.
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
from elastic_emb.state.manifest import (ShardRecord, SnapshotManifest, TensorRecord, as_bytes, row_spec, tensor_items,
                                        write_atomic)
from elastic_emb.state.paths import check_name, open_new
from elastic_emb.state.shardfile import read_snapshot

log = get_logger("elastic_emb.state")

BASE_SUFFIX = ".base.bin"  # the data file a fold writes: rank<r>[.replica].base.bin
FOLD_CHECKSUM = "xxh3_64"  # the algorithm of a folded base's checksums (digest.py)
# What reading one delta file costs a restore beyond its bytes, as bytes of a base (mapping,
# manifest, checksum set-up, applying the rows): measured on the 2-core CPU machine with two ranks,
# chains of 0.53 MB deltas restored in about 2 ms more per delta than their base alone, where the
# base read about 1 GB/s (bench/commit.py --phases restore).
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
        return cls(list(sizes), [0] * len(sizes))

    def add(self, sizes: list[int]) -> None:
        self.delta_bytes = [a + b for a, b in zip(self.delta_bytes, sizes)]
        self.deltas += 1

    def due(self, ratio: float, max_deltas: int, min_deltas: int = 1) -> bool:
        """A fold point: ``max_deltas`` deltas, or, for some rank, what a restore reads of its
        deltas (their bytes, and :data:`DELTA_FILE_COST` for each file) reaches ``ratio`` of its
        base, but never before ``min_deltas`` deltas."""
        opened = self.deltas * DELTA_FILE_COST
        return self.deltas >= max_deltas or (self.deltas >= min_deltas and any(
            b > 0 and d + opened >= ratio * b for d, b in zip(self.delta_bytes, self.base_bytes)))

    def restart(self) -> None:
        self.delta_bytes, self.deltas = [0] * len(self.base_bytes), 0


def _cancelled(path: Path) -> _FoldCancelled:
    return _FoldCancelled(f"fold of {path} cancelled (a resize or the exit): the delta stays as it was")


def fold(tier, manifest_path: Path, cancelled=lambda: False, chains=None) -> int | None:
    """Fold the delta commit whose manifest is ``manifest_path`` (in ``tier``'s node directory)
    into a base, in place (module docstring). Returns the bytes of the new data file, or None
    when there is nothing to fold (already a base, or gone: pruned meanwhile). Raises on a chain
    that cannot be read (a gap, a checksum mismatch) and on storage errors, leaving the delta as it
    was; :class:`_FoldCancelled` when ``cancelled()`` turned true before the manifest swap.
    ``chains``: the node directory's resolved chains (``resolve_chains(...)[0]``), when the caller
    folds several manifests of one commit (listed once)."""
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        return None
    m = SnapshotManifest.model_validate_json(raw)
    if m.parent is None or m.segment is not None:
        return None  # a base already, or a GPU delta in a log segment (not folded: module docstring)
    check_name(m.data_file, "data file")  # (read back from the directory: it names the file removed last)
    key = (m.source_rank, m.replica, m.commit)
    if chains is None:
        chains = resolve_chains(tier.manifests())[0]
    chain = next((c for c in chains.values() if (c[-1][1].source_rank, c[-1][1].replica, c[-1][1].commit) == key),
                 None)
    if chain is None:
        raise FileNotFoundError(f"{manifest_path}: the chain of {m.commit} is not complete in {tier.node_dir} "
                                f"(a link is missing or was pruned); nothing folded")
    tables = read_chain(chain, read_snapshot)  # verified, link by link
    if cancelled():
        raise _cancelled(manifest_path)
    records, parts, off = [], [], 0
    for rec in m.shards:  # the delta's table order: every table of the shard, as in a base
        got = tables[rec.table]
        shard = ShardData(rec.table, RowRange(rec.start, rec.stop), got["weight"],
                          {k: v for k, v in got.items() if k not in ("weight", INDEX)})
        trs = []
        for tname, t in tensor_items(shard):  # a base's order: weight, then the slots by name
            b = as_bytes(t.contiguous())
            spec = row_spec(t)
            trs.append(TensorRecord(name=tname, dtype=spec[0], row_shape=spec[1], offset=off, nbytes=int(b.numel()),
                                    crc32=-1))
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
    folded = m.model_copy(update=dict(parent=None, folded_from=m.parent, data_file=data_name, data_bytes=off,
                                      shards=records, segment=None, segment_offset=0, written_at=time.time()))
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
        write_atomic(manifest_path, SnapshotManifest.model_validate(folded.model_dump()).model_dump_json(),
                     tier.file_mode)
        points.reached("fold_manifest_swapped", m.step)
        if old_data != path:
            old_data.unlink(missing_ok=True)
    return off


class Compactor:
    """Folds the delta commits it is given in a thread of its own, one at a time (module docstring)."""

    def __init__(self, tier, timeout: float) -> None:
        self.tier = tier
        self.timeout = timeout
        self.folded = 0  # commits folded (all of one request's manifests)
        self._cv = threading.Condition()
        self._busy = False
        self._epoch = 0  # cancel() moves it on: a fold started in an older epoch is cancelled for good
        self._thread: threading.Thread | None = None

    def request(self, step: int, manifests: list[Path]) -> bool:
        """Fold these manifests of the commit of ``step`` (written by this rank: its own and the
        replicas it holds) once the fold under way ended (waiting at most ``timeout``: then this
        fold point is skipped, and the next one folds the longer chain). Whether it was queued."""
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            if self._busy:
                log.warning("fold_skipped", step=step, waited_s=self.timeout,
                            reason="the previous fold is still running")
                return False
            self._busy = True
            self._thread = threading.Thread(target=self._run, args=(step, list(manifests), self._epoch),
                                            name="elastic_emb-compactor", daemon=True)
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
                log.info("fold_complete", step=step, manifests=done, bytes=written,
                         seconds=round(time.perf_counter() - t0, 6))
        except _FoldCancelled:
            log.info("fold_cancelled", step=step, reason="stopped (a resize or the exit)")
        except Exception as exc:  # the chain stays as it was: restorable, only longer
            log.warning("fold_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:400],
                        remedy="nothing lost: the next fold point folds the longer chain")
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default the compactor's) for the fold under way; whether none is."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cv:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return not self._busy

    def cancel(self, timeout: float) -> bool:
        """Cancel the fold under way (it stops before its manifest swap, leaving the delta as it
        was) and wait for its thread, at most ``timeout``; whether none runs now. Later requests
        fold again (a resize cancels the fold of the old generation before it restores)."""
        with self._cv:
            self._epoch += 1
        ended = self.wait(timeout)
        if not ended:
            log.warning("fold_still_running", seconds=timeout, remedy="it ends at its next check; nothing is lost")
        return ended


def fold_targets(cdir: Path, rank: int, replicas_of: list[int]) -> list[Path]:
    """The manifests one rank wrote for a commit: its own shard's, then the replicas it holds."""
    return [cdir / f"rank{rank}.json"] + [cdir / f"rank{r}.replica.json" for r in replicas_of]

