"""The key-value store every rank of one torchrun world shares, and the prefixes that keep
generations apart.

torchrun tells each worker where the store is (MASTER_ADDR, MASTER_PORT) and whether the agent
already hosts it (TORCHELASTIC_USE_AGENT_STORE). With torch's shared rendezvous store disabled
(the elastic_emb backend always disables it: with it a scale-up deadlocks) rank 0 hosts a fresh store for
every rendezvous round, so no key of an earlier round survives into the next.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic_emb.topology import Topology, scope


def worker_store(topology: Topology, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> dist.Store:
    """Connect to (or, on rank 0 when the agent does not host it, start) the world's TCPStore."""
    env = os.environ if env is None else env
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE", "False").lower() == "true"
    is_master = topology.rank == 0 and not agent_hosts
    return dist.TCPStore(
        topology.master_addr,
        topology.master_port,
        world_size=None,
        is_master=is_master,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
        use_libuv=True,
    )


def generation_store(base: dist.Store, topology: Topology, purpose: str) -> dist.PrefixStore:
    """A PrefixStore private to one generation and one purpose (``pg``, ``agree``, ``drain``...).

    A process group re-initialised on reused keys hangs (reusing ``default_pg/0`` does), so each
    communicator of each generation gets keys of its own.
    """
    if not purpose or "/" in purpose:
        raise ValueError(f"purpose={purpose!r} must be a non-empty name without '/'")
    return dist.PrefixStore(f"{scope(topology.run_id, topology.generation)}/{purpose}/", base)
