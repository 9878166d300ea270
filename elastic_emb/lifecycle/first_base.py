"""The first commit of a generation formed in process: a full base, written in the background.

A re-form re-lays the shards, so a new generation's first commit writes every row. It goes to
the background writer, and the commits due until every rank's base is complete are coalesced into
one delta on it; rank 0 decides each due step for all (:class:`FirstBase`), so every rank writes
the same commits. Only where shards are large enough to pay (:func:`wanted`).

Design: ``docs/LIFECYCLE.md`` (section "The first base of an in-process generation").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from elastic_emb.store import generation_store
from elastic_emb.topology import Topology

KEY_DONE = "done"  # ranks whose base is complete (counted once each)
KEY_STEP = "step/"  # + a due step: rank 0's verdict, b"1": coalesced, b"0": commit


MIN_SHARD_BYTES = 16 << 20  # a rank's share of the tables' weights from which the base goes to the background


def wanted(tables: Mapping[str, object], world_size: int) -> bool:
    """Whether a generation writes its first base in the background.

    It does when an average shard holds at least :data:`MIN_SHARD_BYTES` of weights. The answer
    depends on the specs and the world size only, so it is the same on every rank.

    Args:
        tables: the context's tables, name -> ``TableSpec``.
        world_size: the generation's number of ranks.

    Returns:
        True when the base is large enough to write in the background.
    """
    total = 0
    for spec in tables.values():
        itemsize = torch.empty((), dtype=getattr(torch, getattr(spec, "dtype", "float32"))).element_size()
        total += int(spec.num_rows) * int(getattr(spec, "dim", 1)) * itemsize
    return total >= MIN_SHARD_BYTES * max(1, world_size)


class FirstBase:
    """The window of one generation's first base, during which due commits are coalesced.

    ``step`` is the base's step once captured; ``coalesced`` the first step coalesced since, or
    None. The verdicts live under a ``first-base`` prefix of the generation's store.

    Args:
        store: the generation's store.
        topology: the generation's topology.
    """

    def __init__(self, store, topology: Topology) -> None:
        self._store = generation_store(store, topology, "first-base")
        self._rank = topology.rank
        self._world = topology.world_size
        self._counted = False
        self.step: int | None = None
        self.coalesced: int | None = None

    def defer(self, step: int, written: bool) -> bool:
        """Whether to coalesce the due ``step``; collective (every rank, at the same step).

        Each rank counts itself in once its base is written; rank 0 decides whether every rank
        has and publishes the verdict, the others read it.

        Args:
            step: the due step.
            written: this rank's writer has nothing in flight (its base is complete, or failed:
                the next commit raises that as usual).

        Returns:
            True to coalesce the step (write nothing now), False to commit it as usual.

        Raises:
            ValueError: the verdict in the store is neither ``b"0"`` nor ``b"1"`` (a foreign
                writer shares the keys).
        """
        if written and not self._counted:
            self._store.add(KEY_DONE, 1)
            self._counted = True
        key = f"{KEY_STEP}{step}"
        if self._rank == 0:
            defer = int(self._store.add(KEY_DONE, 0)) < self._world
            self._store.set(key, b"1" if defer else b"0")
        else:
            value = self._store.get(key)  # bounded by the store's timeout; a dead rank 0 interrupts it
            if value not in (b"0", b"1"):
                raise ValueError(
                    f"first-base verdict for step {step} is {value[:40]!r}, expected b'0' or b'1': "
                    f"a foreign writer shares this generation's store keys"
                )
            defer = value == b"1"
        if defer and self.coalesced is None:
            self.coalesced = step
        return defer
