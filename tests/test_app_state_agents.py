"""The dense state survives a join and a SIGKILLed node, in both resize modes, bit for bit.

Real torchrun agents on loopback, each node with a state directory of its own; the workers train
the table and a dense part (``nn.Linear`` + Adam + a step schedule + an ElasticSampler, passed as
``app_state``; tests/helpers/dense_part.py) and commit every step. Nodes a and b start; c joins
with an empty directory (it receives the dense state from a peer); then b's node is SIGKILLed
(agent and worker; a's agent hosts the rendezvous store). At every start and re-form each worker compares its parameters, Adam's moments
and the schedule with a one-process replay of the restored step, bit for bit, and its sampler's
cursor with the cursor the world that committed that step logged."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_emb.testing.ports import free_port
from tests.helpers.agents import JOIN_CONF, Agent, kill_all, start_agent, wait_for, worker_records

pytestmark = pytest.mark.slow

WAIT = 90.0


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


def _node(tmp: str, node: str) -> dict:
    return {
        "ELASTIC_EMB_STATE_DIR": os.path.join(tmp, f"state-{node}"),
        "ELASTIC_EMB_NODE_ID": node,
        "RDZV_TEST_DENSE": "1",
    }


def _committed_by(tmp: str, ws: int, after: float, least: int = 2) -> set[int]:
    """The workers (pids) of a world of ``ws`` that committed ``least`` steps after ``after``."""
    counts: dict[int, int] = {}
    for r in worker_records(tmp):
        if r["ev"] == "commit" and r["ws"] == ws and r["t"] > after:
            counts[r["pid"]] = counts.get(r["pid"], 0) + 1
    return {pid for pid, n in counts.items() if n >= least}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["restart", "in_process"])
def test_dense_state_survives_a_join_and_a_killed_node_bit_for_bit(cluster, mode):
    tmp, agents = cluster
    conf = JOIN_CONF + (",resize=in_process" if mode == "in_process" else "")
    kw = dict(worker="lifecycle", nnodes="1:3", conf=conf, drain_timeout=30.0)
    port = free_port()
    t0 = time.time()
    # a first: its agent hosts the c10d rendezvous store, which must outlive b's node
    agents.append(start_agent("a", tmp, port, extra_env=_node(tmp, "a"), **kw))
    wait_for(lambda: _committed_by(tmp, 1, t0, 1), WAIT, "a to commit alone", agents)
    agents.append(start_agent("b", tmp, port, extra_env=_node(tmp, "b"), **kw))
    wait_for(lambda: len(_committed_by(tmp, 2, t0, 3)) == 2, WAIT, "a and b to commit at world size 2", agents)
    t_join = time.time()
    agents.append(start_agent("c", tmp, port, extra_env=_node(tmp, "c"), **kw))
    wait_for(lambda: len(_committed_by(tmp, 3, t_join)) == 3, WAIT, "a, b and c to commit at world size 3", agents)
    b = agents[1]
    b_workers = {r["pid"] for r in worker_records(tmp) if r["ev"] == "ready" and r["agent_pid"] == b.pid}
    t_kill = b.signal(signal.SIGKILL)
    for pid in b_workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: len(_committed_by(tmp, 2, t_kill)) == 2, WAIT, "a and c to commit at world size 2", agents)
    recs = worker_records(tmp)

    starts = [r for r in recs if r["ev"] in ("ready", "reformed")]
    assert starts and all("dense_ok" in r for r in starts), starts
    bad = [r for r in starts if not (r["dense_ok"] and r["rows_ok"])]
    assert bad == [], f"dense state or rows differ from the replay: {bad}"
    # the joiner's worker started with the dense state of a step it never trained (from a peer)
    c_starts = [r for r in starts if r["t"] > t_join and r["ws"] == 3 and r["resume"] > 0]
    assert c_starts, starts
    # the sampler's cursor moved with the step: at each start, the cursor of the restored step as
    # the world that committed it last logged it
    commits = [r for r in recs if r["ev"] == "commit"]
    for r in starts:
        step = r["resume"] - 1
        if step < 0:
            assert r["cursor"] == 0, r
            continue
        logged = [c["cursor"] for c in commits if c["step"] == step and c["t"] < r["t"]]
        assert logged and r["cursor"] == logged[-1], (r, logged)
    # ... which it received from a peer: its own directory was empty
    with open(os.path.join(tmp, "agent-c.log")) as f:
        sources = [line for line in f if "lifecycle.app_state_restored" in line]
    assert any('"source": "peer"' in line for line in sources), sources
    after_kill = [r for r in starts if r["t"] > t_kill]
    assert after_kill and {r["ws"] for r in after_kill} == {2}, after_kill
    print(f"\n{mode}: {len(starts)} starts and re-forms, every one bit for bit (dense, Adam, schedule, cursor)")
