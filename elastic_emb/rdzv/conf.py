"""The backend's configuration: its own ``--rdzv-conf`` keys and the registry of inner backends.

- :class:`ListenerConfig`: elastic_emb's ``--rdzv-conf`` keys (torch's pass through to the inner backend);
- :func:`check_conf_keys`: refuses a key neither elastic_emb nor torch reads;
- :class:`TorchConfValues`: the values of torch's keys, checked before torch reads them;
- :func:`config_error`: the refusal (``RendezvousConfigError``), one line under torchrun;
- :data:`INNER_BACKENDS`, :func:`register_inner`: ``inner=NAME`` to the factory of torch's backend and store.

Design: ``docs/RDZV.md`` (section "Configuration"); the keys' table: ``docs/CONFIG.md``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from elastic_emb.errors import RendezvousConfigError
from elastic_emb.rdzv.keys import C10D_STATE_KEY, ETCD_STATE_KEY
from elastic_emb.topology import SAFE_NAME

DEBUG_ENV = "ELASTIC_EMB_DEBUG"  # the CLI's variable: set, an error shows its stack

# The largest timeout or interval any key takes, seconds (a week): past it a value is a typo, and
# torch turns values near float's range into OverflowError inside its timers.
MAX_SECONDS = 7 * 24 * 3600.0


def config_error(message: str) -> ValueError:
    """The error for a bad ``--rdzv-conf``: :class:`RendezvousConfigError`, or with ``ELASTIC_EMB_DEBUG``
    set a plain ``ValueError`` (whose stack torchrun prints).

    Args:
        message: one line naming the key, the value and the remedy.

    Returns:
        The error to raise.
    """
    if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
        return ValueError(message)
    return RendezvousConfigError(f"elastic_emb rendezvous: {message}")


def check_run_id(run_id: Any) -> str:
    """Refuse a run id that is not a plain name (it becomes store keys and a state directory).

    Args:
        run_id: torchrun's ``--rdzv-id``.

    Returns:
        ``run_id``.

    Raises:
        RendezvousConfigError: naming the id and the names allowed.
    """
    if not isinstance(run_id, str) or not re.fullmatch(SAFE_NAME, run_id):
        shown = repr(run_id) if len(str(run_id)) <= 80 else f"{str(run_id)[:40]!r}... ({len(str(run_id))} characters)"
        raise config_error(
            f"--rdzv-id {shown} is not a plain name: use 1-128 letters, digits, '_', '-' or '.', not "
            "starting with '.' (it names the job's store keys and state directory)"
        )
    return run_id


class InnerBackend(NamedTuple):
    """An inner rendezvous backend: where torch's ``create_backend(params) -> (backend, store)``
    for it lives, the store key of the state (for messages), what to install when missing, and
    the ``--rdzv-conf`` keys of its own."""

    factory: str  # "module:function"
    state_key: str
    requires: str = ""
    conf_keys: frozenset[str] = frozenset()  # --rdzv-conf keys of its own (beyond torch's)


INNER_BACKENDS: dict[str, InnerBackend] = {}


def register_inner(
    name: str, factory: str, state_key: str, requires: str = "", conf_keys: frozenset[str] = frozenset()
) -> None:
    """Make ``--rdzv-conf inner=NAME`` create its backend with ``factory``.

    Args:
        name: the value of ``inner=`` that selects the backend.
        factory: ``module:function`` of torch's ``create_backend(params) -> (backend, store)``.
        state_key: the store key of torch's state, with ``{run_id}`` (used in messages).
        requires: the package to install when ``factory``'s module cannot be imported.
        conf_keys: the backend's own ``--rdzv-conf`` keys (beyond torch's).
    """
    INNER_BACKENDS[name] = InnerBackend(factory, state_key, requires, frozenset(conf_keys))


register_inner("c10d", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend:create_backend", C10D_STATE_KEY)
register_inner(
    "etcd-v2",
    "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend:create_backend",
    ETCD_STATE_KEY,
    requires="python-etcd",
)
# elastic_emb's own v3 backend; its keys are etcd_v3.CONF_KEYS (listed here: this module imports no torch).
register_inner(
    "etcd-v3",
    "elastic_emb.rdzv.etcd_v3:create_backend",
    ETCD_STATE_KEY,
    conf_keys=frozenset(
        {"read_timeout", "protocol", "ca_cert", "ssl_cert", "ssl_cert_key", "user", "password_file", "ttl"}
    ),
)


# The --rdzv-conf keys torch's dynamic rendezvous and its c10d/etcd-v2 backends read (torch 2.11-2.14:
# dynamic_rendezvous.create_handler, c10d_rendezvous_backend.create_backend,
# etcd_rendezvous_backend.create_backend), plus `timeout`, which torchrun's launcher always adds.
TORCH_CONF_KEYS = frozenset(
    {
        "timeout",
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "is_host",
        "read_timeout",
        "store_type",
        "protocol",
        "ssl_cert",
        "ssl_cert_key",
        "ca_cert",
    }
)


def check_conf_keys(config: Mapping[str, Any]) -> None:
    """Refuse a ``--rdzv-conf`` key neither elastic_emb nor torch reads (torch would ignore a typo).

    Args:
        config: torchrun's ``--rdzv-conf`` as a mapping (``RendezvousParameters.config``).

    Raises:
        RendezvousConfigError: naming every unknown key and listing the valid ones.
    """
    ours = set(ListenerConfig.model_fields)
    inner = INNER_BACKENDS.get(str(config.get("inner") or "c10d"))
    ours |= inner.conf_keys if inner is not None else set()
    unknown = sorted(set(config) - ours - TORCH_CONF_KEYS)
    if unknown:
        given = ", ".join(f"{k}={config[k]}" for k in unknown)
        raise config_error(
            f"--rdzv-conf {given}: unknown key{'s' if len(unknown) > 1 else ''} for "
            f"--rdzv-backend=elastic_emb; valid keys: {', '.join(sorted(ours))} (elastic_emb) and "
            f"{', '.join(sorted(TORCH_CONF_KEYS))} (torch)"
        )


def _seconds(default: float | None = None, *, gt: float = 0.0) -> Any:
    return Field(default=default, gt=gt, le=MAX_SECONDS, allow_inf_nan=False)


class TorchConfValues(BaseModel):
    """The values of torch's ``--rdzv-conf`` keys that torch reads unchecked.

    torch accepts ``keep_alive_interval=-1`` (its keep-alive thread then spins, and the round
    never forms) and turns ``1e20`` into an ``OverflowError`` deep in a timer; these keys are
    refused here first, in one line. Keys not listed (paths, ``store_type``) pass unchecked.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    timeout: float | None = _seconds()
    join_timeout: float | None = _seconds()
    last_call_timeout: float | None = _seconds()
    close_timeout: float | None = _seconds()
    heartbeat_timeout: float | None = _seconds()
    read_timeout: float | None = _seconds()
    keep_alive_interval: float | None = Field(default=None, gt=0.0, le=3600.0, allow_inf_nan=False)
    keep_alive_max_attempt: int | None = Field(default=None, ge=1, le=10_000)
    is_host: bool | None = None


def check_torch_values(config: Mapping[str, Any]) -> TorchConfValues:
    """Check the values of torch's own ``--rdzv-conf`` keys (finite, in range, typed).

    Args:
        config: torchrun's ``--rdzv-conf`` as a mapping.

    Returns:
        The checked values (None: not given).

    Raises:
        RendezvousConfigError: naming each bad key, its value and its range.
    """
    values = {k: v for k, v in config.items() if k in TorchConfValues.model_fields and v not in (None, "")}
    try:
        return TorchConfValues(**values)
    except ValidationError as exc:
        raise config_error(f"invalid --rdzv-conf: {_explain(exc, values)}") from None


def _explain(exc: ValidationError, values: Mapping[str, Any]) -> str:
    return "; ".join(
        f"{e['loc'][0]}={values.get(e['loc'][0])!r}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
    )


class ListenerConfig(BaseModel):
    """elastic_emb's own ``--rdzv-conf`` keys (torch's keys pass through to the inner backend)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    inner: str = "c10d"
    event_file: str | None = None
    drain: bool = True
    drain_timeout: float = Field(default=30.0, ge=0.0, le=86400.0, allow_inf_nan=False)
    sync_interval: float = Field(default=0.1, gt=0.0, le=1.0, allow_inf_nan=False)
    watch_interval: float = Field(default=0.1, gt=0.0, le=10.0, allow_inf_nan=False)
    store_outage_timeout: float = Field(default=30.0, ge=0.0, le=3600.0, allow_inf_nan=False)
    resize: Literal["restart", "in_process"] = "restart"
    # seconds a worker may go without progress (a step, or long work advancing) before its agent
    # kills it as hung; 0: no watchdog
    hang_timeout: float = Field(default=15.0, ge=0.0, le=86400.0, allow_inf_nan=False)

    @field_validator("inner")
    @classmethod
    def _known_inner(cls, value: str) -> str:
        if value not in INNER_BACKENDS:
            raise ValueError(f"unknown inner backend; use one of {sorted(INNER_BACKENDS)}")
        return value

    @field_validator("event_file")
    @classmethod
    def _event_file_in_a_directory(cls, value: str | None) -> str | None:
        # The file is created; its directory is not: a typo must not create directories.
        if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
            raise ValueError("its directory does not exist; create it first or fix the path")
        return value

    @classmethod
    def from_params(cls, config: Mapping[str, Any]) -> "ListenerConfig":
        """The validated configuration from torchrun's ``--rdzv-conf``.

        Args:
            config: torchrun's ``--rdzv-conf`` as a mapping; ``drain`` may be a string such as
                ``1``, ``0``, ``true`` or ``off``.

        Returns:
            The configuration, with defaults for the keys not given.

        Raises:
            RendezvousConfigError: for an unknown key, a ``drain`` value that is not a boolean word, a
                value out of range or not finite (of elastic_emb's keys or torch's), or an
                ``event_file`` in a directory that does not exist, naming the key and the value.
        """
        check_conf_keys(config)
        check_torch_values(config)
        values: dict[str, Any] = {}
        for key in cls.model_fields:
            if key in config and config[key] is not None:
                raw = config[key]
                if key == "drain" and isinstance(raw, str):
                    low = raw.strip().lower()
                    if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise config_error(f"--rdzv-conf drain={raw!r}: use 1 or 0")
                    raw = low in ("1", "true", "yes", "on")
                values[key] = raw
        try:
            return cls(**values)
        except ValidationError as exc:
            raise config_error(f"invalid --rdzv-conf for the elastic_emb backend: {_explain(exc, values)}") from None
