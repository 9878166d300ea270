"""The agent's view of the store: every call under the :class:`~elastic_emb.rdzv.outage.OutageGuard`.

- :class:`GuardedBackend`: torch's state backend with every state validated by the restricted
  decoder before torch unpickles it (a state that is not torch's is replaced by an empty next
  round; so is a state the store lost, so that rounds never go back), fair writes (:class:`~elastic_emb.rdzv.write_priority.WritePriority`) and the heartbeats
  credited for a store outage;
- :class:`GuardedStore`: the round-key store (``set``/``get``/``add``/``check``).

Design: ``docs/RDZV.md`` (section "The agent's store").
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from elastic_emb.rdzv.decode import RendezvousView, UnsafeStateError, load_state
from elastic_emb.rdzv.outage import OutageGuard


class GuardedBackend:
    """torch's ``RendezvousBackend`` with its calls under an OutageGuard and its states validated.

    Attributes it does not define are the inner backend's.

    Args:
        inner: torch's backend.
        guard: the agent's outage guard.
        expiry: the heartbeat expiry (``keep_alive_interval x keep_alive_max_attempt``): how long
            an outage's credit lasts.
        key: the state's store key, for messages.
        log: a structlog logger (``foreign_rendezvous_state``), or None.
        priority: a :class:`~elastic_emb.rdzv.write_priority.WritePriority`, or None.
    """

    def __init__(
        self,
        inner: Any,
        guard: OutageGuard,
        expiry: timedelta,
        *,
        key: str = "the rendezvous state",
        log: Any = None,
        priority: Any = None,
    ) -> None:
        self._inner = inner
        self._priority = priority
        self._guard = guard
        self._expiry = expiry
        self._key = key
        self._log = log
        self._shifted_outages = 0
        self._shift_until = 0.0
        self._last_round = -1  # the newest round of a valid state this agent saw
        self.replaced = 0  # states that were not torch's, replaced by an empty next round
        self.lost = 0  # times the store was found without the state of a round this agent saw
        self._lost_reported = -1  # the newest round seen when the last loss was logged

    @property
    def name(self) -> str:
        return self._inner.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def get_state(self):
        """The inner backend's ``get_state``, validated and credited for the last outage.

        A value that is not torch's state (a class outside the state's own, bytes that do not
        decode, a complete round without participants, which torch never writes) is never
        unpickled by torch: an empty state of the next round stands in for it, with the stored
        value's token, so the next write (an honest round) replaces it.

        A store that lost the state of a round this agent saw (etcd's data wiped, the key deleted)
        answers no state, or a state of an older round that a node which never saw the history
        created since: an empty state of the round after the newest one seen stands in for it
        (``rendezvous_state_lost``), with no token or the stored value's, so the next write
        re-forms the job at a round number never used before instead of at round 0.

        Returns:
            ``(pickled state, token)``, or None when no state exists and this agent saw none.

        Raises:
            StoreOutageError: when the store stays unreachable past the guard's bound.
        """
        result = self._guard.call("get_state", self._inner.get_state)
        if result is None:
            return None if self._last_round < 0 else (self._lost("no state"), None)
        bits, token = result
        return self._checked(bits), token

    def set_state(self, state: bytes, token: Any = None):
        """The inner backend's ``set_state``, bracketed by the write priority and validated.

        Args:
            state: the pickled state to write.
            token: the token of the state the caller read.

        Returns:
            ``(pickled state, token, has_set)`` as torch's backend returns it (a state that is not
            torch's replaced as by :meth:`get_state`), or None.

        Raises:
            StoreOutageError: when the store stays unreachable past the guard's bound.
        """
        if self._priority is not None:
            self._guard.call("write_priority", self._priority.before_write)
        result = self._guard.call("set_state", self._inner.set_state, state, token)
        if result is None:
            return None if self._last_round < 0 else (self._lost("no state"), None, False)
        bits, token, has_set = result
        if self._priority is not None:
            self._guard.call("write_priority", self._priority.after_write, bool(has_set))
        return self._checked(bits), token, has_set

    def _checked(self, bits: bytes) -> bytes:
        try:
            view = RendezvousView.of(load_state(bits))
        except UnsafeStateError as exc:
            return self._replaced(str(exc))
        if view.complete and not view.participants:
            return self._replaced("a complete round without participants, which torch never writes")
        if view.round < self._last_round:  # torch's rounds only go up: the store lost the newer ones
            return self._lost(f"round {view.round}, created since by a node that did not see round {self._last_round}")
        self._last_round = max(self._last_round, view.round)
        return self._credit_outage(bits)

    def _lost(self, found: str) -> bytes:
        """An empty state of the round after the newest one seen, in place of a state the store lost."""
        from elastic_emb.rdzv import torch_compat

        round_ = self._last_round + 1
        if self._lost_reported != self._last_round:  # once per loss, not at every poll until a write
            self._lost_reported = self._last_round
            self.lost += 1
            if self._log is not None:
                self._log.warning(
                    "rendezvous_state_lost",
                    key=self._key,
                    last_round=self._last_round,
                    found=found,
                    replaced_by_round=round_,
                    remedy="the rendezvous store lost the job's state (etcd restarted with an empty data directory, "
                    "or the key was deleted); the agents re-form the job at a new round and the workers restore "
                    "its newest commit. Give etcd persistent storage (three members or more)",
                )
        return torch_compat.fresh_state(round_)

    def _replaced(self, why: str) -> bytes:
        """An empty state of the round after the newest valid one seen, in place of a foreign value."""
        from elastic_emb.rdzv import torch_compat

        round_ = self._last_round + 1
        self.replaced += 1
        if self._log is not None:
            self._log.error(
                "foreign_rendezvous_state",
                key=self._key,
                error=why,
                replaced_by_round=round_,
                remedy="something other than torch wrote the rendezvous state; the agents replace it with a new "
                "round. Restrict who can write to the rendezvous store",
            )
        return torch_compat.fresh_state(round_)

    def _credit_outage(self, bits: bytes) -> bytes:
        guard = self._guard
        if guard.last_outage is None:
            return bits
        now = time.monotonic()
        if guard.outages != self._shifted_outages:  # a new outage ended: credit it for one expiry
            self._shifted_outages = guard.outages
            self._shift_until = now + self._expiry.total_seconds() + guard.last_outage[1]
        if now > self._shift_until:
            return bits
        from elastic_emb.rdzv import torch_compat

        began, length = guard.last_outage
        return torch_compat.credit_heartbeats(bits, began, length, self._expiry)


class GuardedStore:
    """The round-key store (``set``/``get``/``add``/``check``) under an OutageGuard.

    Every call raises ``StoreOutageError`` once the store stays unreachable past the guard's bound.

    Args:
        inner: the store.
        guard: the agent's outage guard.
    """

    def __init__(self, inner: Any, guard: OutageGuard) -> None:
        self._inner = inner
        self._guard = guard

    def set(self, key: str, value: Any) -> None:
        """``inner.set`` under the guard.

        Args:
            key: the store key.
            value: the value.

        Returns:
            What the inner store's ``set`` returns (None).
        """
        return self._guard.call("store.set", self._inner.set, key, value)

    def get(self, key: str) -> Any:
        """``inner.get`` under the guard.

        Args:
            key: the store key.

        Returns:
            The value.
        """
        return self._guard.call("store.get", self._inner.get, key)

    def add(self, key: str, amount: int) -> int:
        """``inner.add`` under the guard.

        Args:
            key: the store key.
            amount: the amount to add.

        Returns:
            The counter's new value.
        """
        return self._guard.call("store.add", self._inner.add, key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        """``inner.compare_set`` under the guard (``rdzv/counters.py`` reads counters with it).

        Args:
            key: the store key.
            expected: the value required for the swap (empty: the key is absent).
            desired: the new value.

        Returns:
            The value the key holds afterwards.
        """
        return self._guard.call("store.compare_set", self._inner.compare_set, key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        """``inner.check`` under the guard.

        Args:
            keys: the store keys.

        Returns:
            Whether every key is set.
        """
        return self._guard.call("store.check", self._inner.check, keys)
