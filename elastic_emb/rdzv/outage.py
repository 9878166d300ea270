"""Store outages: one tracker for the agent and the workers.

- :class:`OutageTracker`: when the current outage began, whether it passed the bound, the last one;
  events ``store_unreachable``, ``store_reachable``, ``store_outage_exceeded``, once per outage;
- :class:`OutageGuard`: the agent's store calls, retried with backoff until the bound, then
  :class:`~elastic_emb.errors.StoreOutageError`;
- :func:`is_connection_error` (only these count), :func:`reraise_signal`.

Design: ``docs/RDZV.md`` (section "Store outages").
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
    """StoreOutageError that is also torch's (public) ``RendezvousConnectionError``, which torch's
    keep-alive timer logs instead of dying on; built on first use, since this module may be
    imported while torch's rendezvous package is importing.

    Returns:
        The combined error class (the same one on every call).
    """
    if not _TORCH_OUTAGE_ERROR:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        _TORCH_OUTAGE_ERROR.append(
            type(
                "StoreOutageError",
                (StoreOutageError, RendezvousConnectionError),
                {"__module__": __name__, "__doc__": StoreOutageError.__doc__},
            )
        )
    return _TORCH_OUTAGE_ERROR[0]


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the store could not be reached (worth a retry), as opposed to an
    answer the store gave (a missing key, a corrupt state, a compare-and-set conflict).

    Args:
        exc: the error a store call raised.

    Returns:
        True for ``ConnectionError``, ``TimeoutError``, torch's ``RendezvousConnectionError``,
        c10d's ``DistNetworkError`` and python-etcd's ``EtcdConnectionFailed``; False for a
        ``StoreOutageError`` (the bound already passed) and anything else.
    """
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
    """Re-raise torch's ``SignalException``; best-effort handlers that catch ``Exception`` call this first.

    torchrun turns SIGTERM into ``SignalException`` (an ``Exception``) in the agent's main thread,
    wherever it is, also inside a store call; it must pass, or the agent would live on.

    Args:
        exc: the error caught.

    Raises:
        SignalException: ``exc`` itself, when it is torch's ``SignalException``.
    """
    if type(exc).__name__ == "SignalException":
        raise exc


class OutageTracker:
    """When the current outage began, whether it passed the bound, and what the last one was.

    Thread-safe; one per process side (the agent shares one across its threads, so the bound is on
    the outage, not on each call).

    Args:
        timeout: the bound in seconds (``store_outage_timeout``).
        log: a structlog logger for the outage events.
        clock: the monotonic clock.
        fields: added to every event (e.g. the endpoint).

    Raises:
        ValueError: when ``timeout`` is negative.
    """

    def __init__(self, timeout: float, log: Any, *, clock: Callable[[], float] = time.monotonic, **fields: Any) -> None:
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
        """Record a call that did not reach the store.

        Logs ``store_unreachable`` at the outage's first failure and ``store_outage_exceeded``
        once it reaches the bound.

        Args:
            op: the operation, for the events.
            exc: the error it raised.

        Returns:
            The outage's length so far in seconds.
        """
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
                "store_outage_exceeded",
                op=op,
                outage_s=round(down, 3),
                bound_s=self.timeout,
                error=repr(exc),
                remedy="bring the rendezvous store back; the agent fails at this bound and stops its workers "
                "(raise --rdzv-conf store_outage_timeout for longer outages)",
                **self.fields,
            )
        return down

    def succeeded(self, op: str) -> float | None:
        """Record a call that reached the store (logs ``store_reachable`` when it ends an outage).

        Args:
            op: the operation, for the event.

        Returns:
            The length in seconds of the outage it ended, or None when there was none.
        """
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
    """The agent's store calls, retried across an outage of at most ``timeout`` seconds.

    Args:
        endpoint: the store's endpoint, for the events and the error.
        timeout: the bound in seconds (``store_outage_timeout``).
        log: a structlog logger for the outage events.
        base: the first backoff in seconds (doubling per retry).
        cap: the longest backoff in seconds.
        clock: the monotonic clock.
        error: the class raised at the bound (:func:`torch_store_outage_error` in the agent).

    Raises:
        ValueError: when ``timeout`` is negative.
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float,
        log: Any,
        *,
        base: float = 0.05,
        cap: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        error: type[StoreOutageError] = StoreOutageError,
    ) -> None:
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
        """From here on the events go to ``log``.

        Args:
            log: a structlog logger (e.g. one that names this node).
        """
        self.tracker.log = log

    def call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried while it fails to reach the store, up to the bound.

        Retries with exponential backoff and jitter; at exit (``closing`` set) it fails at once.

        Args:
            op: the operation's name, for the events and the error.
            fn: the store call.
            args: its positional arguments.
            kwargs: its keyword arguments.

        Returns:
            What ``fn`` returned.

        Raises:
            StoreOutageError: (the guard's ``error`` class) when the outage reaches the bound,
                naming the endpoint, the outage's length and the remedy.
            Exception: any error of ``fn`` that :func:`is_connection_error` does not count, at once.
        """
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
