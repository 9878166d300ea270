"""Waiting on gloo work that another thread can end: a peer is known gone.

A gloo wait on a peer that died, stopped or lost its network can last until the group's timeout:
gloo does not fail a send already queued on a connection that breaks, a peer that is stopped or
cut off closes nothing at all, and aborting the group does not wake a waiter. Whoever learns
first that a peer is gone (the in-process resize's neighbour probe, a peer's failed collective:
``resize.py``) calls :meth:`WorkWaits.interrupt`; every wait on the works of that communicator,
now and later, then raises :class:`~elastic_emb.errors.TransferInterrupted` at once.

How a wait is woken depends on the work: a collective's work has a future (gloo completes it on
its own thread), so the wait sleeps on an event that the future's callback and ``interrupt``
both set, no polling. A point-to-point send or receive has no future (``Work::getFuture not
implemented``), and it completes only inside its own ``wait()``, which must be called exactly
once and cannot be woken from Python (``Work.abort`` is not bound): a daemon thread makes that
call and sets the event. An interrupted transfer is abandoned, not cancelled: it runs out on
gloo's (or that) thread, which holds its tensors, until it completes, fails when the connection
closes (the group's release aborts it) or reaches its timeout. The waits remember the works they
abandoned (:meth:`WorkWaits.take_abandoned`): their owner holds the process group until those are
complete, because a gloo group's destructor joins its worker threads and would otherwise block
whichever thread dropped it last until the transfer times out (:func:`hold_then_drop`, the one
hold both owners use).

Used by the context's :class:`~elastic_emb.context.group.Group` (its collectives) and the state
tiers' :class:`~elastic_emb.state.comm.Comm` (restore's row moves, replica transfers).
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
    """The waits on one communicator's works, and their interrupt (thread-safe)."""

    def __init__(self, where: str) -> None:
        self.where = where  # named in the error: "rank 1 (generation 3)"
        self.reason: str | None = None  # why every wait ends now; the first interrupt's reason
        self._waiting: dict[threading.Event, list] = {}  # each wait in progress: its event, its works
        self._abandoned: list = []  # works whose wait ended before they did (take_abandoned)
        self._lock = threading.Lock()

    def interrupt(self, reason: str) -> None:
        """End every wait now, and every later one at once, with :class:`TransferInterrupted`
        naming ``reason`` (the first reason given stays)."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
            waiting = list(self._waiting)
        for done in waiting:
            done.set()

    def take_abandoned(self, waiting: bool = False) -> list:
        """The works whose wait ended (interrupt, timeout) before they did, handed over once: the
        caller holds their process group until they are complete (a gloo group's destructor
        joins its worker threads, so dropped meanwhile it blocks until the transfer times out).
        ``waiting``: with them, the works of the waits still in progress (for a release from
        another thread right after an interrupt: it has woken the waits, which may not have
        recorded their works yet)."""
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
            if waiting:
                abandoned += [w for works in self._waiting.values() for w in works]
            return abandoned

    def check(self, what: str) -> None:
        """Raise :class:`TransferInterrupted` if interrupted (before posting more work)."""
        if self.reason is not None:
            raise self._error(what)

    def wait(self, works: Sequence, timeout: float, what: str) -> bool:
        """Complete every work of ``works`` within ``timeout`` seconds: True when they did (a
        work's own failure is raised, as ``Work.wait`` raises it), False when the time ran out
        first; raises :class:`TransferInterrupted` on :meth:`interrupt`."""
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
                if not ok:  # interrupted or timed out: the works are abandoned (module docstring)
                    self._abandoned.extend(works)
        if ok:
            return True
        if self.reason is not None:
            raise self._error(what)
        return False

    def _error(self, what: str) -> TransferInterrupted:
        return TransferInterrupted(f"{what} on {self.where} interrupted: {self.reason}. Close this communicator "
                                   f"(it aborts) and let the lifecycle re-form the world without that peer")


def _when_all(futures: list, callback) -> None:
    """``callback()`` once every future of ``futures`` is done (at once if they are)."""
    if len(futures) == 1:
        futures[0].add_done_callback(lambda _fut: callback())
    else:
        torch.futures.collect_all(futures).add_done_callback(lambda _fut: callback())


def hold_then_drop(refs: list, works: list, bound: float, on_pending: Callable[[], None]) -> None:
    """Hold the objects in ``refs`` (a process group, and whatever must outlive it) until the
    abandoned ``works`` are complete, at most ``bound`` seconds (``on_pending()`` reports it when
    they are not), then drop them in the calling thread, a background one.

    A gloo group's destructor joins its worker threads: dropped last elsewhere while one of its
    transfers still runs, it would block that thread until the transfer ends. The drop is a
    blocking torch call (the destructor releases the GIL), so it is made inside
    :func:`~elastic_emb.native_calls.native_call`. ``refs`` is a list the caller keeps no other
    reference to: clearing it drops the last ones (a thread's own arguments would otherwise keep
    the group until after this function returned)."""
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
