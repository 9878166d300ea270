"""HMAC signatures on the control keys, so a store writer without the job's secret cannot steer it.

Whoever can write to the rendezvous store can write elastic_emb's round keys. Some of them make
processes act: a drain request stops every worker after a step, a death report makes the agents
evict a node, a left mark tells a departure from a death, an eviction mark makes a worker stop
itself, the agreed stop step says when. With a job secret (``ELASTIC_EMB_JOB_SECRET``, e.g. from
a Kubernetes Secret; at least 16 bytes), every such value is written as
``eesig1:<hex HMAC-SHA256 over key NUL value>:<value>`` and every reader verifies it: a value
without a valid signature is ignored and reported (``control_key_rejected`` with the key and
the reason), as if it were not there. The key is inside the MAC, so a signed value cannot be
moved to another key (another round, another node).

Without a secret, values are written and read as they are: whoever can reach the store can stop,
evict or stall the job (the README states this trust model). Counters (``acks``, ``dead``,
``stop_claim``) are not signed: they only say where to look, never what to do.

torch's own rendezvous state cannot carry a signature (torch writes it); what it can make
elastic_emb do is bounded instead: the agent validates it with the restricted decoder before
torch unpickles it (no code runs), and with a secret a worker does not stop itself because the
state leaves its node out unless an agent confirmed the eviction with a signed mark.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from elastic_emb.errors import SecretError
from elastic_emb.rdzv.keys import ENV_JOB_SECRET

_TAG = b"eesig1:"
MIN_SECRET_BYTES = 16


class Signer:
    """Signs and verifies control values with the job's secret (or passes them through without one)."""

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise SecretError(
                f"{ENV_JOB_SECRET} is {len(secret)} bytes: use at least {MIN_SECRET_BYTES} random bytes "
                f"(e.g. `openssl rand -hex 32`), the same value for every node of the job"
            )
        self._secret = secret
        self._rejected: set[str] = set()  # keys already reported: one event per key

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Signer":
        from elastic_emb.config import load

        secret = load(env, "job_secret").job_secret
        return cls(secret.get_secret_value().encode() if secret is not None else None)

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()

    def sign(self, key: str, value: str | bytes) -> bytes:
        """The bytes to store under ``key`` for ``value``."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        if self._secret is None:
            return data
        return _TAG + self._mac(key, data) + b":" + data

    def verify(self, key: str, raw: Any) -> tuple[bytes | None, str]:
        """``(value, "")`` when ``raw`` (read under ``key``) is acceptable, else ``(None, reason)``."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if self._secret is None:
            if data.startswith(_TAG):  # a signed value in a job without a secret: take the value
                return data.split(b":", 2)[-1], ""
            return data, ""
        if not data.startswith(_TAG):
            return None, "unsigned"
        mac, sep, value = data[len(_TAG):].partition(b":")
        if not sep or not hmac.compare_digest(mac, self._mac(key, value)):
            return None, "bad_signature"
        return value, ""


def read_signed(store: Any, signer: Signer, key: str, log: Any = None) -> bytes | None:
    """The verified value under ``key``, or None when it is absent or not validly signed (then a
    ``control_key_rejected`` event names the key and the reason)."""
    if not store.check([key]):
        return None
    value, reason = signer.verify(key, store.get(key))
    if value is None and log is not None and key not in signer._rejected:
        signer._rejected.add(key)
        log.warning("control_key_rejected", key=key, reason=reason,
                    remedy="a value without the job secret's signature was written to the store: check who can "
                    "reach the rendezvous endpoint")
    return value
