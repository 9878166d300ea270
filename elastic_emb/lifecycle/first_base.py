"""The first commit of a generation formed in process: a full base, written in the background.

Why: the delta chain of the snapshot tier does not cross generations (a delta's rows are those of
its base's shard, and a re-form re-lays the shards), so the first commit after an in-process
re-form writes every row of the new shard, with its replica: 0.3-2 s for a 128 MB shard on the
2-core VM, measured as most of the survivors' pause at 256 MB (docs/RESIZE.md). Nothing needs that
base before the next failure: until it is complete, the newest complete commit (of the old
generation, or the one the restore used) is the restore point, exactly as during any commit.

So the first due commit of such a generation captures the base (a copy of the shard, in the
training thread) and hands it to the background writer (``state.writer.CommitWriter``), whatever
``async_commit`` says. The commits due while any rank's base is still being written are
*coalesced*: nothing is written, the rows they changed stay in the context's change masks, and
the first commit after the window writes them all as one delta on the base. A commit is
collective (every rank writes the same step, or none does), so whether a due step is coalesced is
decided once, by rank 0, and read by every other rank from the generation's store
(:meth:`FirstBase.defer`: one key per due step, only during the window): each rank counts itself
in once its own writer has nothing in flight, and rank 0 ends the window at the first due step at
which every rank has.

Only where it pays: a shard of at least ``MIN_SHARD_BYTES`` of weights (judged from the table
specs and the world size, the same on every rank). A small base costs less in the training thread
than the background writer's own communicator takes to form, and is complete at once.

The trade-off, stated: a second failure inside the window (about the base's write time) restores
the newest complete commit, so it costs the steps since that commit, not one step; a drain or a
forced commit inside the window waits for the base and commits as usual; a job that closes inside
the window leaves its last steps uncommitted (``close()`` waits for the base only).
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
    """Whether a generation of ``world_size`` ranks over ``tables`` (name -> TableSpec) writes its
    first base in the background: an average shard of at least :data:`MIN_SHARD_BYTES` of
    weights. The same answer on every rank (specs and world size only)."""
    total = 0
    for spec in tables.values():
        itemsize = torch.empty((), dtype=getattr(torch, getattr(spec, "dtype", "float32"))).element_size()
        total += int(spec.num_rows) * int(getattr(spec, "dim", 1)) * itemsize
    return total >= MIN_SHARD_BYTES * max(1, world_size)


class FirstBase:
    """The window of one generation's first base (module docstring). ``step`` is the base's step
    once captured; ``coalesced`` the first step coalesced since, or None."""

    def __init__(self, store, topology: Topology) -> None:
        self._store = generation_store(store, topology, "first-base")
        self._rank = topology.rank
        self._world = topology.world_size
        self._counted = False
        self.step: int | None = None
        self.coalesced: int | None = None

    def defer(self, step: int, written: bool) -> bool:
        """Collective (every rank, at the same due ``step``): whether to coalesce it. ``written``:
        this rank's writer has nothing in flight (its base is complete, or failed: the next
        commit raises that as usual)."""
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
                raise ValueError(f"first-base verdict for step {step} is {value[:40]!r}, expected b'0' or b'1': "
                                 f"a foreign writer shares this generation's store keys")
            defer = value == b"1"
        if defer and self.coalesced is None:
            self.coalesced = step
        return defer
