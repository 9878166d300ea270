"""Store outages: one tracker for the agent and the workers.

The point of ``inner=etcd-v2`` is a store that outlives every node, so a short outage of the
store itself (etcd restarted, a network blip) must not end the job: the workers' collectives do
not touch it. Both sides count an outage the same way (:class:`OutageTracker`): it begins at the
first call that failed to reach the store, ends at the first call that reached it, and is
*exceeded* once it lasts ``timeout`` seconds. Events, once per outage: ``store_unreachable``,
``store_reachable`` (with ``outage_s``), ``store_outage_exceeded``.

What each side does with it differs:

- the agent (:class:`OutageGuard`) retries every store call with exponential backoff
  (0.05 s doubling to 1 s, jitter 50-100 %) until the store answers or the outage reaches the
  bound, then raises :class:`StoreOutageError` naming the endpoint, the outage length and the
  remedy (its subclass from :func:`torch_store_outage_error` is also torch's
  ``RendezvousConnectionError``, which torch's keep-alive timer logs instead of dying on);
- the watcher treats the membership as *unknown* while the store is down (nothing is inferred
  from a failed read) and reports the bound, at which the agent fails and stops it.

Only connection errors count (:func:`is_connection_error`); an answer the store gave (a missing
key, a corrupt state, a compare-and-set conflict) is not an outage.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from elastic_emb import metrics
from elastic_emb.errors import StoreOutageError


_TORCH_OUTAGE_ERROR: list[type] = []


def torch_store_outage_error() -> type[StoreOutageError]:
    """StoreOutageError that is also torch's (public) ``RendezvousConnectionError``; built on first
    use, since this module may be imported while torch's rendezvous package is importing."""
    if not _TORCH_OUTAGE_ERROR:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        _TORCH_OUTAGE_ERROR.append(type("StoreOutageError", (StoreOutageError, RendezvousConnectionError), {
            "__module__": __name__, "__doc__": StoreOutageError.__doc__}))
    return _TORCH_OUTAGE_ERROR[0]


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the store could not be reached (worth a retry), as opposed to an
    answer the store gave."""
    if isinstance(exc, StoreOutageError):
        return False  # the bound already passed: never retried again
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    # torch's RendezvousConnectionError (both inner backends), c10d's DistNetworkError, and
    # python-etcd's EtcdConnectionFailed (EtcdStore raises it unwrapped); by name, so this module
    # imports neither.
    return bool(names & {"RendezvousConnectionError", "DistNetworkError", "EtcdConnectionFailed"})


def reraise_signal(exc: BaseException) -> None:
    """torchrun turns SIGTERM into torch's ``SignalException`` (an ``Exception``) in the agent's
    main thread, wherever it is: inside a store call of the agent too. Best-effort handlers that
    catch ``Exception`` call this first: that one must pass, or the agent would live on."""
    if type(exc).__name__ == "SignalException":
        raise exc


class OutageTracker:
    """When the current outage began, whether it passed the bound, and what the last one was.

    Thread-safe; one per process side (the agent shares one across its threads, so the bound is on
    the outage, not on each call). ``fields`` are added to every event (e.g. the endpoint).
    """

    def __init__(self, timeout: float, log: Any, *, clock: Callable[[], float] = time.monotonic,
                 **fields: Any) -> None:
        if timeout < 0:
            raise ValueError(f"store_outage_timeout={timeout!r} must be >= 0 seconds")
        self.timeout = timeout
        self.log = log
        self.fields = fields
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None  # clock(), first failed call of this outage
        self._down_wall: datetime | None = None
        self._exceeded = False
        self.last_outage: tuple[datetime, float] | None = None  # (began, seconds) of the last one
        self.outages = 0  # outages that ended

    @property
    def down_for(self) -> float | None:
        """Seconds the current outage has lasted, or None when the last call reached the store."""
        with self._lock:
            return None if self._down_since is None else self._clock() - self._down_since

    @property
    def exceeded(self) -> bool:
        return self._exceeded

    def failed(self, op: str, exc: BaseException) -> float:
        """Record a call that did not reach the store; returns the outage length so far."""
        now = self._clock()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = now
                self._down_wall = datetime.now(timezone.utc)
                self._exceeded = False
            down = now - self._down_since
            report = down >= self.timeout and not self._exceeded
            if report:
                self._exceeded = True
        if first:
            self.log.warning("store_unreachable", op=op, error=repr(exc), bound_s=self.timeout, **self.fields)
        if report:
            self.log.error(
                "store_outage_exceeded", op=op, outage_s=round(down, 3), bound_s=self.timeout, error=repr(exc),
                remedy="bring the rendezvous store back; the agent fails at this bound and stops its workers "
                "(raise --rdzv-conf store_outage_timeout for longer outages)", **self.fields,
            )
        return down

    def succeeded(self, op: str) -> float | None:
        """Record a call that reached the store; returns the length of the outage it ended, if any."""
        if self._down_since is None:  # the common case: no lock
            return None
        now = self._clock()
        with self._lock:
            if self._down_since is None:
                return None
            outage = now - self._down_since
            self.last_outage = (self._down_wall, outage)
            self.outages += 1
            self._down_since = self._down_wall = None
            self._exceeded = False
        self.log.info("store_reachable", op=op, outage_s=round(outage, 3), **self.fields)
        metrics.store_outage(outage)
        return outage


class OutageGuard:
    """The agent's store calls, retried across an outage of at most ``timeout`` seconds."""

    def __init__(self, endpoint: str, timeout: float, log: Any, *, base: float = 0.05, cap: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, error: type[StoreOutageError] = StoreOutageError) -> None:
        self.endpoint = endpoint
        self.tracker = OutageTracker(timeout, log, clock=clock, endpoint=endpoint)
        self._error = error
        self._base = base
        self._cap = cap
        self.closing = threading.Event()  # set at exit: fail at once instead of waiting

    @property
    def timeout(self) -> float:
        return self.tracker.timeout

    @property
    def down_for(self) -> float | None:
        return self.tracker.down_for

    @property
    def last_outage(self) -> tuple[datetime, float] | None:
        return self.tracker.last_outage

    @property
    def outages(self) -> int:
        return self.tracker.outages

    def bind_log(self, log: Any) -> None:
        """From here on the events go to ``log`` (e.g. one that names this node)."""
        self.tracker.log = log

    def call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                time.sleep(self._backoff(op, exc, attempt))
                attempt += 1
                continue
            self.tracker.succeeded(op)
            return result

    def _backoff(self, op: str, exc: Exception, attempt: int) -> float:
        """Seconds to wait before the next try; raises once the outage outlasts the bound."""
        down = self.tracker.failed(op, exc)
        left = self.timeout - down
        if left <= 0 or self.closing.is_set():
            raise self._error(
                f"the rendezvous store at {self.endpoint} has been unreachable for {down:.1f} s (op {op}: "
                f"{type(exc).__name__}: {exc}), longer than store_outage_timeout={self.timeout:g} s"
                + (" (the agent is exiting, so it did not wait)" if self.closing.is_set() and left > 0 else "")
                + ": bring the store back (is etcd running and reachable from this node?), or raise "
                "--rdzv-conf store_outage_timeout if outages this long are expected"
            ) from exc
        # Exponential backoff with jitter (50-100 %): agents that lost the store together do not
        # come back in lockstep; never sleep past the bound, so the error comes on time.
        return min(left, min(self._cap, self._base * 2 ** min(attempt, 30)) * random.uniform(0.5, 1.0))
