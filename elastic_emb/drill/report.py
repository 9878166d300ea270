"""The drill report: a JSON timeline, a PNG plot, and a one-screen summary table.

- :func:`build_report`: the report, derived from the workers' progress lines and the faults fired;
- :func:`write_report`: ``report.json`` and ``report.png`` in the drill's directory;
- :func:`summary_table`, :func:`print_summary`: the verdict and one row per resize, for a terminal.

The segments, a resize's phases (``ran_on``, ``restart``, ``lifecycle``, ``first_step``) and its
counts (``steps_lost``, ``steps_in_flight``) are defined in ``docs/DRILLS.md`` (section "The report").
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from elastic_emb.drill.orchestrator import DrillResult


def segments(events: list[dict]) -> list[dict]:
    """Rank 0's incarnations (segments), in time order.

    A segment begins at rank 0's ``start`` line (a new process) or ``resized`` line (a re-form in
    process) and collects the ``step`` lines after it.

    Args:
        events: the workers' progress lines (every rank's; only rank 0's are used).

    Returns:
        One dict per segment: start time, lifecycle seconds, world, generation, restored step,
        restore report, node, steps ``(t, step)``, mode, and the newest step reported complete.
    """
    segs: list[dict] = []
    for e in sorted((e for e in events if e.get("rank") == 0), key=lambda e: e["t"]):
        if e["event"] in ("start", "resized"):
            in_process = e["event"] == "resized"
            segs.append(
                {
                    "start_t": e["t"],
                    "lifecycle_seconds": e.get("seconds" if in_process else "start_seconds"),
                    "world": e["world"],
                    "generation": e.get("generation"),
                    "restored_step": e.get("restored_step"),
                    "restore": e.get("restore") or {},
                    "node": e.get("node"),
                    "steps": [],
                    "mode": "in_process" if in_process else "restart",
                }
            )
        elif e["event"] == "step" and segs:
            segs[-1]["steps"].append((e["t"], e["step"]))
            # complete when its line was written (lines without the field: synchronous commits)
            segs[-1]["complete"] = max(segs[-1].get("complete", -1), e.get("committed", e["step"]))
    return segs


def build_report(result: DrillResult) -> dict:
    """The report of a drill: verdict, segments, resizes with their phases, nodes, and time series.

    Args:
        result: what :meth:`~elastic_emb.drill.orchestrator.Drill.run` returned.

    Returns:
        A JSON-able dict (the scenario, ``ok``, ``error``, ``faults``, ``segments``, ``resizes``,
        ``nodes``, ``world_size_over_time``, ``throughput_samples_per_s``, ``verification``, ...).
    """
    s, t0 = result.scenario, result.t0
    segs = segments(result.events)
    faults = [f.as_dict(t0) for f in result.faults]
    timeline, resizes = [], []
    committed_max = -1  # the newest step reported (its commit complete or in flight)
    complete_max = -1  # the newest step reported complete
    crashed = None  # the crash_worker fault behind the previous resize: in process, its node rejoins next
    for i, seg in enumerate(segs):
        steps = seg["steps"]
        entry = {
            "world": seg["world"],
            "generation": seg["generation"],
            "node_of_rank0": seg["node"],
            "t_start": round(seg["start_t"] - t0, 3),
            "t_first_step": round(steps[0][0] - t0, 3) if steps else None,
            "t_last_step": round(steps[-1][0] - t0, 3) if steps else None,
            "first_step": steps[0][1] if steps else None,
            "last_step": steps[-1][1] if steps else None,
            "restored_step": seg["restored_step"],
        }
        timeline.append(entry)
        if i > 0:
            prev = segs[i - 1]
            prev_last_t = prev["steps"][-1][0] if prev["steps"] else prev["start_t"]
            cause = [f for f in result.faults if prev["start_t"] <= f.t <= (steps[0][0] if steps else seg["start_t"])]
            fault = cause[-1] if cause else None
            t_fault = fault.t if fault else prev_last_t
            lc_begin = seg["start_t"] - (seg["lifecycle_seconds"] or 0.0)
            restored = seg["restored_step"] if seg["restored_step"] is not None else -1
            restore = seg["restore"]
            if fault is not None:
                cause_name = f"{fault.fault.kind} node{fault.node}"
            elif crashed is not None and seg["world"] > prev["world"]:
                cause_name = f"rejoin node{crashed.node} (crash_worker)"
            else:
                cause_name = "unplanned"
            crashed = fault if fault is not None and fault.fault.kind == "crash_worker" else None
            resizes.append(
                {
                    "from_world": prev["world"],
                    "to_world": seg["world"],
                    "cause": cause_name,
                    "t": round(t_fault - t0, 3),
                    "restored_step": restored,
                    "newest_committed_before": complete_max,
                    "newest_step_before": committed_max,
                    "steps_lost": max(0, complete_max - restored),
                    "steps_in_flight": max(0, committed_max - max(restored, complete_max)),
                    "source_tiers": restore.get("source_tiers") or [],
                    "fallback": restore.get("fallback"),
                    "phases": {
                        "ran_on": round(max(0.0, prev_last_t - t_fault), 3),
                        "restart": round(lc_begin - max(prev_last_t, t_fault), 3),
                        "lifecycle": round(seg["lifecycle_seconds"] or 0.0, 3),
                        "restore": round(float(restore.get("restore_s") or restore.get("seconds") or 0.0), 3),
                        "first_step": round(steps[0][0] - seg["start_t"], 3) if steps else None,
                    },
                    "recovery_seconds": round(steps[0][0] - t_fault, 3) if steps else None,
                    "mode": seg["mode"],
                    "pause_seconds": round(steps[0][0] - prev_last_t, 3) if steps else None,
                }
            )
        if steps:
            committed_max = max(committed_max, max(st for _, st in steps))
            complete_max = max(complete_max, seg.get("complete", -1))
    # World size over time (0 while no world is training) and throughput in 1 s bins.
    world_series: list[list[float]] = [[0.0, 0]]
    for seg in segs:
        if seg["steps"]:
            world_series.append([round(seg["steps"][0][0] - t0, 3), seg["world"]])
            world_series.append([round(seg["steps"][-1][0] - t0, 3), seg["world"]])
            world_series.append([round(seg["steps"][-1][0] - t0 + 1e-3, 3), 0])
    step_times = sorted(t - t0 for seg in segs for t, _ in seg["steps"])
    horizon = max(result.t_end - t0, step_times[-1] if step_times else 0.0)
    bins = [0] * (int(math.ceil(horizon)) + 1)
    for t in step_times:
        bins[int(t)] += 1
    throughput = [[i + 0.5, n * s.batch] for i, n in enumerate(bins)]
    nodes = [
        {
            "node": n.name,
            "pid": n.proc.pid,
            "state": n.state,
            "exit_code": n.exit_code,
            "t_start": round(n.started - t0, 3),
            "t_end": round(n.ended - t0, 3) if n.ended else None,
            "log": str(n.log_path),
        }
        for n in result.nodes
    ]
    return {
        "scenario": json.loads(s.model_dump_json()),
        "ok": result.ok,
        "error": result.error,
        "network": result.network,
        "duration_seconds": round(result.t_end - t0, 3),
        "steps_committed": committed_max + 1,
        "steps_planned": s.steps,
        "world_sizes": [seg["world"] for seg in segs],
        "orphans_alive_at_end": result.orphans_alive_at_end,
        "faults": faults,
        "segments": timeline,
        "resizes": resizes,
        "nodes": nodes,
        "world_size_over_time": world_series,
        "throughput_samples_per_s": throughput,
        "verification": _jsonable(result.verification),
    }


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def write_report(result: DrillResult) -> dict:
    """Write ``report.json`` and ``report.png`` into the drill's out directory.

    A plot that fails is reported in the report (``plot_error``), never raised.

    Args:
        result: the drill's result; its ``report`` is set too.

    Returns:
        The report, with ``paths`` to the two files.
    """
    report = build_report(result)
    out = result.out
    report["paths"] = {"json": str(out / "report.json"), "plot": str(out / "report.png")}
    try:
        plot(report, out / "report.png")
    except Exception as exc:  # noqa: BLE001 - a broken plot must not hide the verdict; it is reported
        report["paths"]["plot"] = None
        report["plot_error"] = f"{type(exc).__name__}: {exc}"
    (out / "report.json").write_text(json.dumps(report, indent=2))
    result.report = report
    return report


def plot(report: dict, path: Path) -> None:
    """Draw the world size and the throughput over time, faults and recoveries marked, into a PNG.

    Args:
        report: a report of :func:`build_report`.
        path: the PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    xs = [p[0] for p in report["world_size_over_time"]]
    ys = [p[1] for p in report["world_size_over_time"]]
    ax1.step(xs, ys, where="post", color="tab:blue", linewidth=2)
    ax1.set_ylabel("world size\n(0: restarting)")
    ax1.set_ylim(-0.2, max(ys + [1]) + 0.8)
    ax1.yaxis.get_major_locator().set_params(integer=True)
    tx = [p[0] for p in report["throughput_samples_per_s"]]
    ty = [p[1] for p in report["throughput_samples_per_s"]]
    ax2.plot(tx, ty, color="tab:green", linewidth=1.5, drawstyle="steps-mid")
    ax2.set_ylabel("samples / s")
    ax2.set_xlabel("seconds since the drill started")
    for f in report["faults"]:
        for ax in (ax1, ax2):
            ax.axvline(f["t"], color="tab:red", linestyle="--", linewidth=1)
        ax1.annotate(
            f"{f['kind']} node{f['node']}",
            (f["t"], ax1.get_ylim()[1]),
            textcoords="offset points",
            xytext=(3, -12),
            fontsize=8,
            color="tab:red",
        )
    for r in report["resizes"]:
        if r["recovery_seconds"] is not None:
            ax2.axvspan(r["t"], r["t"] + r["recovery_seconds"], color="tab:orange", alpha=0.15)
    verdict = "PASS: tables equal the replay bit for bit" if report["ok"] else "FAIL"
    s = report["scenario"]
    fig.suptitle(f"elastic_emb drill '{s['name']}' ({report['network']}): {verdict}", fontsize=11)
    fig.text(
        0.01,
        0.005,
        f"training is paced by the drill: {s['step_delay']:g} s per step, {s['slow_delay']:g} s while "
        f"a resize is in flight; shaded: fault -> first step of the new world",
        fontsize=7,
        color="0.35",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(report: dict):
    """The summary of a drill for a terminal: the verdict, the run in numbers, one row per resize.

    Args:
        report: a report of :func:`write_report` (it needs ``paths``).

    Returns:
        A rich renderable.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = report["scenario"]
    v = report["verification"] or {}
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    verdict = Text("PASS", style="bold green") if report["ok"] else Text("FAIL", style="bold red")
    head.add_row("drill", f"{s['name']}: {s['description']}")
    head.add_row("verdict", verdict)
    head.add_row("network", report["network"])
    head.add_row(
        "steps", f"{report['steps_committed']} committed of {report['steps_planned']}, global batch {s['batch']}"
    )
    head.add_row("world sizes", " -> ".join(str(w) for w in report["world_sizes"]) or "-")
    if v.get("ok"):
        head.add_row(
            "verification",
            f"{v['rows_checked']} rows of {len(v['tables'])} tables equal the replay after "
            f"step {v['step']}, bit for bit; {v.get('step_checksums_checked', 0)} per-step shard checksums match"
            + (
                f"; tower, Adam, schedule and sampler equal too ({v['samples_accounted']} samples read, each once per epoch)"
                if v.get("samples_accounted")
                else ""
            ),
        )
    elif v:
        head.add_row("verification", Text(str(v.get("error", ""))[:600], style="red"))
    if report["error"] and not (v and not v.get("ok")):
        head.add_row("error", Text(report["error"][:600], style="red"))
    head.add_row("duration", f"{report['duration_seconds']:.1f} s")
    table = Table(title="resizes", title_justify="left", show_lines=False)
    for col in (
        "t s",
        "cause",
        "world",
        "mode",
        "from step",
        "lost",
        "tiers",
        "restart s",
        "start s",
        "pause s",
        "recovery s",
    ):
        table.add_column(col, justify="right" if col not in ("cause", "tiers") else "left", no_wrap=True)
    for r in report["resizes"]:
        pause = r.get("pause_seconds")
        table.add_row(
            f"{r['t']:.1f}",
            r["cause"],
            f"{r['from_world']} -> {r['to_world']}",
            {"in_process": "in-proc"}.get(r.get("mode"), "restart"),
            str(r["restored_step"]),
            str(r["steps_lost"]) + (f" +{r['steps_in_flight']} in flight" if r.get("steps_in_flight") else ""),
            "+".join(r["source_tiers"]) or "-",
            f"{r['phases']['restart']:.2f}",
            f"{r['phases']['lifecycle']:.2f}",
            "-" if pause is None else f"{pause:.2f}",
            "-" if r["recovery_seconds"] is None else f"{r['recovery_seconds']:.2f}",
        )
    paths = Text(f"report: {report['paths']['json']}\nplot:   {report['paths']['plot']}")
    return Group(head, table, paths)


def print_summary(report: dict, console=None) -> None:
    """Print :func:`summary_table` of ``report``.

    Args:
        report: a report of :func:`write_report`.
        console: the rich console to print on; default a new one (at least 130 columns off a terminal).
    """
    from rich.console import Console

    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = max(console.width, 130)  # a log file has no screen edge to fit
    console.print(summary_table(report))
