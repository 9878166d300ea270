"""The hang watchdog: a worker that makes no progress for hang_timeout is killed by its agent and
the job re-forms without the hung process, nothing lost.

The worker's heartbeat and the agent's watchdog against real child processes (a stopped one, one
that is not the agent's child, a planted file), and real torchrun agents whose worker is
SIGSTOPped mid-run, in both resize modes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import structlog

from elastic_emb.rdzv.hang import HangWatchdog, process_state
from elastic_emb.testing.ports import free_port
from elastic_emb.watch import heartbeat
from tests.helpers.agents import Agent, events, first_commit_at, kill_all, start_agent, wait_for, worker_records

LOG = structlog.get_logger("test")


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _progress(prefix: str, rank: int, pid: int, age: float) -> str:
    path = f"{prefix}-{rank}.json"
    with open(path, "w") as f:
        json.dump({"pid": pid}, f)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def _spinning() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _settled(pid: int, states: str) -> None:
    """Wait (bounded) until ``pid`` is in one of ``states``: a child that is still starting runs."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        state = process_state(pid)
        if state is not None and state[1] in states:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never reached a state in {states!r}: {process_state(pid)}")


def test_a_stale_child_is_killed_a_fresh_one_and_strangers_are_not(tmp_path):
    prefix = str(tmp_path / "progress")
    stale, fresh, stopped, sleeping = _spinning(), _child(), _child(), _child()
    os.kill(stopped.pid, signal.SIGSTOP)
    stranger = subprocess.Popen(  # a grandchild: not this "agent's" child, whatever its file says
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; p=subprocess.Popen(['sleep','120']); print(p.pid, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    grandchild = int(stranger.stdout.readline())
    _settled(sleeping.pid, "S")  # asleep in time.sleep, not still importing
    _settled(stopped.pid, "T")
    try:
        _progress(prefix, 0, stale.pid, age=30.0)
        _progress(prefix, 1, fresh.pid, age=0.0)
        _progress(prefix, 2, stopped.pid, age=30.0)
        _progress(prefix, 3, grandchild, age=30.0)
        _progress(prefix, 4, 999999, age=30.0)  # a pid nobody has
        _progress(prefix, 7, sleeping.pid, age=15.0)  # asleep: waiting, maybe for a hung peer
        with open(f"{prefix}-5.json", "w") as f:
            f.write("not json")
        os.utime(f"{prefix}-5.json", (0, 0))
        os.mkfifo(f"{prefix}-6.json")  # never blocks the watchdog
        killed = HangWatchdog(prefix, 10.0, LOG).check()
        assert sorted((k["rank"], k["pid"]) for k in killed) == [(0, stale.pid), (2, stopped.pid)]
        assert {k["rank"]: k["state"] for k in killed}[2] == "T"
        assert stale.wait(timeout=10) == -signal.SIGKILL and stopped.wait(timeout=10) == -signal.SIGKILL
        assert fresh.poll() is None and process_state(grandchild) is not None
        assert not os.path.exists(f"{prefix}-0.json") and os.path.exists(f"{prefix}-1.json")
        assert HangWatchdog(prefix, 10.0, LOG).check() == []  # nothing more to kill
        # asleep past twice the bound: killed too
        _progress(prefix, 7, sleeping.pid, age=25.0)
        assert [(k["rank"], k["pid"], k["state"]) for k in HangWatchdog(prefix, 10.0, LOG).check()] == [
            (7, sleeping.pid, "S")
        ]
        assert sleeping.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (stale, fresh, stopped, stranger, sleeping):
            p.kill()
            p.wait()
        os.kill(grandchild, signal.SIGKILL)


def test_the_watchdog_refuses_a_bound_that_is_not_positive(tmp_path):
    with pytest.raises(ValueError, match="hang_timeout=0"):
        HangWatchdog(str(tmp_path / "p"), 0.0, LOG)


def test_a_worker_beats_into_its_file_and_a_pause_disarms_it(tmp_path, monkeypatch):
    prefix = str(tmp_path / "progress")
    monkeypatch.setattr(heartbeat, "_state", {})
    env = {"ELASTIC_EMB_PROGRESS_FILE": prefix, "LOCAL_RANK": "3"}
    path = f"{prefix}-3.json"
    heartbeat.beat(env)
    assert json.loads(open(path).read()) == {"pid": os.getpid()}
    os.utime(path, (0, 0))
    heartbeat._state["last"] = 0.0  # the next beat is due
    heartbeat.beat(env)
    assert time.time() - os.stat(path).st_mtime < 60
    heartbeat.pause()
    assert not os.path.exists(path)
    heartbeat.beat(env)  # the next commit arms it again
    assert os.path.exists(path)
    heartbeat.pause()


def test_without_an_agent_a_beat_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "_state", {})
    heartbeat.beat({"LOCAL_RANK": "0"})
    heartbeat.pause()
    assert heartbeat._state["path"] is None and list(tmp_path.iterdir()) == []


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["restart", "in_process"])
def test_a_stopped_worker_is_killed_as_hung_and_the_job_reforms_nothing_lost(cluster, mode):
    tmp, agents = cluster
    port = free_port()
    conf = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,hang_timeout=3"
    if mode == "in_process":
        conf += ",resize=in_process"
    kw = dict(worker="lifecycle", nnodes="1:2", conf=conf)
    agents.append(start_agent("a", tmp, port, **kw))
    agents.append(start_agent("b", tmp, port, **kw))
    # a commit complete on both ranks first (a stop during the first base would leave none)
    wait_for(
        lambda: (
            {
                r["rank"]
                for r in worker_records(tmp)
                if r["ev"] == "commit" and r["ws"] == 2 and r.get("committed", -1) >= 1
            }
            == {0, 1}
        ),
        90.0,
        "a complete commit at world size 2",
        agents,
    )
    b = agents[1]
    worker = next(r["pid"] for r in worker_records(tmp) if r["ev"] == "ready" and r["agent_pid"] == b.pid)
    t_stop = time.time()
    os.kill(worker, signal.SIGSTOP)
    # b's watchdog kills the stopped worker; the job goes on from its newest complete commit
    wait_for(
        lambda: any(e["event"] == "worker_hung" and e["pid"] == worker for e in events(tmp, "b")),
        90.0,
        "b's watchdog to kill the stopped worker",
        agents,
    )
    hung = next(e for e in events(tmp, "b") if e["event"] == "worker_hung" and e["pid"] == worker)
    assert hung["stopped"] and hung["stale_s"] > 3.0, hung
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_stop), 120.0, "world size 2 again", agents)
    ready = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > t_stop]
    assert ready and all(r["rows_ok"] for r in ready), ready
    assert all(a.proc.poll() is None for a in agents)
