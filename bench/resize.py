"""Fault-to-first-step of an elastic resize: the elastic_emb backend against stock c10d, same run.

One sequence per backend and run, with real torchrun agents on loopback (one gloo worker per
node, tests/helpers/rdzv_worker.py, 50 ms steps), elastic_emb with
``keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1``, stock c10d with
``keep_alive_max_attempt=3`` (with 2 it split-brains on this machine: torch's keep-alive timer
lets a live node's heartbeat age to ~2 intervals, a joiner declares it dead and forms a world of
its own, so two worlds train side by side; elastic_emb refreshes its heartbeat every half
interval):

1. two nodes running; a third agent starts: **scale-up**, timed from the agent's start to the
   first step committed at world size 3 (includes the joiner's own torchrun start);
2. SIGTERM of that agent: **scale-down (SIGTERM)**, timed from the signal to the first step at
   world size 2;
3. SIGKILL of the second node: **scale-down (SIGKILL)**, to the first step at world size 1. With
   ``--kill node`` (the default) its agent and its worker at once (a node lost: no goodbye, no
   orphan report; busy workers are in a collective or a commit when it lands); with ``--kill
   agent`` the agent alone (its orphaned worker reports the node dead).

Backend ``elastic_emb:in_process`` is the elastic_emb backend with ``resize=in_process`` and the
lifecycle worker (``docs/RESIZE.md``): the joiner is included by the running workers, the
scale-downs re-form the survivors in their processes. Every backend also reports the survivors'
**pause**: the last step committed at the old world size to the first step at the new one, and
(busy workers) the **longest step** in the 1.5 s after that first step (commit to commit): a
commit that goes to the background after a re-form must not just move the pause to the steps
after it.
``--table-mb`` sizes the lifecycle worker's table (fp32, 64 columns; 0: the tests' 64 x 4
table) and puts the snapshots on /dev/shm.

``--mode idle`` runs with idle workers (one step per generation, then no collective; the
drain before the scale-up then ends by its 1 s timeout). A resize that does not happen within ``--cap`` seconds is recorded as ``null``
(the stock agent never notices a dead node while its workers are healthy, FACTS item 3) and the
sequence ends there. For the elastic_emb backend each fault is split at the agent's
``rendezvous_round`` event: agent side (fault to new round) and worker side (round to first
step: torchrun starting Python, importing torch, agreeing, gloo init).

``--scenario readme`` runs the README's example instead (what ``make demo`` trains:
``elastic_emb/examples/recsys.py`` under ``run_elastic``, its ``user`` table ``--user-rows`` x 64
fp32, default 1,048,576 x 64 = 256 MiB, the ``item`` table 4096 x 64, the tower with Adam and the
sampler as app state; 50 ms steps, ``--step-delay 0.05``) on at most TWO torchrun agents in
process (``resize=in_process``), each node with its own node id and snapshot directory on
/dev/shm. Per run: node0 trains alone; node1's agent starts (**join** 1 -> 2); node1 is
SIGKILLed mid-run, its agent and worker at once (``--kill agent``: the agent alone), once both
ranks' commits of that world are complete (**kill** 2 -> 1); node2's agent starts (**rejoin**
1 -> 2 after the kill). Measured on the survivor, node0, from the example's own progress lines
(``<out>/events/*.jsonl``, read with the drills' ``EventReader`` and mapped onto this bench's
records): the kill to its next completed step, and for every resize its pause (its last step at
the old size to its first at the new), with the phases of its re-form (the ``resized`` line:
detect, drain, decide, teardown, agree, construct, restore) and the first step after it (which
captures the new world's first base). Median, mean, p99 (= max below 100 runs) and max over the
runs; targets: kill to next step and join pause <= 0.3 s.

    .venv/bin/python -m bench.resize --runs 3 --out out/resize.json
    .venv/bin/python bench/resize.py --runs 1 --backends elastic_emb --cap 30 --out out/resize_smoke.json
    .venv/bin/python -m bench.resize --scenario readme --runs 3 --out out/resize-readme.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

# bench/ (for _report) and the repository root (for tests.helpers), as a script or as -m bench.*
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_BENCH, os.path.dirname(_BENCH)]
from _report import table, write_json  # noqa: E402

from elastic_emb.examples import RECSYS  # noqa: E402
from elastic_emb.testing.ports import free_port  # noqa: E402
from tests.helpers.agents import (  # noqa: E402
    FAST_CONF,
    events,
    first_commit_at,
    kill_all,
    start_agent,
    wait_for,
    worker_records,
)

SCENARIOS = ("scale_up", "scale_down_sigterm", "scale_down_sigkill")
# The set-up before the first measure (two worlds started, not timed): at load 15 on the 2-core VM a
# first 256 MB world took over 60 s (torchrun, import torch, the first base); a set-up that does not
# finish in time ends that run (reported, left out of the medians), not the invocation.
START_WAIT = 180.0


def _round_after(tmp: str, t: float) -> float | None:
    for e in events(tmp, "a"):
        if e["event"] == "rendezvous_round":
            ts = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            if ts > t:
                return ts
    return None


def _until(find, cap: float) -> float | None:
    """Poll ``find()`` every 20 ms until it returns a time, or None after ``cap`` seconds."""
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        t = find()
        if t is not None:
            return t
        time.sleep(0.02)
    return None


def import_floor() -> float:
    """Seconds a fresh interpreter takes to import torch and elastic_emb: the floor under every
    restart's worker side (torchrun starts each worker as a new process)."""
    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, torch.distributed, elastic_emb.lifecycle.manager, elastic_emb.watch.watcher",
        ],
        check=True,
        timeout=120,
    )
    return time.perf_counter() - t


def _last_commit_before(records: list[dict], ws: int, before: float) -> float | None:
    times = [r["t"] for r in records if r["ev"] == "commit" and r["ws"] == ws and r["t"] <= before]
    return max(times) if times else None


def _longest_gap(records: list[dict], ws: int, t: float, window: float) -> float | None:
    """The longest time between consecutive commits of one rank at world size ``ws`` within
    ``window`` seconds after ``t`` (the first step at the new size): a commit that goes to the
    background after a re-form must not just move the pause to the next steps."""
    per: dict = {}
    for r in records:
        if r["ev"] == "commit" and r["ws"] == ws and t <= r["t"] <= t + window:
            per.setdefault(r["rank"], []).append(r["t"])
    gaps = [b - a for ts in per.values() for a, b in zip(ts, ts[1:])]
    return max(gaps) if gaps else None


def _worker_of(tmp: str, agent) -> int | None:
    ready = [r["pid"] for r in worker_records(tmp) if r["ev"] == "ready" and r.get("agent_pid") == agent.pid]
    return ready[-1] if ready else None


def sequence(
    backend: str, mode: str, cap: float, conf: str, worker: str, kill: str = "node", table_mb: int = 0
) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"resize-{backend.replace(':', '-')}-")
    extra: dict = {}
    if table_mb:
        shm = tempfile.mkdtemp(prefix="resize-bench-", dir="/dev/shm")
        extra = {
            "RDZV_TEST_ROWS": str(table_mb * 2**20 // (64 * 4)),
            "RDZV_TEST_DIM": "64",
            "ELASTIC_EMB_STATE_DIR": shm,
        }
    if backend == "elastic_emb:in_process":
        backend, conf, worker = "elastic_emb", conf + ",resize=in_process", "lifecycle"
    port = free_port()
    agents = []
    out: dict = {s: None for s in SCENARIOS}
    split: dict = {}
    pause: dict = {}
    gap: dict = {}  # busy: the longest step (commit to commit) in the 1.5 s after the first at the new size
    try:
        kw = dict(
            backend=backend,
            mode=mode,
            drain_timeout=1.0 if mode == "idle" else 10.0,
            conf=conf,
            worker=worker,
            extra_env=extra,
        )
        agents.append(start_agent("a", tmp, port, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), START_WAIT, "world size 1", agents)
        agents.append(start_agent("b", tmp, port, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=2, after=0), START_WAIT, "world size 2", agents)
        time.sleep(1.0)
        t0 = time.time()
        agents.append(start_agent("c", tmp, port, **kw))
        t = _until(lambda: first_commit_at(tmp, world_size=3, after=t0), cap)
        if t is None:
            return {"results": out, "split": split, "pause": pause, "gap": gap}
        out["scale_up"] = t - t0
        last = _last_commit_before(worker_records(tmp), 2, t)
        if last is not None:
            pause["scale_up"] = t - last  # the running workers' pause (a restart: every worker's)
        time.sleep(1.5)
        if mode == "busy":
            gap["scale_up"] = _longest_gap(worker_records(tmp), 3, t, 1.5)
        for scenario, victim, sig, ws in (
            ("scale_down_sigterm", agents[2], signal.SIGTERM, 2),
            ("scale_down_sigkill", agents[1], signal.SIGKILL, 1),
        ):
            worker_pid = _worker_of(tmp, victim) if sig == signal.SIGKILL and kill == "node" else None
            t0 = victim.signal(sig)
            if worker_pid is not None:
                os.kill(worker_pid, signal.SIGKILL)  # the whole node: agent and worker
            t = _until(lambda: first_commit_at(tmp, world_size=ws, after=t0), cap)
            if t is None:
                break
            out[scenario] = t - t0
            last = _last_commit_before(worker_records(tmp), ws + 1, t0)
            if last is not None:
                pause[scenario] = t - last
            if backend == "elastic_emb":
                r = _round_after(tmp, t0)
                if r is not None:
                    split[scenario] = {"agent_s": r - t0, "worker_s": t - r}
            time.sleep(1.5)
            if mode == "busy":
                gap[scenario] = _longest_gap(worker_records(tmp), ws, t, 1.5)
        return {"results": out, "split": split, "pause": pause, "gap": gap}
    finally:
        kill_all(agents, tmp)
        if extra.get("ELASTIC_EMB_STATE_DIR"):
            shutil.rmtree(extra["ELASTIC_EMB_STATE_DIR"], ignore_errors=True)


# -- --scenario readme: the README's example on two agents, in process ------------------------------

README_DIM = 64  # columns of the example's tables (fp32): the user table is --user-rows x 64
README_STEP_S = 0.05  # the example's --step-delay: the 50 ms steps of this bench's other workers
README_STEPS = 10**6  # the job's steps: more than any run takes (the run ends by killing the agents)
README_TARGET_S = 0.3  # issue 34: kill to the survivor's next step, and a join's pause
SURVIVOR = "node0"  # trains from the first step to the last, in one process
# The figures per run: name -> what it is (the summary's rows, in this order).
README_MEASURES = {
    "kill_to_step": "SIGKILL of node1 (2 -> 1) to the survivor's next step",
    "kill_pause": "SIGKILL: the survivor's last step at 2 to its first at 1",
    "join_pause": "join 1 -> 2 (node1 starts): the survivor's pause",
    "rejoin_pause": "join 1 -> 2 after the kill (node2 starts): the survivor's pause",
    "join_to_step": "join: node1's agent start to the first step at 2",
    "rejoin_to_step": "rejoin: node2's agent start to the first step at 2",
}
README_RESIZES = ("join", "kill", "rejoin")
# The survivor's re-form, from its ``resized`` line (ResizeEvent, seconds): the caller's phases,
# then the lifecycle's.
REFORM_PHASES = (
    "detect_s",
    "drain_s",
    "decide_s",
    "teardown_s",
    "agreement_s",
    "construct_s",
    "restore_s",
    "transfer_s",
    "total_s",
)


class ExampleRecords:
    """The example's progress lines (``<run>/events/*.jsonl``, ``elastic_emb.examples.loop.Progress``)
    as this bench's worker records: read as they are written by the drills' ``EventReader``, each
    line gets ``ev`` (``commit`` for a ``step`` line, ``reformed`` for ``resized``, else its event)
    and ``ws`` (its world size), so ``_last_commit_before`` and ``_longest_gap`` read them as they
    read tests/helpers/rdzv_worker.py's.

    Args:
        run: the example's ``--out`` directory.
    """

    RENAME = {"step": "commit", "resized": "reformed"}

    def __init__(self, run: Path) -> None:
        from elastic_emb.drill.orchestrator import EventReader  # imports torch: only this scenario pays

        self.reader = EventReader(run / "events")
        self.records: list[dict] = []

    def __call__(self, node: str | None = None) -> list[dict]:
        """Every record so far, in time order; ``node``: only that node's."""
        new = self.reader.poll()
        if new:
            self.records.extend({**e, "ev": self.RENAME.get(e["event"], e["event"]), "ws": e.get("world")} for e in new)
            self.records.sort(key=lambda r: r["t"])
        return [r for r in self.records if node is None or r.get("node") == node]


def _first_step_at(records: list[dict], ws: int, after: float) -> float | None:
    times = [r["t"] for r in records if r["ev"] == "commit" and r["ws"] == ws and r["t"] > after]
    return min(times) if times else None


def _settled(records: list[dict], nodes: tuple[str, ...], ws: int, after: float) -> bool:
    """Whether every node in ``nodes`` has stepped at world size ``ws`` since ``after`` with a
    complete commit there (its ``committed`` step reaches its first step of that world): the
    first base of a new world is written in the background, and a kill before it is complete
    would also measure a restore from the previous world's commit."""
    for node in nodes:
        mine = [
            r for r in records if r.get("node") == node and r["ev"] == "commit" and r["ws"] == ws and r["t"] > after
        ]
        if not mine or max(r.get("committed", -1) for r in mine) < min(r["step"] for r in mine):
            return False
    return True


def _reform(records: list[dict], after: float, first: float, last: float | None) -> dict:
    """The survivor's re-form between ``after`` (the fault or the joiner's start) and ``first`` (its
    first step at the new size; ``last``: its last step at the old size): the phases of its
    ``resized`` line, ``first_step_s`` (that line to the first step's line: the step, and its
    commit capturing the new world's first base), ``first_commit_s`` (the first step's time in
    ``commit()``), ``rest_s`` (the pause less those: for a kill the step that failed and the time
    to notice, for a join about 0) and the restore's tiers."""
    reformed = [r for r in records if r["ev"] == "reformed" and after < r["t"] <= first]
    if not reformed:
        return {}
    line = reformed[-1]
    event = line.get("restore") or {}
    out = {k: event.get(k) for k in REFORM_PHASES}
    out["first_step_s"] = first - line["t"]
    timed = [event.get(k) for k in ("detect_s", "drain_s", "decide_s", "total_s")]
    if last is not None and None not in timed:
        out["rest_s"] = (first - last) - sum(timed) - out["first_step_s"]
    step = [r for r in records if r["ev"] == "commit" and r["t"] == first]
    out["first_commit_s"] = ((step[0].get("commit") or {}).get("seconds")) if step else None
    out["source_tiers"] = event.get("source_tiers")
    out["failed_step"] = line.get("failed")
    return out


def readme_sequence(cap: float, conf: str, user_rows: int, kill: str = "node") -> dict:
    """One run of ``--scenario readme``: join, kill, rejoin (module docstring); returns the
    figures of :data:`README_MEASURES` (None for any not reached within ``cap`` s), the survivor's
    re-form phases and the longest step after each resize."""
    from elastic_emb.drill import procs  # psutil: the drill extra, which the example's runs need anyway

    tmp = tempfile.mkdtemp(prefix="resize-readme-")
    shm = tempfile.mkdtemp(prefix="resize-readme-", dir="/dev/shm")
    run = Path(tmp) / "run"
    records = ExampleRecords(run)
    port = free_port()
    agents: list = []
    raw: dict = {m: None for m in README_MEASURES}
    phases: dict = {}
    gap: dict = {}
    note = None

    def start(n: int):
        node = f"node{n}"
        state = os.path.join(shm, node)  # a node's own /dev/shm: no node reads another's snapshots
        os.makedirs(state)
        agents.append(
            start_agent(
                node,
                tmp,
                port,
                backend="elastic_emb",
                nnodes="1:2",
                conf=conf + ",resize=in_process",
                drain_timeout=10.0,
                script=str(RECSYS),
                worker_args=(
                    "--steps",
                    str(README_STEPS),
                    "--out",
                    str(run),
                    "--user-rows",
                    str(user_rows),
                    "--dim",
                    str(README_DIM),
                    "--step-delay",
                    str(README_STEP_S),
                ),
                extra_env={"ELASTIC_EMB_NODE_ID": node, "ELASTIC_EMB_STATE_DIR": state},
            )
        )

    def settle(nodes: tuple[str, ...], ws: int, t: float, label: str) -> bool:
        """Wait (``cap`` s at most) for complete commits of the new world, then for 1.5 s after its
        first step; record the longest step in those 1.5 s."""
        if not _until(lambda: True if _settled(records(), nodes, ws, t) else None, cap):
            return False
        time.sleep(max(0.0, t + 1.5 - time.time()))
        gap[label] = _longest_gap([r for r in records() if r.get("node") in nodes], ws, t, 1.5)
        return True

    def join(label: str, n: int) -> str | None:
        """Start node ``n`` while the survivor trains alone; None, or what did not happen in time."""
        t0 = time.time()
        start(n)
        t = _until(lambda: _first_step_at(records(SURVIVOR), 2, t0), cap)
        if t is None:
            return f"{label}: the survivor took no step at world size 2 within --cap {cap:g} s"
        mine = records(SURVIVOR)
        raw[f"{label}_to_step"] = t - t0
        last = _last_commit_before(mine, 1, t)
        raw[f"{label}_pause"] = None if last is None else t - last
        phases[label] = _reform(mine, t0, t, last)
        if not settle((SURVIVOR, f"node{n}"), 2, t, label):
            return f"{label}: no complete commit of both ranks at world size 2 within --cap {cap:g} s"
        return None

    try:
        start(0)
        first = wait_for(lambda: _first_step_at(records(SURVIVOR), 1, 0.0), START_WAIT, "node0's first step", agents)
        wait_for(lambda: _settled(records(), (SURVIVOR,), 1, 0.0), START_WAIT, "node0's first commit", agents)
        time.sleep(max(0.0, first + 1.0 - time.time()))
        note = join("join", 1)
        if note:
            return {"raw": raw, "phases": phases, "gap": gap, "note": note, "dir": tmp}
        victim = agents[1]
        if kill == "node":
            # collected first: its worker runs in a session of its own, not in the agent's group
            pids = [victim.pid, *procs.descendants(victim.pid)]
            t0 = time.time()
            procs.signal_all(pids, signal.SIGKILL)  # the whole node: agent and worker at once
        else:
            t0 = victim.signal(signal.SIGKILL)  # the agent alone: its orphaned worker reports the node dead
        t = _until(lambda: _first_step_at(records(SURVIVOR), 1, t0), cap)
        if t is None:
            note = f"kill: the survivor took no step at world size 1 within --cap {cap:g} s"
            return {"raw": raw, "phases": phases, "gap": gap, "note": note, "dir": tmp}
        mine = records(SURVIVOR)
        raw["kill_to_step"] = t - t0
        last = _last_commit_before(mine, 2, t)
        raw["kill_pause"] = None if last is None else t - last
        phases["kill"] = _reform(mine, t0, t, last)
        if not settle((SURVIVOR,), 1, t, "kill"):
            note = f"kill: no complete commit at world size 1 within --cap {cap:g} s"
        else:
            note = join("rejoin", 2)
        return {"raw": raw, "phases": phases, "gap": gap, "note": note, "dir": tmp}
    finally:
        workers = {r["pid"] for r in records()}  # a SIGKILLed agent's orphan too (--kill agent)
        for a in agents:
            workers.update(procs.descendants(a.pid))
        procs.signal_all(sorted(workers), signal.SIGKILL)
        kill_all(agents)
        shutil.rmtree(shm, ignore_errors=True)


def stats(values: list) -> dict:
    """Median, mean, p99 (nearest rank: the max below 100 values), max and count of the non-null values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"median": None, "mean": None, "p99": None, "max": None, "n": 0}
    p99 = vals[max(0, -(-99 * len(vals) // 100) - 1)]
    return {
        "median": statistics.median(vals),
        "mean": statistics.fmean(vals),
        "p99": p99,
        "max": vals[-1],
        "n": len(vals),
    }


def med_of(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def main_readme(args) -> None:
    """``--scenario readme``: run, print the tables, write the JSON."""
    raw: dict = {m: [] for m in README_MEASURES}
    phases: dict = {r: [] for r in README_RESIZES}
    gaps: dict = {r: [] for r in README_RESIZES}
    notes: list = []
    loads: list[float] = []
    dirs: list[str] = []
    for run in range(args.runs):
        loads.append(os.getloadavg()[0])
        try:
            res = readme_sequence(args.cap, args.conf, args.user_rows, args.kill)
        except AssertionError as exc:  # a set-up that did not finish: nothing was measured
            print(f"run {run + 1}/{args.runs} readme: set-up failed, left out ({str(exc).splitlines()[0]})", flush=True)
            notes.append(f"run {run + 1}: set-up failed: {str(exc).splitlines()[0]}")
            continue
        dirs.append(res["dir"])
        for m in README_MEASURES:
            raw[m].append(res["raw"][m])
        for r in README_RESIZES:
            phases[r].append(res["phases"].get(r))
            gaps[r].append(res["gap"].get(r))
        if res["note"]:
            notes.append(f"run {run + 1}: {res['note']}")
        print(
            f"run {run + 1}/{args.runs} readme: "
            + ", ".join(f"{m}={'-' if v is None else f'{v:.3f}s'}" for m, v in res["raw"].items())
            + (f" ({res['note']})" if res["note"] else ""),
            flush=True,
        )
    raw["any_join_pause"] = raw["join_pause"] + raw["rejoin_pause"]
    summary = {m: stats(v) for m, v in raw.items()}
    done = len(raw["join_pause"])
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(
        f"\nthe README's example (user table {args.user_rows:,} x {README_DIM} fp32), two agents, in process: "
        f"{done} of {args.runs} runs (s); target <= {README_TARGET_S:g} s"
    )
    labels = {**README_MEASURES, "any_join_pause": "either join 1 -> 2: the survivor's pause"}
    rows = [{"measure": labels[m], **st} for m, st in summary.items()]
    cols = [("measure", "measure"), ("median", "median"), ("mean", "mean"), ("p99", "p99"), ("max", "max")]
    print(table(rows, [*cols, ("n", "runs")], digits=3))
    shown = ("rest_s", *(p for p in REFORM_PHASES if p != "total_s"), "first_step_s", "first_commit_s")
    phase_med = {
        r: {
            k: med_of([p.get(k) for p in ps if p]) for k in (*REFORM_PHASES, "rest_s", "first_step_s", "first_commit_s")
        }
        for r, ps in phases.items()
    }
    pause_of = {"join": "join_pause", "kill": "kill_pause", "rejoin": "rejoin_pause"}
    print(
        "\nwhere the survivor's pause goes, median (s): rest (the pause less the columns after it: a kill's failed step and "
        "its detection), the re-form's phases (transfer: inside restore), the first step at the new size "
        "(first commit: inside it, the new world's first base captured)"
    )
    rows = [{"resize": r, "pause": summary[pause_of[r]]["median"], **phase_med[r]} for r in README_RESIZES]
    print(table(rows, [("resize", "resize"), ("pause", "pause"), *((k, k[:-2]) for k in shown)], digits=3))
    gap_stats = {r: stats(v) for r, v in gaps.items()}
    print(
        "\nlongest step in the 1.5 s after the first at the new size (s), median / max: "
        + ", ".join(f"{r} {fmt(g['median'])} / {fmt(g['max'])}" for r, g in gap_stats.items())
    )
    print(f"load average (1 min) at each run's start: {min(loads):.1f}-{max(loads):.1f}")
    for n in notes:
        print(f"note: {n}")
    write_json(
        args.out,
        "resize",
        {
            "scenario": "readme",
            "runs": args.runs,
            "runs_done": done,
            "example": {
                "script": os.path.relpath(RECSYS, os.path.dirname(_BENCH)),
                "user_rows": args.user_rows,
                "dim": README_DIM,
                "step_delay_s": README_STEP_S,
            },
            "cap_s": args.cap,
            "kill": args.kill,
            "conf": args.conf + ",resize=in_process",
            "target_s": README_TARGET_S,
            "measures": labels,
            "raw_s": raw,
            "summary_s": summary,
            "reform_phases_raw_s": phases,
            "reform_phases_median_s": phase_med,
            "longest_step_after_raw_s": gaps,
            "longest_step_after_s": gap_stats,
            "notes": notes,
            "run_dirs": dirs,
            "load_avg_1min": loads,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario",
        choices=["sequence", "readme"],
        default="sequence",
        help="sequence: scale-up 2 -> 3, SIGTERM, SIGKILL per backend; readme: the README's example on two "
        "agents in process (join, SIGKILL of a node, rejoin; --backends, --worker, --mode and --table-mb do not apply)",
    )
    ap.add_argument(
        "--user-rows",
        type=int,
        default=2**20,
        help="readme: rows of the example's user table (64 fp32 columns; 1,048,576 = 256 MiB)",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mode", choices=["busy", "idle"], default="busy", help="workers during the scale-downs")
    ap.add_argument(
        "--worker",
        choices=["plain", "lifecycle"],
        default="plain",
        help="plain: one all_reduce per step; lifecycle: elastic_emb's Lifecycle over an EmbContext",
    )
    ap.add_argument("--cap", type=float, default=20.0, help="seconds to wait for a resize before recording null")
    ap.add_argument(
        "--kill",
        choices=["node", "agent"],
        default="node",
        help="the SIGKILL scale-down: the node's agent and worker (node), or its agent alone",
    )
    ap.add_argument(
        "--table-mb",
        type=int,
        default=0,
        help="lifecycle worker's table in MiB (64 fp32 columns); 0: the tests' 64 x 4 table",
    )
    ap.add_argument("--backends", default="elastic_emb,elastic_emb:in_process,c10d")
    ap.add_argument("--out", default="out/resize.json")
    ap.add_argument("--conf", default=FAST_CONF, help="--rdzv-conf of the elastic_emb agents")
    ap.add_argument(
        "--stock-conf",
        default="keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1",
        help="--rdzv-conf of the stock c10d agents (with keep_alive_max_attempt=2 stock c10d "
        "split-brains here: a joiner declares the running node dead and forms its own world)",
    )
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")
    if args.scenario == "readme":
        if args.user_rows < 64:
            ap.error(f"--user-rows={args.user_rows} is too small for a table sharded over two ranks; give >= 64")
        if args.mode != "busy":
            ap.error(
                f"--mode {args.mode} does not apply to --scenario readme (the example steps continuously); drop it"
            )
        main_readme(args)
        return
    backends = args.backends.split(",")
    raw: dict = {b: {s: [] for s in SCENARIOS} for b in backends}
    splits: dict = {s: {"agent_s": [], "worker_s": []} for s in SCENARIOS}
    floors: list[float] = []
    pauses: dict = {b: {s: [] for s in SCENARIOS} for b in backends}
    gaps: dict = {b: {s: [] for s in SCENARIOS} for b in backends}
    loads: list[float] = []
    for run in range(args.runs):
        floors.append(import_floor())
        for b in backends:  # interleaved, so load drifts hit both backends alike
            loads.append(os.getloadavg()[0])
            try:
                res = sequence(
                    b,
                    args.mode,
                    args.cap,
                    args.stock_conf if b == "c10d" else args.conf,
                    args.worker,
                    args.kill,
                    args.table_mb,
                )
            except AssertionError as exc:  # a set-up that did not finish: nothing was measured
                print(
                    f"run {run + 1}/{args.runs} {b}: set-up failed, left out ({str(exc).splitlines()[0]})", flush=True
                )
                continue
            for s in SCENARIOS:
                raw[b][s].append(res["results"][s])
            for s in SCENARIOS:
                pauses[b][s].append(res["pause"].get(s))
                gaps[b][s].append(res["gap"].get(s))
            for s, v in res["split"].items():
                for k in v:
                    splits[s][k].append(v[k])
            print(
                f"run {run + 1}/{args.runs} {b}: "
                + ", ".join(f"{s}={'-' if v is None else f'{v:.2f}s'}" for s, v in res["results"].items()),
                flush=True,
            )

    def med(values):
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if len(vals) == len(values) and vals else None

    def cell(value, values):
        vals = [v for v in values if v is not None]
        if value is None:
            return "-"
        return f"{value:.2f}" if len(vals) < 2 else f"{value:.2f} ({min(vals):.2f}-{max(vals):.2f})"

    summary = {b: {s: med(raw[b][s]) for s in SCENARIOS} for b in backends}
    split_med = {s: {k: (statistics.median(v) if v else None) for k, v in d.items()} for s, d in splits.items()}
    done = min(len(raw[b]["scale_up"]) for b in backends)  # set-ups that failed are left out
    print(
        f"\nfault-to-first-step, median (range) of {done} of {args.runs} runs, workers {args.mode} during scale-down (s); "
        f"null = no resize within {args.cap:.0f} s"
    )
    head = f"| scenario | {' | '.join(backends)} | ratio c10d/elastic_emb | elastic_emb agent side | elastic_emb worker side |"
    print(head)
    print("| --- |" + " ---: |" * (len(backends) + 3))
    for s in SCENARIOS:
        e = summary.get("elastic_emb", {}).get(s)
        c = summary.get("c10d", {}).get(s)
        ratio = (
            f"{c / e:.2f}"
            if (e and c)
            else ("> " + f"{args.cap / e:.1f}" if e and c is None and "c10d" in backends else "-")
        )
        sp = split_med.get(s, {})
        cells = " | ".join(cell(summary[b][s], raw[b][s]) for b in backends)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {s} | {cells} | {ratio} | {fmt(sp.get('agent_s'))} | {fmt(sp.get('worker_s'))} |")
    pause_med = {b: {s: med(v) for s, v in d.items()} for b, d in pauses.items()}
    print("\nsurvivors' pause (last step at the old size to first step at the new), median (s)")
    print(f"| scenario | {' | '.join(backends)} |")
    print("| --- |" + " ---: |" * len(backends))
    for s in SCENARIOS:
        print(f"| {s} | " + " | ".join(cell(pause_med[b][s], pauses[b][s]) for b in backends) + " |")
    if args.mode == "busy":
        gap_med = {b: {s: med(v) for s, v in d.items()} for b, d in gaps.items()}
        print(
            "\nlongest step after the change (commit to commit, the 1.5 s after the first step at the new size; "
            "steps are 0.05 s apart plus the step itself), median (s)"
        )
        print(f"| scenario | {' | '.join(backends)} |")
        print("| --- |" + " ---: |" * len(backends))
        for s in SCENARIOS:
            print(f"| {s} | " + " | ".join(cell(gap_med[b][s], gaps[b][s]) for b in backends) + " |")
    print(f"\nload average (1 min) at each sequence's start: {min(loads):.1f}-{max(loads):.1f}")
    print(
        f"\nimport floor (fresh python: import torch + elastic_emb), median: {statistics.median(floors):.2f} s "
        f"(runs: {', '.join(f'{f:.2f}' for f in floors)})"
    )
    write_json(
        args.out,
        "resize",
        {
            "runs": args.runs,
            "mode": args.mode,
            "worker": args.worker,
            "cap_s": args.cap,
            "conf": {"elastic_emb": args.conf, "c10d": args.stock_conf},
            "raw_s": raw,
            "median_s": summary,
            "elastic_emb_split_median_s": split_med,
            "elastic_emb_split_raw_s": splits,
            "import_floor_s": floors,
            "pause_raw_s": pauses,
            "pause_median_s": pause_med,
            "longest_step_after_raw_s": gaps,
            "kill": args.kill,
            "table_mb": args.table_mb,
            "load_avg_1min": loads,
        },
    )


if __name__ == "__main__":
    main()
