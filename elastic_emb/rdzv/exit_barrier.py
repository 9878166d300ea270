"""torchrun's exit barrier, counted over the members of now (``resize=in_process``).

torch's barrier counts up to the node count of the round each agent joined, which an in-process
change does not update. :class:`ExitBarrierStore` wraps the agent's store: an arrival also writes
``.../arrived/<node>``, and the wait for ``.../last_member`` ends once every member of now has
arrived. Everything else passes through.

Design: ``docs/RDZV.md`` (section "The exit barrier").
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic_emb.store import ForwardingStore

# torch's names (torch/distributed/elastic/agent/server/api.py and utils/store.py; checked by
# tests/test_inprocess.py against the installed torch).
TERMINAL_STATE_PREFIX = "torchelastic/agent/terminal_state"
NUM_MEMBERS = TERMINAL_STATE_PREFIX + "/num_members"
LAST_MEMBER = TERMINAL_STATE_PREFIX + "/last_member"
ARRIVED = TERMINAL_STATE_PREFIX + "/arrived/"


class ExitBarrierStore(ForwardingStore):
    """``inner`` with torch's exit barrier completed by the current members.

    Args:
        inner: the store the agent got from the rendezvous.
        node: this agent's node id.
        members: returns the node ids that are members now (empty when unknown: the wait goes on).
        poll: seconds between looks while waiting for ``last_member``.
    """

    def __init__(self, inner, node: str, members: Callable[[], tuple[str, ...]], poll: float = 0.1) -> None:
        super().__init__(inner)
        self._node = node
        self._members = members
        self._poll = poll

    # the barrier's two operations (everything else passes through) -----------------------------

    def add(self, key, value):
        """``inner.add``; an arrival at the barrier first writes this node's ``arrived`` key.

        Args:
            key: the store key.
            value: the amount to add.

        Returns:
            The counter's new value.
        """
        if key == NUM_MEMBERS and value == 1:
            self._inner.set(ARRIVED + self._node, "1")  # before the count: whoever sees the count sees us
        return self._inner.add(key, value)

    def wait(self, keys, timeout=None):
        """``inner.wait``; the wait for ``last_member`` alone ends once every member of now arrived.

        The agent that sees them all sets ``last_member`` for the others.

        Args:
            keys: the store keys to wait for.
            timeout: the bound (default: the inner store's timeout).

        Returns:
            None (for other keys, what the inner store's ``wait`` returns).

        Raises:
            TimeoutError: when the members of now did not all arrive within the bound, naming
                who arrived.
        """
        if list(keys) != [LAST_MEMBER]:
            return super().wait(keys, timeout)
        limit = (timeout or self._inner.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self._inner.check([LAST_MEMBER]):
            members = self._members()
            if members and self._inner.check([ARRIVED + n for n in members]):
                self._inner.set(LAST_MEMBER, "<all members of now arrived>")
                return None
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"exit barrier: members {list(members)} did not all arrive within {limit:g} s "
                    f"(arrived: {[n for n in members if self._inner.check([ARRIVED + n])]})"
                )
            time.sleep(self._poll)
        return None
