"""Real torchrun agents on loopback for the rendezvous tests and bench/resize.py.

``Agent`` starts ``python -m torch.distributed.run`` (stock torchrun) running
``tests/helpers/rdzv_worker.py`` in a process group of its own, so a test can signal exactly one agent,
and ``kill_all`` in teardown can SIGKILL each agent's whole group (the agent and, since torch
starts workers in new sessions, the workers tracked by pid) so nothing outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "helpers", "rdzv_worker.py")

FAST_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"

# For the tests that assert the exact sequence of rounds across a scale-up. After the drain, the
# round restarts when the last running agent leaves it; the first node back sets torch's last-call
# deadline, and every other node (the joiner, the other restarting agent) must join before it,
# else the round completes without it and a second drain and round follow (seen at load 12 and
# 16: "gen 3 resumed at {260}, expected 258", gen 2 being a round without one of the old two,
# whose drained worker took 5-14 s to exit after the agent's SIGTERM; it now exits at once,
# rdzv_worker.py). With that, the three agents of the scale-up to 3 joined within
# 0.5 s of each other at load 20; 3 s of last call is the margin, and costs 2 s on each round
# below max_nodes (a round that reaches it completes at once, scale-downs complete early).
JOIN_CONF = FAST_CONF.replace("last_call_timeout=1", "last_call_timeout=3")
# That margin makes the usual sequence likely, not certain: torch completes a round at its last
# call, and a node that comes later (an agent starved for seconds) waits in that round's wait list
# and comes in by one more drain and round. So the scale-up checks take every round the agents
# report (each scale-up drained, nothing lost), not a fixed number of them.


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log_path: str
    port: int
    worker_pids_seen: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> float:
        t = time.time()
        os.kill(self.proc.pid, sig)
        return t

    def output(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError:
            return ""


def start_agent(
    name: str,
    tmp: str,
    port: int,
    *,
    backend: str = "elastic_emb",
    nnodes: str = "1:3",
    run_id: str = "rdzvtest",
    conf: str = FAST_CONF,
    mode: str = "busy",
    step_s: float = 0.05,
    inner: str = "c10d",
    drain: bool = True,
    drain_timeout: float = 10.0,
    endpoint: str | None = None,
    worker: str = "plain",
    extra_env: dict | None = None,
    worker_args: tuple[str, ...] = (),
    script: str = WORKER,
) -> Agent:
    """Start one torchrun agent (one worker per node) as a real subprocess.

    ``worker``: ``plain`` (an all_reduce per step) or ``lifecycle`` (elastic_emb's Lifecycle over
    an EmbContext, rows verified at every start); see tests/helpers/rdzv_worker.py.
    ``worker_args``: appended to the worker's command line (the worker ignores them; they are
    part of the job's fingerprint).
    ``script``: the training script torchrun runs; default tests/helpers/rdzv_worker.py
    (bench/resize.py ``--scenario readme`` runs the packaged example with its own arguments)."""
    log_dir = os.path.join(tmp, "workers")
    os.makedirs(log_dir, exist_ok=True)
    rdzv_conf = conf
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_EMB_", "TORCHELASTIC_", "RDZV_TEST_"))}
    if backend == "elastic_emb":
        rdzv_conf += (
            f",inner={inner},event_file={os.path.join(tmp, 'events-' + name + '.jsonl')}"
            f",drain={int(drain)},drain_timeout={drain_timeout}"
        )
    else:
        # The stock baseline needs this to survive a resize at all (FACTS item 1).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(
        RDZV_TEST_LOG_DIR=log_dir,
        RDZV_TEST_MODE=mode,
        RDZV_TEST_STEP_S=str(step_s),
        PYTHONPATH=REPO,
        ELASTIC_EMB_LOG_FORMAT="json",
        ELASTIC_EMB_BACKEND="gloo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        RDZV_TEST_WORKER=worker,
        ELASTIC_EMB_STATE_DIR=os.path.join(tmp, "state"),
        TMPDIR=tmp,  # what a SIGKILLed agent leaves there (its drain-count file, torch's logs) stays in the test's dir
    )
    env.update(extra_env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint or f'127.0.0.1:{port}'}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={rdzv_conf}",
        "--max-restarts=3",
        "--monitor-interval=0.1",
        "--local-addr=127.0.0.1",
        script,
        *worker_args,
    ]
    log_path = os.path.join(tmp, f"agent-{name}.log")
    out = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    out.close()
    return Agent(name, proc, log_path, port)


class _LogTail:
    """What one worker log held when last read: the bytes consumed (whole lines only) and their
    records, so the next read parses only what was appended since."""

    __slots__ = ("ino", "offset", "records")

    def __init__(self, ino: int) -> None:
        self.ino, self.offset, self.records = ino, 0, []


_tails: dict[str, dict[str, _LogTail]] = {}  # log dir -> file name -> tail
_merged: dict[str, list[dict]] = {}  # log dir -> every record read so far, in time order
_TAILED_DIRS = 8  # the dirs of the last few tests; older ones are dropped


def worker_records(tmp: str) -> list[dict]:
    """Every record every worker logged, in time order.

    Tests poll this every 0.05 s while busy workers append two records per step each: parsing
    every log from the start each time cost tens of ms per call after a minute of steps (the
    pytest process then took half a core from the agents and workers it waits for). Each file is
    read from where the previous call stopped, whole lines only (a line still being written, or
    cut by a kill, is not consumed: the same records as a full re-read)."""
    log_dir = os.path.join(tmp, "workers")
    names = sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []
    tails = _tails.setdefault(log_dir, {})
    merged = _merged.setdefault(log_dir, [])
    if len(_tails) > _TAILED_DIRS:
        oldest = next(iter(_tails))
        del _tails[oldest], _merged[oldest]
    new: list[dict] = []
    rebuild = any(name not in names for name in tails)  # a log went away: start over from what is there
    for name in names:
        path = os.path.join(log_dir, name)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                tail = tails.get(name)
                if tail is None or tail.ino != st.st_ino or st.st_size < tail.offset:  # new or replaced
                    rebuild = rebuild or tail is not None
                    tail = tails[name] = _LogTail(st.st_ino)
                if st.st_size == tail.offset:
                    continue
                f.seek(tail.offset)
                data = f.read(st.st_size - tail.offset)
        except OSError:
            continue
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            tail.records.append(record)
            new.append(record)
        tail.offset += end
    if rebuild:
        for name in [n for n in tails if n not in names]:
            del tails[name]
        merged[:] = sorted((r for t in tails.values() for r in t.records), key=_time_of)
    elif new:
        new.sort(key=_time_of)
        if merged and new[0]["t"] < merged[-1]["t"]:  # interleaves with what was read: merge
            merged.extend(new)
            merged.sort(key=_time_of)
        else:
            merged.extend(new)
    return list(merged)


def _time_of(record: dict) -> float:
    return record["t"]


def events(tmp: str, name: str) -> list[dict]:
    path = os.path.join(tmp, f"events-{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(pred, timeout: float, what: str, agents: list[Agent] = (), pause: float = 0.05):
    """Poll ``pred()`` until it returns a truthy value or ``timeout`` s pass (then fail, with logs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(pause)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{failure_report(agents)}")


# A step's own log lines: every step writes them, so a report of the last lines would show only them.
_PER_STEP = ('"event": "commit_complete"', '"event": "lifecycle.commit"', '"event": "snapshot_pruned"')


def failure_report(agents: list[Agent], lines: int = 40) -> str:
    """What a timed-out wait shows: per agent, its state and the last ``lines`` lines of its log that
    are not per-step lines (the events of a re-form, a signal, a restart, a traceback), then the last
    lines of its event file and the workers' records other than their steps."""
    parts = []
    for a in agents:
        kept = [ln for ln in a.output().splitlines() if not any(m in ln for m in _PER_STEP)]
        parts.append(f"--- agent {a.name} (pid {a.pid}, rc {a.proc.poll()}), log without per-step lines:")
        parts.extend(ln[:400] for ln in kept[-lines:])
        tmp = os.path.dirname(a.log_path)
        path = os.path.join(tmp, f"events-{a.name}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"--- events of agent {a.name}:")
                parts.extend(ln.rstrip()[:400] for ln in f.readlines()[-lines // 2 :])
    if agents:
        tmp = os.path.dirname(agents[0].log_path)
        recs = [r for r in worker_records(tmp) if r.get("ev") not in ("commit", "start")]
        parts.append("--- worker records other than steps:")
        parts.extend(json.dumps(r)[:400] for r in recs[-lines:])
    return "\n".join(parts)


def first_commit_at(tmp: str, *, world_size: int, after: float) -> float | None:
    """Time of the first step committed by a world of ``world_size`` after time ``after``."""
    for r in worker_records(tmp):
        if r["ev"] == "commit" and r["ws"] == world_size and r["t"] > after:
            return r["t"]
    return None


def kill_all(agents: list[Agent], tmp: str | None = None) -> None:
    """SIGKILL every agent's process group and every worker pid the logs name (teardown)."""
    pids = set()
    if tmp is not None:
        pids = {r["pid"] for r in worker_records(tmp)}
    for a in agents:
        try:
            os.killpg(a.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # torch starts each worker as a session leader
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for a in agents:
        try:
            a.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
