"""In-process resize: the survivors of a membership change re-form the world inside the running workers.

Under stock torchrun (``--rdzv-backend=elastic_emb --rdzv-conf resize=in_process``),
:class:`InProcessResize` sees a departure or a planned join at a step boundary (or after a failed
collective), has one decider publish the next generation's nodes, rebuilds through
:meth:`Lifecycle.on_membership_change`, and asks the agents for a restart-mode round when the
re-form fails. :meth:`InProcessResize.join` starts a worker whose node joins a running world.
After a resize a worker's rank and world size are ``lifecycle.topology``'s, not torchrun's.

Design: ``docs/RESIZE.md``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping

from elastic_emb import config
from elastic_emb.errors import ElasticEmbError, JobComplete, ResizeFallback
from elastic_emb.events import get_logger
from elastic_emb.inprocess.interruptible import InterruptibleStore, WaitGuard
from elastic_emb.inprocess.joiners import JoinPlan, raise_generations
from elastic_emb.inprocess.rollcall import Prober, RollCall, next_node, watch_neighbour
from elastic_emb.rdzv.job_complete import read_mark
from elastic_emb.rdzv.keys import (
    KEY_CURRENT,
    KEY_DECISION,
    KEY_FALLBACK,
    KEY_JOINER,
    inproc_prefix,
    inproc_root,
    round_prefix,
)
from elastic_emb.rdzv.outage import is_connection_error
from elastic_emb.rdzv.signed_cas import claim_signed
from elastic_emb.rdzv.signing import Signer, read_signed
from elastic_emb.state import points
from elastic_emb.topology import Topology, largest_power_of_two_at_most
from elastic_emb.watch import heartbeat

log = get_logger("elastic_emb.inprocess.resize")


def rank_of(node_index: int, local_rank: int, local_world_size: int) -> int:
    """The rank rule of an in-process re-form: a node's workers take the ranks of its place in the list.

    The joiner, the survivors and the give-up on departed nodes all count ranks this one way, so
    the survivors keep their relative order.

    Args:
        node_index: the node's place in the decided node list.
        local_rank: the worker's rank on its node.
        local_world_size: workers per node.

    Returns:
        ``node_index * local_world_size + local_rank``.
    """
    return node_index * local_world_size + local_rank


class InProcessResize:
    """Drives :meth:`Lifecycle.on_membership_change` from the watcher's view of the rendezvous.

    Enabled when ``ELASTIC_EMB_RESIZE`` is ``in_process`` and the watcher knows its node; then it
    also listens on this worker's liveness socket, watches the roll call's failure flag, and (on
    local rank 0) probes the next member node.

    Args:
        lifecycle: the worker's started :class:`~elastic_emb.lifecycle.manager.Lifecycle`.
        watcher: the worker's started :class:`~elastic_emb.watch.watcher.Watcher`, or None.
        env: the environment to read; None reads ``os.environ``.
        detect_timeout: seconds to wait, after a failed collective, for a departure to show (and
            for a member proven alive to answer the roll call).
        decide_timeout: seconds to wait for the decider's record of the next generation.
        store_timeout: the timeout of the new generations' store client.
        rollcall_grace: seconds to wait for a member's roll-call answer when nothing is known of
            it.

    Raises:
        ElasticEmbError: the worker's node is not in ``ELASTIC_EMB_MEMBERSHIP``.
        ConfigError: an ``ELASTIC_EMB_*`` variable is malformed.
    """

    def __init__(
        self,
        lifecycle,
        watcher,
        *,
        env: Mapping[str, str] | None = None,
        detect_timeout: float = 10.0,
        decide_timeout: float = 10.0,
        store_timeout: float = 30.0,
        rollcall_grace: float = 0.5,
    ) -> None:
        env = os.environ if env is None else env
        settings = config.load(env, "resize", "membership", "ep_size")
        self.lc = lifecycle
        self.watcher = watcher
        self.enabled = settings.resize == "in_process" and watcher is not None and watcher.node is not None
        self.detect_timeout = detect_timeout
        self.decide_timeout = decide_timeout
        self.rollcall_grace = rollcall_grace
        self._fixed_ep = settings.ep_size
        self._signer = Signer.from_env(env)
        self._store = None
        self._store_timeout = store_timeout
        self.nodes: tuple[str, ...] = tuple(settings.nodes() or ())
        # the joiners' registrations and the next generation's join plan, as read (joiners.py)
        self._join = JoinPlan(watcher._reader, self._signer) if self.enabled else None
        self._seen: tuple[float, float] | None = None  # the change first seen: (when, that check's seconds)
        if self.enabled and watcher.node not in self.nodes:
            raise ElasticEmbError(
                f"this worker's node {watcher.node!r} is not in ELASTIC_EMB_MEMBERSHIP {self.nodes}: "
                f"launch with --rdzv-backend=elastic_emb"
            )
        if self.enabled:  # a peer's failed collective ends this generation's store waits at once
            watcher.watch_failures(self._rollcall(lifecycle.topology.generation + 1).failed_key)
            watcher.on_failure = self._abort_context
            self._listen(lifecycle.topology, self.nodes)
        # set when the neighbour probe (rollcall.watch_neighbour) finds the next node dead, this generation
        self.neighbour_dead = threading.Event()
        if self.enabled and lifecycle.topology.local_rank == 0:
            watch_neighbour(self, InProcessResize._probe_neighbour, log)

    @classmethod
    def join(
        cls,
        factory,
        lifecycle_config,
        watcher,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        store_timeout: float = 30.0,
        app_state=None,
        rank_state=None,
    ):
        """Start a worker whose node joined a running world (``ELASTIC_EMB_JOINER=1``).

        Registers as ready, waits (bounded) until the running workers' decision includes this
        node, then starts the lifecycle in that generation: agree, construct and restore together
        with the running workers, which rebuild at the same time.

        Args:
            factory: builds the context, as for :meth:`Lifecycle.start`.
            lifecycle_config: the lifecycle's configuration, or None for the defaults.
            watcher: this worker's watcher (its reader, node and store).
            env: the environment to read; None reads ``os.environ``.
            timeout: seconds to wait to be included.
            store_timeout: the timeout of the new generation's store client.
            app_state: the job's app-state objects, as for :meth:`Lifecycle.start`: a joiner
                receives their state from a running worker.
            rank_state: this rank's own stateful objects, as for :meth:`Lifecycle.start`.

        Returns:
            ``(lifecycle, resize)``: the started lifecycle and this worker's
            :class:`InProcessResize`.

        Raises:
            ResizeFallback: not included within ``timeout``; the agents are asked for a
                restart-mode round.
            JobComplete: the job finished first (an agent marked it complete): the worker has
                nothing to do and should exit 0.
            Exception: what :meth:`Lifecycle.start` raises.
        """
        from elastic_emb.lifecycle.manager import Lifecycle

        env = dict(os.environ if env is None else env)
        signer = Signer.from_env(env)
        reader = watcher._reader
        store = reader.store
        root = inproc_root(reader.run_id)
        me = watcher.node
        points.reached("resize_joiner_registering", int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
        key = root + KEY_JOINER + me  # signed, under this node's id: no counter (joiners.py)
        store.set(key, signer.sign(key, me))
        log.info("resize.joiner_ready", node=me, key=key)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        look_for_end = 0.0
        while True:
            value = read_signed(store, signer, root + KEY_CURRENT, log)
            record = json.loads(value) if value is not None else {}
            if me in record.get("nodes", ()):
                break
            if time.monotonic() >= look_for_end:  # the running world finished first (its agents marked it)
                look_for_end = time.monotonic() + 0.1
                done = read_mark(store, signer, reader.run_id, log)
                if done is not None:
                    log.info(
                        "resize.job_complete_before_join",
                        node=me,
                        mark=done,
                        outcome="exit 0: the job finished before this node could join it",
                    )
                    raise JobComplete(
                        f"node {me}: the job finished before this node could join it "
                        f"(marked complete: {done}); nothing to do"
                    )
            if time.monotonic() >= deadline:
                # Nobody includes us (no running worker left, or it died deciding): ask the agents
                # for a restart-mode round, which starts a world with everyone.
                exc = ElasticEmbError(
                    f"node {me} registered to join the running world but was not included within "
                    f"{timeout:g} s (no running worker calls InProcessResize.pending(), or it died)"
                )
                _request_fallback(watcher, signer, exc)
                raise ResizeFallback(str(exc)) from exc
            time.sleep(0.005)  # the running workers' agreement waits for this worker: its pause
        nodes = tuple(str(n) for n in record["nodes"])
        lws, local = int(env["LOCAL_WORLD_SIZE"]), int(env["LOCAL_RANK"])
        node_rank = nodes.index(me)
        rank, world = rank_of(node_rank, local, lws), len(nodes) * lws
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            GROUP_RANK=str(node_rank),
            GROUP_WORLD_SIZE=str(len(nodes)),
            MASTER_ADDR=str(record["master_addr"]),
            MASTER_PORT=str(record["master_port"]),
            ELASTIC_EMB_GENERATION=str(record["generation"]),
        )
        watcher.adopt(nodes, rank, world)
        world_store = InterruptibleStore(reader.world_store(store_timeout), WaitGuard(watcher))
        lc = Lifecycle.start(
            factory,
            lifecycle_config,
            env=env,
            store=world_store,
            watcher=watcher,
            background_base=True,
            app_state=app_state,
            rank_state=rank_state,
        )  # as the running workers' re-form (first_base.py)
        resize = cls(lc, watcher, env={**env, "ELASTIC_EMB_MEMBERSHIP": json.dumps(list(nodes))})
        resize._store = world_store
        log.info(
            "resize.joined",
            mode="in_process",
            node=me,
            generation=record["generation"],
            rank=rank,
            world_size=world,
            wait_s=round(time.perf_counter() - t0, 6),
            pid=os.getpid(),
        )
        return lc, resize

    def pending(self) -> bool:
        """Whether to re-form at this step boundary (check at every one: one or two store reads).

        A departure re-forms at once. A join re-forms only after the step the planner's published
        plan names, so that every worker re-forms at the same boundary; the planner publishes
        that plan here when joiners are ready (``docs/RESIZE.md``, section "The join plan").

        Returns:
            True when a member node of this generation is gone from the rendezvous, a collective
            failed, or the join plan's step has been taken: call :meth:`run`.
        """
        if not self.enabled:
            return False
        t0 = time.perf_counter()
        if self.departure_seen():
            self._saw(t0)
            return True
        plan = self._current_plan(publish=True)
        if plan is not None:
            self._saw(t0)
        return plan is not None and self.lc.step >= plan["after_step"]

    def departure_seen(self) -> bool:
        """Whether this worker already knows a member is gone; memory only, no store read.

        Returns:
            True when the watcher's last view lacks a member, a collective failed, or the
            neighbour probe found the next node dead.
        """
        return self.enabled and bool(self._gone() or self.watcher.failure_seen or self.neighbour_dead.is_set())

    def _current_plan(self, *, publish: bool) -> dict | None:
        """The next generation's join plan, or None; with ``publish``, the planner first publishes
        one when joiners are ready. None too while the store is down (etcd restarting): the
        collectives do not need it, so training goes on; the watcher counts the outage, and past
        its bound the agent stops this worker."""
        try:
            plan = self._read_plan()
            if plan is None and publish and self._is_planner() and self._ready_joiners():
                plan = self._join.publish(self.lc.topology.generation + 1, self.lc.next_step, self._ready_joiners())
            return plan
        except Exception as exc:
            if not is_connection_error(exc):
                raise
            self.watcher._store_failed(exc)
            return None

    def planned(self) -> bool:
        """Whether a join plan for the next generation is published.

        A worker that idles between steps then takes the plan's ``after_step`` and re-forms at
        :meth:`pending`.

        Returns:
            True when the plan is published (False when in-process resize is off, or while the
            store is unreachable: the outage is the watcher's to count, as at a step boundary).
        """
        return self.enabled and self._current_plan(publish=False) is not None

    def _probe_neighbour(self) -> None:
        """A tick of the neighbour probe (``rollcall.watch_neighbour``, local rank 0 only): a
        worker of the next member node refuses its liveness connection (dead, no collective in
        flight to fail, or one that gloo leaves blocked until its timeout). The context's waits
        end now (``interrupt``); the next :meth:`pending` re-forms, as after a failed collective
        (a peer that finished training and exited refuses too: nothing past the last step)."""
        prober, lc = self.watcher.prober, self.lc
        ctx = lc.context
        gen = lc.topology.generation
        if prober is None or self.neighbour_dead.is_set() or ctx is None or ctx.closed or prober.generation != gen:
            return  # no socket, already found, closed, or mid re-form (the roll call probes then)
        dead = prober.dead(next_node(prober.members, self.watcher.node), prober.local_world_size)
        if dead and lc.topology.generation == gen:
            self.neighbour_dead.set()
            log.warning("resize.neighbour_dead", nodes=list(dead), generation=gen, remedy="re-forming without it")
            # a collective, or the commit in flight, blocked on it ends now, not at a timeout
            lc.interrupt(f"node {dead[0]} refused its liveness connection (dead)")

    def _abort_context(self) -> None:
        """The watcher's thread, when a peer's collective failed: abort this worker's
        communicator, so a collective it may be blocked in (a dead peer's connection that gloo
        does not see closed) fails now, not at its timeout; the commit in flight's store waits
        end too (``Lifecycle.interrupt``)."""
        ctx = self.lc.context
        if ctx is not None and not ctx.closed:
            try:
                self.lc.interrupt("a peer's collective failed")
                ctx.close(abort=True, wait=False)
            except Exception as exc:  # the main thread's own abort and its re-form still follow
                log.warning("resize.abort_failed", error=repr(exc)[:300])

    def _listen(self, topology: Topology, nodes: tuple[str, ...]) -> None:
        """This worker's liveness socket (``rollcall.Prober``), once per process."""
        watcher = self.watcher
        if watcher.prober is None:
            prober = Prober(watcher._reader.store, watcher._reader.run_id, self._signer, log)
            try:
                prober.listen(watcher.node, topology.local_rank)
                watcher.prober = prober
            except OSError as exc:  # the roll call's grace and the heartbeat still find the dead
                log.warning("liveness_socket_unavailable", node=watcher.node, error=repr(exc))
                return
        watcher.prober.enter(topology.generation, nodes, topology.local_world_size)

    def _rollcall(self, generation: int) -> RollCall:
        return RollCall(self.watcher._reader.store, self.watcher._reader.run_id, generation, self._signer, log)

    def _roll_call(self, old: Topology) -> tuple[str, ...]:
        """After a failed collective: abort the old communicator first (a survivor still blocked
        in the collective fails at once too), answer the roll call of the next generation and
        return the member nodes gone or silent (``rollcall.py``)."""
        ctx = self.lc.context
        if ctx is not None and not ctx.closed:
            ctx.close(abort=True, wait=False)
        reader = self.watcher._reader
        raise_generations(reader.store, reader.run_id, old.generation + 1, self._signer)  # before any key of it
        roll = self._rollcall(old.generation + 1)
        roll.answer(self.watcher.node, old.local_rank)
        return roll.absent(
            self.nodes,
            old.local_world_size,
            self._gone,
            self.rollcall_grace,
            self.watcher.prober,
            patience=self.detect_timeout,
        )

    def join_due(self) -> bool:
        """At the end of training: whether a join plan asks to re-form after the step just taken.

        The planner published it at the boundary before the last step, so every worker saw it
        before that step's collective; without this re-form the joiner would wait to be included
        by a world that has finished. Departures are not acted on here: with no collective left,
        the workers could disagree on them.

        Returns:
            True when the worker should call :meth:`run` once more.
        """
        if not self.enabled:
            return False
        plan = self._current_plan(publish=False)
        return plan is not None and self.lc.step >= plan["after_step"]

    def _saw(self, t0: float) -> None:
        if self._seen is None:  # the first check that saw this change: detection ends, drain starts
            now = time.perf_counter()
            self._seen = (now, now - t0)

    def _is_planner(self) -> bool:
        return bool(self.nodes) and self.watcher.node == self.nodes[0] and self.lc.topology.local_rank == 0

    def _read_plan(self) -> dict | None:
        return self._join.read(self.lc.topology.generation + 1)

    def _ready_joiners(self) -> list[str]:
        view = self.watcher.last_state
        return self._join.ready(self.nodes, list(view.nodes) if view is not None else [])

    def _gone(self) -> tuple[str, ...]:
        # A node in the wait list is restarting (its worker crashed and its agent rejoins): that
        # is torch's restart mode for every agent, not a departure to re-form without.
        view = self.watcher.last_state
        if view is None:
            return ()
        return tuple(n for n in self.nodes if n not in view.nodes and n not in view.wait_list)

    def run(self, *, failed: bool = False, rebuild: bool = False):
        """Re-form the world without the departed nodes and with the planned joiners.

        Args:
            failed: a collective raised (a peer's failure, ``Watcher.failure_seen``, and a dead
                neighbour count too): the old communicator is aborted and the members answer a
                roll call; a node whose worker's liveness socket refuses is gone at once, one
                proven alive is waited for up to ``detect_timeout``, one unknown up to
                ``rollcall_grace``. If every member answers, the rendezvous is watched (bounded by
                ``detect_timeout``) for a departure.
            rebuild: construct a fresh context even when the sizes stay.

        Returns:
            The lifecycle's :class:`~elastic_emb.lifecycle.records.ResizeEvent` (its
            ``first_step_s`` comes with the next ``commit``).

        Raises:
            ElasticEmbError: in-process resize is off, or a collective failed and no member left
                within ``detect_timeout`` (a real failure, not a resize).
            ResizeFallback: the re-form failed (no decision in time, this worker not in it, an
                error while rebuilding); the agents are asked for a restart-mode round.
        """
        if not self.enabled:
            raise ElasticEmbError("in-process resize is off: launch with --rdzv-conf resize=in_process")
        heartbeat.pause()  # a re-form's waits are bounded by their own timeouts; the next commit re-arms it
        t0 = time.perf_counter()
        seen, self._seen = self._seen, None
        failed = failed or self.watcher.failure_seen or self.neighbour_dead.is_set()
        deadline = time.monotonic() + (self.detect_timeout if failed else 0.0)
        gone = self._roll_call(self.lc.topology) if failed else self._gone()
        if gone and not failed:
            # A commit in flight may wait for these nodes' part; once their heads are out of the
            # rendezvous they will never send it, and after the decision below (watcher.adopt) no
            # store guard calls them members: give up on what they have not sent (a drained node
            # sent all of it before it left, so a graceful resize still loses no step).
            lws = self.lc.topology.local_world_size
            self.lc.give_up_on(
                [rank_of(i, r, lws) for i, n in enumerate(self.nodes) if n in gone for r in range(lws)],
                f"nodes {list(gone)} left the rendezvous",
            )
            # a survivor whose probe saw the same departure first holds a roll call
            reader = self.watcher._reader
            raise_generations(
                reader.store, reader.run_id, self.lc.topology.generation + 1, self._signer
            )  # before any key of it
            self._rollcall(self.lc.topology.generation + 1).present(self.watcher.node, self.lc.topology.local_rank)
        plan = None if failed else self._read_plan()
        joiners = [str(n) for n in plan["joiners"]] if plan is not None else []
        while not gone and not joiners and time.monotonic() < deadline:
            time.sleep(min(0.05, self.watcher.interval))
            gone = self._gone()
        if not gone and not joiners:
            raise ElasticEmbError(
                f"a collective failed and no node of generation {self.lc.topology.generation} left "
                f"the rendezvous within {self.detect_timeout:g} s: a real failure"
            )
        t1 = time.perf_counter()
        old = self.lc.topology
        try:
            survivors = tuple(n for n in self.nodes if n not in gone)
            nodes = self._decide(old.generation + 1, survivors, tuple(joiners))
            t2 = time.perf_counter()
            new = self._topology(old, nodes)
            # The decision is final: from here on "a member is gone" means one of these nodes, and
            # a failed collective is one of the new generation.
            self.watcher.adopt(nodes, new.rank, new.world_size)
            self.watcher.watch_failures(self._rollcall(new.generation + 1).failed_key)
            self._listen(new, nodes)  # the probes now cover these members, nothing found dead yet
            # failed: the failed step may have changed this rank's rows without a commit: the
            # lifecycle aborts the old context first and restores the newest commit, not these rows.
            # Detect: the check that first saw the change (none after a failed collective) plus the
            # wait here; drain: from that check to this step boundary.
            phases = {
                "detect_s": (seen[1] if seen is not None else 0.0) + (t1 - t0),
                "drain_s": max(0.0, t0 - seen[0]) if seen is not None else 0.0,
                "decide_s": t2 - t1,
            }
            event = self.lc.on_membership_change(
                new,
                store=self._world_store(),
                rebuild=rebuild,
                abort=failed,
                mode="in_process",
                phases=phases,
                background_base=True,
            )
        except Exception as exc:
            self._fall_back(exc)
            raise ResizeFallback(
                f"in-process resize from generation {old.generation} failed ({type(exc).__name__}: "
                f"{exc}); the agents restart the workers instead"
            ) from exc
        t3 = time.perf_counter()
        self.nodes = nodes
        self.neighbour_dead.clear()  # the new generation's neighbour is probed from now on
        self._join.included(nodes)
        log.info(
            "resize.in_process",
            mode="in_process",
            gone=list(gone),
            joined=list(joiners),
            old_generation=old.generation,
            new_generation=new.generation,
            old_world_size=old.world_size,
            new_world_size=new.world_size,
            rank=new.rank,
            pid=os.getpid(),
            detect_s=round(t1 - t0, 6),
            decide_s=round(t2 - t1, 6),
            rebuild_s=round(t3 - t2, 6),
            restored_step=event.restored_step,
        )
        return event

    # -- the decision --------------------------------------------------------------------------

    def _decide(self, generation: int, survivors: tuple[str, ...], joiners: tuple[str, ...] = ()) -> tuple[str, ...]:
        if not survivors:
            raise ElasticEmbError("no surviving node")
        store = self.watcher._reader.store
        prefix = inproc_prefix(self.watcher._reader.run_id, generation)
        key = prefix + KEY_DECISION
        me = self.watcher.node
        if me == survivors[0] and self.lc.topology.local_rank == 0:
            raise_generations(store, self.watcher._reader.run_id, generation, self._signer)  # before any key of it
            points.reached("resize_decider_claimed", generation)  # tests: the decider dies mid-decision
            old = self.lc.topology
            record = json.dumps(
                {
                    "generation": generation,
                    "nodes": list(survivors) + list(joiners),
                    "master_addr": old.master_addr,
                    "master_port": old.master_port,
                }
            )
            if claim_signed(store, self._signer, key, record, self.decide_timeout, log):
                current = inproc_root(self.watcher._reader.run_id) + KEY_CURRENT
                store.set(current, self._signer.sign(current, record))  # where joiners look
        deadline = time.monotonic() + self.decide_timeout
        pause = 0.001
        while True:
            value = read_signed(store, self._signer, key, log)
            if value is not None:
                record = json.loads(value)
                if record.get("generation") != generation or not isinstance(record.get("nodes"), list):
                    raise ElasticEmbError(f"decision under {key} is malformed: {value[:200]!r}")
                nodes = tuple(str(n) for n in record["nodes"])
                if me not in nodes:
                    raise ElasticEmbError(f"node {me} is not in generation {generation}'s decision {nodes}")
                return nodes
            if time.monotonic() >= deadline:
                raise ElasticEmbError(
                    f"no decision for generation {generation} under {key} within "
                    f"{self.decide_timeout:g} s (the decider, node {survivors[0]}, died or is stuck)"
                )
            view = self.watcher.last_state
            if me != survivors[0] and view is not None and survivors[0] not in view.nodes:
                # its worker died deciding and its agent left the round to rejoin (rdzv/rejoin.py):
                # no decision can come; fall back now rather than after decide_timeout
                raise ElasticEmbError(
                    f"the decider of generation {generation}, node {survivors[0]}, left the "
                    f"rendezvous before publishing the decision under {key}"
                )
            time.sleep(pause)  # every survivor waits here: part of the pause
            pause = min(0.005, pause * 2)

    def _topology(self, old: Topology, nodes: tuple[str, ...]) -> Topology:
        lws = old.local_world_size
        world = len(nodes) * lws
        ep = (
            self._fixed_ep
            if self._fixed_ep is not None and self._fixed_ep <= world
            else largest_power_of_two_at_most(world)
        )
        node_rank = nodes.index(self.watcher.node)
        return Topology(
            **{
                **old.model_dump(),
                "generation": old.generation + 1,
                "world_size": world,
                "num_nodes": len(nodes),
                "node_rank": node_rank,
                "rank": rank_of(node_rank, old.local_rank, lws),
                "ep_size": ep,
            }
        )

    def _world_store(self):
        if self._store is None:
            watcher = self.watcher
            self._store = InterruptibleStore(watcher._reader.world_store(self._store_timeout), WaitGuard(watcher))
        return self._store

    def _fall_back(self, exc: BaseException) -> None:
        _request_fallback(self.watcher, self._signer, exc, generation=self.lc.topology.generation)


def _request_fallback(watcher, signer: Signer, exc: BaseException, generation: int | None = None) -> None:
    """Ask every agent for a restart-mode round (the signed fallback key of the running round)."""
    reason = f"{type(exc).__name__}: {exc}"[:500]
    log.error("resize_fallback", mode="restart", generation=generation, reason=reason)
    try:
        key = round_prefix(watcher._reader.run_id, watcher.round) + KEY_FALLBACK
        watcher._reader.store.set(key, signer.sign(key, reason))
    except Exception as store_exc:  # the agents' heartbeat/failure paths still end this world
        log.error("resize_fallback_unsent", error=repr(store_exc))
