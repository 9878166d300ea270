"""What a rendezvous state means for one worker: the membership events and their classification.

:func:`classify` is a pure function of plain data: it compares a
:class:`~elastic_emb.rdzv.decode.RendezvousView` with what the worker knows of its round and
returns the :class:`Change` records it implies (``join_pending``, ``departure``,
``round_advanced``, ``evicted``). :class:`MembershipEvent` is the record the watcher hands the
lifecycle; :data:`EXPLAINING` are the kinds that explain a failed collective.

Design: ``docs/LIFECYCLE.md`` (section "Membership events").
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
    """One membership change a worker's watcher saw: its kind, the nodes concerned, and when.

    Kinds: ``join_pending``, ``departure``, ``round_advanced`` and ``evicted`` come from a state;
    ``agent_lost`` (the worker's agent vanished) and ``drain_requested`` from the watcher itself.
    """

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
    """The ``members`` absent from ``view``'s participants.

    Args:
        members: the nodes of the worker's generation.
        view: a rendezvous state.

    Returns:
        The absent members, in their order.
    """
    present = set(view.nodes)
    return tuple(n for n in members if n not in present)


def classify(view: RendezvousView, *, round_: int, members: tuple[str, ...], node: str | None) -> list[Change]:
    """The changes a rendezvous state implies for one worker.

    Args:
        view: the state read.
        round_: the worker's round.
        members: the nodes the worker's round started with.
        node: the worker's node; None when not known yet, so that no eviction is inferred.

    Returns:
        The changes, in the order ``join_pending`` (a node waits), ``departure`` (members gone),
        ``round_advanced`` (a later round), ``evicted`` (the worker's node is neither participant
        nor waiting in its round or a later one: a candidate the watcher confirms).
    """
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
