"""The background commit writer: a commit returns once its rows are captured; the files, the
replicas and the manifests are written while the next step runs.

``lc.commit(step)`` (with ``LifecycleConfig.async_commit``) captures the commit into a buffer of
its own (:meth:`SnapshotTier.capture`: the changed rows, or the whole shard for a base) and
hands it to :class:`CommitWriter`, whose thread writes it (:meth:`SnapshotTier.write`) and prunes.
At most one commit is in flight: the next commit, a resize, a drain and ``close`` first wait for
it (:meth:`CommitWriter.wait`, bounded), so a graceful resize loses no step, and a SIGKILL loses at
most the commit in flight (its manifests were not written: restore takes the one before).

The writer has a communicator of its own (a private gloo group and store prefix): its store
exchanges and replica transfers run beside the training's collectives on the context's group
without ever pairing with them. A failure of the writer is raised by the next ``wait``.
"""

from __future__ import annotations

import threading
import time

from elastic_emb.events import get_logger
from elastic_emb.state.comm import Comm
from elastic_emb.state.snapshot import Capture, SnapshotTier

log = get_logger("elastic_emb.state")


class CommitWriter:
    """Writes one captured commit at a time in a background thread."""

    def __init__(self, tier: SnapshotTier, comm: Comm, timeout: float) -> None:
        self.tier = tier
        self.comm = comm
        self.timeout = timeout
        self.committed_step = -1  # the newest step this writer completed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: int | None = None

    @property
    def in_flight(self) -> int | None:
        """The step being written, or None."""
        return self._in_flight if self._thread is not None and self._thread.is_alive() else None

    def submit(self, cap: Capture) -> None:
        """Start writing ``cap`` (after the commit in flight, if any, is complete)."""
        self.wait()
        self._in_flight = cap.step
        self._thread = threading.Thread(target=self._run, args=(cap,), name=f"elastic_emb-commit-{cap.step}",
                                        daemon=True)
        self._thread.start()

    def _run(self, cap: Capture) -> None:
        t0 = time.perf_counter()
        try:
            written, replicated = self.tier.write(cap, self.comm)
            self.tier.prune(self.comm)
        except BaseException as exc:  # raised to the training thread by the next wait()
            self._error = exc
            log.error("commit_failed", step=cap.step, error=str(exc)[:500])
            return
        self.committed_step = cap.step
        log.info("commit_complete", step=cap.step, bytes_snapshot=written, bytes_replicated=replicated,
                 delta=cap.parent is not None, seconds=round(time.perf_counter() - t0, 6))

    def wait(self) -> int:
        """Block until no commit is in flight (at most ``timeout`` seconds); raise its error if it
        failed. Returns the newest complete step."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.timeout)
            if thread.is_alive():
                self._thread = thread
                raise TimeoutError(f"the commit of step {self._in_flight} is still being written after "
                                   f"{self.timeout}s (storage or a peer is stuck); raise transfer_timeout or "
                                   f"check ELASTIC_EMB_STATE_DIR")
        self._in_flight = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.committed_step

    def close(self) -> None:
        """Wait for the commit in flight, then release the writer's communicator."""
        try:
            self.wait()
        finally:
            self.comm.close()
