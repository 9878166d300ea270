"""Fault injection at the named points of a commit (:mod:`elastic_emb.state.points`).

``ELASTIC_EMB_FAULT=<point>`` (or ``<point>@<step>``) in a worker's environment, armed by
:func:`arm_from_env` at the worker's start, kills that worker with SIGKILL (no clean-up, as a
node loss would) when it reaches the point (at that step). Test workers and drill workers call
:func:`arm_from_env`; the library never reads the variable itself.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from elastic_emb import config
from elastic_emb.events import get_logger
from elastic_emb.state import points

log = get_logger("elastic_emb.testing.faults")

ENV_FAULT = "ELASTIC_EMB_FAULT"


def matches(spec: str, point: str, step: int | None) -> bool:
    """Whether a fault spec names this point (and step).

    Args:
        spec: ``<point>`` or ``<point>@<step>``.
        point: the point reached.
        step: the step being committed, or None when the point has none.

    Returns:
        True when ``spec`` is ``point``, or ``point@step``.
    """
    return spec == point or (step is not None and spec == f"{point}@{step}")


def kill_at(spec: str) -> points.Hook:
    """A hook that SIGKILLs this process at the point ``spec`` names.

    Args:
        spec: ``<point>`` or ``<point>@<step>``.

    Returns:
        The hook, for :func:`elastic_emb.state.points.set_hook`.
    """

    def hook(point: str, step: int | None) -> None:
        if matches(spec, point, step):
            log.warning("faultpoint_kill", point=point, step=step, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def arm_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """Install a kill hook if ``ELASTIC_EMB_FAULT`` is set.

    Args:
        env: the environment to read; default ``os.environ``.

    Returns:
        The spec armed, or None.
    """
    spec = config.load(env, "fault").fault
    if spec:
        points.set_hook(kill_at(spec))
    return spec or None
