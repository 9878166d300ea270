"""Blocking torch calls on background threads, and the interpreter's exit.

A background thread whose blocking call into torch's C++ code returns after the interpreter began
to finalise can abort the whole process. So background threads make such calls inside
:func:`native_call`, and this module's exit hook (:func:`wait_at_exit`, run after the library's
other exit hooks) sets :func:`exiting`, waits briefly for the calls in flight, then parks any
background thread that enters :func:`native_call` later.

Design: ``docs/CORE.md`` (section "Native calls and the interpreter's exit").
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Iterator

EXIT_GRACE_S = 5.0  # longest the exit waits for calls in flight (far longer than a store round trip)

_cond = threading.Condition()
_inside = 0  # threads inside native_call now
_exiting = False  # the exit hook started: loops stop
_closed = False  # the exit hook finished: background threads entering native_call park


def exiting() -> bool:
    """Whether the interpreter is exiting: a background loop stops at its next turn.

    Returns:
        True once the exit hook has started.
    """
    return _exiting


def in_flight() -> int:
    """How many threads are inside :func:`native_call` now.

    Returns:
        The number of threads.
    """
    with _cond:
        return _inside


@contextlib.contextmanager
def native_call() -> Iterator[None]:
    """Mark the blocking torch calls made inside as in flight, so that the exit waits for them.

    A background thread that enters after the exit hook finished never returns from here (it is
    parked for good); the main thread always proceeds.

    Yields:
        None, once the call is counted as in flight.
    """
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
    """The exit hook: set :func:`exiting`, wait for the calls in flight, then close the gate.

    Registered with ``atexit``; a test may call it once earlier. Calls still in flight when the
    grace runs out are reported on stderr.

    Args:
        grace: the longest wait, in seconds; :data:`EXIT_GRACE_S` when None.

    Returns:
        How many calls were still in flight when the grace ran out (0: none).
    """
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
        sys.stderr.write(
            f"elastic_emb: {still} background torch call(s) still running after the {grace}s exit "
            f"grace (a peer or the store is unreachable); if one returns during the interpreter's "
            f"teardown the process aborts\n"
        )
    return still


atexit.register(wait_at_exit)
