"""Restore: bring a freshly constructed context to the newest commit complete for every row.

:func:`restore` (collective) serves a first start, a restart and an in-process resize: every rank
publishes an :class:`Inventory` of what it can supply, all choose the same commit, the files to
send from are verified, and the rows move straight into the context. When state exists but no
commit is complete it raises :class:`RestoreError` naming the missing rows; with no state at all
the context keeps its initial rows. :func:`inspect_state` reports the commits on disk.

Design: ``docs/COMMIT.md`` (section "Restore").
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from elastic_emb.errors import ChecksumMismatch, RestoreError
from elastic_emb.events import get_logger
from elastic_emb.progress import Progress
from elastic_emb.protocol import ShardData, row_owners
from elastic_emb.state.comm import Comm
from elastic_emb.state.delta import INDEX, read_chain, resolve_chains
from elastic_emb.state.durable import DurableTier
from elastic_emb.state.lineage import check as check_lineage
from elastic_emb.state.lineage import new_lineage
from elastic_emb.state.manifest import CommitId, SnapshotManifest, row_bytes, row_spec, specs_of, tensor_items
from elastic_emb.state.plan import Assignment, Piece, missing_rows, plan_assignments
from elastic_emb.state.shardfile import read_snapshot
from elastic_emb.state.snapshot import NodeListing, SnapshotTier
from elastic_emb.state.transport import LivePiece, execute_plan, move_rows

log = get_logger("elastic_emb.state")


class Inventory(BaseModel):
    """What one rank can supply to a restore, and the shape of its new context."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    pieces: list[Piece]
    durable: list[CommitId]
    tables: dict[str, tuple[int, int]]  # table -> this rank's new [start, stop)
    specs: dict[str, list[tuple[str, list[int]]]]
    node: NodeListing | None = None  # what this rank's node directory holds (the marker, torn dirs)
    gaps: list[tuple[CommitId, CommitId, list[tuple[str, int, int]]]] = []  # (delta, missing parent, its rows)
    lineages: list[tuple[CommitId, str, str]] = []  # (commit, its lineage, node id / "durable" / "live")


@dataclass(frozen=True)
class FileSource:
    """A piece read from a shard file: the file, its manifest and the table inside it."""

    path: Path
    manifest: SnapshotManifest
    table: str
    chain: tuple[tuple[Path, SnapshotManifest], ...] = ()  # base first, this file last (a delta commit)

    @property
    def first_row(self) -> int:
        return next(r.start for r in self.manifest.shards if r.table == self.table)


@dataclass
class RestoreReport:
    """What a restore did: the commit used, where each new shard's rows came from, bytes moved."""

    step: int  # -1: no committed state, the context keeps its seeded initial rows
    generation: int | None
    fingerprint: str | None
    tiers: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)  # this rank's (start, stop, tier)
    source_tiers: list[str] = field(default_factory=list)  # distinct tiers used by the whole world
    bytes_moved: int = 0  # bytes this rank sent over the communicator
    bytes_local: int = 0  # bytes this rank copied without the communicator
    fallback: str | None = None  # why an older commit or the durable tier was used
    seconds: float = 0.0
    transfer_seconds: float = 0.0  # the row exchange alone (device synchronized)
    transport: str | None = None  # how rows moved between ranks: cma, p2p, cma+p2p (some pairs fell back), alltoall
    lineage: str | None = None  # the history restored (state/lineage.py); a new one for a start from the seed

    def as_dict(self) -> dict:
        """The report as JSON-able values (for events and the CLI).

        Returns:
            A dict of every field, tuples as lists and times rounded to microseconds.
        """
        return {
            "step": self.step,
            "generation": self.generation,
            "fingerprint": self.fingerprint,
            "tiers": {t: [list(x) for x in v] for t, v in self.tiers.items()},
            "source_tiers": self.source_tiers,
            "bytes_moved": self.bytes_moved,
            "bytes_local": self.bytes_local,
            "fallback": self.fallback,
            "seconds": round(self.seconds, 6),
            "transfer_seconds": round(self.transfer_seconds, 6),
            "transport": self.transport,
            "lineage": self.lineage,
        }


def _inventory(template, live, live_commit, snapshot, durable_ms, live_lineage) -> tuple[Inventory, dict[int, object]]:
    pieces: list[Piece] = []
    lineages: set[tuple[CommitId, str, str]] = set()
    if live_commit is not None and live_lineage is not None and live:
        lineages.add((live_commit, live_lineage, "live"))
    sources: dict[int, object] = {}
    if live_commit is not None:
        for shard in live or []:
            if len(shard.rows):
                sources[len(pieces)] = shard
                pieces.append(
                    Piece(
                        table=shard.table,
                        start=shard.rows.start,
                        stop=shard.rows.stop,
                        tier="live",
                        commit=live_commit,
                        handle=len(pieces),
                        spec=[row_spec(t) for _, t in tensor_items(shard)],
                    )
                )
    manifests = snapshot.manifests() if snapshot else []
    chains, broken = resolve_chains(manifests)
    for path, m in manifests:
        if m.lineage is not None:
            lineages.add((m.commit, m.lineage, snapshot.node_id))
        if path not in chains:
            continue  # a delta whose chain back to its base is broken (reported as a gap)
        for rec in m.shards:
            if rec.stop > rec.start:
                sources[len(pieces)] = FileSource(path, m, rec.table, tuple(chains[path]))
                pieces.append(
                    Piece(
                        table=rec.table,
                        start=rec.start,
                        stop=rec.stop,
                        tier="replica" if m.replica else "snapshot",
                        commit=m.commit,
                        handle=len(pieces),
                        spec=[(tr.dtype, tr.row_shape) for tr in rec.tensors if tr.name != INDEX],
                        num_rows=rec.num_rows,
                        file=f"{snapshot.node_id}/{path.parent.name}/{path.name}",
                    )
                )
    inv = Inventory(
        pieces=pieces,
        durable=[m.commit for m in durable_ms],
        tables={name: (s.rows.start, s.rows.stop) for name, s in template.items()},
        specs=specs_of(template),
        node=snapshot.listing() if snapshot else None,
        gaps=[(m.commit, missing, [(r.table, r.start, r.stop) for r in m.shards]) for m, missing in broken],
        lineages=sorted(lineages | {(m.commit, m.lineage, "durable") for m in durable_ms if m.lineage is not None}),
    )
    return inv, sources


def restore(
    context,
    comm: Comm,
    *,
    snapshot: SnapshotTier | None,
    durable: DurableTier | None,
    live: list[ShardData] | None = None,
    live_commit: tuple[int, int, str] | None = None,
    require_state: bool = False,
    start_fresh: bool = False,
    durable_group=None,
    lineage: str | None = None,
) -> RestoreReport:
    """Bring ``context`` to the newest commit complete for every row across tiers (collective).

    Args:
        context: the new context; filled in place when it offers ``shard_views()``, else through
            ``export_shard()`` and ``import_shard()``.
        comm: the communicator of the new world.
        snapshot: the node's snapshot tier, or None.
        durable: the durable tier, or None.
        live: shards this process exported from its previous context.
        live_commit: the commit ``(step, generation, fingerprint)`` those shards hold.
        require_state: a restore without any state is an error.
        start_fresh: where an error would be raised for missing state, keep the context's initial
            rows instead (an explicit choice to start over).
        durable_group: the registered process group DCP loads with; None: the durable tier is not
            read.
        lineage: the history ``live`` belongs to (``RestoreReport.lineage`` of the restore that
            made it), or None.

    Returns:
        What was restored: the commit (step -1 with none), where each row came from, bytes moved.

    Raises:
        RestoreError: when state exists but no commit is complete, when a node holds the run marker
            (this run committed before) but no commit is left, when ``require_state`` and there is
            none, when a chain link newer than the chosen commit is missing, when every snapshot
            file tried was corrupt, when no rank reports any row of a table, or when the ranks hold
            commits of two histories (two lineages, ``state/lineage.py``) and ``start_fresh`` is off.
        ChecksumMismatch: if the durable commit chosen fails its verification.
    """
    # progress: bytes of this rank's new shards filled so far (``reshard`` when live rows are given)
    with Progress("reshard" if live else "restore") as progress:
        return _restore(
            context,
            comm,
            progress,
            snapshot=snapshot,
            durable=durable,
            live=live,
            live_commit=live_commit,
            require_state=require_state,
            start_fresh=start_fresh,
            durable_group=durable_group,
            lineage=lineage,
        )


def _restore(
    context, comm, progress, *, snapshot, durable, live, live_commit, require_state, start_fresh, durable_group, lineage
) -> RestoreReport:
    """:func:`restore`, reporting the bytes of this rank's new shards filled to ``progress``."""
    t0 = time.perf_counter()
    # The new context's own shards give shapes and dtypes and receive the rows. A context that
    # offers ``shard_views()`` (its own storage, writable) is filled in place: no copy of the
    # shard, no import; otherwise the exported copy is filled and imported back.
    views = context.shard_views()
    in_place = views is not None
    template = views if in_place else context.export_shard()
    progress.total = sum(s.nbytes() for s in template.values())
    specs = specs_of(template)
    durable_ms = durable.manifests() if durable is not None and durable_group is not None else []
    mine, sources = _inventory(
        template, live, CommitId(*live_commit) if live_commit else None, snapshot, durable_ms, lineage
    )
    everyone = [Inventory.model_validate(e) for e in comm.exchange("restore-inv", mine.model_dump(mode="json"))]
    num_rows = _num_rows_from(everyone)
    owners = row_owners(context)  # the context's layout: ep_size, or its framework's (e.g. TorchRec's)
    rejected: dict[str, str] = {}  # file -> why (corrupt), the same on every rank
    files = {p.file for e in everyone for p in e.pieces if p.file}
    for attempt in range(len(files) + 1):  # every failed attempt rejects at least one more file
        invs = [
            [
                p
                for p in e.pieces
                if p.file not in rejected and (p.num_rows or num_rows.get(p.table)) == num_rows.get(p.table)
            ]
            for e in everyone
        ]
        durable_common = set.intersection(*[set(e.durable) for e in everyone]) if everyone else set()
        commits = sorted({p.commit for inv in invs for p in inv} | durable_common, reverse=True)
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
            why = _nothing_complete(everyone, first_missing, rejected, num_rows, require_state)
            if why is None or start_fresh:
                if why is not None:
                    log.warning("restore_start_fresh", reason=str(why))
                return RestoreReport(
                    lineage=_agreed_new_lineage(comm),
                    step=-1,
                    generation=None,
                    fingerprint=None,
                    tiers={t: [(s.rows.start, s.rows.stop, "init")] for t, s in template.items()},
                    source_tiers=["init"],
                    fallback="start_fresh" if why is not None else None,
                    seconds=time.perf_counter() - t0,
                )
            raise why
        notes = []
        if rejected:
            notes.append(
                "rejected corrupt snapshot files " + "; ".join(f"{f} ({r})" for f, r in sorted(rejected.items()))
            )
        if first_missing is not None and first_missing[0] != chosen[1]:
            notes.append(f"{first_missing[0]} lacked rows {first_missing[1][:8]} in live/snapshot tiers")
        fallback = ("; ".join(notes) + f"; used {chosen[0]} commit {chosen[1]}") if notes else None
        kind, cid, plan = chosen
        held = [(c, lin, where) for e in everyone for c, lin, where in e.lineages]
        lineage = check_lineage(held, cid, run_id=comm.topology.run_id, start_fresh=start_fresh)
        lineage = lineage or _agreed_new_lineage(comm)  # commits written before lineages were recorded
        skipped = sorted({(c, miss, tuple(rows)) for e in everyone for c, miss, rows in e.gaps if c > cid})
        if skipped:
            raise RestoreError(
                f"the commit chain has a missing link: {skipped[-1][0]} is a delta on {skipped[-1][1]}, which no "
                f"node holds, for rows "
                + ", ".join(f"{t}[{a}, {b})" for t, a, b in skipped[-1][2])
                + f"; restoring {cid} instead would silently drop the steps after it. Bring back the node directory "
                f"holding it, or delete the newer commits on purpose to restore {cid}",
                [tuple(x) for x in skipped[-1][2]],
            )
        if kind == "durable":
            report = _restore_durable(
                context,
                comm,
                durable,
                durable_ms,
                cid,
                template,
                num_rows,
                owners,
                in_place,
                durable_group,
                fallback,
                t0,
                progress,
            )
            report.lineage = lineage
            return report
        bad_local, handles, starts, filled = _load_sources(comm, plan, sources, template, progress)
        bad_all = comm.exchange(f"restore-bad{attempt}", bad_local)
        if any(bad_all):
            for r, bad in enumerate(bad_all):
                for h, reason in bad:
                    rejected.setdefault(everyone[r].pieces[h].file, reason)
            progress.reset()  # the next attempt fills every row again
            continue
        if fallback:
            log.warning("restore_fallback", step=cid.step, reason=fallback)
        tx = time.perf_counter()
        moved = execute_plan(comm, plan, handles, starts, template, done=filled, progress=progress)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        transfer_s = time.perf_counter() - tx
        _finish(context, template, in_place)
        mine_tiers: dict[str, list[tuple[int, int, str]]] = {}
        local = 0
        for a in sorted(plan, key=lambda a: (a.table, a.start)):
            if a.dst == comm.rank:
                mine_tiers.setdefault(a.table, []).append((a.start, a.stop, a.tier))
                if a.src == comm.rank:
                    local += (a.stop - a.start) * sum(row_bytes(s) for s in specs[a.table])
        return RestoreReport(
            step=cid.step,
            generation=cid.generation,
            fingerprint=cid.fingerprint,
            tiers=mine_tiers,
            source_tiers=sorted({a.tier for a in plan}),
            bytes_moved=moved.bytes_sent,
            bytes_local=local,
            fallback=fallback,
            seconds=time.perf_counter() - t0,
            transfer_seconds=transfer_s,
            transport=moved.transport,
            lineage=lineage,
        )
    raise RestoreError(f"restore rejected every snapshot file it tried: {sorted(rejected)}")


def _agreed_new_lineage(comm: Comm) -> str:
    """A new lineage, the same on every rank (rank 0's proposal)."""
    return comm.exchange("restore-lineage", new_lineage())[0]


def _nothing_complete(
    everyone: list[Inventory], first_missing, rejected: dict[str, str], num_rows: dict[str, int], require_state: bool
) -> RestoreError | None:
    """The error to raise when no commit is complete, or None when there is no state at all (a
    first start: the context keeps its initial rows)."""
    nodes = {e.node.node: e.node for e in everyone if e.node is not None}
    marked = sorted(n for n, listing in nodes.items() if listing.marker)
    held = {n: listing.dirs for n, listing in nodes.items() if listing.dirs}
    bad = (
        ("; corrupt files rejected: " + "; ".join(f"{f}: {r}" for f, r in sorted(rejected.items()))) if rejected else ""
    )
    if first_missing is not None:
        cid, missing = first_missing
        return RestoreError(
            f"no commit is complete: the newest, step {cid.step} (generation {cid.generation}), lacks rows "
            + ", ".join(f"{t}[{a}, {b})" for t, a, b in missing)
            + f" in every tier (live, node snapshots, replicas, durable){bad}. Those rows were on lost nodes or in "
            "corrupt files: bring back a node directory holding them, raise replication, configure a durable_dir, "
            "or start over on purpose (LifecycleConfig.start_fresh)",
            missing,
        )
    if not (require_state or marked or held or rejected):
        return None
    whole = [(t, 0, n) for t, n in sorted(num_rows.items())]
    what = (
        ", ".join(f"{n}: {', '.join(d[-3:])}{' ...' if len(d) > 3 else ''}" for n, d in sorted(held.items()))
        or "nothing"
    )
    return RestoreError(
        f"no complete commit in any tier, yet {'this run committed before (run marker on nodes ' + str(marked) + ')' if marked else 'state was required'}: "
        f"the node directories hold {what} without a valid manifest set{bad}; check that ELASTIC_EMB_STATE_DIR, "
        f"ELASTIC_EMB_NODE_ID and ELASTIC_EMB_DURABLE_DIR point at this run's state, or start over on purpose "
        f"(LifecycleConfig.start_fresh)",
        whole,
    )


def _load_sources(
    comm: Comm, plan: list[Assignment], sources: dict[int, object], template: dict[str, ShardData], progress=None
):
    """Read (and verify) the files this rank sends from. Rows that stay on this rank and come from
    a file are copied while the file is checked (one pass over its bytes, see read_snapshot); their
    bytes advance ``progress`` once the file is verified.

    Returns ((handle, reason) of corrupt pieces, tensors per handle, first row per handle, indices of the
    plan's local assignments already filled)."""
    handles: dict[int, dict[str, torch.Tensor]] = {}
    starts: dict[int, int] = {}
    bad_local: list[tuple[int, str]] = []
    corrupt: set[Path] = set()
    fills: dict[Path, dict[str, list]] = {}
    filled: set[int] = set()
    for i, a in enumerate(plan):
        src = sources.get(a.handle) if a.src == comm.rank else None
        if a.dst != comm.rank or not isinstance(src, FileSource):
            continue
        shard = template[a.table]
        lo = a.start - shard.rows.start
        dsts = {tname: t[lo : lo + (a.stop - a.start)] for tname, t in tensor_items(shard)}
        if all(t.device.type == "cpu" and t.is_contiguous() for t in dsts.values()):
            fills.setdefault(src.path, {}).setdefault(src.table, []).append(
                (a.start - src.first_row, a.stop - src.first_row, dsts)
            )
            filled.add(i)
    # A chain is applied to its base's mapping only when some of its rows leave this rank.
    sent = {
        sources[a.handle].path
        for i, a in enumerate(plan)
        if a.src == comm.rank and i not in filled and isinstance(sources.get(a.handle), FileSource)
    }
    # Every file this rank sends from is read (and verified) once; several files on threads of
    # their own (the checksums and the row copies release the GIL), e.g. a survivor's own shard
    # and the replica of a dead rank's, which a restore after a node kill reads both.
    reads = {}
    for a in plan:
        src = sources.get(a.handle) if a.src == comm.rank else None
        if isinstance(src, FileSource) and src.path not in reads:
            reads[src.path] = src
    if len(reads) > 1:
        with ThreadPoolExecutor(
            max_workers=min(len(reads), os.cpu_count() or 1), thread_name_prefix="elastic_emb-restore"
        ) as pool:
            results = dict(zip(reads, pool.map(lambda src: _read_file(src, fills, sent, progress), reads.values())))
    else:
        results = {path: _read_file(src, fills, sent, progress) for path, src in reads.items()}
    for a in plan:
        if a.src != comm.rank or a.handle in handles:
            continue
        src = sources[a.handle]
        if isinstance(src, ShardData):
            handles[a.handle] = dict(tensor_items(src))
            starts[a.handle] = src.rows.start
            continue
        if src.path in corrupt:
            continue  # reported once per file
        tensors, exc = results[src.path]
        if exc is not None:
            log.error("snapshot_rejected", path=str(src.path), error=str(exc))
            rows = ", ".join(f"{r.table}[{r.start}, {r.stop})" for r in src.manifest.shards)
            bad_local.append((a.handle, f"step {src.manifest.step}, rows {rows}: {exc}"))
            corrupt.add(src.path)
            continue
        handles[a.handle] = tensors[src.table]
        starts[a.handle] = src.first_row
    return bad_local, handles, starts, filled


def _read_file(src: FileSource, fills: dict, sent: set, progress=None) -> tuple[dict | None, Exception | None]:
    """One file (or delta chain) read and verified for :func:`_load_sources`: (its tensors, None)
    or (None, why it was rejected). The rows it filled advance ``progress`` once it is verified."""
    try:
        if len(src.chain) > 1:
            out = read_chain(list(src.chain), read_snapshot, fill=fills.get(src.path), materialize=src.path in sent)
        else:
            out = read_snapshot(src.path, src.manifest, fill=fills.get(src.path))
    except (ChecksumMismatch, OSError, ValueError) as exc:
        return None, exc
    if progress is not None:
        filled = fills.get(src.path, {})
        progress.advance(
            sum(t.numel() * t.element_size() for fs in filled.values() for _, _, dsts in fs for t in dsts.values())
        )
    return out, None


def _restore_durable(
    context, comm, durable, durable_ms, cid, template, num_rows, owners, in_place, group, fallback, t0, progress=None
) -> RestoreReport:
    m = next(m for m in durable_ms if m.commit == cid)
    world = durable.load(m, comm, template, num_rows, group)
    shards = move_rows(comm, [LivePiece(n, s) for n, s in world.items()], template, num_rows, owners, progress=progress)
    _finish(context, shards, in_place)
    log.warning("restore_from_durable", step=cid.step, reason=fallback)
    return RestoreReport(
        step=cid.step,
        generation=cid.generation,
        fingerprint=cid.fingerprint,
        tiers={t: [(s.rows.start, s.rows.stop, "durable")] for t, s in shards.items()},
        source_tiers=["durable"],
        bytes_moved=sum(s.nbytes() for s in world.values()),
        fallback=fallback or "durable tier used",
        seconds=time.perf_counter() - t0,
    )


def _finish(context, shards: dict[str, ShardData], in_place: bool) -> None:
    """Hand the restored rows to the context: import them, or (written in place through
    ``shard_views()``) tell it every row was written, so it need not initialise any lazily."""
    if in_place:
        context.mark_restored()
    else:
        context.import_shard(shards)


def _num_rows_from(everyone: list[Inventory]) -> dict[str, int]:
    """Table sizes from the new context's shards on every rank: the last owned row + 1."""
    out: dict[str, int] = {}
    for e in everyone:
        for name, (_, stop) in e.tables.items():
            out[name] = max(out.get(name, 0), stop)
    for name, n in out.items():
        if n < 1:
            raise RestoreError(
                f"table {name!r}: no rank reports any rows; the context exported empty shards everywhere"
            )
    return out


def inspect_state(state_dir, run_id: str, durable_dir=None) -> dict:
    """Every commit on disk, for operators; reads manifests only.

    Args:
        state_dir: the snapshot root; every node directory under ``<state_dir>/<run_id>/`` visible
            from here is read.
        run_id: the run.
        durable_dir: the durable root (``<durable_dir>/<run_id>/``), or None.

    Returns:
        ``{"run_id", "state_dir", "durable_dir", "commits"}``; ``commits`` newest first, each with
        its tier, step, generation, fingerprint, table sizes, whether it is complete, and the row
        ranges nobody holds (plus, for a snapshot, the nodes and shards holding pieces).
    """
    root = Path(state_dir) / run_id
    found: dict[CommitId, list[tuple[str, SnapshotManifest, object]]] = {}
    if root.is_dir():
        for node in sorted(p.name for p in root.iterdir() if p.is_dir()):
            for _, m in SnapshotTier(state_dir, run_id, node).manifests():
                for rec in m.shards:
                    found.setdefault(m.commit, []).append((node, m, rec))
    out = []
    for cid in sorted(found, reverse=True):
        num_rows = {rec.table: rec.num_rows for _, _, rec in found[cid]}
        pieces = [
            Piece(
                table=rec.table,
                start=rec.start,
                stop=rec.stop,
                tier="replica" if m.replica else "snapshot",
                commit=cid,
                handle=i,
                spec=[(t.dtype, t.row_shape) for t in rec.tensors],
            )
            for i, (_, m, rec) in enumerate(found[cid])
        ]
        missing = missing_rows(pieces, num_rows)
        out.append(
            {
                "tier": "snapshot",
                "step": cid.step,
                "generation": cid.generation,
                "fingerprint": cid.fingerprint,
                "complete": not missing,
                "missing": [list(x) for x in missing],
                "tables": num_rows,
                "nodes": sorted({node for node, _, _ in found[cid]}),
                "shards": sorted({(m.source_rank, m.replica, node) for node, m, _ in found[cid]}),
            }
        )
    if durable_dir is not None:
        for m in DurableTier(durable_dir, run_id).manifests():
            out.append(
                {
                    "tier": "durable",
                    "step": m.step,
                    "generation": m.generation,
                    "fingerprint": m.fingerprint,
                    "complete": True,
                    "missing": [],
                    "tables": m.tables,
                    "dir": m.checkpoint_dir,
                }
            )
    out.sort(key=lambda c: (c["step"], c["generation"]), reverse=True)
    return {
        "run_id": run_id,
        "state_dir": str(state_dir),
        "durable_dir": str(durable_dir) if durable_dir else None,
        "commits": out,
    }
