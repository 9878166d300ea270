"""The ``elastic-emb`` command line.

Built on click: subcommands, typed options with their defaults in ``--help``, and errors that
name the bad option, which argparse would make us write by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click

from elastic_emb.errors import ElasticEmbError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="elastic-emb")
def main() -> None:
    """Elastic lifecycle manager for sharded embedding tables under torchrun."""


@main.command("agree")
@click.option("--timeout", type=float, default=60.0, help="Seconds to wait for every rank.")
def agree_cmd(timeout: float) -> None:
    """Worker: read the topology from torchrun's environment, agree with every rank, print it."""
    from elastic_emb.events import bind_topology, get_logger
    from elastic_emb.store import worker_store
    from elastic_emb.topology import Topology, agree

    try:
        topology = Topology.from_env()
        bind_topology(topology)
        store = worker_store(topology, timeout=timeout)
        agreed = agree(topology, store, timeout=timeout)
    except ElasticEmbError as exc:
        get_logger().error("agreement_failed", error=type(exc).__name__, message=str(exc))
        raise SystemExit(2) from None
    get_logger().info("topology_agreed", fingerprint=agreed.fingerprint())
    print(json.dumps({"rank": agreed.rank, "agreed": json.loads(agreed.to_json()), "fingerprint": agreed.fingerprint()}), flush=True)


@main.command("agree-demo")
@click.option("--nproc", type=click.IntRange(1, 64), default=2, help="Local worker processes.")
def agree_demo(nproc: int) -> None:
    """Run the topology agreement across NPROC local processes under torchrun (loopback)."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ELASTIC_EMB_LOG_FORMAT="json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "elastic_emb.cli", "agree", "--timeout", "30"]
    click.echo("$ " + " ".join(cmd[2:]), err=True)
    raise SystemExit(subprocess.run(cmd, env=env, timeout=120).returncode)


# -- deploy (issue 7): the Kubernetes preStop hook ---------------------------------------------


@main.command("rdzv-state")
@click.option("--endpoint", required=True, help="The --rdzv-endpoint, HOST:PORT.")
@click.option("--run-id", required=True, help="The --rdzv-id.")
@click.option("--inner", type=click.Choice(["c10d", "etcd-v2"]), default="c10d", help="The rendezvous state backend.")
@click.option("--count", type=click.IntRange(1, 100000), default=1, help="Reads to print.")
@click.option("--interval", type=float, default=1.0, help="Seconds between reads.")
def rdzv_state(endpoint: str, run_id: str, inner: str, count: int, interval: float) -> None:
    """Print torch's rendezvous state as JSON (decoded with elastic_emb's restricted unpickler)."""
    from elastic_emb.watch import print_state

    raise SystemExit(print_state(endpoint, run_id, inner, interval, count))


@main.command("drain")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
              help="Seconds to wait for every worker's acknowledgement (keep below the pod's terminationGracePeriodSeconds).")
@click.option("--endpoint", default=None, help="Rendezvous HOST:PORT [default: ELASTIC_EMB_RDZV_ENDPOINT, else PET_RDZV_ENDPOINT].")
@click.option("--run-id", default=None, help="Rendezvous run id [default: TORCHELASTIC_RUN_ID, else PET_RDZV_ID, else none].")
@click.option("--inner", type=click.Choice(["c10d", "etcd-v2"]), default=None,
              help="Inner rendezvous backend [default: ELASTIC_EMB_RDZV_BACKEND, else inner= in PET_RDZV_CONF, else c10d].")
@click.option("--connect-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0,
              help="Seconds to reach the rendezvous store.")
def drain_cmd(timeout: float, endpoint: str | None, run_id: str | None, inner: str | None, connect_timeout: float) -> None:
    """Ask the running workers to finish their step, commit, and acknowledge; wait (bounded).

    Meant as a pod's preStop hook: kubelet sends torchrun SIGTERM only after it returns. Prints
    the outcome as JSON; exit 0 when acknowledged (or nothing to drain), 3 on timeout, 2 when the
    rendezvous cannot be reached.
    """
    from elastic_emb.drain import DrainError, DrainTarget, request_drain
    from elastic_emb.events import get_logger

    log = get_logger("elastic_emb.drain")
    try:
        target = DrainTarget.from_env(endpoint=endpoint, run_id=run_id, inner=inner)
        result = request_drain(target, timeout=timeout, connect_timeout=connect_timeout)
    except DrainError as exc:
        log.error("drain_failed", message=str(exc))
        raise SystemExit(2) from None
    log.info("drain_finished", endpoint=target.endpoint, run_id=target.run_id, **result.model_dump())
    click.echo(result.model_dump_json())
    raise SystemExit(0 if result.ok else 3)


# -- drills (issue 6: elastic_emb/drill/) ------------------------------------------------------


@main.command("drill")
@click.option("--scenario", "scenario_spec", default=None,
              help="A preset (scale-up, scale-down, node-loss, worker-crash, flapping, store-host-loss, "
                   "corrupt-snapshot, demo), chaos:SEED, or a .yaml/.json scenario file.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Directory for logs, tables and the report.")
@click.option("--network", type=click.Choice(["auto", "loopback", "netns"]), default=None,
              help="Override the scenario's network (netns: one namespace per node, needs root).")
@click.option("--rendezvous", type=click.Choice(["elastic_emb", "c10d"]), default=None,
              help="Override the scenario's torchrun --rdzv-backend.")
@click.option("--script", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Training script to drill (default: examples/train_recsys.py).")
@click.option("--progress", type=click.Choice(["auto", "bar", "lines"]), default="auto",
              help="Progress bar on a terminal, plain lines otherwise.")
@click.option("--list", "list_presets", is_flag=True, help="List the presets and exit.")
def drill_cmd(scenario_spec, out, network, rendezvous, script, progress, list_presets) -> None:
    """Run a restart drill: real torchrun agents, real faults, tables checked bit for bit."""
    from elastic_emb.drill import EXAMPLE, PRESETS, load_scenario, run_drill

    if list_presets:
        for name, s in PRESETS.items():
            click.echo(f"{name:18} {s.description}")
        return
    for value, name in ((scenario_spec, "--scenario"), (out, "--out")):
        if not value:
            raise click.UsageError(f"{name} is required (or --list to see the presets)")
    try:
        scenario = load_scenario(scenario_spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--scenario") from None
    update = {k: v for k, v in (("network", network), ("rendezvous", rendezvous)) if v}
    if update:
        scenario = scenario.model_validate({**scenario.model_dump(), **update})
    _drill_logs()
    report = run_drill(scenario, out, script=script or EXAMPLE, progress=progress)
    expected = not report["ok"] if scenario.expect_failure else report["ok"]
    raise SystemExit(0 if expected else 1)


@main.command("demo")
@click.option("--out", type=click.Path(file_okay=False), default="drill-demo", help="Directory for the report.")
def demo_cmd(out) -> None:
    """A short drill on loopback with torch's embedded c10d store: 1 -> 2 -> 1 nodes."""
    from elastic_emb.drill import PRESETS, run_drill

    _drill_logs()
    report = run_drill(PRESETS["demo"], out)
    raise SystemExit(0 if report["ok"] else 1)


def _drill_logs() -> None:
    """The drill's own events go to its report and logs; on the console, warnings only
    (ELASTIC_EMB_LOG_LEVEL=info brings them back)."""
    from elastic_emb.events import configure_logging

    configure_logging(level=os.environ.get("ELASTIC_EMB_LOG_LEVEL", "warning"), force=True)


@main.command("state")
@click.option("--state-dir", default=None, help="Snapshot root [default: ELASTIC_EMB_STATE_DIR, else /dev/shm/elastic_emb].")
@click.option("--run-id", default=None, help="Run id [default: TORCHELASTIC_RUN_ID, else none].")
@click.option("--durable-dir", default=None, help="DCP root [default: ELASTIC_EMB_DURABLE_DIR, if set].")
def state_cmd(state_dir: str | None, run_id: str | None, durable_dir: str | None) -> None:
    """List committed state (newest first): per commit, the nodes holding it, and the row ranges
    missing from this host's view (empty: restorable from here). Reads manifests only."""
    from elastic_emb.state import inspect_state

    state_dir = state_dir or os.environ.get("ELASTIC_EMB_STATE_DIR") or "/dev/shm/elastic_emb"
    run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    durable_dir = durable_dir or os.environ.get("ELASTIC_EMB_DURABLE_DIR") or None
    click.echo(json.dumps(inspect_state(state_dir, run_id, durable_dir), indent=2))


if __name__ == "__main__":
    main()
