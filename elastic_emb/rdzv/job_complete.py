"""The end of a job with nodes still joining it (both resize modes).

An agent whose workers all succeeded writes one signed mark (:func:`mark_complete`) as it enters
torch's exit barrier (:class:`CompletingStore`, :class:`CompletingExitBarrierStore`). A joiner's
worker that finds it exits 0 instead of waiting to be included, and an agent that finds the
rendezvous closed with the mark set exits 0 (:func:`closed_and_complete`) instead of failing.

Design: ``docs/RDZV.md`` (section "Job completion").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from elastic_emb.rdzv.exit_barrier import NUM_MEMBERS, ExitBarrierStore
from elastic_emb.rdzv.keys import KEY_COMPLETE, inproc_root
from elastic_emb.rdzv.outage import reraise_signal
from elastic_emb.rdzv.signing import Signer, read_signed
from elastic_emb.store import ForwardingStore


def complete_key(run_id: str) -> str:
    """The store key of a run's job-complete mark.

    Args:
        run_id: the rendezvous run id.

    Returns:
        ``inproc_root(run_id) + KEY_COMPLETE``.
    """
    return inproc_root(run_id) + KEY_COMPLETE


def mark_complete(store: Any, signer: Signer, run_id: str, **mark: Any) -> None:
    """Write the signed job-complete mark.

    Args:
        store: the rendezvous store.
        signer: the job's control-key signer.
        run_id: the rendezvous run id.
        mark: who and when (node, round, generation), stored as JSON for the readers' events.
    """
    key = complete_key(run_id)
    store.set(key, signer.sign(key, json.dumps(mark)))


def read_mark(store: Any, signer: Signer, run_id: str, log: Any = None) -> str | None:
    """The job-complete mark.

    Args:
        store: the rendezvous store.
        signer: the job's control-key signer.
        run_id: the rendezvous run id.
        log: a structlog logger for ``control_key_rejected``, or None.

    Returns:
        The mark's JSON text (at most 200 characters), or None when the job is not marked
        complete or the value is not validly signed.
    """
    value = read_signed(store, signer, complete_key(run_id), log)
    return None if value is None else value.decode("utf-8", "replace")[:200]


def closed_and_complete(exc: BaseException, store: Callable[[], Any], signer: Signer, run_id: str, log: Any) -> bool:
    """Whether ``exc`` is torch's closed rendezvous of a job marked complete.

    Logs ``job_finished_before_join`` when it is. An unreadable store (gone with the agent that
    hosted it) is logged as ``job_complete_unreadable`` and answers False, as does a missing mark:
    the caller re-raises torch's error.

    Args:
        exc: the error of torch's rendezvous.
        store: returns the store to read the mark from.
        signer: the job's control-key signer.
        run_id: the rendezvous run id.
        log: a structlog logger.

    Returns:
        True when the rendezvous is closed and the job is marked complete.

    Raises:
        SignalException: torch's, when the agent is signalled during the read (never swallowed).
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    if not isinstance(exc, RendezvousClosedError):
        return False
    try:
        mark = read_mark(store(), signer, run_id, log)
    except Exception as err:  # reported; the caller re-raises torch's error
        reraise_signal(err)  # torchrun's SIGTERM (SignalException) is no store error
        log.warning("job_complete_unreadable", error=repr(err)[:300])
        return False
    if mark is not None:
        log.info(
            "job_finished_before_join", mark=mark, outcome="exit 0: the job finished before this node could join it"
        )
    return mark is not None


class CompletingStore(ForwardingStore):
    """``resize=restart``: torch's own exit barrier (the round's members are the members of the
    end), with ``mark()`` called at this agent's arrival, before the count.

    Args:
        inner: the store the agent got from the rendezvous.
        mark: writes the job-complete mark.
    """

    def __init__(self, inner, mark: Callable[[], None]) -> None:
        super().__init__(inner)
        self._mark = mark

    def add(self, key, value):
        """``inner.add``; an arrival at the exit barrier first calls ``mark()``.

        Args:
            key: the store key.
            value: the amount to add.

        Returns:
            The counter's new value.
        """
        if key == NUM_MEMBERS and value == 1:
            self._mark()
        return self._inner.add(key, value)


class CompletingExitBarrierStore(ExitBarrierStore):
    """The exit barrier's store (``rdzv/exit_barrier.py``) that also calls ``mark()`` at this
    agent's arrival, before the count (torch enters the barrier only when every local worker
    succeeded).

    Args:
        inner: the store the agent got from the rendezvous.
        node: this agent's node id.
        members: returns the node ids that are members now.
        mark: writes the job-complete mark.
    """

    def __init__(self, inner, node: str, members: Callable[[], tuple[str, ...]], mark: Callable[[], None]) -> None:
        super().__init__(inner, node, members)
        self._mark = mark

    def add(self, key, value):
        """The exit barrier's ``add``; an arrival first calls ``mark()``.

        Args:
            key: the store key.
            value: the amount to add.

        Returns:
            The counter's new value.
        """
        if key == NUM_MEMBERS and value == 1:
            self._mark()
        return super().add(key, value)
