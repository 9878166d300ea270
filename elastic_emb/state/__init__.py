"""Where embedding rows live between generations, and how they come back resharded.

Three tiers hold committed state; one restore reads them all.

* **live**: when the old and the new context are in one process, the old context's exported
  shard stays in memory across the teardown and its rows move rank to rank over the *new*
  context's communicator, per the reshard plan, with no disk.
* **snapshot** (:mod:`.snapshot`, node-local, with replicas on other nodes).
* **durable** (:mod:`.durable`, ``torch.distributed.checkpoint``, loadable by plain DCP at any
  world size).

Modules, from the bottom up:

* :mod:`.manifest`: the on-disk records of a commit, :class:`CommitId`, checksums, atomic writes.
* :mod:`.paths`: node identity and the directory layout.
* :mod:`.comm`: the communicator (process group for tensors, store for small JSON).
* :mod:`.plan`: pure planning (who sends which rows to whom, replica placement).
* :mod:`.transport`: one :class:`Transport` interface; all-to-all, gloo p2p and cross-memory
  attach (:mod:`.cma`) behind it; :func:`execute_plan` and :func:`move_rows` on top.
* :mod:`.snapshot`, :mod:`.durable`: the two tiers that write commits (:mod:`.shardfile`: a
  snapshot's data file, packed, written and read back verified).
* :mod:`.restore`: the collective restore (inventory, choice of commit, verification, transfer)
  and :func:`inspect_state` for operators.
* :mod:`.points`: named points of a commit where tests inject faults (a no-op in production).

Every commit of every tier ends with a JSON manifest written last by atomic rename, so a commit
torn by a crash is never read as complete. When state exists but no commit is complete,
:class:`~elastic_emb.errors.RestoreError` names the row ranges nobody holds: never silent zeros,
never fresh random rows.
"""

from elastic_emb.state.comm import TRANSPORTS, Comm
from elastic_emb.state.durable import DurableTier
from elastic_emb.state.manifest import (
    CommitId,
    DurableManifest,
    ShardRecord,
    SnapshotManifest,
    TensorRecord,
    as_bytes,
    checksum,
    commit_dirname,
    write_atomic,
)
from elastic_emb.state.crc import crc32_combine
from elastic_emb.state.paths import node_id_from_env
from elastic_emb.state.plan import Assignment, Piece, plan_assignments, replica_holders
from elastic_emb.state.restore import Inventory, RestoreReport, inspect_state, restore
from elastic_emb.state.shardfile import read_snapshot
from elastic_emb.state.snapshot import SnapshotTier
from elastic_emb.state.transport import (
    AllToAllTransport,
    CmaTransport,
    LivePiece,
    Move,
    Moved,
    P2PTransport,
    Transport,
    execute_plan,
    move_rows,
    transport_for,
)

__all__ = [
    "TRANSPORTS", "AllToAllTransport", "Assignment", "CmaTransport", "Comm", "CommitId", "DurableManifest",
    "DurableTier", "Inventory", "LivePiece", "Move", "Moved", "P2PTransport", "Piece", "RestoreReport",
    "ShardRecord", "SnapshotManifest", "SnapshotTier", "TensorRecord", "Transport", "as_bytes", "checksum",
    "commit_dirname", "crc32_combine", "execute_plan", "inspect_state", "move_rows", "node_id_from_env",
    "plan_assignments", "read_snapshot", "replica_holders", "restore", "transport_for", "write_atomic",
]
