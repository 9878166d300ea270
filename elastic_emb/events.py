"""Structured logging: one structlog configuration for every elastic_emb process.

JSON lines when the output is not a terminal (what log collectors on Kubernetes want), a readable
console rendering on a terminal. ``bind_topology`` binds ``run_id``, ``generation`` and ``rank``
to every later event of the process, so each line of a multi-rank log says who wrote it.
``ELASTIC_EMB_LOG_FORMAT=json|console`` overrides the choice; ``ELASTIC_EMB_LOG_LEVEL`` sets the
level (default ``info``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(stream=None, fmt: str | None = None, level: str | None = None, force: bool = False) -> None:
    """Configure structlog once per process (again with ``force=True``)."""
    global _configured
    if _configured and not force:
        return
    stream = stream if stream is not None else sys.stderr
    fmt = fmt or os.environ.get("ELASTIC_EMB_LOG_FORMAT") or ("console" if _isatty(stream) else "json")
    if fmt not in ("json", "console"):
        raise ValueError(f"ELASTIC_EMB_LOG_FORMAT={fmt!r}: use 'json' or 'console'")
    level_name = (level or os.environ.get("ELASTIC_EMB_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        raise ValueError(f"ELASTIC_EMB_LOG_LEVEL={level_name!r}: use debug, info, warning or error")
    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=_isatty(stream))
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write() per event: the agent and its workers often share a log file, and print()
        # writes the text and the newline separately, so lines of two processes could merge.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def get_logger(name: str = "elastic_emb", **bound: Any):
    """A structlog logger; configures logging on first use."""
    configure_logging()
    return structlog.get_logger(name).bind(**bound)


def bind_topology(topology) -> None:
    """Bind run_id, generation and rank to every later event of this process (and thread context)."""
    structlog.contextvars.bind_contextvars(
        run_id=topology.run_id, generation=topology.generation, rank=topology.rank
    )
