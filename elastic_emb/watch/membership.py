"""What a rendezvous state means for one worker: the membership events and their classification.

The worker's :class:`~elastic_emb.watch.watcher.Watcher` reads torch's rendezvous state over and over
(a thread, a store, outages, signed marks); what it concludes from one state is decided here,
as a pure function of plain data, so the rules can be read and tested without a store or a
thread. :func:`classify` compares a :class:`~elastic_emb.rdzv.decode.RendezvousView` with
what the worker knows of its own round (the round, the members it started with, its node) and
returns the :class:`Change` records it implies:

- ``join_pending``: a node waits in the wait list (a scale-up restart is coming);
- ``departure``: a member of the worker's round is gone from the state (heartbeat expired, or it
  left);
- ``round_advanced``: the rendezvous moved past the worker's round;
- ``evicted``: the worker's own node is outside the membership (neither participant nor
  waiting) in its round or a later one. This is a *candidate*: the watcher believes it only when
  the job has no secret, or an agent confirmed it with a signed eviction mark.

Two kinds do not come from a state and are made by the watcher itself: ``agent_lost`` (the
worker's agent process vanished) and ``drain_requested``. :class:`MembershipEvent` is the
immutable record the watcher hands the lifecycle for each of them; :data:`EXPLAINING` are the
kinds that explain a failed collective (the agent is about to restart the workers).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from elastic_emb.rdzv.decode import RendezvousView

EventKind = Literal["join_pending", "departure", "round_advanced", "agent_lost", "evicted", "drain_requested"]

# A failed collective is explained by any of these: the agent restarts the workers next.
EXPLAINING: frozenset[str] = frozenset({"departure", "round_advanced", "join_pending", "agent_lost", "evicted"})

__all__ = ["EXPLAINING", "Change", "EventKind", "MembershipEvent", "classify", "departed"]


class MembershipEvent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: EventKind
    round: int  # the worker's round (generation)
    state_round: int | None = None
    nodes: tuple[str, ...] = ()
    participants: tuple[str, ...] = ()
    at: float  # time.time()


class Change(NamedTuple):
    """One change a state implies (the watcher turns each into at most one event)."""

    kind: EventKind
    nodes: tuple[str, ...]
    state_round: int | None


def departed(members: tuple[str, ...], view: RendezvousView) -> tuple[str, ...]:
    """The ``members`` absent from ``view``'s participants, in their order."""
    present = set(view.nodes)
    return tuple(n for n in members if n not in present)


def classify(view: RendezvousView, *, round_: int, members: tuple[str, ...], node: str | None) -> list[Change]:
    """The changes ``view`` implies for a worker of round ``round_`` that started with ``members``
    and runs on ``node`` (None: not known yet, so no eviction can be inferred)."""
    found: list[Change] = []
    if view.wait_list:
        found.append(Change("join_pending", view.wait_list, view.round))
    gone = departed(members, view)
    if gone:
        found.append(Change("departure", gone, view.round))
    if view.round > round_:
        found.append(Change("round_advanced", (), view.round))
    if node is not None and view.round >= round_ and node not in view.nodes and node not in view.wait_list:
        found.append(Change("evicted", (node,), view.round))
    return found
