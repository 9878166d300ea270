"""Agent side: a torchrun rendezvous backend that sees every membership change.

``torchrun --rdzv-backend=elastic_emb --rdzv-conf=inner=c10d,...`` selects it through the
``torchrun.handlers`` entry point (:func:`handler_factory`). :class:`ElasticEmbRendezvousHandler`
wraps torch's dynamic rendezvous (``inner=c10d``, ``etcd-v3`` or ``etcd-v2``) and adds events, the
round and membership in the workers' environment, scale-down detection and a drain before a
scale-up. Importing this module has no side effect: torch imports it in every process that
imports its rendezvous package.

Design: ``docs/RDZV.md`` (section "The handler"); the ``--rdzv-conf`` keys: ``docs/CONFIG.md``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from elastic_emb import metrics
from elastic_emb.config import load
from elastic_emb.errors import ConfigError
from elastic_emb.events import event_logger
from elastic_emb.native_calls import exiting, native_call
from elastic_emb.rdzv.conf import INNER_BACKENDS, ListenerConfig, check_run_id, config_error
from elastic_emb.rdzv.decode import RendezvousView, node_id
from elastic_emb.rdzv.drain_acks import AckCounter, read_expected, read_local_count
from elastic_emb.rdzv.fingerprint import JobFingerprint, check_fingerprint, live
from elastic_emb.rdzv.guarded import GuardedBackend, GuardedStore
from elastic_emb.rdzv.hang import HangWatchdog
from elastic_emb.rdzv.job_complete import (
    CompletingExitBarrierStore,
    CompletingStore,
    closed_and_complete,
    mark_complete,
)
from elastic_emb.rdzv.keys import (
    BACKEND_NAME,
    DISABLE_SHARED_STORE,
    ENV_AGENT_PID,
    ENV_DRAIN,
    ENV_DRAIN_COUNT_FILE,
    ENV_GENERATION,
    ENV_JOINER,
    ENV_MEMBERSHIP,
    ENV_NODE_ID,
    ENV_PROGRESS_FILE,
    ENV_RDZV_BACKEND,
    ENV_RDZV_ENDPOINT,
    ENV_RESIZE,
    ENV_ROUND,
    ENV_STORE_OUTAGE_TIMEOUT,
    ENV_WATCH_INTERVAL,
    KEY_DRAIN,
    KEY_FALLBACK,
    KEY_GENERATION_MARK,
    KEY_LEFT,
    KEY_ROUND_GENERATION,
    KEY_STOP_STEP,
    inproc_root,
    round_prefix,
    write_priority_key,
)
from elastic_emb.rdzv.liveness import Liveness
from elastic_emb.rdzv.localfile import remove_quietly
from elastic_emb.rdzv.outage import OutageGuard, StoreOutageError, reraise_signal, torch_store_outage_error
from elastic_emb.rdzv.rejoin import leave_for_rejoin
from elastic_emb.rdzv.round_start import RoundStartStore
from elastic_emb.rdzv.signed_cas import parse_mark, read_mark
from elastic_emb.rdzv.signing import Signer, read_signed
from elastic_emb.rdzv.write_priority import WritePriority


def _signal_in_flight() -> BaseException | None:
    """The agent's SignalException if one is being handled or propagated now, also when a later
    error masks it (found in the chain of ``__context__`` / ``__cause__``); None otherwise."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    exc, seen = sys.exc_info()[1], 0
    while exc is not None and seen < 16:  # bounded: a chain can be cyclic
        if isinstance(exc, SignalException):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class ElasticEmbRendezvousHandler:
    """A ``RendezvousHandler`` that delegates to torch's dynamic rendezvous and adds events,
    worker environment, scale-down detection and drain gating.

    Attributes it does not define are torch's handler's.

    Args:
        inner: torch's ``DynamicRendezvousHandler`` (``torch_compat.create_inner_handler``).
        config: the backend's ``--rdzv-conf`` keys.
        endpoint: the rendezvous endpoint (passed to the workers).
        guard: the outage guard the inner backend was created under (default: a new one).

    Raises:
        TorchCompatError: when torch's handler lacks a private attribute the backend uses.
        SecretError: when ``ELASTIC_EMB_JOB_SECRET`` is set but too short.
    """

    def __init__(self, inner: Any, config: ListenerConfig, endpoint: str, guard: OutageGuard | None = None) -> None:
        self._inner = inner
        self._config = config
        self._endpoint = endpoint
        from elastic_emb.rdzv import torch_compat as tc

        self._tc = tc
        tc.check_handler(inner)
        # torch caches the state 1 s; num_nodes_waiting() is polled every --monitor-interval.
        tc.set_cache_duration(inner, config.sync_interval)
        settings = tc.settings(inner)
        self._node = node_id(tc.this_node(inner))
        self._run_id = settings.run_id
        self._log = event_logger(config.event_file, component="rendezvous", run_id=self._run_id, node=self._node)
        # Every store call of this agent (torch's and ours) rides out a store outage up to the bound.
        if guard is None:
            guard = OutageGuard(endpoint, config.store_outage_timeout, self._log, error=torch_store_outage_error())
        guard.bind_log(self._log)  # from here on its events name this node
        self._guard = guard
        expiry = settings.keep_alive_interval * settings.keep_alive_max_attempt
        # A running job's node counts as alive for the fingerprint check twice as long as torch
        # keeps it (10 s at least): a loaded node's heartbeat may lag, and a refusal is cheap.
        self._job_alive_s = max(2 * expiry.total_seconds(), 10.0)
        state_key = INNER_BACKENDS[config.inner].state_key.format(run_id=self._run_id)
        # Control keys are signed with the job's secret when it has one (rdzv/signing.py); a bad
        # secret fails here, at agent start, naming the variable.
        self._signer = Signer.from_env()
        # A node that keeps losing the state's compare-and-set gets a turn (rdzv/write_priority.py).
        self._priority = WritePriority(
            tc.agent_store(inner),
            write_priority_key(self._run_id),
            self._node,
            self._signer,
            expiry.total_seconds(),
            self._log,
        )
        tc.wrap_state_backend(
            inner, lambda b: GuardedBackend(b, guard, expiry, key=state_key, log=self._log, priority=self._priority)
        )
        self._members: tuple[str, ...] = ()
        self._round: int | None = None
        self._generation = 0  # the generation the running round started at (_round_generation)
        self._round_store: Any = None
        # Who of the running round's members is restarting, departed or dead (rdzv/liveness.py).
        self._liveness = Liveness(self._run_id, self._node, self._signer, expiry.total_seconds(), self._log)
        self._expected_next: frozenset[str] | None = None
        self._changed_reported = False
        self._fallback_reported = False
        self._joined_running = False
        self._restart_requested = False  # num_nodes_waiting() > 0 was answered since the last round
        self._drain_started: float | None = None
        self._drain_done = False
        self._drain_acks: AckCounter | None = None
        self._lock = threading.Lock()
        self._rdzv_lock = threading.Lock()
        self._left = False
        self._refused = False  # refused at the first rendezvous: never close the others' rendezvous
        self._fault = load(None, "fault").fault  # tests and drills: a named point where this agent dies
        self._count_file: str | None = None  # where this agent's workers write the drain's count
        self._progress_prefix: str | None = None  # where they show progress (rdzv/hang.py)
        self._watchdog: HangWatchdog | None = None
        self._closed = threading.Event()
        # torch's keep-alive timer fires every keep_alive_interval and writes only a heartbeat
        # older than that, and its first tick comes a full interval after a round completes: a
        # heartbeat can age to ~2 intervals, which keep_alive_max_attempt=2 calls dead. The stock
        # agent ignores such a false death; this backend restarts on it, so it keeps its own
        # heartbeat fresher: every half interval (torch's own keep-alive operation).
        interval = settings.keep_alive_interval.total_seconds()
        self._heartbeat_every = max(0.05, interval / 2)
        threading.Thread(
            target=_heartbeat_loop,
            args=(weakref.ref(self), self._closed, self._heartbeat_every),
            name="elastic_emb-heartbeat",
            daemon=True,
        ).start()
        # atexit: a SIGTERMed agent (torchrun raises SignalException and exits) leaves the
        # rendezvous instead of lingering until its heartbeat expires.
        ref = weakref.ref(self)
        atexit.register(lambda: (h := ref()) is not None and h._leave("agent_exit"))

    # -- RendezvousHandler interface ------------------------------------------------------

    def get_backend(self) -> str:
        """The backend's name.

        Returns:
            ``elastic_emb``.
        """
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return False  # with the shared agent store, a scale-up deadlocks

    def get_run_id(self) -> str:
        """The rendezvous run id (torch's handler's).

        Returns:
            The run id.
        """
        return self._inner.get_run_id()

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (torch's handler's).

        Returns:
            True when closed.
        """
        return self._inner.is_closed()

    def set_closed(self) -> None:
        """Close the rendezvous (torch's handler's)."""
        self._inner.set_closed()

    def shutdown(self) -> bool:
        """Close the rendezvous, unless the agent is being signalled: then leave it instead.

        Returns:
            torch's handler's answer; False when a signal was in flight and the agent left.
        """
        signalled = _signal_in_flight()
        if signalled is not None:
            # torch's launcher keeps the rendezvous open when its agent is signalled (it catches
            # SignalException and skips this call), but when a later error masks the signal it
            # calls shutdown(), which would close the rendezvous for every survivor (torch's
            # metrics wrapper, for one, can raise UnboundLocalError in its `finally` when SIGTERM
            # lands before its timer starts). A signalled agent leaves instead, as at exit.
            self._log.warning("shutdown_declined", reason="agent_signalled", signal=str(signalled)[:200])
            self._leave("agent_exit")
            return False
        if self._refused:
            # This agent was refused before it joined (another job runs under the run id): closing
            # the rendezvous, as torch's launcher asks of every failed agent, would end that job.
            self._log.warning("shutdown_declined", reason="refused_before_joining")
            self._left = True
            self._close_threads()
            return False
        self._left = True
        self._close_threads()  # a closed rendezvous needs no leave
        return self._inner.shutdown()

    @property
    def settings(self):
        return self._inner.settings

    def __getattr__(self, name: str) -> Any:
        # Anything a newer torch agent asks of its handler that this wrapper does not override.
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def next_rendezvous(self):
        """Join the next round (or, in ``resize=in_process`` mode, the running one) and export it.

        Logs ``rendezvous_round`` and puts the round, the generation and the membership into
        ``os.environ`` for the workers torchrun starts next.

        Returns:
            torch's ``RendezvousInfo``, its store wrapped so that torch's exit barrier writes the
            job-complete mark (and, in-process, completes over the members of now).

        Raises:
            SystemExit: with code 0 when the rendezvous is closed because the job finished.
            RendezvousError: torch's error (closed, timed out, ...) when the rendezvous fails
                otherwise, after a ``rendezvous_failed`` event.
            RendezvousConfigError: at the first rendezvous, when a live job runs under this run
                id with another job fingerprint (``rdzv/fingerprint.py``), naming the difference.
        """
        start = time.monotonic()
        previous = self._members
        previous_round = self._round
        if previous_round is None:
            self._check_job()
        expected = self._expected_next
        self._expected_next = None
        early = None
        if expected:
            early = self._tc.EarlyCompletion(
                self._inner,
                expected,
                -1 if previous_round is None else previous_round,
                self._config.sync_interval,
                self._log,
            )
        with self._rdzv_lock:  # no heartbeat of ours interleaves with torch's join operation
            try:
                info = self._join_running_world(rejoin=previous_round is not None)
                if info is None:
                    info = self._inner.next_rendezvous()
            except Exception as exc:
                if closed_and_complete(
                    exc,
                    lambda: self._round_store or GuardedStore(self._tc.agent_store(self._inner), self._guard),
                    self._signer,
                    self._run_id,
                    self._log,
                ):
                    # torch's own way out (RendezvousGracefulExitError) makes its launcher crash on
                    # a None result (launch_agent calls is_failed() on it; torch 2.11-2.13); SystemExit(0) is what
                    # torchrun's @record turns into exit code 0.
                    raise SystemExit(0) from None
                self._log.error(
                    "rendezvous_failed",
                    previous_round=previous_round,
                    error=f"{type(exc).__name__}: {exc}",
                    duration_s=round(time.monotonic() - start, 3),
                )
                raise
            finally:
                if early is not None:
                    early.stop()
            try:
                self._heartbeat()
            except Exception as exc:  # torch's own timer still beats; the next tick of ours retries
                reraise_signal(exc)
                self._log.warning("heartbeat_failed", error=repr(exc))
        if self._config.resize == "in_process":
            # The membership changes inside the round: torch's exit barrier must count the
            # members of the end, not the round's node count (rdzv/exit_barrier.py).
            from torch.distributed.elastic.rendezvous.api import RendezvousInfo

            store = CompletingExitBarrierStore(info.store, self._node, self._members_now, self._mark_job_complete)
            info = RendezvousInfo(store, info.rank, info.world_size, info.bootstrap_store_info)
        else:  # restart mode: torch's barrier, and the mark a late node reads (rdzv/job_complete.py)
            from torch.distributed.elastic.rendezvous.api import RendezvousInfo

            # torch's agents exchange their role records next; a member lost before it writes
            # its own must cost a re-form, not the survivors' agents (rdzv/round_start.py)
            store = RoundStartStore(
                info.store, info.rank, info.world_size, self._lost_members, self._log, reached=self._fault_point
            )
            info = RendezvousInfo(
                CompletingStore(store, self._mark_job_complete),
                info.rank,
                info.world_size,
                info.bootstrap_store_info,
            )
        state = RendezvousView.of(self._tc.current_state(self._inner))
        members = state.nodes
        joins = [n for n in members if n not in previous]
        gone = [n for n in previous if n not in members]
        deaths = [n for n in gone if n in self._liveness.dead]
        with self._lock:
            self._members = members
            self._round = state.round
            self._round_store = GuardedStore(self._tc.agent_store(self._inner), self._guard)
            self._changed_reported = False
            self._fallback_reported = False
            self._drain_started = None
            self._drain_done = False
            self._liveness.new_round(members)  # the dead are no members now; a rejoining node starts clean
        self._generation = self._round_generation(state.round)
        self._export_env(state)
        self._log.info(
            "rendezvous_round",
            round=state.round,
            generation=self._generation,
            previous_round=previous_round,
            world_size=len(members),
            group_rank=info.rank,
            participants=list(members),
            joins=joins,
            departures=[n for n in gone if n not in deaths],
            deaths=deaths,
            duration_s=round(time.monotonic() - start, 3),
        )
        self._fault_point("agent_round_complete")  # tests: a node lost right after its round
        metrics.rendezvous_round(
            round_=state.round,
            world_size=len(members),
            joins=joins,
            deaths=deaths,
            previous_world_size=None if previous_round is None else len(previous),
            departures=[n for n in gone if n not in deaths],
            seconds=time.monotonic() - start,
        )
        return info

    def _fault_point(self, point: str) -> None:
        """Tests and drills: SIGKILL this agent at ``point`` when ``ELASTIC_EMB_FAULT`` names it (a node
        lost there; its workers, if any, are orphaned). The points: ``docs/RDZV.md`` ("Flapping nodes: a member lost mid-round")."""
        if self._fault == point:
            self._log.warning("faultpoint_kill", point=point, round=self._round, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)

    def _close_threads(self) -> None:
        """The heartbeat loop and the hang watchdog end (the agent leaves or closes the rendezvous)."""
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.stop()

    def _check_job(self) -> None:
        """Before this agent's first join: refuse a running job that is not ours (one run id, one job)."""
        try:
            mine = JobFingerprint.of_agent(self._config.resize)
        except ConfigError as exc:  # a malformed ELASTIC_EMB_JOB_FINGERPRINT: one line, exit 1
            raise config_error(str(exc)) from None
        if mine is None:
            self._log.info(
                "job_fingerprint_skipped", reason="not torchrun's command line, no ELASTIC_EMB_JOB_FINGERPRINT"
            )
            return
        store = GuardedStore(self._tc.agent_store(self._inner), self._guard)
        try:
            check_fingerprint(
                store, self._signer, self._run_id, mine, self._live_nodes, self._log, expiry_s=self._job_alive_s
            )
        except ValueError as exc:
            self._log.error("job_fingerprint_refused", error=str(exc))
            self._refused = True
            raise config_error(str(exc)) from None
        except StoreOutageError:
            raise
        except Exception as exc:  # the join that follows meets the same store and reports it
            reraise_signal(exc)
            self._log.warning("job_fingerprint_unchecked", error=repr(exc)[:300])

    def _live_nodes(self) -> list[str]:
        """The nodes of torch's state (participants and wait list) whose heartbeat is fresh."""
        self._inner.num_nodes_waiting()  # syncs torch's state
        state = self._tc.current_state(self._inner)
        view = RendezvousView.of(state)
        return live(self._tc.heartbeats(state), [*view.nodes, *view.wait_list], self._job_alive_s, self._node)

    def _join_running_world(self, rejoin: bool):
        """``resize=in_process``: the agent's first rendezvous joins a running round as one more
        participant, so nobody restarts; this agent's workers wait to be included by the running
        ones. A later rendezvous after this node's worker crashed does the same once the survivors
        re-formed without it (``rdzv/rejoin.py``); after a fallback or a scale-up through the wait
        list (``num_nodes_waiting() > 0`` was answered) it is torch's: restart mode."""
        was_joiner, self._joined_running = self._joined_running, False
        restart_requested, self._restart_requested = self._restart_requested, False
        if self._config.resize != "in_process":
            return None
        tc = self._tc
        if rejoin and (
            restart_requested
            or self._fallback_requested()
            or not leave_for_rejoin(
                tc,
                self._inner,
                self._round_store,
                self._signer,
                run_id=self._run_id,
                round_=self._round,
                generation=self._generation,
                node=self._node,
                was_joiner=was_joiner,
                log=self._log,
            )
        ):
            return None
        joined = tc.join_complete_round(self._inner)
        if joined is None:
            return None
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        rank, world = joined
        tc.start_heartbeats(self._inner)
        store = tc.round_store(self._inner)
        self._joined_running = True
        self._log.info("joined_running_round", group_rank=rank, world_size=world, mode="in_process")
        return RendezvousInfo(
            store, rank, world, RendezvousStoreInfo.build(rank, store, tc.this_node(self._inner).addr)
        )

    def _mark_job_complete(self) -> None:
        """At torch's exit barrier (every local worker succeeded): mark the job complete (rdzv/job_complete.py)."""
        try:
            mark_complete(
                self._round_store,
                self._signer,
                self._run_id,
                node=self._node,
                round=self._round,
                generation=self._generation,
            )
            self._log.info("job_complete_marked", round=self._round)
        except Exception as exc:  # joiners then wait their bound and fail, as without the mark
            reraise_signal(exc)
            self._log.warning("job_complete_mark_failed", round=self._round, error=repr(exc)[:300])

    def _lost_members(self) -> list[int]:
        """The group ranks of the running round's members that are gone from torch's state (their
        heartbeat expired, or they left), all of them when the state moved to another round."""
        try:
            with self._lock:
                self._inner.num_nodes_waiting()  # syncs torch's state, which drops the dead
                view = RendezvousView.of(self._tc.current_state(self._inner))
                members, round_ = self._members, self._round
        except Exception as exc:  # unknown is not lost: the read waits on, to its bound
            reraise_signal(exc)
            return []
        if view.round != round_:
            return list(range(len(members)))
        return [i for i, n in enumerate(members) if n not in view.nodes]

    def _members_now(self) -> tuple[str, ...]:
        """The participants of torch's state now (synced, reported-dead nodes evicted): whom the
        exit barrier waits for. Unknown (a store error) is no members: the barrier waits on."""
        try:
            with self._lock:
                self._inner.num_nodes_waiting()  # syncs torch's state (cached sync_interval)
                self._evict_reported_dead()
                return RendezvousView.of(self._tc.current_state(self._inner)).nodes
        except Exception as exc:
            reraise_signal(exc)
            self._log.warning("exit_barrier_members_unknown", error=repr(exc)[:300])
            return ()

    def num_nodes_waiting(self) -> int:
        """torch's count of waiting nodes, made above 0 by a membership change of the running round.

        Also evicts nodes reported dead, gates a scale-up on the drain, and in ``resize=in_process``
        mode answers 0 for nodes gone (the workers re-form) unless a worker asked for a restart.

        Returns:
            The number torch's agent compares with 0: above 0 restarts the workers.

        Raises:
            StoreOutageError: when the store stays unreachable past ``store_outage_timeout``.
        """
        waiting = self._num_nodes_waiting()
        if waiting > 0:
            self._restart_requested = True
        return waiting

    def _num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        with self._lock:
            if self._round is None:
                return waiting
            self._evict_reported_dead()
            state = self._tc.current_state(self._inner)
            self._liveness.observe(self._tc.heartbeats(state), self._members)
            view = RendezvousView.of(state)
            changed = self._membership_change(view)
            if self._config.resize == "in_process":
                if self._fallback_requested():
                    return max(waiting, 1)
                if changed is None and set(view.nodes) - set(self._members):
                    # A node joined the running round in process: a member from now on.
                    self._log.info(
                        "node_joined_running",
                        round=self._round,
                        nodes=[n for n in view.nodes if n not in self._members],
                    )
                    self._members = view.nodes
                if changed is not None and self._workers_reform(changed):
                    changed = None
            if changed is not None:
                if not self._changed_reported:
                    self._changed_reported = True
                    expected = changed.pop("expected")
                    if expected is not None:
                        self._expected_next = frozenset(expected)
                    self._log.info("membership_changed", round=self._round, **changed)
                return max(waiting, 1)
            if waiting > 0:
                return self._drain_gate(waiting, view)
            if self._drain_started is not None:
                # The node that asked to join went away mid-drain, but the workers stop (or
                # stopped) stepping for it: finish the drain and restart them all the same.
                return self._drain_gate(1, view)
            return 0

    def _workers_reform(self, changed: dict) -> bool:
        """In ``resize=in_process`` mode, whether the running workers handle this change themselves
        (the survivors re-form in their processes, ``elastic_emb/inprocess/resize.py``): yes for nodes gone
        (left or dead). A restarting peer or a round that moved on is torch's: restart mode. The
        survivors become the members this agent compares the next states with."""
        if changed["reason"] != "participant_gone" or changed["restarting"]:
            return False
        self._log.info(
            "membership_changed",
            round=self._round,
            mode="in_process",
            **{k: v for k, v in changed.items() if k != "expected"},
        )
        self._members = tuple(changed["participants"])
        return True

    def _fallback_requested(self) -> bool:
        """A worker's in-process re-form failed and it asked for a restart (signed, per round)."""
        key = round_prefix(self._run_id, self._round) + KEY_FALLBACK
        fallback = read_signed(self._round_store, self._signer, key, self._log)
        if fallback is None:
            return False
        if not self._fallback_reported:
            self._fallback_reported = True
            self._log.warning("resize_fallback", round=self._round, mode="restart", reason=fallback.decode()[:300])
        return True

    # -- heartbeats -----------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Refresh this node's heartbeat in torch's state if it is older than half an interval."""
        self._tc.run_op(self._inner, self._tc.FreshHeartbeat(self._heartbeat_every), 5.0)

    # -- scale-down -----------------------------------------------------------------------

    def _membership_change(self, view: RendezvousView) -> dict | None:
        """What differs between the running round and the state ``view``, or None (``Liveness.change``)."""
        return self._liveness.change(self._round, self._members, self._round_store, view)

    def _evict_reported_dead(self) -> None:
        """Remove nodes that their orphaned workers reported dead from torch's state (torch would
        drop them when their heartbeat expires; the report is faster and certain)."""
        fresh = self._liveness.take_reported_dead(self._round, self._members, self._round_store)
        if not fresh:
            return
        removed = self._remove_from_state(set(fresh))
        self._log.info("dead_node_evicted", round=self._round, nodes=fresh, removed=removed, source="orphan_report")

    def _remove_from_state(self, nodes: set[str]) -> list[str]:
        return self._tc.remove_nodes(self._inner, nodes)

    def _leave(self, why: str) -> None:
        """Leave the rendezvous (torch's own exit operation) and say so in the round's keys."""
        if self._left or self._round is None:
            return
        self._left = True
        self._close_threads()
        self._guard.closing.set()  # at exit, an unreachable store is not waited for
        start = time.monotonic()
        tc = self._tc
        try:
            tc.stop_heartbeats(self._inner)
            store = self._round_store
            key = round_prefix(self._run_id, self._round) + KEY_LEFT + self._node
            store.set(key, self._signer.sign(key, why))
            tc.exit_rendezvous(self._inner, 5.0)
            self._log.info("node_left", round=self._round, reason=why, duration_s=round(time.monotonic() - start, 3))
        except Exception as exc:  # best effort at exit: the heartbeat expiry still removes us
            self._log.warning("leave_failed", round=self._round, reason=why, error=repr(exc))

    # -- drain before scale-up ------------------------------------------------------------

    def _drain_gate(self, waiting: int, view: RendezvousView) -> int:
        """0 while the running workers drain; ``waiting`` once they acknowledged or timed out."""
        if self._drain_done:
            return waiting
        prefix = round_prefix(self._run_id, self._round)
        store = self._round_store
        now = time.monotonic()
        if not self._config.drain:
            self._drain_done = True
            self._log.info("scale_up_pending", round=self._round, waiting=list(view.wait_list), drain="off")
            return waiting
        if self._drain_started is None:
            self._drain_started = now
            request = json.dumps({"round": self._round, "waiting": list(view.wait_list)})
            store.set(prefix + KEY_DRAIN, self._signer.sign(prefix + KEY_DRAIN, request))
            self._log.info(
                "drain_requested", round=self._round, waiting=list(view.wait_list), timeout_s=self._config.drain_timeout
            )
            self._fault_point("agent_drain_started")  # tests: a member lost mid-drain
        if self._drain_acks is None or self._drain_acks.prefix != prefix:  # verified acks only (drain_acks.py)
            self._drain_acks = AckCounter(store, self._signer, prefix, self._round, self._log)
        last = now - self._drain_started >= self._config.drain_timeout
        try:
            try:
                expected = read_expected(store, self._signer, prefix) or 0  # untrusted, like every key
            except ValueError as exc:  # not written with the secret, or not a count: the local copy below
                self._log.warning("drain_count_unreadable", round=self._round, error=str(exc)[:300])
                expected = 0
            if expected == 0:
                # Missing from the store: no watchers, or a store writer deleted it. This node's
                # watchers also wrote it to a file only they and this agent share.
                expected = read_local_count(self._count_file, self._round) or 0
            acks = self._drain_acks.count(expected, final=last) if expected > 0 else 0
        except StoreOutageError:
            raise
        except Exception as exc:
            reraise_signal(exc)
            self._log.warning("drain_unreadable", round=self._round, error=repr(exc))
            expected, acks = -1, 0
        outcome = None
        if expected == 0:
            outcome = "no_watchers"  # the workers run no elastic_emb watcher: nobody will ack
        elif expected > 0 and acks >= expected:
            outcome = "acknowledged"
        elif last:
            outcome = "timeout"
        if outcome is None:
            return 0
        stop_step = None  # for the event only; a value that is not a step (a store writer's) stays None
        value = read_signed(store, self._signer, prefix + KEY_STOP_STEP, self._log)
        if value is not None and value.isascii() and value.isdigit() and len(value) <= 19:
            stop_step = int(value)
        self._drain_done = True
        self._log.info(
            "drain_finished",
            round=self._round,
            outcome=outcome,
            acks=acks,
            expected=expected,
            stop_step=stop_step,
            duration_s=round(now - self._drain_started, 3),
        )
        return waiting

    # -- worker environment ---------------------------------------------------------------

    def _round_generation(self, round_: int) -> int:
        """The generation the workers of round ``round_`` start at: the round itself in restart
        mode; in ``resize=in_process`` mode the round plus the in-process high-water mark
        (``KEY_GENERATION_MARK``, signed, raised by every in-process re-form before it writes a key of its
        generation), so a round after a fallback never reuses a generation that the workers
        formed in process with another membership. Every agent that completed the round reads
        the same mark (the workers that could raise it are stopped, the new ones not started);
        an agent that joined the running round reads what they wrote."""
        if self._config.resize != "in_process":
            return round_
        key = round_prefix(self._run_id, round_) + KEY_ROUND_GENERATION
        if self._joined_running:
            value = read_signed(self._round_store, self._signer, key, self._log)
            generation = parse_mark(value)
            return generation if generation is not None else round_
        key_mark = inproc_root(self._run_id) + KEY_GENERATION_MARK
        # signed, read without add; absent or forged reads as 0 (reported): rdzv/signed_cas.py
        generation = round_ + read_mark(self._round_store, self._signer, key_mark, self._log)
        self._round_store.set(key, self._signer.sign(key, str(generation)))
        return generation

    def _export_env(self, state: RendezvousView) -> None:
        """torchrun starts the workers with a copy of the agent's os.environ."""
        if self._count_file is None:
            # One small file per agent, named by its pid (a killed agent's is replaced by the next
            # agent of that pid); the workers write it without following links (drain_acks.py).
            self._count_file = os.path.join(tempfile.gettempdir(), f"elastic_emb-drain-count-{os.getpid()}.json")
            remove_quietly(self._count_file)
            atexit.register(remove_quietly, self._count_file)
        if self._progress_prefix is None:
            self._progress_prefix = os.path.join(tempfile.gettempdir(), f"elastic_emb-progress-{os.getpid()}")
            if self._config.hang_timeout > 0:
                self._watchdog = HangWatchdog(self._progress_prefix, self._config.hang_timeout, self._log).start()
        os.environ.update(
            {
                ENV_GENERATION: str(self._generation),
                ENV_ROUND: str(state.round),
                ENV_RDZV_BACKEND: self._config.inner,
                ENV_RDZV_ENDPOINT: self._endpoint,
                ENV_NODE_ID: self._node,
                ENV_MEMBERSHIP: json.dumps(list(state.nodes)),
                ENV_AGENT_PID: str(os.getpid()),
                ENV_DRAIN: "1" if self._config.drain else "0",
                ENV_WATCH_INTERVAL: str(self._config.watch_interval),
                ENV_STORE_OUTAGE_TIMEOUT: str(self._config.store_outage_timeout),
                ENV_RESIZE: self._config.resize,
                ENV_JOINER: "1" if self._joined_running else "0",
                ENV_DRAIN_COUNT_FILE: self._count_file,
                ENV_PROGRESS_FILE: self._progress_prefix,
            }
        )


def _heartbeat_loop(ref: "weakref.ref[ElasticEmbRendezvousHandler]", closed: threading.Event, every: float) -> None:
    while not closed.wait(every) and not exiting():
        handler = ref()
        if handler is None or handler._left:
            return
        if handler._round is None or not handler._rdzv_lock.acquire(blocking=False):
            continue  # before the first round, or while torch's join runs its own keep-alives
        try:
            with native_call():  # a store round trip: the agent's exit waits for one in flight
                handler._heartbeat()
        except Exception as exc:  # torch's timer keeps going too; report and retry next tick
            handler._log.warning("heartbeat_failed", error=repr(exc))
        finally:
            handler._rdzv_lock.release()
        del handler


THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator: madvise(MADV_HUGEPAGE) for allocations >= 2 MiB


def create_handler(params: Any) -> ElasticEmbRendezvousHandler:
    """Build the handler from torchrun's ``RendezvousParameters``.

    Sets the process-wide variables the backend needs, shortens torch's rendezvous polls, and
    creates the inner backend under an outage guard (etcd's backends connect at creation).

    Args:
        params: torchrun's ``RendezvousParameters`` (endpoint, run id, ``--rdzv-conf``).

    Returns:
        The handler.

    Raises:
        RendezvousConfigError: for an invalid ``--rdzv-conf`` or ``--rdzv-id`` (a ``ValueError``, and
            a ``SystemExit`` that torchrun prints as one line).
        RuntimeError: when the inner backend's module cannot be imported, naming what to install.
        StoreOutageError: when the store stays unreachable past ``store_outage_timeout``.
        TorchCompatError: when the installed torch lacks what the backend uses.
    """
    check_run_id(params.run_id)
    config = ListenerConfig.from_params(params.config)
    # Before torch builds anything: the inner handler reads it in next_rendezvous, the agent in
    # _start_workers.
    os.environ[DISABLE_SHARED_STORE] = "1"
    # Workers inherit the agent's environment: large CPU allocations (a new context's table, the
    # buffers of a commit, a restore's received rows) on transparent huge pages. Faulting them in
    # as 4 KiB pages is otherwise a large part of a re-form's restore and base commit
    # (docs/RESIZE.md). The user's own setting wins.
    os.environ.setdefault(THP_ENV, "1")
    if config.resize == "in_process":
        # Ranks from group rank x local world size without the agents' store exchange (which a
        # node joining a running round could not complete): every node runs the same nproc.
        os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
    from elastic_emb.rdzv import torch_compat as tc

    tc.shorten_rendezvous_polls(config.sync_interval)
    create_backend = _inner_factory(config.inner)
    # etcd's backend connects at creation: an agent (re)started during a store outage waits too.
    log = event_logger(config.event_file, component="rendezvous", run_id=params.run_id)
    guard = OutageGuard(params.endpoint, config.store_outage_timeout, log, error=torch_store_outage_error())
    backend, store = guard.call("create_backend", create_backend, params)
    inner = tc.create_inner_handler(store, backend, params)
    return ElasticEmbRendezvousHandler(inner, config, params.endpoint, guard)


def _inner_factory(name: str) -> Callable[[Any], Any]:
    import importlib

    spec = INNER_BACKENDS[name]
    module, _, func = spec.factory.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ImportError as exc:
        hint = f"; pip install {spec.requires}" if spec.requires else ""
        raise RuntimeError(f"--rdzv-conf inner={name} cannot load {spec.factory} ({exc}){hint}") from exc


def handler_factory() -> Callable[[Any], ElasticEmbRendezvousHandler]:
    """The ``torchrun.handlers`` entry point.

    Returns:
        :func:`create_handler`, the creator torch registers for ``--rdzv-backend=elastic_emb``.
    """
    return create_handler


def _register_as_subclass() -> None:
    # RendezvousHandler is an ABC; registering keeps isinstance checks true without importing
    # torch.distributed.elastic at module import (this module is imported during that import).
    try:
        from torch.distributed.elastic.rendezvous.api import RendezvousHandler

        RendezvousHandler.register(ElasticEmbRendezvousHandler)
    except Exception:  # pragma: no cover - partial import during torch's own registry import
        pass


_register_as_subclass()
