"""Blocking torch calls on background threads, and the interpreter's exit.

The library's background threads (the commit writer, the membership watcher, a communicator's
release, a wait on an abandoned gloo transfer, the GPU capture's launcher, the agent's
heartbeat) make calls into torch's C++ code with the GIL released: a store ``wait`` or
``check``, a gloo work's ``wait``, a process group's ``shutdown``, and any tensor operation
(torch's bindings release the GIL around each op). On Python 3.11 to 3.13, a daemon thread that
takes the GIL back after the interpreter began to finalise is ended with ``pthread_exit``; when
it is returning from such a call, that unwinding passes a C++ destructor that may not throw, and
the whole process aborts with ``terminate called without an active exception``, whatever exit
status it was about to report (seen: a test suite that had passed, killed at exit; a worker
exiting 0 would look failed to torchrun the same way).

The remedy is to have no such call in flight when finalisation starts. A background thread
makes them inside :func:`native_call`; the exit hook of this module, which runs after the
library's other exit hooks (it is registered first: ``atexit`` runs hooks last-in first-out):

1. sets :func:`exiting`, so polling loops stop at their next turn instead of at their timeout;
2. waits until no thread is inside :func:`native_call`, at most :data:`EXIT_GRACE_S` seconds
   (a store round trip ends in milliseconds; a gloo transfer stuck on a stopped or cut-off peer
   would take its whole timeout, so the exit gives up on it after the grace and reports it on
   stderr: such a call is unlikely to return during the short finalisation that follows, and
   is ended with the process);
3. closes the gate: a background thread that enters :func:`native_call` afterwards is parked
   for good (it never takes the GIL back, so it cannot be unwound). The main thread is never
   parked: it is the one running the exit.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Iterator

EXIT_GRACE_S = 5.0  # longest the exit waits for calls in flight (a store round trip takes ms)

_cond = threading.Condition()
_inside = 0  # threads inside native_call now
_exiting = False  # the exit hook started: loops stop
_closed = False  # the exit hook finished: background threads entering native_call park


def exiting() -> bool:
    """Whether the interpreter is exiting: a background loop stops at its next turn."""
    return _exiting


def in_flight() -> int:
    """How many threads are inside :func:`native_call` now."""
    with _cond:
        return _inside


@contextlib.contextmanager
def native_call() -> Iterator[None]:
    """Mark the blocking torch calls made inside as in flight (see the module docstring). A
    background thread that enters after the exit hook finished never returns from here."""
    global _inside
    with _cond:
        park = _closed and threading.current_thread() is not threading.main_thread()
        if not park:
            _inside += 1
    if park:
        threading.Event().wait()  # the interpreter is finalising: this thread must never run again
    try:
        yield
    finally:
        with _cond:
            _inside -= 1
            _cond.notify_all()


def wait_at_exit(grace: float | None = None) -> int:
    """The exit hook (see the module docstring): returns how many calls were still in flight
    when the grace ran out (0: none). Called by ``atexit``; callable once earlier for a test."""
    global _exiting, _closed
    grace = EXIT_GRACE_S if grace is None else grace
    with _cond:
        _exiting = True
        end = time.monotonic() + grace
        while _inside and (left := end - time.monotonic()) > 0:
            _cond.wait(left)
        still = _inside
        _closed = True
    if still:
        sys.stderr.write(f"elastic_emb: {still} background torch call(s) still running after the {grace}s exit "
                         f"grace (a peer or the store is unreachable); if one returns during the interpreter's "
                         f"teardown the process aborts\n")
    return still


atexit.register(wait_at_exit)
