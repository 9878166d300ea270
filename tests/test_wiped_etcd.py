"""A wiped etcd does not trade the job's committed history for a branch from the seed.

Real torchrun agents on ``inner=etcd-v3`` against a real etcd on loopback, the lifecycle worker
(rows checked bit for bit against the step-by-step replay at every start), each node with a state
directory of its own. Node a trains alone, node b joins (round 1), both commit at world size 2.
Then etcd is SIGKILLed, its data directory deleted, and a fresh etcd started on the same client
port: the rendezvous state, its lease and every round key are gone. The agents do not exit: they
find the state gone (``rendezvous_state_lost``), re-form at a round never used before, and the
workers restore the job's own newest commit (never the seed), same lineage, rows bit for bit.
A node c started afterwards with an empty directory joins that history. Both resize modes: with
``resize=in_process`` the workers' own store is in etcd too (their commits stall while it is
down), and a and b form generation 1 in process before the wipe.

The unit test below it drives :class:`~elastic_emb.rdzv.guarded.GuardedBackend` with an
in-memory backend that loses its state.
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta

import pytest

from elastic_emb.rdzv import torch_compat
from elastic_emb.rdzv.decode import RendezvousView, load_state
from elastic_emb.rdzv.guarded import GuardedBackend
from elastic_emb.rdzv.outage import OutageGuard
from elastic_emb.state.snapshot import SnapshotTier
from tests.helpers.agents import FAST_CONF, Agent, events, kill_all, start_agent, wait_for, worker_records
from tests.helpers.etcd_fixture import etcd_server  # noqa: F401  (the fixture)

RUN_ID = "rdzvtest"  # start_agent's default run id
WAIT = 120.0  # generous for a loaded 2-core machine; each wait ends as soon as its condition holds


def _node(tmp: str, node: str) -> dict:
    return {"ELASTIC_EMB_STATE_DIR": os.path.join(tmp, f"state-{node}"), "ELASTIC_EMB_NODE_ID": node}


def _records(tmp: str, ev: str, after: float) -> list[dict]:
    return [r for r in worker_records(tmp) if r["ev"] == ev and r["t"] > after]


def _committed_by(tmp: str, after: float, ws: int, least: int) -> set[int]:
    return {r["rank"] for r in _records(tmp, "commit", after) if r["ws"] == ws and r["committed"] >= least}


def _lineages(tmp: str, nodes: str) -> set[str | None]:
    return {m.lineage for n in nodes for _, m in SnapshotTier(os.path.join(tmp, f"state-{n}"), RUN_ID, n).manifests()}


def _rounds(tmp: str, nodes: str) -> list[dict]:
    return [e for n in nodes for e in events(tmp, n) if e["event"] == "rendezvous_round"]


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("resize", ["restart", "in_process"])
def test_a_wiped_etcd_keeps_the_running_jobs_history(etcd_server, cluster, resize):  # noqa: F811
    tmp, agents = cluster
    kw = dict(worker="lifecycle", nnodes="1:3", inner="etcd-v3", endpoint=etcd_server.endpoint)
    if resize == "in_process":
        kw["conf"] = FAST_CONF + ",resize=in_process"
    t0 = time.time()
    agents.append(start_agent("a", tmp, 0, extra_env=_node(tmp, "a"), **kw))
    wait_for(lambda: _committed_by(tmp, t0, 1, 2), WAIT, "a committed alone", agents)
    agents.append(start_agent("b", tmp, 0, extra_env=_node(tmp, "b"), **kw))
    wait_for(lambda: _committed_by(tmp, t0, 2, 3) == {0, 1}, WAIT, "a and b committed at world size 2", agents)

    # the wipe: etcd SIGKILLed, its data directory deleted, a fresh etcd on the same client port
    etcd_server.kill()
    before = max(r["committed"] for r in _records(tmp, "commit", t0))  # every rank's newest complete commit
    lineage = _lineages(tmp, "ab")
    last_round = max(e["round"] for e in _rounds(tmp, "ab"))
    last_gen = max(r["gen"] for r in worker_records(tmp) if r["ev"] in ("ready", "reformed"))
    assert len(lineage) == 1 and None not in lineage and last_gen >= 1, (lineage, last_gen)
    shutil.rmtree(etcd_server.data_dir / "member")
    endpoint = etcd_server.endpoint
    etcd_server.start()
    assert etcd_server.endpoint == endpoint
    t1 = time.time()

    # the job re-forms at world size 2 from its own history: no agent ends, nothing from the seed
    # (the workers started before the wipe train on meanwhile: their collectives do not go through etcd)
    wait_for(
        lambda: {r["rank"] for r in _records(tmp, "ready", t1) if r["ws"] == 2} == {0, 1},
        WAIT,
        "a and b re-formed at world size 2 after the wipe",
        agents,
    )
    t_ready = max(r["t"] for r in _records(tmp, "ready", t1))
    wait_for(lambda: _committed_by(tmp, t_ready, 2, 0) == {0, 1}, WAIT, "a and b training after the wipe", agents)
    assert all(a.proc.poll() is None for a in agents), [(a.name, a.proc.poll()) for a in agents]
    # every start after the wipe restored a commit at least as new as the newest one before it
    for r in _records(tmp, "ready", t1):
        assert r["resume"] > before and r["rows_ok"], (before, r)
        # restart mode: the generation is the round, which never goes back. resize=in_process: the
        # generation is the round plus the in-process high-water mark, which was kept in etcd and
        # is lost with it, so a generation number may be reused (docs/OPERATIONS.md, etcd)
        assert r["gen"] > last_gen or resize == "in_process", (last_gen, r)
    lost = [e for n in "ab" for e in events(tmp, n) if e["event"] == "rendezvous_state_lost"]
    assert lost and all(e["last_round"] >= last_round for e in lost), lost
    # round numbers (and the generations of restart mode, the round itself) never go back
    for n in "ab":
        rounds = [e["round"] for e in _rounds(tmp, n)]
        assert rounds == sorted(rounds) and rounds[-1] > last_round, (n, last_round, rounds)
    assert _lineages(tmp, "ab") == lineage

    # a node started after the wipe with an empty directory joins the history, from its newest commit
    t2 = time.time()
    agents.append(start_agent("c", tmp, 0, extra_env=_node(tmp, "c"), **kw))
    newest = max(r["committed"] for r in _records(tmp, "commit", t1))
    wait_for(lambda: _committed_by(tmp, t2, 3, newest + 1) == {0, 1, 2}, WAIT, "a, b and c training", agents)
    # restart mode: every worker starts again; in_process: c joins in process, a and b re-form
    ready = _records(tmp, "ready", t2) + _records(tmp, "reformed", t2)
    assert ready and all(r["resume"] > newest and r["rows_ok"] and r["ws"] == 3 for r in ready), (newest, ready)
    assert all(a.proc.poll() is None for a in agents), [(a.name, a.proc.poll()) for a in agents]
    assert _lineages(tmp, "abc") == lineage


# -- GuardedBackend with a backend that loses its state ------------------------------------------


class _Memory:
    """torch's ``RendezvousBackend`` semantics in memory (tokens count the writes); ``wipe()``."""

    name = "memory"

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.token = 0

    def get_state(self):
        return None if self.value is None else (self.value, self.token)

    def set_state(self, state: bytes, token=None):
        if (self.value is None and token is None) or (self.value is not None and token == self.token):
            self.value, self.token = state, self.token + 1
            return state, self.token, True
        return None if self.value is None else (self.value, self.token, False)

    def wipe(self) -> None:
        self.value = None


class _Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.records.append((event, kw))

    error = info = warning


def _round_of(bits: bytes) -> int:
    return RendezvousView.of(load_state(bits)).round


def test_a_state_the_store_lost_comes_back_as_the_round_after_the_newest_seen():
    inner, log = _Memory(), _Log()
    backend = GuardedBackend(inner, OutageGuard("test", 5.0, log), timedelta(seconds=10), key="k", log=log)
    assert backend.get_state() is None  # a new job: no state, none seen
    _, token, has_set = backend.set_state(torch_compat.fresh_state(4), None)
    assert has_set and _round_of(backend.get_state()[0]) == 4
    inner.wipe()
    for _ in range(3):  # polled until someone writes: the same stand-in, one warning
        bits, token = backend.get_state()
        assert _round_of(bits) == 5 and token is None
    assert [e for e, _ in log.records] == ["rendezvous_state_lost"] and backend.lost == 1
    assert log.records[0][1]["last_round"] == 4 and log.records[0][1]["replaced_by_round"] == 5
    assert backend.set_state(bits, None)[2]  # the next write creates it (a create, not a compare)
    # a node that never saw the history created round 0 since: read as the round after the newest seen,
    # with the stored value's token, so the next honest write replaces it
    inner.wipe()
    newcomer = GuardedBackend(inner, OutageGuard("test", 5.0, log), timedelta(seconds=10), key="k", log=log)
    assert newcomer.get_state() is None
    newcomer.set_state(torch_compat.fresh_state(0), None)
    bits, token = backend.get_state()
    assert _round_of(bits) == 6 and token == inner.token and backend.lost == 2
    assert "round 0" in log.records[-1][1]["found"]
    assert backend.set_state(bits, token)[2] and _round_of(newcomer.get_state()[0]) == 6
    # a stale write to a store that lost the state answers the stand-in too, not torch's round 0
    inner.wipe()
    bits, token, has_set = backend.set_state(bits, token)
    assert not has_set and token is None and _round_of(bits) == 7
