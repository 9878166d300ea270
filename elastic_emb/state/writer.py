"""The background commit writer: a commit returns once its rows are captured; the files, the
replicas and the manifests are written while the next steps run.

:class:`CommitWriter` writes captured commits in order in a thread of its own, on a communicator
of its own, at most ``depth`` in flight; a failed write drops the commits queued after it and is
raised by the next :meth:`~CommitWriter.submit` or :meth:`~CommitWriter.wait`.
:func:`finish_commit_on_sigterm` makes a SIGTERM wait for the commit in flight first.

Design: ``docs/COMMIT.md`` (section "The background writer").
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

from elastic_emb import metrics
from elastic_emb.events import get_logger
from elastic_emb.native_calls import native_call
from elastic_emb.progress import Progress
from elastic_emb.state.comm import Comm
from elastic_emb.state.snapshot import Capture, SnapshotTier

log = get_logger("elastic_emb.state")


class _Abandoned(Exception):
    """The write of an abandoned writer returned: not a failure, nobody waits for it."""


class CommitWriter:
    """Writes captured commits in order in a background thread, at most ``depth`` in flight.

    Args:
        tier: the snapshot tier that writes and prunes.
        comm: the writer's own communicator (a private gloo group and store prefix).
        timeout: how long :meth:`submit` and :meth:`wait` wait by default.
        depth: the most commits in flight (1 for host captures, which name a complete parent).

    Raises:
        ValueError: if ``depth`` is below 1.
    """

    def __init__(self, tier: SnapshotTier, comm: Comm, timeout: float, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1 commits in flight")
        self.tier = tier
        self.comm = comm
        self.timeout = timeout
        self.depth = depth
        self.committed_step = -1  # the newest step this writer completed
        self._queue: deque[Capture] = deque()
        self._writing: Capture | None = None
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._abandoned = False  # abandon(): the thread's write, when it returns, is nobody's
        self._interrupted: str | None = None  # interrupt(): why the write in flight cannot complete

    @property
    def in_flight(self) -> int | None:
        """The oldest step captured and not yet complete, or None."""
        with self._cv:
            if self._writing is not None:
                return self._writing.step
            return self._queue[0].step if self._queue else None

    def _count(self) -> int:
        return len(self._queue) + (self._writing is not None)

    def submit(self, cap: Capture) -> None:
        """Queue a captured commit for writing, once fewer than ``depth`` commits are in flight.

        Args:
            cap: the capture; released here if it cannot be queued.

        Raises:
            TimeoutError: if no slot came free within the writer's timeout.
            Exception: the error of an earlier write that failed (the tier's chain is then broken,
                so the next commit is a base).
        """
        try:
            self._wait_until(lambda: self._count() < self.depth, f"a slot for the commit of step {cap.step}")
        except BaseException:
            cap.release()
            raise
        with self._cv:
            self._queue.append(cap)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastic_emb-commit-writer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                cap = self._writing = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                # native_call: device syncs, transfers, store calls: the exit waits for them
                with native_call(), _base_progress(cap) as progress:
                    written, replicated = self.tier.write(cap, self.comm)
                    if progress is not None:
                        progress.advance(written)
                    if self._abandoned:  # a re-form is under way on a new communicator: prune nothing here
                        raise _Abandoned()
                    self.tier.prune(self.comm)
            except BaseException as exc:  # raised to the training thread by the next submit or wait
                if self._abandoned:
                    log.warning(
                        "commit_abandoned",
                        step=cap.step,
                        seconds=round(time.perf_counter() - t0, 6),
                        error=None if isinstance(exc, _Abandoned) else str(exc)[:300],
                    )
                    cap.release()
                    with self._cv:
                        self._writing = None
                        self._cv.notify_all()
                    return
                if self._interrupted is not None:  # expected: a peer is known gone (interrupt), not a fault here
                    log.warning("commit_aborted", step=cap.step, reason=self._interrupted, error=str(exc)[:300])
                else:
                    log.error("commit_failed", step=cap.step, error=str(exc)[:500])
                with self._cv:
                    self._error = exc
                    dropped, self._queue = list(self._queue), deque()
                    self._writing = None
                    self._cv.notify_all()
                for c in [cap] + dropped:
                    c.release()
                continue
            cap.release()
            with self._cv:
                self.committed_step = cap.step
                self._writing = None
                self._cv.notify_all()
            metrics.replicated(replicated)
            log.info(
                "commit_complete",
                step=cap.step,
                bytes_snapshot=written,
                bytes_replicated=replicated,
                delta=cap.parent is not None,
                seconds=round(time.perf_counter() - t0, 6),
            )

    def _wait_until(self, ready, what: str, timeout: float | None = None) -> None:
        """Wait (at most ``timeout``) until ``ready()``; raise the error of a failed write first."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if self._error is not None:
                    error, self._error = self._error, None
                    self.tier.break_chain()  # the next commit must not name a commit never written
                    raise error
                if ready():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"waited {timeout}s for {what}: the commit of step {self._in_flight_locked()} "
                        f"is still being written (storage or a peer is stuck); raise transfer_timeout "
                        f"or check ELASTIC_EMB_STATE_DIR"
                    )
                self._cv.wait(left)

    def _in_flight_locked(self) -> int | None:
        if self._writing is not None:
            return self._writing.step
        return self._queue[0].step if self._queue else None

    def interrupt(self, reason: str) -> None:
        """A peer is known gone (callable from another thread): the write in flight cannot complete.

        Its store waits and its replica transfer end now (the communicator is aborted), and its
        failure, raised to the training thread as usual, is logged as ``commit_aborted`` (a
        warning), not as the error ``commit_failed``.

        Args:
            reason: why, for the log and the abort.
        """
        self._interrupted = reason  # before the abort: the thread reads it once its wait ends
        self.comm.abort(reason)

    def give_up_on(self, ranks, reason: str) -> None:
        """Ranks of this generation left the rendezvous (callable from another thread).

        The write in flight fails now if it still waits for a key of theirs (``Comm.give_up_on``),
        logged as ``commit_aborted`` (a warning); one they had done their part of completes.

        Args:
            ranks: the ranks gone.
            reason: why, for the log and the errors.
        """
        self._interrupted = reason  # before the comm reads it: the thread reads it once its wait ends
        self.comm.give_up_on(ranks, reason)

    def abandon(self) -> int | None:
        """A peer died: drop the commits in flight without waiting for them.

        The queued commits are released and the communicator aborted; the thread exits without
        pruning once the write it is in returns or fails. The writer is unusable afterwards.

        Returns:
            The oldest step dropped, or None when none was in flight.
        """
        with self._cv:
            oldest = self._in_flight_locked()
            self._abandoned = self._stop = True
            dropped, self._queue = list(self._queue), deque()
            self._cv.notify_all()
        for cap in dropped:
            cap.release()
        self.comm.abort()  # its store waits for the dead peer end now
        if oldest is not None:
            log.warning(
                "commits_abandoned",
                oldest_step=oldest,
                newest_complete=self.committed_step,
                reason="a peer died: the commits in flight cannot complete",
            )
        return oldest

    def wait(self, timeout: float | None = None) -> int:
        """Block until no commit is in flight.

        Args:
            timeout: the most seconds to wait; None: the writer's timeout.

        Returns:
            The newest step this writer completed (-1 for none).

        Raises:
            TimeoutError: if a commit is still in flight at the timeout.
            Exception: the error of a write that failed (the tier's chain is then broken).
        """
        self._wait_until(lambda: self._count() == 0, "the commits in flight", timeout)
        return self.committed_step

    def join(self, timeout: float) -> bool:
        """Wait for the writer's thread to exit (an abandoned writer's thread must not be inside a
        store call when the interpreter exits).

        Args:
            timeout: the most seconds to wait.

        Returns:
            Whether the thread has exited (True when there was none).
        """
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def close(self, wait: bool = True) -> None:
        """Wait for the commits in flight, stop the thread, then release the writer's communicator.

        Args:
            wait: wait for the commits in flight first (False: the caller did); the thread and the
                communicator are stopped and released even when the wait raises.

        Raises:
            TimeoutError: if ``wait`` and a commit is still in flight at the timeout.
            Exception: the error of a write that failed.
        """
        try:
            if wait:
                self.wait()
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            thread = self._thread
            if thread is not None and self._count() == 0:
                thread.join(self.timeout)
            self.comm.close()


def _base_progress(cap: Capture):
    """A base (every row of the shard) reports its write's progress; a delta does not."""
    if cap.parent is not None:
        return contextlib.nullcontext()
    topo = cap.topology  # a thread of its own: the worker's bound fields are not in its context
    return Progress(
        "base_write",
        cap.blob.numel() * cap.blob.element_size(),
        step=cap.step,
        rank=getattr(topo, "rank", None),
        generation=getattr(topo, "generation", None),
    )


def finish_commit_on_sigterm(writer_of: Callable[[], "CommitWriter | None"], wait_s: float):
    """Make a SIGTERM first wait for the commit in flight, then end the process as by default.

    A worker stopped by its agent (a graceful leave) then leaves its last commit complete, as with
    synchronous commits. Installed from the main thread only, and only over the default action
    (never over the user's).

    Args:
        writer_of: returns the current writer, or None.
        wait_s: the most seconds the handler waits for the commit in flight.

    Returns:
        The handler installed, or None when none was.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def finish_then_terminate(signum, frame) -> None:
        writer = writer_of()
        if writer is not None and writer.in_flight is not None:
            log.info("lifecycle.sigterm_waits_for_commit", step=writer.in_flight)
            try:
                writer.wait(wait_s)
            except BaseException as exc:  # the process ends anyway; the previous commit stays the newest
                log.error("lifecycle.commit_failed", step=writer.in_flight, error=str(exc)[:300])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, finish_then_terminate)
    return finish_then_terminate


def uninstall_sigterm(handler) -> None:
    """Put the default SIGTERM action back if ``handler`` is still the one installed (main thread only).

    Args:
        handler: what :func:`finish_commit_on_sigterm` returned (None: nothing to do).
    """
    if handler is not None and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
