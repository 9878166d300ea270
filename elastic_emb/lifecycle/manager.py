"""The lifecycle of one worker's sharded tables: start, commit, and re-form on a membership change.

:class:`Lifecycle` builds a context for an agreed topology and restores the newest complete
commit (:meth:`Lifecycle.start`), commits at step boundaries (:meth:`Lifecycle.commit`), and on a
membership change destroys the context, constructs a new one and carries every row and optimizer
slot across, resharded (:meth:`Lifecycle.on_membership_change`). ``reset`` is used only for a
re-form at the same world and EP size. How a commit is written is
:mod:`~elastic_emb.lifecycle.committer`.

Design: ``docs/LIFECYCLE.md``.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Mapping

from elastic_emb import metrics
from elastic_emb.errors import ElasticEmbError, StorageError
from elastic_emb.events import bind_topology, get_logger
from elastic_emb.lifecycle import first_base
from elastic_emb.lifecycle.committer import Committer
from elastic_emb.lifecycle.first_base import FirstBase
from elastic_emb.lifecycle.records import (
    CALLER_PHASES,
    CommitReport,
    LifecycleConfig,
    ResizeEvent,
    completed_by_caller,
)
from elastic_emb.protocol import ContextFactory, ShardData, ShardedContext, check_context
from elastic_emb.rdzv.signing import signed_store
from elastic_emb.state import RestoreReport, app, points, restore
from elastic_emb.topology import Topology, agree
from elastic_emb.watch import heartbeat

log = get_logger("elastic_emb.lifecycle.manager")


# A StorageError's message carries the writing rank's strerror (the message crosses ranks, its
# errno does not): the metric's reason label, by that text.
_STORAGE_REASONS = (
    (os.strerror(errno.ENOSPC), "no_space"),
    (os.strerror(errno.EDQUOT), "quota"),
    (os.strerror(errno.EROFS), "read_only"),
)


def _storage_reason(exc: StorageError) -> str:
    text = str(exc)
    return next((label for strerror, label in _STORAGE_REASONS if strerror in text), "storage")


class Lifecycle:
    """One worker's sharded tables across its start, its commits and its membership changes.

    Build with :meth:`start`; the constructor only wires the parts together.

    Args:
        factory: builds the context for a topology, ``(topology, store) -> ShardedContext``.
        config: where state lives and how often it is committed (environment defaults resolved).
        topology: this worker's current topology.
        store: the current generation's store.
        watcher: the worker's :class:`~elastic_emb.watch.watcher.Watcher`, or None.
        env: the worker's environment (not read by the constructor).
        app_state: the rest of the training state, committed and restored with the tables (see
            :meth:`start`).
        rank_state: this rank's own stateful objects (see :meth:`start`).
    """

    def __init__(
        self,
        factory: ContextFactory,
        config: LifecycleConfig,
        topology: Topology,
        store,
        watcher=None,
        env: Mapping[str, str] | None = None,
        app_state: Mapping | None = None,
        rank_state: Mapping | None = None,
    ) -> None:
        self.factory = factory
        self.config = config
        self.topology = topology
        self._env = env  # where the job secret is read (signed_store), as at start
        self.store = store
        self.watcher = watcher
        self.context: ShardedContext | None = None
        self._seen_step = -1
        self._skipped_commits = 0  # commits the state directory refused (storage_errors="skip")
        self.draining = False
        self.events: list[ResizeEvent] = []
        self._sigterm = threading.Event()
        self._unfinished: tuple[int, float] | None = None  # (index in events, restore done): first step pending
        # how commits are written: tiers, writer, communicators, the committed step (committer.py)
        self._committer = Committer(config, topology, store, self._require_context)
        self.snapshot = self._committer.snapshot
        self.durable = self._committer.durable
        self.app_state, self.rank_state = app.check_states(app_state, rank_state)
        self._committer.app_state = self.app_state
        self._committer.rank_state = self.rank_state

    # -- start -------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        factory: ContextFactory,
        config: LifecycleConfig | None = None,
        *,
        env: Mapping[str, str] | None = None,
        store=None,
        watcher=None,
        background_base: bool = False,
        app_state: Mapping | None = None,
        rank_state: Mapping | None = None,
    ) -> "Lifecycle":
        """Start a lifecycle: topology from the environment, agree, construct, restore.

        The restore takes the newest commit complete for every row across the node snapshots
        and the durable tier; with no state anywhere the context keeps its initial rows. A
        failure after the store is open closes what was already built before it is raised.

        Args:
            factory: builds the context for a topology, ``(topology, store) -> ShardedContext``.
            config: the configuration (None: the defaults); environment defaults are filled in.
            env: the environment to read; None reads ``os.environ``.
            store: the world's store; None opens it from the environment. In
                ``resize=in_process`` mode pass :func:`~elastic_emb.inprocess.interruptible.interruptible_store`.
            watcher: the worker's :class:`~elastic_emb.watch.watcher.Watcher`, or None.
            background_base: this worker joins a generation formed in process, whose running
                workers may write its first base in the background: so does it, by the same rule.
            app_state: the rest of the training state, as name -> object with ``state_dict()`` and
                ``load_state_dict()`` (DCP's ``Stateful``: an ``nn.Module``, an optimizer, a
                scheduler, an :class:`~elastic_emb.data.ElasticSampler`), the same names on every
                rank. Replicated state: every rank holds the same values. Each commit includes it
                (one copy per node) and every restore loads it, from the node's commit or from a
                peer (:mod:`elastic_emb.state.app`).
            rank_state: state that differs per rank (per-rank RNG streams, a rank's own reader),
                as name -> ``Stateful``. Every rank commits its own (``rank<r>.state.pt``); it is
                restored to the rank that wrote it at the world size it was written at, from that
                node's commit, and otherwise kept as built (a ``rank_state_not_restored``
                warning): per-rank state has no meaning at another rank or world size.

        Returns:
            The started lifecycle; its ``start`` event is ``events[0]``.

        Raises:
            ConfigError: an ``ELASTIC_EMB_*`` variable is malformed, or an ``app_state`` object
                lacks ``state_dict`` or ``load_state_dict``.
            TopologyError: a torchrun variable is missing or malformed.
            TopologyDisagreement: the ranks do not hold the same topology.
            AgreementTimeout: some ranks did not arrive within ``agree_timeout``.
            ContractViolation: the factory's context lacks a member of ``ShardedContext``.
            RestoreError: state exists but no commit is complete (and ``start_fresh`` is off), or
                ``require_state`` is set and there is no state, or the app state of the restored
                step is missing or refused by its object (the message names it).
        """
        app.check_states(app_state, rank_state)  # before anything is built: a bad object is the caller's error
        env = os.environ if env is None else env
        config = (config or LifecycleConfig()).resolved(env)
        t0 = time.perf_counter()
        topology = Topology.from_env(env)
        bind_topology(topology)
        if store is None:
            from elastic_emb.store import worker_store

            store = worker_store(topology, timeout=config.agree_timeout, env=env)
        store = signed_store(store, env)  # with a job secret, every value the workers exchange is signed
        lc = cls(factory, config, topology, store, watcher=watcher, env=env, app_state=app_state, rank_state=rank_state)
        t1 = time.perf_counter()
        try:
            agree(topology, store, timeout=config.agree_timeout)
            t2 = time.perf_counter()
            lc.context = check_context(factory(topology, store))
            t3 = time.perf_counter()
            report = lc._restore(live=None, live_commit=None)
        except BaseException:
            lc.close()  # release what was built (communicator, arena, default group) before raising
            raise
        t4 = time.perf_counter()
        lc.step = report.step
        if background_base and first_base.wanted(lc.context.tables, topology.world_size):
            lc._committer.first_base = FirstBase(store, topology)
        event = lc._event("start", None, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, report, False)
        lc.events.append(event)
        return lc

    # -- properties --------------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        """The step training runs next: :attr:`step` + 1."""
        return self.step + 1

    @property
    def step(self) -> int:
        """The last step training finished that the lifecycle took: committed, in flight,
        coalesced in a first-base window, not due (``commit_every``) or skipped
        (``storage_errors``); -1 before the first. :attr:`committed_step` says which is complete."""
        return max(self._committer.step, self._seen_step)

    @step.setter
    def step(self, value: int) -> None:
        # a restore: the state is that commit's, whatever was taken before it
        self._committer.step = value
        self._seen_step = value

    @property
    def committed_step(self) -> int:
        """The newest step whose commit is complete (its manifests written on its own node and on
        its replica holders); -1 before the first. Synchronous commits (``async_commit=False``) complete
        inside ``commit()``; by default the commit in flight completes in the background."""
        return self._committer.committed_step

    def wait_commit(self) -> int:
        """Block until the commits in flight (``async_commit``) are complete.

        Returns:
            :attr:`step`, the last step taken: :attr:`committed_step` too, unless due steps are
            coalesced in the first-base window of a generation formed in process.

        Raises:
            Exception: the error of a commit in flight that failed; :attr:`step` is first set back
                to the newest complete commit.
        """
        return self._committer.wait()

    def interrupt(self, reason: str) -> None:
        """A peer is known gone: end this generation's waits for it now.

        Called from another thread (the in-process resize's neighbour probe, a peer's failed
        collective). The context's waits end (its ``interrupt``, when it has one), and so do those
        of the generation's state communicators (:meth:`Committer.interrupt`: the commit in
        flight, a restore's row moves), so the training thread raises at once instead of at a
        timeout, and the re-form follows.

        Args:
            reason: how the peer is known gone, for the errors and the log.
        """
        ctx = self.context
        if ctx is not None and hasattr(ctx, "interrupt"):
            ctx.interrupt(reason)
        self._committer.interrupt(reason)

    def give_up_on(self, ranks, reason: str) -> None:
        """Stop waiting for ranks of the current generation that left the rendezvous.

        The in-process resize calls it before it re-forms without them: the commit in flight
        stops waiting for what they will never send (:meth:`Committer.give_up_on`); what they
        finished before leaving still completes.

        Args:
            ranks: the departed ranks, in the current generation's numbering.
            reason: why they are given up on, for the errors and the log.
        """
        self._committer.give_up_on(ranks, reason)

    # -- commits -----------------------------------------------------------------------------

    def commit(self, step: int, *, force: bool = False) -> CommitReport | None:
        """Record that training finished ``step``; write the tiers the cadence asks for.

        Collective: every rank calls it after every step with the same ``step``. When the watcher
        requests a drain, the commit is written, waited for and acknowledged, and
        :attr:`draining` becomes True.

        Args:
            step: the step just finished; above every step committed before.
            force: write a commit now, whatever the cadence says.

        Returns:
            The commit's report, or None when nothing was written (not due, or coalesced in the
            first-base window of a generation formed in process).

        Raises:
            ValueError: ``step`` is not above the last step taken.
            ElasticEmbError: the watcher says this worker was evicted: it must not commit.
            Exception: a write failed: a synchronous commit's, or an earlier background commit's,
                raised when this commit waits for it.
        """
        self._finish_resize(stepped=True)  # the first step after a resize ends here
        heartbeat.beat()  # the agent's hang watchdog: this worker makes progress (rdzv/hang.py)
        if step <= self.step:
            raise ValueError(
                f"step={step} was already taken (last step {self.step}, committed {self.committed_step}); "
                f"steps must increase: resume at lifecycle.next_step={self.next_step}"
            )
        self._seen_step = max(self._seen_step, step)
        if self.watcher is not None and self.watcher.evicted:
            raise ElasticEmbError(
                f"rank {self.topology.rank} was evicted from the job: it must not commit step "
                f"{step}; exit and let the agent restart it"
            )
        drain = bool(self.watcher is not None and self.watcher.drain_requested(step))
        due = force or drain or step % self.config.commit_every == 0
        report = None
        try:
            report = self._committer.due(step, forced=force or drain) if due else None
            if drain:
                self.wait_commit()  # a drain acknowledges a complete commit, never one in flight
        except StorageError as exc:
            if self.config.storage_errors == "raise":
                raise
            self._commit_skipped(step, exc)
            report = None
        if drain:
            # the newest complete commit: the step itself, unless the state directory refused it
            self.watcher.ack_drain(self.committed_step)
            heartbeat.pause()  # a drained worker idles until its agent stops it
            self.draining = True
            log.info("lifecycle.draining", step=step, committed_step=self.committed_step)
        return report

    def _commit_skipped(self, step: int, exc: StorageError) -> None:
        """A commit the state directory refused: training goes on (``storage_errors="skip"``).

        :attr:`step` stays ``step`` (the rows hold it) while :attr:`committed_step` stays the
        newest complete commit; the snapshot tier's chain is broken, so the next commit that
        succeeds is a full base: the rows this one would have written are in it."""
        self._skipped_commits += 1
        reason = _storage_reason(exc)
        metrics.commit_failed(reason)
        log.warning(
            "lifecycle.commit_skipped",
            step=step,
            committed_step=self.committed_step,
            reason=reason,
            skipped=self._skipped_commits,
            error=str(exc)[:300],
            remedy="free space in (or remount read-write) the state directory; commits resume by themselves",
        )

    # -- membership changes ------------------------------------------------------------------

    def on_membership_change(
        self,
        new_topology: Topology,
        store=None,
        *,
        rebuild: bool = False,
        abort: bool = False,
        mode: str | None = None,
        phases: Mapping[str, float] | None = None,
        background_base: bool = False,
    ) -> ResizeEvent:
        """Move to a new generation: ``reset`` at the same sizes, else commit, close, construct, restore.

        Same world and EP size with an open context: ``reset``. Otherwise the context is destroyed
        and a new one constructed, and every row is restored, resharded. The event is logged
        after the new world's first step (its next :meth:`commit`).

        Args:
            new_topology: the new generation of the same run.
            store: the new generation's store; None keeps the current one.
            rebuild: destroy and construct even at the same sizes (a fresh context and
                communicator).
            abort: a collective failed: abort the old context first, so the restore takes the
                newest commit, never rows that may hold part of an uncommitted step (a closed
                context is always rebuilt: ``reset`` needs an open one).
            mode: how the change was driven (``"in_process"``), for the event.
            phases: the driving caller's phases (``detect_s``, ``drain_s``, ``decide_s``), for the
                event.
            background_base: write the new generation's first commit (a full base) in the
                background and coalesce the commits due meanwhile, when the shards are large
                enough to pay; every rank of the new generation must pass the same.

        Returns:
            The change's :class:`ResizeEvent`, without ``first_step_s``; ``events[-1]`` gets the
            complete one after the first step.

        Raises:
            ValueError: ``new_topology`` is of another run or not of a later generation, or
                ``phases`` names a phase outside ``CALLER_PHASES``.
            ElasticEmbError: the lifecycle has no context (closed, or an earlier resize failed).
            TopologyDisagreement: the ranks do not hold the same new topology.
            AgreementTimeout: some ranks did not arrive within ``agree_timeout``.
            ContractViolation: the factory's new context lacks a member of ``ShardedContext``.
            RestoreError: no commit is complete for every row of the new generation.
        """
        store = self.store if store is None else store
        old = self.topology
        if new_topology.run_id != old.run_id:
            raise ValueError(f"new topology is for run {new_topology.run_id!r}, this lifecycle for {old.run_id!r}")
        if new_topology.generation <= old.generation:
            raise ValueError(
                f"new topology generation {new_topology.generation} must be > current "
                f"{old.generation}: each membership change is a new rendezvous round"
            )
        if set(phases or {}) - set(CALLER_PHASES):
            raise ValueError(f"phases {sorted(phases)} must be among {CALLER_PHASES}")
        self._finish_resize(stepped=False)  # a resize with no step since the last: log that one as it is
        store = signed_store(store, self._env)
        self._committer.first_base = None  # a window still open ends here: the live rows or the restore cover it
        t0 = time.perf_counter()
        ctx = self.context
        if abort or ctx is None or ctx.closed or not ctx.healthy:
            # A peer died: the commit in flight may wait for it (its replica, its exchange) up to
            # transfer_timeout and cannot complete; drop it instead of waiting for it.
            self._committer.abandon()
        if abort and ctx is not None and not ctx.closed:
            ctx.close(abort=True, wait=False)
        aborted = time.perf_counter() - t0
        same = (new_topology.world_size, new_topology.ep_size) == (old.world_size, old.ep_size)
        if same and not rebuild and (ctx is None or not ctx.closed):
            event = self._reform_same_size(new_topology, store)
        else:
            event = self._rebuild(new_topology, store)
        if background_base and first_base.wanted(self._require_context().tables, new_topology.world_size):
            self._committer.first_base = FirstBase(store, new_topology)
        event = completed_by_caller(event, aborted, mode, phases)
        self.events.append(event)
        self._unfinished = (len(self.events) - 1, time.perf_counter())
        metrics.resize(event, self.snapshot)
        return event

    def _finish_resize(self, *, stepped: bool) -> None:
        """Log the resize event waiting for its first step: with ``first_step_s`` when a step
        just ended (``commit``), without when the world closes or changes again first."""
        if self._unfinished is None:
            return
        index, ready = self._unfinished
        self._unfinished = None
        event = self.events[index]
        if stepped:
            event = event.model_copy(update={"first_step_s": round(time.perf_counter() - ready, 6)})
            self.events[index] = event
        log.info("lifecycle.resize", **event.model_dump())

    def _reform_same_size(self, new: Topology, store) -> ResizeEvent:
        """The only caller of ``reset``."""
        old = self.topology
        if (new.world_size, new.ep_size) != (old.world_size, old.ep_size):  # structural guard
            raise AssertionError(f"reset across sizes {old.world_size}->{new.world_size} must never happen")
        t0 = time.perf_counter()
        self.wait_durable()
        self._committer.close_writer()  # the commit in flight completes first: a graceful resize loses no step
        agree(new, store, timeout=self.config.agree_timeout)
        t1 = time.perf_counter()
        ctx = self._require_context()
        ctx.reset(new.rank, new.world_size, topology=new, store=store)
        t2 = time.perf_counter()
        self._committer.close_comm()
        self._enter(new, store)
        self._committer.default_group()
        report = RestoreReport(
            step=self.step, generation=new.generation, fingerprint=new.fingerprint(), source_tiers=["live"]
        )
        return self._event("reset", old, 0.0, t1 - t0, t2 - t1, 0.0, t2 - t0, report, False)

    def _rebuild(self, new: Topology, store) -> ResizeEvent:
        """Destroy and construct: the path for a new world or EP size. Never calls reset."""
        old = self.topology
        t0 = time.perf_counter()
        ctx = self._require_context()
        self.wait_durable()
        self._committer.close_writer()  # the commit in flight completes first: a graceful resize loses no step
        committed = False
        healthy = ctx.healthy and not ctx.closed
        # A commit is collective over the old world: only when nobody left (leavers commit before
        # they go, on a drain; ranks that died cannot). Otherwise restore takes the newest commit
        # complete across tiers, and the survivors' newer live rows wait for the next commit.
        if healthy and self._seen_step > self._committer.step and new.world_size >= old.world_size:
            try:
                self._committer.commit(self._seen_step)
                committed = True
            except Exception as exc:  # a peer is gone: the live rows still count, older commits cover the rest
                log.warning("lifecycle.resize_commit_failed", step=self._seen_step, error=repr(exc)[:300])
        live: list[ShardData] | None = None
        if not healthy:
            # A collective failed (a peer died mid-step): this rank's rows may hold part of a step
            # that was never committed, so they are not the state of any commit. Restore from the
            # committed tiers instead: restoring these rows could apply that step twice.
            log.warning(
                "lifecycle.live_rows_skipped",
                reason="context unhealthy: rows may hold a partial step",
                last_step=self._seen_step,
            )
        else:
            try:
                live = list(ctx.export_shard().values())
            except Exception as exc:
                log.warning("lifecycle.export_failed", error=repr(exc)[:300])
        live_commit = (
            (self._seen_step, old.generation, old.fingerprint()) if live is not None and self._seen_step >= 0 else None
        )
        self._committer.close_comm()
        # Ranks left: their ends of the communicator are gone without a destroy, and a destroy
        # waits for peers (NCCL); abort instead, on every survivor alike (docs/FACTS.md, NCCL).
        # wait=False: the communicator may be released in the background while the new one
        # forms (EmbContext does): NCCL's destroy is most of a serial rebuild.
        ctx.close(abort=True if new.world_size < old.world_size else None, wait=False)
        self.context = None
        t1 = time.perf_counter()
        agree(new, store, timeout=self.config.agree_timeout)
        self._enter(new, store)
        t2 = time.perf_counter()
        self.context = check_context(self.factory(new, store))
        t3 = time.perf_counter()
        same_rank = (new.rank, new.world_size) == (old.rank, old.world_size)  # the rank's own state is still its own
        report = self._restore(live=live, live_commit=live_commit, same_rank=same_rank)
        t4 = time.perf_counter()
        self.step = report.step
        return self._event("rebuild", old, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, report, committed)

    # -- restore -----------------------------------------------------------------------------

    def _restore(self, *, live, live_commit, same_rank: bool = False) -> RestoreReport:
        points.reached("lifecycle_restoring", self.topology.generation)  # drills: a node lost mid-restore
        ctx = self._require_context()
        comm = self._committer.comm_for(ctx)
        group = self._committer.default_group()
        report = restore(
            ctx,
            comm,
            snapshot=self.snapshot,
            durable=self.durable,
            live=live,
            live_commit=live_commit,
            require_state=self.config.require_state,
            start_fresh=self.config.start_fresh,
            durable_group=group,
            lineage=self.snapshot.lineage,  # the history the live rows belong to
        )
        # the rest of the training state, at the tables' step: kept by a survivor whose live rows
        # are that step, else read from this node's commit or received from a rank that has it
        app_live = live is not None and live_commit is not None and report.step == live_commit[0]
        source = app.restore(
            self.app_state,
            comm,
            self.snapshot,
            report.step,
            live=app_live,
            lineage=report.lineage,
            start_fresh=self.config.start_fresh,
            durable=self.durable,
        )
        if self.app_state:
            log.info("lifecycle.app_state_restored", step=report.step, source=source, names=list(self.app_state))
        # this rank's own state: only where it has a meaning (the same rank and world size)
        topo = self.topology
        source = app.restore_rank_state(
            self.rank_state,
            self.snapshot,
            report.step,
            rank=topo.rank,
            world_size=topo.world_size,
            live=app_live and same_rank,
            lineage=report.lineage,
        )
        if self.rank_state:
            log.info("lifecycle.rank_state_restored", step=report.step, source=source, names=list(self.rank_state))
        # the commits from here on belong to the history restored (state/lineage.py)
        self.snapshot.lineage = report.lineage
        if self.durable is not None:
            self.durable.lineage = report.lineage
        # Every rank of the new generation passes here (starters and rebuilders alike): the torn
        # commits of earlier generations will never complete, remove them.
        self.snapshot.prune(comm, at_start=True)
        log.info("lifecycle.restored", **report.as_dict())
        return report

    # -- the durable tier --------------------------------------------------------------------

    @property
    def durable_in_flight(self) -> bool:
        """Whether an asynchronous durable checkpoint is still being written (its manifest not yet)."""
        return self._committer.durable_in_flight

    def wait_durable(self, timeout: float | None = None) -> None:
        """Block until the asynchronous durable checkpoint in flight (if any) is written.

        A checkpoint that fails or outlasts ``timeout`` is logged, not raised: the snapshot tier
        still holds the commit.

        Args:
            timeout: seconds to wait at most; None waits up to ``transfer_timeout``.
        """
        self._committer.wait_durable(timeout)

    # -- draining ----------------------------------------------------------------------------

    def wait_for_restart(self, timeout: float) -> bool:
        """After a drain: block until the agent's SIGTERM or ``timeout`` seconds.

        In the main thread a SIGTERM handler is installed for the wait and the previous one put
        back afterwards.

        Args:
            timeout: seconds to wait at most.

        Returns:
            True when the SIGTERM came, False when the time ran out.

        Raises:
            ValueError: ``timeout`` is not positive.
        """
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        heartbeat.pause()  # waiting for the agent on purpose
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, lambda *_: self._sigterm.set())
            try:
                return self._sigterm.wait(timeout)
            finally:
                signal.signal(signal.SIGTERM, previous)
        return self._sigterm.wait(timeout)

    # -- teardown ----------------------------------------------------------------------------

    def __enter__(self) -> "Lifecycle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the commits in flight, then release everything.

        Raises:
            Exception: the error of a commit in flight that failed, raised after everything is
                released: like a synchronous :meth:`commit`, the caller learns that its last
                commit is not complete.
        """
        self._finish_resize(stepped=False)
        heartbeat.pause()  # what follows (the last commits, the exit barrier) is not a step
        failed = self._committer.close()  # the commits in flight complete first: a graceful end loses no step
        if self.context is not None:
            self.context.close()
            self.context = None
        self._committer.release_default_group()
        if failed is not None:
            raise failed

    # -- helpers -----------------------------------------------------------------------------

    def _require_context(self) -> ShardedContext:
        if self.context is None:
            raise ElasticEmbError("the lifecycle has no context (closed, or a resize failed): start a new Lifecycle")
        return self.context

    def _enter(self, topology: Topology, store) -> None:
        """This lifecycle's generation is now ``topology`` (on ``store``)."""
        self.topology, self.store = topology, store
        self._committer.enter(topology, store)
        bind_topology(topology)

    def _event(
        self,
        kind,
        old: Topology | None,
        teardown,
        agreement,
        construct,
        restore_s,
        total,
        report: RestoreReport,
        committed: bool,
    ) -> ResizeEvent:
        event = ResizeEvent.of(
            kind,
            old,
            self.topology,
            teardown=teardown,
            agreement=agreement,
            construct=construct,
            restore_s=restore_s,
            total=total,
            report=report,
            committed=committed,
        )
        if kind == "start":  # a resize's event is logged after its first step (on_membership_change)
            log.info("lifecycle.start", **event.model_dump())
            metrics.resize(event, self.snapshot)
        return event
