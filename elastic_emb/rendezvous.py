"""Agent side: a torchrun rendezvous backend that sees every membership change.

``torchrun --rdzv-backend=elastic_emb --rdzv-endpoint=HOST:PORT --rdzv-conf=inner=c10d,...``
selects this module through the ``torchrun.handlers`` entry point (``handler_factory``). It is not
a rendezvous protocol of its own: it wraps torch's dynamic rendezvous (``inner=c10d`` or
``inner=etcd-v2``) and adds four things the stock agent lacks (FACTS items 1-8):

1. **Events.** Every round and every change is one structlog JSON event (stderr, and the file
   named by ``event_file``): ``rendezvous_round`` (round, world size, participants in group-rank
   order, joins, departures, deaths, duration), ``membership_changed``, ``scale_up_pending``,
   ``drain_requested`` / ``drain_finished`` (outcome ``acknowledged`` or ``timeout``),
   ``node_left``, ``dead_node_evicted``, ``rendezvous_failed`` (with torch's error).
2. **Generation and membership for the workers.** After each round the backend puts into the
   agent's environment (torchrun copies it into every worker it then starts):

   ====================================  =====================================================
   ``ELASTIC_EMB_GENERATION``            the rendezvous round (read by ``Topology.from_env``)
   ``ELASTIC_EMB_RDZV_BACKEND``          ``c10d`` or ``etcd-v2`` (the inner backend)
   ``ELASTIC_EMB_RDZV_ENDPOINT``         the rendezvous endpoint (what the watcher reads)
   ``ELASTIC_EMB_RDZV_NODE``             this agent's node id in the rendezvous (one per agent process)
   ``ELASTIC_EMB_MEMBERSHIP``            JSON list of node ids, index = group rank
   ``ELASTIC_EMB_AGENT_PID``             the agent's pid (a worker that outlives it is orphaned)
   ``ELASTIC_EMB_DRAIN``                 ``1`` when the agent drains before a scale-up
   ``ELASTIC_EMB_WATCH_INTERVAL``        the watcher's polling interval in seconds
   ``ELASTIC_EMB_STORE_OUTAGE_TIMEOUT``  how long the watcher treats an unreachable store as unknown
   ====================================  =====================================================

   torch's shared agent store is always disabled (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): with
   it a scale-up deadlocks (FACTS item 1); without it worker rank 0 hosts a fresh store per round.
3. **Scale-down.** The stock agent only asks ``num_nodes_waiting()`` while its workers are
   healthy and restarts them (without spending restart budget) when it is > 0 (FACTS item 2).
   This backend answers > 0 also when the membership of the running round changed: a
   participant's heartbeat expired, an agent left, a node was reported dead, or the round moved
   on. A SIGTERMed agent leaves the rendezvous on exit (torch's own exit operation), so the
   survivors restart at once instead of waiting for its heartbeat to expire. A SIGKILLed agent
   cannot say goodbye; its orphaned workers notice (their parent changed, see ``watch.py``) and
   report the node dead under a round-scoped store key; the survivors then remove it from the
   rendezvous state (what torch's heartbeat expiry would do seconds later) and restart.
4. **Drain before scale-up.** When a node waits to join, every agent posts a drain request for
   the running round; the workers' watchers agree on a last step, finish and commit it, and
   acknowledge; the agent lets torch restart its workers only when every worker acknowledged, or
   after ``drain_timeout`` seconds, whichever comes first (the event says which).

Speed, all through torch's own rendezvous operations: the state cache (1 s) and the 1 s pause
between rendezvous polls, both hard-coded in torch, become ``sync_interval`` (default 0.1 s) in
this backend's agent process; after a scale-down the next round is marked complete as soon as
every expected survivor has joined it, instead of waiting ``last_call_timeout`` for nodes that
cannot come (``_EarlyCompletion``). A departure (the node wrote its ``left`` mark) and a death
(reported by its orphans, or its heartbeat expired) are told apart in the events. The agent
refreshes its own heartbeat every half ``keep_alive_interval``: torch's timer lets it age to
about two intervals, and with ``keep_alive_max_attempt=2`` a live node is then declared dead
(measured: stock c10d with those settings formed two worlds side by side on this machine).

--rdzv-conf keys (besides torch's own: ``last_call_timeout``, ``join_timeout``,
``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``,
``read_timeout``, ``is_host``, ``store_type``, and the etcd ssl/protocol keys, all passed on):

``inner`` (``c10d``), ``event_file`` (none), ``drain`` (``1``), ``drain_timeout`` (30 s),
``sync_interval`` (0.1 s), ``watch_interval`` (0.1 s, handed to the workers),
``store_outage_timeout`` (30 s; handed to the workers).

**Store outages.** The point of ``inner=etcd-v2`` is a store that outlives every node, so a
short outage of the store itself (etcd restarted, a network blip) must not end the job: the
workers' own collectives do not touch it. Every call the agent makes on the store (torch's
state reads and compare-and-set writes through the inner backend, and elastic_emb's round
keys) goes through one :class:`OutageGuard`: on a connection error it retries with
exponential backoff (0.05 s doubling to 1 s, jitter 50-100 %) until the store answers or the
outage (measured from the first failed call, shared by all threads) reaches
``store_outage_timeout``; then it raises :class:`StoreOutageError` naming the endpoint, the
outage length and the remedy, and the agent fails as before. Events: ``store_unreachable``
(once per outage), ``store_reachable`` (with ``outage_s``), ``store_outage_exceeded``. Nobody
can write a heartbeat while the store is down, so after an outage the heartbeats that were
alive when it began are moved forward by its length (in the state this agent reads, and so in
the next state it writes): torch would otherwise call every node dead at the first read.
Other errors (a corrupt state, a compare-and-set conflict) are not retried here. Limit: a node
that did not see the outage (one starting just then) cannot credit it; if its first read comes
before a survivor has written the credited state, and the outage outlasted
``keep_alive_interval x keep_alive_max_attempt``, it removes the others as dead and they restart
into its round (a membership restart: free, nothing lost; the ``store-host-loss`` drill, whose
joiner starts during the outage, can show this). A heartbeat expiry above the outages you
expect avoids it.

Caveat (FACTS item 6): torch imports this module in every process that imports
``torch.distributed.elastic.rendezvous``, so importing it has no side effect; the patches and
the environment changes happen only when torchrun creates a handler.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import random
import sys
import threading
import time
import weakref
from datetime import datetime, timedelta, timezone
from collections.abc import Callable, Mapping
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

BACKEND_NAME = "elastic_emb"

ENV_GENERATION = "ELASTIC_EMB_GENERATION"
ENV_RDZV_BACKEND = "ELASTIC_EMB_RDZV_BACKEND"
ENV_RDZV_ENDPOINT = "ELASTIC_EMB_RDZV_ENDPOINT"
ENV_NODE_ID = "ELASTIC_EMB_RDZV_NODE"
ENV_MEMBERSHIP = "ELASTIC_EMB_MEMBERSHIP"
ENV_AGENT_PID = "ELASTIC_EMB_AGENT_PID"
ENV_DRAIN = "ELASTIC_EMB_DRAIN"
ENV_WATCH_INTERVAL = "ELASTIC_EMB_WATCH_INTERVAL"
ENV_STORE_OUTAGE_TIMEOUT = "ELASTIC_EMB_STORE_OUTAGE_TIMEOUT"
DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Where each inner backend keeps torch's pickled _RendezvousState (FACTS item 7).
C10D_STATE_KEY = "torch.rendezvous.{run_id}"
ETCD_STATE_KEY = "/torch/elastic/rendezvous/{run_id}"
ETCD_STORE_PREFIX = "/torch/elastic/store"
C10D_NULL_STATE = b"Y2FuaW1hZGFt"  # torch's "no state yet" sentinel in the c10d backend


# Key names under round_prefix() (the drain protocol and death/leave reports). elastic_emb.drain
# (the preStop client) speaks the same protocol: rename nothing without it.
KEY_DRAIN = "drain"  # agent (or preStop hook) -> workers: stop after an agreed step
KEY_WORLD_SIZE = "world_size"  # watchers -> agent: acknowledgements to expect
KEY_ACKS = "acks"  # counter of workers that committed the last step and stopped
KEY_ACK = "ack/"  # + rank: the step that worker stopped after
KEY_STOP_CLAIM = "stop_claim"  # counter: the first rank to see a drain fixes the last step
KEY_STOP_STEP = "stop_step"  # the agreed last step
KEY_DEAD = "dead"  # counter of death reports; + "/" + node id: one report
KEY_LEFT = "left/"  # + node id: the node left on purpose (reason)


def round_prefix(run_id: str, round_: int) -> str:
    """Store key prefix of elastic_emb's keys for one rendezvous round (drain, deaths, leaves).

    Round-scoped so a key of an earlier round can never be mistaken for a current one.
    """
    return f"elastic_emb/{run_id}/round{round_}/"


class ListenerConfig(BaseModel):
    """elastic_emb's own --rdzv-conf keys (torch's keys pass through to the inner backend)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    inner: Literal["c10d", "etcd-v2"] = "c10d"
    event_file: str | None = None
    drain: bool = True
    drain_timeout: float = Field(default=30.0, ge=0.0)
    sync_interval: float = Field(default=0.1, gt=0.0, le=1.0)
    watch_interval: float = Field(default=0.1, gt=0.0, le=10.0)
    store_outage_timeout: float = Field(default=30.0, ge=0.0, le=3600.0)

    @classmethod
    def from_params(cls, config: Mapping[str, Any]) -> "ListenerConfig":
        values: dict[str, Any] = {}
        for key in cls.model_fields:
            if key in config and config[key] is not None:
                raw = config[key]
                if key == "drain" and isinstance(raw, str):
                    low = raw.strip().lower()
                    if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(f"--rdzv-conf drain={raw!r}: use 1 or 0")
                    raw = low in ("1", "true", "yes", "on")
                values[key] = raw
        try:
            return cls(**values)
        except ValidationError as exc:
            bad = "; ".join(f"{e['loc'][0]}={values.get(e['loc'][0])!r}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"invalid --rdzv-conf for the elastic_emb backend: {bad}") from None


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------


class _Tee:
    """A structlog 'logger' that writes each rendered line to stderr and, if given, a file."""

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the agent

    def msg(self, message: str) -> None:
        with self._lock:
            # One write() per line: the agent's workers share its stderr, and print() writes the
            # text and the newline separately, so two processes' lines could merge into one.
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            if self._file is not None:
                self._file.write(message + "\n")
                self._file.flush()

    info = warning = error = msg


def event_logger(path: str | None, **bound: Any):
    """A JSON-lines structlog logger for rendezvous events (stderr + optional file)."""
    return structlog.wrap_logger(
        _Tee(path),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
    ).bind(**bound)


# ---------------------------------------------------------------------------------------------
# Store outages
# ---------------------------------------------------------------------------------------------


class StoreOutageError(ConnectionError):
    """The rendezvous store stayed unreachable longer than ``store_outage_timeout``.

    The agent raises :func:`torch_store_outage_error`'s subclass, which is also torch's
    ``RendezvousConnectionError``: torch's own keep-alive timer then logs it instead of dying.
    """


_TORCH_OUTAGE_ERROR: list[type] = []


def torch_store_outage_error() -> type[StoreOutageError]:
    """StoreOutageError that is also torch's RendezvousConnectionError (built on first use: this
    module may not import torch.distributed.elastic at import time, see the module docstring)."""
    if not _TORCH_OUTAGE_ERROR:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        _TORCH_OUTAGE_ERROR.append(type("StoreOutageError", (StoreOutageError, RendezvousConnectionError), {
            "__module__": __name__, "__doc__": StoreOutageError.__doc__}))
    return _TORCH_OUTAGE_ERROR[0]


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the store could not be reached (worth a retry), as opposed to an
    answer the store gave (a missing key, a corrupt state, a compare-and-set conflict)."""
    if isinstance(exc, StoreOutageError):
        return False  # the bound already passed: never retried again
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    # torch's RendezvousConnectionError (both inner backends), c10d's DistNetworkError, and
    # python-etcd's EtcdConnectionFailed (EtcdStore raises it unwrapped); by name, so this
    # module imports neither at import time (see the caveat in the module docstring).
    return bool(names & {"RendezvousConnectionError", "DistNetworkError", "EtcdConnectionFailed"})


class OutageGuard:
    """Retries store calls across an outage of at most ``timeout`` seconds (module docstring).

    One guard per agent, shared by every thread that calls the store, so the bound is on the
    outage, not on each call: a call that starts late in an outage gets only what is left.
    """

    def __init__(self, endpoint: str, timeout: float, log: Any, *, base: float = 0.05, cap: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, error: type[StoreOutageError] = StoreOutageError) -> None:
        self.endpoint = endpoint
        self._error = error
        self.timeout = timeout
        self._log = log
        self._base = base
        self._cap = cap
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic, first failed call of this outage
        self._down_wall: datetime | None = None
        self._exceeded_reported = False
        self.closing = threading.Event()  # set at exit: fail at once instead of waiting
        self.last_outage: tuple[datetime, float] | None = None  # (began, seconds) of the last one
        self.outages = 0

    @property
    def down_for(self) -> float | None:
        with self._lock:
            return None if self._down_since is None else self._clock() - self._down_since

    def call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                delay = self._failed(op, exc, attempt)
                attempt += 1
                time.sleep(delay)
                continue
            self._succeeded(op)
            return result

    def _failed(self, op: str, exc: Exception, attempt: int) -> float:
        """Seconds to wait before the next try; raises once the outage outlasts the bound."""
        now = self._clock()
        with self._lock:
            if self._down_since is None:
                self._down_since = now
                self._down_wall = datetime.now(timezone.utc)
                self._exceeded_reported = False
                self._log.warning("store_unreachable", endpoint=self.endpoint, op=op, error=repr(exc),
                                  bound_s=self.timeout)
            down = now - self._down_since
            left = self.timeout - down
            report = left <= 0 and not self._exceeded_reported
            if report:
                self._exceeded_reported = True
        if left <= 0 or self.closing.is_set():
            if report:
                self._log.error("store_outage_exceeded", endpoint=self.endpoint, op=op, outage_s=round(down, 3),
                                bound_s=self.timeout, error=repr(exc))
            raise self._error(
                f"the rendezvous store at {self.endpoint} has been unreachable for {down:.1f} s (op {op}: "
                f"{type(exc).__name__}: {exc}), longer than store_outage_timeout={self.timeout:g} s"
                + (" (the agent is exiting, so it did not wait)" if self.closing.is_set() and left > 0 else "")
                + ": bring the store back (is etcd running and reachable from this node?), or raise "
                f"--rdzv-conf store_outage_timeout if outages this long are expected"
            ) from exc
        # Exponential backoff with jitter (50-100 %): agents that lost the store together do not
        # come back in lockstep; never sleep past the bound, so the error comes on time.
        return min(left, min(self._cap, self._base * 2 ** min(attempt, 30)) * random.uniform(0.5, 1.0))

    def _succeeded(self, op: str) -> None:
        if self._down_since is None:  # the common case: no lock
            return
        now = self._clock()
        with self._lock:
            if self._down_since is None:
                return
            outage = now - self._down_since
            self.last_outage = (self._down_wall, outage)
            self.outages += 1
            self._down_since = self._down_wall = None
        self._log.info("store_reachable", endpoint=self.endpoint, op=op, outage_s=round(outage, 3))


class _GuardedBackend:
    """torch's ``RendezvousBackend`` (get_state/set_state) with its calls under an OutageGuard.

    After an outage, heartbeats that were alive when it began are moved forward by its length
    in every state read for one expiry period (until live nodes have written fresh ones): no node
    could write a heartbeat while the store was down, and torch's sync would otherwise remove
    every node as dead at its first read.
    """

    def __init__(self, inner: Any, guard: OutageGuard, expiry: timedelta) -> None:
        self._inner = inner
        self._guard = guard
        self._expiry = expiry
        self._shifted_outages = 0
        self._shift_until = 0.0

    @property
    def name(self) -> str:
        return self._inner.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def get_state(self):
        result = self._guard.call("get_state", self._inner.get_state)
        if result is None:
            return None
        bits, token = result
        return self._credit_outage(bits), token

    def set_state(self, state: bytes, token: Any = None):
        result = self._guard.call("set_state", self._inner.set_state, state, token)
        if result is None:
            return None
        bits, token, has_set = result
        return self._credit_outage(bits), token, has_set

    def _credit_outage(self, bits: bytes) -> bytes:
        guard = self._guard
        if guard.last_outage is None:
            return bits
        now = time.monotonic()
        if guard.outages != self._shifted_outages:  # a new outage ended: credit it for one expiry
            self._shifted_outages = guard.outages
            self._shift_until = now + self._expiry.total_seconds() + guard.last_outage[1]
        if now > self._shift_until:
            return bits
        began, length = guard.last_outage
        state = pickle.loads(bits)  # torch's own state, from the same store torch unpickles it from
        credit = timedelta(seconds=length)
        changed = False
        for node, beat in list(state.last_heartbeats.items()):
            # Alive when the outage began (not yet expired), and not refreshed since: credit it.
            if began - self._expiry <= beat < began:
                state.last_heartbeats[node] = beat + credit
                changed = True
        return pickle.dumps(state) if changed else bits


class _GuardedStore:
    """The round-key store (``set``/``get``/``add``/``check``) under an OutageGuard."""

    def __init__(self, inner: Any, guard: OutageGuard) -> None:
        self._inner = inner
        self._guard = guard

    def set(self, key: str, value: Any) -> None:
        return self._guard.call("store.set", self._inner.set, key, value)

    def get(self, key: str) -> Any:
        return self._guard.call("store.get", self._inner.get, key)

    def add(self, key: str, amount: int) -> int:
        return self._guard.call("store.add", self._inner.add, key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._guard.call("store.check", self._inner.check, keys)


# ---------------------------------------------------------------------------------------------
# Torch internals used, in one place (so a torch upgrade breaks here, with a clear message)
# ---------------------------------------------------------------------------------------------

_PATCHED_DELAY: dict[str, Any] = {}


def _shorten_rendezvous_polls(sync_interval: float) -> None:
    """Make torch's rendezvous loop poll every ``sync_interval`` s instead of every 1 s.

    ``_DistributedRendezvousOpExecutor.run`` sleeps ``_delay(seconds=1)`` between polls of the
    shared state; with ``last_call_timeout=1`` that pause alone can double a round's duration.
    Only the 1 s poll is shortened; the random start-up skew ``(0, 0.3)`` is kept.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = _PATCHED_DELAY.setdefault("original", dr._delay)
    _PATCHED_DELAY["interval"] = sync_interval

    def _delay(seconds):  # same signature as torch.distributed.elastic.rendezvous.utils._delay
        if not isinstance(seconds, tuple) and seconds >= 1:
            time.sleep(_PATCHED_DELAY["interval"])
        else:
            original(seconds)

    dr._delay = _delay


def node_id(node: Any) -> str:
    """The id of a torch ``_NodeDesc``: ``addr_pid_localid`` (its repr)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


class Membership(BaseModel):
    """A view of the rendezvous state, decoupled from torch's private classes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    round: int
    complete: bool
    closed: bool
    participants: tuple[str, ...]  # node ids in group-rank order (when complete)
    wait_list: tuple[str, ...]
    redundancy_list: tuple[str, ...] = ()

    @classmethod
    def of(cls, state: Any) -> "Membership":
        ordered = sorted(state.participants.items(), key=lambda kv: (kv[1], node_id(kv[0])))
        return cls(
            round=int(state.round),
            complete=bool(state.complete),
            closed=bool(state.closed),
            participants=tuple(node_id(n) for n, _ in ordered),
            wait_list=tuple(sorted(node_id(n) for n in state.wait_list)),
            redundancy_list=tuple(sorted(node_id(n) for n in getattr(state, "redundancy_list", ()))),
        )


# ---------------------------------------------------------------------------------------------
# The handler
# ---------------------------------------------------------------------------------------------


class ElasticEmbRendezvousHandler:
    """A ``RendezvousHandler`` that delegates to torch's dynamic rendezvous and adds events,
    worker environment, scale-down detection and drain gating (see the module docstring)."""

    def __init__(self, inner: Any, config: ListenerConfig, endpoint: str, guard: OutageGuard | None = None) -> None:
        self._inner = inner
        self._config = config
        self._endpoint = endpoint
        for attr in ("_state_holder", "_this_node", "_settings", "_heartbeat_lock", "_op_executor", "_store"):
            if not hasattr(inner, attr):
                raise RuntimeError(
                    f"torch's DynamicRendezvousHandler has no attribute {attr!r} in this torch version; "
                    f"the elastic_emb backend supports torch >= 2.11 with that layout: use "
                    f"--rdzv-backend=c10d (and elastic_emb.watch alone) or pin a supported torch"
                )
        holder = inner._state_holder
        # torch caches the state 1 s; num_nodes_waiting() is polled every --monitor-interval.
        if hasattr(holder, "_cache_duration"):
            holder._cache_duration = config.sync_interval
        self._node = node_id(inner._this_node)
        self._run_id = inner._settings.run_id
        self._log = event_logger(config.event_file, component="rendezvous", run_id=self._run_id, node=self._node)
        # Every store call of this agent (torch's and ours) rides out a store outage up to the bound.
        if guard is None:
            guard = OutageGuard(endpoint, config.store_outage_timeout, self._log, error=torch_store_outage_error())
        guard._log = self._log  # from here on its events name this node
        self._guard = guard
        settings = inner._settings
        holder._backend = _GuardedBackend(
            holder._backend, self._guard, settings.keep_alive_interval * settings.keep_alive_max_attempt
        )
        self._members: tuple[str, ...] = ()
        self._round: int | None = None
        self._round_store: Any = None
        self._known_dead: set[str] = set()
        self._expected_next: frozenset[str] | None = None
        self._changed_reported = False
        self._drain_started: float | None = None
        self._drain_done = False
        self._lock = threading.Lock()
        self._rdzv_lock = threading.Lock()
        self._left = False
        self._closed = threading.Event()
        # torch's keep-alive timer fires every keep_alive_interval and writes only a heartbeat
        # older than that, and its first tick comes a full interval after a round completes: a
        # heartbeat can age to ~2 intervals, which keep_alive_max_attempt=2 calls dead. The stock
        # agent ignores such a false death; this backend restarts on it, so it keeps its own
        # heartbeat fresher: every half interval (torch's own keep-alive operation).
        interval = inner._settings.keep_alive_interval.total_seconds()
        self._heartbeat_every = max(0.05, interval / 2)
        threading.Thread(
            target=_heartbeat_loop, args=(weakref.ref(self), self._closed, self._heartbeat_every),
            name="elastic_emb-heartbeat", daemon=True,
        ).start()
        # atexit: a SIGTERMed agent (torchrun raises SignalException and exits) leaves the
        # rendezvous instead of lingering until its heartbeat expires (FACTS items 3-4).
        ref = weakref.ref(self)
        atexit.register(lambda: (h := ref()) is not None and h._leave("agent_exit"))

    # -- RendezvousHandler interface ------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return False  # FACTS item 1: the shared agent store deadlocks a scale-up

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def shutdown(self) -> bool:
        self._left = True
        self._closed.set()  # a closed rendezvous needs no leave
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
        start = time.monotonic()
        previous = self._members
        previous_round = self._round
        expected = self._expected_next
        self._expected_next = None
        early = _EarlyCompletion(self, expected) if expected else None
        with self._rdzv_lock:  # no heartbeat of ours interleaves with torch's join operation
            try:
                info = self._inner.next_rendezvous()
            except Exception as exc:
                self._log.error("rendezvous_failed", previous_round=previous_round, error=f"{type(exc).__name__}: {exc}",
                                duration_s=round(time.monotonic() - start, 3))
                raise
            finally:
                if early is not None:
                    early.stop()
            try:
                self._heartbeat()
            except Exception as exc:  # torch's own timer still beats; the next tick of ours retries
                self._log.warning("heartbeat_failed", error=repr(exc))
        state = Membership.of(self._inner._state_holder.state)
        members = state.participants
        joins = [n for n in members if n not in previous]
        gone = [n for n in previous if n not in members]
        deaths = [n for n in gone if n in self._known_dead]
        with self._lock:
            self._members = members
            self._round = state.round
            self._round_store = _GuardedStore(self._inner._store, self._guard)
            self._changed_reported = False
            self._drain_started = None
            self._drain_done = False
            self._known_dead.clear()  # the dead are no members now; a rejoining node starts clean
        self._export_env(state)
        self._log.info(
            "rendezvous_round",
            round=state.round,
            previous_round=previous_round,
            world_size=len(members),
            group_rank=info.rank,
            participants=list(members),
            joins=joins,
            departures=[n for n in gone if n not in deaths],
            deaths=deaths,
            duration_s=round(time.monotonic() - start, 3),
        )
        return info

    def num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        with self._lock:
            if self._round is None:
                return waiting
            holder = self._inner._state_holder
            self._evict_reported_dead()
            view = Membership.of(holder.state)
            changed = self._membership_change(view)
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

    # -- heartbeats -----------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Refresh this node's heartbeat in torch's state if it is older than half an interval."""
        inner = self._inner
        with inner._heartbeat_lock:
            inner._op_executor.run(_FreshHeartbeat(self._heartbeat_every), time.monotonic() + 5.0)

    # -- scale-down -----------------------------------------------------------------------

    def _membership_change(self, view: Membership) -> dict | None:
        """What differs between the running round and the current state, or None.

        Every event carries ``departures`` (left on purpose), ``deaths`` (reported dead, or the
        heartbeat expired) and ``restarting`` (members already in the wait list: their agent
        restarted first, they are coming back), and ``expected``: who should form the next round.
        """
        if view.round != self._round:
            return {"reason": "round_advanced", "state_round": view.round, "departures": [], "deaths": [],
                    "restarting": [], "participants": list(view.participants), "expected": None}
        absent = [n for n in self._members if n not in view.participants]
        if not absent:
            return None
        restarting = [n for n in absent if n in view.wait_list]
        gone = [n for n in absent if n not in restarting]
        # A node that left on purpose said so (KEY_LEFT); any other absence is a death:
        # reported by its orphans, or its heartbeat expired (hung, partitioned, lost host).
        prefix = round_prefix(self._run_id, self._round)
        for n in gone:
            if n not in self._known_dead and not self._said_left(prefix, n):
                self._known_dead.add(n)
        dead = [n for n in gone if n in self._known_dead]
        return {
            "reason": "participant_gone" if gone else "peer_restarting",
            "departures": [n for n in gone if n not in dead],
            "deaths": dead,
            "restarting": restarting,
            "participants": list(view.participants),
            "expected": sorted(set(view.participants) | set(restarting)),
        }

    def _said_left(self, prefix: str, node: str) -> bool:
        try:
            return bool(self._round_store.check([prefix + KEY_LEFT + node]))
        except StoreOutageError:
            raise  # the bound passed: the agent fails, naming the store
        except Exception as exc:  # unreadable: call it a departure, the restart is the same
            self._log.warning("left_mark_unreadable", round=self._round, node=node, error=repr(exc))
            return True

    def _evict_reported_dead(self) -> None:
        """Remove nodes that their orphaned workers reported dead from torch's state.

        Torch would drop them when their heartbeat expires (keep_alive_interval x
        keep_alive_max_attempt); the report is faster and certain: the reporting worker saw its
        own agent process vanish.
        """
        store = self._round_store
        prefix = round_prefix(self._run_id, self._round)
        try:
            if int(store.add(prefix + KEY_DEAD, 0)) == 0:
                return
            reported = [
                n for n in self._members
                if n not in self._known_dead and store.check([prefix + f"{KEY_DEAD}/{n}"])
            ]
        except StoreOutageError:
            raise
        except Exception as exc:  # the store is the rendezvous itself; torch's sync will raise too
            self._log.warning("dead_report_unreadable", round=self._round, error=repr(exc))
            return
        fresh = [n for n in reported if n in self._members and n not in self._known_dead]
        if not fresh:
            return
        self._known_dead.update(fresh)
        removed = self._remove_from_state(set(fresh))
        self._log.info("dead_node_evicted", round=self._round, nodes=fresh, removed=removed, source="orphan_report")

    def _remove_from_state(self, nodes: set[str]) -> list[str]:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        inner = self._inner
        holder = inner._state_holder
        with inner._heartbeat_lock:
            for _ in range(10):  # compare-and-set against other agents; bounded retries
                holder.sync()
                state = holder.state
                hit = [n for n in list(state.participants) + list(state.wait_list) if node_id(n) in nodes]
                if not hit:
                    return []
                removed_participant = False
                for n in hit:
                    if n in state.participants:
                        del state.participants[n]
                        removed_participant = True
                    state.wait_list.discard(n)
                    state.redundancy_list.discard(n)
                    state.last_heartbeats.pop(n, None)
                if removed_participant:
                    dr._remove_participant_epilogue(state, inner._settings)
                holder.mark_dirty()
                if holder.sync():
                    return [node_id(n) for n in hit]
        return []

    def _leave(self, why: str) -> None:
        """Leave the rendezvous (torch's own exit operation) and say so in the round's keys."""
        if self._left or self._round is None:
            return
        self._left = True
        self._closed.set()
        self._guard.closing.set()  # at exit, an unreachable store is not waited for
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        start = time.monotonic()
        inner = self._inner
        try:
            inner._stop_heartbeats()
            store = self._round_store
            store.set(round_prefix(self._run_id, self._round) + KEY_LEFT + self._node, why)
            with inner._heartbeat_lock:
                inner._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + 5.0)
            self._log.info("node_left", round=self._round, reason=why, duration_s=round(time.monotonic() - start, 3))
        except Exception as exc:  # best effort at exit: the heartbeat expiry still removes us
            self._log.warning("leave_failed", round=self._round, reason=why, error=repr(exc))

    # -- drain before scale-up ------------------------------------------------------------

    def _drain_gate(self, waiting: int, view: Membership) -> int:
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
            store.set(prefix + KEY_DRAIN, json.dumps({"round": self._round, "waiting": list(view.wait_list)}))
            self._log.info("drain_requested", round=self._round, waiting=list(view.wait_list), timeout_s=self._config.drain_timeout)
        try:
            expected = int(store.get(prefix + KEY_WORLD_SIZE)) if store.check([prefix + KEY_WORLD_SIZE]) else 0
            acks = int(store.add(prefix + KEY_ACKS, 0))
        except StoreOutageError:
            raise
        except Exception as exc:
            self._log.warning("drain_unreadable", round=self._round, error=repr(exc))
            expected, acks = -1, 0
        outcome = None
        if expected == 0:
            outcome = "no_watchers"  # the workers run no elastic_emb watcher: nobody will ack
        elif expected > 0 and acks >= expected:
            outcome = "acknowledged"
        elif now - self._drain_started >= self._config.drain_timeout:
            outcome = "timeout"
        if outcome is None:
            return 0
        stop_step = None
        if store.check([prefix + KEY_STOP_STEP]):
            stop_step = int(store.get(prefix + KEY_STOP_STEP))
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

    def _export_env(self, state: Membership) -> None:
        """torchrun starts the workers with a copy of the agent's os.environ (FACTS item 6)."""
        os.environ.update(
            {
                ENV_GENERATION: str(state.round),
                ENV_RDZV_BACKEND: self._config.inner,
                ENV_RDZV_ENDPOINT: self._endpoint,
                ENV_NODE_ID: self._node,
                ENV_MEMBERSHIP: json.dumps(list(state.participants)),
                ENV_AGENT_PID: str(os.getpid()),
                ENV_DRAIN: "1" if self._config.drain else "0",
                ENV_WATCH_INTERVAL: str(self._config.watch_interval),
                ENV_STORE_OUTAGE_TIMEOUT: str(self._config.store_outage_timeout),
            }
        )


class _EarlyCompletion:
    """Completes the next round as soon as every expected survivor has joined it.

    After a scale-down the survivors are known: waiting ``last_call_timeout`` for nodes that
    cannot come is pure loss. A thread polls the state (its own state holder on the same
    backend: torch's compare-and-set makes it one more writer, like another node) and, when the
    new round's participants are exactly the expected survivors, takes torch's own
    ``MARK_RENDEZVOUS_COMPLETE`` action (ranks assigned as torch does). Any other membership
    (a newcomer, a missing survivor) leaves the round to torch's last-call rule.
    """

    def __init__(self, handler: "ElasticEmbRendezvousHandler", expected: frozenset[str]) -> None:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        inner = handler._inner
        self._handler = handler
        self._expected = expected
        self._after_round = handler._round if handler._round is not None else -1
        self._done = threading.Event()
        self._holder = dr._BackendRendezvousStateHolder(inner._state_holder._backend, inner._settings, cache_duration=0)
        self._executor = dr._DistributedRendezvousOpExecutor(inner._this_node, self._holder, inner._settings)
        self._interval = handler._config.sync_interval
        self._deadline = time.monotonic() + inner._settings.timeout.join.total_seconds()
        self._thread = threading.Thread(target=self._run, name="elastic_emb-early-complete", daemon=True)
        self._thread.start()

    def __call__(self, ctx: Any, deadline: float) -> Any:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

        state = ctx.state
        if state.complete or state.closed or state.round <= self._after_round:
            if state.complete and state.round > self._after_round:
                self._done.set()
            return _Action.FINISH
        if frozenset(node_id(n) for n in state.participants) == self._expected and len(state.participants) >= ctx.settings.min_nodes:
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return _Action.FINISH

    def _run(self) -> None:
        while not self._done.is_set() and time.monotonic() < self._deadline:
            try:
                self._executor.run(self, self._deadline)
            except Exception as exc:  # torch's own join still completes the round on its rules
                self._handler._log.warning("early_completion_failed", error=repr(exc))
                return
            if self._done.wait(self._interval):
                return
        if self._done.is_set():
            return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(2.0)


class _FreshHeartbeat:
    """A rendezvous operation (torch's op protocol: ``(ctx, deadline) -> _Action``) that writes
    this node's heartbeat when it is older than ``max_age`` s, and never adds a node that is
    not in the state (a node that left must stay out)."""

    def __init__(self, max_age: float) -> None:
        self._max_age = timedelta(seconds=max_age)

    def __call__(self, ctx: Any, deadline: float) -> Any:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

        last = ctx.state.last_heartbeats.get(ctx.node)
        if last is None or last > datetime.now(timezone.utc) - self._max_age:
            return _Action.FINISH
        if time.monotonic() > deadline:
            return _Action.ERROR_TIMEOUT
        return _Action.KEEP_ALIVE


def _heartbeat_loop(ref: "weakref.ref[ElasticEmbRendezvousHandler]", closed: threading.Event, every: float) -> None:
    while not closed.wait(every):
        handler = ref()
        if handler is None or handler._left:
            return
        if handler._round is None or not handler._rdzv_lock.acquire(blocking=False):
            continue  # before the first round, or while torch's join runs its own keep-alives
        try:
            handler._heartbeat()
        except Exception as exc:  # torch's timer keeps going too; report and retry next tick
            handler._log.warning("heartbeat_failed", error=repr(exc))
        finally:
            handler._rdzv_lock.release()
        del handler


def create_handler(params: Any) -> ElasticEmbRendezvousHandler:
    """Build the handler from torchrun's ``RendezvousParameters``."""
    config = ListenerConfig.from_params(params.config)
    # Before torch builds anything: the inner handler reads it in next_rendezvous, the agent in
    # _start_workers (FACTS item 1).
    os.environ[DISABLE_SHARED_STORE] = "1"
    _shorten_rendezvous_polls(config.sync_interval)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if config.inner == "c10d":
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    else:
        try:
            from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend
        except ImportError as exc:
            raise RuntimeError(
                f"--rdzv-conf inner=etcd-v2 needs the python-etcd package ({exc}); pip install python-etcd"
            ) from exc
    # etcd's backend connects at creation: an agent (re)started during a store outage waits too.
    log = event_logger(config.event_file, component="rendezvous", run_id=params.run_id)
    guard = OutageGuard(params.endpoint, config.store_outage_timeout, log, error=torch_store_outage_error())
    backend, store = guard.call("create_backend", create_backend, params)
    inner = dr.create_handler(store, backend, params)
    return ElasticEmbRendezvousHandler(inner, config, params.endpoint, guard)


def handler_factory() -> Callable[[Any], ElasticEmbRendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the creator torch registers."""
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
