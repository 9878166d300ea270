"""The key-value store every rank of one torchrun world shares, and the prefixes that keep
generations apart.

torchrun tells each worker where the store is (MASTER_ADDR, MASTER_PORT) and whether the agent
already hosts it (TORCHELASTIC_USE_AGENT_STORE). With torch's shared rendezvous store disabled
(the elastic_emb backend always disables it: with it a scale-up deadlocks) rank 0 hosts a fresh store for
every rendezvous round, so no key of an earlier round survives into the next.

:class:`ForwardingStore` is the base of the store wrappers (the exit barrier's, the interruptible
one): it passes every operation to the store it wraps, so a wrapper states only what it changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic_emb.topology import Topology, scope


class ForwardingStore(dist.Store):
    """A ``torch.distributed.Store`` that passes every operation to ``inner``.

    A subclass overrides only what it changes. A Python ``dist.Store`` subclass is used by C++
    callers (``PrefixStore``, gloo) through torch's trampoline, which calls the Python method of
    the same name where there is one and torch's default otherwise. ``multi_get``/``multi_set``
    are forwarded here as well; a wrapper that changes ``get`` or ``set`` must restore torch's
    defaults for them (``multi_get = dist.Store.multi_get``: a loop over ``self.get``), or a
    ``multi_get`` would bypass its ``get``.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner = inner

    def set(self, key, value):
        return self._inner.set(key, value)

    def get(self, key):
        return self._inner.get(key)

    def add(self, key, value):
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys):
        return self._inner.check(keys)

    def wait(self, keys, timeout=None):
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    # torch's trampoline calls these two by their C++ names (a PrefixStore over a wrapper).
    def deleteKey(self, key):  # noqa: N802
        return self.delete_key(key)

    def getNumKeys(self):  # noqa: N802
        return self.num_keys()

    def multi_get(self, keys):
        return self._inner.multi_get(keys)

    def multi_set(self, keys, values):
        return self._inner.multi_set(keys, values)

    def set_timeout(self, timeout: timedelta):
        return self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout


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
