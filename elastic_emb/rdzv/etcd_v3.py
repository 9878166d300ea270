"""``inner=etcd-v3``: torch's dynamic rendezvous kept in etcd through etcd's v3 API.

- :class:`EtcdV3RendezvousBackend`: torch's ``RendezvousBackend``, compare-and-swap on ``mod_revision``;
- :class:`EtcdV3Store`: the ``torch.distributed.Store`` of the agents and of elastic_emb's round keys;
- :func:`create_backend` (torchrun's entry, ``inner=etcd-v3``) and :func:`open_reader` (the worker side).

Both talk to etcd through :class:`~elastic_emb.rdzv.etcd_v3_client.EtcdV3Client`, whose names stay
importable from here. Design: ``docs/RDZV.md`` (section "The etcd backends").
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
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic_emb.errors import EtcdV3Error
from elastic_emb.rdzv.conf import config_error

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
    """The etcd key of a run's rendezvous state.

    Args:
        run_id: the rendezvous run id (``--rdzv-id``).

    Returns:
        The key, the same path as torch's etcd-v2 backend uses.
    """
    return STATE_PREFIX + run_id


class EtcdRefusedError(EtcdV3Error, RendezvousError):
    """:class:`~elastic_emb.errors.EtcdV3Error` that is also torch's ``RendezvousError`` (not its
    ``RendezvousConnectionError``): etcd refused a rendezvous call. The outage guard does not retry
    it, and torch's keep-alive timer logs it instead of dying on it.

    Args:
        message: the call, etcd's answer and the remedy.
        code: etcd's gRPC status code.
        kind: ``"authentication"``, ``"permission"``, ``"lease"`` or ``"request"``.
    """


def _refused(exc: EtcdV3Error) -> EtcdRefusedError:
    return EtcdRefusedError(str(exc), exc.code, exc.kind)


def _token(token: Any) -> int | None:
    """A token this backend issued (a positive revision), or None for anything else."""
    if isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token > 0 else None
    if isinstance(token, (str, bytes)):
        text = token.decode(errors="replace") if isinstance(token, bytes) else token
        return int(text) if (text.isascii() and text.isdigit()) and int(text) > 0 else None
    return None


class EtcdV3RendezvousBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on etcd v3.

    The state is stored as base64 text under :func:`state_key`, attached to a lease of ``ttl``
    seconds granted afresh every ``ttl/3``; tokens are the state key's ``mod_revision``.

    Args:
        client: the etcd client.
        run_id: the rendezvous run id.
        ttl: the state lease in seconds (default: the client's ``ttl`` option).

    Raises:
        ValueError: when ``run_id`` is empty.
    """

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
        """The stored value, unchecked (what the worker side decodes itself).

        Returns:
            The base64 text of the pickled state, or None when no state exists.

        Raises:
            EtcdV3ConnectionError: when no etcd member can serve the read.
            EtcdRefusedError: when etcd refuses the read.
        """
        kv = self._call(self._client.get, self._key)
        return None if kv is None else kv.value

    def get_state(self) -> tuple[bytes, Any] | None:
        """The state and its token.

        Returns:
            ``(pickled state, token)``, or None when no state exists.

        Raises:
            RendezvousStateError: when the stored value is not base64.
            EtcdV3ConnectionError: when no etcd member can serve the read.
            EtcdRefusedError: when etcd refuses the read.
        """
        kv = self._call(self._client.get, self._key)
        return None if kv is None else self._decode(kv)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` if ``token`` is current (compare-and-swap; one transaction).

        Args:
            state: the pickled state.
            token: the token of the state the caller read; None when it read no state.

        Returns:
            ``(state, new token, True)`` when written; otherwise ``(current state, its token,
            False)``, or None when no state exists. A token this backend did not issue writes
            nothing.

        Raises:
            RendezvousStateError: when the current value is not base64.
            EtcdV3ConnectionError: when no etcd member can serve the call.
            EtcdRefusedError: when etcd refuses the call (a lost lease is replaced once first).
        """
        revision = 0 if token is None else _token(token)
        if revision is None:  # not a token this backend issued: nothing is written
            current = self.get_state()
            return None if current is None else (*current, False)
        try:
            written, new_rev, current = self._client.put_if(
                self._key, base64.b64encode(state), mod_revision=revision, lease=self._lease_id()
            )
        except EtcdV3Error as exc:
            if exc.kind != "lease":
                raise _refused(exc) from exc
            # etcd no longer has the lease (its data was wiped, or the lease was revoked): the
            # lease kept here would fail every write until its renewal at ttl/3. Take a new one now.
            self._lease = None
            written, new_rev, current = self._call(
                self._client.put_if, self._key, base64.b64encode(state), mod_revision=revision, lease=self._lease_id()
            )
        if written:
            return state, new_rev, True
        return None if current is None else (*self._decode(current), False)

    def _decode(self, kv: KeyValue) -> tuple[bytes, int]:
        try:
            return base64.b64decode(kv.value, validate=True), kv.mod_revision
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError(
                f"the rendezvous state under {self._key} is corrupt (not base64: {kv.value[:40]!r}); delete the key "
                f"or use another --rdzv-id"
            ) from exc

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
            raise _refused(exc) from exc


# -- the c10d store -----------------------------------------------------------------------------


class EtcdV3Store(Store):
    """A ``torch.distributed.Store`` on etcd v3 (keys under ``prefix``).

    Blocking reads poll with a short backoff until the store's timeout (no streaming watch).
    Every call may raise :class:`EtcdV3ConnectionError` (no member can serve it) or
    :class:`~elastic_emb.errors.EtcdV3Error` (etcd refused it).

    Args:
        client: the etcd client.
        prefix: the key prefix of the store (a ``/`` is appended when missing).
        timeout: the store's timeout (default: torch's store default).
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
        """Write ``value`` under ``key``.

        Args:
            key: the store key.
            value: str or bytes (or a list of byte values, as C++ passes them).

        Raises:
            ValueError: when ``value`` is of another type.
        """
        self.client.put(self._key(key), self._value(value))

    def get(self, key: str) -> bytes:
        """The value under ``key``, waiting for it up to the store's timeout.

        Args:
            key: the store key.

        Returns:
            The value.

        Raises:
            LookupError: when the key is not set within the timeout.
        """
        found = self._wait_get([key], self.timeout)
        if found is None:
            raise LookupError(f"key {key!r} not found in the etcd-v3 store within {self.timeout}")
        return found[0]

    def add(self, key: str, num: int) -> int:
        """Add ``num`` to the counter under ``key`` (compare-and-swap, retried on a collision).

        Args:
            key: the store key (a missing key counts as 0).
            num: the amount to add.

        Returns:
            The counter's new value.

        Raises:
            TimeoutError: when every compare-and-swap lost for the store's timeout (at least 1 s).
        """
        k = self._key(key)
        deadline = time.monotonic() + max(self.timeout.total_seconds(), 1.0)
        current = self.client.get(k)
        while True:
            base = 0 if current is None else int(current.value.decode() or 0)
            written, _, now = self.client.put_if(
                k, str(base + int(num)), mod_revision=0 if current is None else current.mod_revision
            )
            if written:
                return base + int(num)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"add({key!r}) lost every compare-and-swap for {self.timeout}: the key is "
                    f"written faster than this client can update it"
                )
            current = now
            time.sleep(random.uniform(0, 0.01))  # spread colliding writers

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (``TCPStore``'s semantics).

        Args:
            key: the store key.
            expected_value: the value the key must hold; empty for a missing key.
            desired_value: the value to write.

        Returns:
            The value the key holds afterwards (``expected_value`` when the key is missing and
            ``expected_value`` is not empty).

        Raises:
            ValueError: when a value is not str or bytes.
        """
        k, expected, desired = self._key(key), self._value(expected_value), self._value(desired_value)
        if expected:
            written, _, now = self.client.put_if(k, desired, prev_value=expected)
        else:
            written, _, now = self.client.put_if(k, desired, mod_revision=0)
        if written:
            return desired
        return expected if now is None else now.value

    def delete_key(self, key: str) -> bool:
        """Delete ``key``.

        Args:
            key: the store key.

        Returns:
            Whether the key existed.
        """
        return self.client.delete(self._key(key)) > 0

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set, without waiting (one transaction).

        Args:
            keys: the store keys.

        Returns:
            True when all of them exist.
        """
        wanted = [self._key(k) for k in keys]
        return len(self.client.get_many(wanted)) == len(set(wanted))

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        """Wait until every key is set.

        Args:
            keys: the store keys.
            override_timeout: the bound of this wait (default: the store's timeout).

        Raises:
            LookupError: when not all keys are set within the bound.
        """
        if self._wait_get(keys, override_timeout or self.timeout) is None:
            raise LookupError(
                f"keys {list(keys)!r} not all set in the etcd-v3 store within {override_timeout or self.timeout}"
            )

    def num_keys(self) -> int:
        """The number of keys under the store's prefix.

        Returns:
            The count etcd reports.
        """
        reply = self.client.call(
            "kv/range", {"key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix)), "count_only": True}
        )
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
    """The backend and store of ``inner=etcd-v3`` (the factory in ``conf.INNER_BACKENDS``).

    Connects once (a range of the state key), so a wrong endpoint or credentials fail here, and
    puts the non-secret client options into :data:`ENV_OPTIONS` for the workers' watchers. A
    refusal here (credentials, permission) is a configuration error: one line, no retry.

    Args:
        params: torchrun's ``RendezvousParameters`` (endpoint, run id, ``--rdzv-conf``).

    Returns:
        ``(backend, store)``.

    Raises:
        ValueError: for invalid client options or an invalid endpoint.
        EtcdV3ConnectionError: when no etcd member answers.
        RendezvousConfigError: when etcd refuses the first read (credentials, permission), naming
            the kind of refusal and the remedy (a plain ``ValueError`` with ``ELASTIC_EMB_DEBUG``).
    """
    options = ClientOptions.from_conf(dict(params.config))
    client = EtcdV3Client.from_endpoint(params.endpoint, options)
    backend = EtcdV3RendezvousBackend(client, params.run_id, ttl=options.ttl)
    try:
        backend.raw_state()  # fail fast (EtcdV3ConnectionError) when no member answers
    except EtcdRefusedError as exc:
        raise config_error(f"inner=etcd-v3: {exc}") from None
    os.environ[ENV_OPTIONS] = options.to_env()
    return backend, EtcdV3Store(client, STORE_PREFIX)


def open_reader(
    endpoint: str, run_id: str, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[EtcdV3Store, EtcdV3RendezvousBackend]:
    """For the worker side (watcher, drain hook, ``rdzv-state``): the round-key store and the state.

    The client options come from :data:`ENV_OPTIONS` (else ``PET_RDZV_CONF``, else the defaults),
    with ``timeout`` as the read timeout. Nothing is read yet.

    Args:
        endpoint: ``HOST[:PORT][,HOST[:PORT]...]``.
        run_id: the rendezvous run id.
        timeout: seconds bounding every request and the store's blocking reads.
        env: the environment to read the options from (default: ``os.environ``).

    Returns:
        ``(store of elastic_emb's round keys, backend)``; the backend's
        :meth:`~EtcdV3RendezvousBackend.raw_state` reads the state.

    Raises:
        ValueError: for invalid options or an invalid endpoint.
    """
    options = ClientOptions.from_env(env).model_copy(update={"read_timeout": float(timeout)})
    client = EtcdV3Client.from_endpoint(endpoint, options)
    return EtcdV3Store(client, STORE_PREFIX, timeout=timedelta(seconds=timeout)), EtcdV3RendezvousBackend(
        client, run_id
    )
