"""Where embedding rows live between generations, and how they come back resharded.

Three tiers hold committed state; one restore reads them all.

* **live**: when the old and the new context are in one process, the old context's exported
  shard stays in memory across the teardown and its rows move rank to rank over the *new*
  context's communicator, per the reshard plan, with no disk.
* **snapshot** (node-local): each rank writes its shard at a commit into
  ``<state_dir>/<run_id>/<node_id>/step-<step>-<fingerprint>/`` (``/dev/shm`` by default, so
  it survives a worker restart but not a reboot) and sends a replica of it over the
  communicator to a rank on ``replication`` other nodes, which write it into *their* node
  directory. Losing any ``replication`` nodes loses nothing. A rank reads only its own node's
  directory: node identity must therefore be stable across restarts (torchrun renumbers node
  ranks), so directories are keyed by a node id: ``ELASTIC_EMB_NODE_ID`` if set, else the
  host name.
* **durable**: ``torch.distributed.checkpoint`` into ``<durable_dir>/step-<step>-<fp>/`` with
  one DTensor ``Shard(0)`` per table tensor, laid out ``torch.chunk``-style over the whole world,
  so plain DCP without elastic_emb loads it at any world size.

Every commit of every tier ends with a JSON manifest written last by atomic rename (step,
topology fingerprint, per-shard row ranges, CRC32 of every tensor), so a commit torn by a crash
is never read as complete: without its manifest, a data file does not exist for restore.

Restore (the same code for a first start, a restart and an in-process resize) is collective:
every rank of the new world publishes, through the store, what it can supply (live shards it
holds, manifests in its node directory, durable commits it sees); every rank then computes the
same plan from the same inventory: the newest commit ``(step, generation)`` whose pieces cover
every row of every table, the tier each row range comes from (live before own snapshot before
replica), and which rank sends it to which new owner. Rows then move over the new communicator
(``ELASTIC_EMB_TRANSPORT``): on CPU each receiver pulls its rows straight out of its same-host
senders' memory (``cma``, elastic_emb/cma.py), with gloo send/recv for any peer it cannot read
(``p2p``); on CUDA in one ``all_to_all``. Snapshot bytes are checked against their CRC32 before
they are sent. When
no piece-based commit is complete, the newest complete durable commit is loaded by DCP at the
new world size. When state exists but no commit is complete, :class:`RestoreError` names the row
ranges nobody holds: never silent zeros, never fresh random rows.

The communicator is the context's ``process_group`` (a c10d ProcessGroup; raw methods are used,
so it need not be registered with ``torch.distributed``); a context without one gets a gloo
group of its own on a private store prefix. Small metadata travels through the store as JSON
(never pickle).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from elastic_emb.errors import ChecksumMismatch, RestoreError
from elastic_emb.events import get_logger
from elastic_emb.protocol import ShardData, row_owners
from elastic_emb.sharding import owned_range
from elastic_emb.topology import Topology

log = get_logger("elastic_emb.state")

TIER_PRIORITY = {"live": 0, "snapshot": 1, "replica": 2}
MANIFEST_VERSION = 1
TRANSPORTS = ("cma", "p2p", "alltoall")  # ELASTIC_EMB_TRANSPORT values (see Comm)


# ---------------------------------------------------------------------------------------------
# Checksums and small helpers
# ---------------------------------------------------------------------------------------------


def checksum(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (CPU copy when needed). zlib's CRC32 runs at several GB/s on one
    core (see bench/reshard.py), a small fraction of the cost of writing the same bytes."""
    return zlib.crc32(as_bytes(t).numpy())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (moved to the CPU, made contiguous if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def node_id_from_env(env: Mapping[str, str] | None = None) -> str:
    """This node's stable identity: ELASTIC_EMB_NODE_ID, else the host name."""
    env = os.environ if env is None else env
    nid = env.get("ELASTIC_EMB_NODE_ID") or socket.gethostname()
    if not nid or "/" in nid or nid in (".", ".."):
        raise ValueError(f"node id {nid!r} (ELASTIC_EMB_NODE_ID or hostname) must be a plain name without '/'")
    return nid


def faultpoint(name: str, step: int | None = None) -> None:
    """Fault injection for tests and drills: ``ELASTIC_EMB_FAULT=<name>`` (or ``<name>@<step>``)
    kills this process (SIGKILL, no clean-up) when it reaches the named point (at that step).
    A no-op otherwise."""
    want = os.environ.get("ELASTIC_EMB_FAULT")
    if want and (want == name or (step is not None and want == f"{name}@{step}")):
        log.warning("faultpoint_kill", point=name, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def _tensor_items(shard: ShardData) -> list[tuple[str, torch.Tensor]]:
    """The row-wise tensors of a shard in canonical order: weight, then slots by name."""
    return [("weight", shard.weight)] + [(k, shard.slots[k]) for k in sorted(shard.slots)]


def _row_spec(t: torch.Tensor) -> list:
    """[dtype, per-row shape] of a row-wise tensor."""
    return [str(t.dtype).removeprefix("torch."), list(t.shape[1:])]


def _row_bytes(spec: list) -> int:
    dtype = getattr(torch, spec[0])
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------
# Manifests
# ---------------------------------------------------------------------------------------------


class TensorRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    dtype: str
    row_shape: list[int]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    crc32: int


class ShardRecord(BaseModel):
    """One table's rows in one shard file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    table: str
    num_rows: int = Field(ge=1)
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    tensors: list[TensorRecord]


class SnapshotManifest(BaseModel):
    """The commit marker of one rank's shard in one node directory (own copy or replica)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = MANIFEST_VERSION
    kind: Literal["snapshot"] = "snapshot"
    step: int = Field(ge=0)
    generation: int = Field(ge=0)
    fingerprint: str
    run_id: str
    world_size: int
    ep_size: int
    source_rank: int
    source_node: str
    holder_node: str
    replica: bool
    data_file: str
    data_bytes: int
    shards: list[ShardRecord]
    written_at: float


class DurableManifest(BaseModel):
    """The commit marker of one DCP checkpoint, written by rank 0 after DCP finished."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = MANIFEST_VERSION
    kind: Literal["durable"] = "durable"
    step: int = Field(ge=0)
    generation: int = Field(ge=0)
    fingerprint: str
    run_id: str
    world_size: int
    tables: dict[str, int]  # table -> num_rows
    tensors: dict[str, list]  # "<table>.<name>" -> [dtype, row_shape]
    checksums: dict[str, dict[str, list]]  # "<table>.<name>" -> {rank: [start, stop, crc32]}
    checkpoint_dir: str
    written_at: float


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that readers see either nothing or all of it (write, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit_dirname(step: int, fingerprint: str) -> str:
    return f"step-{step:012d}-{fingerprint}"


# ---------------------------------------------------------------------------------------------
# Communicator: the new world's process group for tensors, the store for small JSON
# ---------------------------------------------------------------------------------------------


class Comm:
    """The collective operations state transfer needs, on one world's process group and store."""

    def __init__(self, topology: Topology, store, process_group=None, *, timeout: float = 300.0,
                 device: torch.device | str | None = None, purpose: str = "state") -> None:
        from elastic_emb.store import generation_store

        self.topology = topology
        self.rank = topology.rank
        self.size = topology.world_size
        self.timeout = timeout
        import torch.distributed as dist

        # The k-th communicator a rank makes in a generation pairs with the k-th on every other
        # rank (same program order), and gets keys of its own: reused keys would hand one
        # exchange the values of an earlier one (and a reused process group prefix hangs).
        gen_store = generation_store(store, topology, purpose)
        self.instance = int(gen_store.add(f"instances/rank{self.rank}", 1))
        self.store = dist.PrefixStore(f"c{self.instance}/", gen_store)
        self._own_pg = process_group is None
        if process_group is None:
            pg_store = dist.PrefixStore(f"c{self.instance}/pg/", gen_store)
            process_group = dist.ProcessGroupGloo(pg_store, self.rank, self.size, timedelta(seconds=timeout))
        self.pg = process_group
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if topology.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        # How rows travel: "cma" (CPU: receivers pull rows out of same-host senders' memory,
        # elastic_emb/cma.py; gloo p2p for any peer that cannot be read), "p2p" (CPU: every
        # send/recv posted at once on gloo, no staging copy) or "alltoall" (one collective over a
        # packed buffer: the only safe way for NCCL).
        self.transport = os.environ.get("ELASTIC_EMB_TRANSPORT") or ("cma" if self.device.type == "cpu" else "alltoall")
        if self.transport not in TRANSPORTS or (self.transport != "alltoall" and self.device.type != "cpu"):
            raise ValueError(f"ELASTIC_EMB_TRANSPORT={self.transport!r}: use 'alltoall' (any device), or 'cma' or "
                             f"'p2p' on CPU only; unset it for the default ('cma' on CPU, 'alltoall' on CUDA)")
        self._op = 0

    def exchange(self, name: str, obj: Any) -> list[Any]:
        """All-gather a JSON-able object through the store; returns one entry per rank."""
        self._op += 1
        base = f"x{self._op}-{name}"
        self.store.set(f"{base}/{self.rank}", json.dumps(obj))
        keys = [f"{base}/{r}" for r in range(self.size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise TimeoutError(
                f"state exchange {name!r} (generation {self.topology.generation}): ranks {missing} did "
                f"not publish within {self.timeout}s; they died or are stuck: restart the workers"
            ) from exc
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        """Send ``send[d]`` (uint8) to rank d; return the byte buffers received from each rank."""
        in_splits = [int(t.numel()) for t in send]
        inp = torch.cat([t.to(self.device) for t in send]) if send else torch.empty(0, dtype=torch.uint8, device=self.device)
        return self.all_to_all_flat(inp, in_splits, recv_sizes)

    def all_to_all_flat(self, inp: torch.Tensor, in_splits: list[int], recv_sizes: list[int],
                        out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One ``alltoall_base`` of a flat uint8 buffer (into ``out`` if given); every rank must
        call it, even with nothing to move."""
        import torch.distributed as dist

        if out is None:
            out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        elif out.numel() != sum(recv_sizes):
            raise ValueError(f"all_to_all_flat: out has {out.numel()} bytes, expected {sum(recv_sizes)}")
        opts = dist.AllToAllOptions()
        opts.timeout = timedelta(seconds=self.timeout)
        work = self.pg.alltoall_base(out, inp, list(recv_sizes), list(in_splits), opts)
        if not work.wait():
            raise RuntimeError(f"all_to_all of {sum(in_splits)} bytes failed on rank {self.rank}")
        return list(torch.split(out, list(recv_sizes)))

    def barrier(self, name: str) -> None:
        self.exchange(name, 0)

    def close(self) -> None:
        if self._own_pg:
            try:
                if hasattr(self.pg, "shutdown"):
                    self.pg.shutdown()
            except Exception as exc:  # teardown of a broken world: report, do not mask the caller's error
                log.warning("state_comm_close_failed", error=repr(exc))


# ---------------------------------------------------------------------------------------------
# Snapshot tier (node-local directory + replicas on other nodes)
# ---------------------------------------------------------------------------------------------


def replica_holders(records: list[dict], rank: int, replication: int) -> list[int]:
    """Ranks that hold replicas of ``rank``'s shard: one rank on each of the next ``replication``
    nodes (in node_rank order, wrapping), the one with the same local rank modulo that node's size.
    ``records`` has one {"rank", "node_rank", "local_rank"} per rank."""
    nodes: dict[int, list[dict]] = {}
    for r in records:
        nodes.setdefault(r["node_rank"], []).append(r)
    order = sorted(nodes)
    me = records[rank]
    pos = order.index(me["node_rank"])
    out = []
    for j in range(1, min(replication, len(order) - 1) + 1):
        node = nodes[order[(pos + j) % len(order)]]
        node.sort(key=lambda r: r["local_rank"])
        out.append(node[me["local_rank"] % len(node)]["rank"])
    return out


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
        records, blob = _pack_shard(shards, num_rows)
        data_name = f"rank{topo.rank}.bin"
        _write_blob(cdir / data_name, blob)
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
            name = f"rank{r}.replica.bin"
            _write_blob(cdir / name, got[r].cpu())
            replicated += everyone[r]["bytes"]
        # Data is durable on this node; manifests go last (a crash before here leaves no commit).
        faultpoint("snapshot_before_manifest", step)
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
        def step_of(d: Path) -> int:
            try:
                return int(d.name.split("-")[1])
            except (IndexError, ValueError):
                return -1

        def mtime(d: Path) -> float:
            # Every rank of a node prunes the same directory: another may have removed d already.
            try:
                return d.stat().st_mtime
            except FileNotFoundError:
                return 0.0

        dirs = sorted(self.node_dir.glob("step-*"), key=lambda d: (step_of(d), mtime(d)))
        def has_manifest(d: Path) -> bool:
            try:
                return any(d.glob("rank*.json"))
            except FileNotFoundError:  # removed by another rank of this node meanwhile
                return False

        complete = [d for d in dirs if has_manifest(d)]
        kept = complete[-self.keep:]
        if not kept:
            return
        newest_kept = step_of(kept[-1])
        for d in dirs:
            if d in kept:
                continue
            if d in complete or step_of(d) < newest_kept:
                shutil.rmtree(d, ignore_errors=True)


def _pack_shard(shards: dict[str, ShardData], num_rows: dict[str, int]) -> tuple[list[ShardRecord], torch.Tensor]:
    records, parts, off = [], [], 0
    for name in sorted(shards):
        sd = shards[name]
        trs = []
        for tname, t in _tensor_items(sd):
            b = as_bytes(t)
            trs.append(TensorRecord(name=tname, dtype=_row_spec(t)[0], row_shape=_row_spec(t)[1], offset=off,
                                    nbytes=int(b.numel()), crc32=zlib.crc32(b.numpy())))
            parts.append(b)
            off += int(b.numel())
        records.append(ShardRecord(table=name, num_rows=num_rows[name], start=sd.rows.start, stop=sd.rows.stop, tensors=trs))
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return records, blob


def _write_blob(path: Path, blob: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(blob.numpy()))
        f.flush()
        os.fsync(f.fileno())


# A block of a snapshot tensor copied into its destination and checksummed while it is in cache:
# the file's bytes then come from memory once, not once for the CRC32 and again for the copy.
# 2 MiB: measured fastest of 0.5-4 MiB for 128 MB shards with two ranks sharing a 32 MiB L3.
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


# ---------------------------------------------------------------------------------------------
# Durable tier (torch.distributed.checkpoint)
# ---------------------------------------------------------------------------------------------


class DurableTier:
    """DCP checkpoints, one DTensor Shard(0) per table tensor over the whole world (torch.chunk
    layout), so that plain ``torch.distributed.checkpoint.load`` reads them at any world size."""

    def __init__(self, root: str | os.PathLike, run_id: str) -> None:
        self.root = Path(root) / run_id
        self.run_id = run_id

    def manifests(self) -> list[DurableManifest]:
        out = []
        if not self.root.is_dir():
            return out
        for mpath in sorted(self.root.glob("step-*/elastic_emb_manifest.json")):
            try:
                m = DurableManifest.model_validate_json(mpath.read_text())
            except Exception as exc:
                log.warning("durable_manifest_invalid", path=str(mpath), error=repr(exc)[:300])
                continue
            if (mpath.parent / ".metadata").exists():
                out.append(m)
        return out

    def commit(self, step: int, shards: dict[str, ShardData], comm: Comm, num_rows: dict[str, int], group,
               asynchronous: bool = False):
        """Save through DCP (collective). ``group``: a gloo process group registered with
        torch.distributed with this world's ranks (DCP and DTensor accept no other).

        Returns ``(bytes this rank wrote, future or None)``. Asynchronous: DCP stages the tensors
        and writes them in a background thread (``dcp.async_save``); rank 0 writes the manifest
        when its upload completes (DCP's coordinator finishes only after every rank's writes), so
        a checkpoint cut short by a crash has no manifest. Wait on the future before the next
        durable commit, a resize or exit."""
        import torch.distributed.checkpoint as dcp

        topo = comm.topology
        world_shards = _to_world_layout(shards, comm, num_rows)
        sd, specs = _dtensor_state_dict(world_shards, group, num_rows)
        cdir = self.root / commit_dirname(step, topo.fingerprint())
        cdir.mkdir(parents=True, exist_ok=True)
        sums = {}
        for name, shard in world_shards.items():
            for tname, t in _tensor_items(shard):
                sums[f"{name}.{tname}"] = [shard.rows.start, shard.rows.stop, checksum(t)]
        gathered = comm.exchange(f"durable{step}", sums)
        manifest = None
        if topo.rank == 0:
            checksums: dict[str, dict[str, list]] = {}
            for r, s in enumerate(gathered):
                for key, v in s.items():
                    checksums.setdefault(key, {})[str(r)] = v
            manifest = DurableManifest(step=step, generation=topo.generation, fingerprint=topo.fingerprint(),
                                       run_id=topo.run_id, world_size=topo.world_size, tables=dict(num_rows),
                                       tensors=specs, checksums=checksums, checkpoint_dir=str(cdir), written_at=time.time())
        nbytes = sum(s.nbytes() for s in world_shards.values())

        def finish(error: BaseException | None = None) -> None:
            if manifest is None:
                return
            if error is not None:
                log.error("durable_commit_failed", step=step, dir=str(cdir), error=repr(error)[:500])
                return
            faultpoint("durable_before_manifest", step)
            write_atomic(cdir / "elastic_emb_manifest.json", manifest.model_dump_json())

        if not asynchronous:
            dcp.save(sd, checkpoint_id=str(cdir), process_group=group)
            finish()
            comm.barrier(f"durable{step}-done")
            return nbytes, None
        resp = dcp.async_save(sd, checkpoint_id=str(cdir), process_group=group)
        fut = getattr(resp, "upload_completion", resp)  # torch >= 2.9 may return an AsyncSaveResponse
        fut.add_done_callback(lambda f: finish(f.exception()))
        return nbytes, fut

    def load(self, manifest: DurableManifest, comm: Comm, template: dict[str, ShardData],
             num_rows: dict[str, int], group) -> dict[str, ShardData]:
        """Load a commit at this world size (world layout) and verify every saved shard's CRC32
        (combined from the parts the ranks now hold, whatever the world size). Returns this
        rank's rows in the world layout; the caller moves them to the context's layout."""
        import torch.distributed.checkpoint as dcp

        world = {}
        for name, spec in template.items():
            rows = owned_range(num_rows[name], comm.size, comm.rank)
            world[name] = ShardData(name, rows, torch.zeros(len(rows), *spec.weight.shape[1:], dtype=spec.weight.dtype),
                                    {k: torch.zeros(len(rows), *v.shape[1:], dtype=v.dtype) for k, v in spec.slots.items()})
        sd, _ = _dtensor_state_dict(world, group, num_rows)
        dcp.load(sd, checkpoint_id=manifest.checkpoint_dir, process_group=group)
        self._verify(manifest, comm, world)
        return world


    @staticmethod
    def _verify(manifest: DurableManifest, comm: Comm, world: dict[str, ShardData]) -> None:
        """Check the loaded rows against the CRC32 of every saved shard, whatever the layout now.

        Each rank takes the CRC32 of the part of every saved shard it holds; the parts of one
        saved shard, in row order, combine into that shard's CRC32 (:func:`crc32_combine`)."""
        mine: dict[str, list] = {}
        for name, shard in world.items():
            for tname, t in _tensor_items(shard):
                key = f"{name}.{tname}"
                rb = _row_bytes(_row_spec(t))
                for saved_rank, (start, stop, _) in manifest.checksums.get(key, {}).items():
                    lo, hi = max(start, shard.rows.start), min(stop, shard.rows.stop)
                    if lo < hi:
                        part = t[lo - shard.rows.start: hi - shard.rows.start]
                        mine.setdefault(key, []).append([saved_rank, lo, hi, checksum(part), (hi - lo) * rb])
        everyone = comm.exchange("durable-verify", mine)
        for key, saved in sorted(manifest.checksums.items()):
            for saved_rank, (start, stop, crc) in sorted(saved.items()):
                parts = sorted((p[1], p[2], p[3], p[4]) for e in everyone for p in e.get(key, []) if p[0] == saved_rank)
                covered = sum(hi - lo for lo, hi, _, _ in parts)
                got = 0
                for _, _, c, n in parts:
                    got = crc32_combine(got, c, n)
                if covered != stop - start or got != crc:
                    raise ChecksumMismatch(
                        f"durable checkpoint {manifest.checkpoint_dir}: {key} rows [{start}, {stop}) (saved by rank "
                        f"{saved_rank}) CRC32 {got:#010x} != manifest {crc:#010x} ({covered} of {stop - start} rows "
                        f"checked); the checkpoint is corrupt or incomplete: use another commit"
                    )


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` in bytes.

    Appending ``len2`` zero bytes to A is a linear map on the 32-bit CRC register over GF(2);
    it is built by repeated squaring of the one-zero-bit operator, so the cost is O(log len2)
    32x32 bit-matrix products, independent of the data (the method of zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1

    def times(mat: list[int], vec: int) -> int:
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    def square(mat: list[int]) -> list[int]:
        return [times(mat, mat[n]) for n in range(32)]

    one_bit = [0xEDB88320] + [1 << n for n in range(31)]  # shift the register by one zero bit
    op = square(square(one_bit))  # four zero bits
    while len2:
        op = square(op)  # now: 8 * 2^k zero bits, i.e. 2^k zero bytes
        if len2 & 1:
            crc1 = times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2


def _registered(pg) -> bool:
    """Whether torch.distributed knows this process group (DCP and DTensor need that)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(pg)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def _dtensor_state_dict(shards: dict[str, ShardData], group, num_rows: dict[str, int]):
    """DTensors (CPU, Shard(0) over ``group``'s whole world, torch.chunk layout) for DCP."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if group is None or not _registered(group):
        raise RuntimeError(
            "the durable tier needs a process group registered with torch.distributed (DCP and DTensor "
            "accept no other); Lifecycle initializes the default group per generation when durable_dir is set"
        )
    mesh = DeviceMesh.from_group(group, "cpu")
    sd, specs = {}, {}
    for name, shard in shards.items():
        for tname, t in _tensor_items(shard):
            shape = (num_rows[name], *t.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            sd[f"{name}.{tname}"] = DTensor.from_local(t.cpu(), mesh, [Shard(0)], run_check=False,
                                                       shape=torch.Size(shape), stride=stride)
            specs[f"{name}.{tname}"] = _row_spec(t)
    return sd, specs


def _to_world_layout(shards: dict[str, ShardData], comm: Comm, num_rows: dict[str, int]) -> dict[str, ShardData]:
    """Move rows from the context's layout (ep owners) to the torch.chunk layout over the whole world."""
    if comm.topology.ep_size == comm.size:
        return shards
    pieces = [LivePiece(name, s) for name, s in shards.items()]
    template = {}
    for name, s in shards.items():
        rows = owned_range(num_rows[name], comm.size, comm.rank)
        template[name] = ShardData(name, rows, torch.empty(len(rows), *s.weight.shape[1:], dtype=s.weight.dtype),
                                   {k: torch.empty(len(rows), *v.shape[1:], dtype=v.dtype) for k, v in s.slots.items()})
    return move_rows(comm, pieces, template, num_rows, owners=comm.size)


# ---------------------------------------------------------------------------------------------
# Restore: inventory, plan, transfer
# ---------------------------------------------------------------------------------------------


@dataclass
class LivePiece:
    """Rows this process holds in memory (an old context's export)."""

    table: str
    shard: ShardData


@dataclass
class Assignment:
    """Rows [start, stop) of ``table`` go from rank ``src`` (piece ``handle`` there) to ``dst``."""

    table: str
    start: int
    stop: int
    src: int
    dst: int
    handle: int
    tier: str


def move_rows(comm: Comm, pieces: list[LivePiece], template: dict[str, ShardData], num_rows: dict[str, int],
              owners: int) -> dict[str, ShardData]:
    """Every rank holds some row ranges in memory (``pieces``, together covering every row once or
    more); deliver to each rank its rows in a layout of ``owners`` owners. Fills ``template``."""
    inv = [{"table": p.table, "start": p.shard.rows.start, "stop": p.shard.rows.stop, "tier": "live",
            "commit": "x", "handle": i, "spec": [_row_spec(t) for _, t in _tensor_items(p.shard)]}
           for i, p in enumerate(pieces) if len(p.shard.rows)]
    everyone = comm.exchange("move-inv", inv)
    plan, missing = plan_assignments(everyone, "x", num_rows, owners, _specs_of(template))
    if missing:
        raise RestoreError(f"row ranges held by no rank: {missing}", missing)
    handles = {i: {t: v for t, v in _tensor_items(p.shard)} for i, p in enumerate(pieces)}
    starts = {i: p.shard.rows.start for i, p in enumerate(pieces)}
    _execute(comm, plan, handles, starts, template)
    return template


def _specs_of(template: dict[str, ShardData]) -> dict[str, list]:
    return {name: [_row_spec(t) for _, t in _tensor_items(s)] for name, s in template.items()}


def plan_assignments(inventories: list[list[dict]], commit: str, num_rows: dict[str, int], owners: int,
                     specs: dict[str, list]) -> tuple[list[Assignment], list[tuple[str, int, int]]]:
    """Pure: choose, for every row of every table in the ``owners`` layout, one rank that sends it.

    Preference per row: the tier (live memory, then own snapshot, then replica: memory moved over
    the interconnect beats reading a file), then the destination itself (no transfer), then the
    piece reaching furthest, then the lowest rank, so every rank computes the same plan. Returns the assignments and the ranges (table, start, stop) nobody holds."""
    by_table: dict[str, list[tuple[int, dict]]] = {}
    for rank, inv in enumerate(inventories):
        for p in inv:
            if p["commit"] != commit or p["table"] not in num_rows:
                continue
            if [list(x) for x in p["spec"]] != [list(x) for x in specs[p["table"]]]:
                continue  # a different dtype or slot layout cannot fill this table
            by_table.setdefault(p["table"], []).append((rank, p))
    plan: list[Assignment] = []
    missing: list[tuple[str, int, int]] = []
    for table in sorted(num_rows):
        n = num_rows[table]
        cands = by_table.get(table, [])
        for dst in range(owners):
            want = owned_range(n, owners, dst)
            cur = want.start
            while cur < want.stop:
                covering = [(r, p) for r, p in cands if p["start"] <= cur < p["stop"]]
                if not covering:
                    nxt = min([p["start"] for _, p in cands if p["start"] > cur] + [want.stop])
                    nxt = min(nxt, want.stop)
                    if missing and missing[-1][0] == table and missing[-1][2] == cur:
                        missing[-1] = (table, missing[-1][1], nxt)
                    else:
                        missing.append((table, cur, nxt))
                    cur = nxt
                    continue
                r, p = min(covering, key=lambda rp: (TIER_PRIORITY.get(rp[1]["tier"], 9), rp[0] != dst, -rp[1]["stop"], rp[0]))
                stop = min(p["stop"], want.stop)
                plan.append(Assignment(table, cur, stop, r, dst, p["handle"], p["tier"]))
                cur = stop
    return plan, missing


def _execute(comm: Comm, plan: list[Assignment], handles: dict[int, dict[str, torch.Tensor]],
             starts: dict[int, int], template: dict[str, ShardData], done: set[int] | None = None) -> tuple[int, str]:
    """Move the rows of ``plan`` by the communicator's transport; fill ``template`` (this rank's
    rows). ``done``: indices (in ``plan``) of this rank's local assignments already copied.
    Returns (bytes this rank sent, the transport that moved them: ``comm.transport``, or
    ``cma+p2p`` / ``p2p`` when some or all pairs fell back from cross-memory attach to gloo)."""
    me = comm.rank
    done_ids = {id(plan[i]) for i in done or ()}
    row_bytes = {name: [_row_bytes(s) for s in spec] for name, spec in _specs_of(template).items()}
    order = sorted(plan, key=lambda a: (a.dst, a.src, a.table, a.start))
    in_splits = [0] * comm.size
    recv_sizes = [0] * comm.size
    for a in order:
        nbytes = (a.stop - a.start) * sum(row_bytes[a.table])
        if a.src == me and a.dst == me:
            # Rows staying on this rank: copy directly, never through the collective.
            if id(a) not in done_ids:
                _fill(template[a.table], a, handles[a.handle], starts[a.handle])
        elif a.src == me:
            in_splits[a.dst] += nbytes
        elif a.dst == me:
            recv_sizes[a.src] += nbytes
    if comm.transport == "p2p":
        return _execute_p2p(comm, order, handles, starts, template), "p2p"
    if comm.transport == "cma":
        return _execute_cma(comm, order, handles, starts, template)
    outgoing = [a for a in order if a.src == me and a.dst != me]
    incoming = [a for a in order if a.dst == me and a.src != me]
    # Zero copy where this rank sends (or receives) a single block of a single tensor: the
    # collective then reads the rows (writes the rows) in place. That is the shape of most
    # transfers of a table without optimizer slots between few ranks.
    inp = out = None
    if len(outgoing) == 1 and len(handles[outgoing[0].handle]) == 1:
        a = outgoing[0]
        t = next(iter(handles[a.handle].values()))
        v = t[a.start - starts[a.handle]: a.stop - starts[a.handle]]
        if v.is_contiguous() and v.device == comm.device:
            inp = v.reshape(-1).view(torch.uint8)
    if len(incoming) == 1 and not template[incoming[0].table].slots:
        a = incoming[0]
        shard = template[a.table]
        v = shard.weight[a.start - shard.rows.start: a.stop - shard.rows.start]
        if v.is_contiguous() and v.device == comm.device:
            out = v.reshape(-1).view(torch.uint8)
    if inp is None:
        # Pack straight into one send buffer (one copy per byte), in the order the receivers expect.
        inp = torch.empty(sum(in_splits), dtype=torch.uint8, device=comm.device)
        off = 0
        for a in outgoing:
            lo, hi = a.start - starts[a.handle], a.stop - starts[a.handle]
            for _, t in sorted(handles[a.handle].items(), key=lambda kv: (kv[0] != "weight", kv[0])):
                b = t[lo:hi].reshape(-1).view(torch.uint8)
                inp[off: off + b.numel()].copy_(b)
                off += b.numel()
    got = comm.all_to_all_flat(inp, in_splits, recv_sizes, out=out)
    if out is not None:
        return int(inp.numel()), "alltoall"  # received in place
    offsets = [0] * comm.size
    for a in order:
        if a.dst != me or a.src == me:
            continue
        shard = template[a.table]
        n = a.stop - a.start
        buf = got[a.src]
        lo = a.start - shard.rows.start
        for (tname, t), rb in zip(_tensor_items(shard), row_bytes[a.table]):
            seg = buf[offsets[a.src]: offsets[a.src] + n * rb]
            offsets[a.src] += n * rb
            t[lo: lo + n].reshape(-1).view(torch.uint8).copy_(seg)
    return int(inp.numel()), "alltoall"


def _execute_cma(comm: Comm, order: list[Assignment], handles: dict[int, dict[str, torch.Tensor]],
                 starts: dict[int, int], template: dict[str, ShardData]) -> tuple[int, str]:
    """CPU transport between processes of one host: receivers pull their rows out of the senders'
    memory (elastic_emb/cma.py); the pairs that cannot go that way go over gloo p2p afterwards.
    Block keys are assignment indices in the shared plan order, as the p2p tags are."""
    from elastic_emb import cma

    if all(a.src == a.dst for a in order):
        return 0, "cma"  # every rank has the same plan: all skip the offer and barrier exchanges
    me = comm.rank
    outgoing: dict[int, tuple[int, list[torch.Tensor]]] = {}
    incoming: dict[int, tuple[int, list[torch.Tensor]]] = {}
    sent = 0
    for i, a in enumerate(order):
        if a.src == a.dst or me not in (a.src, a.dst):
            continue
        names = [tname for tname, _ in _tensor_items(template[a.table])]
        if a.src == me:
            lo, hi = a.start - starts[a.handle], a.stop - starts[a.handle]
            ts = [handles[a.handle][tname][lo:hi] for tname in names]
            outgoing[i] = (a.dst, ts)
            sent += sum(t.numel() * t.element_size() for t in ts)
        else:
            shard = template[a.table]
            lo = a.start - shard.rows.start
            incoming[i] = (a.src, [t[lo: lo + (a.stop - a.start)] for _, t in _tensor_items(shard)])
    fallback = cma.transfer(comm, outgoing, incoming)
    if not fallback:
        return sent, "cma"
    _execute_p2p(comm, order, handles, starts, template, only=fallback)
    moved = {(a.src, a.dst) for a in order if a.src != a.dst}
    return sent, ("p2p" if moved <= fallback else "cma+p2p")


def _execute_p2p(comm: Comm, order: list[Assignment], handles: dict[int, dict[str, torch.Tensor]],
                 starts: dict[int, int], template: dict[str, ShardData],
                 only: set[tuple[int, int]] | None = None) -> int:
    """CPU transport (gloo): post every send and receive at once, straight from the source rows
    into the destination rows, no staging copy, then wait for all of them (bounded by the
    communicator's timeout). The tag is the assignment's index in the shared plan order, so every
    message pairs with exactly one receive. NCCL would need the sends grouped to avoid a
    deadlock, so device tensors take the single all-to-all path instead. ``only``: move just
    the assignments of these (src, dst) pairs (the cma transport's fallback)."""
    me = comm.rank
    works, sent = [], 0
    post: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, contiguous buffer received into)
    for i, a in enumerate(order):
        if a.src == a.dst or me not in (a.src, a.dst):
            continue
        if only is not None and (a.src, a.dst) not in only:
            continue
        if a.src == me:
            lo, hi = a.start - starts[a.handle], a.stop - starts[a.handle]
            srcs = handles[a.handle]
            for j, (tname, _) in enumerate(_tensor_items(template[a.table])):
                t = srcs[tname][lo:hi].contiguous()
                works.append(comm.pg.send([t], a.dst, i * 64 + j))
                sent += t.numel() * t.element_size()
        else:
            shard = template[a.table]
            lo = a.start - shard.rows.start
            for j, (tname, t) in enumerate(_tensor_items(shard)):
                dst = t[lo: lo + (a.stop - a.start)]
                if not dst.is_contiguous():  # gloo receives into contiguous memory only
                    post.append((dst, torch.empty(dst.shape, dtype=dst.dtype)))
                    dst = post[-1][1]
                works.append(comm.pg.recv([dst], a.src, i * 64 + j))
    deadline = time.monotonic() + comm.timeout
    for w in works:
        if not w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic()))):
            raise RuntimeError(f"row transfer on rank {me} failed")
    for dst, buf in post:
        dst.copy_(buf)
    return sent


def _fill(shard: ShardData, a: Assignment, src: dict[str, torch.Tensor], src_start: int) -> None:
    lo = a.start - shard.rows.start
    slo, shi = a.start - src_start, a.stop - src_start
    for tname, t in _tensor_items(shard):
        t[lo: lo + (a.stop - a.start)].copy_(src[tname][slo:shi])


@dataclass
class RestoreReport:
    """What a restore did: the commit used, where each new shard's rows came from, bytes moved."""

    step: int  # -1: no committed state, the context keeps its seeded initial rows
    generation: int | None
    fingerprint: str | None
    tiers: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)  # table -> [(start, stop, tier)] of this rank
    source_tiers: list[str] = field(default_factory=list)  # distinct tiers used by the whole world
    bytes_moved: int = 0  # bytes this rank sent over the communicator
    bytes_local: int = 0  # bytes this rank copied without the communicator
    fallback: str | None = None  # why an older commit or the durable tier was used
    seconds: float = 0.0
    transfer_seconds: float = 0.0  # the row exchange alone (device synchronized)
    transport: str | None = None  # how rows moved between ranks: cma, p2p, cma+p2p (some pairs fell back), alltoall

    def as_dict(self) -> dict:
        return {
            "step": self.step, "generation": self.generation, "fingerprint": self.fingerprint,
            "tiers": {t: [list(x) for x in v] for t, v in self.tiers.items()}, "source_tiers": self.source_tiers,
            "bytes_moved": self.bytes_moved, "bytes_local": self.bytes_local, "fallback": self.fallback,
            "seconds": round(self.seconds, 6), "transfer_seconds": round(self.transfer_seconds, 6),
            "transport": self.transport,
        }


def restore(context, comm: Comm, *, snapshot: SnapshotTier | None, durable: DurableTier | None,
            live: list[ShardData] | None = None, live_commit: tuple[int, int, str] | None = None,
            require_state: bool = False, max_attempts: int = 4, durable_group=None) -> RestoreReport:
    """Collective: bring ``context`` to the newest commit complete for every row across tiers.

    ``live``: shards this process exported from its previous context, at commit ``live_commit``
    = (step, generation, fingerprint). Raises :class:`RestoreError` when state exists but no
    commit is complete (or when ``require_state`` and there is none)."""
    t0 = time.perf_counter()
    # The new context's own shards give shapes and dtypes and receive the rows. A context that
    # offers ``shard_views()`` (its own storage, writable) is filled in place: no copy of the
    # shard, no import; otherwise the exported copy is filled and imported back.
    views = getattr(context, "shard_views", None)
    in_place = callable(views)
    template = views() if in_place else context.export_shard()
    specs = _specs_of(template)
    # 1. Inventory: what this rank can supply.
    handles_meta: list[dict] = []
    sources: dict[int, tuple[str, Any]] = {}
    for shard in live or []:
        if not len(shard.rows):
            continue
        h = len(handles_meta)
        cid = _commit_id(*live_commit) if live_commit else None
        if cid is None:
            break
        handles_meta.append({"table": shard.table, "start": shard.rows.start, "stop": shard.rows.stop, "tier": "live",
                             "commit": cid, "handle": h, "spec": [_row_spec(t) for _, t in _tensor_items(shard)]})
        sources[h] = ("live", shard)
    snap_manifests = snapshot.manifests() if snapshot else []
    for path, m in snap_manifests:
        for rec in m.shards:
            if rec.stop <= rec.start:
                continue
            h = len(handles_meta)
            handles_meta.append({"table": rec.table, "start": rec.start, "stop": rec.stop,
                                 "tier": "replica" if m.replica else "snapshot",
                                 "commit": _commit_id(m.step, m.generation, m.fingerprint), "handle": h,
                                 "spec": [[tr.dtype, tr.row_shape] for tr in rec.tensors], "num_rows": rec.num_rows})
            sources[h] = ("file", (path, m, rec.table))
    durable_ms = durable.manifests() if durable is not None and durable_group is not None else []
    mine = {"pieces": handles_meta,
            "durable": [_commit_id(m.step, m.generation, m.fingerprint) for m in durable_ms],
            "tables": {name: [s.rows.start, s.rows.stop] for name, s in template.items()},
            "specs": specs}
    everyone = comm.exchange("restore-inv", mine)
    num_rows = _num_rows_from(everyone, comm)
    owners = row_owners(context)  # the context's layout: ep_size, or its framework's (e.g. TorchRec's)
    bad_handles: set[tuple[int, int]] = set()
    fallback = None
    for attempt in range(max_attempts):
        invs = [[p for p in e["pieces"] if (r, p["handle"]) not in bad_handles and p.get("num_rows", num_rows.get(p["table"])) == num_rows.get(p["table"])]
                for r, e in enumerate(everyone)]
        durable_common = set.intersection(*[set(e["durable"]) for e in everyone]) if everyone else set()
        commits = sorted({p["commit"] for inv in invs for p in inv} | durable_common, key=_commit_order, reverse=True)
        if not commits:
            if require_state or any(e["pieces"] for e in everyone):
                raise RestoreError(
                    "no complete commit found in any tier for this run and state was required: "
                    f"snapshot dirs on the nodes hold {sum(len(e['pieces']) for e in everyone)} usable pieces, "
                    f"no durable commit seen by every rank; check ELASTIC_EMB_STATE_DIR / ELASTIC_EMB_NODE_ID / "
                    f"ELASTIC_EMB_DURABLE_DIR point at this run's state",
                    [(t, 0, n) for t, n in sorted(num_rows.items())],
                )
            return RestoreReport(step=-1, generation=None, fingerprint=None,
                                 tiers={t: [(s.rows.start, s.rows.stop, "init")] for t, s in template.items()},
                                 source_tiers=["init"], seconds=time.perf_counter() - t0)
        chosen = None
        first_missing = None
        for cid in commits:
            plan, missing = plan_assignments(invs, cid, num_rows, owners, specs)
            if not missing:
                chosen = ("pieces", cid, plan)
                break
            if first_missing is None:
                first_missing = (cid, missing)
            if cid in durable_common:
                chosen = ("durable", cid, None)
                break
        if chosen is None:
            cid, missing = first_missing
            step, gen, _ = _parse_commit(cid)
            raise RestoreError(
                f"no commit is complete: the newest, step {step} (generation {gen}), lacks rows "
                + ", ".join(f"{t}[{a}, {b})" for t, a, b in missing)
                + " in every tier (live, node snapshots, replicas, durable); those rows were on lost nodes. "
                  "Bring back a node directory holding them, raise replication, or configure a durable_dir",
                missing,
            )
        notes = []
        if bad_handles:
            bad_commits = sorted({everyone[r]["pieces"][h]["commit"] for r, h in bad_handles})
            notes.append(f"rejected {len(bad_handles)} corrupt snapshot pieces (checksum) of commits {bad_commits}")
        if first_missing is not None and first_missing[0] != chosen[1]:
            notes.append(f"commit {first_missing[0]} lacked rows {first_missing[1][:8]} in live/snapshot tiers")
        fallback = ("; ".join(notes) + f"; used {chosen[0]} commit {chosen[1]}") if notes else None
        kind, cid, plan = chosen
        step, gen, fp = _parse_commit(cid)
        if kind == "durable":
            m = next(m for m in durable_ms if _commit_id(m.step, m.generation, m.fingerprint) == cid)
            world = durable.load(m, comm, template, num_rows, durable_group)
            shards = move_rows(comm, [LivePiece(n, s) for n, s in world.items()], template, num_rows, owners)
            if not in_place:
                context.import_shard(shards)
            else:
                _wrote_every_row(context)
            log.warning("restore_from_durable", step=step, reason=fallback)
            return RestoreReport(step=step, generation=gen, fingerprint=fp,
                                 tiers={t: [(s.rows.start, s.rows.stop, "durable")] for t, s in shards.items()},
                                 source_tiers=["durable"], bytes_moved=sum(s.nbytes() for s in world.values()),
                                 fallback=fallback or "durable tier used", seconds=time.perf_counter() - t0)
        # 2. Load (and verify) the files this rank must send from; drop corrupt ones and re-plan.
        handles: dict[int, dict[str, torch.Tensor]] = {}
        starts: dict[int, int] = {}
        bad_local = []
        files: dict[Path, dict] = {}
        # Rows that stay on this rank and come from a file are copied while the file is checked
        # (one pass over its bytes, see read_snapshot); _execute then skips those assignments.
        fills: dict[Path, dict[str, list]] = {}
        filled: set[int] = set()
        for i, a in enumerate(plan):
            if a.src != comm.rank or a.dst != comm.rank or sources[a.handle][0] != "file":
                continue
            path, m, table = sources[a.handle][1]
            shard = template[a.table]
            rec_start = next(r.start for r in m.shards if r.table == table)
            lo = a.start - shard.rows.start
            dsts = {tname: t[lo: lo + (a.stop - a.start)] for tname, t in _tensor_items(shard)}
            if all(t.device.type == "cpu" and t.is_contiguous() for t in dsts.values()):
                fills.setdefault(path, {}).setdefault(table, []).append((a.start - rec_start, a.stop - rec_start, dsts))
                filled.add(i)
        for a in plan:
            if a.src != comm.rank or a.handle in handles:
                continue
            kind_, src = sources[a.handle]
            if kind_ == "live":
                handles[a.handle] = dict(_tensor_items(src))
                starts[a.handle] = src.rows.start
            else:
                path, m, table = src
                try:
                    if path not in files:
                        files[path] = read_snapshot(path, m, fill=fills.get(path))
                except (ChecksumMismatch, OSError) as exc:
                    log.error("snapshot_rejected", path=str(path), error=str(exc))
                    bad_local.append(a.handle)
                    continue
                handles[a.handle] = files[path][table]
                starts[a.handle] = next(r.start for r in m.shards if r.table == table)
        bad_all = comm.exchange(f"restore-bad{attempt}", bad_local)
        if any(bad_all):
            for r, hs in enumerate(bad_all):
                bad_handles.update((r, h) for h in hs)
            continue
        if fallback:
            log.warning("restore_fallback", step=step, reason=fallback)
        tx = time.perf_counter()
        sent, transport = _execute(comm, plan, handles, starts, template, done=filled)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        transfer_s = time.perf_counter() - tx
        if not in_place:
            context.import_shard(template)
        else:
            _wrote_every_row(context)
        mine_tiers: dict[str, list[tuple[int, int, str]]] = {}
        local = 0
        for a in sorted(plan, key=lambda a: (a.table, a.start)):
            if a.dst == comm.rank:
                mine_tiers.setdefault(a.table, []).append((a.start, a.stop, a.tier))
                if a.src == comm.rank:
                    local += (a.stop - a.start) * sum(_row_bytes(s) for s in specs[a.table])
        return RestoreReport(step=step, generation=gen, fingerprint=fp, tiers=mine_tiers,
                             source_tiers=sorted({a.tier for a in plan}), bytes_moved=sent, bytes_local=local,
                             fallback=fallback, seconds=time.perf_counter() - t0, transfer_seconds=transfer_s,
                             transport=transport)
    raise RestoreError(f"restore gave up after {max_attempts} attempts: corrupt snapshot pieces {sorted(bad_handles)}")


def _wrote_every_row(context) -> None:
    """Tell a context whose rows were all written in place through ``shard_views()`` that it
    need not initialise them (``EmbContext`` initialises rows lazily; optional hook)."""
    hook = getattr(context, "mark_restored", None)
    if callable(hook):
        hook()


def _commit_id(step: int, generation: int, fingerprint: str) -> str:
    return f"{step}:{generation}:{fingerprint}"


def _parse_commit(cid: str) -> tuple[int, int, str]:
    s, g, f = cid.split(":", 2)
    return int(s), int(g), f


def _commit_order(cid: str) -> tuple[int, int]:
    s, g, _ = _parse_commit(cid)
    return s, g


def _num_rows_from(everyone: list[dict], comm: Comm) -> dict[str, int]:
    """Table sizes from the new context's shards on every rank: the last owned row + 1."""
    out: dict[str, int] = {}
    for e in everyone:
        for name, (start, stop) in e["tables"].items():
            out[name] = max(out.get(name, 0), stop)
    for name, n in out.items():
        if n < 1:
            raise RestoreError(f"table {name!r}: no rank reports any rows; the context exported empty shards everywhere")
    return out


# ---------------------------------------------------------------------------------------------
# Inspection (operators: which commits are complete where)
# ---------------------------------------------------------------------------------------------


def inspect_state(state_dir: str | os.PathLike, run_id: str, durable_dir: str | os.PathLike | None = None) -> dict:
    """Every commit found under ``<state_dir>/<run_id>/*/`` (all node directories visible from
    here) and ``<durable_dir>/<run_id>/``: for each, the nodes and tiers holding pieces, and the
    row ranges of each table nobody holds (empty: complete). Newest first. Reads manifests only."""
    root = Path(state_dir) / run_id
    pieces: dict[str, list[tuple[str, SnapshotManifest, ShardRecord]]] = {}
    if root.is_dir():
        for node in sorted(p.name for p in root.iterdir() if p.is_dir()):
            for _, m in SnapshotTier(state_dir, run_id, node).manifests():
                for rec in m.shards:
                    pieces.setdefault(_commit_id(m.step, m.generation, m.fingerprint), []).append((node, m, rec))
    out = []
    for cid in sorted(pieces, key=_commit_order, reverse=True):
        step, gen, fp = _parse_commit(cid)
        num_rows = {rec.table: rec.num_rows for _, _, rec in pieces[cid]}
        specs = {rec.table: [[t.dtype, t.row_shape] for t in rec.tensors] for _, _, rec in pieces[cid]}
        inv = [[{"table": rec.table, "start": rec.start, "stop": rec.stop, "tier": "replica" if m.replica else "snapshot",
                 "commit": cid, "handle": i, "spec": [[t.dtype, t.row_shape] for t in rec.tensors]}
                for i, (_, m, rec) in enumerate(pieces[cid])]]
        _, missing = plan_assignments(inv, cid, num_rows, 1, specs)
        out.append({"tier": "snapshot", "step": step, "generation": gen, "fingerprint": fp,
                    "complete": not missing, "missing": [list(x) for x in missing], "tables": num_rows,
                    "nodes": sorted({node for node, _, _ in pieces[cid]}),
                    "shards": sorted({(m.source_rank, m.replica, node) for node, m, _ in pieces[cid]})})
    if durable_dir is not None:
        for m in DurableTier(durable_dir, run_id).manifests():
            out.append({"tier": "durable", "step": m.step, "generation": m.generation, "fingerprint": m.fingerprint,
                        "complete": True, "missing": [], "tables": m.tables, "dir": m.checkpoint_dir})
    out.sort(key=lambda c: (c["step"], c["generation"]), reverse=True)
    return {"run_id": run_id, "state_dir": str(state_dir), "durable_dir": str(durable_dir) if durable_dir else None,
            "commits": out}
