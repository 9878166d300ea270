"""How a lifecycle's commits are written, and what writing them keeps between commits.

:class:`Committer` owns, for one generation at a time, the snapshot and durable tiers, the state
tiers' communicator, the background writer (``state.writer.CommitWriter``), DCP's default process
group, the step taken and the step committed. The lifecycle
(:class:`~elastic_emb.lifecycle.manager.Lifecycle`) decides when a commit is due; the committer
writes it, and drops, interrupts or gives up on the commits in flight when a peer is gone.

Design: ``docs/LIFECYCLE.md`` (section "Commits").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from elastic_emb import metrics
from elastic_emb.errors import _CommAborted
from elastic_emb.events import get_logger
from elastic_emb.lifecycle.default_group import DefaultGroup
from elastic_emb.lifecycle.first_base import FirstBase
from elastic_emb.lifecycle.records import CommitReport, LifecycleConfig
from elastic_emb.protocol import ShardedContext
from elastic_emb.state import Comm, DurableTier, SnapshotTier
from elastic_emb.state import app as app_state
from elastic_emb.state.capture import DeviceCapture
from elastic_emb.state.comm import thread_store
from elastic_emb.state.snapshot import APPLY_PRUNE_EVERY
from elastic_emb.state.writer import CommitWriter, finish_commit_on_sigterm, uninstall_sigterm
from elastic_emb.topology import Topology

log = get_logger("elastic_emb.lifecycle.manager")

# A SIGTERM (a graceful leave: the agent forwards it; kubelet's, after preStop) waits this long at
# most for the commit in flight before the process ends as it would have (torchrun's agent sends
# SIGKILL 30 s after its SIGTERM by default).
SIGTERM_COMMIT_WAIT = 20.0

# close(): how long the thread of an abandoned writer may take to leave its aborted store wait.
ABANDONED_JOIN = 5.0

# Commits in flight at most with GPU captures (each holds a pinned buffer of its delta): enough to
# cover the copy, the checksum and the write of one commit while the next steps run.
COMMIT_DEPTH = 3


class Committer:
    """Writes one lifecycle's commits and keeps the tiers, communicators and writer they need.

    Args:
        config: the lifecycle's resolved configuration.
        topology: the current generation's topology.
        store: the current generation's store.
        context: returns the lifecycle's context of the moment, raising
            :class:`~elastic_emb.errors.ElasticEmbError` when it has none.
    """

    def __init__(
        self, config: LifecycleConfig, topology: Topology, store, context: Callable[[], ShardedContext]
    ) -> None:
        self.config = config
        self.topology = topology
        self.store = store
        self._context = context
        self.step = -1  # the last step taken: committed, in flight, or coalesced in a first-base window
        self.app_state: dict = {}  # the job's app-state objects (state/app.py), committed with the tables
        self.rank_state: dict = {}  # this rank's own stateful objects, committed by every rank
        self.first_base: FirstBase | None = None  # an in-process generation's first base window (first_base.py)
        self._comm: Comm | None = None
        self._writer: CommitWriter | None = None
        self._before_in_flight = -1  # self.step before the oldest commit the writer has in flight
        self._device: DeviceCapture | None = None  # GPU captures (async_commit on CUDA), made at the first one
        self._sigterm_installed = None  # the SIGTERM handler that finishes the commit in flight
        self._abandoned: list[CommitWriter] = []  # writers whose commits a dead peer's re-form dropped
        self._pending_durable = None
        self._dcomm: Comm | None = None  # the durable thread's communicator (_durable_comm)
        self._default_group = DefaultGroup()  # DCP's process group, for the durable tier
        self._interrupted: tuple[Topology, str] | None = None  # (generation, why): interrupt()
        self.snapshot = SnapshotTier(
            config.state_dir,
            topology.run_id,
            config.node_id,
            replication=config.replication,
            keep=config.keep,
            file_mode=config.file_mode,
            dir_mode=config.dir_mode,
            max_chain=config.max_chain,
            fold_ratio=config.fold_ratio,
            fold_max_deltas=config.fold_max_deltas,
            fold_timeout=config.transfer_timeout,
            apply=config.apply_in_place,
        )
        self.snapshot.fold = self.snapshot.fold and config.fold and not config.apply_in_place
        self.durable = (
            DurableTier(config.durable_dir, topology.run_id, file_mode=config.file_mode, dir_mode=config.dir_mode)
            if config.durable_dir
            else None
        )

    def enter(self, topology: Topology, store) -> None:
        """The lifecycle moved to a new generation (or re-formed the same one).

        Communicators and a writer of the previous generation are replaced at their next use.

        Args:
            topology: the new generation's topology.
            store: the new generation's store.
        """
        self.topology, self.store = topology, store

    # -- the committed step ------------------------------------------------------------------

    @property
    def committed_step(self) -> int:
        """``Lifecycle.committed_step``."""
        if self._writer is not None and self._writer.in_flight is not None:
            done = max(self._before_in_flight, self._writer.committed_step)
        else:
            done = self.step
        coalesced = self.first_base.coalesced if self.first_base is not None else None
        return done if coalesced is None else min(done, coalesced - 1)  # coalesced steps are not written yet

    def wait(self) -> int:
        """Block until the commits in flight are complete (``Lifecycle.wait_commit``).

        Returns:
            :attr:`step`, the last step taken.

        Raises:
            Exception: the error of a commit in flight that failed, after :attr:`step` is set back
                to the newest complete commit.
        """
        if self._writer is not None:
            try:
                self._writer.wait()
            except BaseException:
                self.step = max(self._before_in_flight, self._writer.committed_step)
                raise
        return self.step

    # -- commits -----------------------------------------------------------------------------

    def due(self, step: int, *, forced: bool) -> CommitReport | None:
        """Commit a step that is due, unless a first-base window coalesces it.

        Args:
            step: the due step.
            forced: a drain or ``commit(force=True)``: never coalesced; a first-base window ends
                and its base is waited for.

        Returns:
            The commit's report, or None when nothing was written (coalesced).

        Raises:
            ValueError: a first-base verdict in the store is foreign (:meth:`FirstBase.defer`).
            Exception: a write failed, as in :meth:`commit`.
        """
        if self.first_base is not None:
            report, due = self._first_base_commit(step, forced=forced)
            if not due:
                return report
        return self.commit(step)

    def _first_base_commit(self, step: int, *, forced: bool) -> tuple[CommitReport | None, bool]:
        """A due commit inside the first-base window of a generation formed in process
        (``first_base.py``): the base itself goes to the background writer; later due steps are
        coalesced until every rank's base is complete. Returns (its report, whether to commit
        ``step`` as usual now)."""
        fb = self.first_base
        if fb.step is None:
            fb.step = step
            return self.commit(step, background=True), False
        if not forced and fb.defer(step, self._writer is None or self._writer.in_flight is None):
            self.step = step  # taken, its rows not written: committed_step stays below fb.coalesced
            return None, False
        self.first_base = None  # the window ends: from here, commits as configured
        self.wait()  # complete on every rank (or forced: waited for here); raises a failed base's error
        return None, True

    def commit(self, step: int, *, background: bool = False) -> CommitReport:
        """Write ``step`` to the tiers now (collective over the generation).

        With the background writer the rows are captured here and written while training goes
        on; otherwise the snapshot, its replicas and a due durable checkpoint are written before
        this returns.

        Args:
            step: the step to commit.
            background: go through the background writer whatever ``async_commit`` says (the
                first base of a generation formed in process).

        Returns:
            The commit's report (for a background commit, the bytes captured).

        Raises:
            ElasticEmbError: the lifecycle has no context.
            Exception: a synchronous write failed, or a background commit failed (this one's
                submission, or an earlier one it waits for); :attr:`step` is then set back to the
                newest complete commit.
        """
        t0 = time.perf_counter()
        ctx = self._context()
        durable_due = bool(
            self.durable is not None and self.config.durable_every and step % self.config.durable_every == 0
        )
        changes = None
        # On CUDA, with the background writer, a delta is gathered on the GPU on a side stream
        # (elastic_emb.state.capture): no host sync, several commits in flight.
        asynchronous = self._async_for(ctx)
        background = background or asynchronous  # (the first base of a generation formed in process, too)
        on_device = bool(
            asynchronous
            and self.config.incremental
            and ctx.tracks_changes
            and not durable_due
            and getattr(ctx, "device", None) is not None
            and ctx.device.type == "cuda"
            and hasattr(ctx, "take_changed_rows")
            and hasattr(ctx, "hold_writes")
        )
        if self.config.incremental and ctx.tracks_changes:
            # The changed rows as row numbers where the context offers them (work per commit grows
            # with the rows written), else the contract's whole-shard masks.
            take_rows = getattr(ctx, "take_changed_rows", None)
            changes = take_rows(unique=not on_device) if take_rows is not None else ctx.take_changes()
        # A delta reads only the changed rows: straight from the context's own tensors when it
        # offers them (the commit is synchronous, nothing writes them meanwhile), not a full copy.
        views = ctx.shard_views() if changes is not None and not durable_due else None
        shards = views if views is not None else ctx.export_shard()
        comm = self.comm_for(ctx)
        num_rows = {name: int(spec.num_rows) for name, spec in ctx.tables.items()}
        # The app state is replicated: one copy per node, by its first rank; copied here (the next
        # step changes it), serialized and written by the writer, before the commit's manifest.
        app = app_state.capture(self.app_state) if self.app_state and self.topology.local_rank == 0 else None
        mine = app_state.capture(self.rank_state) if self.rank_state else None  # per rank: every rank's own
        if background:
            writer = self._writer_for()
            if not on_device:
                self.wait()  # a host capture names a parent that must be complete
            elif self._device is None:
                self._device = DeviceCapture(ctx.device, buffers=COMMIT_DEPTH, timeout=self.config.transfer_timeout)
                self.snapshot.fold = False  # GPU deltas land in reused log segments: never folded
                self.snapshot.enable_spares(COMMIT_DEPTH + 1)
                # A segment is held until its delta is written into its base and pruned (applying
                # in place: keep + the prune spacing + the applier's backlog), or while its chain is
                # kept (re-basing); with none free a delta takes the pinned path, never a wait.
                chain = APPLY_PRUNE_EVERY + 2 if self.config.apply_in_place else min(self.config.max_chain, 8)
                self.snapshot.enable_ring(chain + COMMIT_DEPTH + self.config.keep)
            if writer.in_flight is None:
                self._before_in_flight = self.step
            cap = self.snapshot.capture(
                step,
                shards,
                self.topology,
                num_rows,
                changes,
                device=self._device if on_device else None,
                hold=ctx.hold_writes if on_device else None,
            )
            if app is not None or mine is not None:
                cap = dataclasses.replace(cap, app=app, rank_state=mine)
            try:
                writer.submit(cap)
            except BaseException:
                self.step = max(self._before_in_flight, writer.committed_step)
                raise
            written, replicated = int(cap.blob.numel()), 0  # the writer logs commit_complete with both
        else:
            written, replicated = self.snapshot.commit(
                step, shards, comm, num_rows, changes=changes, app=app, rank_state=mine
            )
        tiers = ["snapshot"] + (["replica"] if self.config.replication and self.topology.num_nodes > 1 else [])
        durable_bytes = 0
        if durable_due:
            self.wait_durable()
            group = self.default_group()
            # Asynchronous: the rest of the save runs in a thread, on a communicator of the
            # durable tier's own (the context's and the writer's stay free for the steps).
            dcomm = self._durable_comm(group) if self.config.durable_async else comm
            durable_bytes, self._pending_durable = self.durable.commit(
                step,
                shards,
                dcomm,
                num_rows,
                group,
                asynchronous=self.config.durable_async,
                app=app if self.topology.rank == 0 else None,
            )
            tiers.append("durable")
        if not background:
            self.snapshot.prune(comm)  # the background writer prunes after each commit it completes
        self.step = step
        report = CommitReport(
            step=step,
            tiers=tiers,
            bytes_snapshot=written,
            bytes_replicated=replicated,
            bytes_durable=durable_bytes,
            seconds=time.perf_counter() - t0,
        )
        log.info("lifecycle.commit", **report.model_dump())
        metrics.commit(report)
        return report

    # -- the durable tier --------------------------------------------------------------------

    def default_group(self):
        """DCP's default process group of this generation, made on first use.

        Returns:
            The default group, or None without a durable tier.

        Raises:
            ElasticEmbError: a default group the user created does not match the topology.
        """
        if self.durable is None:
            return None
        return self._default_group.ensure(self.topology, self.store, self.config.transfer_timeout)

    def _durable_comm(self, group) -> Comm:
        """The durable tier's communicator of this generation, on DCP's group (used only by the
        durable thread, one checkpoint at a time). It polls the store (``interruptible``), as the
        writer's does: a blocking store wait already under way would ignore :meth:`interrupt` and
        :meth:`give_up_on` and hold the checkpoint of a dead or departed rank for
        ``transfer_timeout``."""
        if self._dcomm is None or self._dcomm.topology is not self.topology or not self._dcomm.formed_on(group):
            self._dcomm = self._made(
                Comm(
                    self.topology,
                    thread_store(self.store),
                    group,
                    timeout=self.config.transfer_timeout,
                    device="cpu",
                    purpose="durable",
                    interruptible=True,
                )
            )
        return self._dcomm

    @property
    def durable_in_flight(self) -> bool:
        """Whether an asynchronous durable checkpoint is still being written."""
        return self._pending_durable is not None and not self._pending_durable.done()

    def wait_durable(self, timeout: float | None = None) -> None:
        """Block until the durable checkpoint in flight (if any) is written (``Lifecycle.wait_durable``).

        A checkpoint that fails or outlasts ``timeout`` is logged, not raised: the snapshot tier
        still holds the commit.

        Args:
            timeout: seconds to wait at most; None waits up to ``transfer_timeout``.
        """
        fut, self._pending_durable = self._pending_durable, None
        if fut is None:
            return
        timeout = self.config.transfer_timeout if timeout is None else timeout
        try:
            fut.result(timeout=timeout)
        except Exception as exc:  # reported; the snapshot tier still holds the commit
            log.error("lifecycle.durable_failed", error=repr(exc)[:500])

    # -- communicators and the background writer ---------------------------------------------

    def comm_for(self, ctx: ShardedContext) -> Comm:
        """The state tiers' communicator of this generation, made on first use.

        Args:
            ctx: the lifecycle's context; the communicator uses its ``process_group`` (when that
                is None, a gloo group of its own, once per generation).

        Returns:
            The communicator; restores and synchronous commits use it.
        """
        # A context without a process group gets a communicator with a gloo group of its own, once
        # per generation (formed_on: that group stands for the context's None). A new one would
        # close the writer, waiting for the commits in flight, and form a gloo group per commit.
        if (
            self._comm is None
            or self._comm.topology is not self.topology
            or not self._comm.formed_on(ctx.process_group)
        ):
            self.close_comm()
            self._comm = self._made(
                Comm(self.topology, self.store, ctx.process_group, timeout=self.config.transfer_timeout)
            )
        return self._comm

    def _async_for(self, ctx) -> bool:
        """Whether commits go through the background writer: ``async_commit``, or by default
        (None) when commits are incremental, i.e. the context tracks its changes."""
        if self.config.async_commit is not None:
            return self.config.async_commit
        return bool(self.config.incremental and ctx.tracks_changes)

    def _writer_for(self) -> CommitWriter:
        if self._writer is None or self._writer.comm.topology is not self.topology:
            self.close_writer()
            comm = self._made(
                Comm(
                    self.topology,
                    thread_store(self.store),
                    None,
                    timeout=self.config.transfer_timeout,
                    purpose="commit",
                    interruptible=True,
                )
            )
            self._writer = CommitWriter(self.snapshot, comm, self.config.transfer_timeout, depth=COMMIT_DEPTH)
            if not self._sigterm_installed:  # a SIGTERM first waits (bounded) for the commit in flight
                self._sigterm_installed = finish_commit_on_sigterm(
                    lambda: self._writer, min(SIGTERM_COMMIT_WAIT, self.config.transfer_timeout)
                )
        return self._writer

    def interrupt(self, reason: str) -> None:
        """A peer is known gone: abort every communicator of this generation (from another thread).

        The writer's, the state tiers' and the durable thread's are aborted, and so are those made
        for the same generation afterwards. A wait whose keys or rows are all there still
        completes; the others raise :class:`~elastic_emb.errors._CommAborted`
        (``TransferInterrupted`` for a transfer) instead of waiting out ``transfer_timeout``; the
        writer logs its commit as ``commit_aborted``, a warning. The re-form that follows abandons
        the writer (:meth:`abandon`).

        Args:
            reason: how the peer is known gone, for the errors and the log.
        """
        self._interrupted = (self.topology, reason)  # first: a communicator made meanwhile sees it (_made)
        writer = self._writer  # one read each: the training thread may replace them meanwhile
        if writer is not None:
            writer.interrupt(reason)
        for comm in (self._comm, self._dcomm):
            if comm is not None:
                comm.abort(reason)

    def give_up_on(self, ranks, reason: str) -> None:
        """Stop waiting for ranks of this generation that left the rendezvous without a failed collective.

        A commit in flight still waiting for their part ends now instead of at
        ``transfer_timeout``, while a commit they finished before leaving (a drain) completes, so
        a graceful resize still loses no step (:meth:`Comm.give_up_on`).

        Args:
            ranks: the departed ranks, in this generation's numbering.
            reason: why they are given up on, for the errors and the log.
        """
        writer = self._writer  # one read each: the training thread may replace them meanwhile
        if writer is not None:
            writer.give_up_on(ranks, reason)
        for comm in (self._comm, self._dcomm):
            if comm is not None:
                comm.give_up_on(ranks, reason)

    def _made(self, comm: Comm) -> Comm:
        """A communicator just made for this generation: aborted at once when the generation was
        interrupted already."""
        interrupted = self._interrupted
        if interrupted is not None and interrupted[0] is self.topology:
            comm.abort(interrupted[1])
        return comm

    def abandon(self) -> None:
        """Drop the commits in flight without waiting (a peer died; ``CommitWriter.abandon``):
        the committed step falls back to the newest complete commit."""
        if self._writer is not None:
            if self._writer.abandon() is not None:
                self.step = max(self._before_in_flight, self._writer.committed_step)
            self._abandoned.append(self._writer)  # close() gives its thread a moment to exit
            self._writer = None

    def close_writer(self) -> None:
        """Wait for the commits in flight (a failure is logged: the previous commit stays the
        newest complete one), then release the writer."""
        if self._writer is not None:
            try:
                self.wait()
            except Exception as exc:  # reported; the previous commit stays the newest complete one
                _commit_lost(exc, step=self._writer.in_flight)
            self._writer.close(wait=False)  # waited for above
            self._writer = None
        self.snapshot.cancel_fold()  # what comes next (a restore, the exit) reads the chains as they are

    def close_comm(self) -> None:
        """The generation's communicators go (the writer's first: it may be using the store)."""
        self.close_writer()
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> BaseException | None:
        """Wait for the checkpoint and the commits in flight, then release everything.

        Releases the writer, the communicators, the SIGTERM handler and the spare files, and gives
        abandoned writers' threads a moment to exit.

        Returns:
            The error of a commit in flight that failed (the caller raises it once everything is
            released), or None.
        """
        self.wait_durable()
        failed: BaseException | None = None
        try:
            self.wait()  # the commit in flight completes first: a graceful resize loses no step
        except Exception as exc:
            failed = exc
            _commit_lost(exc, committed_step=self.step)
        self.close_comm()
        for writer in self._abandoned:  # out of their store waits (aborted) before the process exits
            if not writer.join(ABANDONED_JOIN):
                log.warning(
                    "lifecycle.abandoned_writer_alive",
                    seconds=ABANDONED_JOIN,
                    remedy="its replica transfer to the dead peer runs to transfer_timeout",
                )
        self._abandoned = []
        uninstall_sigterm(self._sigterm_installed)
        self._sigterm_installed = None
        self.snapshot.close_spares()  # files allocated ahead for GPU captures
        return failed

    def release_default_group(self) -> None:
        """After the context is closed: DCP's default process group and its communicator."""
        self._dcomm = None
        self._default_group.destroy()


def _commit_lost(exc: BaseException, **where) -> None:
    """Log a commit in flight that did not complete: ``lifecycle.commit_aborted`` (warning) when
    its communicator was aborted because a peer is known gone (:class:`_CommAborted`: expected, the
    re-form restores the newest complete commit), else ``lifecycle.commit_failed`` (error)."""
    if isinstance(exc, _CommAborted):
        log.warning(
            "lifecycle.commit_aborted",
            reason="a peer is gone: the communicator was aborted",
            error=str(exc)[:300],
            **where,
        )
    else:
        log.error("lifecycle.commit_failed", error=str(exc)[:500], **where)
