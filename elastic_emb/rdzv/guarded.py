"""The agent's view of the store: torch's state backend and elastic_emb's round keys, every call
under the :class:`~elastic_emb.rdzv.outage.OutageGuard`, every state validated before torch sees it.

:class:`GuardedBackend` wraps torch's ``RendezvousBackend`` (``get_state``/``set_state``), which
the handler installs as the state holder's backend (``torch_compat.wrap_state_backend``), so
torch's own reads and compare-and-set writes go through it:

- **Validation.** Every state it returns has been decoded with the restricted decoder
  (``decode.load_state``) before torch's state holder runs ``pickle.loads`` on the same bytes. A
  value naming any class outside the state's own (a pickle payload written to
  ``torch.rendezvous.<run_id>`` by whoever can reach the store) raises
  :class:`ForeignStateError`, also torch's ``RendezvousStateError``, so no code of the payload
  runs in the agent; torch's agent then fails the rendezvous with that message (it cannot go on
  without a state it can trust), which names the key and the remedy.
- **Fair writes.** With a :class:`~elastic_emb.rdzv.write_priority.WritePriority`, each
  compare-and-set first yields to a node that keeps losing its writes (a starved late agent),
  and counts its own losses: torch's single-key state otherwise starves a slow writer.
- **Outage credit.** After an outage, heartbeats that were alive when it began are moved forward
  by its length in every state read for one expiry period (until live nodes have written fresh
  ones): no node could write a heartbeat while the store was down, and torch's sync would
  otherwise remove every node as dead at its first read.

:class:`GuardedStore` is the round-key store (``set``/``get``/``add``/``check``) under the guard.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from elastic_emb.errors import ForeignStateError
from elastic_emb.rdzv.decode import UnsafeStateError, load_state
from elastic_emb.rdzv.outage import OutageGuard

_FOREIGN_STATE_ERROR: list[type] = []


def foreign_state_error() -> type[ForeignStateError]:
    """ForeignStateError that is also torch's ``RendezvousStateError`` (what torch's agent expects
    from a corrupt state); built on first use (see ``torch_compat``'s import note)."""
    if not _FOREIGN_STATE_ERROR:
        from torch.distributed.elastic.rendezvous.api import RendezvousStateError

        _FOREIGN_STATE_ERROR.append(type("ForeignStateError", (ForeignStateError, RendezvousStateError), {
            "__module__": __name__, "__doc__": ForeignStateError.__doc__}))
    return _FOREIGN_STATE_ERROR[0]


class GuardedBackend:
    """torch's ``RendezvousBackend`` with its calls under an OutageGuard and its states validated."""

    def __init__(self, inner: Any, guard: OutageGuard, expiry: timedelta, *, key: str = "the rendezvous state",
                 log: Any = None, priority: Any = None) -> None:
        self._inner = inner
        self._priority = priority
        self._guard = guard
        self._expiry = expiry
        self._key = key
        self._log = log
        self._shifted_outages = 0
        self._shift_until = 0.0

    @property
    def name(self) -> str:
        return self._inner.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def get_state(self):
        result = self._guard.call("get_state", self._inner.get_state)
        if result is None:
            return None
        bits, token = result
        return self._checked(bits), token

    def set_state(self, state: bytes, token: Any = None):
        if self._priority is not None:
            self._guard.call("write_priority", self._priority.before_write)
        result = self._guard.call("set_state", self._inner.set_state, state, token)
        if result is None:
            return None
        bits, token, has_set = result
        if self._priority is not None:
            self._guard.call("write_priority", self._priority.after_write, bool(has_set))
        return self._checked(bits), token, has_set

    def _checked(self, bits: bytes) -> bytes:
        try:
            load_state(bits)
        except UnsafeStateError as exc:
            if self._log is not None:
                self._log.error("foreign_rendezvous_state", key=self._key, error=str(exc))
            raise foreign_state_error()(
                f"refusing the value of {self._key} before unpickling it: {exc}. Remove the key (the agents "
                f"re-create the state) and restrict who can write to the rendezvous store"
            ) from None
        return self._credit_outage(bits)

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
    """The round-key store (``set``/``get``/``add``/``check``) under an OutageGuard."""

    def __init__(self, inner: Any, guard: OutageGuard) -> None:
        self._inner = inner
        self._guard = guard

    def set(self, key: str, value: Any) -> None:
        return self._guard.call("store.set", self._inner.set, key, value)

    def get(self, key: str) -> Any:
        return self._guard.call("store.get", self._inner.get, key)

    def add(self, key: str, amount: int) -> int:
        return self._guard.call("store.add", self._inner.add, key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._guard.call("store.check", self._inner.check, keys)
