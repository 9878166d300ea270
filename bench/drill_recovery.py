"""Recovery time of real resizes: the elastic_emb rendezvous backend against stock c10d.

Each run is a whole drill (:func:`elastic_emb.drill.run_drill`: torchrun agents, real SIGTERM /
SIGKILL, tables verified bit for bit against the replay). For every scenario the same drill runs
with ``--rdzv-backend=elastic_emb`` and with torch's stock ``c10d`` (the baseline, same rdzv-conf:
1 s keep-alive x 3, 1 s last call), alternating, ``--runs`` times each. Per resize it reports
``recovery`` (fault -> first committed step of the new world), ``restart`` (last old step -> the
new worker starts its Lifecycle), ``lifecycle`` (agree + construct + restore) and the steps lost.
Prints a table of medians with the ratio elastic_emb / c10d and writes JSON.

    .venv/bin/python bench/drill_recovery.py --scenarios scale-up scale-down node-loss --runs 3 --out out/drill_recovery.json
    .venv/bin/python bench/drill_recovery.py --scenarios scale-down --runs 1 --backends elastic_emb   # a smoke run

A drill whose verification fails is reported (and makes the script exit 1): a fast recovery that
lost rows is not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from elastic_emb.drill import PRESETS, Scenario, run_drill

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

BACKENDS = ("elastic_emb", "c10d")


def one(name: str, backend: str, workdir: Path, k: int) -> dict:
    # Restart mode for both backends (stock c10d has no other): the presets' in-process mode is bench/resize.py's.
    scenario = Scenario.model_validate(
        {**PRESETS[name].model_dump(), "rendezvous": backend, "network": "loopback", "mode": "restart"}
    )
    report = run_drill(scenario, workdir / f"{name}-{backend}-{k}", progress="lines", summary=False)
    r = report["resizes"][0] if report["resizes"] else {}
    return {
        "scenario": name,
        "backend": backend,
        "run": k,
        "ok": report["ok"],
        "error": report["error"],
        "recovery_s": r.get("recovery_seconds"),
        "restart_s": (r.get("phases") or {}).get("restart"),
        "lifecycle_s": (r.get("phases") or {}).get("lifecycle"),
        "steps_lost": r.get("steps_lost"),
        "tiers": r.get("source_tiers"),
        "world_sizes": report["world_sizes"],
        "duration_s": report["duration_seconds"],
    }


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=["scale-up", "scale-down", "node-loss"], choices=sorted(PRESETS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--backends",
        nargs="+",
        default=list(BACKENDS),
        choices=BACKENDS,
        help="rendezvous backends to drill (c10d, the baseline, gives the ratio)",
    )
    p.add_argument("--out", type=Path, default=Path("out/drill_recovery.json"))
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs={args.runs} must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="drill-bench-") as tmp:
        for name in args.scenarios:
            for k in range(args.runs):
                for backend in args.backends:  # alternate, so load drifts hit both alike
                    rows.append(one(name, backend, Path(tmp), k))
                    print(json.dumps(rows[-1]), flush=True)
    summary = []
    print(
        f"\n{'scenario':12} {'backend':12} {'ok':>5} {'recovery s':>11} {'restart s':>10} {'lifecycle s':>12} "
        f"{'lost':>5} {'ratio vs c10d':>14}"
    )
    for name in args.scenarios:
        base = median([r["recovery_s"] for r in rows if r["scenario"] == name and r["backend"] == "c10d" and r["ok"]])
        for backend in args.backends:
            mine = [r for r in rows if r["scenario"] == name and r["backend"] == backend]
            rec = median([r["recovery_s"] for r in mine if r["ok"]])
            entry = {
                "scenario": name,
                "backend": backend,
                "runs": len(mine),
                "ok": sum(r["ok"] for r in mine),
                "recovery_s": rec,
                "restart_s": median([r["restart_s"] for r in mine if r["ok"]]),
                "lifecycle_s": median([r["lifecycle_s"] for r in mine if r["ok"]]),
                "steps_lost": max((r["steps_lost"] or 0) for r in mine),
                "ratio_vs_c10d": (rec / base) if rec is not None and base else None,
            }
            summary.append(entry)
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            print(
                f"{name:12} {backend:12} {entry['ok']:>2}/{entry['runs']:<2} {fmt(rec):>11} {fmt(entry['restart_s']):>10} "
                f"{fmt(entry['lifecycle_s']):>12} {entry['steps_lost']:>5} {fmt(entry['ratio_vs_c10d']):>14}"
            )
    write_json(args.out, "drill_recovery", {"summary": summary, "runs": rows})
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
