"""The worker side's one way into a running rendezvous: :class:`RendezvousReader`.

A worker's watcher, the preStop hook and ``elastic-emb rdzv-state`` open torch's state (decoded
with the restricted decoder) and the store of elastic_emb's round keys through it, for the inner
backend ``c10d``, ``etcd-v2`` or ``etcd-v3``. It imports no agent-side module and each backend's
client only when that backend is used. :func:`print_state` is ``elastic-emb rdzv-state``.

Design: ``docs/RDZV.md`` (section "The worker side's reader").
"""

from __future__ import annotations

import time
from datetime import timedelta

from elastic_emb.rdzv.decode import RendezvousView, decode_state
from elastic_emb.rdzv.keys import (
    C10D_NULL_STATE,
    C10D_STATE_KEY,
    ENV_RDZV_BACKEND,
    ENV_RDZV_ENDPOINT,
    ETCD_STATE_KEY,
    ETCD_STORE_PREFIX,
)

__all__ = ["RendezvousReader", "print_state"]


class RendezvousReader:
    """Reads torch's state and reads/writes elastic_emb's round keys, for one inner backend.

    Args:
        backend: the inner backend: ``c10d``, ``etcd-v2`` or ``etcd-v3``.
        endpoint: the rendezvous endpoint, ``HOST:PORT`` (etcd-v3: members separated by ``,``).
        run_id: the rendezvous run id.
        timeout: seconds bounding every store call.
        connect_timeout: seconds bounding the first connection (c10d), which a worker makes at
            start, when a loaded host may be slow to accept (default: ``timeout``).

    Raises:
        ValueError: when the endpoint is not ``HOST:PORT`` or the backend is unknown.
    """

    def __init__(
        self, backend: str, endpoint: str, run_id: str, timeout: float = 2.0, connect_timeout: float | None = None
    ) -> None:
        self.backend = backend
        self.run_id = run_id
        host, _, port = endpoint.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()):
            raise ValueError(f"{ENV_RDZV_ENDPOINT}={endpoint!r} must be HOST:PORT")
        self.endpoint = endpoint
        if backend == "c10d":
            import torch.distributed as dist

            self.store = dist.TCPStore(
                host,
                int(port),
                is_master=False,
                timeout=timedelta(seconds=max(timeout, connect_timeout or 0.0)),
                use_libuv=True,
            )
            self.store.set_timeout(timedelta(seconds=timeout))
            self._state_key = C10D_STATE_KEY.format(run_id=run_id)
            self._client = None
        elif backend == "etcd-v2":
            import etcd  # python-etcd

            from elastic_emb.rdzv.etcd_v2 import CasEtcdStore  # the drain's stop step needs compare_set

            self._client = etcd.Client(host=host, port=int(port), read_timeout=max(1, int(timeout)))
            self.store = CasEtcdStore(self._client, ETCD_STORE_PREFIX, timeout=timedelta(seconds=timeout))
            self._state_key = ETCD_STATE_KEY.format(run_id=run_id)
        elif backend == "etcd-v3":
            from elastic_emb.rdzv.etcd_v3 import open_reader

            self.store, self._v3 = open_reader(endpoint, run_id, timeout)
            self._client = self._v3
        else:
            raise ValueError(f"{ENV_RDZV_BACKEND}={backend!r}: use c10d, etcd-v2 or etcd-v3")

    def world_store(self, timeout: float):
        """A separate client of the rendezvous store with a longer timeout: the store of the
        generations the survivors form in process, whose process groups wait on it.

        Args:
            timeout: seconds bounding the new client's store calls.

        Returns:
            A ``TCPStore`` client (c10d), an :class:`~elastic_emb.rdzv.etcd_v3.EtcdV3Store`
            (etcd-v3) or a :class:`~elastic_emb.rdzv.etcd_v2.CasEtcdStore` (etcd-v2: the
            agreements need ``compare_set``).
        """
        host, _, port = self.endpoint.rpartition(":")
        if self._client is None:
            import torch.distributed as dist

            return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True)
        if self.backend == "etcd-v3":  # its own client: the endpoint may list several members
            from elastic_emb.rdzv.etcd_v3 import open_reader

            return open_reader(self.endpoint, self.run_id, timeout)[0]
        import etcd

        from elastic_emb.rdzv.etcd_v2 import CasEtcdStore  # agreements need compare_set

        client = etcd.Client(host=host, port=int(port), read_timeout=max(1, int(timeout)))
        return CasEtcdStore(client, ETCD_STORE_PREFIX, timeout=timedelta(seconds=timeout))

    def raw_state(self) -> bytes | None:
        """torch's state as stored, not decoded.

        Returns:
            ``base64(pickle(state))``, or None when there is no state yet.
        """
        if self._client is None:
            if not self.store.check([self._state_key]):
                return None
            raw = self.store.get(self._state_key)
            return None if raw == C10D_NULL_STATE else raw
        if self.backend == "etcd-v3":
            return self._v3.raw_state()
        import etcd

        try:
            return self._client.read(self._state_key).value.encode()
        except etcd.EtcdKeyNotFound:
            return None

    def state(self) -> RendezvousView | None:
        """torch's state, decoded with the restricted decoder.

        Returns:
            The view, or None when there is no state yet.

        Raises:
            UnsafeStateError: when the stored value is not a state the decoder admits.
        """
        raw = self.raw_state()
        return None if raw is None else decode_state(raw)


# -- print the rendezvous state (restricted decoding): ``elastic-emb rdzv-state`` -----------------


def print_state(endpoint: str, run_id: str, inner: str = "c10d", follow: float = 0.0, count: int = 1) -> int:
    """Print the decoded rendezvous state as JSON lines (``elastic-emb rdzv-state``).

    Args:
        endpoint: the rendezvous endpoint.
        run_id: the rendezvous run id.
        inner: the inner backend.
        follow: seconds between reads.
        count: the number of reads (at least one).

    Returns:
        0, the command's exit code.

    Raises:
        ValueError: for an invalid endpoint or backend.
        UnsafeStateError: when the stored value is not a state the decoder admits.
    """
    reader = RendezvousReader(inner, endpoint, run_id)
    for i in range(max(1, count)):
        view = reader.state()
        print(view.model_dump_json() if view is not None else '{"state": null}', flush=True)
        if i + 1 < count:
            time.sleep(follow)
    return 0
