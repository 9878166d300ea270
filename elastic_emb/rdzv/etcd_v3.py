"""``inner=etcd-v3``: torch's dynamic rendezvous kept in etcd through etcd's v3 API.

torch ships rendezvous backends for c10d (the store lives in one agent) and for etcd's v2 API
(``etcd-v2``, through ``python-etcd`` 0.4.5 of 2017). etcd removed the v2 API in 3.6; 3.5 is the
last line that still has it. This module keeps the rendezvous in etcd through the v3 API:

- :class:`EtcdV3RendezvousBackend` implements torch's public ``RendezvousBackend``
  (``get_state`` / ``set_state``) with compare-and-swap on the key's ``mod_revision``;
- :class:`EtcdV3Store` is the ``torch.distributed.Store`` the dynamic rendezvous hands the agent
  (per-round ``MASTER_ADDR``/``MASTER_PORT``, the agents' barriers) and elastic_emb's round keys
  live in (drain requests, acknowledgements, death reports);
- :func:`create_backend` builds both from torchrun's ``RendezvousParameters``, :func:`open_reader`
  for the worker side.

Both talk to etcd through :class:`~elastic_emb.rdzv.etcd_v3_client.EtcdV3Client`
(``rdzv/etcd_v3_client.py``: the JSON gateway over ``http.client``, kept connections, member
failover, authentication, TLS, the ``--rdzv-conf`` options); this module holds what the
rendezvous means by those calls. The client's names stay importable from here.

**Semantics** (those torch's own backends are held to): ``get_state`` is ``None`` when no state
exists and raises ``RendezvousStateError`` when the stored value is not base64 (the state is
stored as base64 text, as torch's etcd-v2 backend does, so a worker reads the same bytes from
either); ``set_state`` with the current token sets the state and returns the new token (the
write's revision); with a stale, ``None`` (and a state exists) or invalid token it returns the
current state and token and ``has_set=False`` without writing. The compare and the read of the
current state are one transaction, so a failed compare returns the state that beat it. The state
key is attached to a lease of ``ttl`` seconds (default two hours, like etcd-v2's TTL), granted
afresh every ``ttl/3``, so a finished job's state disappears and its run id can be reused.

**Failures.** When no member can serve a call the client raises
:class:`~elastic_emb.rdzv.etcd_v3_client.EtcdV3ConnectionError`, which elastic_emb's outage guard
retries up to ``store_outage_timeout``. An ``add`` whose reply is lost may have been applied (as
with torch's etcd-v2 store); the rendezvous state itself is only ever written under
compare-and-swap, so a retried ``set_state`` cannot apply twice.
"""

from __future__ import annotations

import base64
import binascii
import os
import random
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic_emb.errors import EtcdV3Error
# The transport and its options.
from elastic_emb.rdzv.etcd_v3_client import (
    ENV_OPTIONS,
    ClientOptions,
    EtcdV3Client,
    EtcdV3ConnectionError,
    KeyValue,
    _b64,
)

NAME = "etcd-v3"
STATE_PREFIX = "/torch/elastic/rendezvous/"  # + run id (the same path as torch's etcd-v2 backend)
STORE_PREFIX = "/torch/elastic/store/"


# -- the rendezvous backend ---------------------------------------------------------------------


def state_key(run_id: str) -> str:
    return STATE_PREFIX + run_id


def _token(token: Any) -> int | None:
    """A token this backend issued (a positive revision), or None for anything else."""
    if isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token > 0 else None
    if isinstance(token, (str, bytes)):
        text = token.decode(errors="replace") if isinstance(token, bytes) else token
        return int(text) if text.isdigit() and int(text) > 0 else None
    return None


class EtcdV3RendezvousBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on etcd v3 (module docstring)."""

    def __init__(self, client: EtcdV3Client, run_id: str, ttl: int | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = state_key(run_id)
        self._ttl = int(ttl or client.options.ttl)
        self._lease: tuple[int, float] | None = None  # (lease id, monotonic time granted)

    @property
    def name(self) -> str:
        return NAME

    def raw_state(self) -> bytes | None:
        """The stored value (base64 text of the pickled state), unchecked; None when absent."""
        kv = self._call(self._client.get, self._key)
        return None if kv is None else kv.value

    def get_state(self) -> tuple[bytes, Any] | None:
        kv = self._call(self._client.get, self._key)
        return None if kv is None else self._decode(kv)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        revision = 0 if token is None else _token(token)
        if revision is None:  # not a token this backend issued: nothing is written
            current = self.get_state()
            return None if current is None else (*current, False)
        lease = self._lease_id()
        written, new_rev, current = self._call(self._client.put_if, self._key, base64.b64encode(state),
                                               mod_revision=revision, lease=lease)
        if written:
            return state, new_rev, True
        return None if current is None else (*self._decode(current), False)

    def _decode(self, kv: KeyValue) -> tuple[bytes, int]:
        try:
            return base64.b64decode(kv.value, validate=True), kv.mod_revision
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError(
                f"the rendezvous state under {self._key} is corrupt (not base64: {kv.value[:40]!r}); delete the key "
                f"or use another --rdzv-id") from exc

    def _lease_id(self) -> int:
        """A lease with at least two thirds of ``ttl`` left (a fresh one every ttl/3)."""
        now = time.monotonic()
        if self._lease is None or now - self._lease[1] > self._ttl / 3:
            self._lease = (self._call(self._client.grant_lease, self._ttl), now)
        return self._lease[0]

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EtcdV3ConnectionError:
            raise
        except EtcdV3Error as exc:
            raise RendezvousConnectionError(f"etcd refused a rendezvous call: {exc}") from exc


# -- the c10d store -----------------------------------------------------------------------------


class EtcdV3Store(Store):
    """A ``torch.distributed.Store`` on etcd v3 (keys under ``prefix``).

    Blocking reads poll with a short backoff (10 ms doubling to 100 ms) until the store's timeout:
    the agents read a handful of keys per round and the workers' watchers use the non-blocking
    ``check``, so polling costs etcd little and needs no streaming watch connection.
    """

    def __init__(self, client: EtcdV3Client, prefix: str = STORE_PREFIX, timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix.encode() + (key if isinstance(key, bytes) else str(key).encode())

    @staticmethod
    def _value(value: Any) -> bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, (list, tuple)):  # a vector<uint8_t> from C++
            return bytes(value)
        raise ValueError(f"store value must be str or bytes, got {type(value).__name__}")

    def set(self, key: str, value: Any) -> None:
        self.client.put(self._key(key), self._value(value))

    def get(self, key: str) -> bytes:
        found = self._wait_get([key], self.timeout)
        if found is None:
            raise LookupError(f"key {key!r} not found in the etcd-v3 store within {self.timeout}")
        return found[0]

    def add(self, key: str, num: int) -> int:
        k = self._key(key)
        deadline = time.monotonic() + max(self.timeout.total_seconds(), 1.0)
        current = self.client.get(k)
        while True:
            base = 0 if current is None else int(current.value.decode() or 0)
            written, _, now = self.client.put_if(k, str(base + int(num)),
                                                 mod_revision=0 if current is None else current.mod_revision)
            if written:
                return base + int(num)
            if time.monotonic() > deadline:
                raise TimeoutError(f"add({key!r}) lost every compare-and-swap for {self.timeout}: the key is "
                                   f"written faster than this client can update it")
            current = now
            time.sleep(random.uniform(0, 0.01))  # spread colliding writers

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        k, expected, desired = self._key(key), self._value(expected_value), self._value(desired_value)
        if expected:
            written, _, now = self.client.put_if(k, desired, prev_value=expected)
        else:
            written, _, now = self.client.put_if(k, desired, mod_revision=0)
        if written:
            return desired
        return expected if now is None else now.value

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self._key(key)) > 0

    def check(self, keys: list[str]) -> bool:
        wanted = [self._key(k) for k in keys]
        return len(self.client.get_many(wanted)) == len(set(wanted))

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        if self._wait_get(keys, override_timeout or self.timeout) is None:
            raise LookupError(f"keys {list(keys)!r} not all set in the etcd-v3 store within {override_timeout or self.timeout}")

    def num_keys(self) -> int:
        reply = self.client.call("kv/range", {"key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix)),
                                              "count_only": True})
        return int(reply.get("count", 0))

    def _wait_get(self, keys: Sequence[str], timeout: timedelta) -> list[bytes] | None:
        wanted = [self._key(k) for k in keys]
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.01
        while True:
            found = self.client.get_many(wanted)
            if all(k in found for k in wanted):
                return [found[k].value for k in wanted]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)


def _prefix_end(prefix: str) -> bytes:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


# -- torchrun's entry ---------------------------------------------------------------------------


def create_backend(params: Any) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """``(backend, store)`` from torchrun's ``RendezvousParameters`` (``inner=etcd-v3``).

    Connects once (a range of the state key), so a wrong endpoint or credentials fail here, and
    puts the non-secret client options into :data:`ENV_OPTIONS` for the workers' watchers.
    """
    options = ClientOptions.from_conf(dict(params.config))
    client = EtcdV3Client.from_endpoint(params.endpoint, options)
    backend = EtcdV3RendezvousBackend(client, params.run_id, ttl=options.ttl)
    backend.raw_state()  # fail fast (EtcdV3ConnectionError) when no member answers
    os.environ[ENV_OPTIONS] = options.to_env()
    return backend, EtcdV3Store(client, STORE_PREFIX)


def open_reader(endpoint: str, run_id: str, timeout: float, env: Mapping[str, str] | None = None
                ) -> tuple[EtcdV3Store, EtcdV3RendezvousBackend]:
    """For the worker side (watcher, drain hook, ``rdzv-state``): the store of elastic_emb's
    round keys and the backend whose :meth:`~EtcdV3RendezvousBackend.raw_state` reads the state."""
    options = ClientOptions.from_env(env).model_copy(update={"read_timeout": float(timeout)})
    client = EtcdV3Client.from_endpoint(endpoint, options)
    return EtcdV3Store(client, STORE_PREFIX, timeout=timedelta(seconds=timeout)), EtcdV3RendezvousBackend(client, run_id)
