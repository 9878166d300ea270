"""HMAC signatures on the control keys, so a store writer without the job's secret cannot steer it.

With a job secret (``ELASTIC_EMB_JOB_SECRET``, at least 16 bytes) every control value is written
as ``eesig1:<hex HMAC-SHA256 over key NUL value>:<value>`` (:meth:`Signer.sign`), and a value
without a valid signature reads as absent and is reported once per key (:func:`read_signed`,
``control_key_rejected``). Without a secret, values pass as they are. Counters are not signed.

Design: ``docs/RDZV.md`` (section "Signing control keys").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from elastic_emb.errors import SecretError, UnsafeStateError
from elastic_emb.rdzv.keys import ENV_JOB_SECRET
from elastic_emb.store import ForwardingStore

_TAG = b"eesig1:"
MIN_SECRET_BYTES = 16


class Signer:
    """Signs and verifies control values with the job's secret (or passes them through without one).

    Args:
        secret: the job's secret, or None for a job without one.

    Raises:
        SecretError: when ``secret`` is shorter than :data:`MIN_SECRET_BYTES`.
    """

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise SecretError(
                f"{ENV_JOB_SECRET} is {len(secret)} bytes: use at least {MIN_SECRET_BYTES} random bytes "
                f"(e.g. `openssl rand -hex 32`), the same value for every node of the job"
            )
        self._secret = secret
        self._rejected: set[str] = set()  # keys already reported: one event per key

    def key_prefix(self) -> str:
        """The prefix :func:`signed_store` puts the workers' keys under: derived from the secret,
        so nobody without it can name them.

        Returns:
            ``"k<24 hex digits>"`` (a ``PrefixStore`` adds the ``/``).

        Raises:
            SecretError: when the job has no secret.
        """
        if self._secret is None:
            raise SecretError(f"no {ENV_JOB_SECRET}: a key prefix needs the job's secret")
        digest = hmac.new(self._secret, b"elastic_emb workers' store keys", hashlib.sha256).hexdigest()
        return f"k{digest[:24]}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Signer":
        """The signer of the job's secret, ``ELASTIC_EMB_JOB_SECRET``.

        Args:
            env: the environment to read (default: ``os.environ``).

        Returns:
            The signer (passing values through when the variable is unset).

        Raises:
            SecretError: when the secret is shorter than :data:`MIN_SECRET_BYTES`.
            ConfigError: when the variable's value is invalid.
        """
        from elastic_emb.config import load

        secret = load(env, "job_secret").job_secret
        return cls(secret.get_secret_value().encode() if secret is not None else None)

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()

    def sign(self, key: str, value: str | bytes) -> bytes:
        """The bytes to store under ``key`` for ``value``.

        Args:
            key: the store key (inside the MAC, so the value cannot be moved to another key).
            value: the value.

        Returns:
            ``eesig1:<hex MAC>:<value>`` with a secret, the value's bytes without one.
        """
        data = value.encode() if isinstance(value, str) else bytes(value)
        if self._secret is None:
            return data
        return _TAG + self._mac(key, data) + b":" + data

    def verify(self, key: str, raw: Any) -> tuple[bytes | None, str]:
        """Check a value read from the store.

        Args:
            key: the store key it was read under.
            raw: the value read (bytes or str).

        Returns:
            ``(value, "")`` when ``raw`` is acceptable (without a secret: always, a signed value
            yielding its value), else ``(None, reason)`` with reason ``unsigned`` or
            ``bad_signature``.
        """
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if self._secret is None:
            if data.startswith(_TAG):  # a signed value in a job without a secret: take the value
                return data.split(b":", 2)[-1], ""
            return data, ""
        if not data.startswith(_TAG):
            return None, "unsigned"
        mac, sep, value = data[len(_TAG) :].partition(b":")
        if not sep or not hmac.compare_digest(mac, self._mac(key, value)):
            return None, "bad_signature"
        return value, ""


def read_signed(store: Any, signer: Signer, key: str, log: Any = None) -> bytes | None:
    """The verified value under ``key``.

    Args:
        store: the store to read.
        signer: the job's control-key signer.
        key: the store key.
        log: a structlog logger; a value that does not verify is reported once per key
            (``control_key_rejected``, naming the key and the reason). None: not reported.

    Returns:
        The value, or None when the key is absent or its value is not validly signed.
    """
    if not store.check([key]):
        return None
    value, reason = signer.verify(key, store.get(key))
    if value is None:
        report_rejected(signer, key, reason, log)
    return value


def report_rejected(signer: Signer, key: str, reason: str, log: Any) -> None:
    """Log ``control_key_rejected`` for ``key``, once per key and signer.

    Args:
        signer: the job's control-key signer (it remembers the keys reported).
        key: the store key whose value was refused.
        reason: why (``unsigned``, ``bad_signature``, ``not a step``, ...).
        log: a structlog logger, or None (nothing is reported).
    """
    if log is None or key in signer._rejected:
        return
    signer._rejected.add(key)
    log.warning(
        "control_key_rejected",
        key=key,
        reason=reason,
        remedy="a value without the job secret's signature, or not of its kind, was written to the store: "
        "check who can reach the rendezvous endpoint",
    )


class SignedStore(ForwardingStore):
    """The workers' store with every value signed with the job's secret (``signed_store``).

    ``set``, ``multi_set`` and ``compare_set`` write signed values; ``get``, ``multi_get`` and
    ``compare_set`` return a value only when it verifies, and raise naming the key otherwise, so a
    store writer can neither forge an agreement verdict or a restore inventory nor move a value to
    another key. Counters (``add``) cannot be signed: they pass as they are.

    Args:
        inner: the store.
        signer: a signer with the job's secret.
    """

    def __init__(self, inner: Any, signer: Signer) -> None:
        super().__init__(inner)
        self._signer = signer

    def _checked(self, key: Any, raw: Any) -> bytes:
        value, reason = self._signer.verify(str(key), raw)
        if value is None:
            raise UnsafeStateError(
                f"store key {str(key)!r} holds a value {reason.replace('_', ' ')} ({bytes(raw)[:40]!r}): not written "
                "by this job's workers; keep MASTER_ADDR:MASTER_PORT reachable only from the job"
            )
        return value

    def set(self, key, value):
        """Set ``key`` to ``value``, signed.

        Args:
            key: the key.
            value: the value (str or bytes).
        """
        self._inner.set(key, self._signer.sign(str(key), value))

    def get(self, key):
        """The verified value of ``key``, waiting for it up to the store's timeout.

        Args:
            key: the key.

        Returns:
            The value, without its signature.

        Raises:
            UnsafeStateError: when the value is unsigned or badly signed.
        """
        return self._checked(key, self._inner.get(key))

    def multi_get(self, keys):
        """The verified values of several keys.

        Args:
            keys: the keys.

        Returns:
            Their values, in order.

        Raises:
            UnsafeStateError: when a value is unsigned or badly signed.
        """
        keys = list(keys)
        return [self._checked(k, v) for k, v in zip(keys, self._inner.multi_get(keys))]

    def multi_set(self, keys, values):
        """Set several keys, each value signed.

        Args:
            keys: the keys.
            values: their values.
        """
        keys = list(keys)
        self._inner.multi_set(keys, [self._signer.sign(str(k), v) for k, v in zip(keys, values)])

    def compare_set(self, key, expected, desired):
        """``compare_set`` on signed values (signing is deterministic, so equal values compare equal).

        Args:
            key: the key.
            expected: the value the key must hold; empty for a missing key.
            desired: the value to write.

        Returns:
            The value the key holds afterwards, verified.

        Raises:
            UnsafeStateError: when that value is unsigned or badly signed.
        """
        signed_expected = self._signer.sign(str(key), expected) if expected not in ("", b"") else b""
        return self._checked(key, self._inner.compare_set(key, signed_expected, self._signer.sign(str(key), desired)))


def signed_store(store: Any, env: Mapping[str, str] | None = None) -> Any:
    """``store`` with its values signed when the job has a secret (``ELASTIC_EMB_JOB_SECRET``).

    Args:
        store: the workers' store.
        env: the environment to read the secret from (default: ``os.environ``).

    Returns:
        A :class:`SignedStore` over ``store``, or ``store`` itself without a secret (or when it is
        one already).

    Raises:
        SecretError: when the secret is set but too short.
    """
    if store is None or isinstance(store, SignedStore):
        return store
    signer = Signer.from_env(env)
    if not signer.enabled:
        return store
    # Every key also goes under a prefix derived from the secret: a store writer without it cannot
    # name the workers' keys (a TCPStore cannot list them), so it cannot plant or spoil even the
    # counters (``add``), which no signature covers.
    return SignedStore(dist.PrefixStore(signer.key_prefix(), store), signer)
