"""In-process resize (--rdzv-conf resize=in_process) with real torchrun agents on loopback: the
survivors re-form in their running processes (pids unchanged), rows bit for bit equal to the
closed-form replay, torch's restart budget untouched, no new rendezvous round."""

from __future__ import annotations

import signal
import time

import pytest

from elastic_emb.testing.ports import free_port
from tests.helpers.agents import (
    FAST_CONF,
    Agent,
    events,
    first_commit_at,
    kill_all,
    start_agent,
    wait_for,
    worker_records,
)

WAIT = 60.0
CONF = FAST_CONF + ",resize=in_process"


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


@pytest.fixture
def inner(request, tmp_path):
    """The inner rendezvous (indirect parameter ``c10d`` or ``etcd-v2``): the keyword arguments of
    ``start_agent`` for it. ``etcd-v2`` starts a real etcd on loopback for the test; requested
    before ``cluster``, it is stopped after the agents are killed."""
    import os
    import shutil

    if request.param == "c10d":
        yield {}
        return
    if shutil.which("etcd") is None:
        pytest.skip("etcd-server is not installed (Debian package etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd is not installed (test extra)")
    from elastic_emb.testing.etcd import EtcdServer

    with EtcdServer(os.path.join(str(tmp_path), "etcd")) as server:
        yield {"inner": "etcd-v2", "endpoint": server.endpoint}


INNERS = pytest.mark.parametrize("inner", ["c10d", "etcd-v2"], indirect=True)


def _two_nodes(tmp, agents, **kw) -> dict:
    """a, then b joins in process, checked: b's agent joins the running round as one more
    participant (no agent restarts); its worker registers as ready and waits; a's worker includes
    it at a step boundary: both build generation + 1 together, a's worker pid unchanged, rows
    bit-exact, nothing lost or repeated. Returns, per agent pid, its worker's pid and the
    generation it is in now (after a few steps at world size 2)."""
    port = free_port()
    agents.append(start_agent("a", tmp, port, worker="lifecycle", conf=CONF, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    first = [r for r in worker_records(tmp) if r["ev"] == "ready"][0]
    t_join = time.time()
    agents.append(start_agent("b", tmp, port, worker="lifecycle", conf=CONF, **kw))
    t_first = wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_join), WAIT, "world size 2", agents)
    # Both workers committed at world size 2, and the running one logged its resize event (it does
    # so after its first commit there): waited for, not assumed after a pause.
    wait_for(
        lambda: len(_committers(tmp, 2, t_join)) >= 2 and _resize_events(tmp, first["pid"], t_join),
        WAIT,
        "both workers to commit at world size 2",
        agents,
    )
    recs = worker_records(tmp)
    reformed = [r for r in recs if r["ev"] == "reformed" and r["t"] > t_join]
    assert len(reformed) == 1 and reformed[0]["pid"] == first["pid"] and reformed[0]["ws"] == 2, reformed
    assert reformed[0]["rows_ok"] and reformed[0]["rank"] == 0, reformed
    joiner = [r for r in recs if r["ev"] == "ready" and r["t"] > t_join]
    assert len(joiner) == 1 and joiner[0]["joined"] and joiner[0]["rows_ok"] and joiner[0]["ws"] == 2, joiner
    assert joiner[0]["gen"] == reformed[0]["gen"] == first["gen"] + 1
    assert joiner[0]["resume"] == reformed[0]["resume"], (joiner, reformed)  # nothing lost, nothing repeated
    committed = {r["pid"] for r in recs if r["ev"] == "commit" and r["ws"] == 2}
    assert committed == {first["pid"], joiner[0]["pid"]}
    rounds = [e for e in events(tmp, "a") if e["event"] == "rendezvous_round"]
    assert len(rounds) == 1, rounds  # no new torch round: nobody was restarted
    ev = _resize_event(tmp, first["pid"], t_join)  # the running worker's event: every phase, its pid
    assert ev["new_world_size"] == 2 and ev["kind"] == "rebuild", ev
    last_before = max(r["t"] for r in recs if r["ev"] == "commit" and r["ws"] == 1)
    print(
        f"\nin-process 1->2: join to first step {t_first - t_join:.2f} s (includes the joiner's torchrun start), "
        f"running worker's pause {t_first - last_before:.2f} s"
    )
    return {
        agents[0].pid: {"pid": first["pid"], "gen": reformed[0]["gen"]},
        agents[1].pid: {"pid": joiner[0]["pid"], "gen": joiner[0]["gen"]},
    }


def _committers(tmp, ws, after) -> set[int]:
    """The worker pids that logged a commit at world size ``ws`` after ``after``."""
    return {r["pid"] for r in worker_records(tmp) if r["ev"] == "commit" and r["ws"] == ws and r["t"] > after}


def _resize_events(tmp, pid, after) -> list[dict]:
    return [r for r in worker_records(tmp) if r["ev"] == "resize_event" and r["pid"] == pid and r["t"] > after]


def _reformed(tmp, pid, after):
    return [r for r in worker_records(tmp) if r["ev"] == "reformed" and r["pid"] == pid and r["t"] > after]


@pytest.mark.slow
@INNERS
@pytest.mark.parametrize("fault", ["sigterm", "sigkill_node"])
def test_two_to_one_survivor_reforms_in_process(inner, cluster, fault):
    """1 -> 2 in process (checked in :func:`_two_nodes`), then SIGTERM of b's agent (it leaves
    the rendezvous; its worker dies), or SIGKILL of b's whole node (agent and worker at once: no
    goodbye, no orphan report; its heartbeat expires). Over the inner c10d store and over etcd-v2
    (a real etcd on loopback)."""
    import os

    tmp, agents = cluster
    workers = _two_nodes(tmp, agents, **inner)
    a, b = agents
    survivor = workers[a.pid]
    if fault == "sigterm":
        t_kill = b.signal(signal.SIGTERM)
    else:
        t_kill = b.signal(signal.SIGKILL)
        os.kill(workers[b.pid]["pid"], signal.SIGKILL)
    rec = wait_for(lambda: _reformed(tmp, survivor["pid"], t_kill), WAIT, "the survivor to re-form", agents)[0]
    t_first = wait_for(lambda: first_commit_at(tmp, world_size=1, after=t_kill), WAIT, "a step at world size 1", agents)
    # the survivor logs its resize event after that first commit: waited for, not assumed after a pause
    wait_for(lambda: _resize_events(tmp, survivor["pid"], t_kill), WAIT, "the survivor's resize event", agents)
    recs = worker_records(tmp)
    # the same process, re-formed: no new worker started by any agent after the kill
    assert rec["ws"] == 1 and rec["rank"] == 0 and rec["rows_ok"] and rec["rows"] == [0, 64], rec
    assert not [r for r in recs if r["ev"] == "ready" and r["t"] > t_kill], "an agent restarted a worker"
    after = [r for r in recs if r["ev"] == "commit" and r["t"] > t_kill and r["ws"] == 1]
    assert after and {r["pid"] for r in after} == {survivor["pid"]}
    # nothing lost or repeated: the survivor resumed right after the newest step committed by the world of two.
    # That is the newest step it logged as committed, or the one step it started after it: a commit can
    # complete on both nodes while the fault cuts the call (and its log line) short, seen on an idle
    # machine; the rows, checked bit-exact at the restored step above, say which one was kept.
    committed2 = max(r["step"] for r in recs if r["ev"] == "commit" and r["ws"] == 2 and r["pid"] == survivor["pid"])
    started2 = max(r["step"] for r in recs if r["ev"] == "start" and r["ws"] == 2 and r["pid"] == survivor["pid"])
    assert started2 in (committed2, committed2 + 1), (started2, committed2)
    assert rec["resume"] in (committed2, committed2 + 1, started2 + 1), (rec, committed2, started2)
    assert rec["gen"] == survivor["gen"] + 1
    # The agent sees the node gone too (after a kill, at its heartbeat expiry: possibly after the
    # survivor re-formed on the roll call) and leaves the change to the workers: no new round.
    wait_for(
        lambda: [e for e in events(tmp, "a") if e["event"] == "membership_changed" and e.get("mode") == "in_process"],
        WAIT,
        "agent a to see the node gone",
        agents,
    )
    time.sleep(0.5)
    ev = events(tmp, "a")
    assert not [e for e in ev if e["event"] == "rendezvous_round" and e["timestamp"] > _iso(t_kill)]
    # One lifecycle.resize event with every phase, logged after the first step at world size 1.
    ev = _resize_event(tmp, survivor["pid"], t_kill)
    assert ev["new_world_size"] == 1 and ev["new_generation"] == rec["gen"], ev
    logged = [e for e in _logged_resize_events(a) if e["new_generation"] == rec["gen"]]
    assert len(logged) == 1 and logged[0]["first_step_s"] == ev["first_step_s"], logged
    last_before = max(r["t"] for r in recs if r["ev"] == "commit" and r["ws"] == 2)
    print("\nphases: " + ", ".join(f"{p[:-2]} {ev[p] * 1e3:.1f} ms" for p in PHASES))
    print(
        f"\nin-process 2->1 ({fault}): fault to first step {t_first - t_kill:.2f} s, survivor pause "
        f"{t_first - last_before:.2f} s, re-form {rec['total_s']:.3f} s (rebuild), tiers {rec['tiers']}, "
        f"after a failed collective: {rec['failed']}"
    )


PHASES = ("detect_s", "drain_s", "decide_s", "agreement_s", "teardown_s", "construct_s", "restore_s", "first_step_s")


def _resize_event(tmp, pid, after) -> dict:
    """The complete ``lifecycle.resize`` event of the re-form of worker ``pid`` after ``after``
    (the worker logs ``lc.events[-1]`` after the first commit of the new world), checked: every
    phase present and non-negative, mode in_process, the pid of the process that was there before."""
    got = _resize_events(tmp, pid, after)
    assert got, f"worker {pid} logged no resize_event after its re-form"
    ev = got[0]
    assert ev["mode"] == "in_process" and ev["event_pid"] == pid, ev
    for phase in PHASES:
        assert isinstance(ev[phase], float) and ev[phase] >= 0.0, (phase, ev)
    return ev


def _logged_resize_events(agent) -> list[dict]:
    """The structlog ``lifecycle.resize`` lines in an agent's log (its worker's stderr, JSON)."""
    import json

    out = []
    for line in agent.output().splitlines():
        if '"lifecycle.resize"' in line:
            try:
                out.append(json.loads(line[line.index("{") :]))
            except ValueError:
                pass
    return [e for e in out if e.get("event") == "lifecycle.resize"]


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


@pytest.mark.slow
def test_a_crashed_worker_rejoins_and_the_world_converges(cluster):
    """SIGKILL of one worker (its agent lives): the survivor re-forms without it in its own
    process (2 -> 1); the crashed node's agent leaves the round, waits for that decision, restarts
    its worker as a joiner (rdzv/rejoin.py), and the survivor includes it at a step boundary
    (1 -> 2). The survivor's pid never changes, no agent starts a new round, rows are bit-exact."""
    import os

    tmp, agents = cluster
    workers = _two_nodes(tmp, agents)
    a, b = agents
    survivor = workers[a.pid]["pid"]
    t_kill = time.time()
    os.kill(workers[b.pid]["pid"], signal.SIGKILL)

    def rejoined():
        ready = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > t_kill and r["ws"] == 2]
        return ready and first_commit_at(tmp, world_size=2, after=ready[0]["t"])

    t_back = wait_for(rejoined, WAIT, "the restarted worker included at world size 2", agents)
    # both workers step on after the first commit of that world (waited for, not assumed after a pause)
    wait_for(lambda: len(_committers(tmp, 2, t_back)) >= 2, WAIT, "both workers to commit after the rejoin", agents)
    recs = worker_records(tmp)
    ready = [r for r in recs if r["ev"] == "ready" and r["t"] > t_kill]
    assert len(ready) == 1 and ready[0]["agent_pid"] == b.pid, ready  # only the crashed worker restarted
    joiner = ready[0]
    assert joiner["joined"] and joiner["rows_ok"] and joiner["restart_count"] == 1, joiner
    reformed = [r for r in recs if r["ev"] == "reformed" and r["t"] > t_kill]
    assert {r["pid"] for r in reformed} == {survivor}, reformed
    assert [(r["ws"], r["rank"]) for r in reformed] == [(1, 0), (2, 0)] and all(r["rows_ok"] for r in reformed), (
        reformed
    )
    assert joiner["gen"] == reformed[1]["gen"] == reformed[0]["gen"] + 1, (joiner, reformed)
    assert joiner["resume"] == reformed[1]["resume"], (joiner, reformed)  # the join loses and repeats nothing
    assert {r["pid"] for r in recs if r["ev"] == "commit" and r["t"] > t_back} == {survivor, joiner["pid"]}
    # no new torch round: a's agent logs none, b's agent rejoined the running one (its round logged again)
    rounds = {n: [e["round"] for e in events(tmp, n) if e["event"] == "rendezvous_round"] for n in ("a", "b")}
    assert rounds["a"] == [0] and rounds["b"] == [0, 0], rounds
    rejoin = [e["event"] for e in events(tmp, "b") if e["timestamp"] > _iso(t_kill)]
    # the survivors' decision without b comes before b's agent looks (rejoin_not_included) or after
    assert rejoin[:3] in (
        ["worker_failed_rejoining", "survivors_reformed", "joined_running_round"],
        ["worker_failed_rejoining", "rejoin_not_included", "joined_running_round"],
    ), rejoin
    t_one = first_commit_at(tmp, world_size=1, after=t_kill)
    print(
        f"\nworker crash: survivor at world size 1 after {t_one - t_kill:.2f} s, the restarted worker included "
        f"after {t_back - t_kill:.2f} s (includes its Python start)"
    )


@pytest.mark.slow
def test_the_decider_dies_mid_decision_and_the_job_converges(cluster):
    """Three nodes; c leaves (SIGTERM); the decider (a's worker, first survivor) is killed right
    after claiming the decision (fault point). b waits for the record until a's node leaves the
    round (or decide_timeout) and asks the agents for a restart (resize_fallback); a's agent,
    waiting to rejoin after its worker's crash (rdzv/rejoin.py), sees that and takes torch's
    join: the world of two comes back bit-exact, restarted."""
    tmp, agents = cluster
    port = free_port()
    # generations: 0 (a alone), 1 (b joined), 2 (c joined), 3 (c left): the decider of 3 dies
    fault = {"ELASTIC_EMB_FAULT": "resize_decider_claimed@3"}
    agents.append(start_agent("a", tmp, port, worker="lifecycle", conf=CONF, extra_env=fault))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    for name, ws in (("b", 2), ("c", 3)):
        t = time.time()
        agents.append(start_agent(name, tmp, port, worker="lifecycle", conf=CONF))
        wait_for(lambda: first_commit_at(tmp, world_size=ws, after=t), WAIT, f"world size {ws}", agents)
    time.sleep(0.5)
    t_kill = agents[2].signal(signal.SIGTERM)

    def newest_ready():
        # a's agent may restart its killed worker first (a ready, then the fallback): each
        # agent's newest worker is the one that counts
        latest = {r["agent_pid"]: r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > t_kill}
        return [r for r in latest.values() if r["ws"] == 2]

    def back_at_two():
        ready = newest_ready()
        return len(ready) == 2 and first_commit_at(tmp, world_size=2, after=max(r["t"] for r in ready))

    t_back = wait_for(back_at_two, WAIT, "the world of two, restarted", agents)
    ready = newest_ready()
    assert all(r["rows_ok"] for r in ready), ready
    assert "faultpoint_kill" in agents[0].output()  # the decider did die mid-decision
    fell_back = [e for n in ("a", "b") for e in events(tmp, n) if e["event"] == "resize_fallback"]
    assert fell_back, "no agent saw the fallback request"
    assert {e["round"] for e in fell_back} == {0}, fell_back  # one fallback (a second one would be round 1's)
    # Generations strictly increase across the fallback: the restarted world's generation is above
    # every one formed in process before (3 was claimed by the dead decider), so no generation is
    # seen with two memberships, and one fallback suffices (a reused generation met that
    # generation's closed agreement, or its stale join plan, and needed a second one).
    recs = worker_records(tmp)
    worlds: dict = {}
    for r in recs:
        if r["ev"] in ("ready", "reformed", "commit"):
            worlds.setdefault(r["gen"], set()).add(r["ws"])
    assert all(len(ws) == 1 for ws in worlds.values()), worlds
    before = max(r["gen"] for r in recs if r["ev"] in ("ready", "reformed") and r["t"] < t_kill)
    assert before == 2 and all(r["gen"] > 3 for r in ready), (before, ready)
    # After the fallback both agents join torch's next round (restart mode). Both on time for its
    # last call: round 1 is the world of two. One after it: round 1 completes without that node,
    # which waits in its wait list and comes in by a drain and round 2 (a scale-up, no second
    # fallback). Which one depends on the agents' timing, not on the library.
    rounds = {n: [e["round"] for e in events(tmp, n) if e["event"] == "rendezvous_round"] for n in ("a", "b")}
    last = rounds["a"][-1]
    assert rounds["a"][0] == rounds["b"][0] == 0 and rounds["b"][-1] == last and last in (1, 2), rounds
    assert sorted(set(rounds["a"]) | set(rounds["b"])) == list(range(last + 1)), rounds
    gens = {e["round"]: e["generation"] for e in events(tmp, "a") if e["event"] == "rendezvous_round"}
    assert gens[0] == 0 and gens[last] == {r["gen"] for r in ready}.pop(), (gens, ready)
    print(
        f"\ndecider killed: world of two back after {t_back - t_kill:.2f} s at generation {gens[last]} "
        f"(round {last}); fallback requested: {bool(fell_back)}"
    )


def _steps_lost(recs, reformed) -> int:
    """Steps a re-form rolled back: the newest step any worker logged as complete before it
    (``committed``: a commit in flight is not complete), minus the step it restored (``resume -
    1``; a step whose commit completed but whose log line was cut by the fault counts as kept:
    the rows, checked bit-exact, say it was)."""
    before = [
        r.get("committed", r["step"])
        for r in recs
        if r["ev"] == "commit" and r["t"] < reformed["t"] and r["ws"] != reformed["ws"]
    ]
    return max(0, max(before) - (reformed["resume"] - 1))


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["c10d", "etcd-v2"])
def test_three_to_two_to_three_survivors_keep_their_processes(cluster, inner):
    """a, b, c join one after the other (in process); c leaves by SIGTERM (3 -> 2); a new node d
    joins (2 -> 3). a's and b's workers are the same processes from the first step to the last:
    no agent starts a worker for them, every re-form restores rows bit-exact (the worker checks
    against the step-by-step replay), and no step is lost. With ``inner=etcd-v2`` the rendezvous
    lives in a real etcd on loopback instead of a's agent."""
    import contextlib
    import os
    import shutil

    tmp, agents = cluster
    kw: dict = dict(worker="lifecycle", conf=CONF)
    with contextlib.ExitStack() as stack:
        port = free_port()
        if inner == "etcd-v2":
            if shutil.which("etcd") is None:
                pytest.skip("etcd-server is not installed (Debian package etcd-server)")
            pytest.importorskip("etcd", reason="python-etcd is not installed (test extra)")
            from elastic_emb.testing.etcd import EtcdServer

            server = stack.enter_context(EtcdServer(os.path.join(tmp, "etcd")))
            kw.update(inner="etcd-v2", endpoint=server.endpoint)
        agents.append(start_agent("a", tmp, port, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
        for name, ws in (("b", 2), ("c", 3)):
            t = time.time()
            agents.append(start_agent(name, tmp, port, **kw))
            wait_for(lambda: first_commit_at(tmp, world_size=ws, after=t), WAIT, f"world size {ws}", agents)
        recs = worker_records(tmp)
        worker_of = {r["agent_pid"]: r["pid"] for r in recs if r["ev"] == "ready"}
        a, b, c = (worker_of[x.pid] for x in agents)
        time.sleep(0.5)
        t_leave = agents[2].signal(signal.SIGTERM)
        wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_leave), WAIT, "world size 2 (c left)", agents)
        time.sleep(0.5)
        t_join = time.time()
        agents.append(start_agent("d", tmp, port, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=3, after=t_join), WAIT, "world size 3 (d joined)", agents)
        # every worker of the world of three committed in it (waited for, not assumed after a pause)
        wait_for(lambda: len(_committers(tmp, 3, t_join)) >= 3, WAIT, "all three workers to commit", agents)
        recs = worker_records(tmp)

    # the survivors never restarted: the only workers any agent started are a, b, c and d's joiner
    ready = [r for r in recs if r["ev"] == "ready"]
    assert [r["pid"] for r in ready][:3] == [a, b, c] and len(ready) == 4, ready
    d = ready[3]
    assert d["joined"] and d["rows_ok"] and d["ws"] == 3 and d["t"] > t_join, d
    for pid in (a, b):
        reformed = [
            (r["ws"], r["rank"]) for r in recs if r["ev"] == "reformed" and r["pid"] == pid and r["t"] > t_leave
        ]
        want_rank = 0 if pid == a else 1
        assert reformed == [(2, want_rank), (3, want_rank)], (pid, reformed)  # survivors keep their order
    changes = [r for r in recs if r["ev"] == "reformed" and r["t"] > t_leave]
    assert [_steps_lost(recs, r) for r in changes] == [0] * 4, changes
    # (the leave may interrupt a step: the agent's SIGTERM stops c's worker mid-collective, and the
    # survivors restore the newest commit; the join happens at an agreed step boundary)
    assert all(r["rows_ok"] for r in changes) and not [r for r in changes if r["ws"] == 3 and r["failed"]], changes
    # the joiner starts where the survivors resume: nothing lost, nothing repeated
    at3 = [r for r in changes if r["ws"] == 3]
    assert {r["resume"] for r in at3} == {d["resume"]}, (at3, d)
    assert {r["gen"] for r in at3} == {d["gen"]}
    committed3 = {r["pid"] for r in recs if r["ev"] == "commit" and r["ws"] == 3 and r["t"] > t_join}
    assert committed3 == {a, b, d["pid"]}
    t_first2 = first_commit_at(tmp, world_size=2, after=t_leave)
    t_first3 = first_commit_at(tmp, world_size=3, after=t_join)
    last_at2 = max(r["t"] for r in recs if r["ev"] == "commit" and r["ws"] == 2 and r["t"] < t_first3)
    print(
        f"\nin-process 3->2->3 ({inner}): leave to first step {t_first2 - t_leave:.2f} s; "
        f"join to first step {t_first3 - t_join:.2f} s, survivors' pause {t_first3 - last_at2:.2f} s"
    )


def _newest_ready(tmp, after) -> dict:
    """Each agent's newest worker started after ``after`` (agent pid -> its ready record)."""
    return {r["agent_pid"]: r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > after}


@pytest.mark.slow
def test_a_joiner_dying_before_it_is_ready_and_the_job_converges(cluster):
    """Re-form fault: b's first worker is killed before it registers as ready (fault point
    ``resize_joiner_registering@0``). a's world never included it, so nothing waits on it; b's
    agent restarts the worker, which joins. Bound: the world of two trains within WAIT, every
    row bit-exact, no committed step lost, a's restart budget untouched."""
    tmp, agents = cluster
    port = free_port()
    agents.append(start_agent("a", tmp, port, worker="lifecycle", conf=CONF))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    time.sleep(0.5)
    t_join = time.time()
    fault = {"ELASTIC_EMB_FAULT": "resize_joiner_registering@0"}
    agents.append(start_agent("b", tmp, port, worker="lifecycle", conf=CONF, extra_env=fault))
    a, b = agents

    def at_two():
        recs = worker_records(tmp)
        pids = {r["pid"] for r in recs if r["ev"] == "commit" and r["ws"] == 2 and r["t"] > t_join}
        return len(pids) == 2 and pids

    wait_for(lambda: "faultpoint_kill" in b.output(), WAIT, "b's first worker to die at the fault point", agents)
    wait_for(at_two, WAIT, "the world of two after the joiner's death", agents)
    t_two = first_commit_at(tmp, world_size=2, after=t_join)
    time.sleep(0.3)
    recs = worker_records(tmp)
    starts = [r for r in recs if r["ev"] in ("ready", "reformed") and r["t"] > t_join]
    assert starts and all(r["rows_ok"] for r in starts), starts
    assert [_steps_lost(recs, r) for r in starts if r["ws"] == 2] == [0] * len([r for r in starts if r["ws"] == 2])
    newest = _newest_ready(tmp, 0)
    assert newest[a.pid]["restart_count"] == 0 and newest[b.pid]["restart_count"] >= 1, newest
    kept = a.pid in {r["agent_pid"] for r in recs if r["ev"] == "ready"} and not any(
        r["agent_pid"] == a.pid for r in recs if r["ev"] == "ready" and r["t"] > t_join
    )
    print(
        f"\njoiner died before ready: world of two after {t_two - t_join:.2f} s from the join; "
        f"a's worker kept its process: {kept}"
    )


@pytest.mark.slow
def test_a_second_node_lost_during_the_restore_and_the_job_converges(cluster):
    """Re-form fault: three nodes; c's node is SIGKILLed (agent and worker); while a and b restore
    generation 3, b's worker dies at ``lifecycle_restoring@3`` and the test SIGKILLs b's agent (a
    second node lost). a's re-form fails (its peer is gone mid-restore), it says so in a
    ``resize_fallback`` event, and the job goes on at world size 1 with every row bit-exact.
    Bound: within WAIT of the first fault."""
    import os

    tmp, agents = cluster
    port = free_port()
    agents.append(start_agent("a", tmp, port, worker="lifecycle", conf=CONF))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    for name, ws in (("b", 2), ("c", 3)):
        t = time.time()
        extra = {"ELASTIC_EMB_FAULT": "lifecycle_restoring@3"} if name == "b" else None
        agents.append(start_agent(name, tmp, port, worker="lifecycle", conf=CONF, extra_env=extra))
        wait_for(lambda: first_commit_at(tmp, world_size=ws, after=t), WAIT, f"world size {ws}", agents)
    a, b, c = agents
    c_worker = next(r["pid"] for r in worker_records(tmp) if r["ev"] == "ready" and r["agent_pid"] == c.pid)
    time.sleep(0.5)
    t_kill = c.signal(signal.SIGKILL)
    os.kill(c_worker, signal.SIGKILL)
    wait_for(lambda: "faultpoint_kill" in b.output(), WAIT, "b's worker to die in the restore", agents, pause=0.01)
    b.signal(signal.SIGKILL)  # the second node lost: its agent too

    def at_one():
        newest = _newest_ready(tmp, t_kill).get(a.pid)
        reformed = [r for r in worker_records(tmp) if r["ev"] == "reformed" and r["t"] > t_kill and r["ws"] == 1]
        start = newest or (reformed[-1] if reformed else None)
        return start is not None and start["ws"] == 1 and first_commit_at(tmp, world_size=1, after=start["t"])

    t_one = wait_for(at_one, WAIT, "a alone at world size 1", agents)
    time.sleep(0.3)
    recs = worker_records(tmp)
    starts = [r for r in recs if r["ev"] in ("ready", "reformed") and r["t"] > t_kill]
    assert starts and all(r["rows_ok"] for r in starts if r["ws"] == 1), starts
    a_workers = {r["pid"] for r in recs if r["ev"] == "ready" and r["agent_pid"] == a.pid}
    at_one = {r["pid"] for r in recs if r["ev"] == "commit" and r["t"] >= t_one}
    assert len(at_one) == 1 and at_one <= a_workers, (at_one, a_workers)  # a's worker alone trains on
    said = [e for e in events(tmp, "a") if e["event"] == "resize_fallback"]
    print(
        f"\nsecond node lost mid-restore: world of one after {t_one - t_kill:.2f} s; fallback said: "
        f"{[e.get('reason', '')[:120] for e in said]}"
    )


def test_the_resize_event_waits_for_the_first_step(tmp_path):
    """One process, world size 1 over a real gloo group: a re-form (the same size rebuilt, as
    ``InProcessResize.run(rebuild=True)`` does) returns its event at once, but logs
    ``lifecycle.resize`` only when the first step of the new world ends (``commit``), with the
    caller's phases, every phase non-negative; a re-form with no step after it is logged at
    ``close`` with ``first_step_s`` null."""
    import os
    from datetime import timedelta

    import structlog
    import torch.distributed as dist

    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.protocol import TableSpec
    from elastic_emb.topology import Topology
    from tests.helpers.lifecycle_worker import MiniContext

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)

    def topo(gen: int) -> Topology:
        return Topology.build(
            run_id="firststep",
            generation=gen,
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            node_rank=0,
            num_nodes=1,
            ep_size=1,
            backend="gloo",
            master_addr="127.0.0.1",
            master_port=1,
        )

    def factory(t, s):
        return MiniContext(t, s, tables=[TableSpec(name="t", num_rows=8, dim=2)])

    lc = Lifecycle(factory, LifecycleConfig(state_dir=str(tmp_path), node_id="n0").resolved({}), topo(0), store)
    lc.context = factory(topo(0), store)
    for step in range(2):
        lc.context.train_step(step)
        lc.commit(step)
    phases = {"detect_s": 0.001, "drain_s": 0.0, "decide_s": 0.002}
    with structlog.testing.capture_logs() as logs:
        ev = lc.on_membership_change(topo(1), rebuild=True, mode="in_process", phases=phases)
        assert ev.kind == "rebuild" and ev.first_step_s is None and ev.pid == os.getpid()
        assert not [e for e in logs if e["event"] == "lifecycle.resize"]  # not before the first step
        time.sleep(0.05)
        lc.context.train_step(2)
        lc.commit(2)
        lc.commit(3)  # a second step logs nothing more
    logged = [e for e in logs if e["event"] == "lifecycle.resize"]
    assert len(logged) == 1, logged
    assert {k: v for k, v in logged[0].items() if k not in ("event", "log_level")} == lc.events[-1].model_dump()
    done = lc.events[-1]
    assert done.mode == "in_process" and done.first_step_s >= 0.05 and done.restored_step == 1
    for phase in PHASES:
        assert getattr(done, phase) >= 0.0, (phase, done)
    assert (done.detect_s, done.drain_s, done.decide_s) == (0.001, 0.0, 0.002)
    with structlog.testing.capture_logs() as logs:
        lc.on_membership_change(topo(2), rebuild=True)
        lc.close()
    logged = [e for e in logs if e["event"] == "lifecycle.resize"]
    assert len(logged) == 1 and logged[0]["first_step_s"] is None and logged[0]["new_generation"] == 2, logged


def test_torchs_exit_barrier_completes_over_the_members_of_now():
    """torchrun's exit barrier (torch's own ``store_util.barrier``, called as its agent calls it)
    through ``ExitBarrierStore`` on a real TCPStore. A membership that changed in process leaves
    every agent counting its round's node count: 2 -> 1 (the survivor counts 2, alone) and 1 -> 2
    (the joiner counts 2 and arrives first, the first node counts 1: plain torch never completes
    either). Over the members of now both complete at once; with a member missing the barrier
    still waits for it, bounded by its timeout."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.utils import store as store_util

    from elastic_emb.rdzv import exit_barrier as eb

    assert agent_api._TERMINAL_STATE_SYNC_ID == eb.TERMINAL_STATE_PREFIX  # torch's names, as installed
    assert (store_util._NUM_MEMBERS, store_util._LAST_MEMBER_CHECKIN) == ("/num_members", "/last_member")
    master = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)

    def barrier(prefix: str, node: str, world: int, members, timeout: float = 30.0) -> float:
        # Completing at all is the check: plain torch never completes these, and the barrier
        # raises TimeoutError at ``timeout`` (no wall-clock bound of our own: a loaded machine).
        store = eb.ExitBarrierStore(dist.PrefixStore(prefix, master), node, lambda: members, poll=0.02)
        t0 = time.monotonic()
        store_util.barrier(store, world_size=world, key_prefix=eb.TERMINAL_STATE_PREFIX, barrier_timeout=timeout)
        return time.monotonic() - t0

    # 2 -> 1: the survivor counts 2 but is the only member now.
    barrier("down/", "a", 2, ("a",))
    # 1 -> 2: the joiner (counting 2) arrives first, then the first node (counting 1).
    took: dict = {}
    joiner = threading.Thread(target=lambda: took.setdefault("b", barrier("up/", "b", 2, ("a", "b"))))
    joiner.start()
    arrived = dist.PrefixStore("up/", master)
    deadline = time.monotonic() + 30
    while not arrived.check([eb.ARRIVED + "b"]) and time.monotonic() < deadline:  # the joiner is first
        time.sleep(0.01)
    assert arrived.check([eb.ARRIVED + "b"]), "the joiner never arrived at the barrier"
    took["a"] = barrier("up/", "a", 1, ("a", "b"))
    joiner.join(60)
    assert set(took) == {"a", "b"}, took  # both completed (a TimeoutError leaves the thread's entry out)
    # A member that has not arrived is waited for, up to the barrier's timeout.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"members \['a', 'c'\] did not all arrive within 0.5 s"):
        barrier("late/", "a", 1 + 5, ("a", "c"), timeout=0.5)
    # its own 0.5 s bound, not the store's 30 s default (half of that: the margin for a loaded machine)
    assert time.monotonic() - t0 < 15.0
