"""How a worker notices that its agent is gone, and how it stops itself so that it cannot hang.

A worker whose agent was SIGKILLed keeps running (torch starts workers in a new session), and a
worker the rendezvous left out must stop too. The :class:`~elastic_emb.watch.watcher.Watcher` decides
*that* it must stop (from the store, with signed confirmations); this module holds the two
process-level mechanics it needs, which touch no store and no rendezvous:

- :func:`agent_gone`: the agent died when the worker's parent changed (it was reparented), or,
  when a wrapper (a shell, a launcher script) sits between the agent and the worker, when the
  agent's pid (``ELASTIC_EMB_AGENT_PID``) no longer exists;
- :func:`stop_self`: SIGTERM to itself after ``stop_delay`` seconds, and a hard end at
  ``evict_grace`` seconds. The delay first: the surviving agents need a few monitor intervals to
  read the death report and SIGTERM their own workers; an orphan that vanished at once would fail
  their collective first, and torch counts a failure against the restart budget. Then the
  SIGTERM an agent would send (the worker's handler, if any, runs), and the hard end, so a worker
  blocked in a collective cannot outlive the grace. The hard deadline is the kernel's: an
  interval timer whose SIGALRM (default action: terminate) needs no Python thread, so it fires
  even while the interpreter is tearing down. A process that handles SIGALRM itself gets a
  Python timer (``os._exit(3)``) instead.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["agent_gone", "stop_self"]


def agent_gone(initial_parent: int, agent_pid: int) -> bool:
    """Whether the agent (``agent_pid``; the worker's parent was ``initial_parent`` at start) died."""
    if os.getppid() != initial_parent:
        return True
    if agent_pid != initial_parent:
        try:
            os.kill(agent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, owned by someone else: alive
            return False
    return False


def stop_self(stop_delay: float, evict_grace: float) -> None:
    """SIGTERM this process in ``stop_delay`` seconds, end it at ``evict_grace`` (module docstring)."""
    if not 0 <= stop_delay <= evict_grace:
        raise ValueError(f"stop_delay={stop_delay!r} must be within [0, evict_grace={evict_grace!r}]")
    if signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
        signal.setitimer(signal.ITIMER_REAL, evict_grace)
    else:
        hard = threading.Timer(evict_grace, os._exit, args=(3,))
        hard.daemon = True
        hard.start()
    term = threading.Timer(stop_delay, os.kill, args=(os.getpid(), signal.SIGTERM))
    term.daemon = True
    term.start()
