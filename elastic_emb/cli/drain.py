"""Drain on request: the client side of a Kubernetes ``preStop`` hook (``elastic-emb drain``).

:func:`request_drain` asks the workers of the running round to stop after a committed step,
through the backend's drain keys (``rdzv/keys.py``), and waits, bounded, for every worker's
signed acknowledgement, so a departing node's rows are in a commit before its workers die.
:class:`DrainTarget` says where the job's rendezvous is; :class:`DrainOutcome` what the drain
ended with.

Design: ``docs/LIFECYCLE.md`` (section "The preStop drain client").
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from elastic_emb.errors import DrainError
from elastic_emb.events import get_logger
from elastic_emb.progress import Progress
from elastic_emb.rdzv.drain_acks import NO_WATCHERS_GRACE, AckCounter, read_expected

# The drain protocol's keys under round_prefix(run_id, round): the wire contract (rdzv/keys.py);
# tests/test_deploy.py runs this client against real watchers.
from elastic_emb.rdzv.keys import KEY_DRAIN, KEY_STOP_STEP, round_prefix
from elastic_emb.rdzv.signing import Signer, read_signed
from elastic_emb.topology import SAFE_NAME


class DrainTarget(BaseModel):
    """Where the running job's rendezvous is: the inner backend, its endpoint and the run id."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    inner: Literal["c10d", "etcd-v2", "etcd-v3"]
    endpoint: str = Field(min_length=3)
    run_id: str = Field(min_length=1)

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        endpoint: str | None = None,
        run_id: str | None = None,
        inner: str | None = None,
    ) -> "DrainTarget":
        """The target from explicit values first, then elastic_emb's variables, then torchrun's.

        Args:
            env: the environment to read; None reads ``os.environ``. ``PET_*`` are what a preStop
                hook sees in the pod.
            endpoint: the rendezvous ``HOST:PORT``, or None.
            run_id: the run id, or None (else ``TORCHELASTIC_RUN_ID``, ``PET_RDZV_ID``, ``none``).
            inner: the inner backend, or None (else ``ELASTIC_EMB_RDZV_BACKEND``, ``inner=`` in
                ``PET_RDZV_CONF``, ``c10d``).

        Returns:
            The target.

        Raises:
            DrainError: no endpoint is known, the inner backend is not supported, or the run id is
                not a plain name.
            ConfigError: an ``ELASTIC_EMB_*`` variable is malformed.
        """
        from elastic_emb.config import load

        env = os.environ if env is None else env
        settings = load(env, "rdzv_endpoint", "rdzv_backend")
        endpoint = endpoint or settings.rdzv_endpoint or env.get("PET_RDZV_ENDPOINT")
        if not endpoint:
            raise DrainError(
                "no rendezvous endpoint: neither ELASTIC_EMB_RDZV_ENDPOINT nor PET_RDZV_ENDPOINT is set; "
                "pass --endpoint HOST:PORT (the job's --rdzv-endpoint)"
            )
        inner = inner or settings.rdzv_backend or _conf_value(env.get("PET_RDZV_CONF", ""), "inner") or "c10d"
        run_id = run_id or env.get("TORCHELASTIC_RUN_ID") or env.get("PET_RDZV_ID") or "none"
        if inner not in ("c10d", "etcd-v2", "etcd-v3"):
            raise DrainError(f"inner rendezvous backend {inner!r} is not supported: use c10d, etcd-v2 or etcd-v3")
        if not re.fullmatch(SAFE_NAME, run_id):
            raise DrainError(
                f"run id {run_id[:80]!r} is not a plain name: use 1-128 letters, digits, '_', '-' or '.', not "
                "starting with '.'; pass the job's --rdzv-id as --run-id"
            )
        return cls(inner=inner, endpoint=endpoint, run_id=run_id)


class DrainOutcome(BaseModel):
    """What the drain request ended with (printed as JSON by ``elastic-emb drain``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outcome: Literal["acknowledged", "no_running_round", "no_watchers", "timeout"]
    round: int | None
    acks: int
    expected: int
    stop_step: int | None
    elapsed_s: float

    @property
    def ok(self) -> bool:
        """Whether the drain ended without a timeout."""
        return self.outcome != "timeout"


def _conf_value(conf: str, key: str) -> str | None:
    """The value of ``key`` in a torchrun ``--rdzv-conf`` string ``k=v,k=v``."""
    for item in conf.split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip() == key:
            return v.strip()
    return None


def request_drain(
    target: DrainTarget,
    *,
    timeout: float = 60.0,
    poll: float = 0.05,
    reason: str = "prestop",
    connect_timeout: float = 5.0,
) -> DrainOutcome:
    """Ask the workers of the running round to stop after a committed step; wait for their acks.

    Args:
        target: where the job's rendezvous is.
        timeout: seconds to wait for every acknowledgement.
        poll: seconds between reads.
        reason: why the drain is requested, recorded in the request.
        connect_timeout: seconds to reach the rendezvous store.

    Returns:
        The outcome: ``acknowledged`` when every worker acknowledged, ``no_running_round`` at
        once when there is no complete round, ``no_watchers`` when no worker published its count
        within a short grace, ``timeout`` after ``timeout`` seconds otherwise.

    Raises:
        ValueError: ``timeout`` or ``poll`` is not positive.
        DrainError: the rendezvous store cannot be reached within ``connect_timeout``, or a count
            of the drain protocol read from it is foreign (unsigned, or out of range).
    """
    if timeout <= 0 or poll <= 0:
        raise ValueError(f"timeout={timeout!r} and poll={poll!r} must be > 0 seconds")
    from elastic_emb.rdzv.reader import RendezvousReader  # imports torch.distributed: only when draining

    start = time.monotonic()
    try:
        reader = RendezvousReader(target.inner, target.endpoint, target.run_id, timeout=connect_timeout)
        state = reader.state()
    except Exception as exc:  # connection refused / timed out: name what was tried
        raise DrainError(
            f"cannot read the rendezvous of run {target.run_id!r} at {target.endpoint} ({target.inner}): "
            f"{type(exc).__name__}: {exc}. Check --endpoint/--run-id/--inner (PET_RDZV_ENDPOINT, PET_RDZV_ID, "
            f"PET_RDZV_CONF inner=...)"
        ) from None

    def done(
        outcome: str, round_: int | None, acks: int = 0, expected: int = 0, stop: int | None = None
    ) -> DrainOutcome:
        return DrainOutcome(
            outcome=outcome,
            round=round_,
            acks=acks,
            expected=expected,
            stop_step=stop,
            elapsed_s=round(time.monotonic() - start, 3),
        )

    if state is None or not state.complete or state.closed:
        return done("no_running_round", None if state is None else state.round)
    store = reader.store
    prefix = round_prefix(target.run_id, state.round)
    signer = Signer.from_env()
    log = get_logger("elastic_emb.cli.drain", round=state.round)
    counter = AckCounter(store, signer, prefix, state.round, log)
    expected = _checked(target, read_expected, store, signer, prefix)
    settle = time.monotonic() + min(timeout, NO_WATCHERS_GRACE)
    while not expected and time.monotonic() < settle:
        # None (or 0): no worker runs a watcher, or the round's watchers are starting, or a store
        # writer deleted the key and rank 0's watcher writes it back (rdzv/drain_acks.py)
        time.sleep(poll)
        expected = _checked(target, read_expected, store, signer, prefix)
    if not expected:  # a watcher writes its world size (>= 1): none did
        return done("no_watchers", state.round)
    _checked(target, counter.hint)  # checked before asking anything
    if read_signed(store, signer, prefix + KEY_DRAIN) is None:
        request = json.dumps({"round": state.round, "reason": reason, "host": socket.gethostname()})
        store.set(prefix + KEY_DRAIN, signer.sign(prefix + KEY_DRAIN, request))
    deadline = start + timeout
    with Progress("drain", expected, unit="acks", round=state.round) as progress:  # acknowledged k of n
        while True:
            last = time.monotonic() >= deadline
            acks = _checked(target, counter.count, expected, final=last)
            progress.advance(acks - progress.done)
            if acks >= expected:
                value = read_signed(store, signer, prefix + KEY_STOP_STEP, log)
                stop = int(value) if value is not None else None
                return done("acknowledged", state.round, acks, expected, stop)
            if last:
                return done("timeout", state.round, acks, expected)
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def _checked(target: DrainTarget, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A count of the drain protocol read from the store (untrusted input, ``rdzv/drain_acks.py``):
    a foreign value ends the drain with :class:`DrainError` naming the key and the value."""
    try:
        return read(*args, **kwargs)
    except ValueError as exc:
        raise DrainError(f"cannot drain run {target.run_id!r}: {exc}") from None
