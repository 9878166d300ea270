"""Every use of a private name of torch's dynamic rendezvous, in one place.

The backend wraps torch's ``DynamicRendezvousHandler`` and reaches into its private layer (the
handler's state holder, op executor, heartbeat lock and store; the state holder's backend and
cache; the exit operation and epilogue; the pickled ``_RendezvousState``). Importing this module
checks those names and their meaning against an in-memory backend and raises
:class:`~elastic_emb.errors.TorchCompatError` naming what changed and :data:`SUPPORTED_TORCH`.
It imports torch's dynamic rendezvous, so ``handler.py`` imports it only when torchrun creates a handler.

Design: ``docs/RDZV.md`` (section "torch's private names").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from elastic_emb.errors import ElasticEmbError, TorchCompatError
from elastic_emb.native_calls import exiting, native_call
from elastic_emb.rdzv.decode import dump_state, load_state, node_id

SUPPORTED_TORCH = ">=2.11,<2.16"  # keep in step with pyproject.toml (tests/test_torch_compat.py checks)


def _fail(what: str) -> TorchCompatError:
    return TorchCompatError(
        f"torch {torch.__version__}: {what}; the elastic_emb rendezvous backend supports torch {SUPPORTED_TORCH}: "
        f"install a supported torch, or use --rdzv-backend=c10d (the workers' elastic_emb.watch.watcher works without it)"
    )


# -- the entry points the handler uses ---------------------------------------------------------

_HANDLER_ATTRS = (
    "_state_holder",
    "_this_node",
    "_settings",
    "_heartbeat_lock",
    "_op_executor",
    "_store",
    "_stop_heartbeats",
    "_start_heartbeats",
    "_get_store",
)


def check_handler(inner: Any) -> None:
    """Check that torch's handler has every private attribute this module uses.

    Args:
        inner: torch's ``DynamicRendezvousHandler``.

    Raises:
        TorchCompatError: naming the first attribute missing from the handler or its state holder.
    """
    for attr in _HANDLER_ATTRS:
        if not hasattr(inner, attr):
            raise _fail(f"DynamicRendezvousHandler has no attribute {attr!r}")
    holder = inner._state_holder
    for attr in ("_backend", "_cache_duration", "sync", "mark_dirty", "state"):
        if not hasattr(holder, attr):
            raise _fail(f"{type(holder).__name__} has no attribute {attr!r}")


def create_inner_handler(store: Any, backend: Any, params: Any) -> Any:
    """torch's ``DynamicRendezvousHandler`` for ``backend`` (checked by :func:`check_handler`).

    Args:
        store: the store torch's backend factory returned.
        backend: torch's ``RendezvousBackend``.
        params: torchrun's ``RendezvousParameters``.

    Returns:
        torch's handler.

    Raises:
        TorchCompatError: when the handler lacks an attribute this module uses.
    """
    inner = dr.create_handler(store, backend, params)
    check_handler(inner)
    return inner


def this_node(inner: Any) -> Any:
    """This agent's node descriptor.

    Args:
        inner: torch's handler.

    Returns:
        torch's ``_NodeDesc`` of this node.
    """
    return inner._this_node


def settings(inner: Any) -> Any:
    """The rendezvous settings.

    Args:
        inner: torch's handler.

    Returns:
        torch's ``RendezvousSettings`` (run id, node counts, keep-alive, timeouts).
    """
    return inner._settings


def agent_store(inner: Any) -> Any:
    """The store the rendezvous runs on (elastic_emb's round keys live there too).

    Args:
        inner: torch's handler.

    Returns:
        The store.
    """
    return inner._store


def heartbeat_lock(inner: Any) -> Any:
    """The lock torch holds around each rendezvous operation of the handler.

    Args:
        inner: torch's handler.

    Returns:
        The lock.
    """
    return inner._heartbeat_lock


def current_state(inner: Any) -> Any:
    """The state object torch's holder last synced (live: do not keep it).

    Args:
        inner: torch's handler.

    Returns:
        torch's ``_RendezvousState``.
    """
    return inner._state_holder.state


def heartbeats(state: Any) -> dict[str, float]:
    """Each node's heartbeat in a state object, as epoch seconds by node id.

    Args:
        state: torch's ``_RendezvousState`` (:func:`current_state`); entries that are not a node
            and a time are skipped.

    Returns:
        Epoch seconds by node id.
    """
    from elastic_emb.rdzv.decode import node_id

    out: dict[str, float] = {}
    for node, beat in dict(state.last_heartbeats).items():
        try:
            out[node_id(node)] = beat.timestamp()
        except (AttributeError, TypeError, ValueError, OverflowError, OSError):
            continue  # not a node and a time: nothing to learn from it
    return out


def set_cache_duration(inner: Any, seconds: float) -> None:
    """Set how long torch's state holder caches the state (1 s in torch).

    ``num_nodes_waiting()`` is polled every ``--monitor-interval``, and a shorter cache makes its
    answer fresher.

    Args:
        inner: torch's handler.
        seconds: the new cache duration.
    """
    inner._state_holder._cache_duration = seconds


def wrap_state_backend(inner: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace the state holder's backend with ``wrap(backend)`` (every get/set of the state then
    goes through the wrapper, torch's own included).

    Args:
        inner: torch's handler.
        wrap: takes torch's backend and returns its replacement.
    """
    holder = inner._state_holder
    holder._backend = wrap(holder._backend)


def stop_heartbeats(inner: Any) -> None:
    """Stop torch's keep-alive timer.

    Args:
        inner: torch's handler.
    """
    inner._stop_heartbeats()


def start_heartbeats(inner: Any) -> None:
    """Start torch's keep-alive timer.

    Args:
        inner: torch's handler.
    """
    inner._start_heartbeats()


def round_store(inner: Any) -> Any:
    """The store of the current round (what torch's ``next_rendezvous`` hands the agent).

    Args:
        inner: torch's handler.

    Returns:
        torch's prefixed store of the round.
    """
    return inner._get_store()


def join_complete_round(inner: Any, attempts: int = 10) -> tuple[int, int] | None:
    """Add this node to the participants of a complete, running round (compare-and-set) instead of
    waiting in the wait list for the next round: the in-process join.

    Args:
        inner: torch's handler.
        attempts: compare-and-set attempts before giving up.

    Returns:
        ``(group_rank, group_world_size)``, the rank being the count of participants before this
        node; None when there is no running round with room, or every attempt lost (then torch's
        own join is the way in).
    """
    holder = inner._state_holder
    node = inner._this_node
    with inner._heartbeat_lock:
        for _ in range(attempts):
            holder.sync()
            state = holder.state
            if (
                not state.complete
                or state.closed
                or not state.participants
                or node in state.participants
                or len(state.participants) >= inner._settings.max_nodes
            ):
                return None
            rank = len(state.participants)
            state.participants[node] = rank
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            state.last_heartbeats[node] = datetime.now(timezone.utc)
            holder.mark_dirty()
            if holder.sync():
                return rank, len(holder.state.participants)
    return None


def run_op(inner: Any, op: Callable[[Any, float], Any], timeout: float) -> None:
    """Run a rendezvous operation with torch's executor, under the handler's heartbeat lock.

    Args:
        inner: torch's handler.
        op: the operation, ``(ctx, deadline) -> Action``.
        timeout: seconds until the operation's deadline.
    """
    with inner._heartbeat_lock:
        inner._op_executor.run(op, time.monotonic() + timeout)


def exit_rendezvous(inner: Any, timeout: float) -> None:
    """Leave the rendezvous with torch's own exit operation.

    Args:
        inner: torch's handler.
        timeout: seconds until the operation's deadline.
    """
    run_op(inner, dr._RendezvousExitOp(), timeout)


def second_writer(inner: Any) -> tuple[Any, Any]:
    """A separate state holder (no cache) and op executor on the same backend and node: one more
    compare-and-set writer, like another node, that leaves the handler's cache alone.

    Args:
        inner: torch's handler.

    Returns:
        ``(state holder, op executor)``.
    """
    holder = dr._BackendRendezvousStateHolder(inner._state_holder._backend, inner._settings, cache_duration=0)
    return holder, dr._DistributedRendezvousOpExecutor(inner._this_node, holder, inner._settings)


def remove_nodes(inner: Any, nodes: set[str], attempts: int = 10) -> list[str]:
    """Remove the nodes with these ids from torch's state (participants, wait and redundancy lists,
    heartbeats), as torch's heartbeat expiry would, by compare-and-set.

    Args:
        inner: torch's handler.
        nodes: the node ids to remove.
        attempts: compare-and-set attempts before giving up.

    Returns:
        The ids removed (empty when none was there, or every attempt lost the race).
    """
    holder = inner._state_holder
    with inner._heartbeat_lock:
        for _ in range(attempts):
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


def credit_heartbeats(bits: bytes, began: datetime, length: float, expiry: timedelta) -> bytes:
    """The pickled state with every heartbeat that was alive when an outage began (and not
    refreshed since) moved forward by the outage's length.

    Args:
        bits: the pickled state (decoded with the restricted decoder).
        began: when the outage began (UTC).
        length: the outage's length in seconds.
        expiry: the heartbeat expiry: a heartbeat older than this at ``began`` was not alive.

    Returns:
        The re-pickled state, or ``bits`` itself when no heartbeat moved.

    Raises:
        UnsafeStateError: when ``bits`` is not a state the decoder admits.
    """
    state = load_state(bits)
    credit = timedelta(seconds=length)
    changed = False
    for node, beat in list(state.last_heartbeats.items()):
        if began - expiry <= beat < began:
            state.last_heartbeats[node] = beat + credit
            changed = True
    return dump_state(state) if changed else bits


def fresh_state(round_: int) -> bytes:
    """A pickled empty ``_RendezvousState`` at ``round_`` (not complete, no nodes): what replaces
    a state that is not torch's, so that the next honest round overwrites it.

    Args:
        round_: the round of the new state.

    Returns:
        The pickle bytes, as torch's state holder writes them.
    """
    state = dr._RendezvousState()
    state.round = int(round_)
    return dump_state(state)


_PATCHED_DELAY: dict[str, Any] = {}


def shorten_rendezvous_polls(interval: float) -> None:
    """Make torch's rendezvous loop poll every ``interval`` s instead of every 1 s, in this process.

    ``_DistributedRendezvousOpExecutor.run`` sleeps ``_delay(seconds=1)`` between polls of the
    shared state; with ``last_call_timeout=1`` that pause alone can double a round's duration.
    Only the 1 s poll is shortened; the random start-up skew ``(0, 0.3)`` is kept.

    Args:
        interval: seconds between polls (``sync_interval``); a later call replaces it.
    """
    original = _PATCHED_DELAY.setdefault("original", dr._delay)
    _PATCHED_DELAY["interval"] = interval

    def _delay(seconds):  # torch.distributed.elastic.rendezvous.utils._delay's signature
        if not isinstance(seconds, tuple) and seconds >= 1:
            time.sleep(_PATCHED_DELAY["interval"])
        else:
            original(seconds)

    dr._delay = _delay


# -- rendezvous operations (torch's op protocol: ``(ctx, deadline) -> Action``) ------------------


class FreshHeartbeat:
    """Writes this node's heartbeat when it is older than ``max_age`` s; never adds a node that is
    not in the state (a node that left must stay out). A rendezvous operation for :func:`run_op`.

    Args:
        max_age: the age in seconds past which the heartbeat is written.
    """

    def __init__(self, max_age: float) -> None:
        self._max_age = timedelta(seconds=max_age)

    def __call__(self, ctx: Any, deadline: float) -> Any:
        last = ctx.state.last_heartbeats.get(ctx.node)
        if last is None or last > datetime.now(timezone.utc) - self._max_age:
            return Action.FINISH
        if time.monotonic() > deadline:
            return Action.ERROR_TIMEOUT
        return Action.KEEP_ALIVE


class EarlyCompletion:
    """Completes the next round as soon as every expected survivor has joined it.

    After a scale-down the survivors are known: waiting ``last_call_timeout`` for nodes that
    cannot come is pure loss. A thread polls the state with :func:`second_writer` and, when the
    round after ``after_round`` has exactly the ``expected`` participants (and at least
    ``min_nodes``), takes torch's own ``MARK_RENDEZVOUS_COMPLETE`` action (ranks assigned as torch
    does). Any other membership (a newcomer, a missing survivor) leaves the round to torch's
    last-call rule. Bounded by the rendezvous join timeout; :meth:`stop` ends it.

    Args:
        inner: torch's handler.
        expected: the node ids that should form the next round.
        after_round: the round before it (-1: none).
        interval: seconds between polls.
        log: a structlog logger (``early_completion_failed``).
    """

    def __init__(self, inner: Any, expected: frozenset[str], after_round: int, interval: float, log: Any) -> None:
        import threading

        self._expected = expected
        self._after_round = after_round
        self._interval = interval
        self._log = log
        self._done = threading.Event()
        _, self._executor = second_writer(inner)
        self._deadline = time.monotonic() + inner._settings.timeout.join.total_seconds()
        self._thread = threading.Thread(target=self._run, name="elastic_emb-early-complete", daemon=True)
        self._thread.start()

    def __call__(self, ctx: Any, deadline: float) -> Any:
        state = ctx.state
        if state.complete or state.closed or state.round <= self._after_round:
            if state.complete and state.round > self._after_round:
                self._done.set()
            return Action.FINISH
        joined = frozenset(node_id(n) for n in state.participants)
        if joined == self._expected and len(state.participants) >= ctx.settings.min_nodes:
            return Action.MARK_RENDEZVOUS_COMPLETE
        return Action.FINISH

    def _run(self) -> None:
        while not self._done.is_set() and time.monotonic() < self._deadline and not exiting():
            try:
                with native_call():  # store reads and writes: the agent's exit waits for one in flight
                    self._executor.run(self, self._deadline)
            except Exception as exc:  # torch's own join still completes the round on its rules
                self._log.warning("early_completion_failed", error=repr(exc))
                return
            if self._done.wait(self._interval):
                return

    def stop(self) -> None:
        """End the polling thread (waits for it up to 2 s)."""
        self._done.set()
        self._thread.join(2.0)


# -- the import-time check ---------------------------------------------------------------------


class _MemoryBackend(dr.RendezvousBackend):
    """torch's backend contract, in memory, with a compare-and-set token."""

    def __init__(self) -> None:
        self.bits: bytes | None = None
        self.token = 0

    @property
    def name(self) -> str:
        return "elastic_emb-compat-check"

    def get_state(self):
        return None if self.bits is None else (self.bits, self.token)

    def set_state(self, state, token=None):
        if token == self.token or (self.bits is None and token is None):
            self.bits, self.token = state, self.token + 1
            return self.bits, self.token, True
        return self.bits, self.token, False


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise _fail(what)


def _verify() -> None:
    for name in (
        "_RendezvousState",
        "_NodeDesc",
        "_BackendRendezvousStateHolder",
        "_DistributedRendezvousOpExecutor",
        "_RendezvousExitOp",
        "_Action",
        "_remove_participant_epilogue",
        "_delay",
        "create_handler",
        "RendezvousSettings",
        "RendezvousTimeout",
        "DynamicRendezvousHandler",
    ):
        _check(hasattr(dr, name), f"dynamic_rendezvous has no {name}")
    for member in ("FINISH", "KEEP_ALIVE", "MARK_RENDEZVOUS_COMPLETE", "ERROR_TIMEOUT"):
        _check(hasattr(dr._Action, member), f"_Action has no member {member}")
    fresh = dr._RendezvousState()
    for field in ("round", "complete", "closed", "participants", "wait_list", "redundancy_list", "last_heartbeats"):
        _check(hasattr(fresh, field), f"_RendezvousState has no field {field!r}")
    _check(
        "_delay" in dr._DistributedRendezvousOpExecutor.run.__code__.co_names,
        "_DistributedRendezvousOpExecutor.run no longer pauses through the module's _delay",
    )

    node = dr._NodeDesc("compat-check", 1, 0)
    other = dr._NodeDesc("compat-check", 2, 0)
    _check(node_id(node) == repr(node), f"_NodeDesc repr {node!r} is not addr_pid_localid")
    settings_ = dr.RendezvousSettings("compat", 1, 2, dr.RendezvousTimeout(), timedelta(seconds=5), 3)
    backend = _MemoryBackend()
    holder = dr._BackendRendezvousStateHolder(backend, settings_, cache_duration=0)
    state = holder.state
    state.participants[node] = 0
    state.participants[other] = 1
    state.complete = True
    state.last_heartbeats[other] = datetime.now(timezone.utc)
    holder.mark_dirty()
    try:
        has_set = holder.sync()  # unpacks set_state's (bytes, token, has_set)
    except (TypeError, ValueError) as exc:
        raise _fail(f"the state holder does not take set_state's (bytes, token, has_set): {exc}") from None
    _check(has_set is True and backend.bits is not None, "the state holder did not write through set_state")
    try:
        decoded = load_state(backend.bits)
    except ElasticEmbError as exc:
        raise _fail(f"the pickled _RendezvousState needs a class outside the decoder's allow-list ({exc})") from None
    _check(node_id(next(iter(decoded.participants))) == node_id(node), "the pickled state lost its participants")
    try:
        dr._DistributedRendezvousOpExecutor(node, holder, settings_).run(
            lambda ctx, deadline: dr._Action.FINISH if ctx.node in ctx.state.last_heartbeats else dr._Action.KEEP_ALIVE,
            time.monotonic() + 5.0,
        )
    except Exception as exc:
        raise _fail(f"a keep-alive operation failed ({type(exc).__name__}: {exc})") from None
    _check(node in load_state(backend.bits).last_heartbeats, "a keep-alive operation does not write last_heartbeats")
    dr._DistributedRendezvousOpExecutor(other, holder, settings_).run(dr._RendezvousExitOp(), time.monotonic() + 5.0)
    _check(other not in load_state(backend.bits).participants, "_RendezvousExitOp does not remove the node")
    emptied = dr._RendezvousState()
    emptied.complete, emptied.round = True, 4
    dr._remove_participant_epilogue(emptied, settings_)
    _check(
        emptied.round == 5 and not emptied.complete, "_remove_participant_epilogue does not advance an emptied round"
    )
    holder.mark_dirty()
    backend.token += 1  # another writer won: the next write must report has_set False
    _check(holder.sync() is False, "the state holder does not report a lost compare-and-set as has_set False")


_verify()
Action = dr._Action  # after the check: it names the members used
