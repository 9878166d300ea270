"""The drain's count: the round's ``world_size`` key, which the watchers write (how many
acknowledgements a drain needs), is untrusted store input like every key. Deleted, it read as
"no watchers", so the preStop drain returned at once and the pod stopped before any commit.
Real watchers on a real TCPStore (127.0.0.1), the real preStop client (``drain.request_drain``):
rank 0's watcher writes a deleted count back and the drain then waits for every rank's
acknowledgement; after an in-process re-form (the same round, a new world size) it writes the new
count; with no watcher at all the drain still answers "no watchers", after its grace."""

from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_emb.cli.drain import DrainTarget, request_drain
from elastic_emb.rdzv.drain_acks import NO_WATCHERS_GRACE
from elastic_emb.rdzv.keys import KEY_DRAIN, KEY_WORLD_SIZE, round_prefix
from elastic_emb.rdzv.reader import RendezvousReader
from elastic_emb.testing.ports import free_port
from elastic_emb.watch.watcher import Watcher

RUN, ROUND = "dctest", 3
WAIT = 30.0  # bound of every wait here: generous, for a loaded 2-core machine
NODES = (_NodeDesc("127.0.0.1", 201, 0), _NodeDesc("127.0.0.1", 202, 0))


@pytest.fixture
def running_round(monkeypatch):
    """A TCPStore holding torch's state of a complete round of two nodes (one rank each)."""
    monkeypatch.delenv("ELASTIC_EMB_JOB_SECRET", raising=False)
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    state = _RendezvousState()
    state.round, state.complete = ROUND, True
    for rank, node in enumerate(NODES):
        state.participants[node] = rank
        state.last_heartbeats[node] = datetime.now(timezone.utc)
    result = C10dRendezvousBackend(master, RUN).set_state(pickle.dumps(state), None)
    assert result is not None and result[2]
    yield port, master, DrainTarget(inner="c10d", endpoint=f"127.0.0.1:{port}", run_id=RUN)


def _start_watchers(port: int) -> list:
    """One running watcher per node of the round, ranks in NODES order (world size 2)."""
    return [
        Watcher(
            RendezvousReader("c10d", f"127.0.0.1:{port}", RUN),
            round_=ROUND,
            rank=rank,
            world_size=2,
            node=f"{n.addr}_{n.pid}_{n.local_id}",
            agent_pid=os.getppid(),
            interval=0.02,
        ).start()
        for rank, n in enumerate(NODES)
    ]


def test_a_deleted_drain_count_is_written_back_and_the_drain_waits_for_every_rank(running_round):
    port, master, target = running_round
    prefix = round_prefix(RUN, ROUND)
    watchers = _start_watchers(port)
    try:
        assert master.get(prefix + KEY_WORLD_SIZE) == b"2"
        master.delete_key(prefix + KEY_WORLD_SIZE)  # a store writer deletes the count
        result: dict = {}
        client = threading.Thread(
            target=lambda: result.update(outcome=request_drain(target, timeout=WAIT, poll=0.02)), daemon=True
        )
        t0 = time.monotonic()
        client.start()
        # Both ranks step as a training loop does, each asking after its step whether to stop.
        acked: set[int] = set()
        step = 0
        while len(acked) < 2 and time.monotonic() - t0 < WAIT:
            step += 1
            for rank, w in enumerate(watchers):
                if rank not in acked and w.drain_requested(step):
                    w.ack_drain(step)
                    acked.add(rank)
            time.sleep(0.02)
        client.join(WAIT)
        assert not client.is_alive(), f"the drain did not return within {WAIT} s"
        outcome = result["outcome"]
        # Without the written-back count the drain answered "no_watchers" at once, asking nothing.
        assert outcome.outcome == "acknowledged" and (outcome.acks, outcome.expected) == (2, 2), outcome
        assert acked == {0, 1} and outcome.stop_step == watchers[0].stop_step == watchers[1].stop_step
        assert master.get(prefix + KEY_WORLD_SIZE) == b"2" and master.check([prefix + KEY_DRAIN])
    finally:
        for w in watchers:
            w.stop()


def test_after_an_in_process_re_form_the_drain_counts_the_new_world(running_round):
    """The round stays when the world re-forms in process (resize.py), so the count of the first
    world stayed too: a drain after 2 -> 1 waited for a rank that was gone and timed out."""
    port, master, target = running_round
    prefix = round_prefix(RUN, ROUND)
    watchers = _start_watchers(port)
    try:
        assert master.get(prefix + KEY_WORLD_SIZE) == b"2"
        watchers[1].stop()  # its node left; the survivor re-forms alone, as rank 0 of one
        watchers[0].adopt((watchers[0].node,), 0, 1)
        deadline = time.monotonic() + WAIT
        while master.get(prefix + KEY_WORLD_SIZE) != b"1" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert master.get(prefix + KEY_WORLD_SIZE) == b"1", "rank 0 did not write the new world's count"
        result: dict = {}
        client = threading.Thread(
            target=lambda: result.update(outcome=request_drain(target, timeout=WAIT, poll=0.02)), daemon=True
        )
        client.start()
        step = 0
        while not watchers[0].drain_requested(step) and step < 10_000:
            step += 1
            time.sleep(0.01)
        watchers[0].ack_drain(step)
        client.join(WAIT)
        assert not client.is_alive(), f"the drain did not return within {WAIT} s"
        outcome = result["outcome"]
        assert outcome.outcome == "acknowledged" and (outcome.acks, outcome.expected) == (1, 1), outcome
    finally:
        for w in watchers:
            w.stop()


@pytest.mark.slow
def test_without_watchers_the_drain_answers_no_watchers_after_its_grace(running_round):
    _, master, target = running_round
    t0 = time.monotonic()
    outcome = request_drain(target, timeout=WAIT, poll=0.05)
    elapsed = time.monotonic() - t0
    assert outcome.outcome == "no_watchers" and outcome.round == ROUND, outcome
    assert NO_WATCHERS_GRACE <= elapsed < NO_WATCHERS_GRACE + WAIT, elapsed
    assert not master.check([round_prefix(RUN, ROUND) + KEY_DRAIN])  # nothing was asked of anyone
