"""Two histories of one run id meet: the restore refuses, naming both, and trains neither.

Real torchrun agents on loopback, each node with a state directory of its own. Nodes a and b
commit; the job stops. Node c then starts alone on a fresh rendezvous endpoint (as after a wiped
store: nothing tells it the run has history) with an empty directory, starts from the seed and
commits steps of its own. When a and c meet, every worker's restore sees two lineages and stops
with one line naming both; no step is trained. With c's directory moved aside, a and b go on from
their own newest commit, rows equal to the step-by-step replay."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from elastic_emb.testing.ports import free_port
from tests.helpers.agents import Agent, kill_all, start_agent, wait_for, worker_records

pytestmark = pytest.mark.slow


def _node(tmp: str, node: str) -> dict:
    return {"ELASTIC_EMB_STATE_DIR": os.path.join(tmp, f"state-{node}"), "ELASTIC_EMB_NODE_ID": node}


def _committed(tmp: str, after: float, ranks: set[int], ws: int, least: int) -> bool:
    return {
        r["rank"]
        for r in worker_records(tmp)
        if r["ev"] == "commit" and r["t"] > after and r["ws"] == ws and r["committed"] >= least
    } == ranks


def _stop(agents: list[Agent], tmp: str) -> None:
    kill_all(agents, tmp)
    for a in agents:
        a.proc.wait(timeout=60)
    agents.clear()


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


@pytest.mark.timeout(500)
def test_two_histories_of_one_run_are_refused_naming_both(cluster):
    tmp, agents = cluster
    kw = dict(worker="lifecycle", nnodes="1:3")
    # history 1: nodes a and b
    port, t0 = free_port(), time.time()
    agents += [start_agent(n, tmp, port, extra_env=_node(tmp, n), **kw) for n in ("a", "b")]
    wait_for(lambda: _committed(tmp, t0, {0, 1}, 2, 3), 120.0, "history 1 committed at world size 2", agents)
    _stop(agents, tmp)
    # history 2: node c alone on a fresh endpoint, from the seed
    port, t1 = free_port(), time.time()
    agents.append(start_agent("c", tmp, port, extra_env=_node(tmp, "c"), **kw))
    wait_for(lambda: _committed(tmp, t1, {0}, 1, 3), 120.0, "history 2 committed at world size 1", agents)
    fresh = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > t1]
    assert fresh and fresh[0]["resume"] == 0, fresh  # c saw no history: it started from the seed
    _stop(agents, tmp)
    # the two meet: every worker refuses, naming both histories, and no step is trained
    port, t2 = free_port(), time.time()
    kw2 = dict(kw, nnodes="2:3")
    agents += [start_agent(n + "2", tmp, port, extra_env=_node(tmp, n), **kw2) for n in ("a", "c")]
    wait_for(lambda: all(a.proc.poll() is not None for a in agents), 240.0, "both agents to give up", agents)
    for a in agents:
        out = a.output()
        lines = [line for line in out.splitlines() if "holds two histories" in line]
        assert lines, out[-3000:]
        found = re.search(
            r"step (\d+) \(generation \d+, lineage ([0-9a-f]{8}), on ([^)]+)\) and step (\d+) \(generation \d+, lineage ([0-9a-f]{8}), on ([^)]+)\)",
            lines[0],
        )
        assert found, lines[0]
        assert found.group(2) != found.group(5) and {found.group(3), found.group(6)} == {"a", "c"}, lines[0]
    assert not [r for r in worker_records(tmp) if r["t"] > t2 and r["ev"] in ("ready", "commit")]
    agents.clear()
    # c's directory moved aside: a and b go on from history 1, rows bit for bit
    shutil.move(os.path.join(tmp, "state-c"), os.path.join(tmp, "state-c.aside"))
    port, t3 = free_port(), time.time()
    agents += [start_agent(n + "3", tmp, port, extra_env=_node(tmp, n), **kw) for n in ("a", "b")]
    wait_for(lambda: _committed(tmp, t3, {0, 1}, 2, 0), 120.0, "history 1 going on", agents)
    ready = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > t3]
    assert ready and all(r["rows_ok"] and r["resume"] > 3 for r in ready), ready
