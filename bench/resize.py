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

    .venv/bin/python -m bench.resize --runs 3 --out out/resize.json
    .venv/bin/python bench/resize.py --runs 1 --backends elastic_emb --cap 30 --out out/resize_smoke.json
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

# bench/ (for _report) and the repository root (for tests.helpers), as a script or as -m bench.*
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_BENCH, os.path.dirname(_BENCH)]
from _report import write_json  # noqa: E402

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


def _until(tmp: str, agents, ws: int, after: float, cap: float) -> float | None:
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        t = first_commit_at(tmp, world_size=ws, after=after)
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


def _last_commit_before(tmp: str, ws: int, before: float) -> float | None:
    times = [r["t"] for r in worker_records(tmp) if r["ev"] == "commit" and r["ws"] == ws and r["t"] <= before]
    return max(times) if times else None


def _longest_gap(tmp: str, ws: int, t: float, window: float) -> float | None:
    """The longest time between consecutive commits of one rank at world size ``ws`` within
    ``window`` seconds after ``t`` (the first step at the new size): a commit that goes to the
    background after a re-form must not just move the pause to the next steps."""
    per: dict = {}
    for r in worker_records(tmp):
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
        t = _until(tmp, agents, 3, t0, cap)
        if t is None:
            return {"results": out, "split": split, "pause": pause, "gap": gap}
        out["scale_up"] = t - t0
        last = _last_commit_before(tmp, 2, t)
        if last is not None:
            pause["scale_up"] = t - last  # the running workers' pause (a restart: every worker's)
        time.sleep(1.5)
        if mode == "busy":
            gap["scale_up"] = _longest_gap(tmp, 3, t, 1.5)
        for scenario, victim, sig, ws in (
            ("scale_down_sigterm", agents[2], signal.SIGTERM, 2),
            ("scale_down_sigkill", agents[1], signal.SIGKILL, 1),
        ):
            worker_pid = _worker_of(tmp, victim) if sig == signal.SIGKILL and kill == "node" else None
            t0 = victim.signal(sig)
            if worker_pid is not None:
                os.kill(worker_pid, signal.SIGKILL)  # the whole node: agent and worker
            t = _until(tmp, agents, ws, t0, cap)
            if t is None:
                break
            out[scenario] = t - t0
            last = _last_commit_before(tmp, ws + 1, t0)
            if last is not None:
                pause[scenario] = t - last
            if backend == "elastic_emb":
                r = _round_after(tmp, t0)
                if r is not None:
                    split[scenario] = {"agent_s": r - t0, "worker_s": t - r}
            time.sleep(1.5)
            if mode == "busy":
                gap[scenario] = _longest_gap(tmp, ws, t, 1.5)
        return {"results": out, "split": split, "pause": pause, "gap": gap}
    finally:
        kill_all(agents, tmp)
        if extra.get("ELASTIC_EMB_STATE_DIR"):
            import shutil

            shutil.rmtree(extra["ELASTIC_EMB_STATE_DIR"], ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
