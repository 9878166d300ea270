"""The snapshot tier: each rank's shard in a node-local directory, with replicas on other nodes.

At a commit, each rank writes its shard into
``<state_dir>/<run_id>/<node_id>/step-<step>-<fingerprint>/rank<r>.bin`` (``/dev/shm`` by
default, so it survives a worker restart but not a reboot) and sends a copy over the
communicator to one rank on each of the next ``replication`` nodes, which write it into *their*
node directory as ``rank<r>.replica.bin``. Losing any ``replication`` nodes therefore loses
nothing. A rank reads only its own node's directory, so node identity must be stable across
restarts (torchrun renumbers node ranks): directories are keyed by a node id,
``ELASTIC_EMB_NODE_ID`` if set, else the host name.

Data files are written and fsynced first; the manifests (one per shard held, own or replica) go
last, by atomic rename, so a commit cut short by a crash has no manifest and does not exist for
restore. Reading a shard back (:func:`read_snapshot`) checks every tensor's CRC32 against its
manifest, copying the rows that stay on the reading rank in the same pass over the bytes.
"""

from __future__ import annotations

import os
import shutil
import time
import zlib
from pathlib import Path

import torch

from elastic_emb.errors import ChecksumMismatch
from elastic_emb.events import get_logger
from elastic_emb.protocol import ShardData
from elastic_emb.state import points
from elastic_emb.state.comm import Comm
from elastic_emb.state.manifest import (
    ShardRecord,
    SnapshotManifest,
    TensorRecord,
    as_bytes,
    commit_dirname,
    row_spec,
    step_of_dirname,
    tensor_items,
    write_atomic,
)
from elastic_emb.state.plan import replica_holders

log = get_logger("elastic_emb.state")


class SnapshotTier:
    """Node-local snapshots with replicas on other nodes."""

    def __init__(self, root: str | os.PathLike, run_id: str, node_id: str, *, replication: int = 1, keep: int = 2) -> None:
        if replication < 0:
            raise ValueError(f"replication={replication} must be >= 0 (0: no replicas)")
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 commits")
        self.root = Path(root)
        self.run_id = run_id
        self.node_id = node_id
        self.replication = replication
        self.keep = keep

    @property
    def node_dir(self) -> Path:
        return self.root / self.run_id / self.node_id

    def commit(self, step: int, shards: dict[str, ShardData], comm: Comm, num_rows: dict[str, int]) -> tuple[int, int]:
        """Write this rank's shard and replicas of others'; collective over ``comm``.

        Returns (bytes written locally for own shard, bytes received as replicas)."""
        topo = comm.topology
        cdir = self.node_dir / commit_dirname(step, topo.fingerprint())
        cdir.mkdir(parents=True, exist_ok=True)
        records, blob = pack_shard(shards, num_rows)
        data_name = f"rank{topo.rank}.bin"
        write_blob(cdir / data_name, blob)
        info = {"rank": topo.rank, "node_rank": topo.node_rank, "local_rank": topo.local_rank,
                "node": self.node_id, "bytes": int(blob.numel()),
                "shards": [r.model_dump() for r in records]}
        everyone = comm.exchange(f"snap{step}", info)
        # Replicas: who sends to whom follows from the gathered records alone.
        holders = {r["rank"]: replica_holders(everyone, r["rank"], self.replication) for r in everyone}
        send = [torch.empty(0, dtype=torch.uint8) for _ in range(comm.size)]
        for h in holders[topo.rank]:
            send[h] = blob
        senders = [r for r in range(comm.size) if topo.rank in holders[r]]
        recv_sizes = [everyone[r]["bytes"] if r in senders else 0 for r in range(comm.size)]
        got = comm.all_to_all(send, recv_sizes) if any(holders.values()) else [None] * comm.size
        replicated = 0
        for r in senders:
            write_blob(cdir / f"rank{r}.replica.bin", got[r].cpu())
            replicated += everyone[r]["bytes"]
        # Data is durable on this node; manifests go last (a crash before here leaves no commit).
        points.reached("snapshot_before_manifest", step)
        base = dict(step=step, generation=topo.generation, fingerprint=topo.fingerprint(), run_id=topo.run_id,
                    world_size=topo.world_size, ep_size=topo.ep_size, holder_node=self.node_id)
        own = SnapshotManifest(**base, source_rank=topo.rank, source_node=self.node_id, replica=False,
                               data_file=data_name, data_bytes=int(blob.numel()), shards=records, written_at=time.time())
        write_atomic(cdir / f"rank{topo.rank}.json", own.model_dump_json())
        for r in senders:
            rep = SnapshotManifest(**base, source_rank=r, source_node=everyone[r]["node"], replica=True,
                                   data_file=f"rank{r}.replica.bin", data_bytes=everyone[r]["bytes"],
                                   shards=[ShardRecord(**s) for s in everyone[r]["shards"]], written_at=time.time())
            write_atomic(cdir / f"rank{r}.replica.json", rep.model_dump_json())
        return int(blob.numel()), replicated

    def manifests(self) -> list[tuple[Path, SnapshotManifest]]:
        """Every complete (manifest present and valid) shard in this node's directory."""
        out = []
        if not self.node_dir.is_dir():
            return out
        for cdir in sorted(self.node_dir.glob("step-*")):
            for mpath in sorted(cdir.glob("rank*.json")):
                try:
                    m = SnapshotManifest.model_validate_json(mpath.read_text())
                except Exception as exc:  # a foreign or damaged file: report and skip, never guess
                    log.warning("snapshot_manifest_invalid", path=str(mpath), error=repr(exc)[:300])
                    continue
                if m.run_id != self.run_id:
                    continue
                out.append((cdir / m.data_file, m))
        return out

    def prune(self) -> None:
        """Keep this node's newest ``keep`` commit directories that hold a manifest; delete older
        ones, and torn directories (no manifest) older than the newest kept (local, not collective)."""
        def mtime(d: Path) -> float:
            # Every rank of a node prunes the same directory: another may have removed d already.
            try:
                return d.stat().st_mtime
            except FileNotFoundError:
                return 0.0

        dirs = sorted(self.node_dir.glob("step-*"), key=lambda d: (step_of_dirname(d.name), mtime(d)))

        def has_manifest(d: Path) -> bool:
            try:
                return any(d.glob("rank*.json"))
            except FileNotFoundError:  # removed by another rank of this node meanwhile
                return False

        complete = [d for d in dirs if has_manifest(d)]
        kept = complete[-self.keep:]
        if not kept:
            return
        newest_kept = step_of_dirname(kept[-1].name)
        for d in dirs:
            if d in kept:
                continue
            if d in complete or step_of_dirname(d.name) < newest_kept:
                shutil.rmtree(d, ignore_errors=True)


def pack_shard(shards: dict[str, ShardData], num_rows: dict[str, int]) -> tuple[list[ShardRecord], torch.Tensor]:
    """Every table's row-wise tensors back to back in one byte buffer, with their records."""
    records, parts, off = [], [], 0
    for name in sorted(shards):
        sd = shards[name]
        trs = []
        for tname, t in tensor_items(sd):
            b = as_bytes(t)
            trs.append(TensorRecord(name=tname, dtype=row_spec(t)[0], row_shape=row_spec(t)[1], offset=off,
                                    nbytes=int(b.numel()), crc32=zlib.crc32(b.numpy())))
            parts.append(b)
            off += int(b.numel())
        records.append(ShardRecord(table=name, num_rows=num_rows[name], start=sd.rows.start, stop=sd.rows.stop, tensors=trs))
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return records, blob


def write_blob(path: Path, blob: torch.Tensor) -> None:
    """Write a byte buffer to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(memoryview(blob.numpy()))
        f.flush()
        os.fsync(f.fileno())


# A block of a snapshot tensor copied into its destination and checksummed while it is in cache:
# the file's bytes then come from memory once, not once for the CRC32 and again for the copy.
# 2 MiB: fastest of 0.5-4 MiB measured for 128 MB shards with two ranks sharing a 32 MiB L3.
VERIFY_CHUNK = 2 << 20


def read_snapshot(path: Path, manifest: SnapshotManifest, verify: bool = True,
                  fill: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] | None = None,
                  ) -> dict[str, dict[str, torch.Tensor]]:
    """Load one shard file; check every tensor's CRC32. Returns table -> name -> tensor.

    ``fill``: table -> [(row_lo, row_hi, {tensor name: destination rows})], rows counted from the
    shard's first row: those rows are also copied into the (contiguous) destinations, in the same
    pass over the file as the checksum, block by block while each block is in cache. The copies
    happen before the verdict: when ChecksumMismatch is raised, the destinations hold unverified
    bytes, which the caller must overwrite or discard (restore re-plans without the piece, and
    raises if no commit is left, so the rows are never used)."""
    size = path.stat().st_size if path.exists() else -1
    if size != manifest.data_bytes:
        raise ChecksumMismatch(f"{path}: {size} bytes on disk, manifest says {manifest.data_bytes}; the file is "
                               f"damaged or was replaced: delete {path.parent} to drop this commit")
    # Map the file rather than read it: on /dev/shm the pages are already in memory, so the
    # checksum and the row copies read them in place (no read copy, no fresh pages).
    raw = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for rec in manifest.shards:
        n = rec.stop - rec.start
        tensors = {}
        for tr in rec.tensors:
            b = raw[tr.offset: tr.offset + tr.nbytes]
            rb = tr.nbytes // n if n else 0
            copies = [(lo * rb, dsts[tr.name].reshape(-1).view(torch.uint8))
                      for lo, hi, dsts in (fill or {}).get(rec.table, []) if tr.name in dsts]
            if verify:
                got = _crc_and_copy(b, copies)
                if got != tr.crc32:
                    raise ChecksumMismatch(
                        f"{path}: table {rec.table!r} tensor {tr.name!r} rows [{rec.start}, {rec.stop}) has CRC32 "
                        f"{got:#010x}, manifest says {tr.crc32:#010x}; the snapshot is corrupt: delete {path.parent}"
                    )
            else:
                for off, dst in copies:
                    dst.copy_(b[off: off + dst.numel()])
            dtype = getattr(torch, tr.dtype)
            if tr.offset % torch.empty((), dtype=dtype).element_size():
                b = b.clone()  # a view needs an aligned offset (tensors of mixed element sizes)
            tensors[tr.name] = b.view(dtype).reshape(n, *tr.row_shape)
        out[rec.table] = tensors
    return out


def _crc_and_copy(b: torch.Tensor, copies: list[tuple[int, torch.Tensor]]) -> int:
    """CRC32 of the bytes ``b``; meanwhile copy ``b[off: off + len(dst)]`` into each flat ``dst``.
    Block by block: each block is copied first (which brings it into cache), then checksummed."""
    crc = 0
    total = b.numel()
    if not copies:
        return zlib.crc32(b.numpy()) if total else 0
    for c0 in range(0, total, VERIFY_CHUNK):
        c1 = min(c0 + VERIFY_CHUNK, total)
        for off, dst in copies:
            lo, hi = max(c0, off), min(c1, off + dst.numel())
            if lo < hi:
                dst[lo - off: hi - off].copy_(b[lo:hi])
        crc = zlib.crc32(b[c0:c1].numpy(), crc)
    return crc
