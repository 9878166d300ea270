"""The drill's command line: ``elastic-emb drill``, ``elastic-emb demo``, ``python -m elastic_emb.drill``.

- :func:`drill_cmd`, :func:`demo_cmd`: the click commands (``elastic_emb.cli`` adds them to its group);
- :func:`default_out`: where a drill writes when ``--out`` is not given;
- :func:`need_drill_extra`: the one-line stop when the ``[drill]`` extra is not installed.

Every failure a user can cause becomes one :class:`~elastic_emb.cli.console.UserError` line.
Design: ``docs/DRILLS.md`` (section "Command line").
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import click
from pydantic import ValidationError

from elastic_emb.cli.console import EXIT_FAILED, EXIT_OK, UserError

# The [drill] extra (pyproject.toml): the module each of its packages is imported as.
DRILL_EXTRA = {"rich": "rich", "matplotlib": "matplotlib", "pyyaml": "yaml", "psutil": "psutil"}


def need_drill_extra() -> None:
    """Stop a drill command before it starts when a package of the ``[drill]`` extra is missing.

    Raises:
        UserError: naming the missing packages and the install command (exit code 2).
    """
    missing = [name for name, module in DRILL_EXTRA.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(
            f"this command needs the drill extra (missing: {', '.join(missing)}): pip install 'elastic-emb[drill]'"
        )


def default_out(name: str) -> Path:
    """The output directory of a drill run without ``--out``.

    Args:
        name: the scenario's name.

    Returns:
        ``./drill-<name>`` if the current directory is writable, else a new temporary directory
        (a read-only root filesystem, a package run from ``/``).
    """
    cwd = Path.cwd()
    if os.access(cwd, os.W_OK | os.X_OK):
        return cwd / f"drill-{name}"
    return Path(tempfile.mkdtemp(prefix=f"elastic-emb-drill-{name}-"))


def _resolve_out(out: str | None, name: str) -> Path:
    if out is None:
        path = default_out(name)
        click.echo(f"drill output: {path} (--out to choose)", err=True)
        return path
    path = Path(out).expanduser().resolve()
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory; name a new or empty directory")
    if not os.access(path if path.exists() else parent, os.W_OK | os.X_OK):
        raise UserError(
            f"--out {out}: {path if path.exists() else parent} is not writable; "
            f"choose a writable directory (or leave --out out: ./drill-{name} or a temporary directory)"
        )
    return path


def _drill_logs() -> None:
    """The drill's own events go to its report and logs; on the console, warnings only
    (ELASTIC_EMB_LOG_LEVEL=info brings them back)."""
    from elastic_emb.events import configure_logging

    configure_logging(default_level="warning", force=True)


def _run(scenario, out: Path, script: Path | None, progress: str) -> int:
    from elastic_emb.drill import EXAMPLE, DrillError, run_drill

    _drill_logs()
    try:
        report = run_drill(scenario, out, script=script or EXAMPLE, progress=progress)
    except DrillError as exc:  # raised before the drill started (e.g. --out is a user's directory)
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"--out {out}: {exc.strerror or exc}; choose a writable directory") from None
    expected = not report["ok"] if scenario.expect_failure else report["ok"]
    return EXIT_OK if expected else EXIT_FAILED


def preset_help() -> str:
    """The preset names, comma-separated, for the help of ``--scenario``.

    Returns:
        The names of :data:`~elastic_emb.drill.scenario.PRESETS`, in their order.
    """
    from elastic_emb.drill.scenario import PRESETS

    return ", ".join(PRESETS)


@click.command("drill")
@click.option(
    "--scenario",
    "scenario_spec",
    default=None,
    metavar="NAME|chaos:SEED|FILE",
    help=f"A preset ({preset_help()}), chaos:SEED, or a .yaml/.json scenario file.",
)
@click.option(
    "--out",
    default=None,
    help="Directory for logs, tables and the report [default: ./drill-<scenario> if the current "
    "directory is writable, else a new temporary directory].",
)
@click.option(
    "--network",
    type=click.Choice(["auto", "loopback", "netns"]),
    default=None,
    help="Override the scenario's network (netns: one namespace per node, needs root).",
)
@click.option(
    "--rendezvous",
    type=click.Choice(["elastic_emb", "c10d"]),
    default=None,
    help="Override the scenario's torchrun --rdzv-backend.",
)
@click.option(
    "--mode",
    type=click.Choice(["restart", "in_process"]),
    default=None,
    help="Override the scenario's resize mode: in_process (--rdzv-conf resize=in_process: the survivors "
    "re-form in their running processes; a scenario's default) or restart (the agents restart every "
    "worker; the default with --rendezvous c10d, and gpu-2-1-2's).",
)
@click.option(
    "--script",
    default=None,
    help="Training script to drill [default: the packaged example, `elastic-emb example-path`].",
)
@click.option(
    "--progress",
    type=click.Choice(["auto", "bar", "lines"]),
    default="auto",
    show_default=True,
    help="Progress bar on a terminal, plain lines otherwise.",
)
@click.option("--list", "list_presets", is_flag=True, help="List the presets and exit.")
def drill_cmd(scenario_spec, out, network, rendezvous, mode, script, progress, list_presets) -> int:
    """Run a resize drill: real torchrun agents, real faults, tables checked bit for bit.

    Exit 0 on PASS (for a scenario that plants a loss: when the loss was caught), 1 on FAIL,
    2 on bad input.
    \f
    Args:
        scenario_spec: a preset name, ``chaos:SEED``, or a scenario file (``--scenario``).
        out: the output directory, or None for :func:`default_out`.
        network: overrides the scenario's ``network`` when given.
        rendezvous: overrides the scenario's ``rendezvous`` when given.
        mode: overrides the scenario's ``mode`` when given.
        script: the training script to drill, or None for the packaged example.
        progress: ``auto``, ``bar`` or ``lines``.
        list_presets: print the presets and return.

    Returns:
        The exit code: ``EXIT_OK`` when the verdict is the expected one, else ``EXIT_FAILED``.

    Raises:
        click.UsageError: if neither ``--scenario`` nor ``--list`` is given.
        click.BadParameter: if the scenario cannot be loaded, or the overrides make it invalid
            (``--mode in_process`` with ``--rendezvous c10d`` among them).
        UserError: if the drill extra is missing, ``--script`` is not a file, ``--out`` cannot be used,
            or the drill could not start.
    """
    from elastic_emb.drill.scenario import PRESETS, load_scenario

    if list_presets:
        for name, s in PRESETS.items():
            click.echo(f"{name:18} {s.description}")
        return EXIT_OK
    if not scenario_spec:
        raise click.UsageError("--scenario is required (or --list to see the presets)")
    need_drill_extra()
    try:
        scenario = load_scenario(scenario_spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--scenario") from None
    update = {k: v for k, v in (("network", network), ("rendezvous", rendezvous), ("mode", mode)) if v}
    if rendezvous == "c10d" and mode == "in_process":
        raise click.BadParameter(
            "--mode in_process needs the elastic_emb rendezvous (stock c10d restarts every "
            "worker); drop --rendezvous c10d or use --mode restart",
            param_hint="--mode",
        )
    if rendezvous == "c10d" and scenario.mode == "in_process":
        update["mode"] = "restart"  # stock c10d restarts every worker: the preset's in-process mode cannot apply
    if update:
        try:
            scenario = scenario.model_validate({**scenario.model_dump(), **update})
        except ValidationError as exc:
            problems = "; ".join(e["msg"] for e in exc.errors())
            raise click.BadParameter(f"{scenario.name} with {update}: {problems}", param_hint="--scenario") from None
    script_path = None
    if script is not None:
        script_path = Path(script).expanduser()
        if not script_path.is_file():
            raise UserError(
                f"--script {script}: no such file; name the training script to drill, or leave "
                f"--script out to drill the packaged example"
            )
    return _run(scenario, _resolve_out(out, scenario.name), script_path, progress)


@click.command("demo")
@click.option(
    "--out",
    default=None,
    help="Directory for the report [default: ./drill-demo if the current directory is writable, "
    "else a new temporary directory].",
)
@click.option(
    "--progress",
    type=click.Choice(["auto", "bar", "lines"]),
    default="auto",
    show_default=True,
    help="Progress bar on a terminal, plain lines otherwise.",
)
def demo_cmd(out, progress) -> int:
    """A short drill on loopback with torch's embedded c10d store: 1 -> 2 -> 1 nodes, resized in
    process (``--rdzv-conf resize=in_process``: node 0's worker is never restarted).

    Trains the packaged example model; exit 0 when its tables equal the single-process replay
    bit for bit.
    \f
    Args:
        out: the output directory, or None for :func:`default_out`.
        progress: ``auto``, ``bar`` or ``lines``.

    Returns:
        The exit code: ``EXIT_OK`` on PASS, else ``EXIT_FAILED``.

    Raises:
        UserError: if the drill extra is missing, ``--out`` cannot be used or the drill could not start.
    """
    from elastic_emb.drill.scenario import PRESETS

    need_drill_extra()
    return _run(PRESETS["demo"], _resolve_out(out, "demo"), None, progress)
