"""torchrun's exit barrier, counted over the members of now (``resize=in_process``).

When an agent's workers succeed, torch's agent waits in an exit barrier until every agent of its
round has arrived: ``store_util.barrier(store, world_size=<the round's node count>,
key_prefix="torchelastic/agent/terminal_state")``, where arriving is ``add(".../num_members", 1)``
and the agent whose count equals *its* ``world_size`` sets ``.../last_member``, which the others
wait for (300 s by default, then it logs an error and exits).

In ``resize=in_process`` mode the membership changes inside a round: nodes leave or die without a
new round, and joiners enter the running round as extra participants. Every agent still counts
with the node count of the round it joined, so the barrier never completes (a scale-down: the
count waits for a node that is gone; a scale-up: the joiner counts 2, the first node 1, and if the
joiner arrives first nobody's count is ever equal to its own number), and the agents outlive their
job by the barrier's timeout. Found by the drills (``scale-down``, ``scale-up``, ``agent-loss`` in
process, their agents left running at the end).

:class:`ExitBarrierStore` wraps the store an agent gets from the rendezvous. It passes everything
through, with two additions for the barrier's keys only: an arrival also writes this node's own
key (``.../arrived/<node>``), and the wait for ``last_member`` ends as soon as every node that is a
member *now* (torch's participants, read fresh; the dead drop out when their heartbeat expires or
their orphan reports them) has arrived; that agent then sets ``last_member`` for the others. The
bound stays torch's barrier timeout.
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
    """``inner`` with torch's exit barrier completed by the current members (module docstring).

    ``node``: this agent's node id; ``members()``: the node ids that are members now."""

    def __init__(self, inner, node: str, members: Callable[[], tuple[str, ...]], poll: float = 0.1) -> None:
        super().__init__(inner)
        self._node = node
        self._members = members
        self._poll = poll

    # the barrier's two operations (everything else passes through) -----------------------------

    def add(self, key, value):
        if key == NUM_MEMBERS and value == 1:
            self._inner.set(ARRIVED + self._node, "1")  # before the count: whoever sees the count sees us
        return self._inner.add(key, value)

    def wait(self, keys, timeout=None):
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
                raise TimeoutError(f"exit barrier: members {list(members)} did not all arrive within {limit:g} s "
                                   f"(arrived: {[n for n in members if self._inner.check([ARRIVED + n])]})")
            time.sleep(self._poll)
        return None
