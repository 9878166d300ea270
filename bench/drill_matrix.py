"""Every drill preset in every resize mode: the verification matrix (not a test: CI has no time for it).

Runs ``python -m elastic_emb.drill --scenario PRESET --mode MODE`` for each preset and mode, one at
a time, each in its own process with a hard timeout (SIGTERM, which the drill turns into a clean
stop; SIGKILL 30 s later), reads the drill's ``report.json``, prints a table and writes JSON.

    nice -n 19 .venv/bin/python bench/drill_matrix.py --modes in_process,restart --out out/drill_matrix.json
    nice -n 19 .venv/bin/python bench/drill_matrix.py --presets scale-up flapping --modes restart

PASS is the drill's own verdict (exit 0: tables equal the single-process replay bit for bit; for
``corrupt-snapshot``, the planted loss was caught). A preset this machine cannot run is SKIP with the
reason (``gpu-2-1-2`` without two GPUs, ``torchrec`` without the torchrec extra), never PASS.
Columns: ``resizes`` (re-forms the report found, and how many of them were in process), ``lost``
(steps redone, summed over the resizes), ``pause`` (the largest survivors' pause, seconds), the
drill's duration.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_emb.drill.scenario import PRESETS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

MODES = ("in_process", "restart")


def skip_reason(name: str) -> str | None:
    """Why this machine cannot run preset ``name`` (None: it can)."""
    s = PRESETS[name]
    if s.backend == "nccl":
        import torch

        need = s.max_nodes * s.nproc_per_node
        if torch.cuda.device_count() < need:
            return f"needs {need} GPUs, this machine has {torch.cuda.device_count()}"
    if s.workload == "torchrec" and importlib.util.find_spec("torchrec") is None:
        return "needs the torchrec extra (make .venv/.torchrec)"
    return None


def one(name: str, mode: str, workdir: Path, timeout: float) -> dict:
    """Run one drill in its own process; its row of the matrix."""
    row = {
        "preset": name,
        "mode": mode,
        "result": "SKIP",
        "error": None,
        "resizes": None,
        "in_process": None,
        "lost": None,
        "pause_s": None,
        "duration_s": None,
        "world_sizes": None,
    }
    reason = skip_reason(name)
    if reason:
        row["error"] = reason
        return row
    out = workdir / f"{name}-{mode}"
    cmd = [
        sys.executable,
        "-m",
        "elastic_emb.drill",
        "--scenario",
        name,
        "--mode",
        mode,
        "--out",
        str(out),
        "--progress",
        "lines",
    ]
    log = workdir / f"{name}-{mode}.log"
    t = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the drill stops and kills what it started
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            rc = None
    row["duration_s"] = round(time.monotonic() - t, 1)
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    resizes = report.get("resizes") or []
    row.update(
        result="PASS" if rc == 0 else "FAIL",
        world_sizes=report.get("world_sizes"),
        resizes=len(resizes),
        in_process=sum(r.get("mode") == "in_process" for r in resizes),
        lost=sum(r.get("steps_lost") or 0 for r in resizes),
        pause_s=max((r["pause_seconds"] for r in resizes if r.get("pause_seconds") is not None), default=None),
    )
    if rc is None:
        row["error"] = f"timed out after {timeout:g} s (log {log})"
    elif rc != 0:
        row["error"] = (report.get("error") or f"exit {rc}, no report (log {log})")[:400]
    if report.get("duration_seconds") is not None:
        row["duration_s"] = report["duration_seconds"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | mode | result | resizes (in process) | lost | pause s | duration s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    fmt = lambda v, spec="": "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        resizes = "-" if r["resizes"] is None else f"{r['resizes']} ({r['in_process']})"
        lines.append(
            f"| {r['preset']} | {r['mode']} | {r['result']} | {resizes} | {fmt(r['lost'])} | "
            f"{fmt(r['pause_s'], '.2f')} | {fmt(r['duration_s'], '.0f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per drill, then SIGTERM")
    p.add_argument(
        "--keep", type=Path, default=None, help="keep every drill's directory here (default: a temporary one)"
    )
    p.add_argument("--out", type=Path, default=Path("out/drill_matrix.json"))
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes {args.modes}: unknown {bad}; use {','.join(MODES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="drill-matrix-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in args.presets:
            for mode in modes:
                rows.append(one(name, mode, workdir.resolve(), args.timeout))
                print(json.dumps(rows[-1]), flush=True)
    print()
    print(table(rows))
    for r in rows:
        if r["error"]:
            print(f"{r['preset']} {r['mode']} {r['result']}: {r['error']}")
    write_json(args.out, "drill_matrix", {"modes": modes, "timeout_s": args.timeout, "rows": rows})
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
