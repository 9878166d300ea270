"""How a worker notices that its agent is gone, and how it stops itself so that it cannot hang.

:func:`agent_gone` says whether the agent died (the worker was reparented, or the agent's pid is
gone); :func:`stop_self` sends the process SIGTERM after a delay and ends it at a hard deadline
that the kernel keeps. Neither touches a store: the watcher decides *that* the worker must stop.

Design: ``docs/LIFECYCLE.md`` (section "Self-stop").
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["agent_gone", "stop_self"]


def agent_gone(initial_parent: int, agent_pid: int) -> bool:
    """Whether the worker's agent died.

    Args:
        initial_parent: the worker's parent pid at start.
        agent_pid: the agent's pid (``ELASTIC_EMB_AGENT_PID``; the parent unless a wrapper sits
            between agent and worker).

    Returns:
        True when the worker was reparented, or the agent's pid no longer exists.
    """
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
    """SIGTERM this process in ``stop_delay`` seconds, end it at ``evict_grace``.

    The hard end is an interval timer whose SIGALRM ends the process without a Python thread;
    when the process handles SIGALRM itself, a Python timer calls ``os._exit(3)`` instead.

    Args:
        stop_delay: seconds until the SIGTERM (the surviving agents first stop their workers).
        evict_grace: seconds until the process is ended whatever it does.

    Raises:
        ValueError: ``stop_delay`` is outside ``[0, evict_grace]``.
    """
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
