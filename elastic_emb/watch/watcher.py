"""Worker side: a thread that watches the rendezvous and tells the lifecycle what changed.

torchrun tells a worker nothing about membership. :class:`Watcher` polls the
rendezvous state every ``interval`` seconds (bounded: every store read has a timeout and the
loop sleeps on an Event, so ``stop()`` returns within one interval plus one read) and turns
differences into :class:`~elastic_emb.watch.membership.MembershipEvent` records: ``join_pending``,
``departure``, ``round_advanced``, ``evicted`` (decided from each state by
:func:`elastic_emb.watch.membership.classify`, a pure function, where the kinds are explained),
``agent_lost`` (the worker's own agent process vanished: its parent changed) and
``drain_requested``.

The parts: ``rdzv/reader.py`` opens the store and reads the state for each inner backend;
``membership.py`` says what one state means; ``selfstop.py`` notices a dead agent and stops the
process; ``rdzv/drain_acks.py`` writes the drain's signed acknowledgements. This module holds
what needs a thread, a store and time: the polling loop, the orphan report, the drain agreement,
the outage accounting and the signed confirmations below. The reader's and the events' names stay importable from here.

**Safe decoding.** The state is ``base64(pickle(_RendezvousState))`` in a network store:
the watcher decodes it with the restricted decoder of ``rdzv/decode.py`` (the same one the agent
validates with), which admits only the classes the state is made of and raises
:class:`UnsafeStateError` for anything else, before any object of that class is made.

**Orphans.** A worker whose agent was SIGKILLed keeps running (torch starts workers in a new
session). The watcher notices within one interval that its parent process changed (it was
reparented), or that the agent's pid (``ELASTIC_EMB_AGENT_PID``) is gone when a wrapper sits
between agent and worker, reports the node dead under the
round's store keys (the surviving agents then evict it from the rendezvous and restart at
once, see ``rdzv/handler.py``), marks itself evicted and stops the worker: ``stop_delay`` seconds
later it sends itself SIGTERM (the worker's own clean-up runs) and, if the process is still
alive ``evict_grace`` seconds after the eviction, the kernel ends it (``selfstop.py``: SIGALRM
from an interval timer, which needs no Python thread, so it also cuts a slow interpreter
teardown short). A worker outside the membership never
touches shared state: ``evicted`` is True before the stop begins, and the lifecycle checks it.

**Drain.** When the agent asks the running workers to drain before a scale-up (a round-scoped
``drain`` key), every rank must stop after the same step or the rank that stopped first would
leave the others blocked in a collective. ``drain_requested(step)`` settles that: the first rank
to see the request after committing step ``s`` fixes the last step at ``s + 1`` (no rank can
have started ``s + 2``: that needs this rank in step ``s + 1``'s collective), and every rank
then stops after committing it and calls ``ack_drain(step)``, which writes this rank's own signed
acknowledgement (``rdzv/drain_acks.py``: a drain counts only acknowledgements that verify).

**Store outages.** The workers' own collectives do not use the rendezvous store, so while it
is unreachable (etcd restarting, say) they keep training, and the watcher treats the
membership as *unknown*: no departure, eviction or round change is inferred from a failed read,
a drain cannot be seen (it needs the store), and ``membership_change_pending()`` says False
(a failed collective is then a real failure). It counts the outage with the agent's tracker
(``rdzv/outage.py``): ``store_unreachable`` once per outage, ``store_reachable`` with ``outage_s``
when a read succeeds again, and past ``store_outage_timeout`` (``ELASTIC_EMB_STORE_OUTAGE_TIMEOUT``,
the agent's bound, default 30 s) ``store_outage_exceeded`` once; ``store_outage_exceeded`` is set: the agent fails at the same
bound and stops its workers. ``store_outage_s`` says how long the current outage has lasted.

Without the elastic_emb backend (plain ``--rdzv-backend=c10d``) the watcher works from
torchrun's variables plus ``ELASTIC_EMB_RDZV_ENDPOINT`` (the ``--rdzv-endpoint``, which torchrun
does not pass on); the worker's node is the participant whose pid is its parent's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_emb.events import get_logger
from elastic_emb.watch.membership import EXPLAINING, EventKind, MembershipEvent, classify, departed
from elastic_emb.native_calls import exiting, native_call
# The worker side imports the wire contract (keys), the shared decoder and view (decode), the
# shared outage tracker (outage) and the store reader (reader) from the rendezvous package; never
# the agent-side handler.
from elastic_emb.rdzv.decode import ALLOWED_CLASSES, Participant, RendezvousView, UnsafeStateError, decode_state
from elastic_emb.rdzv.drain_acks import RESTORE_EVERY_S, keep_expected, write_ack, write_expected
from elastic_emb.rdzv.keys import (
    KEY_EVICTED,
    ENV_RDZV_ENDPOINT,
    KEY_DEAD,
    KEY_DRAIN,
    KEY_STOP_CLAIM,
    KEY_STOP_STEP,
    round_prefix,
)
from elastic_emb.rdzv.outage import OutageTracker, is_connection_error
from elastic_emb.rdzv.reader import RendezvousReader, print_state
from elastic_emb.rdzv.signing import Signer, read_signed
from elastic_emb.watch.selfstop import agent_gone, stop_self

StateView = RendezvousView  # the name this module used before the two views were merged
# Names this module exported before the reader (rdzv/reader.py) and the event classification
# (membership.py) moved out; they stay importable from here.
__all__ = ["ALLOWED_CLASSES", "EventKind", "MembershipEvent", "Participant", "RendezvousReader", "RendezvousView",
           "StateView", "UnsafeStateError", "Watcher", "decode_state", "print_state"]


# -- the watcher --------------------------------------------------------------------------------


class Watcher:
    """Polls the rendezvous for one worker; see the module docstring."""

    def __init__(
        self,
        reader: RendezvousReader,
        *,
        round_: int | None,
        rank: int,
        world_size: int,
        node: str | None,
        agent_pid: int,
        interval: float = 0.1,
        drain: bool = True,
        stop_delay: float = 0.3,
        evict_grace: float = 1.5,
        on_evicted: Callable[[MembershipEvent], None] | None = None,
        signer: Signer | None = None,
        store_outage_timeout: float = 30.0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval={interval!r} must be > 0 seconds")
        self.store_outage_timeout = store_outage_timeout
        self._reader = reader
        self.round = round_
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self.agent_pid = agent_pid
        self._initial_parent = os.getppid()
        self.interval = interval
        self.drain_enabled = drain
        if not 0 <= stop_delay <= evict_grace:
            raise ValueError(f"stop_delay={stop_delay!r} must be within [0, evict_grace={evict_grace!r}]")
        self.stop_delay = stop_delay
        self.evict_grace = evict_grace
        self._on_evicted = on_evicted
        self._signer = signer if signer is not None else Signer.from_env()
        self._unconfirmed_reported = False
        self._events: list[MembershipEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._evicted = False
        self._drain_seen = False
        self._stop_step: int | None = None
        self._acked = False
        self._restore_due = float("inf")  # rank 0 keeps the round's world_size key, once start() wrote it
        self._members: tuple[str, ...] = ()
        self._reported: set[tuple[str, tuple[str, ...]]] = set()
        self.last_state: RendezvousView | None = None
        self._failure_key: str | None = None  # resize.py: a peer's collective failed (rollcall.py)
        self.prober = None  # resize.py: the members' liveness sockets (rollcall.Prober)
        self.on_failure: Callable[[], None] | None = None  # resize.py: abort the communicator
        self.failure_seen = False
        self._log = get_logger("elastic_emb.watch.watcher", rank=rank)
        # ValueError for a negative bound, before anything starts.
        self._outage = OutageTracker(store_outage_timeout, self._log, round=round_)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> "Watcher | None":
        """A watcher for this worker, or None when the rendezvous endpoint is unknown."""
        from elastic_emb.config import load, variable

        env = os.environ if env is None else env
        settings = load(env, "rdzv_endpoint", "rdzv_backend", "agent_pid", "generation", "rdzv_round",
                        "watch_interval", "drain", "store_outage_timeout", "rdzv_node")
        endpoint = settings.rdzv_endpoint
        if not endpoint:
            get_logger("elastic_emb.watch.watcher").info(
                "watcher_disabled",
                reason=f"{ENV_RDZV_ENDPOINT} is not set: launch with --rdzv-backend=elastic_emb, or set it "
                f"to the --rdzv-endpoint",
            )
            return None
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        backend = settings.rdzv_backend or "c10d"
        # connect bounded by 30 s: under load (16 on 2 cores) the agent's store took over 2 s to
        # accept and every worker of a bench run died at start; each later call stays bounded by 2 s
        reader = RendezvousReader(backend, endpoint, run_id, connect_timeout=30.0)
        agent_pid = settings.agent_pid or os.getppid()
        # The round (a backend older than ELASTIC_EMB_RDZV_ROUND: the generation was the round).
        # Unset (no elastic_emb backend): the round is learnt from the first complete state.
        gen = settings.rdzv_round if settings.rdzv_round is not None else (
            settings.generation if env.get(variable("generation")) else None)
        kwargs.setdefault("interval", settings.watch_interval)
        kwargs.setdefault("drain", settings.drain)
        kwargs.setdefault("store_outage_timeout", settings.store_outage_timeout)
        kwargs.setdefault("signer", Signer.from_env(env))
        return cls(
            reader,
            round_=gen,
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            node=settings.rdzv_node,
            agent_pid=agent_pid,
            **kwargs,
        )

    # -- public ---------------------------------------------------------------------------

    @property
    def evicted(self) -> bool:
        return self._evicted

    @property
    def store_outage_s(self) -> float | None:
        """Seconds the rendezvous store has been unreachable, or None when the last read worked."""
        return self._outage.down_for

    @property
    def store_outage_exceeded(self) -> bool:
        """The current outage outlasted ``store_outage_timeout`` (the agent fails at that bound)."""
        return self._outage.exceeded

    def start(self) -> "Watcher":
        if self._thread is not None:
            return self
        self._poll()  # learn the round and membership before the worker builds anything
        if self.round is not None:
            try:  # tells the agent how many acknowledgements a drain needs (signed: rdzv/drain_acks.py)
                write_expected(self._reader.store, self._signer, self._prefix(), self.world_size)
            except Exception as exc:
                self._log.warning("watch_store_error", op="world_size", error=repr(exc))
            self._restore_due = time.monotonic() + RESTORE_EVERY_S
        self._thread = threading.Thread(target=self._run, name="elastic_emb-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Watcher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def events(self) -> list[MembershipEvent]:
        """Membership events since the last call."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def drain_requested(self, step: int | None = None) -> bool:
        """Whether the worker must stop stepping for a drain.

        With ``step`` (the step just committed): True once ``step`` reaches the last step all ranks
        agreed on (the first rank to see the request fixes it at ``step + 1``). Without: whether a
        request is pending at all.
        """
        if not self.drain_enabled or self.round is None or self._evicted:
            return False  # an evicted worker stops through its eviction, not a drain
        if not self._drain_seen:
            self._drain_seen = self._control(KEY_DRAIN)
            if not self._drain_seen:
                return False
            self._emit("drain_requested")
        if step is None:
            return True
        if self._stop_step is None:
            self._stop_step = self._agree_stop_step(step)
        return step >= self._stop_step

    def membership_change_pending(self, timeout: float = 2.0) -> bool:
        """After a collective failed: whether a membership change explains it.

        Polls (bounded by ``timeout``) until the state shows a departure, a newer round, a
        waiting node, or this worker's eviction. True means the agent is about to restart the
        workers: wait for its SIGTERM instead of exiting with an error, which torch would count
        against the restart budget. False means the failure is a real one.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                seen = {kind for kind, _ in self._reported}
            if self._evicted or seen & EXPLAINING:
                return True
            if time.monotonic() >= deadline:
                return False
            if self._thread is None:
                self._poll()
            time.sleep(min(self.interval, max(0.0, deadline - time.monotonic())))

    def adopt(self, nodes: tuple[str, ...], rank: int, world_size: int) -> None:
        """The workers re-formed in process (``resize.py``): ``nodes`` are the members now, and
        the departures seen so far are settled (a later one is reported afresh)."""
        with self._lock:
            self._members = tuple(nodes)
            self._reported = {k for k in self._reported if k[0] not in ("departure", "round_advanced")}
            self._events = [e for e in self._events if e.kind not in ("departure", "round_advanced")]
        self.rank, self.world_size = rank, world_size
        if self._thread is not None:  # the new count, at the next poll (rank 0: _keep_drain_count)
            self._restore_due = 0.0

    def watch_failures(self, key: str | None) -> None:
        """In process (``rollcall.py``): each poll reads ``key``, set when a collective of this
        generation failed; then ``failure_seen`` holds and ``on_failure`` runs once (locked: never
        for a replaced key)."""
        with self._lock:
            self._failure_key, self.failure_seen = key, False

    def _control_set(self, key: str) -> bool:
        try:
            return bool(self._reader.store.check([key]))
        except Exception as exc:  # the state read reports an outage; this is a hint only
            self._log.debug("watch_store_error", op="failure_flag", error=repr(exc))
            return False

    def interrupted(self) -> bool:
        """This generation is over: a member gone or a peer's collective failed (store waits end)."""
        return self.failure_seen or bool(self.gone())

    def gone(self) -> tuple[str, ...]:
        """Members of this worker's generation absent from the last state read (none if unread)."""
        view = self.last_state
        if view is None or self.round is None:
            return ()
        return departed(self._members, view)

    @property
    def stop_step(self) -> int | None:
        return self._stop_step

    def ack_drain(self, step: int) -> None:
        """Tell the agent this worker committed ``step`` and stopped stepping (this rank's signed
        acknowledgement, ``rdzv/drain_acks.py``)."""
        if self._acked or self.round is None or self._evicted:
            return  # outside the membership: touch no shared state
        write_ack(self._reader.store, self._signer, self._prefix(), self.round, self.rank, step)
        self._acked = True
        self._log.info("drain_acknowledged", round=self.round, step=step)

    # -- internals ------------------------------------------------------------------------

    def _prefix(self) -> str:
        return round_prefix(self._reader.run_id, self.round)

    def _control(self, name: str) -> bool:
        """Whether the control key ``name`` of this round holds a value (validly signed, when the
        job has a secret: anything else is ignored with a ``control_key_rejected`` event)."""
        try:
            found = read_signed(self._reader.store, self._signer, self._prefix() + name, self._log) is not None
        except Exception as exc:
            if is_connection_error(exc):
                self._store_failed(exc)  # logged once per outage; the answer is unknown: not yet
            else:
                self._log.warning("watch_store_error", op=name, error=repr(exc))
            return False
        self._store_back()
        return found

    def _agree_stop_step(self, step: int) -> int:
        store = self._reader.store
        key = self._prefix() + KEY_STOP_STEP
        if int(store.add(self._prefix() + KEY_STOP_CLAIM, 1)) == 1:
            store.set(key, self._signer.sign(key, str(step + 1)))
            return step + 1
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # the claimer sets it right after claiming
            value = read_signed(store, self._signer, key, self._log)
            if value is not None:
                return int(value)
            time.sleep(0.005)
        raise TimeoutError(f"drain of round {self.round}: no stop step under {key} within 10 s; the claiming rank died")

    def _emit(self, kind: EventKind, *, nodes: tuple[str, ...] = (), state_round: int | None = None,
              once: bool = True, before: Callable[[MembershipEvent], None] | None = None) -> MembershipEvent | None:
        """Record an event (``once``: only the first of its kind and nodes); ``before`` runs with
        it before ``events()`` can return it."""
        with self._lock:
            if once:
                key = (kind, nodes)
                if key in self._reported:
                    return None
                self._reported.add(key)
        event = MembershipEvent(
            kind=kind, round=self.round if self.round is not None else -1, state_round=state_round,
            nodes=nodes, participants=self._members, at=time.time(),
        )
        if before is not None:
            before(event)
        with self._lock:
            self._events.append(event)
        self._log.info("membership_event", kind=kind, round=event.round, state_round=state_round, nodes=list(nodes))
        return event

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and not exiting():
            with native_call():  # store reads: the process's exit waits for one in flight
                self._poll()
            if self._evicted:
                return

    def _own_node(self, view: RendezvousView) -> str | None:
        if self.node is not None:
            return self.node
        host = {socket.getfqdn(), socket.gethostname()}
        mine = [p.node for p in view.participants if p.pid == self.agent_pid and (p.addr in host or len(view.participants) == 1)]
        if not mine:  # loopback launches may use --local-addr; the pid alone then decides
            mine = [p.node for p in view.participants if p.pid == self.agent_pid]
        return mine[0] if len(mine) == 1 else None

    def _poll(self) -> None:
        if agent_gone(self._initial_parent, self.agent_pid):
            self._orphaned()
            return
        if (key := self._failure_key) is not None and not self.failure_seen and self._control_set(key):
            with self._lock:
                # watch_failures may have moved to the next generation's key meanwhile: the previous
                # generation's failure is not this one's (seen: the new generation's agreement ended
                # with _MemberGone and fell back)
                if key == self._failure_key and not self.failure_seen:
                    self.failure_seen = True
                    if self.on_failure is not None:
                        self.on_failure()
        try:
            view = self._reader.state()
        except UnsafeStateError as exc:
            self._log.error("unsafe_rendezvous_state", error=str(exc))
            return
        except Exception as exc:
            self._store_failed(exc)
            return  # unknown, not a change: nothing is inferred from a failed read
        self._store_back()
        if view is None:
            return
        self.last_state = view
        if self.round is None and view.complete:
            self.round = view.round
        if self.node is None:
            self.node = self._own_node(view)
        if not self._members and view.round == self.round:
            self._members = view.nodes
        if self.round is None:
            return
        if self.rank == 0 and time.monotonic() >= self._restore_due:
            self._keep_drain_count()
        for change in classify(view, round_=self.round, members=self._members, node=self.node):
            if change.kind != "evicted":
                self._emit(change.kind, nodes=change.nodes, state_round=change.state_round)
            elif self._eviction_confirmed():
                self._evict("evicted", nodes=change.nodes, state_round=change.state_round)

    def _keep_drain_count(self) -> None:
        """Rank 0: the round's ``world_size`` says this world's size (``rdzv/drain_acks.py``):
        written back when a store writer deleted it (it would read as "no watchers" and end a
        drain before any commit), rewritten after an in-process re-form (the round stays; a stale
        count would make a drain wait for ranks that are gone, or end before every rank acked)."""
        self._restore_due = time.monotonic() + RESTORE_EVERY_S
        try:
            replaced = keep_expected(self._reader.store, self._signer, self._prefix(), self.world_size)
        except Exception as exc:  # upkeep only: the state read reports an outage
            self._log.debug("watch_store_error", op="world_size", error=repr(exc))
            return
        if replaced == b"":
            self._log.warning("drain_count_restored", round=self.round, world_size=self.world_size,
                              reason="the round's world_size key was missing: deleted by a store writer")
        elif replaced is not None:
            self._log.info("drain_count_updated", round=self.round, world_size=self.world_size,
                           was=replaced[:40].decode("ascii", "replace"))

    def _eviction_confirmed(self) -> bool:
        """Whether to believe a state that leaves this node out. Without a job secret, yes: the
        state is all there is. With one, only when an agent confirmed it with a signed eviction
        mark (it writes one for every node it sees gone): torch's state carries no signature, so
        a store writer could otherwise make every worker stop itself with a crafted state. An
        unconfirmed one is a ``departure``-like hint only (``membership_change_pending``)."""
        if not self._signer.enabled:
            return True
        if self._control(KEY_EVICTED + self.node):
            return True
        self._emit("departure", nodes=(self.node,), state_round=None)
        if not self._unconfirmed_reported:
            self._unconfirmed_reported = True
            self._log.warning("eviction_unconfirmed", round=self.round, node=self.node,
                              reason="the rendezvous state leaves this node out, but no agent signed its eviction")
        return False

    def _store_failed(self, exc: Exception) -> None:
        if not is_connection_error(exc):
            self._log.warning("watch_store_error", op="state", error=repr(exc))
            return
        self._outage.fields["round"] = self.round
        self._outage.failed("state", exc)

    def _store_back(self) -> None:
        self._outage.succeeded("state")

    def _orphaned(self) -> None:
        """Our agent is gone: report the node dead for the survivors, then stop."""
        if self._evicted:
            return
        if self.round is not None and self.node is not None:
            try:
                store = self._reader.store
                key = self._prefix() + f"{KEY_DEAD}/{self.node}"
                store.set(key, self._signer.sign(key, str(os.getpid())))
                store.add(self._prefix() + KEY_DEAD, 1)
            except Exception as exc:
                self._log.warning("watch_store_error", op="report_dead", error=repr(exc))
        self._evict("agent_lost", nodes=(self.node or "",), state_round=None)

    def _evict(self, kind: EventKind, *, nodes: tuple[str, ...], state_round: int | None) -> None:
        if self._evicted:
            return
        self._evicted = True
        # on_evicted runs before the event is visible: whoever sees it in events() sees its effect
        self._emit(kind, nodes=nodes, state_round=state_round, once=False, before=self._on_evicted)
        if self._on_evicted is not None:
            return
        self._log.warning("worker_stopping", reason=kind, delay_s=self.stop_delay, grace_s=self.evict_grace)
        stop_self(self.stop_delay, self.evict_grace)  # SIGTERM after the delay, the kernel's end at the grace
