"""The ``elastic-emb`` command line: drills, the preStop drain, rendezvous and state inspection.

Built on click. Every command runs through :func:`elastic_emb.cli.console.run_command`: a
failure the user can cause ends in one line naming the input and the remedy, with a documented
exit code; ``--debug`` (or ``ELASTIC_EMB_DEBUG=1``) shows the stack instead. The drill commands
live in :mod:`elastic_emb.drill.command` (the drill package does not import this module); this
group adds them.

Design: ``docs/LIFECYCLE.md`` (section "The command line").
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import click

from elastic_emb.cli.console import EXIT_USAGE, UserError, quiet_torch, run_command
from elastic_emb.drill.command import demo_cmd, drill_cmd
from elastic_emb.errors import ElasticEmbError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="elastic-emb")
@click.option("--debug", is_flag=True, help="Show Python and C++ stacks on errors (also ELASTIC_EMB_DEBUG=1).")
def main(debug: bool) -> None:
    """Elastic lifecycle manager for sharded embedding tables under torchrun.

    Exit codes: 0 ok; 1 negative verdict (drill FAIL); 2 bad input or unreachable endpoint;
    3 timed out (drain); 70 internal error (rerun with --debug).
    \f

    Args:
        debug: show stacks on errors (``run_command`` reads the flag before click does).
    """


main.add_command(drill_cmd)
main.add_command(demo_cmd)


def entry_point() -> None:
    """The ``elastic-emb`` console script: the group, with one-line errors."""
    run_command(main, prog_name="elastic-emb")


def probe_endpoint(endpoint: str, option: str, timeout: float) -> tuple[str, int]:
    """Check ``HOST:PORT`` is well-formed and something accepts a TCP connection there.

    A short plain-socket probe before torch's TCPStore or etcd client is built: those retry for
    their whole timeout and fail with a long stack (TCPStore's carries C++ frames); this fails in
    ``timeout`` seconds with the endpoint and the remedy named.

    Args:
        endpoint: ``HOST:PORT``, or an etcd member list ``HOST:PORT,HOST:PORT`` that passes when
            one member accepts.
        option: the option the endpoint came from, named in the message.
        timeout: seconds a connection may take.

    Returns:
        ``(host, port)`` of the endpoint that accepted.

    Raises:
        UserError: the endpoint is malformed, its host does not resolve, nothing listens there,
            or it is unreachable within ``timeout``.
    """
    if "," in endpoint:
        errors = []
        for part in (p for p in endpoint.split(",") if p.strip()):
            try:
                return probe_endpoint(part, option, timeout)
            except UserError as exc:
                errors.append(exc.message)
        raise UserError("; ".join(errors) or f"{option} {endpoint!r}: write HOST:PORT[,HOST:PORT...]")
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise UserError(f"{option} {endpoint!r}: write HOST:PORT, e.g. 127.0.0.1:29400")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except socket.gaierror as exc:
        raise UserError(
            f"{option} {endpoint}: cannot resolve host {host!r} ({exc.strerror}); fix the host name"
        ) from None
    except ConnectionRefusedError:
        raise UserError(
            f"nothing listens at {endpoint} ({option}): start the job (its rendezvous store) first, or fix {option}"
        ) from None
    except OSError as exc:
        raise UserError(
            f"{endpoint} ({option}) is unreachable within {timeout:g} s ({exc.strerror or exc}); "
            f"check host, port and network, or raise --connect-timeout"
        ) from None
    return host, int(port)


@main.command("agree")
@click.option("--timeout", type=float, default=60.0, help="Seconds to wait for every rank.")
def agree_cmd(timeout: float) -> None:
    """Worker: read the topology from torchrun's environment, agree with every rank, print it.
    \f

    Args:
        timeout: seconds to wait for every rank.

    Raises:
        SystemExit: 2 when the topology is bad or the ranks do not agree (logged as
            ``agreement_failed``).
    """
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
    print(
        json.dumps({"rank": agreed.rank, "agreed": json.loads(agreed.to_json()), "fingerprint": agreed.fingerprint()}),
        flush=True,
    )


@main.command("agree-demo")
@click.option("--nproc", type=click.IntRange(1, 64), default=2, help="Local worker processes.")
def agree_demo(nproc: int) -> None:
    """Run the topology agreement across NPROC local processes under torchrun (loopback).
    \f

    Args:
        nproc: local worker processes.

    Raises:
        SystemExit: always, with torchrun's exit code.
    """
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ELASTIC_EMB_LOG_FORMAT="json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "elastic_emb.cli.main",
        "agree",
        "--timeout",
        "30",
    ]
    click.echo("$ " + " ".join(cmd[2:]), err=True)
    raise SystemExit(subprocess.run(cmd, env=env, timeout=120).returncode)


@main.command("example-path")
def example_path() -> None:
    """Print the packaged example model's file path (a torchrun training script).

    e.g. torchrun --standalone --nproc-per-node=2 "$(elastic-emb example-path)" --steps 50 --out runs/x
    """
    from elastic_emb.examples import RECSYS

    click.echo(str(RECSYS))


# -- deploy: the Kubernetes preStop hook -------------------------------------------------------


@main.command("rdzv-state")
@click.option("--endpoint", required=True, help="The --rdzv-endpoint, HOST:PORT.")
@click.option("--run-id", required=True, callback=lambda ctx, param, value: _plain_run_id(value), help="The --rdzv-id.")
@click.option(
    "--inner", type=click.Choice(["c10d", "etcd-v2", "etcd-v3"]), default="c10d", help="The rendezvous state backend."
)
@click.option("--count", type=click.IntRange(1, 100000), default=1, help="Reads to print.")
@click.option("--interval", type=click.FloatRange(min=0), default=1.0, help="Seconds between reads.")
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    help="Seconds to reach the rendezvous store.",
)
def rdzv_state(endpoint: str, run_id: str, inner: str, count: int, interval: float, connect_timeout: float) -> None:
    """Print torch's rendezvous state as JSON (decoded with elastic_emb's restricted unpickler).
    \f

    Args:
        endpoint: the rendezvous ``HOST:PORT``.
        run_id: the rendezvous run id.
        inner: the inner rendezvous backend.
        count: reads to print.
        interval: seconds between reads.
        connect_timeout: seconds to reach the store.

    Raises:
        UserError: the endpoint is unreachable, the etcd-v2 client is missing, or the rendezvous
            read failed.
        SystemExit: when done, with the reader's exit code.
    """
    quiet_torch()
    probe_endpoint(endpoint, "--endpoint", connect_timeout)
    if inner == "etcd-v2":
        _need_etcd_client("--inner etcd-v2")
    from elastic_emb.watch.watcher import print_state

    try:
        raise SystemExit(print_state(endpoint, run_id, inner, interval, count))
    except (ConnectionError, TimeoutError, RuntimeError) as exc:  # torch's DistNetworkError, etcd's errors
        raise UserError(
            f"rendezvous at {endpoint} (--endpoint, --inner {inner}) failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; check --inner and that the job runs"
        ) from None


def _need_etcd_client(what: str) -> None:
    try:
        import etcd  # noqa: F401 - python-etcd
    except ImportError:
        raise UserError(f"{what} needs the python-etcd package: pip install 'elastic-emb[etcd-v2]'") from None


@main.command("drain")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    help="Seconds to wait for every worker's acknowledgement (keep below the pod's terminationGracePeriodSeconds).",
)
@click.option(
    "--endpoint",
    default=None,
    help="Rendezvous HOST:PORT [default: ELASTIC_EMB_RDZV_ENDPOINT, else PET_RDZV_ENDPOINT].",
)
@click.option(
    "--run-id", default=None, help="Rendezvous run id [default: TORCHELASTIC_RUN_ID, else PET_RDZV_ID, else none]."
)
@click.option(
    "--inner",
    type=click.Choice(["c10d", "etcd-v2", "etcd-v3"]),
    default=None,
    help="Inner rendezvous backend [default: ELASTIC_EMB_RDZV_BACKEND, else inner= in PET_RDZV_CONF, else c10d].",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    help="Seconds to reach the rendezvous store.",
)
def drain_cmd(
    timeout: float, endpoint: str | None, run_id: str | None, inner: str | None, connect_timeout: float
) -> None:
    """Ask the running workers to finish their step, commit, and acknowledge; wait (bounded).

    Meant as a pod's preStop hook: kubelet sends torchrun SIGTERM only after it returns. Prints
    the outcome as JSON; exit 0 when acknowledged (or nothing to drain), 3 on timeout, 2 when the
    rendezvous cannot be reached (one JSON log line, drain_failed, says why).
    \f

    Args:
        timeout: seconds to wait for every worker's acknowledgement.
        endpoint: the rendezvous ``HOST:PORT``, or None to read it from the environment.
        run_id: the rendezvous run id, or None.
        inner: the inner rendezvous backend, or None.
        connect_timeout: seconds to reach the store.

    Raises:
        SystemExit: always: 0 acknowledged or nothing to drain, 3 timed out, 2 the rendezvous
            cannot be reached or a drain count is foreign.
    """
    quiet_torch()
    from elastic_emb.cli.drain import DrainError, DrainTarget, request_drain
    from elastic_emb.events import get_logger

    log = get_logger("elastic_emb.cli.drain")
    try:
        target = DrainTarget.from_env(endpoint=endpoint, run_id=run_id, inner=inner)
        try:
            probe_endpoint(target.endpoint, "--endpoint", connect_timeout)
            if target.inner == "etcd-v2":
                _need_etcd_client("--inner etcd-v2")
        except UserError as exc:
            raise DrainError(exc.message) from None
        result = request_drain(target, timeout=timeout, connect_timeout=connect_timeout)
    except DrainError as exc:
        # The hook's log is JSON lines: the failure is one of them.
        log.error("drain_failed", message=str(exc).splitlines()[0] if str(exc) else "")
        raise SystemExit(EXIT_USAGE) from None
    log.info("drain_finished", endpoint=target.endpoint, run_id=target.run_id, **result.model_dump())
    click.echo(result.model_dump_json())
    raise SystemExit(0 if result.ok else 3)


def _plain_run_id(value: str | None) -> str | None:
    """``value`` if it is None or a plain name (a run id names store keys and a directory).

    Raises:
        click.BadParameter: naming the value and the names allowed (exit 2).
    """
    from elastic_emb.topology import SAFE_NAME  # not state.paths: that imports torch before quiet_torch

    if value is not None and not re.fullmatch(SAFE_NAME, value):
        shown = repr(value) if len(value) <= 80 else f"{value[:40]!r}... ({len(value)} characters)"
        raise click.BadParameter(
            f"{shown} is not a plain name: use 1-128 letters, digits, '_', '-' or '.', not starting with '.'",
            param_hint="--run-id",
        )
    return value


@main.command("state")
@click.option(
    "--state-dir", default=None, help="Snapshot root [default: ELASTIC_EMB_STATE_DIR, else /dev/shm/elastic_emb]."
)
@click.option("--run-id", default=None, help="Run id [default: TORCHELASTIC_RUN_ID, else none].")
@click.option("--durable-dir", default=None, help="DCP root [default: ELASTIC_EMB_DURABLE_DIR, if set].")
def state_cmd(state_dir: str | None, run_id: str | None, durable_dir: str | None) -> None:
    """List committed state (newest first): per commit, the nodes holding it, and the row ranges
    missing from this host's view (empty: restorable from here). Reads manifests only.
    \f

    Args:
        state_dir: the snapshot root, or None for the configured one.
        run_id: the run id, or None (``TORCHELASTIC_RUN_ID``, else ``none``).
        durable_dir: the DCP root, or None for the configured one.

    Raises:
        UserError: a variable is malformed, or the state directory, the run or the durable
            directory does not exist.
    """
    from elastic_emb.config import load
    from elastic_emb.errors import ConfigError
    from elastic_emb.state import inspect_state

    try:
        settings = load(None, "state_dir", "durable_dir")
    except ConfigError as exc:
        raise UserError(f"{exc}; fix the variable or pass --state-dir/--durable-dir") from None
    given = state_dir is not None
    state_dir = state_dir or settings.state_dir
    run_id = _plain_run_id(run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "none")
    durable_dir = durable_dir or settings.durable_dir
    source = (
        "--state-dir"
        if given
        else ("ELASTIC_EMB_STATE_DIR" if os.environ.get("ELASTIC_EMB_STATE_DIR") else "the default")
    )
    if not Path(state_dir).is_dir():
        raise UserError(
            f"state directory {state_dir} (from {source}) does not exist; pass the job's --state-dir "
            f"(its ELASTIC_EMB_STATE_DIR), on a host that ran the job"
        )
    if not (Path(state_dir) / run_id).is_dir():
        runs = sorted(p.name for p in Path(state_dir).iterdir() if p.is_dir())[:20]
        raise UserError(f"no run {run_id!r} under {state_dir} (--run-id); runs there: {', '.join(runs) or 'none'}")
    if durable_dir is not None and not Path(durable_dir).is_dir():
        raise UserError(
            f"durable directory {durable_dir} (--durable-dir / ELASTIC_EMB_DURABLE_DIR) does not exist; "
            f"fix the path or leave it out"
        )
    click.echo(json.dumps(inspect_state(state_dir, run_id, durable_dir), indent=2))


if __name__ == "__main__":
    entry_point()
