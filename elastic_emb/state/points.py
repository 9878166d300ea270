"""Named points inside a commit, where a test or a drill may stop the process.

The production path only announces that it reached a point (:func:`reached`); nothing happens
unless a hook is installed (:func:`set_hook`). :mod:`elastic_emb.testing.faults` installs one
that kills the process at a chosen point and step, to prove that a crash anywhere in a commit
leaves the last complete commit restorable.

Design: ``docs/COMMIT.md`` (section "Fault points", which lists the points).
"""

from __future__ import annotations

from collections.abc import Callable

Hook = Callable[[str, int | None], None]
_hook: Hook | None = None


def reached(point: str, step: int | None = None) -> None:
    """Announce that this process reached a named point: a no-op without a hook.

    Args:
        point: the point's name.
        step: the step (or generation, or restart count) it was reached at, if any.
    """
    if _hook is not None:
        _hook(point, step)


def set_hook(hook: Hook | None) -> Hook | None:
    """Install the hook :func:`reached` calls.

    Args:
        hook: ``hook(point, step)``, or None to remove the hook.

    Returns:
        The hook installed before, or None.
    """
    global _hook
    prev, _hook = _hook, hook
    return prev
