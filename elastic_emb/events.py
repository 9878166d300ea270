"""Structured logging: one structlog set-up for every elastic_emb process.

JSON lines off a terminal, a console rendering on one (``ELASTIC_EMB_LOG_FORMAT`` and
``ELASTIC_EMB_LOG_LEVEL`` override). Main names: :func:`configure_logging`, :func:`get_logger`,
:func:`bind_topology` (``run_id``, ``generation`` and ``rank`` on every later event), and
:func:`event_logger` (always JSON lines: the rendezvous backend's event log).

Design: ``docs/CORE.md`` (section "Events and logs").
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import structlog

from elastic_emb import config

_configured = False


def configure_logging(
    stream=None, fmt: str | None = None, level: str | None = None, force: bool = False, default_level: str = "info"
) -> None:
    """Configure structlog once per process; later calls do nothing unless ``force`` is True.

    Args:
        stream: where events are written; stderr when None.
        fmt: ``json`` or ``console``; None: ``ELASTIC_EMB_LOG_FORMAT``, else console when
            ``stream`` is a terminal and JSON lines otherwise.
        level: the lowest level logged (``debug``, ``info``, ...); None: ``ELASTIC_EMB_LOG_LEVEL``,
            else ``default_level``.
        force: configure again even if this process already did.
        default_level: the level used when neither ``level`` nor the variable is set.

    Raises:
        ValueError: if ``fmt`` or the resulting level is not a known one.
        ConfigError: if ``ELASTIC_EMB_LOG_FORMAT`` or ``ELASTIC_EMB_LOG_LEVEL`` has a bad value.
    """
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
        if path:  # its directory must exist: a mistyped path must not create directories
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
    """A JSON-lines logger writing to stderr and, when given, a file.

    It uses the same processors as :func:`configure_logging` but is independent of its format
    and level: every event is written, as JSON.

    Args:
        path: a file to append every line to as well (created; its directory must exist);
            None: stderr only.
        bound: fields bound to every event.

    Returns:
        A bound structlog logger.

    Raises:
        OSError: if the file cannot be opened (its directory does not exist, or no permission).
    """
    return structlog.wrap_logger(_Tee(path), processors=_processors(structlog.processors.JSONRenderer())).bind(**bound)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def get_logger(name: str = "elastic_emb", **bound: Any):
    """A structlog logger; configures logging (:func:`configure_logging`) on first use.

    Args:
        name: the logger's name.
        bound: fields bound to every event of this logger.

    Returns:
        A bound structlog logger.

    Raises:
        ConfigError: if logging is not configured yet and a log setting has a bad value.
    """
    configure_logging()
    return structlog.get_logger(name).bind(**bound)


def bind_topology(topology) -> None:
    """Bind ``run_id``, ``generation`` and ``rank`` to every later event of this context.

    Bound through structlog's context variables: every later event of the calling thread (and of
    contexts copied from it) carries them.

    Args:
        topology: the rank's :class:`~elastic_emb.topology.Topology` (any object with
            ``run_id``, ``generation`` and ``rank``).
    """
    structlog.contextvars.bind_contextvars(run_id=topology.run_id, generation=topology.generation, rank=topology.rank)
