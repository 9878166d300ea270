"""Lifecycle: build a context for an agreed topology, commit its rows, and on a resize destroy it,
construct a new one, and carry every row and optimizer slot across, resharded.

The one rule: ``reset`` is for a same-size re-form only. :meth:`Lifecycle.on_membership_change`
branches once on ``(world_size, ep_size)``: equal, it calls :meth:`_reform_same_size` (the only
place ``reset`` is called, and it checks the sizes again); different, it calls
:meth:`_rebuild`, which has no reference to ``reset`` at all: commit (if the context is healthy
and has uncommitted progress), export the live shard, close, agree on the new topology,
construct, restore. A context that refuses ``reset`` across sizes (``WorldSizeChanged``) is
therefore never asked to.

Start (:meth:`Lifecycle.start`): topology from the environment, agree over the store,
construct, then the same restore as a resize, minus the live tier: the newest commit that is
complete for every row across the node snapshots (own and replicas) and the durable tier, with
checksums verified. With no state anywhere, the context keeps its seeded initial rows (the
context decides those; ``EmbContext`` makes them identical whatever the world size).

Commits (:meth:`Lifecycle.commit`, at step boundaries): every ``commit_every`` steps a node
snapshot (+ replicas), every ``durable_every`` steps also a DCP checkpoint. Call ``commit(step)``
after *every* step: the cadence decides what is written, and the lifecycle learns how far
training got, which tells a resize whether the live rows are newer than the last commit.
Incremental commits are asynchronous by default: ``commit()`` returns once the rows are captured
and a background writer completes them (``committed_step``); how a due commit is written (tiers,
the writer, the committed step) is ``committer.py``. After an in-process re-form the new generation's first commit (a full base) is
written in the background and the commits due meanwhile are coalesced into one delta
(``first_base.py``).

Each resize logs one ``lifecycle.resize`` event (and returns it as :class:`ResizeEvent`): phase
durations (teardown, agreement, construct, restore, and the first step), bytes moved, source
tiers, steps. The event waits for the first step of the new world: it is logged when training
calls ``commit()`` next (``first_step_s``: restore done -> that call), or, when no step follows,
at the next resize or ``close()`` (``first_step_s`` null). ``on_membership_change`` returns it at
once without ``first_step_s``; ``events[-1]`` gets the complete one. A caller that drives the
change (``resize.InProcessResize``) passes the phases before it: detect, drain, decide.

A user context plugs in through :class:`elastic_emb.protocol.ShardedContext` and a factory
``(topology, store) -> context``; the lifecycle checks at construction that the context has every
member of the contract (:func:`elastic_emb.protocol.check_context`) and then uses them as
declared. Its ``process_group`` (when not None) carries row transfers; otherwise the state layer
forms a gloo group of its own per generation. ``shard_views()`` (when not None) lets restore
write rows in place instead of into a copy that ``import_shard`` copies again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

from elastic_emb import metrics
from elastic_emb.lifecycle.committer import Committer
from elastic_emb.errors import ElasticEmbError
from elastic_emb.events import bind_topology, get_logger
from elastic_emb.lifecycle import first_base
from elastic_emb.lifecycle.first_base import FirstBase
from elastic_emb.lifecycle.records import (
    CALLER_PHASES,
    CommitReport,
    LifecycleConfig,
    ResizeEvent,
    completed_by_caller,
)
from elastic_emb.protocol import ContextFactory, ShardData, ShardedContext, check_context
from elastic_emb.state import RestoreReport, points, restore
from elastic_emb.topology import Topology, agree

log = get_logger("elastic_emb.lifecycle.manager")


class Lifecycle:
    """See the module docstring. Build with :meth:`start`."""

    def __init__(self, factory: ContextFactory, config: LifecycleConfig, topology: Topology, store,
                 watcher=None, env: Mapping[str, str] | None = None) -> None:
        self.factory = factory
        self.config = config
        self.topology = topology
        self.store = store
        self.watcher = watcher
        self.context: ShardedContext | None = None
        self._seen_step = -1
        self.draining = False
        self.events: list[ResizeEvent] = []
        self._sigterm = threading.Event()
        self._unfinished: tuple[int, float] | None = None  # (index in events, restore done): first step pending
        # how commits are written: tiers, writer, communicators, the committed step (committer.py)
        self._committer = Committer(config, topology, store, self._require_context)
        self.snapshot = self._committer.snapshot
        self.durable = self._committer.durable

    # -- start -------------------------------------------------------------------------------

    @classmethod
    def start(cls, factory: ContextFactory, config: LifecycleConfig | None = None, *,
              env: Mapping[str, str] | None = None, store=None, watcher=None,
              background_base: bool = False) -> "Lifecycle":
        """Topology from env -> agree -> construct -> restore the newest complete commit.

        ``background_base``: this worker joins a generation formed in process, whose running
        workers may write its first base in the background (``on_membership_change``): so does
        it, by the same rule."""
        env = os.environ if env is None else env
        config = (config or LifecycleConfig()).resolved(env)
        t0 = time.perf_counter()
        topology = Topology.from_env(env)
        bind_topology(topology)
        if store is None:
            from elastic_emb.store import worker_store

            store = worker_store(topology, timeout=config.agree_timeout, env=env)
        lc = cls(factory, config, topology, store, watcher=watcher, env=env)
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
        lc._seen_step = report.step
        if background_base and first_base.wanted(lc.context.tables, topology.world_size):
            lc._committer.first_base = FirstBase(store, topology)
        event = lc._event("start", None, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, report, False)
        lc.events.append(event)
        return lc

    # -- properties --------------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        return self.step + 1

    @property
    def step(self) -> int:
        """The last step training finished that the lifecycle took (committed, in flight, or
        coalesced in a first-base window); -1 before the first."""
        return self._committer.step

    @step.setter
    def step(self, value: int) -> None:
        self._committer.step = value

    @property
    def committed_step(self) -> int:
        """The newest step whose commit is complete (its manifests written on its own node and on
        its replica holders); -1 before the first. Synchronous commits (``async_commit=False``) complete
        inside ``commit()``; by default the commit in flight completes in the background."""
        return self._committer.committed_step

    def wait_commit(self) -> int:
        """Block until the commit in flight (``async_commit``) is complete; raise its error if it
        failed (the lifecycle then counts the step before it as the last committed one).
        Returns :attr:`committed_step`."""
        return self._committer.wait()

    def interrupt(self, reason: str) -> None:
        """A peer is known gone (called from another thread: the in-process resize's neighbour
        probe, a peer's failed collective): the context's waits end now (``interrupt``) and so do
        those of the generation's state communicators (:meth:`Committer.interrupt`: the commit in
        flight, a restore's row moves), so the training thread raises at once instead of at a
        timeout, and the re-form follows."""
        ctx = self.context
        if ctx is not None and hasattr(ctx, "interrupt"):
            ctx.interrupt(reason)
        self._committer.interrupt(reason)

    def give_up_on(self, ranks, reason: str) -> None:
        """Ranks of the current generation left the rendezvous (the in-process resize, before it
        re-forms without them): the commit in flight stops waiting for what they will never send
        (:meth:`Committer.give_up_on`); what they finished before leaving still completes."""
        self._committer.give_up_on(ranks, reason)

    # -- commits -----------------------------------------------------------------------------

    def commit(self, step: int, *, force: bool = False) -> CommitReport | None:
        """Record that training finished ``step``; write the tiers the cadence asks for.

        Collective: every rank calls it with the same ``step``. Returns None when nothing was
        written. After a commit, a drain requested by the watcher is acknowledged and
        :attr:`draining` becomes True."""
        self._finish_resize(stepped=True)  # the first step after a resize ends here
        if step <= self.step:
            raise ValueError(f"step={step} was already committed (last committed step {self.step}); "
                             f"steps must increase: resume at lifecycle.next_step={self.next_step}")
        self._seen_step = max(self._seen_step, step)
        if self.watcher is not None and self.watcher.evicted:
            raise ElasticEmbError(f"rank {self.topology.rank} was evicted from the job: it must not commit step "
                                  f"{step}; exit and let the agent restart it")
        drain = bool(self.watcher is not None and self.watcher.drain_requested(step))
        due = force or drain or step % self.config.commit_every == 0
        report = self._committer.due(step, forced=force or drain) if due else None
        if drain:
            self.wait_commit()  # a drain acknowledges a complete commit, never one in flight
            self.watcher.ack_drain(step)
            self.draining = True
            log.info("lifecycle.draining", step=step)
        return report

    # -- membership changes ------------------------------------------------------------------

    def on_membership_change(self, new_topology: Topology, store=None, *, rebuild: bool = False,
                             abort: bool = False, mode: str | None = None,
                             phases: Mapping[str, float] | None = None, background_base: bool = False) -> ResizeEvent:
        """Same world and EP size, open context: ``reset``. Otherwise: commit, close, construct,
        restore.

        ``rebuild``: destroy and construct even at the same sizes (a fresh context and
        communicator). ``abort``: a collective failed; abort the old context first, so the
        restore takes the newest commit, never rows that may hold part of an uncommitted step
        (a closed context is always rebuilt: ``reset`` needs an open one).
        ``mode`` and ``phases`` (``detect_s``, ``drain_s``, ``decide_s``) come from the caller that
        drove the change and go into the event, which is logged after the first step (module
        docstring). ``background_base``: the new generation's first commit (a full base) is
        written in the background and the commits due meanwhile are coalesced, when the shards
        are large enough to pay (``first_base.py``); every rank of the new generation must pass
        the same (the in-process resize does, and its joiners' ``start``)."""
        store = self.store if store is None else store
        old = self.topology
        if new_topology.run_id != old.run_id:
            raise ValueError(f"new topology is for run {new_topology.run_id!r}, this lifecycle for {old.run_id!r}")
        if new_topology.generation <= old.generation:
            raise ValueError(f"new topology generation {new_topology.generation} must be > current "
                             f"{old.generation}: each membership change is a new rendezvous round")
        if set(phases or {}) - set(CALLER_PHASES):
            raise ValueError(f"phases {sorted(phases)} must be among {CALLER_PHASES}")
        self._finish_resize(stepped=False)  # a resize with no step since the last: log that one as it is
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
        report = RestoreReport(step=self.step, generation=new.generation, fingerprint=new.fingerprint(),
                               source_tiers=["live"])
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
        if healthy and self._seen_step > self.step and new.world_size >= old.world_size:
            try:
                self._committer.commit(self._seen_step)
                committed = True
            except Exception as exc:  # a peer is gone: the live rows still count, older commits cover the rest
                log.warning("lifecycle.resize_commit_failed", step=self._seen_step, error=repr(exc)[:300])
        live: list[ShardData] | None = None
        if not healthy:
            # A collective failed (a peer died mid-step): this rank's rows may hold part of a step
            # that was never committed, so they are not the state of any commit. Restore from the
            # committed tiers instead (found by tests/test_ep8.py: a step applied twice).
            log.warning("lifecycle.live_rows_skipped", reason="context unhealthy: rows may hold a partial step",
                        last_step=self._seen_step)
        else:
            try:
                live = list(ctx.export_shard().values())
            except Exception as exc:
                log.warning("lifecycle.export_failed", error=repr(exc)[:300])
        live_commit = (self._seen_step, old.generation, old.fingerprint()) if live is not None and self._seen_step >= 0 else None
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
        report = self._restore(live=live, live_commit=live_commit)
        t4 = time.perf_counter()
        self.step = report.step
        self._seen_step = report.step
        return self._event("rebuild", old, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, report, committed)

    # -- restore -----------------------------------------------------------------------------

    def _restore(self, *, live, live_commit) -> RestoreReport:
        points.reached("lifecycle_restoring", self.topology.generation)  # drills: a node lost mid-restore
        ctx = self._require_context()
        comm = self._committer.comm_for(ctx)
        group = self._committer.default_group()
        report = restore(ctx, comm, snapshot=self.snapshot, durable=self.durable, live=live,
                         live_commit=live_commit, require_state=self.config.require_state,
                         start_fresh=self.config.start_fresh, durable_group=group)
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
        """Block until the asynchronous durable checkpoint in flight (if any) is written."""
        self._committer.wait_durable(timeout)

    # -- draining ----------------------------------------------------------------------------

    def wait_for_restart(self, timeout: float) -> bool:
        """After a drain: block until the agent's SIGTERM (True) or ``timeout`` seconds (False)."""
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
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
        """Wait for the commits in flight, then release everything. Raises the error of a
        commit in flight that failed (after releasing): like a synchronous ``commit()``, the
        caller learns that its last commit is not complete."""
        self._finish_resize(stepped=False)
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

    def _event(self, kind, old: Topology | None, teardown, agreement, construct, restore_s, total,
               report: RestoreReport, committed: bool) -> ResizeEvent:
        event = ResizeEvent.of(kind, old, self.topology, teardown=teardown, agreement=agreement, construct=construct,
                               restore_s=restore_s, total=total, report=report, committed=committed)
        if kind == "start":  # a resize's event is logged after its first step (on_membership_change)
            log.info("lifecycle.start", **event.model_dump())
            metrics.resize(event, self.snapshot)
        return event
