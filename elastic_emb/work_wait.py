"""Waiting on gloo work that another thread can end: a peer is known gone.

A gloo wait on a peer that died, stopped or lost its network can last until the group's timeout.
:class:`WorkWaits` bounds the waits on one communicator's works; whoever learns first that a peer
is gone calls :meth:`WorkWaits.interrupt`, and every wait, now and later, raises
:class:`~elastic_emb.errors.TransferInterrupted` at once. Transfers whose wait ended early are
abandoned, and :func:`hold_then_drop` keeps their process group until they complete. Used by the
context's :class:`~elastic_emb.context.group.Group` and the state tiers' :class:`~elastic_emb.state.comm.Comm`.

Design: ``docs/CORE.md`` (section "Bounded waits on gloo work").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from elastic_emb.errors import TransferInterrupted
from elastic_emb.native_calls import native_call


class WorkWaits:
    """The waits on one communicator's works, and their interrupt (thread-safe).

    Args:
        where: who waits, named in the error (e.g. ``"rank 1 (generation 3)"``).
    """

    def __init__(self, where: str) -> None:
        self.where = where  # named in the error: "rank 1 (generation 3)"
        self.reason: str | None = None  # why every wait ends now; the first interrupt's reason
        self._waiting: dict[threading.Event, list] = {}  # each wait in progress: its event, its works
        self._abandoned: list = []  # works whose wait ended before they did (take_abandoned)
        self._lock = threading.Lock()

    def interrupt(self, reason: str) -> None:
        """End every wait now, and every later one at once, with :class:`TransferInterrupted`.

        A wait whose works completed before it woke still returns normally.

        Args:
            reason: why, named in the error; only the first reason given is kept.
        """
        with self._lock:
            if self.reason is None:
                self.reason = reason
            waiting = list(self._waiting)
        for done in waiting:
            done.set()

    def take_abandoned(self, waiting: bool = False) -> list:
        """Hand over, once, the works whose wait ended (interrupt, timeout) before they did.

        The caller holds their process group until they are complete (:func:`hold_then_drop`):
        a gloo group's destructor joins its worker threads, so dropped meanwhile it would block
        until the transfer times out.

        Args:
            waiting: also include the works of the waits still in progress (for a release from
                another thread right after an interrupt: the woken waits may not have recorded
                their works as abandoned yet).

        Returns:
            The works; later calls do not return them again.
        """
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
            if waiting:
                abandoned += [w for works in self._waiting.values() for w in works]
            return abandoned

    def check(self, what: str) -> None:
        """Refuse to go on once interrupted; call it before posting more work.

        Args:
            what: the operation about to be posted, named in the error.

        Raises:
            TransferInterrupted: if :meth:`interrupt` was called.
        """
        if self.reason is not None:
            raise self._error(what)

    def wait(self, works: Sequence, timeout: float, what: str) -> bool:
        """Wait until every work of ``works`` is complete, at most ``timeout`` seconds.

        Collective works are woken through their futures; point-to-point works (which have no
        future) are waited for on a daemon thread. Works whose wait ends early are recorded as
        abandoned (:meth:`take_abandoned`).

        Args:
            works: the ``torch.distributed.Work`` objects to complete.
            timeout: seconds to wait.
            what: the operation, named in the error.

        Returns:
            True when every work completed; False when the time ran out first.

        Raises:
            TransferInterrupted: if :meth:`interrupt` is called before or during the wait (and
                the works did not complete first).
            RuntimeError: a work's own failure, as ``Work.wait`` raises it.
        """
        futures, blocking = [], []
        for work in works:
            if work.is_completed():
                futures.append(None)
                continue
            try:
                futures.append(work.get_future())
            except RuntimeError:  # gloo send/recv: completes only inside its own wait()
                blocking.append(work)
        if blocking:
            return self._wait_blocking(list(works), timeout, what)
        pending = [f for f in futures if f is not None]
        if pending:
            done = threading.Event()
            arm = lambda: _when_all(pending, done.set)  # noqa: E731
            if not self._sleep(list(works), done, timeout, what, arm, lambda: all(f.done() for f in pending)):
                return False
        for work in works:
            work.wait()  # complete: raises the work's own error, if any
        return True

    def _wait_blocking(self, works: list, timeout: float, what: str) -> bool:
        """Call every work's ``wait()`` in a daemon thread (bounded by ``timeout``), while this
        thread waits for that thread or an interrupt."""
        done = threading.Event()
        outcome: dict = {}
        deadline = time.monotonic() + timeout

        def run() -> None:
            ok = True
            with native_call():  # the process's exit waits for these (briefly: native_calls.py)
                for w in works:  # every one, so that every one ends complete (take_abandoned)
                    try:
                        ok = w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic()))) and ok
                    except BaseException as exc:  # the first is raised in the waiting thread at once
                        if not outcome:
                            outcome.update(ok=False, error=exc)
                            done.set()
            if not outcome:
                outcome.update(ok=ok, error=None)
            done.set()

        # Started even when interrupted already: the works posted are waited for (and their
        # tensors held) until they end, whoever stops waiting for them.
        threading.Thread(target=run, name="elastic_emb-work-wait", daemon=True).start()
        # the thread's own waits end at the deadline; this one a moment later, to take their verdict
        if not self._sleep(works, done, timeout + 1.0, what, lambda: None, lambda: bool(outcome)):
            return False
        if outcome["error"] is not None:
            raise outcome["error"]
        return bool(outcome["ok"])

    def _sleep(self, works: list, done: threading.Event, timeout: float, what: str, arm, finished) -> bool:
        """Register ``done``, ``arm()`` what sets it on completion, and wait for it: True when the
        works completed (``finished()``; that wins over an interrupt that came after), False on
        timeout; raises on an interrupt before or during the wait. ``works`` are recorded as
        abandoned unless they completed."""
        with self._lock:
            armed = self.reason is None  # interrupted already: no wait at all
            if armed:
                self._waiting[done] = works
        ok = False
        try:
            if armed:
                arm()
                done.wait(timeout)
        finally:
            ok = finished()
            with self._lock:  # one step: take_abandoned sees the works in one list or the other
                self._waiting.pop(done, None)
                if not ok:  # interrupted or timed out: the works are abandoned (docs/CORE.md)
                    self._abandoned.extend(works)
        if ok:
            return True
        if self.reason is not None:
            raise self._error(what)
        return False

    def _error(self, what: str) -> TransferInterrupted:
        return TransferInterrupted(
            f"{what} on {self.where} interrupted: {self.reason}. Close this communicator "
            f"(it aborts) and let the lifecycle re-form the world without that peer"
        )


def _when_all(futures: list, callback) -> None:
    """``callback()`` once every future of ``futures`` is done (at once if they are)."""
    if len(futures) == 1:
        futures[0].add_done_callback(lambda _fut: callback())
    else:
        torch.futures.collect_all(futures).add_done_callback(lambda _fut: callback())


def hold_then_drop(refs: list, works: list, bound: float, on_pending: Callable[[], None]) -> None:
    """Hold a process group until its abandoned works are complete, then drop it.

    Meant for a background thread: a gloo group's destructor joins its worker threads, so the
    thread that drops it last waits for its running transfers. The drop is made inside
    :func:`~elastic_emb.native_calls.native_call` (the destructor is a blocking torch call).

    Args:
        refs: a list holding the group and whatever must outlive it, to which the caller keeps no
            other reference: clearing it drops the last references (a thread's own arguments
            would otherwise keep the group until after this function returned).
        works: the abandoned works; cleared with ``refs``.
        bound: the longest wait, in seconds.
        on_pending: called when the works are still not complete after ``bound`` seconds (the
            group is dropped anyway).
    """
    try:
        deadline = time.monotonic() + bound
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                on_pending()
                break
            time.sleep(0.02)
    finally:
        with native_call():
            refs.clear()
            works.clear()
