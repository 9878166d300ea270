"""The agent's hang watchdog: a local worker that makes no progress for ``hang_timeout`` is killed.

Workers touch their progress files (``watch/heartbeat.py``) at every commit and while long work
advances; :class:`HangWatchdog` SIGKILLs a worker stopped or running without progress for the
bound, or asleep in the kernel for twice it (most often waiting on a hung peer, whose own agent
acts first), so that the job re-forms from its newest complete commit. A file naming a process
that is not this agent's child is ignored. Design: ``docs/OPERATIONS.md`` ("Hung workers").
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_emb import metrics
from elastic_emb.rdzv.localfile import read_regular, remove_quietly


def process_state(pid: int) -> tuple[int, str] | None:
    """A process's parent and state letter, from ``/proc/<pid>/stat``.

    Args:
        pid: the process id.

    Returns:
        ``(parent pid, state)`` (``R``, ``S``, ``D``, ``T`` for stopped, ``Z``, ...), or None when
        the process is gone or ``/proc`` cannot be read.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), fields[0].decode("ascii", "replace")
    except (OSError, IndexError, ValueError):
        return None


class HangWatchdog:
    """Kills this agent's workers whose progress file is older than ``timeout`` seconds.

    Args:
        prefix: the progress files' prefix (``ELASTIC_EMB_PROGRESS_FILE``).
        timeout: seconds without progress after which a worker is hung (> 0).
        log: a structlog logger (``worker_hung``).
        agent_pid: the agent's pid: only its children are killed (default: this process).
        clock: the wall clock the files' times are compared with.
        kill: sends the signal (default ``os.kill``), for the tests' record of who was killed.

    Raises:
        ValueError: when ``timeout`` is not positive.
    """

    def __init__(
        self,
        prefix: str,
        timeout: float,
        log: Any,
        *,
        agent_pid: int | None = None,
        clock: Callable[[], float] = time.time,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"hang_timeout={timeout!r} must be > 0 seconds (0 turns the watchdog off)")
        self.prefix = prefix
        self.timeout = timeout
        self.log = log
        self.agent_pid = os.getpid() if agent_pid is None else agent_pid
        self._clock = clock
        self._kill = kill
        self.killed: list[dict] = []  # what was killed: {rank, pid, stale_s, state}
        self._ignored: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "HangWatchdog":
        """Look every ``min(1, timeout / 4)`` seconds in a daemon thread.

        Returns:
            This watchdog.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastic_emb-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop looking (the thread ends within one period)."""
        self._stop.set()

    def check(self) -> list[dict]:
        """Look once: kill every hung worker of this agent.

        Returns:
            The workers killed by this call: ``{rank, pid, stale_s, state}`` each.
        """
        now = self._clock()
        found = []
        for path in sorted(glob.glob(glob.escape(self.prefix) + "-*.json"))[:1024]:
            rank = path[len(self.prefix) + 1 : -len(".json")]
            read = read_regular(path)
            if read is None or not (rank.isascii() and rank.isdigit()):
                continue
            data, st = read
            stale = now - st.st_mtime
            if stale <= self.timeout:
                continue
            pid = _pid_of(data)
            state = process_state(pid) if pid is not None else None
            if state is not None and state[1] in ("S", "D", "I") and stale <= 2 * self.timeout:
                continue  # waiting, most likely for a hung peer: its own agent acts first
            if state is None or state[0] != self.agent_pid or state[1] == "Z":
                if path not in self._ignored:  # gone, exited, or not ours: nothing to kill
                    self._ignored.add(path)
                    self.log.debug("progress_file_ignored", path=path, pid=pid, reason="not a live child of this agent")
                remove_quietly(path)
                continue
            self.log.error(
                "worker_hung",
                local_rank=int(rank),
                pid=pid,
                stale_s=round(stale, 3),
                stopped=state[1] in ("T", "t"),
                bound_s=self.timeout,
                remedy="the worker made no progress (no commit, no long work advancing) for longer than "
                "--rdzv-conf hang_timeout; it is killed and the job re-forms from its newest complete commit",
            )
            try:
                self._kill(pid, signal.SIGKILL)
            except OSError:
                continue
            remove_quietly(path)  # its next incarnation writes its own
            metrics.worker_hung()
            found.append({"rank": int(rank), "pid": pid, "stale_s": stale, "state": state[1]})
        self.killed.extend(found)
        return found

    def _run(self) -> None:
        every = min(1.0, self.timeout / 4)
        while not self._stop.wait(every):
            try:
                self.check()
            except Exception as exc:  # never end the agent's watchdog on one bad look
                self.log.warning("hang_watchdog_error", error=repr(exc)[:300])


def _pid_of(data: bytes) -> int | None:
    try:
        pid = json.loads(data)["pid"]
    except (ValueError, KeyError, TypeError):
        return None
    return pid if type(pid) is int and 1 < pid < 1 << 22 else None
