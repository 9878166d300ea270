"""membership.classify: what one rendezvous state means for a worker (a pure function; the
watcher's store, thread and signed confirmations are tested in test_watch.py)."""

from __future__ import annotations

from elastic_emb.rdzv.decode import RendezvousView
from elastic_emb.watch.membership import EXPLAINING, Change, classify, departed

A, B, C, J = "10.0.0.1_11_0", "10.0.0.2_12_0", "10.0.0.3_13_0", "10.0.0.4_14_0"


def view(round_: int, nodes: tuple[str, ...], wait: tuple[str, ...] = ()) -> RendezvousView:
    return RendezvousView.of_nodes(round_, nodes, wait)


def test_an_unchanged_state_means_nothing():
    assert classify(view(3, (A, B, C)), round_=3, members=(A, B, C), node=A) == []


def test_each_change_of_the_state_is_named():
    assert classify(view(3, (A, B, C), wait=(J,)), round_=3, members=(A, B, C), node=A) == [
        Change("join_pending", (J,), 3)
    ]
    assert classify(view(3, (A, C)), round_=3, members=(A, B, C), node=A) == [Change("departure", (B,), 3)]
    assert classify(view(4, (A, B, C)), round_=3, members=(A, B, C), node=A) == [Change("round_advanced", (), 4)]
    # Our own node left out: a departure of ours and an eviction candidate (the watcher confirms it).
    assert classify(view(3, (B, C)), round_=3, members=(A, B, C), node=A) == [
        Change("departure", (A,), 3),
        Change("evicted", (A,), 3),
    ]


def test_no_eviction_without_a_known_node_nor_from_an_older_round_nor_while_waiting():
    assert classify(view(3, (B, C)), round_=3, members=(A, B, C), node=None) == [Change("departure", (A,), 3)]
    assert classify(view(2, (B, C)), round_=3, members=(), node=A) == []  # a stale state: not ours
    assert classify(view(4, (B, C), wait=(A,)), round_=3, members=(B, C), node=A) == [
        Change("join_pending", (A,), 4),
        Change("round_advanced", (), 4),
    ]


def test_departed_keeps_the_members_order_and_explaining_kinds():
    assert departed((C, A, B), view(3, (B,))) == (C, A)
    assert departed((), view(3, (B,))) == ()
    assert EXPLAINING == {"departure", "round_advanced", "join_pending", "agent_lost", "evicted"}
