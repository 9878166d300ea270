"""Elastic restart drills: real torchrun agents, real faults, and proof that nothing was lost.

A drill runs the packaged example model (:mod:`elastic_emb.examples.recsys`) under one ``torchrun`` agent per simulated node
(:mod:`~elastic_emb.drill.orchestrator`), injects the faults of a scenario
(:mod:`~elastic_emb.drill.scenario`) at given steps or times, then checks the final tables
against a single-process reference replay, bit for bit (:mod:`~elastic_emb.drill.replay`), and
writes a report: JSON timeline, PNG plot, summary table (:mod:`~elastic_emb.drill.report`).

``elastic-emb drill --scenario NAME|FILE --out DIR`` and ``elastic-emb demo`` are the command
line; :func:`run_drill` is the same thing from Python.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_emb.examples import RECSYS as EXAMPLE

if TYPE_CHECKING:
    from elastic_emb.drill.orchestrator import Drill, DrillError, DrillResult
    from elastic_emb.drill.replay import LossDetected, verify
    from elastic_emb.drill.scenario import PRESETS, Fault, Scenario, chaos, load_scenario

__all__ = [
    "Drill",
    "DrillError",
    "DrillResult",
    "EXAMPLE",
    "Fault",
    "LossDetected",
    "PRESETS",
    "Scenario",
    "chaos",
    "load_scenario",
    "run_drill",
    "verify",
]

# Loaded on first use: the orchestrator and the replay import torch (seconds), which the
# command line must not pay for `--help`, `--list` or a one-line error.
_LAZY = {
    "Drill": "orchestrator",
    "DrillError": "orchestrator",
    "DrillResult": "orchestrator",
    "LossDetected": "replay",
    "verify": "replay",
    "PRESETS": "scenario",
    "Fault": "scenario",
    "Scenario": "scenario",
    "chaos": "scenario",
    "load_scenario": "scenario",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"elastic_emb.drill.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'elastic_emb.drill' has no attribute {name!r}")


class _Progress:
    """A progress bar on a terminal (rich), plain lines otherwise (one every few seconds)."""

    def __init__(self, scenario: Scenario, console, mode: str) -> None:
        self.console = console
        self.tty = console.is_terminal if mode == "auto" else mode == "bar"
        self.scenario = scenario
        self.last_line = 0.0
        self.last_state = None
        self.bar = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("world {task.fields[world]}  faults {task.fields[faults]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self.task = self.bar.add_task(f"drill {scenario.name}", total=scenario.steps, world=0, faults=0)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()

    def __call__(self, st: dict) -> None:
        if st.get("phase") == "verify":
            if self.bar:
                self.bar.stop()
            self.console.print(
                f"[drill {self.scenario.name}] verifying steps 0..{st['step']} against the "
                f"single-process replay, bit for bit",
                highlight=False,
            )
            return
        if self.bar:
            self.bar.update(self.task, completed=st["step"] + 1, world=st["world"], faults=st["faults"])
            return
        state = (st["world"], st["faults"], st["nodes"])
        now = time.monotonic()
        if state != self.last_state or now - self.last_line >= 5.0:
            self.console.print(
                f"[drill {self.scenario.name}] t={st['t']:6.1f}s step {st['step'] + 1}/{st['steps']} "
                f"world {st['world']} live nodes {st['nodes']} faults fired {st['faults']}",
                highlight=False,
                soft_wrap=True,
            )
            self.last_line, self.last_state = now, state


def run_drill(
    scenario: Scenario,
    out: Path | str,
    *,
    script: Path | str = EXAMPLE,
    console=None,
    progress: str = "auto",
    summary: bool = True,
    metrics_port: int | None = None,
) -> dict:
    """Run ``scenario``, write the report into ``out`` and print its summary.

    Args:
        scenario: the drill to run.
        out: directory for logs, node state, final tables and the report (a drill's own directory
            from an earlier run is replaced; any other non-empty directory is refused).
        script: the training script the agents run; default the packaged recsys example.
        console: the rich console for the progress and the summary; default a new one.
        progress: ``"bar"``, ``"lines"``, or ``"auto"`` (a bar on a terminal, lines otherwise).
        summary: print the summary table at the end.
        metrics_port: serve Prometheus metrics from every agent and worker, from this port up
            (see :class:`~elastic_emb.drill.orchestrator.Drill`); None serves none.

    Returns:
        The report (:func:`~elastic_emb.drill.report.build_report`). ``report["ok"]`` is the verdict;
        for a scenario with ``expect_failure`` the drill should end with ``ok`` False and the loss
        named in ``report["verification"]``.

    Raises:
        DrillError: if ``out`` exists and is not a drill directory, or the scenario combines
            ``store: etcd`` with namespaces.
        RuntimeError: if the scenario asks for ``network: netns`` and namespaces do not work here.
        OSError: if ``out`` cannot be written.
    """
    from rich.console import Console

    from elastic_emb.drill.orchestrator import Drill
    from elastic_emb.drill.report import print_summary, write_report

    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = max(console.width, 110)  # a log file has no screen edge to fit
    with _Progress(scenario, console, progress) as bar:
        result = Drill(scenario, out, script=script, on_progress=bar, metrics_port=metrics_port).run()
    report = write_report(result)
    if summary:
        print_summary(report, console)
    return report
