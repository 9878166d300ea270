"""The key-value store every rank of one torchrun world shares, and the prefixes that keep
generations apart.

:func:`worker_store` connects to the world's TCPStore (rank 0 hosts a fresh one every rendezvous
round unless the agent hosts it); :func:`generation_store` gives each communicator of each
generation keys of its own; :class:`ForwardingStore` is the base of the store wrappers.

Design: ``docs/CORE.md`` (section "Stores").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic_emb.topology import Topology, scope


class ForwardingStore(dist.Store):
    """A ``torch.distributed.Store`` that passes every operation to ``inner``.

    A subclass overrides only what it changes. A wrapper that changes ``get`` or ``set`` must
    also restore torch's defaults for ``multi_get``/``multi_set`` (``multi_get =
    dist.Store.multi_get``), or they would bypass it: ``docs/CORE.md`` (section "Stores").
    Errors of the inner store pass through unchanged.

    Args:
        inner: the store wrapped.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner = inner

    def set(self, key, value):
        """Set ``key`` to ``value``.

        Args:
            key: the key.
            value: the value (str or bytes).

        Returns:
            What the inner store returns (None).
        """
        return self._inner.set(key, value)

    def get(self, key):
        """The value of ``key``, waiting for it up to the store's timeout.

        Args:
            key: the key.

        Returns:
            The value, as bytes.
        """
        return self._inner.get(key)

    def add(self, key, value):
        """Add ``value`` to the integer counter ``key`` (created at 0).

        Args:
            key: the counter's key.
            value: the amount to add (0 reads the counter).

        Returns:
            The counter's new value.
        """
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: if it is absent).

        Args:
            key: the key.
            expected: the value required for the swap.
            desired: the new value.

        Returns:
            The key's value after the call, as bytes (``desired`` when the swap happened); for an
            absent key and a non-empty ``expected``, torch's stores return ``expected``.
        """
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys):
        """Whether every key exists, without waiting.

        Args:
            keys: the keys.

        Returns:
            True when all of them exist.
        """
        return self._inner.check(keys)

    def wait(self, keys, timeout=None):
        """Wait until every key exists.

        Args:
            keys: the keys.
            timeout: a ``timedelta``; the store's own timeout when None.

        Returns:
            What the inner store returns (None); it raises when the time runs out.
        """
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def delete_key(self, key):
        """Delete ``key``.

        Args:
            key: the key.

        Returns:
            True when the key existed.
        """
        return self._inner.delete_key(key)

    def num_keys(self):
        """The number of keys in the store.

        Returns:
            The inner store's count.
        """
        return self._inner.num_keys()

    # torch's trampoline calls these two by their C++ names (a PrefixStore over a wrapper).
    def deleteKey(self, key):  # noqa: N802
        """:meth:`delete_key` under its C++ name.

        Args:
            key: the key.

        Returns:
            True when the key existed.
        """
        return self.delete_key(key)

    def getNumKeys(self):  # noqa: N802
        """:meth:`num_keys` under its C++ name.

        Returns:
            The number of keys.
        """
        return self.num_keys()

    def multi_get(self, keys):
        """The values of several keys in one call, waiting for each.

        Args:
            keys: the keys.

        Returns:
            Their values, as bytes, in the order of ``keys``.
        """
        return self._inner.multi_get(keys)

    def multi_set(self, keys, values):
        """Set several keys in one call.

        Args:
            keys: the keys.
            values: their values, in the same order.

        Returns:
            What the inner store returns (None).
        """
        return self._inner.multi_set(keys, values)

    def set_timeout(self, timeout: timedelta):
        """Set the inner store's default timeout.

        Args:
            timeout: the new timeout.

        Returns:
            What the inner store returns (None).
        """
        return self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout


def worker_store(topology: Topology, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> dist.Store:
    """Connect to the world's TCPStore, or start it on rank 0 when the agent does not host it.

    Args:
        topology: this rank's topology (its rank, ``master_addr`` and ``master_port``).
        timeout: seconds to connect, and the store's default timeout for its operations.
        env: the environment read for ``TORCHELASTIC_USE_AGENT_STORE``; ``os.environ`` when None.

    Returns:
        The connected ``TCPStore``.

    Raises:
        ValueError: if ``timeout`` is not positive.
        RuntimeError: torch's ``DistNetworkError``/``DistStoreError`` when the store cannot be
            reached or started within ``timeout``.
    """
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
    """A PrefixStore private to one generation and one purpose.

    A process group re-initialised on reused keys hangs, so each communicator of each generation
    gets keys of its own.

    Args:
        base: the world's store.
        topology: the generation's topology (its run id and generation).
        purpose: a short name such as ``pg``, ``agree`` or ``drain``.

    Returns:
        A ``PrefixStore`` over ``base`` with prefix
        ``elastic_emb/<run_id>/gen<generation>/<purpose>/``.

    Raises:
        ValueError: if ``purpose`` is empty or contains ``/``.
    """
    if not purpose or "/" in purpose:
        raise ValueError(f"purpose={purpose!r} must be a non-empty name without '/'")
    return dist.PrefixStore(f"{scope(topology.run_id, topology.generation)}/{purpose}/", base)
