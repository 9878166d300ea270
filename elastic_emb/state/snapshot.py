"""The snapshot tier: each rank's shard in a node-local directory, with replicas on other nodes.

:class:`SnapshotTier` captures a commit (:meth:`~SnapshotTier.capture`: a whole shard or a delta,
on the host or the GPU) and writes it collectively (:meth:`~SnapshotTier.write`): data files first,
replicas on the next ``replication`` nodes, manifests last by atomic rename, so a commit cut short
by a crash does not exist for restore. :meth:`~SnapshotTier.prune` deletes what no kept commit
needs and hands fold points to the compactor.

Design: ``docs/COMMIT.md`` (section "The snapshot tier").
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from elastic_emb.errors import StorageError
from elastic_emb.events import get_logger
from elastic_emb.protocol import ShardData
from elastic_emb.state import app as app_state
from elastic_emb.state import points
from elastic_emb.state.applier import Applier
from elastic_emb.state.capture import DELTA_CHECKSUM, finished_records, record_ranges
from elastic_emb.state.comm import Comm
from elastic_emb.state.compact import Compactor, FoldWindow, fold_targets
from elastic_emb.state.crc import crc32_of, write_and_checksum
from elastic_emb.state.delta import pack_delta
from elastic_emb.state.inplace import present
from elastic_emb.state.manifest import (
    CommitId,
    ShardRecord,
    SnapshotManifest,
    commit_dirname,
    step_of_dirname,
    write_atomic,
)
from elastic_emb.state.paths import DIR_MODE, FILE_MODE, check_name, make_dirs, open_new, under
from elastic_emb.state.plan import replica_holders, uncovered
from elastic_emb.state.ring import (
    LOG_DIR,
    Segment,
    SegmentRing,
    newest_per_segment,
    on_memory_fs,
    segment_path,
    sweep_segments,
)
from elastic_emb.state.rowhash import aligned, base_hashes, hashes_file, write_hashes
from elastic_emb.state.shardfile import pack_shard, write_blob
from elastic_emb.state.spares import SpareFiles, remove_dead_spares

log = get_logger("elastic_emb.state")


RUN_MARKER = "run.json"

# With folding (compact.py), a chain of host-captured deltas still ends in a captured base after
# this many deltas: a bound the same on every rank, so that a node whose folds keep failing does
# not keep a chain forever.
FOLD_CHAIN_LIMIT = 1024
# Applying in place (inplace.py), a chain has no length bound of its own (only its deltas after the
# base's mark are read by a restore); this one only keeps a chain whose applier keeps failing
# from growing without end.
APPLY_CHAIN_LIMIT = 1 << 20
# Applying in place, the full prune (which deletes the deltas written into their bases) runs every
# this many deltas; the prunes between are skipped on every rank alike.
APPLY_PRUNE_EVERY = 4
# Applying in place, the most commits the applier may be behind before the writer waits for it.
APPLY_BACKLOG = 4


class RunMarker(BaseModel):
    """Written into a node directory with the run's first commit there: from then on, finding no
    complete commit is an error (:func:`elastic_emb.state.restore.restore`), not a fresh start."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    run_id: str
    node_id: str
    first_step: int = Field(ge=0)
    generation: int = Field(ge=0)
    written_at: float


class NodeListing(BaseModel):
    """What one node directory holds: the commit directories (torn ones included), whether the
    run marker is there, the valid manifests' pieces (``[commit, table, start, stop, num_rows]``)
    and the links of delta commits to their parents. Exchanged between ranks so that every rank
    judges completeness the same way."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    node: str
    marker: bool
    dirs: list[str]
    pieces: list[tuple[CommitId, str, int, int, int]]
    parents: list[tuple[CommitId, CommitId]] = []  # (delta commit, the commit it changes)


# Commits after the newest complete one that a rank may have written: at most the background
# writer's depth (COMMIT_DEPTH of GPU captures, one of host captures) are in flight, and a failed
# commit removes its own files. The app state of this many commits beyond ``keep`` stays on disk.
APP_SLACK = 3


@dataclass(frozen=True)
class Capture:
    """A commit copied out of the context, ready to be written (:meth:`SnapshotTier.write`)."""

    step: int
    topology: object  # elastic_emb.topology.Topology of the generation that took it
    records: list[ShardRecord]
    blob: torch.Tensor  # this rank's shard (a base) or its changed rows (a delta), packed
    parent: CommitId | None  # the commit a delta changes; None: a base
    chain_length: int  # deltas since the base, this one included
    # A capture on the GPU (elastic_emb.state.capture): ``blob`` is complete once ``copied`` (a
    # CUDA event) has passed, its checksums are computed by the writer, and ``buffer`` goes back to
    # ``device`` after the write.
    copied: object = None
    device: object = None
    buffer: object = None
    speculative: bool = False  # the capture advanced the tier's chain itself (the write does not)
    fold: bool = False  # folding was on when it was captured (compact.py): it may be a fold point
    app: dict | None = None  # the job's app state of this step (state/app.py capture), written beside the shard
    rank_state: dict | None = None  # this rank's own state of this step (state/app.py capture)

    def release(self) -> None:
        """The buffer of a GPU capture is no longer needed (written, or dropped): a log segment is
        freed unless its manifest was written, a pinned buffer goes back to its pool."""
        if isinstance(self.buffer, Segment):
            self.buffer.release()  # a log segment: free again unless its manifest was written
        elif self.device is not None:
            self.device.release(self.buffer)


class SnapshotTier:
    """Node-local snapshots with replicas on other nodes.

    Args:
        root: the state directory; this node's commits go under ``<root>/<run_id>/<node_id>/``.
        run_id: the run (a plain name).
        node_id: this node's stable id (a plain name).
        replication: how many other nodes hold a replica of each shard (0: none).
        keep: how many complete commits prune keeps (with their chains).
        file_mode: the permissions of the files written.
        dir_mode: the permissions of the directories created.
        max_chain: the most deltas on a base before the next commit is a base (0: every commit is).
            With folding on (``max_chain > 0``, host captures) it is the least spacing of fold points.
        fold_ratio: a fold point once some rank's deltas reach this share of its shard's bytes.
        fold_max_deltas: a fold point after this many deltas anyway.
        fold_timeout: how long a fold point waits for the previous fold.
        apply: write the deltas into their chain's base in place, in the background
            (:mod:`elastic_emb.state.inplace`): every commit after a chain's base is a delta, on the
            host and the GPU path alike, and no fold runs. False: fold (host) or re-base (GPU).

    Raises:
        ValueError: if a parameter is out of range or an id is not a plain name.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        run_id: str,
        node_id: str,
        *,
        replication: int = 1,
        keep: int = 2,
        file_mode: int = FILE_MODE,
        dir_mode: int = DIR_MODE,
        max_chain: int = 8,
        fold_ratio: float = 0.25,
        fold_max_deltas: int = 32,
        fold_timeout: float = 300.0,
        apply: bool = False,
    ) -> None:
        if replication < 0:
            raise ValueError(f"replication={replication} must be >= 0 (0: no replicas)")
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 commits")
        self.root = Path(root)
        self.run_id = check_name(run_id, "run id")
        self.node_id = check_name(node_id, "node id")
        self.replication = replication
        self.keep = keep
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        if max_chain < 0:
            raise ValueError(f"max_chain={max_chain} must be >= 0 (0: every commit is a full base)")
        self.max_chain = max_chain
        # (fingerprint, last complete commit of this tier in that generation, deltas since its base)
        self._chain: tuple[str, CommitId, int] | None = None
        self.lineage: str | None = None  # the run's history, recorded in every manifest (set after a restore)
        self.spares: SpareFiles | None = None  # files allocated ahead for GPU captures
        self.ring: SegmentRing | None = None  # log segments the GPU copies deltas into
        self._ring_count = 0  # enable_ring: the ring is made at the first GPU delta (sized by it)
        self._parsed: dict[bytes, SnapshotManifest] = {}  # manifests() parses each file's bytes once
        self._app_dirs: deque[Path] = deque()  # the commit directories this rank wrote app state into
        # What prune needs to know to skip itself (see _prune_frees_nothing): the newest commit this
        # tier wrote (its id, parent, deltas since its base), and the commit a prune last left as
        # the newest complete one with nothing else deletable (None: the next prune is a full one).
        self._written: tuple[CommitId, CommitId | None, int] | None = None
        self._pruned_at: CommitId | None = None
        # Compaction (compact.py): host-captured chains are folded into bases by their holders
        # instead of capturing a full base every max_chain + 1 commits. Off once commits are
        # captured on the GPU (their deltas live in log segments that are reused).
        if not fold_ratio > 0 or fold_max_deltas < 1:
            raise ValueError(f"fold_ratio={fold_ratio} must be > 0 and fold_max_deltas={fold_max_deltas} >= 1")
        self.fold = max_chain > 0
        self.fold_ratio, self.fold_max_deltas = fold_ratio, fold_max_deltas
        self._window: FoldWindow | None = None  # the deltas since the last base or fold point, per rank
        self.compactor = Compactor(self, fold_timeout)
        self.fold_lock = threading.Lock()  # a fold's manifest swap and prune's deletions, one at a time
        self._fold_due: tuple[int, list[Path]] | None = None  # the fold point just written: (step, its manifests)
        # Applying in place (inplace.py): the complete delta commits of the current chain not yet
        # handed to the applier. A commit goes to it once ``keep`` newer ones were written: by then
        # it is complete on every rank (each rank finished it before the next commit's exchange),
        # and the ``keep`` newest commits stay restorable (a base stands only for its mark on).
        self.apply = apply
        if apply:
            self.fold = False
        self.applier = Applier(self, fold_timeout)
        self._unapplied: deque[tuple[CommitId, list[tuple[int, bool]]]] = deque()

    def enable_spares(self, count: int) -> None:
        """Keep data files allocated ahead for GPU-captured commits, in a directory of this
        process's own (removing those of the node's processes that are gone).

        Args:
            count: how many files to keep ready (the first call decides; later calls do nothing).
        """
        if self.spares is None:
            remove_dead_spares(self.node_dir)
            self.spares = SpareFiles(self.node_dir / f".spare-{os.getpid()}", count, self.file_mode, self.dir_mode)

    def close_spares(self) -> None:
        """Remove the files allocated ahead and close the log ring (the commits in flight are
        written; the segments that manifests name stay for restore)."""
        if self.spares is not None:
            self.spares.close()
            self.spares = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def enable_ring(self, count: int, size: int | None = None) -> None:
        """Land GPU-captured deltas in a ring of log segments (:mod:`elastic_emb.state.ring`).

        Args:
            count: the number of segments.
            size: bytes per segment; None: the ring is made at the first GPU delta, with segments
                of 1.25 times its size.
        """
        self._ring_count = count
        if size is not None and self.ring is None:
            self.ring = self._make_ring(size)

    def _make_ring(self, size: int) -> SegmentRing | None:
        """The log ring, or None (then deltas take the pinned-buffer path, and no ring is tried
        again): the state dir is not in memory (its pages cannot stay registered), or
        registering failed (e.g. the locked-memory limit)."""
        d = self.node_dir / LOG_DIR
        try:
            make_dirs(self.root, d, self.dir_mode)
            if not on_memory_fs(d):
                raise RuntimeError(f"{d} is not on tmpfs: only memory-backed pages can be registered with CUDA")
            return SegmentRing(d, self._ring_count, size, self.file_mode)
        except (OSError, RuntimeError) as exc:
            log.warning(
                "log_ring_unavailable",
                dir=str(d),
                segments=self._ring_count,
                segment_bytes=size,
                error=str(exc)[:300],
                remedy="deltas are copied into files instead; put "
                "ELASTIC_EMB_STATE_DIR on /dev/shm (and raise ulimit -l) for the ring",
            )
            self._ring_count = 0
            return None

    def _land(self, nbytes: int) -> Segment | None:
        if self.ring is None:
            self.ring = self._make_ring(nbytes + nbytes // 4)
        return self.ring.acquire(nbytes) if self.ring is not None else None

    @property
    def node_dir(self) -> Path:
        return under(self.root, self.run_id, self.node_id)

    # -- commit ---------------------------------------------------------------------------------

    def commit(
        self,
        step: int,
        shards: dict[str, ShardData],
        comm: Comm,
        num_rows: dict[str, int],
        changes: dict[str, torch.Tensor] | None = None,
        app: dict | None = None,
        rank_state: dict | None = None,
    ) -> tuple[int, int]:
        """Capture and write a commit now (:meth:`write` of :meth:`capture`); collective.

        Args:
            step: the commit's step.
            shards: table -> this rank's shard (the context's tensors).
            comm: the communicator of the world.
            num_rows: table -> rows in the table.
            changes: the context's ``take_changes()`` (the same choice on every rank): write a
                delta of those rows on the previous commit of this generation, unless the chain is
                at its bound or there is none yet (then a full base); None: a full base.
            app: the job's app state of this step (:func:`elastic_emb.state.app.capture`), written
                beside this rank's shard; None: none.
            rank_state: this rank's own state of this step (captured alike); None: none.

        Returns:
            ``(bytes written for this rank's own shard, bytes received as replicas)``.

        Raises:
            StorageError: on every rank, when any rank could not write its data (full or read-only
                storage); each rank then removes what it wrote of this commit, so the older commits
                stay the newest complete ones.
        """
        cap = self.capture(step, shards, comm.topology, num_rows, changes)
        if app is not None or rank_state is not None:
            cap = replace(cap, app=app, rank_state=rank_state)
        try:
            return self.write(cap, comm)
        except BaseException:
            if cap.speculative:
                self.break_chain()  # the next commit must not name a commit never written
            raise

    def capture(
        self,
        step: int,
        shards: dict[str, ShardData],
        topology,
        num_rows: dict[str, int],
        changes: dict[str, torch.Tensor] | None = None,
        device=None,
        hold=None,
    ) -> "Capture":
        """Copy what a commit writes into a buffer of its own (local, not collective).

        Once it returns, the context may change its rows while :meth:`write` runs (e.g. in a
        background writer). The capture is a delta on the previous commit of this generation when
        ``changes`` are given and the chain is below its bound, else a whole-shard base.

        Args:
            step: the commit's step.
            shards: table -> this rank's shard (the context's tensors).
            topology: the generation's topology.
            num_rows: table -> rows in the table.
            changes: the rows written since the last commit (see :meth:`commit`), or None.
            device: a :class:`~elastic_emb.state.capture.DeviceCapture`, with raw ``changes``
                (``take_changed_rows(unique=False)``) and ``hold``: the delta is gathered on the GPU
                and copied to host memory asynchronously, and the chain advances at once (after a
                failed write the caller calls :meth:`break_chain`).
            hold: the context's ``hold_writes``, for ``device``.

        Returns:
            The :class:`Capture`, ready for :meth:`write`.

        Raises:
            ValueError: if ``changes`` are malformed.
            TimeoutError: with ``device``, if no pinned buffer came free in time.
        """
        fp = topology.fingerprint()  # (a hash of the topology's JSON: once per call, it runs on the training thread)
        chain = self._chain if self._chain and self._chain[0] == fp else None
        if device is not None:
            parent, length = None, 0
            if (
                changes is not None
                and chain is not None
                and (self.apply or chain[2] < self.max_chain)
                and all(changes.get(name) is not None for name in shards)
            ):
                parent, length = chain[1], chain[2] + 1
                records, blob, copied, buf = device.capture(
                    shards, changes, num_rows, hold, land=self._land if self._ring_count else None
                )
                if self.spares is not None and not isinstance(buf, Segment):
                    self.spares.want(int(blob.numel()))
                cap = Capture(step, topology, records, blob, parent, length, copied, device, buf, True)
            else:  # a base: the whole shard, copied on the host (a chain's first commit; re-basing, every max_chain + 1)
                records, blob = self._pack_base(shards, num_rows)
                cap = Capture(step, topology, records, blob, None, 0, speculative=True)
            self._chain = (fp, CommitId(step, topology.generation, fp), length)
            return cap
        parent = None
        # Folding, the chain goes on (its holders fold it at the fold points); a hard bound, the
        # same on every rank, still ends one whose folds keep failing.
        limit = APPLY_CHAIN_LIMIT if self.apply else FOLD_CHAIN_LIMIT if self.fold else self.max_chain
        if changes is not None and chain is not None and chain[2] < limit:
            parent = chain[1]
            records, blob, _ = pack_delta(shards, changes, num_rows)
        else:
            records, blob = self._pack_base(shards, num_rows)
        length = 0 if parent is None else chain[2] + 1
        self._chain = None  # until this commit completes: a failed commit makes the next one a base
        return Capture(step, topology, records, blob, parent, length, fold=self.fold)

    def _pack_base(self, shards, num_rows):
        """A base packed on the training thread. Applying in place, its rows are checked by the
        per-row hashes the writer computes (no CRC32 here), unless a tensor starts unaligned (such
        a base is not written in place: it keeps its CRC32s)."""
        records, blob = pack_shard(shards, num_rows, checksums=not self.apply)
        if self.apply and not aligned(records):
            records = [
                r.model_copy(
                    update={
                        "tensors": [
                            t.model_copy(update={"crc32": crc32_of(blob[t.offset : t.offset + t.nbytes].numpy())})
                            for t in r.tensors
                        ]
                    }
                )
                for r in records
            ]
        return records, blob

    def break_chain(self) -> None:
        """A commit failed: make the next one a base (it must not name a parent never written)."""
        self._chain = None

    def rewind(self, base: CommitId) -> None:
        """Delete this node's commits after ``base`` and make the next delta extend ``base`` again
        (their log segments come free). For benchmarks that measure many delta commits on one
        base. Local, not collective; no commit may be in flight.

        Args:
            base: a full commit (no parent) of this tier, in this node's directory.

        Raises:
            ValueError: if this node holds no manifest of ``base`` as a full commit.
        """
        if not any(m.commit == base and m.parent is None for _, m in self.manifests()):
            raise ValueError(f"rewind: commit {base} is not a full commit in {self.node_dir}")
        for cdir in self.node_dir.glob("step-*"):
            if step_of_dirname(cdir.name) > base.step:
                shutil.rmtree(cdir, ignore_errors=True)
        self._chain = (base.fingerprint, base, 0)
        self._written = self._pruned_at = None

    def write(self, cap: "Capture", comm: Comm) -> tuple[int, int]:
        """Write a captured commit: data, replicas, manifests last (collective).

        Args:
            cap: the capture (its GPU copy, if any, is waited for here).
            comm: the communicator of the world (the writer's own in the background).

        Returns:
            ``(bytes written for this rank's own shard, bytes received as replicas)``.

        Raises:
            StorageError: on every rank, when any rank could not write its data or replicas, or
                when this rank could not write its manifests; what it wrote is removed.
            RuntimeError: if the ranks disagree on the parent commit.
        """
        topo, step, parent, records, blob = cap.topology, cap.step, cap.parent, cap.records, cap.blob
        cdir = self.node_dir / commit_dirname(step, topo.fingerprint())
        written: list[Path] = []
        data_name = f"rank{topo.rank}.bin"
        seg = cap.buffer if isinstance(cap.buffer, Segment) else None
        if cap.copied is not None:  # a GPU capture: wait here (not in the training thread) for its bytes
            if seg is not None:  # landing in its log segment: checksummed there, on several cores, piece by
                # piece as the copy lands (a capture without pieces: after the whole copy)
                landed = cap.copied.landed() if hasattr(cap.copied, "landed") else None
                if landed is None:
                    cap.copied.synchronize()
                records, error = (
                    finished_records(cap.records, seg.host.numpy(), algorithm=DELTA_CHECKSUM, landed=landed),
                    None,
                )
            else:
                cap.copied.synchronize()
                records, error = self._write_checksummed(cdir, data_name, cap, written)
        else:
            error = self._write(cdir, data_name, blob, written, step)
        hashed: dict[str, str] = {}  # data file -> its hash file (a base born mutable: inplace.py)
        if self.apply and parent is None and seg is None and error is None:
            error = self._write_hashes(cdir, data_name, blob, records, written, step, hashed)
        app_meta = {}
        if cap.app is not None and error is None:  # serialized here, off the training thread
            app_meta, error = self._write_app(cdir, cap.app, written, step)
        if cap.rank_state is not None and error is None:
            path = cdir / app_state.rank_state_file(topo.rank)
            try:
                make_dirs(self.root, cdir, self.dir_mode)
                written.append(path)
                size, crc = app_state.write_file(path, cap.rank_state, self.file_mode)
                app_meta.update(rank_state=True, rank_state_bytes=size, rank_state_crc=crc)
            except OSError as exc:
                error = storage_message(path, 0, exc, step)
        points.reached("snapshot_data_written", step)
        info = {
            "rank": topo.rank,
            "node_rank": topo.node_rank,
            "local_rank": topo.local_rank,
            "node": self.node_id,
            "bytes": int(blob.numel()),
            "error": error,
            "shards": [r.model_dump() for r in records],
        }
        info["parent"] = list(parent) if parent else None
        everyone = comm.exchange(f"snap{step}", info)
        if len({json.dumps(e["parent"]) for e in everyone}) != 1:  # cannot happen with one program on every rank
            raise RuntimeError(
                f"commit of step {step}: ranks disagree on the parent commit "
                f"{[e['parent'] for e in everyone]}; every rank must pass the same kind of changes"
            )
        self._abandon_if_failed(step, cdir, written, [e["error"] for e in everyone])
        # Replicas: who sends to whom follows from the gathered records alone.
        holders = {r["rank"]: replica_holders(everyone, r["rank"], self.replication) for r in everyone}
        send = [torch.empty(0, dtype=torch.uint8) for _ in range(comm.size)]
        for h in holders[topo.rank]:
            send[h] = blob
        senders = [r for r in range(comm.size) if topo.rank in holders[r]]
        recv_sizes = [everyone[r]["bytes"] if r in senders else 0 for r in range(comm.size)]
        points.reached("snapshot_replica_in_flight", step)
        got = comm.all_to_all(send, recv_sizes) if any(holders.values()) else [None] * comm.size
        replicated = 0
        for r in senders:
            rname = f"rank{r}.replica.bin"
            error = error or self._write(cdir, rname, got[r].cpu(), written, step)
            if self.apply and parent is None and error is None:
                recs = [ShardRecord(**x) for x in everyone[r]["shards"]]
                error = self._write_hashes(cdir, rname, got[r].cpu(), recs, written, step, hashed)
            replicated += everyone[r]["bytes"]
        # Data is written on this node; manifests go last (a crash before them leaves no commit).
        if any(holders.values()):  # ... and only once every node has its data
            self._abandon_if_failed(step, cdir, written, comm.exchange(f"snap{step}-replicas", error))
        points.reached("snapshot_before_manifest", step)
        base = dict(
            step=step,
            generation=topo.generation,
            fingerprint=topo.fingerprint(),
            run_id=topo.run_id,
            world_size=topo.world_size,
            ep_size=topo.ep_size,
            holder_node=self.node_id,
            parent=parent,
            lineage=self.lineage,
        )
        own = SnapshotManifest(
            **base,
            source_rank=topo.rank,
            source_node=self.node_id,
            replica=False,
            data_file=data_name,
            data_bytes=int(blob.numel()),
            shards=records,
            written_at=time.time(),
            segment=seg.name if seg is not None else None,
            **app_meta,
            **self._mutable(data_name, hashed, step, topo),
        )
        try:
            if seg is not None:
                make_dirs(self.root, cdir, self.dir_mode)
            self._write_text(cdir / f"rank{topo.rank}.json", own.model_dump_json(), written)
            if seg is not None:
                seg.ring.landed(seg, cdir / f"rank{topo.rank}.json")  # held while this manifest exists
            points.reached("snapshot_manifest_partial", step)
            for r in senders:
                rep = SnapshotManifest(
                    **base,
                    source_rank=r,
                    source_node=everyone[r]["node"],
                    replica=True,
                    data_file=f"rank{r}.replica.bin",
                    data_bytes=everyone[r]["bytes"],
                    shards=[ShardRecord(**s) for s in everyone[r]["shards"]],
                    written_at=time.time(),
                    **self._mutable(f"rank{r}.replica.bin", hashed, step, topo),
                )
                self._write_text(cdir / f"rank{r}.replica.json", rep.model_dump_json(), written)
            self._mark_run(step, topo.generation)
        except OSError as exc:
            self._remove(cdir, written)
            raise StorageError(storage_message(cdir, 4096, exc, step)) from None
        if not cap.speculative:
            self._chain = (topo.fingerprint(), CommitId(step, topo.generation, topo.fingerprint()), cap.chain_length)
        self._written = (CommitId(step, topo.generation, topo.fingerprint()), parent, cap.chain_length)
        if app_meta:
            # The newest complete commit is among this rank's last few (at most APP_SLACK in flight
            # or failed after it), so the app state of older ones is never restored: drop it now,
            # whether or not a prune runs (a chain keeps its commits' rows, not their app state).
            self._app_dirs.append(cdir)
            while len(self._app_dirs) > self.keep + APP_SLACK:
                self._drop_app_state(self._app_dirs.popleft())
        if self.apply:
            self._hand_to_applier(CommitId(step, topo.generation, topo.fingerprint()), parent, topo.rank, senders)
        sizes = [int(e["bytes"]) for e in everyone]  # (every rank's, exchanged: the same window everywhere)
        if parent is None:
            self._window = FoldWindow.after_base(sizes)
        elif self._window is not None and len(self._window.base_bytes) == len(sizes):
            self._window.add(sizes)
            spacing = min(self.max_chain, self.fold_max_deltas)  # folds no more often than the bases they replace
            if cap.fold and self._window.due(self.fold_ratio, self.fold_max_deltas, spacing):
                self._window.restart()
                self._fold_due = (step, fold_targets(cdir, topo.rank, senders))  # prune hands it on
        return int(blob.numel()), replicated

    def _hand_to_applier(self, commit: CommitId, parent: CommitId | None, rank: int, senders: list[int]) -> None:
        """Queue a commit just written; hand the applier the one ``keep`` commits older."""
        if parent is None:  # a base starts a new chain: the old one's deltas are not applied any more
            self._unapplied.clear()
            return
        if self._unapplied and self._unapplied[-1][0] != parent:
            self._unapplied.clear()  # (a chain this tier did not write in full: apply from here on)
        self._unapplied.append((commit, [(rank, False)] + [(r, True) for r in senders]))
        while len(self._unapplied) > self.keep:
            old, shards = self._unapplied.popleft()
            self.applier.request(old.step, old, shards)
        # Back-pressure: the deltas not applied yet stay on the node (and in the log ring), so
        # this writer waits (bounded) while the applier is more than APPLY_BACKLOG commits behind.
        if not self.applier.wait_below(APPLY_BACKLOG, self.applier.timeout):
            log.warning(
                "apply_behind",
                step=commit.step,
                backlog=self.applier.backlog(),
                waited_s=self.applier.timeout,
                remedy="the applier cannot keep up with the commits: commit less often (commit_every) or check the state directory's storage",
            )

    def _write_hashes(self, cdir, data_name, blob, records, written, step, hashed) -> str | None:
        """Write a base's per-row hashes beside its data file (applying in place, a base is born
        mutable: no later pass reads it to make it so); None, or why it could not be written."""
        if not aligned(records):  # a tensor starts unaligned: this base is not written in place
            return None
        hashes = base_hashes(blob, records)
        path = cdir / hashes_file(data_name)
        try:
            written.append(path)
            write_hashes(path, hashes, self.file_mode)
        except OSError as exc:
            return storage_message(path, int(hashes.numel()) * 8, exc, step)
        hashed[data_name] = path.name
        return None

    @staticmethod
    def _mutable(data_name: str, hashed: dict[str, str], step: int, topo) -> dict:
        """The manifest fields of a base born mutable (its hash file, its mark: itself)."""
        if data_name not in hashed:
            return {}
        return dict(row_hashes=hashed[data_name], applied=CommitId(step, topo.generation, topo.fingerprint()))

    def _write_checksummed(self, cdir: Path, name: str, cap: "Capture", written: list[Path]):
        """Write a GPU capture's data file and compute its CRC32s, both on several cores. Returns
        (its records with their CRC32s, None or the one-line reason it could not be written)."""
        path = cdir / name
        ranges = record_ranges(cap.records)
        try:
            make_dirs(self.root, cdir, self.dir_mode)
            spare = self.spares.take(int(cap.blob.numel())) if self.spares is not None and cap.blob.numel() else None
            free = free_bytes(cdir)
            if spare is None and free is not None and free < cap.blob.numel():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(path)
            if spare is not None:  # pages allocated ahead: the copy below only copies
                os.replace(spare, path)
            data = cap.blob.numpy()
            opener = (
                (lambda p: os.fdopen(os.open(p, os.O_RDWR), "r+b"))
                if spare is not None
                else (lambda p: open_new(p, self.file_mode, readable=True))
            )
            crcs = write_and_checksum(path, data, ranges, opener)  # each chunk checksummed while in cache
        except OSError as exc:
            return cap.records, storage_message(path, int(cap.blob.numel()), exc, cap.step)
        return finished_records(cap.records, data, crcs), None

    def _write(self, cdir: Path, name: str, blob: torch.Tensor, written: list[Path], step: int) -> str | None:
        """Write one data file of this commit; None, or the one-line reason it could not be written."""
        path = cdir / name
        try:
            make_dirs(self.root, cdir, self.dir_mode)
            free = free_bytes(cdir)
            if free is not None and free < blob.numel():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(path)
            write_blob(path, blob, self.file_mode)
        except OSError as exc:
            return storage_message(path, int(blob.numel()), exc, step)
        return None

    def _write_app(self, cdir: Path, state: dict, written: list[Path], step: int) -> tuple[dict, str | None]:
        """Write a commit's app state; its manifest fields, and None or the one-line reason it failed."""
        path = cdir / app_state.APP_FILE
        try:
            make_dirs(self.root, cdir, self.dir_mode)
            written.append(path)
            size, crc = app_state.write_file(path, state, self.file_mode)
        except OSError as exc:
            return {}, storage_message(path, 0, exc, step)
        return {"app_file": app_state.APP_FILE, "app_bytes": size, "app_crc": crc}, None

    def _write_text(self, path: Path, text: str, written: list[Path]) -> None:
        written.append(path)
        write_atomic(path, text, self.file_mode)

    def _abandon_if_failed(self, step: int, cdir: Path, written: list[Path], errors: list[str | None]) -> None:
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if not failed:
            return
        self._remove(cdir, written)
        log.error("snapshot_commit_failed", step=step, ranks=[r for r, _ in failed], error=failed[0][1])
        raise StorageError(
            f"rank {failed[0][0]}: {failed[0][1]}" + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
        )

    @staticmethod
    def _remove(cdir: Path, written: list[Path]) -> None:
        """Remove what this rank wrote of a failed commit, and the directory once it is empty."""
        for path in written:
            path.unlink(missing_ok=True)
        try:
            cdir.rmdir()
        except OSError:
            pass  # other ranks of this node still have files there (they remove theirs), or it is gone

    def _mark_run(self, step: int, generation: int) -> None:
        path = self.node_dir / RUN_MARKER
        if not path.exists():
            marker = RunMarker(
                run_id=self.run_id, node_id=self.node_id, first_step=step, generation=generation, written_at=time.time()
            )
            write_atomic(path, marker.model_dump_json(), self.file_mode)

    # -- reading ----------------------------------------------------------------------------------

    def manifests(self) -> list[tuple[Path, SnapshotManifest]]:
        """Every valid manifest in this node's directory, with its data file.

        A manifest that does not parse, names another run or a data file outside its directory,
        or names a log segment a newer commit names too, is reported and ignored: never counted.

        Returns:
            ``(data file or log segment path, manifest)`` pairs, by commit directory.
        """
        out = []
        node_dir = self.node_dir  # resolved (and checked) once: it stats every component
        try:
            cdirs = sorted(node_dir.glob("step-*"))
        except OSError:
            return out
        # Parsed manifests by their exact bytes: the background writer prunes after every commit,
        # which lists every manifest twice, and parsing them all again would hold the GIL, which
        # the training thread needs to launch its kernels. Keyed by content, a rewritten file is
        # always parsed again.
        parsed, seen = self._parsed, {}
        for cdir in cdirs:
            try:
                mpaths = sorted(cdir.glob("rank*.json"))
            except FileNotFoundError:  # pruned meanwhile (by another rank of this node, or beside the applier)
                continue
            for mpath in mpaths:
                try:
                    raw = mpath.read_bytes()
                    m = parsed.get(raw) or SnapshotManifest.model_validate_json(raw)
                    check_name(m.data_file, "data file")
                    data = cdir / m.data_file if m.segment is None else segment_path(node_dir, m.segment)
                except FileNotFoundError:
                    continue  # pruned by another rank of this node meanwhile
                except Exception as exc:  # a foreign or damaged file: report and skip, never guess
                    log.warning("snapshot_manifest_invalid", path=str(mpath), error=repr(exc)[:300])
                    continue
                if m.run_id != self.run_id:
                    log.warning(
                        "snapshot_manifest_invalid",
                        path=str(mpath),
                        error=f"run id {m.run_id!r}, expected {self.run_id!r}",
                    )
                    continue
                seen[raw] = m
                out.append((data, m))
        self._parsed = seen  # only what is still there: bounded by the directory
        return present(newest_per_segment(out))

    def listing(self, manifests: list[tuple[Path, SnapshotManifest]] | None = None) -> NodeListing:
        """This node directory's contents.

        Args:
            manifests: :meth:`manifests` as just listed; None: listed here.

        Returns:
            The :class:`NodeListing` every rank exchanges to judge completeness alike.
        """
        try:
            dirs = sorted(d.name for d in self.node_dir.glob("step-*"))
            marker = (self.node_dir / RUN_MARKER).exists()
        except OSError:
            dirs, marker = [], False
        manifests = self.manifests() if manifests is None else manifests
        pieces = [(m.commit, r.table, r.start, r.stop, r.num_rows) for _, m in manifests for r in m.shards]
        parents = sorted({(m.commit, m.parent) for _, m in manifests if m.parent is not None})
        return NodeListing(node=self.node_id, marker=marker, dirs=dirs, pieces=pieces, parents=parents)

    # -- pruning ----------------------------------------------------------------------------------

    def prune(self, comm: Comm, *, at_start: bool = False) -> list[str]:
        """Delete the commit directories of this node that can no longer be needed (collective).

        Completeness is judged over the whole world, by restore's rule. Kept: the newest ``keep``
        complete commits with their chains, and anything newer than the newest complete one.
        Deleted: everything else older than the newest complete commit. Nothing is deleted without
        a complete commit. Skipped on every rank alike when it could delete nothing. At a fold
        point it waits for the previous fold first, then hands the commit just written to the
        compactor.

        Args:
            comm: the communicator of the world.
            at_start: after a restart's restore: torn directories of earlier generations are
                deleted too, since their writers are gone.

        Returns:
            The directory names this rank deleted (only local rank 0 deletes).
        """
        written = self._written
        fold_due, self._fold_due = self._fold_due, None
        if fold_due is not None:
            self.compactor.wait()  # bounded (fold_timeout); a fold still running then is skipped
        elif not at_start and self._prune_frees_nothing(written):
            self._pruned_at = written[0]
            return []
        self._pruned_at = None  # until this prune has completed
        deleted, newest = self._prune(comm, at_start)
        # Clean: the commit just written is the newest complete one, so the prune kept only it, the
        # keep - 1 commits before it and their chains (and what may still complete).
        if written is not None and (newest == written[0] or (self.apply and newest is not None)):
            self._pruned_at = newest
        if fold_due is not None:
            self.compactor.request(*fold_due)
        return deleted

    @staticmethod
    def _drop_app_state(cdir: Path) -> None:
        """Remove a commit's app state once it is only a link in a newer commit's chain: a restore
        reads the app state of the commit it restores, so the disk holds it ``keep`` times, not
        once per commit of every kept chain."""
        try:
            (cdir / app_state.APP_FILE).unlink(missing_ok=True)
            for path in cdir.glob("rank*.state.pt"):
                path.unlink(missing_ok=True)
        except OSError as exc:  # read-only storage: the file stays, nothing depends on its removal
            log.warning("snapshot_prune_failed", dir=str(cdir), error=str(exc))

    def cancel_fold(self, timeout: float = 10.0) -> bool:
        """Cancel the fold under way, if any (a resize restores next, or the process exits).

        Its commit stays the delta it was.

        Args:
            timeout: the most seconds to wait for the fold's thread.

        Returns:
            Whether no fold runs now.
        """
        self._fold_due = None  # a fold point an abandoned writer wrote but never pruned: not folded
        self._unapplied.clear()  # what comes next restores (or exits): the chain is read as it is
        applier_idle = self.applier.cancel(timeout)
        return self.compactor.cancel(timeout) and applier_idle

    def _prune_frees_nothing(self, written: tuple[CommitId, CommitId | None, int] | None) -> bool:
        """Whether a full prune now would delete nothing: the newest commit written is a delta on
        the commit the last prune left as the newest complete one (nothing else deletable), and it
        is at least ``keep`` deltas from its base. Then the ``keep`` newest complete commits are
        it and ``keep - 1`` of its own ancestors: the kept set only grew by this commit, and the
        one commit that left the newest ``keep`` stays, as a link of its chain. (A kill between
        its write and here changes nothing: a new process prunes in full first.)"""
        if self.apply:
            # Deltas written into their base become deletable as the applier goes on, so the full
            # prune comes every APPLY_PRUNE_EVERY deltas (a count every rank shares: it is collective).
            return (
                written is not None
                and self._pruned_at is not None
                and written[1] is not None
                and written[2] % APPLY_PRUNE_EVERY != 0
            )
        return (
            written is not None
            and self._pruned_at is not None
            and written[1] == self._pruned_at
            and written[2] >= self.keep
        )

    def _prune(self, comm: Comm, at_start: bool) -> tuple[list[str], CommitId | None]:
        """The full prune: (the directory names deleted, the newest complete commit or None)."""
        topo = comm.topology
        lead = topo.local_rank == 0
        shown = self.manifests() if lead else []  # listed before the exchange: never a newer commit
        listing = self.listing(shown) if lead else None
        everyone = [
            NodeListing.model_validate(x) if x else None
            for x in comm.exchange("prune", listing.model_dump(mode="json") if listing else None)
        ]
        by_commit: dict[CommitId, list[tuple[str, int, int, int]]] = {}
        for e in everyone:
            for cid, table, start, stop, n in e.pieces if e else []:
                by_commit.setdefault(cid, []).append((table, start, stop, n))
        complete = sorted((c for c, ps in by_commit.items() if not commit_missing(ps)), reverse=True)
        if not complete or listing is None:  # (every rank has the same answer; local rank 0 deletes)
            return [], complete[0] if complete else None
        kept = set(complete[: self.keep])
        restorable = set(kept)  # the commits a restore picks: their app state is kept with them
        parent_of = {c: p for e in everyone if e for c, p in e.parents}
        for c in list(kept):  # a kept delta keeps its chain back to the base
            while c in parent_of and parent_of[c] not in kept:
                c = parent_of[c]
                kept.add(c)
        newest = complete[0]
        commit_of = {f"{commit_dirname(c.step, c.fingerprint)}": c for c in by_commit}
        # A base written in place (inplace.py) stands for its mark, not for its own directory's
        # commit: its directory stays while that mark is kept.
        bases: dict[str, list[CommitId]] = {}
        for path, m in shown:  # (the listing's own: its marks are the ones the kept set was judged by)
            if m.row_hashes is not None and m.parent is None and path.parent.parent == self.node_dir:
                bases.setdefault(path.parent.name, []).append(m.commit)
        current = topo.fingerprint()
        deleted = []
        for name in listing.dirs:
            cid = commit_of.get(name)
            if name in bases:
                if any(c in kept for c in bases[name]):
                    continue
            elif cid in kept:
                if cid not in restorable:  # kept for its rows (a chain's base or delta), not restored as itself
                    self._drop_app_state(self.node_dir / name)
                continue
            newer = cid > newest if cid is not None else step_of_dirname(name) >= newest.step
            if newer and not (at_start and not name.endswith(f"-{current}")):
                continue
            try:
                with self.fold_lock:  # not under a fold's manifest swap
                    shutil.rmtree(self.node_dir / name)
                deleted.append(name)
            except FileNotFoundError:
                pass
            except OSError as exc:  # read-only storage: restore still works, commits will say why
                log.warning("snapshot_prune_failed", dir=str(self.node_dir / name), error=str(exc))
        if deleted:  # (applying in place, every few commits: a debug event then)
            (log.debug if self.apply else log.info)(
                "snapshot_pruned", deleted=deleted, kept=[str(c) for c in sorted(kept)]
            )
        if (self.node_dir / LOG_DIR).is_dir():  # segments of exited processes that no commit names
            sweep_segments(self.node_dir, {m.segment for _, m in self.manifests() if m.segment})
        return deleted, newest


def commit_missing(pieces: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int]]:
    """The rows of a commit no piece covers: the completeness rule of prune and restore.

    Args:
        pieces: ``(table, start, stop, num_rows)`` of every valid manifest of the commit; the table
            sizes are taken from them.

    Returns:
        The uncovered ranges ``(table, start, stop)`` (empty: the commit is complete).
    """
    num_rows: dict[str, int] = {}
    for table, _, _, n in pieces:
        num_rows[table] = max(num_rows.get(table, 0), n)
    return uncovered(((t, a, b) for t, a, b, _ in pieces), num_rows)


def free_bytes(path: Path) -> int | None:
    """Bytes available to this user on the filesystem of ``path``.

    Args:
        path: any path on the filesystem.

    Returns:
        The free bytes, or None if unknown.
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def storage_message(path: Path, needed: int, exc: OSError, step: int) -> str:
    """One line for an operator: what could not be written, why, bytes needed and free, what to do.

    Args:
        path: what could not be written.
        needed: the bytes it needed.
        exc: the error.
        step: the commit's step.

    Returns:
        The message.
    """
    free = free_bytes(path.parent if not path.is_dir() else path)
    reason = exc.strerror or str(exc)
    return (
        f"cannot write {path} for the commit of step {step} ({reason}): needs {needed} bytes, "
        f"{'unknown' if free is None else free} bytes free there; the partial commit is removed and older "
        f"commits stay restorable: free space or make it writable, or point ELASTIC_EMB_STATE_DIR elsewhere"
    )
