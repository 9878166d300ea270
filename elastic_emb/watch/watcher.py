"""The worker's watcher: a thread that polls the rendezvous and tells the lifecycle what changed.

torchrun tells a worker nothing about membership. :class:`Watcher` turns each rendezvous state
into :class:`~elastic_emb.watch.membership.MembershipEvent` records, stops an orphaned or evicted
worker, settles a drain's last step among the ranks and acknowledges it, and counts store
outages. The reader's and the events' names are importable from here too (``__all__``).

Design: ``docs/LIFECYCLE.md`` (section "The watcher").
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_emb.events import get_logger
from elastic_emb.native_calls import exiting, native_call

# The worker side imports the wire contract (keys), the shared decoder and view (decode), the
# shared outage tracker (outage) and the store reader (reader) from the rendezvous package; never
# the agent-side handler.
from elastic_emb.rdzv.counters import increment
from elastic_emb.rdzv.decode import ALLOWED_CLASSES, Participant, RendezvousView, UnsafeStateError, decode_state
from elastic_emb.rdzv.drain_acks import (
    RESTORE_EVERY_S,
    agree_stop_step,
    keep_expected,
    write_ack,
    write_expected,
    write_local_count,
)
from elastic_emb.rdzv.keys import (
    ENV_RDZV_ENDPOINT,
    KEY_DEAD,
    KEY_DRAIN,
    KEY_EVICTED,
    round_prefix,
)
from elastic_emb.rdzv.outage import OutageTracker, is_connection_error
from elastic_emb.rdzv.reader import RendezvousReader, print_state
from elastic_emb.rdzv.signing import Signer, read_signed
from elastic_emb.watch.membership import EXPLAINING, EventKind, MembershipEvent, classify, departed
from elastic_emb.watch.selfstop import agent_gone, stop_self

StateView = RendezvousView  # another name for the view, importable from here
# The reader's (rdzv/reader.py) and the event classification's (membership.py) names are
# importable from here too.
__all__ = [
    "ALLOWED_CLASSES",
    "EventKind",
    "MembershipEvent",
    "Participant",
    "RendezvousReader",
    "RendezvousView",
    "StateView",
    "UnsafeStateError",
    "Watcher",
    "decode_state",
    "print_state",
]


# -- the watcher --------------------------------------------------------------------------------


class Watcher:
    """Polls the rendezvous for one worker and reports what changed.

    Build it with :meth:`from_env` and :meth:`start` it before the lifecycle. ``prober`` and
    ``on_failure`` are set by the in-process resize; ``failure_seen`` holds once the failure flag
    given to :meth:`watch_failures` is set.

    Args:
        reader: reads the rendezvous state and holds the store.
        round_: the worker's rendezvous round; None learns it from the first complete state.
        rank: the worker's rank.
        world_size: the world's size.
        node: the worker's node (its agent's rendezvous id); None finds it in the state.
        agent_pid: the agent's pid (the worker's parent, unless a wrapper sits between).
        interval: seconds between polls.
        drain: whether to take part in drains.
        stop_delay: seconds from an eviction to this process's SIGTERM.
        evict_grace: seconds from an eviction to the process's hard end.
        on_evicted: called with the event instead of stopping the process, or None.
        signer: signs and verifies control keys; None reads the job's secret from the environment.
        store_outage_timeout: seconds of store outage after which ``store_outage_exceeded`` holds.

    Raises:
        ValueError: ``interval`` is not positive, ``stop_delay`` is outside
            ``[0, evict_grace]``, or ``store_outage_timeout`` is negative.
    """

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
        count_file: str | None = None,
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
        self._count_file = count_file  # the agent's copy of the count (drain_acks.write_local_count)
        self._count_written: tuple[int, int] | None = None  # (round, world size) last written there
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
        """A watcher for this worker, from torchrun's and elastic_emb's variables.

        Args:
            env: the environment to read; None reads ``os.environ``.
            **kwargs: constructor arguments that override the environment's.

        Returns:
            The watcher (not started), or None when the rendezvous endpoint is unknown.

        Raises:
            ConfigError: an ``ELASTIC_EMB_*`` variable is malformed.
        """
        from elastic_emb.config import load, variable

        env = os.environ if env is None else env
        settings = load(
            env,
            "rdzv_endpoint",
            "rdzv_backend",
            "agent_pid",
            "generation",
            "rdzv_round",
            "watch_interval",
            "drain",
            "store_outage_timeout",
            "rdzv_node",
            "drain_count_file",
        )
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
        # connect bounded by 30 s: a loaded host's store may be slow to accept, and a worker that
        # gives up dies at start; each later call stays bounded by 2 s
        reader = RendezvousReader(backend, endpoint, run_id, connect_timeout=30.0)
        agent_pid = settings.agent_pid or os.getppid()
        # The round: ELASTIC_EMB_RDZV_ROUND, else ELASTIC_EMB_GENERATION when set (a backend that
        # does not set the round passes it as the generation). Neither (no elastic_emb backend):
        # the round is learnt from the first complete state.
        gen = (
            settings.rdzv_round
            if settings.rdzv_round is not None
            else (settings.generation if env.get(variable("generation")) else None)
        )
        kwargs.setdefault("interval", settings.watch_interval)
        kwargs.setdefault("drain", settings.drain)
        kwargs.setdefault("store_outage_timeout", settings.store_outage_timeout)
        kwargs.setdefault("signer", Signer.from_env(env))
        kwargs.setdefault("count_file", settings.drain_count_file)
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
        """Whether this worker is outside the membership (it must not touch shared state)."""
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
        """Poll once now, publish the drain's expected count, then poll in a daemon thread.

        Returns:
            This watcher; starting a started watcher does nothing.
        """
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

    def poll(self) -> None:
        """Read the rendezvous state once, now, as the watcher's thread does every ``interval``.

        For a caller that drives a watcher it never started (a benchmark that times this read).
        """
        self._poll()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the polling thread and wait for it.

        Args:
            timeout: seconds to wait for the thread at most.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Watcher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def events(self) -> list[MembershipEvent]:
        """Hand out the membership events recorded since the last call.

        Returns:
            The events, oldest first.
        """
        with self._lock:
            out, self._events = self._events, []
        return out

    def drain_requested(self, step: int | None = None) -> bool:
        """Whether the worker must stop stepping for a drain.

        Args:
            step: the step just committed; None asks only whether a request is pending. The first
                rank to see the request with a step fixes the last step at ``step + 1``.

        Returns:
            With ``step``: True once ``step`` reaches the last step all ranks agreed on. Without:
            whether a request is pending. Always False when draining is off, before the round is
            known, or after an eviction.

        Raises:
            TimeoutError: another rank claimed the last step but did not publish it within 10 s
                (it died).
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
            self._stop_step = agree_stop_step(self._reader.store, self._signer, self._prefix(), step + 1, self._log)
        return step >= self._stop_step

    def membership_change_pending(self, timeout: float = 2.0) -> bool:
        """After a collective failed: whether a membership change explains it.

        Polls until the state shows a departure, a newer round, a waiting node, or this worker's
        eviction.

        Args:
            timeout: seconds to poll at most.

        Returns:
            True when a change explains the failure: the agent is about to restart the workers,
            so wait for its SIGTERM instead of exiting with an error, which torch would count
            against the restart budget. False when the failure is a real one.
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
        """The workers re-formed in process: take the new generation's members.

        The departures and round changes seen so far are settled (a later one is reported
        afresh), and rank 0 rewrites the drain's expected count at its next poll.

        Args:
            nodes: the new generation's nodes.
            rank: this worker's new rank.
            world_size: the new world size.
        """
        with self._lock:
            self._members = tuple(nodes)
            self._reported = {k for k in self._reported if k[0] not in ("departure", "round_advanced")}
            self._events = [e for e in self._events if e.kind not in ("departure", "round_advanced")]
        self.rank, self.world_size = rank, world_size
        if self._thread is not None:  # the new count, at the next poll (rank 0: _keep_drain_count)
            self._restore_due = 0.0

    def watch_failures(self, key: str | None) -> None:
        """In process: read the roll call's failure flag of this generation at each poll.

        Once the flag is set, ``failure_seen`` holds and ``on_failure`` runs once (never for a
        key that was replaced meanwhile).

        Args:
            key: the flag's store key (``RollCall.failed_key``); None stops watching.
        """
        with self._lock:
            self._failure_key, self.failure_seen = key, False

    def _control_set(self, key: str) -> bool:
        try:
            return bool(self._reader.store.check([key]))
        except Exception as exc:  # the state read reports an outage; this is a hint only
            self._log.debug("watch_store_error", op="failure_flag", error=repr(exc))
            return False

    def interrupted(self) -> bool:
        """Whether this generation is over, so that its store waits should end.

        Returns:
            True when a member is gone or a peer's collective failed.
        """
        return self.failure_seen or bool(self.gone())

    def gone(self) -> tuple[str, ...]:
        """The members of this worker's generation absent from the last state read.

        Returns:
            The absent members, in order; empty before the first state or round is known.
        """
        view = self.last_state
        if view is None or self.round is None:
            return ()
        return departed(self._members, view)

    @property
    def stop_step(self) -> int | None:
        """The drain's last step, once the ranks agreed on it; else None."""
        return self._stop_step

    def ack_drain(self, step: int) -> None:
        """Tell the agent this worker committed ``step`` and stopped stepping.

        Writes this rank's signed acknowledgement once; does nothing before the round is known
        or after an eviction.

        Args:
            step: the last step committed.
        """
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

    def _emit(
        self,
        kind: EventKind,
        *,
        nodes: tuple[str, ...] = (),
        state_round: int | None = None,
        once: bool = True,
        before: Callable[[MembershipEvent], None] | None = None,
    ) -> MembershipEvent | None:
        """Record an event (``once``: only the first of its kind and nodes); ``before`` runs with
        it before ``events()`` can return it."""
        with self._lock:
            if once:
                key = (kind, nodes)
                if key in self._reported:
                    return None
                self._reported.add(key)
        event = MembershipEvent(
            kind=kind,
            round=self.round if self.round is not None else -1,
            state_round=state_round,
            nodes=nodes,
            participants=self._members,
            at=time.time(),
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
        mine = [
            p.node
            for p in view.participants
            if p.pid == self.agent_pid and (p.addr in host or len(view.participants) == 1)
        ]
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
                # generation's failure is not this one's (it would end the new agreement's waits)
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
        if self._count_file and self._count_written != (self.round, self.world_size):
            self._tell_agent_count()
        for change in classify(view, round_=self.round, members=self._members, node=self.node):
            if change.kind != "evicted":
                self._emit(change.kind, nodes=change.nodes, state_round=change.state_round)
            elif self._eviction_confirmed():
                self._evict("evicted", nodes=change.nodes, state_round=change.state_round)

    def _tell_agent_count(self) -> None:
        """Every rank: the round's count into the agent's file, once per (round, world size); the
        agent falls back to it when the store's world_size is missing (a store writer deleted it)."""
        self._count_written = (self.round, self.world_size)
        try:
            write_local_count(self._count_file, self.round, self.world_size)
        except OSError as exc:  # the store's key still serves; the agent then has no fallback
            self._log.warning("drain_count_file_failed", path=self._count_file, error=repr(exc))

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
            self._log.warning(
                "drain_count_restored",
                round=self.round,
                world_size=self.world_size,
                reason="the round's world_size key was missing: deleted by a store writer",
            )
        elif replaced is not None:
            self._log.info(
                "drain_count_updated",
                round=self.round,
                world_size=self.world_size,
                was=replaced[:40].decode("ascii", "replace"),
            )

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
            self._log.warning(
                "eviction_unconfirmed",
                round=self.round,
                node=self.node,
                reason="the rendezvous state leaves this node out, but no agent signed its eviction",
            )
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
                increment(store, self._prefix() + KEY_DEAD)  # a hint: never add (rdzv/counters.py)
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
