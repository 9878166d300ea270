"""The end of a job while a node is still joining it (``resize=in_process``), on real torchrun agents.

A node whose agent joins the running round, or starts, after the running world's last step
boundary can never be included: the world finishes without it. That is no failure of the job.
The agents of the finished world mark it complete when their workers have all succeeded (torch
enters its exit barrier only then); a joiner's worker still waiting to be included reads the mark
and exits 0 (``job_complete_before_join``), and an agent that finds the rendezvous already closed
reads it and exits 0 (``job_finished_before_join``) instead of failing on torch's
``RendezvousClosedError``. The world's tables equal the single-process replay bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_emb.drill import verify
from elastic_emb.drill.store_server import wait_listening
from elastic_emb.examples import RECSYS
from elastic_emb.testing.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "helpers" / "late_joiner.py"
WAIT = 120.0  # bound of every wait below (a loaded 2-core machine: a torchrun start takes 3-10 s)
STEPS = 30
# Seconds per step while the slow file exists: the world's remaining steps then outlast WAIT, so it
# cannot finish before the joiner's agent is in its round however long that agent takes to start
# (the wait for it fails first, naming it). Removing the file ends the slow pace after one step.
SLOW_DELAY = 5.0


def _agent(
    out: Path,
    number: int,
    endpoint: str,
    env_extra: dict | None = None,
    max_restarts: int = 2,
    resize: str = "in_process",
) -> subprocess.Popen:
    """One torchrun agent (stock ``torch.distributed.run``, ``--rdzv-backend=elastic_emb``, in process
    unless ``resize`` says otherwise) running the packaged example through ``tests/helpers/late_joiner.py``."""
    state = out / "state" / f"node{number}"
    state.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "ELASTIC_EMB_", "MASTER_"))}
    env.update(
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        ELASTIC_EMB_NODE_ID=f"node{number}",
        ELASTIC_EMB_STATE_DIR=str(state),
        ELASTIC_EMB_BACKEND="gloo",
        ELASTIC_EMB_LOG_FORMAT="json",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO),
        **(env_extra or {}),
    )
    conf = {
        "join_timeout": 90,
        "last_call_timeout": 1,
        "close_timeout": 5,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
        "read_timeout": 60,
        "is_host": "false",
        "resize": resize,
        "event_file": str(out / f"events-node{number}.jsonl"),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=elastic_emb",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=late-joiner",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        "--local-addr=127.0.0.1",
        str(SCRIPT),
        "--steps",
        str(STEPS),
        "--batch",
        "64",
        "--user-rows",
        "512",
        "--item-rows",
        "512",
        "--seed",
        "0",
        "--step-delay",
        "0.05",
        "--out",
        str(out / "run"),
        "--checksums",
        "--slow-file",
        str(out / "slow"),
        "--slow-delay",
        str(SLOW_DELAY),
        "--drain-timeout",
        "60",
    ]
    log = open(out / f"node{number}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=str(out),
    )
    log.close()
    return proc


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _progress(out: Path, node: str) -> list[dict]:
    return [e for p in sorted((out / "run" / "events").glob(f"{node}-*.jsonl")) for e in _events(p)]


def _wait(pred, what: str, procs: dict, out: Path):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    logs = "\n".join(
        f"--- node{n} (rc {p.poll()}):\n{(out / f'node{n}.log').read_text(errors='replace')[-3000:]}"
        for n, p in procs.items()
    )
    raise AssertionError(f"timed out after {WAIT:g} s waiting for {what}\n{logs}")


@pytest.fixture
def cluster(tmp_path):
    procs: dict[int, subprocess.Popen] = {}
    port = free_port()
    store_log = open(tmp_path / "store.log", "wb")  # noqa: SIM115 - closed below
    store = subprocess.Popen(
        [sys.executable, "-m", "elastic_emb.drill.store_server", "--port", str(port), "--lifetime", "600"],
        stdout=store_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    store_log.close()
    try:
        wait_listening("127.0.0.1", port, store, timeout=60.0)
        yield tmp_path, f"127.0.0.1:{port}", procs
    finally:
        for p in [*procs.values(), store]:
            if p.poll() is None:
                os.killpg(p.pid, 9)
            p.wait(timeout=30)
        # torch starts each worker in a session of its own: kill the ones a progress file names
        for path in sorted((tmp_path / "run" / "events").glob("*.jsonl")):
            try:
                os.kill(int(path.stem.rsplit("-", 1)[1]), 9)
            except (ProcessLookupError, PermissionError, ValueError):
                pass


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nodes_joining_a_job_that_finishes_first_exit_zero(cluster):
    """A 1-node world trains; a second node's agent joins the running round, but its worker starts
    only after the world wrote its final tables (held back by ``late_joiner.py``): the world's agent
    marks the job complete, the joiner's worker reads the mark and exits 0, both agents exit 0. A
    third node's agent started after the job ended finds the rendezvous closed and exits 0 too,
    starting no worker. The world's tables equal the replay bit for bit."""
    out, endpoint, procs = cluster
    (out / "slow").touch()  # the world steps slowly until the joiner's agent is in its round
    procs[0] = _agent(out, 0, endpoint)
    _wait(lambda: [e for e in _progress(out, "node0") if e["event"] == "step"], "node0's first step", procs, out)
    procs[1] = _agent(out, 1, endpoint, {"LATE_JOINER_GATE": str(out / "run" / "final")})
    _wait(
        lambda: [e for e in _events(out / "events-node1.jsonl") if e["event"] == "joined_running_round"],
        "node1's agent to join the running round",
        procs,
        out,
    )
    (out / "slow").unlink()  # the world finishes now, before node1's worker even starts
    _wait(lambda: all(p.poll() is not None for p in procs.values()), "both agents to exit", procs, out)
    t_end = time.time()
    assert [procs[0].returncode, procs[1].returncode] == [0, 0], (out / "node1.log").read_text()[-3000:]

    world = _progress(out, "node0")
    assert [e for e in world if e["event"] == "final"] and not [e for e in world if e["event"] == "resized"], world[-3:]
    joiner = _progress(out, "node1")
    finished = [e for e in joiner if e["event"] == "job_complete_before_join"]
    assert len(finished) == 1 and "finished before this node could join" in finished[0]["reason"], joiner
    assert not [e for e in joiner if e["event"] in ("resize_fallback", "step", "start")], joiner
    marked = [e for e in _events(out / "events-node0.jsonl") if e["event"] == "job_complete_marked"]
    assert marked, "node0's agent did not mark the job complete"
    # The joiner was never waited for: it saw the mark well before its --drain-timeout (60 s) ran out.
    final_t = max(e["t"] for e in world if e["event"] == "final")
    assert finished[0]["t"] - final_t < 60.0, finished[0]["t"] - final_t

    # A node that comes after the end: the rendezvous is closed, the job marked complete.
    procs[2] = _agent(out, 2, endpoint)
    _wait(lambda: procs[2].poll() is not None, "node2's agent to exit", procs, out)
    assert procs[2].returncode == 0, (out / "node2.log").read_text()[-3000:]
    late = [e for e in _events(out / "events-node2.jsonl") if e["event"] == "job_finished_before_join"]
    ids = {
        e["node"] for n in (0, 1) for e in _events(out / f"events-node{n}.jsonl") if e["event"] == "rendezvous_round"
    }
    assert len(late) == 1 and json.loads(late[0]["mark"])["node"] in ids, (late, ids)
    assert not _progress(out, "node2"), "node2's agent started a worker"

    v = verify(out / "run", RECSYS)
    assert v["ok"] and v["step"] == STEPS - 1 and v["step_checksums_checked"] >= STEPS, v
    print(
        f"\nlate joiner: its worker exited {finished[0]['t'] - final_t:.2f} s after the world's final tables; "
        f"a node started after the end exited 0 in {time.time() - t_end:.1f} s"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_after_the_end_of_a_restart_mode_job_exits_zero(cluster):
    """``resize=restart``: the agents of a finished job mark it complete too (at torch's own exit
    barrier), so a node whose agent starts after the end finds the rendezvous closed, reads the
    mark and exits 0 (``job_finished_before_join``), starting no worker: not torch's
    ``RendezvousClosedError``."""
    out, endpoint, procs = cluster
    procs[0] = _agent(out, 0, endpoint, resize="restart")
    _wait(lambda: procs[0].poll() is not None, "node0's agent to finish the job", procs, out)
    assert procs[0].returncode == 0, (out / "node0.log").read_text()[-3000:]
    assert [e for e in _events(out / "events-node0.jsonl") if e["event"] == "job_complete_marked"]
    procs[1] = _agent(out, 1, endpoint, resize="restart")
    _wait(lambda: procs[1].poll() is not None, "node1's agent to exit", procs, out)
    assert procs[1].returncode == 0, (out / "node1.log").read_text()[-3000:]
    late = [e for e in _events(out / "events-node1.jsonl") if e["event"] == "job_finished_before_join"]
    assert len(late) == 1 and json.loads(late[0]["mark"])["node"] in {
        e["node"] for e in _events(out / "events-node0.jsonl") if e["event"] == "rendezvous_round"
    }, late
    assert not _progress(out, "node1"), "node1's agent started a worker"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_that_failed_stays_a_failure_for_a_node_that_comes_after_it(cluster):
    """The counter-case: node0's worker fails (exit 1, no restarts left), so its agent fails and
    closes the rendezvous without entering the exit barrier: no mark. A node that comes after it
    finds the rendezvous closed and fails on torch's ``RendezvousClosedError``, as before: only a
    job that finished lets a late node exit 0."""
    out, endpoint, procs = cluster
    procs[0] = _agent(out, 0, endpoint, {"LATE_JOINER_FAIL": "1"}, max_restarts=0)
    _wait(lambda: procs[0].poll() is not None, "node0's agent to fail", procs, out)
    assert procs[0].returncode != 0
    assert not [e for e in _events(out / "events-node0.jsonl") if e["event"] == "job_complete_marked"]
    procs[1] = _agent(out, 1, endpoint)
    _wait(lambda: procs[1].poll() is not None, "node1's agent to exit", procs, out)
    assert procs[1].returncode != 0
    agent1 = _events(out / "events-node1.jsonl")
    failed = [e for e in agent1 if e["event"] == "rendezvous_failed"]
    assert failed and "RendezvousClosedError" in failed[0]["error"], agent1
    assert not [e for e in agent1 if e["event"] == "job_finished_before_join"], agent1


def test_the_mark_is_read_only_for_a_closed_rendezvous_and_only_when_validly_signed():
    """``closed_and_complete``: a closed rendezvous with the signed mark is a finished job; without
    the mark, with a mark that is not validly signed, or for any other error, it is not."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    from elastic_emb.events import event_logger
    from elastic_emb.rdzv.job_complete import closed_and_complete, complete_key, mark_complete
    from elastic_emb.rdzv.signing import Signer

    store, log, signer = dist.HashStore(), event_logger(None), Signer(b"s" * 32)
    closed = RendezvousClosedError()
    assert not closed_and_complete(closed, lambda: store, signer, "job", log)  # no mark yet
    store.set(complete_key("job"), b'{"node": "forged"}')  # unsigned, with a job secret set
    assert not closed_and_complete(closed, lambda: store, signer, "job", log)
    mark_complete(store, signer, "job", node="a", round=0, generation=0)
    assert closed_and_complete(closed, lambda: store, signer, "job", log)
    assert not closed_and_complete(RendezvousTimeoutError(), lambda: store, signer, "job", log)
    assert not closed_and_complete(closed, lambda: store, signer, "another-job", log)

    def gone():
        raise ConnectionError("store gone with the agent that hosted it")

    assert not closed_and_complete(closed, gone, signer, "job", log)  # unreadable: torch's error stands
