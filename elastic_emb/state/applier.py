"""The applier: a thread per snapshot tier that writes the deltas it is handed into their bases.

What one apply does (the marks, the rows, the hashes) is :func:`~elastic_emb.state.inplace.apply_chain`;
this module queues the requests, batches them, cancels at a resize and bounds the backlog.

Design: ``docs/COMMIT.md`` (section "Applying deltas in place").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from elastic_emb.events import get_logger
from elastic_emb.native_calls import exiting, native_call
from elastic_emb.state.inplace import MappedFile, ReadBuffer, apply_chain, close_maps
from elastic_emb.state.manifest import CommitId
from elastic_emb.state.rowhash import hashes_file

log = get_logger("elastic_emb.state")


class Applier:
    """Writes the deltas it is handed into their bases, in a thread of its own, in order.

    Requests queue up; each run takes every queued request and, per chain, writes all its deltas
    after the base's mark up to the newest requested. An apply that fails is logged and changes
    nothing a restore needs (the chain keeps its deltas; the next request tries again). The bases'
    mappings stay open between runs (closed once a base is gone, and by :meth:`cancel`).

    Args:
        tier: the node's :class:`~elastic_emb.state.snapshot.SnapshotTier`.
        timeout: how long :meth:`wait` and :meth:`cancel` wait by default.
    """

    def __init__(self, tier, timeout: float) -> None:
        self.tier = tier
        self.timeout = timeout
        self.applied = 0  # deltas written into bases
        self._cv = threading.Condition()
        self._queue: list[tuple[CommitId, list[tuple[int, bool]]]] = []
        self._running = 0  # commits of the batch under way
        self._busy = False
        self._epoch = 0
        self._maps: dict[Path, MappedFile] = {}  # the bases' mappings, kept open between runs
        self._writing = threading.Lock()  # held while a base is written (apply_chain)
        self._buffer = ReadBuffer()  # each delta is read into it (the applier thread only)
        self._thread: threading.Thread | None = None

    def backlog(self) -> int:
        """The commits handed over and not applied yet.

        Returns:
            The commits queued, plus those of the batch under way.
        """
        with self._cv:
            return len(self._queue) + self._running

    def request(self, step: int, commit: CommitId, shards: list[tuple[int, bool]]) -> None:
        """Queue a complete delta commit's shards held here (own and replicas) for applying.

        Args:
            step: the commit's step (for events).
            commit: the commit.
            shards: ``(source rank, replica)`` of each of its manifests this rank wrote.
        """
        with self._cv:
            self._queue.append((commit, list(shards)))
            if not self._busy:
                self._busy = True
                self._thread = threading.Thread(target=self._run, name="elastic_emb-applier", daemon=True)
                self._thread.start()

    def wait_below(self, count: int, timeout: float) -> bool:
        """Wait until at most ``count`` commits are not applied yet (back-pressure: what the
        deltas not applied hold is bounded).

        Args:
            count: the backlog to wait for.
            timeout: the most seconds to wait.

        Returns:
            Whether the backlog came down to ``count``.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self._queue) + self._running > count and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return len(self._queue) + self._running <= count

    def _run(self) -> None:
        from elastic_emb.state.delta import resolve_chains

        while True:
            with self._cv:
                self._running = 0
                self._cv.notify_all()
                batch, self._queue, epoch = self._queue, [], self._epoch
                if not batch or exiting():
                    self._queue = []
                    self._busy = False
                    self._cv.notify_all()
                    return
                self._running = len(batch)

            def cancelled(epoch=epoch) -> bool:  # cancel() moves the epoch on: this batch stops
                return self._epoch != epoch or exiting()

            t0, step, done = time.perf_counter(), batch[-1][0].step, 0
            try:
                with native_call():  # tensor ops and file writes: the exit waits for them (or cancels)
                    newest: dict[tuple[int, bool], CommitId] = {}
                    for commit, shards in batch:
                        for key in shards:
                            newest[key] = max(newest.get(key, commit), commit)
                    chains = resolve_chains(self.tier.manifests())[0]
                    tips = {(c[-1][1].source_rank, c[-1][1].replica, c[-1][1].commit): c for c in chains.values()}
                    bases = {c[0][0] for c in chains.values()}
                    close_maps(self._maps, keep={p for b in bases for p in (b, b.with_name(hashes_file(b.name)))})
                    for (source, replica), commit in sorted(newest.items()):
                        if cancelled():
                            break
                        chain = tips.get((source, replica, commit))
                        if chain is not None:  # (else pruned, or its chain broken, meanwhile)
                            done += apply_chain(self.tier, chain, cancelled, self._maps, self._writing, self._buffer)
                    if cancelled():
                        close_maps(self._maps)
                if done:
                    self.applied += done
                    log.debug("apply_complete", step=step, deltas=done, seconds=round(time.perf_counter() - t0, 6))
            except Exception as exc:  # nothing lost: the chain keeps its deltas
                close_maps(self._maps)
                log.warning(
                    "apply_failed",
                    step=step,
                    error=f"{type(exc).__name__}: {exc}"[:400],
                    remedy="nothing lost: the chain keeps its deltas, the next commit tries again",
                )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued request is applied.

        Args:
            timeout: the most seconds to wait; None: the applier's timeout.

        Returns:
            Whether the applier is idle now.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cv:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return not self._busy

    def cancel(self, timeout: float) -> bool:
        """Drop the queued requests and stop the apply under way: once this returns, no byte is
        written into a base any more (a restore may read them next). A run still reading (a base
        being promoted, which writes no base) ends on its own at its next check.

        Args:
            timeout: the most seconds to wait for the write under way (one delta at most).

        Returns:
            Whether no base is being written now.
        """
        with self._cv:
            self._epoch += 1
            self._queue = []
        if self._writing.acquire(timeout=timeout):
            self._writing.release()
            return True
        log.warning("apply_still_running", seconds=timeout, remedy="it ends at its next delta; nothing is lost")
        return False
