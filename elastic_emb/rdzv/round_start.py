"""Restart mode: a member lost between its round's completion and its role record costs a re-form.

After a round completes, torch's agents exchange ``torchelastic/role_info/<group rank>`` (group
rank 0 gathers them all) and ``torchelastic/assigned_ranks/<group rank>``, each read blocking
until the store's timeout. A node killed in between (a flapping node) left the survivors' agents
waiting out that timeout and then failing, the job dead. :class:`RoundStartStore` waits in slices
and, once the handler says a member of the round is gone, stands in for its missing records with
this agent's own role and size: the workers start in a world that the very next membership check
replaces (a membership restart, not a failure), so the survivors re-form within the heartbeat
expiry. Design: ``docs/RDZV.md`` ("Flapping nodes: a member lost mid-round"), with the bound.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic_emb.store import ForwardingStore

ROLE_INFO = "torchelastic/role_info/"
ASSIGNED_RANKS = "torchelastic/assigned_ranks/"
SLICE_S = 0.5  # each blocking wait; between slices the handler is asked who is gone


class RoundStartStore(ForwardingStore):
    """The round's store, whose reads of torch's rank records end when a member is gone.

    Args:
        inner: the store the agent got from the rendezvous.
        group_rank: this agent's group rank in the round.
        group_world_size: the round's node count.
        lost: returns the group ranks of the round's members known gone (empty while all live).
        log: a structlog logger (``round_member_lost``).
        timeout: how long a read waits at most when nobody is lost (torch's own bound).
        reached: called with ``agent_role_info_written`` once this agent's role record is in the
            store and with ``agent_ranks_assigned`` once it read its ranks (the handler's fault
            points, for the tests).
    """

    def __init__(
        self,
        inner: Any,
        group_rank: int,
        group_world_size: int,
        lost: Callable[[], list[int]],
        log: Any,
        timeout: float = 60.0,
        reached: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self._reached = reached or (lambda point: None)
        self._rank = group_rank
        self._world = group_world_size
        self._lost = lost
        self._log = log
        self._timeout = timeout

    def set(self, key, value):
        """torch's ``set``; after this agent's own role record, the fault point ``agent_role_info_written``.

        Args:
            key: the key.
            value: its value.
        """
        self._inner.set(key, value)
        if str(key) == f"{ROLE_INFO}{self._rank}":
            self._reached("agent_role_info_written")

    def multi_get(self, keys):
        """torch's group rank 0 gathers every role record; a lost member's is stood in for.

        Args:
            keys: the keys.

        Returns:
            Their values.
        """
        keys = list(keys)
        if keys and all(str(k).startswith(ROLE_INFO) for k in keys):
            gone = self._wait(keys)
            if gone:
                mine = json.loads(self._inner.get(f"{ROLE_INFO}{self._rank}"))
                out = []
                for k in keys:
                    if self._inner.check([k]):
                        out.append(self._inner.get(k))
                    else:
                        rank = int(str(k)[len(ROLE_INFO) :])
                        stand_in = {"role": mine["role"], "rank": rank, "local_world_size": mine["local_world_size"]}
                        out.append(json.dumps(stand_in).encode())
                return out
        return self._inner.multi_get(keys)

    def get(self, key):
        """A read of this agent's assigned ranks ends when the gatherer (group rank 0) is gone.

        Args:
            key: the key.

        Returns:
            Its value; for a gatherer that is gone, ranks computed as if every node ran this
            agent's number of workers (the world is replaced at the next membership check).
        """
        if str(key) != f"{ASSIGNED_RANKS}{self._rank}":
            return self._inner.get(key)
        if self._wait([key]) and not self._inner.check([key]):
            lws = json.loads(self._inner.get(f"{ROLE_INFO}{self._rank}"))["local_world_size"]
            base, total = self._rank * lws, self._world * lws
            value = json.dumps([base, total, base, total]).encode()
        else:
            value = self._inner.get(key)
        self._reached("agent_ranks_assigned")
        return value

    def _wait(self, keys: list) -> list[int]:
        """Wait for ``keys`` in slices; the lost members' group ranks when some are gone first
        (empty when every key came, or the bound passed: the caller's read then decides)."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                self._inner.wait(keys, timedelta(seconds=SLICE_S))
                return []
            except Exception as exc:  # a slice ran out (torch raises its own timeout error)
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
            gone = self._lost()
            if gone:
                missing = [k for k in keys if not self._inner.check([k])]
                self._log.warning(
                    "round_member_lost",
                    lost_group_ranks=gone,
                    missing=[str(k) for k in missing][:8],
                    action="standing in for their records: the next membership check restarts the workers "
                    "in a round without them",
                )
                return gone
            if time.monotonic() > deadline:
                return []
