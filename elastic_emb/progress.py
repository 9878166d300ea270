"""Progress of long work: restores, reshards, base writes, durable saves and loads, drains.

A :class:`Progress` counts what the worker code did (:meth:`Progress.advance`: one addition to a
counter of the calling thread, no lock, no system call) and one shared background thread reports
it: nothing for work that ends within ``ELASTIC_EMB_PROGRESS_AFTER`` seconds, then a ``progress``
event about once a second (``done_<unit>``, ``total_<unit>``, ``rate``, ``eta_s``), a final one,
and a bar when the stream is a terminal. Reporting never raises into the caller.

Design: ``docs/OPERATIONS.md`` (section "Progress").
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from elastic_emb import config
from elastic_emb.errors import ConfigError
from elastic_emb.events import get_logger

TICK_S = 0.25  # how often the shared thread looks at the open reporters (and redraws a bar)
BAR_WIDTH = 30
_DEFAULT_AFTER = config.Settings.model_fields["progress_after"].default
_warned_setting: list[bool] = []


def _after_setting() -> float:
    """``ELASTIC_EMB_PROGRESS_AFTER``; a bad value is logged once and the default used."""
    try:
        return float(config.load(None, "progress_after").progress_after)
    except ConfigError as exc:
        if not _warned_setting:
            _warned_setting.append(True)
            get_logger("elastic_emb.progress").warning("progress_setting_invalid", error=str(exc), using=_DEFAULT_AFTER)
        return _DEFAULT_AFTER


class Progress:
    """Counts the units of one piece of work done so far and reports them, thread-safe.

    Use it as a context manager (the exit reports the final event) or call :meth:`close`. Worker
    threads call :meth:`advance`; reporting happens in a shared background thread (or, with
    ``auto=False``, whenever the owner calls :meth:`tick`). The first event comes once the work
    has run ``after`` seconds, then one every ``every`` seconds, and the final one on close when
    the work ran ``after`` seconds or more: work that ends sooner reports nothing. ``rate`` is the
    average since the start, in units per second; ``eta_s`` is the time the rest takes at that
    rate (None while nothing is done or the total is unknown).

    Args:
        task: what the work is (``restore``, ``reshard``, ``base_write``, ...): the events' ``task``.
        total: the units of the whole work; None or 0 when unknown. Settable later (``total``).
        unit: what is counted; the events carry ``done_<unit>`` and ``total_<unit>``.
        after: seconds of quiet before the first report; None: ``ELASTIC_EMB_PROGRESS_AFTER``.
        every: seconds between two events.
        clock: monotonic seconds; tests inject a fake clock (with ``auto=False``).
        stream: where the bar is drawn; None: ``sys.stderr``.
        bar: whether to draw a bar; None: when ``stream`` is a terminal and this process is not a
            worker of local rank above 0 (the local ranks of a node share one terminal).
        auto: report from the shared background thread; False: only :meth:`tick` reports.
        fields: bound to every event (e.g. ``step``), after the structlog context variables bound
            in the creating thread (``run_id``, ``generation``, ``rank``).
    """

    def __init__(
        self,
        task: str,
        total: int | None = None,
        *,
        unit: str = "bytes",
        after: float | None = None,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        stream=None,
        bar: bool | None = None,
        auto: bool = True,
        **fields: Any,
    ) -> None:
        self.task = task
        self.total = total
        self.unit = unit
        self._after = _after_setting() if after is None else max(0.0, float(after))
        self._every = max(1e-3, float(every))
        self._clock = clock
        self._stream = sys.stderr if stream is None else stream
        self._cells: list[list[int]] = []  # one counter per advancing thread, written by it alone
        self._local = threading.local()
        self._lock = threading.Lock()  # new cells, reports, close; never taken by a steady advance
        self._closed = False
        self._next = 0.0
        self._bar_drawn = False
        self._fields = {**structlog.contextvars.get_contextvars(), **fields}
        self._log = None
        try:
            self._log = get_logger("elastic_emb.progress")
        except Exception:  # a bad log setting: no events (the caller's own logging reports it)
            pass
        self._start = clock()
        self._next = self._start + self._after
        if bar is None:
            bar = _isatty(self._stream) and os.environ.get("LOCAL_RANK", "0") == "0"
        self._bar = bool(bar) and _claim_bar(self)
        if auto:
            try:
                _TICKER.add(self)
            except RuntimeError:  # no thread can be started: the final event still comes from close
                pass

    # -- the worker side ---------------------------------------------------------------------------

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done (any thread; cheap: no lock, no system call).

        Args:
            n: the units just done (negative to take some back).
        """
        try:
            self._local.cell[0] += n
        except AttributeError:
            self._new_cell(n)
        except Exception:  # never into the caller
            pass

    def _new_cell(self, n: int) -> None:
        try:
            cell = [0]
            with self._lock:
                self._cells.append(cell)
            self._local.cell = cell
            cell[0] += n
        except Exception:
            pass

    @property
    def done(self) -> int:
        """The units counted so far, over every thread."""
        return sum(c[0] for c in tuple(self._cells))

    def reset(self) -> None:
        """Start the count over (work redone from the beginning); call it while no thread advances."""
        with self._lock:
            for c in self._cells:
                c[0] = 0

    # -- reporting ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """Report if due: redraw the bar, and emit an event when the next one is due."""
        try:
            with self._lock:
                if self._closed:
                    return
                now = self._clock()
                if now - self._start < self._after:
                    return
                due = now >= self._next
                if due:
                    while self._next <= now:
                        self._next += self._every
                    self._clear_bar()
                    self._emit(now, final=False)
                if self._bar:
                    self._draw(now, final=False)
        except Exception:
            pass

    def close(self, failed: bool = False) -> None:
        """End the work: the final event (and bar) when it ran ``after`` seconds or more.

        Args:
            failed: the work ended with an error; the final event carries ``failed=True``.
        """
        try:
            _TICKER.remove(self)
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                now = self._clock()
                if now - self._start >= self._after:
                    if self._bar:
                        try:
                            self._draw(now, final=True)
                        except Exception:  # the terminal went away: the event still goes out
                            pass
                    self._emit(now, final=True, failed=failed)
        except Exception:
            pass
        finally:
            _release_bar(self)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """The fields of an event now (without the bound ones).

        Args:
            now: the clock's time; None: read it.

        Returns:
            ``task``, ``done_<unit>``, ``total_<unit>``, ``elapsed_s``, ``rate`` (units per
            second, None before any time passed) and ``eta_s`` (None while unknown).
        """
        now = self._clock() if now is None else now
        done, total = self.done, self.total
        elapsed = max(0.0, now - self._start)
        rate = done / elapsed if elapsed > 0 else None
        eta = None
        if total and done >= total:
            eta = 0.0
        elif total and done > 0 and elapsed > 0:
            eta = (total - done) * elapsed / done  # the rest at the average rate so far
        return {
            "task": self.task,
            f"done_{self.unit}": done,
            f"total_{self.unit}": total,
            "elapsed_s": round(elapsed, 3),
            "rate": None if rate is None else round(rate, 3),
            "eta_s": None if eta is None else round(eta, 3),
        }

    def _emit(self, now: float, final: bool, failed: bool = False) -> None:
        if self._log is None:
            return
        event = {**self._fields, **self.snapshot(now), "final": final}
        if failed:
            event["failed"] = True
        self._log.info("progress", **event)

    def _clear_bar(self) -> None:
        """Clear the bar's line before an event is written (both usually go to stderr)."""
        if self._bar_drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()

    def _draw(self, now: float, final: bool) -> None:
        s = self.snapshot(now)
        done, total = s[f"done_{self.unit}"], s[f"total_{self.unit}"]
        frac = min(1.0, max(0.0, done / total)) if total else 0.0
        filled = int(frac * BAR_WIDTH)
        line = f"{self.task} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {frac * 100:5.1f}% "
        line += f"{_amount(done, self.unit)}/{_amount(total, self.unit) if total else '?'}"
        if s["rate"] is not None:
            line += f" {_amount(s['rate'], self.unit)}/s"
        if s["eta_s"] is not None and not final:
            line += f" ETA {s['eta_s']:.0f}s"
        if final:
            line += f" in {s['elapsed_s']:.1f}s"
        line = line[: _columns(self._stream) - 1]  # a wrapped line could not be redrawn in place
        self._stream.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
        self._stream.flush()
        self._bar_drawn = not final


def _amount(n: float, unit: str) -> str:
    """``n`` units for the bar: bytes in binary multiples, anything else as a number."""
    if unit != "bytes":
        return f"{n:g}" if isinstance(n, float) else str(n)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.0f}{suffix}" if suffix == "B" else f"{n:.1f}{suffix}"
        n /= 1024
    return str(n)


def _columns(stream) -> int:
    """The terminal's width (80 when it cannot be read or is not set)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80
    return max(20, columns) if columns > 0 else 80


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


# -- one bar at a time per process -----------------------------------------------------------------

_bar_lock = threading.Lock()
_bar_owner: list[Progress] = []


def _claim_bar(p: Progress) -> bool:
    """Whether ``p`` may draw the bar: only one reporter of a process does (nested work logs only)."""
    with _bar_lock:
        if _bar_owner:
            return False
        _bar_owner.append(p)
        return True


def _release_bar(p: Progress) -> None:
    with _bar_lock:
        if _bar_owner and _bar_owner[0] is p:
            _bar_owner.clear()


# -- the shared reporting thread -------------------------------------------------------------------


_ON_ADVANCE: list[Callable[[], None]] = []  # called by the ticker when open work advanced (set_on_advance)


def set_on_advance(fn: Callable[[], None] | None) -> None:
    """Have the ticker call ``fn`` after a tick in which some open work advanced (at most every
    ``TICK_S``): the worker's progress heartbeat, so that long work that advances counts as progress.

    Args:
        fn: the callable (it must not raise), or None to stop.
    """
    _ON_ADVANCE[:] = [] if fn is None else [fn]


class _Ticker:
    """One daemon thread ticking every open reporter; it runs only while some reporter is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[Progress] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, p: Progress) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # the interpreter is exiting: no new thread
            self._open.append(p)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastic_emb-progress", daemon=True)
                self._thread.start()

    def remove(self, p: Progress) -> None:
        with self._lock:
            if p in self._open:
                self._open.remove(p)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                open_now = list(self._open)
                if not open_now:
                    self._thread = None
                    return
            advanced = False
            for p in open_now:
                done = p.done
                if done != getattr(p, "_done_at_tick", 0):
                    p._done_at_tick, advanced = done, True
                p.tick()
            if advanced and _ON_ADVANCE:
                try:
                    _ON_ADVANCE[0]()
                except Exception:  # reporting never raises
                    pass
        with self._lock:
            self._thread = None

    def forked(self) -> None:
        """In a forked child: the parent's thread does not exist here, and nothing is open."""
        self._lock = threading.Lock()
        self._open = []
        self._thread = None

    def stop(self) -> None:
        """At exit: end the thread (briefly waited for), so it writes nothing during teardown."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=1.0)


_TICKER = _Ticker()
atexit.register(_TICKER.stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_TICKER.forked)
