"""The end of a job with nodes still joining it (both resize modes).

A node can come after the running world's last step boundary: its agent joins the running round
(or starts) while the world finishes, and its worker, still importing, registers as a joiner that
no world will ever include. That is no failure of the job, and must not look like one: before this
module, the joiner waited its ``drain_timeout``, asked for a fallback, and its agent failed on the
rendezvous that the finished world's agents had closed (torch's ``RendezvousClosedError``).

The protocol, one signed store key (``inproc_root(run_id) + KEY_COMPLETE``):

* **Mark.** torch's agent enters its exit barrier only when every local worker succeeded. The
  barrier's first operation is ``add(".../num_members", 1)``; :class:`CompletingExitBarrierStore`
  writes the mark just before it (:func:`mark_complete`): ``{node, round, generation}``.
* **Read by a joiner's worker** (``InProcessResize.join``): while it waits to be included it also
  looks for the mark (every 0.1 s) and, when it is set, raises
  :class:`~elastic_emb.errors.JobComplete`: the worker exits 0 with one event.
* **Read by an agent** that finds the rendezvous closed (``ElasticEmbRendezvousHandler``): with the
  mark set it exits 0 with one event. torch has a way out for this (``RendezvousGracefulExitError``)
  but its launcher crashes on the ``None`` result that it produces (the agent's ``run`` returns None
  after it; ``launch_agent`` then calls ``result.is_failed()``: read in torch 2.11-2.13),
  so the handler raises ``SystemExit(0)``, which torchrun's ``@record`` turns into exit code 0. A
  rendezvous closed without the mark (the job failed, or was stopped) stays torch's error.

The mark lives as long as torch's closed state under the same run id, which already refuses a
second job of that id. ``resize=restart`` writes and reads the same mark (:class:`CompletingStore`
around torch's own barrier): there a node whose agent comes after the end, or waits to be let in
while the world finishes, finds the closed rendezvous of a finished job and exits 0 too; a node
that comes in time is let in by torch (the running agents see it waiting and restart their
workers into a round with it). Not covered: a store hosted by the first agent (inner c10d without
``is_host=false``) is gone when that agent exits, so a later agent finds no store at all.
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
    return inproc_root(run_id) + KEY_COMPLETE


def mark_complete(store: Any, signer: Signer, run_id: str, **mark: Any) -> None:
    """Write the signed mark (``mark``: who and when, for the readers' events)."""
    key = complete_key(run_id)
    store.set(key, signer.sign(key, json.dumps(mark)))


def read_mark(store: Any, signer: Signer, run_id: str, log: Any = None) -> str | None:
    """The mark (its JSON text), or None when the job is not marked complete (or the value is not
    validly signed: then ``read_signed`` logs ``control_key_rejected``)."""
    value = read_signed(store, signer, complete_key(run_id), log)
    return None if value is None else value.decode("utf-8", "replace")[:200]


def closed_and_complete(exc: BaseException, store: Callable[[], Any], signer: Signer, run_id: str, log: Any) -> bool:
    """Whether ``exc`` is torch's closed rendezvous of a job marked complete (``store()``: the store
    to read the mark from); logs ``job_finished_before_join`` when it is. An unreadable store (gone
    with the agent that hosted it) or no mark: False, torch's error stands."""
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
        log.info("job_finished_before_join", mark=mark, outcome="exit 0: the job finished before this node could join it")
    return mark is not None


class CompletingStore(ForwardingStore):
    """``resize=restart``: torch's own exit barrier (the round's members are the members of the
    end), with ``mark()`` called at this agent's arrival, before the count."""

    def __init__(self, inner, mark: Callable[[], None]) -> None:
        super().__init__(inner)
        self._mark = mark

    def add(self, key, value):
        if key == NUM_MEMBERS and value == 1:
            self._mark()
        return self._inner.add(key, value)


class CompletingExitBarrierStore(ExitBarrierStore):
    """The exit barrier's store (``rdzv/exit_barrier.py``) that also calls ``mark()`` at this
    agent's arrival, before the count (torch enters the barrier only when every local worker
    succeeded)."""

    def __init__(self, inner, node: str, members: Callable[[], tuple[str, ...]], mark: Callable[[], None]) -> None:
        super().__init__(inner, node, members)
        self._mark = mark

    def add(self, key, value):
        if key == NUM_MEMBERS and value == 1:
            self._mark()
        return super().add(key, value)
