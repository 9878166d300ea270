"""The elastic_emb rendezvous backend with real torchrun agents on loopback and real signals.

Each scenario starts stock ``torchrun --rdzv-backend=elastic_emb`` agents (one gloo worker each,
tests/helpers/rdzv_worker.py), changes the membership by starting agents and by SIGTERM / SIGKILL of
an agent, and checks what the workers did (their per-step logs) and what the agents reported
(their event files). Timings are printed for the record, never asserted (bench/resize.py
measures them); the bounds here only keep a hang from passing.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from elastic_emb.testing.ports import free_port
from tests.helpers.agents import (
    JOIN_CONF,
    Agent,
    events,
    first_commit_at,
    kill_all,
    start_agent,
    wait_for,
    worker_records,
)

WAIT = 120.0  # generous: a torchrun start took over 60 s at load 20 on the 2-core machine (a bound, not a cost)


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


def _node(agent: Agent) -> str:
    return f"127.0.0.1_{agent.pid}_0"


def _gen_of(tmp: str, ws: int, after: float) -> int:
    for r in worker_records(tmp):
        if r["ev"] == "ready" and r["ws"] == ws and r["t"] > after:
            return r["gen"]
    raise AssertionError(f"no generation of world size {ws} started after {after}")


def _ready(tmp: str, gen: int) -> list[dict]:
    return [r for r in worker_records(tmp) if r["ev"] == "ready" and r["gen"] == gen]


def _steps(tmp: str, gen: int, ev: str) -> list[int]:
    return [r["step"] for r in worker_records(tmp) if r["ev"] == ev and r["gen"] == gen]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _grow(tmp, agents, name, ws, **kw) -> tuple[float, int]:
    t = time.time()
    agents.append(start_agent(name, tmp, agents[0].port, **{"worker": "lifecycle", **kw}))
    wait_for(lambda: first_commit_at(tmp, world_size=ws, after=t), WAIT, f"world size {ws} after {name} joined", agents)
    return t, _gen_of(tmp, ws, t)


def _check_drained(tmp: str, old_gen: int, new_gen: int) -> None:
    """Zero steps lost: the last step any worker started in the old generation was committed by
    every rank of it, and the new generation resumed right after it."""
    started = _steps(tmp, old_gen, "start")
    committed = _steps(tmp, old_gen, "commit")
    ranks = {r["rank"] for r in _ready(tmp, old_gen)}
    last = max(started)
    assert max(committed) == last, f"gen {old_gen}: last started step {last}, last committed {max(committed)}"
    assert sorted(r for r in ranks) == sorted(
        r["rank"] for r in worker_records(tmp) if r["ev"] == "commit" and r["gen"] == old_gen and r["step"] == last
    ), f"gen {old_gen}: not every rank committed step {last}"
    drained = [r for r in worker_records(tmp) if r["ev"] == "drained" and r["gen"] == old_gen]
    assert sorted(r["rank"] for r in drained) == sorted(ranks) and {r["step"] for r in drained} == {last}
    resumed = {r["resume"] for r in _ready(tmp, new_gen)}
    assert resumed == {last + 1}, f"gen {new_gen} resumed at {resumed}, expected {last + 1}"


def _t(event: dict) -> float:
    """An agent event's time (its ISO timestamp) in seconds since the epoch, as ``time.time()``."""
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _rounds(tmp: str, name: str, after: float = 0.0, before: float = float("inf")) -> list[dict]:
    """Agent ``name``'s ``rendezvous_round`` events logged between ``after`` and ``before``."""
    return [e for e in events(tmp, name) if e["event"] == "rendezvous_round" and after < _t(e) < before]


def _check_grown(tmp: str, old_gen: int, new_gen: int) -> None:
    """A scale-up from ``old_gen`` to ``new_gen``, the first generation of the larger world: every
    generation between them (a round that completed before a late node came) was drained too."""
    gens = sorted({r["gen"] for r in worker_records(tmp) if r["ev"] == "ready" and old_gen <= r["gen"] <= new_gen})
    assert gens[0] == old_gen and gens[-1] == new_gen, (old_gen, new_gen, gens)
    for g0, g1 in zip(gens, gens[1:]):
        _check_drained(tmp, g0, g1)


def _check_membership_restart(tmp: str, gen: int, ws: int) -> None:
    ready = _ready(tmp, gen)
    assert len(ready) == ws and sorted(r["rank"] for r in ready) == list(range(ws))
    # Every row of the table came back, bit-exact (each worker checked its restored shard
    # against a step-by-step replay of every step, and the shards tile the table).
    assert all(r["rows_ok"] for r in ready), ready
    spans = sorted(tuple(r["rows"]) for r in ready if r["rows"][1] > r["rows"][0])
    assert spans[0][0] == 0 and spans[-1][1] == 64 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    # A membership change is not a failure: torch's restart budget is untouched.
    assert {r["restart_count"] for r in ready} == {0}, ready


@pytest.mark.slow
def test_busy_scale_up_with_drain_then_sigterm_and_sigkill(cluster):
    tmp, agents = cluster
    port = free_port()
    # drain_timeout: a round that completes without a late node is drained too; once its new
    # workers' watchers are up, the drain waits for their first step (seconds at load); the usual
    # drain ends within a step.
    kw = dict(conf=JOIN_CONF, drain_timeout=60.0)
    agents.append(start_agent("a", tmp, port, worker="lifecycle", **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    gen1 = _gen_of(tmp, 1, 0)

    t_b, gen2 = _grow(tmp, agents, "b", 2, **kw)
    _check_grown(tmp, gen1, gen2)
    _check_membership_restart(tmp, gen2, 2)
    t_c, gen3 = _grow(tmp, agents, "c", 3, **kw)
    _check_grown(tmp, gen2, gen3)
    _check_membership_restart(tmp, gen3, 3)
    b, c = agents[1], agents[2]

    # Scale-down by SIGTERM while the workers run collectives.
    time.sleep(0.5)
    t_term = c.signal(signal.SIGTERM)
    t_first = wait_for(
        lambda: first_commit_at(tmp, world_size=2, after=t_term), WAIT, "world size 2 after SIGTERM", agents
    )
    gen4 = _gen_of(tmp, 2, t_term)
    _check_membership_restart(tmp, gen4, 2)
    print(f"\nSIGTERM (busy): fault to first step {t_first - t_term:.2f} s")

    # Scale-down by SIGKILL: b's worker is orphaned and must stop itself.
    time.sleep(0.5)
    orphan = next(r["pid"] for r in _ready(tmp, gen4) if r["agent_pid"] == b.pid)
    t_kill = b.signal(signal.SIGKILL)
    t_orphan = wait_for(lambda: (not _alive(orphan)) and time.time(), WAIT, "the orphan to stop", agents, pause=0.02)
    t_first = wait_for(
        lambda: first_commit_at(tmp, world_size=1, after=t_kill), WAIT, "world size 1 after SIGKILL", agents
    )
    gen5 = _gen_of(tmp, 1, t_kill)
    _check_membership_restart(tmp, gen5, 1)
    print(
        f"SIGKILL (busy): orphan stopped after {t_orphan - t_kill:.2f} s, fault to first step {t_first - t_kill:.2f} s"
    )
    # The orphan never committed after its node left: every commit of gen4 precedes the
    # survivors' first step of gen5, and no record of the orphan follows its eviction.
    orphan_recs = [r for r in worker_records(tmp) if r["pid"] == orphan]
    assert orphan_recs[-1]["t"] < t_first

    # Steps: each generation resumed after the highest step committed before it; nothing repeats.
    # A worker logs a commit only after lc.commit() returned, so a SIGTERM between the two leaves
    # a committed step unlogged: the log bounds the last commit from below, the last started step
    # from above. The restored rows themselves are checked bit for bit at every start (rows_ok).
    # (complete: the record's ``committed``, the newest complete commit; with asynchronous commits
    # the step just logged may still be in flight, and a SIGKILL loses it.)
    per_gen, started, complete = {}, {}, {}
    for r in worker_records(tmp):
        if r["ev"] == "commit" and r["rank"] == 0:
            per_gen.setdefault(r["gen"], []).append(r["step"])
            complete.setdefault(r["gen"], []).append(r.get("committed", r["step"]))
        if r["ev"] == "start" and r["rank"] == 0:
            started.setdefault(r["gen"], []).append(r["step"])
    gens = sorted(per_gen)
    for g0, g1 in zip(gens, gens[1:]):
        resume = min(per_gen[g1])
        assert max(complete[g0]) + 1 <= resume <= max(started[g0]) + 1, (
            g0,
            g1,
            per_gen[g0][-3:],
            started[g0][-3:],
            per_gen[g1][:3],
        )
        assert per_gen[g1] == list(range(resume, max(per_gen[g1]) + 1))
    assert all(r["rows_ok"] for r in worker_records(tmp) if r["ev"] == "ready")

    # The rounds, phase by phase. Every member agent logs a round; a round that a late node missed
    # may lack any one of them, even a (its agent starved between leaving the old round and joining
    # the new one), so the rounds are read from every agent, by number. Membership only: joins,
    # departures and deaths are each agent's own view (against its previous round).
    a = agents[0]
    A, B, C = _node(a), _node(b), _node(c)
    by_round = {e["round"]: e for name in ("c", "b", "a") for e in _rounds(tmp, name)}
    rounds = [by_round[k] for k in sorted(by_round)]
    assert all(len(e["participants"]) == e["world_size"] and e["duration_s"] >= 0 for e in rounds), rounds
    # the rounds are the workers' generations; a round that a late node's drain ended before its
    # workers started (their watchers not up yet: the drain finds no watchers) has no worker records
    ready = sorted({r["gen"] for r in worker_records(tmp) if r["ev"] == "ready"})
    assert set(ready) <= set(by_round), (ready, rounds)

    def phase(after: float, before: float = float("inf")) -> list[set[str]]:
        return [set(e["participants"]) for e in rounds if after < _t(e) < before]

    # Each phase ends with its world; a round before that (a late node) is part of it. b's death
    # leaves a alone: one round.
    phases = [(0.0, t_b, {A}), (t_b, t_c, {A, B}), (t_c, t_term, {A, B, C}), (t_term, t_kill, {A, B})]
    for after, before, world in phases:
        got = phase(after, before)
        assert got and got[-1] == world and all(p < world for p in got[:-1]), (world, got)
    assert phase(t_kill) == [{A}], phase(t_kill)
    assert sum(len(phase(a0, b0)) for a0, b0, _ in phases) + 1 == len(rounds), rounds
    # what a saw: b and c joined, c left (a departure, no death), b died (a death, no departure)
    a_rounds = _rounds(tmp, "a")
    assert B in next(e for e in a_rounds if B in e["participants"])["joins"], a_rounds
    assert C in next(e for e in a_rounds if C in e["participants"])["joins"], a_rounds
    left = _rounds(tmp, "a", t_term, t_kill)[0]
    assert C in left["departures"] and left["deaths"] == [], left
    died = _rounds(tmp, "a", t_kill)
    assert [(e["deaths"], e["departures"]) for e in died] == [([B], [])], died
    # Every round that a scale-up ended was drained once, acknowledged by every running worker
    # (each round's own world size); c's departure and b's death end theirs without a drain. Every
    # member agent waits for the acks; the first to count them all closes the round, so the other
    # members may never report their own drain_finished (agent b beat a in one run): read every
    # agent's events.
    first_after = [next(e["round"] for e in rounds if _t(e) > t) for t in (t_term, t_kill)]
    scaled_up = [e0 for e0, e1 in zip(rounds, rounds[1:]) if e1["round"] not in first_after]
    drains: dict[int, list[dict]] = {}
    for name in ("a", "b", "c"):
        for e in events(tmp, name):
            if e["event"] == "drain_finished":
                drains.setdefault(e["round"], []).append(e)
    assert sorted(drains) == [e["round"] for e in scaled_up], drains
    for e in scaled_up:
        if e["round"] in ready:  # its workers ran: each acknowledged (the world's count)
            want = [("acknowledged", e["world_size"], e["world_size"])] * len(drains[e["round"]])
        else:  # its workers never started stepping: nobody to wait for, nothing to lose
            want = [("no_watchers", 0, 0)] * len(drains[e["round"]])
        assert [(d["outcome"], d["acks"], d["expected"]) for d in drains[e["round"]]] == want, (e, drains)
    # zero steps lost across every scale-up: from each generation whose workers ran to the next one
    for g0, g1 in zip(ready, ready[1:]):
        if not any(g0 < k <= g1 for k in first_after):
            _check_drained(tmp, g0, g1)
    ev = events(tmp, "a")
    changes = [e for e in ev if e["event"] == "membership_changed"]
    # A member may restart first after a drain: a sees it restarting (no departure, no death) before
    # its own drain ends; it is still in the next round (the rounds above).
    restarts = [e for e in changes if e["reason"] == "peer_restarting"]
    drained = {e["round"]: set(e["participants"]) - {A} for e in scaled_up}
    assert all(e["round"] in drained and set(e["restarting"]) <= drained[e["round"]] for e in restarts), restarts
    gone = [(e["departures"], e["deaths"]) for e in changes if e["reason"] != "peer_restarting"]
    assert gone == [([C], []), ([], [B])], changes
    # (b's death is seen by whichever comes first: its orphan's report, event dead_node_evicted, or
    # its heartbeat's expiry; which one depends on timing, so neither is required here.)
    assert any(e["event"] == "node_left" and e["reason"] == "agent_exit" for e in events(tmp, "c"))


@pytest.mark.slow
def test_idle_scale_down_and_drain_timeout(cluster):
    """Idle workers (no collectives in flight): the stock agent would never notice a lost node."""
    tmp, agents = cluster
    port = free_port()
    kw = dict(mode="idle", drain_timeout=1.0, worker="lifecycle")
    a = start_agent("a", tmp, port, **kw)
    agents.append(a)
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    agents.append(start_agent("b", tmp, port, **kw))
    agents.append(start_agent("c", tmp, port, **kw))
    t0 = time.time()
    wait_for(lambda: first_commit_at(tmp, world_size=3, after=0), WAIT, "world size 3", agents)
    b, c = agents[1], agents[2]
    time.sleep(1.0)  # idle: the workers sit outside any collective

    t_term = c.signal(signal.SIGTERM)
    t_first = wait_for(
        lambda: first_commit_at(tmp, world_size=2, after=t_term), WAIT, "world size 2 after SIGTERM", agents
    )
    _check_membership_restart(tmp, _gen_of(tmp, 2, t_term), 2)
    print(f"\nSIGTERM (idle): fault to first step {t_first - t_term:.2f} s")
    time.sleep(1.0)

    gen = _gen_of(tmp, 2, t_term)
    orphan = next(r["pid"] for r in _ready(tmp, gen) if r["agent_pid"] == b.pid)
    t_kill = b.signal(signal.SIGKILL)
    t_orphan = wait_for(lambda: (not _alive(orphan)) and time.time(), WAIT, "the orphan to stop", agents, pause=0.02)
    t_first = wait_for(
        lambda: first_commit_at(tmp, world_size=1, after=t_kill), WAIT, "world size 1 after SIGKILL", agents
    )
    _check_membership_restart(tmp, _gen_of(tmp, 1, t_kill), 1)
    print(
        f"SIGKILL (idle): orphan stopped after {t_orphan - t_kill:.2f} s, fault to first step {t_first - t_kill:.2f} s"
    )

    # A join while the workers idle: nobody commits, so the drain ends by its timeout.
    t_d = time.time()
    agents.append(start_agent("d", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_d), WAIT, "world size 2 after d joined", agents)
    # (d late for the round after that drain: a round of a alone, whose drain finds its worker not
    # yet watching: no_watchers; JOIN_CONF's comment)
    drains = [e for e in events(tmp, "a") if e["event"] == "drain_finished" and _t(e) > t_d]
    assert drains and drains[0]["outcome"] == "timeout" and drains[0]["acks"] == 0 and drains[0]["expected"] == 1
    assert drains[0]["duration_s"] >= 1.0
    assert all(d["outcome"] in ("timeout", "no_watchers") for d in drains), drains
    assert t0 > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server is not installed (Debian package etcd-server)")
def test_etcd_v2_inner_backend_scale_down(cluster):
    pytest.importorskip("etcd", reason="python-etcd is not installed (test extra)")
    from elastic_emb.testing.etcd import EtcdServer

    tmp, agents = cluster
    with EtcdServer(os.path.join(tmp, "etcd")) as server:
        kw = dict(inner="etcd-v2", endpoint=server.endpoint, worker="lifecycle", conf=JOIN_CONF, drain_timeout=60.0)
        a = start_agent("a", tmp, 0, **kw)
        agents.append(a)
        wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1 (etcd-v2)", agents)
        t_b = time.time()
        agents.append(start_agent("b", tmp, 0, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_b), WAIT, "world size 2 (etcd-v2)", agents)
        gen = _gen_of(tmp, 2, t_b)
        b = agents[1]
        orphan = next(r["pid"] for r in _ready(tmp, gen) if r["agent_pid"] == b.pid)
        time.sleep(0.5)
        t_kill = b.signal(signal.SIGKILL)
        wait_for(lambda: not _alive(orphan), WAIT, "the orphan to stop (etcd-v2)", agents, pause=0.02)
        t_first = wait_for(
            lambda: first_commit_at(tmp, world_size=1, after=t_kill), WAIT, "world size 1 (etcd-v2)", agents
        )
        print(f"\nSIGKILL (etcd-v2, busy): fault to first step {t_first - t_kill:.2f} s")
        ev = events(tmp, "a")
        rounds = [e for e in ev if e["event"] == "rendezvous_round"]
        # 1 -> 2 -> 1; b late for the round after the drain adds a round of a alone and a drain (JOIN_CONF)
        sizes = [e["world_size"] for e in rounds]
        assert sizes == [1] * (len(sizes) - 2) + [2, 1] and len(sizes) >= 3, sizes
        assert rounds[-1]["deaths"] == [_node(b)]
        # one drain for each round of a alone that b's join ended (a, its only member, reports it):
        # acknowledged by a's running worker, or none to ask when it ended before that worker started.
        # A round of a alone that ended before b started was not ended by a join (a worker of a that
        # failed at its start, restarted by torch: seen once in CI, cause not kept) and has no drain.
        ready = {r["gen"] for r in worker_records(tmp) if r["ev"] == "ready"}
        drains = [(e["round"], e["outcome"]) for e in ev if e["event"] == "drain_finished"]
        ended_by_join = [e for e, after in zip(rounds[:-2], rounds[1:-1]) if _t(after) > t_b]
        want = [(e["round"], "acknowledged" if e["round"] in ready else "no_watchers") for e in ended_by_join]
        why = (drains, [(e["round"], e["world_size"], e["timestamp"]) for e in rounds], t_b, a.output()[-3000:])
        assert drains == want and drains and drains[0][1] == "acknowledged", why


@pytest.mark.slow
def test_watcher_alone_under_stock_c10d(cluster):
    """No elastic_emb backend: stock c10d agents, the watcher told only the endpoint. It still
    sees the join and the departure, and the SIGKILLed agent's orphan stops itself.

    The join is in the state only from the joiner's wait-list entry to the stock agent's restart
    (0.1 to ~1 s: its monitor interval and 1 s state cache); the worker's watcher polls every 0.1 s
    and the worker logs at step starts, so a stall of a few hundred ms used to lose it (joins ==
    []). The worker now takes one last look at SIGTERM, which torch sends before it touches the
    state (tests/helpers/rdzv_worker.py: look_once_more_on_sigterm), so the join is always seen.
    """
    tmp, agents = cluster
    port = free_port()
    kw = dict(
        backend="c10d",
        conf="keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1",
        extra_env={"ELASTIC_EMB_RDZV_ENDPOINT": f"127.0.0.1:{port}"},
    )
    agents.append(start_agent("a", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1 (stock c10d)", agents)
    t_b = time.time()
    agents.append(start_agent("b", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_b), WAIT, "world size 2 (stock c10d)", agents)
    a, b = agents
    recs = worker_records(tmp)
    first = next(r for r in recs if r["ev"] == "ready" and r["ws"] == 1)
    joins = [r for r in recs if r["ev"] == "membership" and r["pid"] == first["pid"] and r["kind"] == "join_pending"]
    assert joins and joins[0]["nodes"] == [_node(b)], joins
    assert joins[0]["watch_node"] == _node(a)  # found its own node by the agent's pid
    ready2 = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["ws"] == 2]
    survivor = next(r["pid"] for r in ready2 if r["agent_pid"] == a.pid)
    orphan = next(r["pid"] for r in ready2 if r["agent_pid"] == b.pid)
    time.sleep(0.5)
    t_kill = b.signal(signal.SIGKILL)
    wait_for(lambda: not _alive(orphan), WAIT, "the orphan to stop (stock c10d)", agents, pause=0.02)
    t_orphan = time.time()
    departures = wait_for(
        lambda: [
            r
            for r in worker_records(tmp)
            if r["ev"] == "membership" and r["pid"] == survivor and r["kind"] == "departure"
        ],
        WAIT,
        "the survivor's watcher to see the departure",
        agents,
    )
    assert departures[0]["nodes"] == [_node(b)]
    print(
        f"\nstock c10d + watcher: orphan stopped {t_orphan - t_kill:.2f} s after SIGKILL, survivor saw the "
        f"departure after {departures[0]['t'] - t_kill:.2f} s"
    )


@pytest.mark.slow
def test_hung_agent_is_declared_dead_and_its_worker_leaves(cluster):
    """SIGSTOP an agent (hung, not dead: no orphan report). Its heartbeat expires, the survivor
    restarts without it (a death, not a departure), and the hung node's idle worker sees its
    node outside the membership and stops itself."""
    tmp, agents = cluster
    port = free_port()
    agents.append(start_agent("a", tmp, port, mode="idle"))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    t_b = time.time()
    agents.append(start_agent("b", tmp, port, mode="idle"))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_b), WAIT, "world size 2", agents)
    b = agents[1]
    stuck = next(
        r["pid"] for r in worker_records(tmp) if r["ev"] == "ready" and r["ws"] == 2 and r["agent_pid"] == b.pid
    )
    time.sleep(0.5)
    t_stop = b.signal(signal.SIGSTOP)
    try:
        t_first = wait_for(
            lambda: first_commit_at(tmp, world_size=1, after=t_stop), WAIT, "world size 1 after SIGSTOP", agents
        )
        wait_for(lambda: not _alive(stuck), WAIT, "the hung node's worker to stop", agents, pause=0.02)
        t_gone = time.time()
    finally:
        b.signal(signal.SIGCONT)
    print(
        f"\nSIGSTOP (idle): survivor's first step after {t_first - t_stop:.2f} s, hung node's worker gone after "
        f"{t_gone - t_stop:.2f} s"
    )
    mine = [r for r in worker_records(tmp) if r["pid"] == stuck]
    assert any(r["ev"] == "evicted" or (r["ev"] == "membership" and r["kind"] == "evicted") for r in mine), mine[-5:]
    ev = events(tmp, "a")
    changes = [e for e in ev if e["event"] == "membership_changed"]
    assert changes[-1]["deaths"] == [_node(b)] and changes[-1]["departures"] == []
    last_round = [e for e in ev if e["event"] == "rendezvous_round"][-1]
    assert last_round["world_size"] == 1 and last_round["deaths"] == [_node(b)]


def test_entry_point_registers_the_backend_and_conf_errors_name_the_key():
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastic_emb.rdzv.handler import ListenerConfig, create_handler

    assert rendezvous_handler_registry._registry["elastic_emb"] is create_handler
    cfg = ListenerConfig.from_params(
        {"inner": "etcd-v2", "drain": "0", "drain_timeout": "2.5", "timeout": 900, "last_call_timeout": "1"}
    )
    assert (cfg.inner, cfg.drain, cfg.drain_timeout) == ("etcd-v2", False, 2.5)
    with pytest.raises(ValueError, match=r"inner='zk'"):
        ListenerConfig.from_params({"inner": "zk"})
    with pytest.raises(ValueError, match=r"drain='maybe'"):
        ListenerConfig.from_params({"drain": "maybe"})
    with pytest.raises(ValueError, match=r"sync_interval='0'"):
        ListenerConfig.from_params({"sync_interval": "0"})


@pytest.mark.slow
def test_whole_node_death_restarts_without_spending_budget(cluster):
    """SIGKILL of an agent and its worker together (a lost host: no orphan reports anything).
    The survivors' agent sees the node's heartbeat expire and restarts its worker as a
    membership change (restart count 0, rows intact); a worker whose collective failed first
    waits for that restart (Watcher.membership_change_pending) instead of failing."""
    tmp, agents = cluster
    port = free_port()
    agents.append(start_agent("a", tmp, port, worker="lifecycle"))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    t_b, gen2 = _grow(tmp, agents, "b", 2)
    b = agents[1]
    victim = next(r["pid"] for r in _ready(tmp, gen2) if r["agent_pid"] == b.pid)
    time.sleep(0.5)
    t_kill = b.signal(signal.SIGKILL)
    os.kill(victim, signal.SIGKILL)
    t_first = wait_for(
        lambda: first_commit_at(tmp, world_size=1, after=t_kill), WAIT, "world size 1 after the node died", agents
    )
    gen3 = _gen_of(tmp, 1, t_kill)
    _check_membership_restart(tmp, gen3, 1)
    print(f"\nwhole node SIGKILL (busy): fault to first step {t_first - t_kill:.2f} s")
    ev = events(tmp, "a")
    assert [e for e in ev if e["event"] == "rendezvous_round"][-1]["deaths"] == [_node(b)]
    assert not any(e["event"] == "dead_node_evicted" for e in ev)  # nobody reported it: heartbeat expiry
    # Whether the survivor's worker was in a gloo collective (fails at once: it then waits via
    # membership_change_pending) or in a commit's store wait (blocks until the agent's SIGTERM)
    # depends on timing; either way the restart above was a membership restart (count 0).
    waited = [r for r in worker_records(tmp) if r["ev"] == "collective_failed_membership" and r["gen"] == gen2]
    print(f"survivor waited on a failed collective: {bool(waited)}")


def _handler_on_loopback(monkeypatch, run_id: str, max_nodes: int):
    """The backend's handler in this process, hosting its c10d store on loopback (no agent)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from elastic_emb.rdzv.handler import create_handler

    # create_handler changes the agent process (env, torch's poll pause): undone after the test.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr(dr, "_delay", dr._delay)
    params = RendezvousParameters(
        backend="elastic_emb",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=max_nodes,
        is_host="1",
        keep_alive_interval="1",
    )
    return create_handler(params)


def test_membership_change_classification_against_a_real_store(monkeypatch):
    """Departure (left mark), death (no mark) and a peer restarting (already in the wait list)
    are told apart; the restarting peer stays expected in the next round."""
    from elastic_emb.rdzv.decode import RendezvousView
    from elastic_emb.rdzv.keys import KEY_LEFT, round_prefix

    h = _handler_on_loopback(monkeypatch, "cls", max_nodes=4)
    try:
        h._members, h._round, h._round_store = ("A", "B", "C", "D"), 7, h._inner._store
        h._round_store.set(round_prefix("cls", 7) + KEY_LEFT + "B", "agent_exit")
        view = RendezvousView.of_nodes(7, ("A",), ("D", "J"))
        change = h._membership_change(view)
        assert change["reason"] == "participant_gone"
        assert (change["departures"], change["deaths"], change["restarting"]) == (["B"], ["C"], ["D"])
        assert change["expected"] == ["A", "D", "J"]  # J waits to join: torch admits it to the next round
        assert h._membership_change(RendezvousView.of_nodes(7, ("A", "B", "C", "D"), ("J",))) is None  # a joiner
        only_restart = h._membership_change(RendezvousView.of_nodes(7, ("A", "B", "C"), ("D",)))
        assert only_restart["reason"] == "peer_restarting" and only_restart["restarting"] == ["D"]
        assert only_restart["expected"] == ["A", "B", "C", "D"]
        # A member restarts first after a drain for a joiner: the joiner is expected too, or the
        # next round would complete early without it (seen: rounds of 1, 2, 2, 3 nodes).
        drained = h._membership_change(RendezvousView.of_nodes(7, ("A", "C", "D"), ("B", "J")))
        assert drained["reason"] == "peer_restarting" and drained["restarting"] == ["B"]
        assert drained["expected"] == ["A", "B", "C", "D", "J"]
        assert h._membership_change(RendezvousView.of_nodes(8, (), complete=False))["reason"] == "round_advanced"
    finally:
        h._closed.set()
        h._left = True


def test_a_signalled_agent_leaves_but_does_not_close_the_rendezvous_even_when_the_signal_is_masked(monkeypatch):
    """torch's launcher skips ``shutdown()`` on SignalException (closing would end the job for the
    survivors) but calls it when a later error masks the signal (torch's metrics wrapper raised
    UnboundLocalError in its ``finally``; seen in CI: the survivors got RendezvousClosedError).
    The handler then leaves (its ``left`` mark) and keeps the rendezvous open; a plain shutdown
    closes it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from elastic_emb.rdzv.keys import KEY_LEFT, round_prefix

    h = _handler_on_loopback(monkeypatch, "sig", max_nodes=2)
    try:
        h._round, h._round_store = 3, h._inner._store

        def masked_signal() -> None:
            start = None
            try:
                del start
                raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
            finally:
                print(start)  # noqa: F821 - unbound, as in torch's wrapper: masks the signal

        with pytest.raises(UnboundLocalError):
            try:
                masked_signal()
            finally:  # where torch's launch_agent calls it
                assert h.shutdown() is False
        assert not h.is_closed()
        key = round_prefix("sig", 3) + KEY_LEFT + h._node
        assert h._round_store.check([key])  # it left, as at exit
        h._left = False
        assert h.shutdown() is not False  # no signal in flight: torch's plain shutdown closes it
        assert h.is_closed()
    finally:
        h._closed.set()
        h._left = True


def test_liveness_forgets_heartbeats_of_nodes_no_longer_members():
    """The agent's heartbeat map keeps the running round's members and the newest state's nodes
    only (a long job with churn does not accumulate entries); a member absent from the state keeps
    its last heartbeat, which tells a restarting member (fresh beat) from a dead one."""
    import structlog
    from torch.distributed import HashStore

    from elastic_emb.rdzv.decode import RendezvousView
    from elastic_emb.rdzv.liveness import Liveness
    from elastic_emb.rdzv.signing import Signer

    lv = Liveness("prune", "A", Signer(None), expiry_s=30.0, log=structlog.get_logger())
    now = time.time()
    lv.observe({"A": now, "B": now, "J": now}, members=("A", "B"))
    assert lv.beats == {"A": now, "B": now, "J": now}  # J waits to join: in the state
    lv.observe({"A": now + 1}, members=("A", "B"))  # B between torch's exit and join; J gone
    assert lv.beats == {"A": now + 1, "B": now}
    change = lv.change(3, ("A", "B"), HashStore(), RendezvousView.of_nodes(3, ("A",)))
    assert (change["restarting"], change["deaths"], change["expected"]) == (["B"], [], ["A", "B"])
    lv.new_round(("A",))  # B did not come back: no member now
    assert lv.beats == {"A": now + 1}
    lv.observe({"A": now - 60}, members=("A", "C"))  # C: a member never seen in a state
    change = lv.change(4, ("A", "C"), HashStore(), RendezvousView.of_nodes(4, ("A",)))
    assert (change["deaths"], change["restarting"]) == (["C"], [])  # no fresh beat: dead
    assert lv.dead == {"C"}


@pytest.mark.slow
def test_a_flapping_node_costs_the_survivor_a_reform_never_its_agent(cluster):
    """Restart mode. A node that dies right after its round completed, before its agent wrote
    torch's role record (the fault point ``agent_round_complete``), left the survivor's agent
    waiting 60 s for that record and then failing, the job dead. Three such nodes in a row: the
    survivor stands in for the lost record, restarts into a round of its own, and goes on."""
    tmp, agents = cluster
    port = free_port()
    kw = dict(worker="lifecycle", nnodes="1:2", conf=JOIN_CONF, drain_timeout=30.0)
    agents.append(start_agent("a", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    for cycle in range(3):
        flapper = start_agent(f"f{cycle}", tmp, port, extra_env={"ELASTIC_EMB_FAULT": "agent_round_complete"}, **kw)
        agents.append(flapper)
        wait_for(lambda f=flapper: f.proc.poll() is not None, WAIT, f"flapping node {cycle} to die", agents)
        assert flapper.proc.returncode == -signal.SIGKILL, flapper.output()[-2000:]
        t_dead = time.time()
        wait_for(
            lambda t=t_dead: first_commit_at(tmp, world_size=1, after=t), WAIT, f"a alone after flap {cycle}", agents
        )
        assert agents[0].proc.poll() is None, agents[0].output()[-3000:]
    lost = [e for e in events(tmp, "a") if e["event"] == "round_member_lost"]
    assert len(lost) == 3, lost
    # every restart of a's worker restored its rows bit for bit (the stand-in worlds start no step)
    ready = [r for r in worker_records(tmp) if r["ev"] == "ready"]
    assert ready and all(r["rows_ok"] for r in ready), ready
    assert {r["ws"] for r in ready if r["ev"] == "ready"} <= {1, 2}


def _check_survivor_reformed(tmp: str, survivor: Agent, t_dead: float, what: str, agents: list[Agent]) -> float:
    """After a node died at ``t_dead``: the survivor's agent still runs, its worker came back by a
    membership restart (no restart budget spent) with its newest commit, rows bit for bit, and
    trained on (a commit after the restart). Returns the seconds from the death to that commit."""
    mine = [r for r in worker_records(tmp) if r.get("agent_pid") == survivor.pid]
    pids = {r["pid"] for r in mine}
    before = [r for r in worker_records(tmp) if r["pid"] in pids and r["ev"] == "commit" and r["t"] <= t_dead]
    newest = max((r["committed"] for r in before if r["committed"] is not None), default=-1)

    def trained_on():
        recs = worker_records(tmp)
        ready = [r for r in recs if r["ev"] == "ready" and r["agent_pid"] == survivor.pid and r["t"] > t_dead]
        if not ready:
            return None
        pid = ready[0]["pid"]
        commits = [r for r in recs if r["ev"] == "commit" and r["pid"] == pid]
        return (ready[0], commits[0]) if commits else None

    ready, commit = wait_for(trained_on, WAIT, f"the survivor to commit again after {what}", agents)
    assert survivor.proc.poll() is None, survivor.output()[-3000:]
    assert ready["rows_ok"] and ready["restart_count"] == 0, ready
    assert ready["resume"] > newest, (ready, newest)  # its newest complete commit came back (or a newer one)
    return commit["t"] - t_dead


def _kill_workers_of(tmp: str, agent: Agent) -> None:
    """SIGKILL the workers an agent started (its node is lost with them, not just its agent)."""
    for pid in {r["pid"] for r in worker_records(tmp) if r.get("agent_pid") == agent.pid}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_member_lost_mid_drain_costs_the_survivor_a_reform_never_its_agent(cluster):
    """Restart mode, a drain for a joiner in progress: a member (the fault point
    ``agent_drain_started``: its agent dies right after it requested the drain, before the round
    after it; the test then kills its worker) is lost three times in a row, each time while the
    next flapping node waits to join. The survivor's agent never exits; its worker comes back
    with its newest commit, rows bit for bit, without spending restart budget, and trains on in a
    world with the joiner."""
    tmp, agents = cluster
    port = free_port()
    # max 3 nodes: torch puts a node that comes to a full round in its redundancy list (no drain)
    kw = dict(worker="lifecycle", nnodes="1:3", conf=JOIN_CONF, drain_timeout=30.0)
    a = start_agent("a", tmp, port, **kw)
    agents.append(a)
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    fault = {"ELASTIC_EMB_FAULT": "agent_drain_started"}
    t = time.time()
    prev = start_agent("f0", tmp, port, extra_env=fault, **kw)  # a drains for it; it is no member yet
    agents.append(prev)
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t), WAIT, "world size 2 with f0", agents)
    took = []
    for cycle in range(1, 4):
        nxt = start_agent(f"f{cycle}", tmp, port, extra_env=fault, **kw)  # its join drains a and prev
        agents.append(nxt)
        wait_for(lambda p=prev: p.proc.poll() is not None, WAIT, f"f{cycle - 1} to die mid-drain", agents)
        t_dead = time.time()
        _kill_workers_of(tmp, prev)
        assert prev.proc.returncode == -signal.SIGKILL, prev.output()[-2000:]
        drains = [e for e in events(tmp, prev.name) if e["event"] == "drain_requested"]
        assert drains and [e for e in events(tmp, prev.name) if e["event"] == "faultpoint_kill"], drains
        took.append(_check_survivor_reformed(tmp, a, t_dead, f"f{cycle - 1} died mid-drain", agents))
        prev = nxt
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=time.time()), WAIT, "world size 2 at the end", agents)
    print(f"\nmember lost mid-drain: survivor's next commit {', '.join(f'{s:.1f}' for s in took)} s after each death")
    assert all(r["rows_ok"] for r in worker_records(tmp) if r["ev"] == "ready")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_lost_in_the_round_start_barriers_costs_the_survivor_a_reform_never_its_agent(cluster):
    """Restart mode. A joining node dies after its round completed, inside the barriers before
    training: right after its agent wrote torch's role record (``agent_role_info_written``),
    right after it read its assigned ranks (``agent_ranks_assigned``: the survivor's workers start
    in a world with a dead peer), and with its worker inside the workers' topology agreement
    (``topology_agreeing``: the worker kills its agent and itself). Each time the survivor's
    agent never exits; its worker comes back with its newest commit, rows bit for bit, without
    spending restart budget, and trains on."""
    tmp, agents = cluster
    port = free_port()
    kw = dict(worker="lifecycle", nnodes="1:2", conf=JOIN_CONF, drain_timeout=30.0)
    a = start_agent("a", tmp, port, **kw)
    agents.append(a)
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    faults = [
        {"ELASTIC_EMB_FAULT": "agent_role_info_written"},
        {"ELASTIC_EMB_FAULT": "agent_ranks_assigned"},
        {"RDZV_TEST_NODE_FAULT": "topology_agreeing"},
    ]
    took = []
    for cycle, fault in enumerate(faults):
        flapper = start_agent(f"f{cycle}", tmp, port, extra_env=fault, **kw)
        agents.append(flapper)
        wait_for(lambda f=flapper: f.proc.poll() is not None, WAIT, f"flapping node {cycle} to die", agents)
        t_dead = time.time()
        _kill_workers_of(tmp, flapper)  # none started, or the node fault took them: a no-op
        assert flapper.proc.returncode == -signal.SIGKILL, flapper.output()[-2000:]
        took.append(_check_survivor_reformed(tmp, a, t_dead, f"{fault} ", agents))
    print(f"\nnode lost in the round-start barriers: survivor's next commit {took} s after each death")
    assert all(r["rows_ok"] for r in worker_records(tmp) if r["ev"] == "ready")
