"""Structured logging: one structlog set-up for every elastic_emb process.

JSON lines when the output is not a terminal (what log collectors on Kubernetes want), a readable
console rendering on a terminal. ``bind_topology`` binds ``run_id``, ``generation`` and ``rank``
to every later event of the process, so each line of a multi-rank log says who wrote it.
``ELASTIC_EMB_LOG_FORMAT=json|console`` overrides the choice; ``ELASTIC_EMB_LOG_LEVEL`` sets the
level (default ``info``); both are declared in :mod:`elastic_emb.config`.

:func:`event_logger` is the same processor chain, always as JSON lines, written to stderr and
(optionally) a file of its own: the rendezvous backend's event log, which drills and operators
parse, whatever the terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import structlog

from elastic_emb import config

_configured = False


def configure_logging(stream=None, fmt: str | None = None, level: str | None = None, force: bool = False,
                      default_level: str = "info") -> None:
    """Configure structlog once per process (again with ``force=True``). The level is ``level``,
    else ``ELASTIC_EMB_LOG_LEVEL``, else ``default_level``."""
    global _configured
    if _configured and not force:
        return
    stream = stream if stream is not None else sys.stderr
    settings = config.load(None, "log_format", "log_level")
    fmt = fmt or settings.log_format or ("console" if _isatty(stream) else "json")
    if fmt not in ("json", "console"):
        raise ValueError(f"fmt={fmt!r}: use 'json' or 'console'")
    level_name = (level or settings.log_level or default_level).upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        raise ValueError(f"level={level_name!r}: use debug, info, warning or error")
    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=_isatty(stream))
    )
    structlog.configure(
        processors=_processors(renderer),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write() per event: the agent and its workers often share a log file, and print()
        # writes the text and the newline separately, so lines of two processes could merge.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def _processors(renderer) -> list:
    """The one processor chain: context, level, UTC time, exception text, then ``renderer``."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]


class _Tee:
    """A structlog 'logger' that writes each rendered line to stderr and, if given, a file."""

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the process

    def msg(self, message: str) -> None:
        with self._lock:
            # One write() per line: an agent's workers share its stderr, and print() writes the
            # text and the newline separately, so two processes' lines could merge into one.
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            if self._file is not None:
                self._file.write(message + "\n")
                self._file.flush()

    info = warning = error = debug = critical = msg


def event_logger(path: str | None, **bound: Any):
    """A JSON-lines logger (stderr, and ``path`` when given) with ``bound`` on every event; the
    same processors as :func:`configure_logging`, independent of its format and level."""
    return structlog.wrap_logger(_Tee(path), processors=_processors(structlog.processors.JSONRenderer())).bind(**bound)


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
