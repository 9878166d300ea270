"""A hung worker: SIGSTOP to its agent killing it, and to the job's next step, in both resize modes.

Two torchrun agents on loopback (one gloo lifecycle worker per node, tests/helpers/rdzv_worker.py,
50 ms steps). Once both ranks hold a complete commit, one worker is SIGSTOPped: a process that
is alive and silent, which no collective of its own ends. Timed from the signal:

- **detect**: to its agent's ``worker_hung`` event (the hang watchdog, ``--hang-timeout``);
- **resume**: to the first step committed at world size 2 again.

The baseline, in the same invocation, is the same run with the watchdog off (``hang_timeout=0``):
the peer's collective timeout or nothing ends the hang there; a resume that does not come within
``--cap`` seconds is recorded as null. Each figure: median, mean, p99 and max over ``--runs``.

    .venv/bin/python bench/hang.py --runs 3 --out out/hang.json
    .venv/bin/python bench/hang.py --runs 1 --modes restart --hang-timeout 3 --no-baseline --out out/hang_smoke.json
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_BENCH, os.path.dirname(_BENCH)]
from _report import write_json  # noqa: E402

from elastic_emb.testing.ports import free_port  # noqa: E402
from tests.helpers.agents import events, first_commit_at, kill_all, start_agent, wait_for, worker_records  # noqa: E402

CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
START_WAIT = 180.0


def _t(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def trial(mode: str, hang_timeout: float, cap: float) -> dict:
    """One run: two nodes, a complete commit, SIGSTOP of node b's worker; the figures from the signal."""
    tmp = tempfile.mkdtemp(prefix=f"hang-{mode}-")
    conf = f"{CONF},hang_timeout={hang_timeout:g}" + (",resize=in_process" if mode == "in_process" else "")
    agents = []
    try:
        kw = dict(worker="lifecycle", nnodes="1:2", conf=conf)
        port = free_port()
        agents.append(start_agent("a", tmp, port, **kw))
        agents.append(start_agent("b", tmp, port, **kw))

        def committed() -> bool:
            recs = worker_records(tmp)
            return {
                r["rank"] for r in recs if r["ev"] == "commit" and r["ws"] == 2 and r.get("committed", -1) >= 1
            } == {
                0,
                1,
            }

        wait_for(committed, START_WAIT, "a complete commit at world size 2", agents)
        b = agents[1]
        worker = next(r["pid"] for r in worker_records(tmp) if r["ev"] == "ready" and r["agent_pid"] == b.pid)
        t_stop = time.time()
        os.kill(worker, signal.SIGSTOP)
        deadline = time.monotonic() + cap
        resumed = None
        while time.monotonic() < deadline and resumed is None:
            resumed = first_commit_at(tmp, world_size=2, after=t_stop)
            time.sleep(0.05)
        hung = [_t(e) for e in events(tmp, "b") if e["event"] == "worker_hung" and e.get("pid") == worker]
        return {
            "detect_s": (hung[0] - t_stop) if hung else None,
            "resume_s": None if resumed is None else resumed - t_stop,
        }
    finally:
        kill_all(agents, tmp)


def stats(values: list) -> dict:
    """Median, mean, p99 and max of the values measured (None: not within the cap)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"n": 0, "missing": len(values)}
    p99 = vals[min(len(vals) - 1, int(round(0.99 * (len(vals) - 1))))]
    return {
        "n": len(vals),
        "missing": len(values) - len(vals),
        "median": statistics.median(vals),
        "mean": statistics.fmean(vals),
        "p99": p99,
        "max": vals[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="restart,in_process")
    ap.add_argument("--hang-timeout", type=float, default=15.0, help="--rdzv-conf hang_timeout (the default: 15 s)")
    ap.add_argument("--cap", type=float, default=60.0, help="seconds to wait for the next step before recording null")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs with the watchdog off")
    ap.add_argument("--out", default="out/hang.json")
    args = ap.parse_args()
    if args.runs < 1 or args.hang_timeout <= 0 or args.cap <= 0:
        ap.error("--runs >= 1, --hang-timeout > 0 and --cap > 0 are required")
    modes = args.modes.split(",")
    variants = {"watchdog": args.hang_timeout} | ({} if args.no_baseline else {"baseline": 0.0})
    raw = {m: {v: {"detect_s": [], "resume_s": []} for v in variants} for m in modes}
    for run in range(args.runs):
        for m in modes:
            for v, bound in variants.items():  # interleaved, so load drifts hit both alike
                res = trial(m, bound, args.cap)
                for k, x in res.items():
                    raw[m][v][k].append(x)
                shown = ", ".join(f"{k}={'-' if x is None else f'{x:.2f}s'}" for k, x in res.items())
                print(f"run {run + 1}/{args.runs} {m} {v}: {shown}", flush=True)
    summary = {m: {v: {k: stats(xs) for k, xs in d.items()} for v, d in per.items()} for m, per in raw.items()}
    print(
        f"\nSIGSTOP of one worker of two, seconds from the signal (hang_timeout={args.hang_timeout:g}, cap {args.cap:g}):"
    )
    for m in modes:
        for v in variants:
            for k in ("detect_s", "resume_s"):
                s = summary[m][v][k]
                line = (
                    "null (none within the cap)"
                    if not s["n"]
                    else (
                        f"median {s['median']:.2f}  mean {s['mean']:.2f}  p99 {s['p99']:.2f}  max {s['max']:.2f}"
                        f"  ({s['n']} of {s['n'] + s['missing']})"
                    )
                )
                print(f"  {m:10s} {v:8s} {k:9s} {line}")
        if "baseline" in variants:
            w, b = summary[m]["watchdog"]["resume_s"], summary[m]["baseline"]["resume_s"]
            if w["n"] and b["n"]:
                print(f"  {m:10s} resume, watchdog / baseline (median): {w['median'] / b['median']:.2f}")
    write_json(
        args.out,
        "hang",
        {"args": vars(args), "raw": raw, "summary": summary},
    )


if __name__ == "__main__":
    main()
