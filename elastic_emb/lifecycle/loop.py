"""The elastic training loop: a user's step function, run under either resize mode.

:func:`run_elastic` starts the worker (or, on a node joining in process, joins the running world),
runs and commits every step, re-forms in process or waits for the agent's restart when the
membership changes, and closes. :class:`LoopHooks` are its seams (progress, pacing, final rows),
so that a caller adds to the loop without writing a second one. The loop's steps and its exit
codes are described in ``docs/TRAINING.md`` (section "The elastic loop").
"""

# LoopHooks is an abstract base whose every seam is optional: no abstract methods, no-op defaults.
# ruff: noqa: B024, B027

from __future__ import annotations

import signal
import threading
import time
from abc import ABC
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic_emb import config as settings
from elastic_emb.errors import JobComplete, ResizeFallback
from elastic_emb.events import bind_topology, get_logger
from elastic_emb.inprocess.interruptible import interruptible_store
from elastic_emb.inprocess.resize import InProcessResize
from elastic_emb.lifecycle.manager import Lifecycle
from elastic_emb.lifecycle.records import CommitReport, LifecycleConfig, ResizeEvent
from elastic_emb.protocol import ContextFactory
from elastic_emb.store import worker_store
from elastic_emb.topology import Topology
from elastic_emb.watch import heartbeat
from elastic_emb.watch.watcher import Watcher

if TYPE_CHECKING:
    from elastic_emb.protocol import ShardedContext

# How long a failed step waits for the membership change that would explain it: a SIGTERMed agent's
# "left" mark comes only after it stopped its workers, and a dead node shows at its heartbeat expiry;
# a loaded machine adds seconds to both. A real failure is re-raised this much later, no more.
MEMBERSHIP_WAIT_S = 15.0

log = get_logger("elastic_emb.lifecycle.loop")

EXIT_OK = 0
"""Every step done; or stopped for the agent's restart, which came; or a joiner found the job done."""
EXIT_NOT_RESTARTED = 3
"""The worker stopped for the agent's restart, and no SIGTERM came within ``drain_timeout``."""

StepFn = Callable[["ShardedContext", int], Any]
"""``step(context, step_index) -> loss``: one training step on every rank. The loss (a float, a
one-element tensor, or None) is read after the step's commit, so that on a GPU the commit's host
work overlaps the step's."""

STOP_REASONS = ("drain", "membership", "fallback", "job_complete")
"""Why the loop stops before its last step (:meth:`LoopHooks.on_stop`)."""


class LoopHooks(ABC):
    """The seams of :func:`run_elastic`; every default does nothing.

    The hooks run on the training thread, between steps: a hook that raises ends the loop with
    that error (the lifecycle is closed first). Read the world's rank and size from
    ``lc.topology``, which changes with every re-form in process.
    """

    def on_start(self, lc: Lifecycle, *, seconds: float) -> None:
        """The worker started (or joined) and restored; no step of this process ran yet.

        Args:
            lc: the started lifecycle; ``lc.step`` is the restored step (-1 on a fresh job, whose
                context keeps its initial rows), ``lc.events[-1]`` the start's report.
            seconds: seconds from the call of :func:`run_elastic` to here.
        """

    def after_step(
        self, lc: Lifecycle, step: int, loss: float | None, *, seconds: float, report: CommitReport | None
    ) -> None:
        """A step ran and was committed (the commit may still be written in the background).

        Args:
            lc: the lifecycle; ``lc.committed_step`` is the newest step whose commit is complete.
            step: the step.
            loss: what the step returned, as a float (None when it returned None).
            seconds: seconds the step and its commit took.
            report: the commit's report, or None when nothing was written.
        """

    def pace(self, lc: Lifecycle, step: int, wake: Callable[[], bool]) -> None:
        """Between two steps, unless the worker is draining: a hook may wait here (drills do).

        A wait should end as soon as ``wake()`` is True, so that a re-form or a drain does not
        wait for the rest of it.

        Args:
            lc: the lifecycle.
            step: the step just committed.
            wake: True once the loop has a reason to go on: in process a member left or a join
                is planned, in restart mode a drain is requested. One or two store reads.
        """

    def on_step_failed(self, lc: Lifecycle, step: int, error: BaseException) -> None:
        """A step (or, in process, its commit) raised and a membership change explains it.

        Nothing of the step is committed: in process the world re-forms next and the step runs
        again; in restart mode the worker stops for the agent's restart (:meth:`on_stop`).

        Args:
            lc: the lifecycle.
            step: the step that failed.
            error: what it raised.
        """

    def on_resize(self, lc: Lifecycle, event: ResizeEvent, *, failed: bool) -> None:
        """The world re-formed in this process (``resize=in_process``).

        Args:
            lc: the lifecycle in its new generation; ``lc.step`` is the step restored.
            event: the re-form's report (its ``first_step_s`` comes with the next commit).
            failed: the re-form followed a failed step rather than a step boundary.
        """

    def on_stop(self, lc: Lifecycle | None, reason: str, step: int) -> None:
        """The loop stops before its last step; it waits for the agent's restart next.

        Args:
            lc: the lifecycle, or None when the worker never started (a joiner).
            reason: one of :data:`STOP_REASONS`: ``drain`` (a node joins in restart mode: every
                step up to ``step`` is committed), ``membership`` (restart mode: a step failed
                and the membership changed), ``fallback`` (the in-process re-form fell back to
                the agents' restart), ``job_complete`` (a joiner: the job finished before it was
                included; the worker exits at once).
            step: the newest step taken (-1 when none).
        """

    def on_finish(self, lc: Lifecycle) -> None:
        """Every step ran and was committed; the lifecycle is closed after this hook.

        Args:
            lc: the lifecycle, in the world that ran the last step.
        """


def run_elastic(
    factory: ContextFactory,
    step: StepFn,
    *,
    steps: int,
    config: LifecycleConfig | None = None,
    hooks: LoopHooks | None = None,
    drain_timeout: float = 120.0,
    app_state=None,
    rank_state=None,
) -> int:
    """Run ``step`` for steps ``lc.next_step .. steps - 1`` elastically, committing each one.

    Under ``--rdzv-backend=elastic_emb`` a :class:`~elastic_emb.watch.watcher.Watcher` follows
    the membership, and ``ELASTIC_EMB_RESIZE`` picks the mode. Restart mode: the worker stops for
    the agent's restart when a node joins (after a committed step) or when a step failed because
    the membership changed. ``in_process``: the world re-forms in this process at a step boundary
    or after a failed step, and a worker of a joining node (``ELASTIC_EMB_JOINER``) waits to be
    included. Without the backend the loop runs at the launch's world size.

    Args:
        factory: builds the context for an agreed topology, ``(topology, store) -> context``.
        step: one training step, ``step(context, step_index) -> loss`` (:data:`StepFn`); every
            rank calls it for every step, and it must read rank and world size from
            ``context.topology``.
        steps: the number of steps of the whole job (across restarts and re-forms).
        config: the lifecycle's configuration; None for the defaults.
        hooks: the caller's seams (:class:`LoopHooks`); None for none.
        drain_timeout: seconds to wait for the agent's restart once the worker stopped for it,
            and for a joiner to be included.
        app_state: the rest of the training state (a dense model, its optimizer, a scheduler, an
            :class:`~elastic_emb.data.ElasticSampler`), committed and restored with the tables;
            see :meth:`Lifecycle.start`.
        rank_state: state that differs per rank (per-rank RNG streams), restored to the rank that
            wrote it at the same world size; see :meth:`Lifecycle.start`.

    Returns:
        The process exit code: :data:`EXIT_OK` (0) when every step is done, when the worker
        stopped for the agent's restart and it came, or when a joiner found the job finished;
        :data:`EXIT_NOT_RESTARTED` (3) when no restart came within ``drain_timeout``.

    Raises:
        ValueError: ``steps`` is negative or ``drain_timeout`` is not positive.
        Exception: what :meth:`Lifecycle.start` raises; a step's error that no membership change
            explains; in process, the re-form's ``ElasticEmbError`` when no departure explains a
            failed step.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be a whole number >= 0 (the job's total number of steps)")
    if not drain_timeout > 0:
        raise ValueError(f"drain_timeout={drain_timeout!r} must be > 0 seconds")
    hooks = hooks if hooks is not None else LoopHooks()
    config = config if config is not None else LifecycleConfig()
    t0 = time.perf_counter()
    watcher = Watcher.from_env()
    if watcher is not None:
        watcher.start()
    try:
        in_process = watcher is not None and settings.load(None, "resize").resize == "in_process"
        if in_process and settings.load(None, "joiner").joiner:
            try:  # this node joins a running world: wait (bounded) to be included, then start with it
                lc, resize = InProcessResize.join(
                    factory, config, watcher, timeout=drain_timeout, app_state=app_state, rank_state=rank_state
                )
            except JobComplete:  # the world finished first: nothing to join, nothing lost
                hooks.on_stop(None, "job_complete", -1)
                return EXIT_OK
            except ResizeFallback:  # not included: the agents restart everyone, this worker too
                hooks.on_stop(None, "fallback", -1)
                return EXIT_OK if _wait_for_sigterm(drain_timeout) else EXIT_NOT_RESTARTED
        else:
            store = None
            if in_process:  # its waits end as soon as a member is gone
                store = interruptible_store(worker_store(Topology.from_env(), timeout=config.agree_timeout), watcher)
            lc = Lifecycle.start(
                factory, config, watcher=watcher, store=store, app_state=app_state, rank_state=rank_state
            )
            resize = InProcessResize(lc, watcher) if in_process else None
        try:
            return _Loop(lc, resize, watcher, hooks, drain_timeout).run(step, steps, t0)
        finally:
            lc.close()
    finally:
        if watcher is not None:
            watcher.stop()


class _Loop:
    """One worker's steps in one process, across its in-process re-forms."""

    def __init__(self, lc: Lifecycle, resize, watcher, hooks: LoopHooks, drain_timeout: float) -> None:
        self.lc, self.resize, self.watcher, self.hooks = lc, resize, watcher, hooks
        self.drain_timeout = drain_timeout

    def run(self, step_fn: StepFn, steps: int, t0: float) -> int:
        lc, resize, hooks = self.lc, self.resize, self.hooks
        bind_topology(lc.topology)
        hooks.on_start(lc, seconds=time.perf_counter() - t0)
        while lc.next_step < steps:
            step = lc.next_step
            if resize is not None and resize.pending():
                if not self._reform(failed=False):
                    return self._stop("fallback")
                continue
            t = time.perf_counter()
            try:
                loss = step_fn(lc.context, step)
                if resize is not None:  # in process, a commit whose peer died re-forms too
                    report = lc.commit(step)
            except Exception as exc:
                if resize is not None:  # a peer died mid-step: re-form now (raises if nobody left)
                    hooks.on_step_failed(lc, step, exc)
                    if not self._reform(failed=True):
                        return self._stop("fallback")
                    continue
                # Restart mode: when a membership change explains the failure, the agent is about
                # to restart this worker into the new world (free of --max-restarts): wait for it
                # rather than fail. Nothing of this step was committed; it runs again.
                heartbeat.pause()  # the wait below is bounded; the agent's restart follows, or the error
                if self.watcher is not None and self.watcher.membership_change_pending(timeout=MEMBERSHIP_WAIT_S):
                    log.warning("loop.step_failed_membership_changed", step=step, error=type(exc).__name__)
                    hooks.on_step_failed(lc, step, exc)
                    return self._stop("membership")
                raise
            if resize is None:
                report = lc.commit(step)
            hooks.after_step(
                lc, step, None if loss is None else float(loss), seconds=time.perf_counter() - t, report=report
            )
            if not lc.draining:
                hooks.pace(lc, step, self._wake)
            if lc.draining:  # a node joins: everything up to `step` is committed; the agent restarts us
                return self._stop("drain")
        if resize is not None and (resize.departure_seen() or resize.join_due()):
            # A joiner became ready just before the last step: include it now, so that the world
            # that ends the job is the one the joiner's agent is part of.
            if not self._reform(failed=False):
                return self._stop("fallback")
        hooks.on_finish(lc)
        log.info("loop.done", step=lc.step)
        return EXIT_OK

    def _reform(self, *, failed: bool) -> bool:
        """Re-form in this process; False when it fell back to the agents' restart."""
        try:
            event = self.resize.run(failed=failed)
        except ResizeFallback:
            return False
        bind_topology(self.lc.topology)
        self.hooks.on_resize(self.lc, event, failed=failed)
        return True

    def _stop(self, reason: str) -> int:
        """Stop stepping and wait (bounded) for the agent's restart."""
        self.hooks.on_stop(self.lc, reason, self.lc.step)
        if self.lc.wait_for_restart(self.drain_timeout):
            log.info("loop.stopped_for_restart", reason=reason, step=self.lc.step)
            return EXIT_OK
        log.error("loop.not_restarted", reason=reason, step=self.lc.step, timeout=self.drain_timeout)
        return EXIT_NOT_RESTARTED

    def _wake(self) -> bool:
        """Whether a pacing hook should stop waiting: a re-form or a drain is due."""
        if self.resize is not None:  # pending() also publishes the join plan, as at a step boundary
            return self.resize.pending() or self.resize.planned()
        return self.watcher is not None and self.watcher.drain_requested()


def _wait_for_sigterm(timeout: float) -> bool:
    """Block until SIGTERM (True) or ``timeout`` seconds (False): a joiner that was not included
    waits for the agents' restart-mode round. The previous handler is put back afterwards."""
    got = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return got.wait(timeout)  # only the main thread receives signals: wait out the bound
    previous = signal.signal(signal.SIGTERM, lambda *_: got.set())
    try:
        return got.wait(timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)
