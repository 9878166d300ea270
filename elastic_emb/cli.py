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


if __name__ == "__main__":
    main()
