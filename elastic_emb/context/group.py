"""The context's private process group: form, wait on, interrupt, release.

- :class:`Group`: a gloo or NCCL group built from its backend on a store prefix private to the
  generation and construction (not registered with ``torch.distributed``), its bounded waits and
  its health; :meth:`Group.interrupt` ends every wait at once when a peer is known to be gone;
- :class:`Release` and :func:`wait_releases`: the bounded destroy or abort, in the background if
  asked, holding an aborted group until its abandoned transfers end;
- :func:`apply_nccl_defaults`: :data:`NCCL_DEFAULTS` (``NCCL_CUMEM_ENABLE=0`` unless set).

Design: ``docs/CONTEXT.md`` (section "The private process group").
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb.errors import CommunicationError, TransferInterrupted
from elastic_emb.events import get_logger
from elastic_emb.native_calls import native_call
from elastic_emb.rdzv.counters import increment
from elastic_emb.store import generation_store
from elastic_emb.topology import Topology
from elastic_emb.work_wait import WorkWaits, hold_then_drop

log = get_logger("elastic_emb.context")

NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0"}
_nccl_defaults_applied = False


def apply_nccl_defaults() -> dict[str, str]:
    """Set :data:`NCCL_DEFAULTS` where the environment does not. Called by the first NCCL
    context of the process (it must precede the process's first NCCL communicator to take
    effect); callers that create NCCL communicators of their own earlier can call it first.

    Returns:
        The variables set by this call, with their values.
    """
    global _nccl_defaults_applied
    applied = {}
    for key, value in NCCL_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    if not _nccl_defaults_applied:
        _nccl_defaults_applied = True
        log.info(
            "context.nccl_env", set_by_elastic_emb=applied, effective={k: os.environ.get(k) for k in NCCL_DEFAULTS}
        )
    return applied


def poll(ready, timeout: float) -> bool:
    """Call ``ready()`` until it is true or ``timeout`` seconds pass: yield the core between
    calls for the first ~2000, then sleep 0.2 ms, so a short wait is noticed at once and a long
    one does not burn a core.

    Args:
        ready: a callable without arguments.
        timeout: seconds.

    Returns:
        True once ``ready()`` returned true, False when the time ran out.
    """
    deadline = time.monotonic() + timeout
    spins = 0
    while not ready():
        if time.monotonic() > deadline:
            return False
        spins += 1
        time.sleep(0 if spins < 2000 else 0.0002)
    return True


class Group:
    """A formed private process group, its timeout and its health (use :meth:`form`).

    Args:
        pg: the ``ProcessGroup``.
        backend: its backend object (held until release).
        topology: the context's topology.
        device: the context's device.
        timeout: seconds; bounds every wait.
        log_: the context's logger.
    """

    def __init__(self, pg, backend, topology: Topology, device: torch.device, timeout: float, log_):
        self.pg = pg
        self._backend = backend  # held: the group must not outlive release (no teardown at exit)
        self.topology = topology
        self.device = device
        self.timeout = timeout
        self.healthy = True
        self.log = log_
        # every gloo wait, their interrupt (interrupt, release) and the works abandoned (held until release)
        self._waits = WorkWaits(f"rank {topology.rank} (generation {topology.generation})")

    @classmethod
    def form(
        cls,
        topology: Topology,
        store: dist.Store,
        device: torch.device,
        timeout: float,
        high_priority_stream: bool,
        log_,
    ) -> "Group":
        """A process group private to this construction or reset, connected and probed.

        Args:
            topology: the context's topology (backend, rank, world size, generation).
            store: the job's store; the group uses a prefix private to the generation and to
                this rank's construction count.
            device: the context's device.
            timeout: seconds; bounds forming and every later wait.
            high_priority_stream: NCCL: run the communicator's stream at high priority.
            log_: the context's logger.

        Returns:
            The formed :class:`Group`.

        Raises:
            CommunicationError: when the peers do not all form it within ``timeout``, or the
                construction probe fails.
        """
        started = time.monotonic()
        gen_store = generation_store(store, topology, "ctx")
        instance = increment(gen_store, f"instances/rank{topology.rank}")  # signed with a secret: rdzv/counters.py
        pg_store = dist.PrefixStore(f"pg{instance}/", gen_store)
        td = timedelta(seconds=timeout)
        rank, size = topology.rank, topology.world_size
        try:
            if topology.backend == "gloo":
                backend = dist.ProcessGroupGloo(pg_store, rank, size, td)
                backend._set_sequence_number_for_group()
                pg = dist.ProcessGroup(pg_store, rank, size)
                pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
                pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
                if torch.cuda.is_available():
                    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
            else:
                apply_nccl_defaults()
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = td
                opts.is_high_priority_stream = high_priority_stream
                backend = dist.ProcessGroupNCCL(pg_store, rank, size, opts)
                backend._set_sequence_number_for_group()
                torch.cuda.set_device(device)
                backend.eager_connect_single_device(device)
                pg = dist.ProcessGroup(pg_store, rank, size)
                pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
                pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        except Exception as exc:
            raise CommunicationError(
                f"could not form the {topology.backend} process group of rank {rank}/{size} "
                f"(run {topology.run_id!r} generation {topology.generation}, instance {instance}) within "
                f"{timeout}s: {exc}. Check that every rank constructs the context"
            ) from exc
        pg._set_group_name(f"elastic_emb.{topology.run_id}.gen{topology.generation}.{instance}")
        group = cls(pg, backend, topology, device, timeout, log_)
        group._probe()
        log_.info("context.group_formed", instance=instance, seconds=round(time.monotonic() - started, 4))
        return group

    def _probe(self) -> None:
        """The first collective connects: do it now, so construction fails here, not in a lookup.
        Raises CommunicationError when a probe returns the wrong values."""
        size, rank = self.topology.world_size, self.topology.rank
        probe = torch.ones(1, device=self.device)
        self.wait(self.pg.allreduce([probe]), None, "construction probe")
        if int(probe.item()) != size:
            raise CommunicationError(f"construction probe summed to {probe.item()}, expected {size}")
        if self.topology.backend == "nccl" and size > 1:
            # NCCL sets up the point-to-point connections an all-to-all needs only at the first
            # all-to-all (the all-reduce above uses other channels), which the first lookup or
            # the live reshard would otherwise pay. Pay it in construction.
            ids = torch.arange(size, dtype=torch.int64, device=self.device)
            got = torch.empty_like(ids)
            self.wait(
                self.pg.alltoall_base(got, ids, [1] * size, [1] * size, dist.AllToAllOptions()),
                None,
                "construction all-to-all probe",
            )
            if got.tolist() != [rank] * size:
                raise CommunicationError(
                    f"construction all-to-all probe returned {got.tolist()}, expected {[rank] * size}"
                )

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, work, timeout: float | None, what: str, host: bool = True) -> None:
        """Complete ``work`` within ``timeout`` (default: the group's).

        Gloo: ``Work.wait(timeout)`` blocks on a condition variable. NCCL: ``Work.wait(timeout)``
        polls with 10 ms sleeps (ProcessGroupNCCL's kSynchronizeBusyWaitMillis), far too coarse
        for a lookup of a few ms, so the host polls ``is_completed()`` itself with short sleeps
        when it needs the result (``host=True``), and otherwise only orders the current stream
        after the collective (``host=False``; the communicator's own timeout still bounds it).

        Args:
            work: the collective's work object.
            timeout: seconds; None: the group's.
            what: the operation, for messages.
            host: NCCL: whether the host waits for completion (else only the stream is ordered).

        Raises:
            TransferInterrupted: after :meth:`interrupt` (the group is then unhealthy).
            CommunicationError: on failure or timeout (the group is then unhealthy).
        """
        t = self.timeout if timeout is None else timeout
        try:
            if self.topology.backend != "nccl":
                # the work's future or an interrupt ends the wait, no polling (work_wait.py)
                ok = self._waits.wait([work], t, what)
            else:  # (an interrupt ends the host's poll too: the collective may never complete)
                ok = poll(lambda: self._waits.check(what) or work.is_completed(), t) if host else True
                if ok:
                    work.wait()
        except TransferInterrupted:
            self.healthy = False
            raise
        except Exception as exc:
            self.healthy = False
            raise CommunicationError(
                f"{what} failed on rank {self.topology.rank} (generation {self.topology.generation}): {exc}. "
                f"A peer died or is stuck; close this context and let the lifecycle re-form the world"
            ) from exc
        if ok is False:
            raise self.timed_out(what, t)

    @property
    def interrupted(self) -> str | None:
        """Why every wait on this group ends now (:meth:`interrupt`, an aborting release), or None."""
        return self._waits.reason

    def interrupt(self, reason: str) -> None:
        """End every wait on this group now and every later one at once (a peer is known to be
        gone; thread-safe): they raise :class:`~elastic_emb.errors.TransferInterrupted` (a
        :class:`CommunicationError`) naming ``reason``.

        Args:
            reason: why, for the error.
        """
        self._waits.interrupt(reason)

    def wait_event(self, event, timeout: float, what: str) -> None:
        """Poll a CUDA event until done, at most ``timeout`` seconds (host side), or until an
        :meth:`interrupt`.

        Args:
            event: the CUDA event.
            timeout: seconds.
            what: the operation, for messages.

        Raises:
            TransferInterrupted: after :meth:`interrupt` (the group is then unhealthy).
            CommunicationError: when ``timeout`` passes (the group is then unhealthy).
        """
        try:
            done = poll(lambda: self._waits.check(what) or event.query(), timeout)
        except TransferInterrupted:
            self.healthy = False
            raise
        if not done:
            raise self.timed_out(what, timeout)

    def timed_out(self, what: str, t: float) -> CommunicationError:
        """The error for a wait that ran out; marks the group unhealthy.

        Args:
            what: the operation, for the message.
            t: the seconds waited.

        Returns:
            The :class:`CommunicationError` to raise.
        """
        self.healthy = False
        return CommunicationError(
            f"{what} timed out after {t}s on rank {self.topology.rank} (generation "
            f"{self.topology.generation}): a peer is stuck or gone; close this context (it aborts) and "
            f"let the lifecycle re-form the world"
        )

    # -- collectives ------------------------------------------------------------------------

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        """Start an all-to-all of ``inp`` into ``out``.

        Args:
            out: the receive tensor.
            inp: the send tensor.
            out_splits: rows received from each rank (along dimension 0).
            in_splits: rows sent to each rank.

        Returns:
            The work, to pass to :meth:`wait`.

        Raises:
            CommunicationError: when the collective cannot be started (the group is then unhealthy).
        """
        try:
            return self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
        except Exception as exc:
            self.healthy = False
            raise CommunicationError(f"all-to-all failed on rank {self.topology.rank}: {exc}") from exc

    def allreduce(self, t: torch.Tensor, what: str) -> None:
        """Sum ``t`` over the group in place, waited (bounded by the timeout).

        Args:
            t: the tensor, on the group's device.
            what: the operation, for messages.

        Raises:
            CommunicationError: on failure or timeout.
        """
        self.wait(self.pg.allreduce([t]), None, what)

    # -- release ----------------------------------------------------------------------------

    def release(self, abort: bool, wait: bool = True, keep=None) -> None:
        """Release the communicator: destroy (``shutdown``) or abort, bounded by the timeout.
        Idempotent. Gloo is always aborted; an aborted group with abandoned transfers is held by
        a daemon thread until they end.

        Args:
            abort: abort instead of destroying (ends every wait on the group first).
            wait: False (NCCL) hands the release to a background thread and returns at once.
            keep: an object (the arena, after a failure) kept alive until the release is done,
                in case a stuck kernel still touches it.
        """
        pg, self.pg, self._backend = self.pg, None, None
        if pg is None:
            return
        if abort and self.interrupted is None:  # a wait in another thread ends now
            self.interrupt("the communicator was aborted (a peer died)")
        abandoned = self._waits.take_abandoned(waiting=True)  # and those of waits ending now
        if self.topology.backend == "gloo" and not abandoned and (wait or self.interrupted is None):
            # Gloo: abort() only closes this rank's connections. A healthy close has drained every
            # pending lookup first, so no collective is in flight and no peer loses data; shutdown()
            # left a joinable thread behind when a peer had died ("terminate called without an
            # active exception" at interpreter exit), abort did not. After an abandoned wait the
            # group's destructor blocks until the transfer times out: a Release aborts it and a
            # thread holds the group until then, whether or not the caller waits
            # (docs/CONTEXT.md, section "Who drops the group last").
            try:
                pg.abort()
            except Exception as exc:  # reported, not swallowed silently
                self.log.warning("context.group_release_failed", method="abort", error=str(exc))
            return
        method = "abort" if abort or self.topology.backend == "gloo" else "shutdown"  # gloo: as above
        release = Release(pg, method, self.timeout, self.log, keep, abandoned)
        del pg, keep, abandoned  # the release holds the group now: this frame must not drop it last
        if not wait:
            release.start()
            return
        release.release_communicator()  # the communicator is released when this returns...
        if release.holding():
            release.start(release.hold)  # ...but an abandoned transfer is waited out by a thread
        else:
            release.hold()


class Release:
    """Destroy or abort one communicator, bounded: a destroy still running after ``timeout``
    means a peer is gone, and is followed by an abort; an abort still running after another
    ``timeout`` is reported and left to the process's exit. The group is dropped (by this
    thread) only once the ``abandoned`` works are complete, at most ``timeout`` after the call:
    before then its destructor would block whoever dropped it last.

    Args:
        pg: the process group.
        method: ``"shutdown"`` or ``"abort"``.
        timeout: seconds each step is bounded by.
        log_: the context's logger.
        keep: an object kept alive until the group is dropped (the arena after a failure).
        abandoned: works abandoned by interrupted waits.
    """

    def __init__(self, pg, method: str, timeout: float, log_, keep=None, abandoned=()):
        self.pg, self.method, self.timeout, self._log, self._keep = pg, method, timeout, log_, keep
        self._abandoned = list(abandoned)
        self.thread: threading.Thread | None = None
        self.error: str | None = None
        self.seconds: float | None = None
        self.released = threading.Event()  # the destroy or abort returned (or timed out)
        self.done = threading.Event()  # and the group was dropped

    def _call(self, method: str) -> bool:
        def target() -> None:
            try:
                with native_call():  # the process's exit waits for it (briefly: native_calls.py)
                    getattr(self.pg, method)()
            except Exception as exc:  # reported, not swallowed silently
                self.error = f"{method}: {exc}"
                self._log.warning("context.group_release_failed", method=method, error=str(exc))

        t = threading.Thread(target=target, name=f"elastic_emb-{method}", daemon=True)
        t.start()
        t.join(self.timeout)
        return not t.is_alive()

    def run(self) -> None:
        """The whole release: :meth:`release_communicator`, then :meth:`hold`."""
        try:
            self.release_communicator()
        finally:
            self.hold()

    def release_communicator(self) -> None:
        """The destroy or abort, bounded (it sets :attr:`released`)."""
        started = time.monotonic()
        try:
            finished = self._call(self.method)
            if not finished:
                self._log.error("context.group_release_timeout", method=self.method, timeout=self.timeout)
                self.error = f"{self.method} did not finish within {self.timeout}s"
                if self.method == "shutdown" and self._call("abort"):
                    self.error += "; aborted instead"
            self.seconds = time.monotonic() - started
            self._log.info(
                "context.group_released", method=self.method, seconds=round(self.seconds, 4), error=self.error
            )
        finally:
            self.released.set()

    def holding(self) -> bool:
        """Whether an abandoned work still runs.

        Returns:
            True when dropping the group now would wait for a transfer.
        """
        return not all(w.is_completed() for w in self._abandoned)

    def hold(self) -> None:
        """Hold the group until the abandoned works are complete (bounded), then drop it
        (:func:`~elastic_emb.work_wait.hold_then_drop`, the state communicator's hold too)."""
        refs = [self.pg, self._keep]  # the last references, unless a holder elsewhere still has one
        self.pg = self._keep = None
        try:
            hold_then_drop(
                refs,
                self._abandoned,
                self.timeout + 1.0,  # gloo fails them at its timeout
                lambda: self._log.warning(
                    "context.abandoned_work_pending", works=len(self._abandoned), timeout=self.timeout
                ),
            )
        finally:
            self.done.set()

    def start(self, target=None) -> None:
        """Run the release in a daemon thread, registered for :func:`wait_releases`.

        Args:
            target: one of its parts to run instead (default: :meth:`run`).
        """
        with _RELEASES_LOCK:
            _RELEASES.append(self)
        self.thread = threading.Thread(target=target or self.run, name="elastic_emb-release", daemon=True)
        self.thread.start()


_RELEASES: list[Release] = []
_RELEASES_LOCK = threading.Lock()


def wait_releases(timeout: float | None = None, *, dropped: bool = True) -> list[dict]:
    """Wait for the communicators that ``close(wait=False)`` handed to background threads.
    Finished releases are forgotten.

    Args:
        timeout: seconds in all; None: each release's own bound (twice the context's timeout).
        dropped: False waits only until each destroy or abort has returned, not for the
            abandoned transfers a group is held for (what the exit does: the holding thread is a
            daemon, so the group is never destroyed and the process does not sit out gloo's
            timeout).

    Returns:
        One record per release: method, seconds, error (None when clean), done (the group
        dropped), released (its destroy or abort returned).
    """
    with _RELEASES_LOCK:
        pending = list(_RELEASES)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for r in pending:
        left = 2 * r.timeout + 1 if deadline is None else max(0.0, deadline - time.monotonic())
        (r.done if dropped else r.released).wait(left)
        finished = r.done.is_set()
        out.append(
            {
                "method": r.method,
                "seconds": r.seconds,
                "error": r.error,
                "done": finished,
                "released": r.released.is_set(),
            }
        )
        if finished:
            with _RELEASES_LOCK:
                if r in _RELEASES:
                    _RELEASES.remove(r)
    return out
