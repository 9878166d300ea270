"""One run id, one job: an agent whose job fingerprint differs from the running job's is refused
at its first rendezvous in one line naming the difference, and the running job goes on.

The record and its comparison against a real TCPStore, and real torchrun agents: a second job
started by mistake with the running job's run id and endpoint."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import pytest
import structlog
import torch.distributed as dist

import elastic_emb
from elastic_emb.rdzv.fingerprint import MAX_ARGS, JobFingerprint, check_fingerprint, live
from elastic_emb.rdzv.keys import fingerprint_key
from elastic_emb.rdzv.signing import Signer
from elastic_emb.testing.ports import free_port
from tests.helpers.agents import Agent, events, first_commit_at, kill_all, start_agent, wait_for, worker_records

LOG = structlog.get_logger("test")
SECRET = "0123456789abcdef0123456789abcdef"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _fp(*args: str, script: str = "train.py", env: dict | None = None, resize: str = "restart"):
    return JobFingerprint.of_agent(resize, [TORCHRUN, "--nnodes=1:2", "--rdzv-id=job", script, *args], env or {})


def test_the_fingerprint_is_read_from_torchruns_command_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    fp = _fp("--user-rows", "1000", script=str(script))
    assert fp.version == elastic_emb.__version__ and fp.resize == "restart" and fp.user is None
    assert fp.script == str(script) and fp.args == ("--user-rows", "1000")
    assert len(fp.script_digest) == 64 and len(fp.args_digest) == 64
    # python -m torch.distributed.run reads the same; a module has no script digest
    run_py = os.path.join("/x", "torch", "distributed", "run.py")
    same = JobFingerprint.of_agent("restart", [run_py, "--rdzv-id=other", str(script), "--user-rows", "1000"], {})
    assert same == fp
    module = JobFingerprint.of_agent("restart", [TORCHRUN, "-m", "pkg.train", "--a"], {})
    assert module.script == "pkg.train" and module.script_digest is None and module.args == ("--a",)
    # not torchrun's command line: nothing to compare, unless the user names the job
    assert JobFingerprint.of_agent("restart", [sys.executable, "-m", "pytest"], {}) is None
    user = JobFingerprint.of_agent("restart", ["anything"], {"ELASTIC_EMB_JOB_FINGERPRINT": "cfg-7"})
    assert user.user == "cfg-7" and user.script is None and user.args == ()
    # the script's content is part of it: another version of the code is another job
    script.write_text("print(2)\n")
    changed = _fp("--user-rows", "1000", script=str(script))
    assert changed.script_digest != fp.script_digest
    assert changed.difference(fp).startswith("script's content (SHA-256): ")


@pytest.mark.parametrize(
    ("mine", "running", "clause"),
    [
        (
            ("--user-rows", "2000"),
            ("--user-rows", "1000"),
            "worker argument 2: '--user-rows 2000' here, '--user-rows 1000' in the running job",
        ),
        (("--a", "1", "--b"), ("--a", "1"), "worker arguments: 3 here, 2 in the running job"),
        (("--x",), ("--y",), "worker argument 1: '--x' here, '--y' in the running job"),
    ],
)
def test_the_difference_is_named(mine, running, clause):
    assert _fp(*mine).difference(_fp(*running)) == clause
    assert _fp(*mine).difference(_fp(*mine)) is None


def test_differences_past_the_kept_arguments_and_in_the_resize_mode_are_named():
    base = [str(i) for i in range(MAX_ARGS)]
    assert _fp(*base, "a").difference(_fp(*base, "b")) == "worker arguments beyond the first 256 differ"
    assert _fp(resize="in_process").difference(_fp()) == "resize: 'in_process' here, 'restart' in the running job"
    user = JobFingerprint.of_agent("restart", [], {"ELASTIC_EMB_JOB_FINGERPRINT": "a"})
    other = JobFingerprint.of_agent("restart", [], {"ELASTIC_EMB_JOB_FINGERPRINT": "b"})
    assert user.difference(other) == "ELASTIC_EMB_JOB_FINGERPRINT: 'a' here, 'b' in the running job"


@pytest.fixture
def store():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    yield server
    del server


def _check(store, signer, mine, nodes):
    return check_fingerprint(store, signer, "job", mine, lambda: nodes, LOG, expiry_s=6.0)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_first_agent_publishes_later_ones_match_and_another_job_is_refused(store, secret):
    signer = Signer(secret.encode() if secret else None)
    job1, job2 = _fp("--user-rows", "1000"), _fp("--user-rows", "2000")
    assert _check(store, signer, job1, []) == "published"
    assert _check(store, signer, job1, ["n1"]) == "matched"
    with pytest.raises(ValueError) as info:
        _check(store, signer, job2, ["n1", "n2"])
    line = str(info.value)
    assert "\n" not in line and line.startswith("--rdzv-id 'job' is taken by a running job (nodes n1, n2)")
    assert "'--user-rows 2000' here, '--user-rows 1000' in the running job" in line and "own --rdzv-id" in line
    assert (
        JobFingerprint.model_validate_json(signer.verify(fingerprint_key("job"), store.get(fingerprint_key("job")))[0])
        == job1
    )
    # once no node of the running job is alive, the next job replaces its record
    assert _check(store, signer, job2, []) == "published"
    assert _check(store, signer, job2, ["n3"]) == "matched"


@pytest.mark.parametrize(
    "forged",
    [b"not json", b'{"version": "0.1.0"}', b"x" * (300 * 1024), b'{"version": 1, "resize": "restart", "args": []}'],
)
def test_a_record_that_is_not_a_fingerprint_is_replaced_not_trusted(store, forged):
    job = _fp("--a")
    store.set(fingerprint_key("job"), forged)
    assert _check(store, Signer(None), job, ["n1"]) == "published"
    assert _check(store, Signer(None), job, ["n1"]) == "matched"


def test_with_a_secret_an_unsigned_record_is_not_trusted(store):
    # a store writer plants the running job's "fingerprint" to lock out its real nodes
    signer = Signer(SECRET.encode())
    store.set(fingerprint_key("job"), _fp("--forged").model_dump_json())
    assert _check(store, signer, _fp("--real"), ["n1"]) == "published"
    assert _check(store, signer, _fp("--real"), ["n1"]) == "matched"


def test_live_nodes_are_those_with_a_fresh_heartbeat_other_than_this_one():
    now = time.time()
    beats = {"a": now, "b": now - 100.0, "me": now}
    assert live(beats, ["a", "b", "c", "me"], 6.0, "me") == ["a"]


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


@pytest.mark.slow
def test_a_second_job_with_the_same_run_id_is_refused_and_the_running_job_goes_on(cluster):
    tmp, agents = cluster
    port = free_port()
    job1 = ("--user-rows", "1000")
    agents.append(start_agent("a", tmp, port, worker="lifecycle", nnodes="1:2", worker_args=job1))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), 90.0, "job 1 at world size 1", agents)

    # Job 2, launched by mistake with job 1's run id and endpoint and another table size.
    t_wrong = time.time()
    wrong = start_agent("w", tmp, port, worker="lifecycle", nnodes="1:2", worker_args=("--user-rows", "2000"))
    agents.append(wrong)
    wait_for(lambda: wrong.proc.poll() is not None, 120.0, "job 2's agent to be refused", agents)
    out = wrong.output()
    assert wrong.proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("elastic_emb rendezvous: --rdzv-id 'rdzvtest' is taken by a running job"), last
    assert "'--user-rows 2000' here, '--user-rows 1000' in the running job" in last, last
    assert any(e["event"] == "job_fingerprint_refused" for e in events(tmp, "w"))

    # Job 1 never noticed: no new round, and it kept committing at world size 1 ...
    rounds = [e for e in events(tmp, "a") if e["event"] == "rendezvous_round"]
    assert len(rounds) == 1, rounds
    t_after = time.time()
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=t_after), 90.0, "job 1 to go on", agents)
    assert not [r for r in worker_records(tmp) if r["ev"] == "ready" and r["t"] > t_wrong]
    # ... and a node of job 1 itself still joins: its rows come back bit for bit at world size 2
    t_b = time.time()
    agents.append(start_agent("b", tmp, port, worker="lifecycle", nnodes="1:2", worker_args=job1))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_b), 120.0, "job 1 at world size 2", agents)
    ready = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["ws"] == 2 and r["t"] > t_b]
    assert len(ready) == 2 and all(r["rows_ok"] for r in ready), ready
    assert any(e["event"] == "job_fingerprint_matched" for e in events(tmp, "b"))
    agents[0].signal(signal.SIGTERM)
