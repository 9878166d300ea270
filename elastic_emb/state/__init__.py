"""Where embedding rows live between generations, and how they come back resharded.

Three tiers hold committed state: live rows kept in memory across an in-process re-form, node-local
snapshots with replicas on other nodes (:class:`SnapshotTier`), and DCP checkpoints loadable at any
world size (:class:`DurableTier`). One collective :func:`restore` reads them all; rows move by a
:class:`Transport` (:func:`execute_plan`, :func:`move_rows`). Every commit ends with a manifest
written last by atomic rename, and a restore that finds no complete commit raises
:class:`~elastic_emb.errors.RestoreError` instead of inventing rows.

Design: ``docs/COMMIT.md``.
"""

from elastic_emb.state.comm import TRANSPORTS, Comm
from elastic_emb.state.crc import crc32_combine
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
    "TRANSPORTS",
    "AllToAllTransport",
    "Assignment",
    "CmaTransport",
    "Comm",
    "CommitId",
    "DurableManifest",
    "DurableTier",
    "Inventory",
    "LivePiece",
    "Move",
    "Moved",
    "P2PTransport",
    "Piece",
    "RestoreReport",
    "ShardRecord",
    "SnapshotManifest",
    "SnapshotTier",
    "TensorRecord",
    "Transport",
    "as_bytes",
    "checksum",
    "commit_dirname",
    "crc32_combine",
    "execute_plan",
    "inspect_state",
    "move_rows",
    "node_id_from_env",
    "plan_assignments",
    "read_snapshot",
    "replica_holders",
    "restore",
    "transport_for",
    "write_atomic",
]
