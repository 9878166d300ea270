"""The durable tier: ``torch.distributed.checkpoint`` (DCP) checkpoints any world size can load.

:class:`DurableTier` saves each table tensor as one DTensor ``Shard(0)`` over the whole world, in
``torch.chunk`` layout, so plain DCP loads it at any world size; a commit can run in a background
thread of its own. Rank 0 writes the manifest last, with the CRC32 of every saved shard, and a load
at any world size verifies them without gathering a byte.

Design: ``docs/COMMIT.md`` (section "The durable tier").
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from elastic_emb.errors import ChecksumMismatch
from elastic_emb.events import get_logger
from elastic_emb.native_calls import native_call
from elastic_emb.progress import Progress
from elastic_emb.protocol import ShardData
from elastic_emb.sharding import owned_range
from elastic_emb.state import app as app_state
from elastic_emb.state import points
from elastic_emb.state.comm import Comm
from elastic_emb.state.crc import crc32_combine
from elastic_emb.state.manifest import (
    DurableManifest,
    checksum,
    commit_dirname,
    row_bytes,
    row_spec,
    tensor_items,
    write_atomic,
)
from elastic_emb.state.paths import DIR_MODE, FILE_MODE, check_name, make_dirs, under
from elastic_emb.state.transport import LivePiece, move_rows

log = get_logger("elastic_emb.state")


class DurableTier:
    """DCP checkpoints, one DTensor Shard(0) per table tensor over the whole world (torch.chunk
    layout), so that plain ``torch.distributed.checkpoint.load`` reads them at any world size.

    Args:
        root: the durable directory; commits go under ``<root>/<run_id>/``.
        run_id: the run (a plain name).
        file_mode: the permissions of the files written.
        dir_mode: the permissions of the directories created.

    Raises:
        ValueError: if ``run_id`` is not a plain name.
    """

    def __init__(
        self, root: str | os.PathLike, run_id: str, *, file_mode: int = FILE_MODE, dir_mode: int = DIR_MODE
    ) -> None:
        self.base = Path(root)
        self.run_id = check_name(run_id, "run id")
        self.root = under(root, run_id)
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.lineage: str | None = None  # the run's history, recorded in every manifest (set after a restore)

    def manifests(self) -> list[DurableManifest]:
        """The valid manifests of complete checkpoints (with DCP's ``.metadata``), newest last.

        A manifest that does not parse or names another run is reported and skipped.

        Returns:
            The manifests; ``checkpoint_dir`` is always the directory the manifest was found in
            (the recorded path is not trusted).
        """
        out = []
        if not self.root.is_dir():
            return out
        for mpath in sorted(self.root.glob("step-*/elastic_emb_manifest.json")):
            try:
                m = DurableManifest.model_validate_json(mpath.read_text())
            except Exception as exc:
                log.warning("durable_manifest_invalid", path=str(mpath), error=repr(exc)[:300])
                continue
            if m.run_id != self.run_id:
                log.warning("durable_manifest_invalid", path=str(mpath), error=f"run id {m.run_id!r}")
                continue
            if (mpath.parent / ".metadata").exists():
                out.append(m.model_copy(update={"checkpoint_dir": str(mpath.parent)}))
        return out

    def commit(
        self,
        step: int,
        shards: dict[str, ShardData],
        comm: Comm,
        num_rows: dict[str, int],
        group,
        asynchronous: bool = False,
        app: dict | None = None,
    ) -> tuple[int, Future | None]:
        """Save ``shards`` through DCP (collective).

        A checkpoint cut short by a crash has no manifest (rank 0 writes it last, once DCP
        finished on every rank).

        Args:
            step: the commit's step.
            shards: table -> this rank's shard, a copy of its own (``export_shard()``): when
                asynchronous, the training changes the context's rows meanwhile.
            comm: the communicator; when asynchronous, one of the durable tier's own (on
                ``group``), used by nobody else until the future is done.
            num_rows: table -> rows in the table.
            group: a gloo process group of this world registered with torch.distributed (DCP and
                DTensor accept no other).
            asynchronous: run everything after the capture (the move to the world layout, the
                CRC32s, the DCP save, the manifest) in a background thread, so the step goes on.
            app: rank 0's copy of the job's app state (:func:`elastic_emb.state.app.capture`),
                written beside DCP's files before the manifest; None: none.

        Returns:
            ``(bytes this rank hands over, future or None)``: wait on the future (it holds the
            step, or the save's error) before the next durable commit, a resize or the exit.

        Raises:
            RuntimeError: if ``group`` is not registered with torch.distributed. Synchronous: this
                and any error of the save raise here; asynchronous: they are set on the future.
        """
        nbytes = sum(s.nbytes() for s in shards.values())
        if not asynchronous:
            with Progress("durable_save", nbytes, step=step) as progress:
                self._save(step, shards, comm, num_rows, group, None, progress, app)
            return nbytes, None
        copied = None
        if any(t.is_cuda for s in shards.values() for _, t in tensor_items(s)):
            copied = torch.cuda.Event()  # the thread reads the copy once the training stream made it
            copied.record()
        fut: Future = Future()

        def run() -> None:
            try:
                with (
                    native_call(),  # DCP's writes and collectives: the exit waits for them (briefly)
                    # a thread of its own: the worker's bound fields are not in its context
                    Progress(
                        "durable_save", nbytes, step=step, rank=comm.topology.rank, generation=comm.topology.generation
                    ) as progress,
                ):
                    self._save(step, shards, comm, num_rows, group, copied, progress, app)
            except BaseException as exc:  # reported by finish and by the future's waiter
                log.error("durable_commit_failed", step=step, error=repr(exc)[:500])
                fut.set_exception(exc)
            else:
                fut.set_result(step)

        threading.Thread(target=run, name=f"elastic_emb-durable-{step}", daemon=True).start()
        return nbytes, fut

    def _save(
        self,
        step: int,
        shards: dict[str, ShardData],
        comm: Comm,
        num_rows: dict[str, int],
        group,
        copied,
        progress: Progress | None = None,
        app: dict | None = None,
    ) -> None:
        """The whole save of one rank: world layout, CRC32s, DCP, and (rank 0) the manifest last.
        ``progress`` counts this rank's bytes in the world layout once DCP has written them (DCP
        writes them in one call)."""
        import torch.distributed.checkpoint as dcp

        points.reached("durable_saving", step)
        if copied is not None:  # a GPU capture: its bytes exist once the event passed
            copied.synchronize()
        shards = {n: _on_cpu(s) for n, s in shards.items()}
        topo = comm.topology
        world_shards = _to_world_layout(shards, comm, num_rows)
        world_bytes = sum(s.nbytes() for s in world_shards.values())
        if progress is not None:
            progress.total = world_bytes
        sd, specs = _dtensor_state_dict(world_shards, group, num_rows)
        cdir = self.root / commit_dirname(step, topo.fingerprint())
        make_dirs(self.base, cdir, self.dir_mode)
        sums = {
            f"{name}.{tname}": [shard.rows.start, shard.rows.stop, checksum(t)]
            for name, shard in world_shards.items()
            for tname, t in tensor_items(shard)
        }
        gathered = comm.exchange(f"durable{step}", sums)
        dcp.save(sd, checkpoint_id=str(cdir), process_group=group)
        if progress is not None:
            progress.advance(world_bytes)
        if topo.rank == 0:
            app_meta = {}
            if app is not None:  # replicated: rank 0's copy, beside DCP's files
                size, crc = app_state.write_file(cdir / app_state.APP_FILE, app, self.file_mode)
                app_meta = {"app_file": app_state.APP_FILE, "app_bytes": size, "app_crc": crc}
            checksums: dict[str, dict[str, list]] = {}
            for r, s in enumerate(gathered):
                for key, v in s.items():
                    checksums.setdefault(key, {})[str(r)] = v
            manifest = DurableManifest(
                step=step,
                generation=topo.generation,
                fingerprint=topo.fingerprint(),
                run_id=topo.run_id,
                world_size=topo.world_size,
                tables=dict(num_rows),
                tensors=specs,
                checksums=checksums,
                checkpoint_dir=str(cdir),
                written_at=time.time(),
                lineage=self.lineage,
                **app_meta,
            )
            for f in cdir.rglob("*"):  # DCP creates its files with the process's umask
                os.chmod(f, self.dir_mode if f.is_dir() else self.file_mode)
            points.reached("durable_before_manifest", step)
            write_atomic(cdir / "elastic_emb_manifest.json", manifest.model_dump_json(), self.file_mode)
        comm.barrier(f"durable{step}-done")

    def load(
        self, manifest: DurableManifest, comm: Comm, template: dict[str, ShardData], num_rows: dict[str, int], group
    ) -> dict[str, ShardData]:
        """Load a commit at this world size and verify every saved shard's CRC32 (collective).

        Each saved shard's CRC32 is combined from the parts the ranks now hold, whatever the world
        size.

        Args:
            manifest: the commit's manifest (from :meth:`manifests`).
            comm: the communicator of the world.
            template: table -> a shard with the table's tensor shapes and dtypes.
            num_rows: table -> rows in the table.
            group: a gloo process group of this world registered with torch.distributed.

        Returns:
            This rank's rows in the world (``torch.chunk``) layout; the caller moves them to the
            context's layout.

        Raises:
            ChecksumMismatch: if a saved shard's rows are not all covered or their CRC32 differs.
            RuntimeError: if ``group`` is not registered with torch.distributed.
        """
        import torch.distributed.checkpoint as dcp

        world = {}
        for name, spec in template.items():
            rows = owned_range(num_rows[name], comm.size, comm.rank)
            world[name] = ShardData(
                name,
                rows,
                torch.zeros(len(rows), *spec.weight.shape[1:], dtype=spec.weight.dtype),
                {k: torch.zeros(len(rows), *v.shape[1:], dtype=v.dtype) for k, v in spec.slots.items()},
            )
        sd, _ = _dtensor_state_dict(world, group, num_rows)
        nbytes = sum(s.nbytes() for s in world.values())
        with Progress("durable_load", nbytes, step=manifest.step) as progress:  # DCP reads in one call
            dcp.load(sd, checkpoint_id=manifest.checkpoint_dir, process_group=group)
            progress.advance(nbytes)
            self._verify(manifest, comm, world)
        return world

    @staticmethod
    def _verify(manifest: DurableManifest, comm: Comm, world: dict[str, ShardData]) -> None:
        """Check the loaded rows against the CRC32 of every saved shard, whatever the layout now.

        Each rank takes the CRC32 of the part of every saved shard it holds; the parts of one
        saved shard, in row order, combine into that shard's CRC32 (:func:`crc32_combine`)."""
        mine: dict[str, list] = {}
        for name, shard in world.items():
            for tname, t in tensor_items(shard):
                key = f"{name}.{tname}"
                rb = row_bytes(row_spec(t))
                for saved_rank, (start, stop, _) in manifest.checksums.get(key, {}).items():
                    lo, hi = max(start, shard.rows.start), min(stop, shard.rows.stop)
                    if lo < hi:
                        part = t[lo - shard.rows.start : hi - shard.rows.start]
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
        for tname, t in tensor_items(shard):
            shape = (num_rows[name], *t.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            sd[f"{name}.{tname}"] = DTensor.from_local(
                t.cpu(), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
            )
            specs[f"{name}.{tname}"] = row_spec(t)
    return sd, specs


def _on_cpu(shard: ShardData) -> ShardData:
    """The shard with its tensors in host memory (DCP's gloo group and the CRC32 read them there)."""
    if not shard.weight.is_cuda:
        return shard
    return ShardData(shard.table, shard.rows, shard.weight.cpu(), {k: v.cpu() for k, v in shard.slots.items()})


def _to_world_layout(shards: dict[str, ShardData], comm: Comm, num_rows: dict[str, int]) -> dict[str, ShardData]:
    """Move rows from the context's layout (ep owners) to the torch.chunk layout over the whole world."""
    if comm.topology.ep_size == comm.size:
        return shards
    pieces = [LivePiece(name, s) for name, s in shards.items()]
    template = {}
    for name, s in shards.items():
        rows = owned_range(num_rows[name], comm.size, comm.rank)
        template[name] = ShardData(
            name,
            rows,
            torch.empty(len(rows), *s.weight.shape[1:], dtype=s.weight.dtype),
            {k: torch.empty(len(rows), *v.shape[1:], dtype=v.dtype) for k, v in s.slots.items()},
        )
    return move_rows(comm, pieces, template, num_rows, owners=comm.size)
