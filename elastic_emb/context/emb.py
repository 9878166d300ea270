"""EmbContext: one generation's sharded embedding context, a communicator plus a memory arena.

:class:`EmbContext` is built for exactly one topology (world size and expert-parallel size) and
is a facade over the parts of :mod:`elastic_emb.context`: collective ``lookup`` and
``apply_gradients``; ``reset`` to the same world size (rows kept) and ``close`` (the
communicator released, in the background if asked); ``export_shard`` / ``import_shard`` /
``shard_views`` and a DTensor ``state_dict`` for resharding; ``take_changes`` for incremental
commits; ``check_errors`` for the errors the GPU found.

Design: ``docs/CONTEXT.md`` (sections "Parts" and "Life of a context").
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from elastic_emb import config, metrics
from elastic_emb.context.arena import Arena, Rows
from elastic_emb.context.changes import ChangeTracker
from elastic_emb.context.checks import DeviceChecks
from elastic_emb.context.dedup import Deduper
from elastic_emb.context.dtensor import MeshCache, load_state_dict, state_dict
from elastic_emb.context.exchange import MAX_CHUNKS, HeaderExchange, call_tag
from elastic_emb.context.gradients import GradientRouter
from elastic_emb.context.group import Group, log, wait_releases
from elastic_emb.context.lookup import LookupEngine, LookupHandle
from elastic_emb.context.parts import OpParts
from elastic_emb.errors import CommunicationError, ContextClosed, WorldSizeChanged
from elastic_emb.protocol import ContextBase, OptimizerSpec, ShardData, TableSpec
from elastic_emb.sharding import RowRange, owned_range
from elastic_emb.topology import Topology, is_power_of_two

# Contexts not yet closed: closed at interpreter exit, before torch's own teardown, so that no
# communicator is destroyed by static destructors (gloo then aborts the process).
_OPEN: "weakref.WeakSet[EmbContext]" = weakref.WeakSet()


@atexit.register
def _close_open_contexts() -> None:
    for ctx in list(_OPEN):
        try:
            ctx.close()
        except Exception:
            pass
    # Communicators still being released in the background: let them finish before torch's
    # own teardown (bounded by their timeouts). Not the abandoned transfers an aborted gloo
    # group is held for: its daemon thread keeps it, so it is never destroyed (its destructor
    # would wait for the transfer, up to the timeout).
    wait_releases(dropped=False)


class EmbContext(ContextBase):
    """A sharded embedding context for one topology: a private communicator plus a memory arena.

    Args:
        topology: the agreed topology record.
        store: the job's store (the context uses a private prefix of it).
        tables: the tables; names must be unique.
        optimizer: the row-wise optimizer the owners apply.
        device: default ``cuda:<local_rank>`` on NCCL, else the CPU.
        timeout: seconds; bounds every wait.
        require_power_of_two: whether the EP size must be a power of two.
        seed: the initial rows' seed; None: zeros.
        staging_rows_per_rank: staging rows per peer, each direction (grown on demand).
        pipeline_chunks: lookup pieces, equal on every rank; default 3 on NCCL, 1 on gloo.
        high_priority_stream: NCCL's stream priority; default on for NCCL.
        capture_dedup: whether the dedup kernels of large batches replay from CUDA graphs.
        nonfinite_gradients: "raise" refuses a gradient call with NaN or infinite rows; "skip"
            updates the other rows; default from ``ELASTIC_EMB_NONFINITE_GRADIENTS``, else "raise".

    Raises:
        ValueError: for a bad argument (timeout, tables, EP size, device, pipeline_chunks, ...).
        CommunicationError: when the peers do not all form the group within ``timeout``.
    """

    tracks_changes = True

    def __init__(
        self,
        topology: Topology,
        store: dist.Store,
        *,
        tables: Sequence[TableSpec],
        optimizer: OptimizerSpec = OptimizerSpec(),  # noqa: B008 - a frozen record, safe to share
        device: torch.device | str | None = None,
        timeout: float = 60.0,
        require_power_of_two: bool = True,
        seed: int | None = 0,
        staging_rows_per_rank: int = 4096,
        pipeline_chunks: int | None = None,
        high_priority_stream: bool | None = None,
        capture_dedup: bool = True,
        nonfinite_gradients: Literal["raise", "skip"] | None = None,
    ) -> None:
        started = time.monotonic()
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        if not tables:
            raise ValueError("tables is empty: an EmbContext needs at least one TableSpec")
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"table names {dup} appear more than once in tables; names must be unique")
        if nonfinite_gradients is None:
            nonfinite_gradients = config.load(None, "nonfinite_gradients").nonfinite_gradients
        if nonfinite_gradients not in ("raise", "skip"):
            raise ValueError(f"nonfinite_gradients={nonfinite_gradients!r} must be 'raise' or 'skip'")
        self.nonfinite_gradients = nonfinite_gradients
        if staging_rows_per_rank < 0:
            raise ValueError(f"staging_rows_per_rank={staging_rows_per_rank} must be >= 0")
        if pipeline_chunks is None:
            # NCCL: overlap gathers and reorders with the row exchanges (separate streams).
            # Gloo: a CPU process does one thing at a time, pieces would only add round trips.
            pipeline_chunks = 3 if topology.backend == "nccl" else 1
        if not 1 <= pipeline_chunks <= MAX_CHUNKS:
            raise ValueError(f"pipeline_chunks={pipeline_chunks} must be in [1, {MAX_CHUNKS}]")
        self.pipeline_chunks = pipeline_chunks
        # NCCL: the exchanges' kernels go first when they compete with gathers for the GPU.
        self.high_priority_stream = (
            topology.backend == "nccl" if high_priority_stream is None else bool(high_priority_stream)
        )
        _check_ep(topology, require_power_of_two)
        self.topology = topology
        self.tables: dict[str, TableSpec] = {t.name: t for t in tables}
        self.optimizer = optimizer
        self.timeout = float(timeout)
        self.require_power_of_two = require_power_of_two
        self.seed = seed
        self.staging_rows_per_rank = staging_rows_per_rank
        self.capture_dedup = bool(capture_dedup)
        self.device = _pick_device(topology, device)
        self._base_store = store
        self._closed = False
        self._mesh = MeshCache()
        self._log = log.bind(run_id=topology.run_id, generation=topology.generation, rank=topology.rank)
        self._group = Group.form(topology, store, self.device, self.timeout, self.high_priority_stream, self._log)
        self._arena = self._allocate(topology)
        # Rows are filled lazily: a context built for a resize has them overwritten by the
        # restore at once. import_shard and mark_restored() skip the fill.
        self._rows = Rows(self.tables, seed)
        self._changes = ChangeTracker(self._local_rows(), self.device)
        self._checks = DeviceChecks(self.device, self.timeout, self._log)
        self._wire()
        _OPEN.add(self)
        self._log.info(
            "context.constructed",
            world_size=topology.world_size,
            ep_size=topology.ep_size,
            backend=topology.backend,
            device=str(self.device),
            tables=len(self.tables),
            arena_bytes=self.arena_bytes,
            resident_bytes=self._arena.resident_bytes,
            seconds=round(time.monotonic() - started, 4),
        )

    def _allocate(self, topology: Topology) -> Arena:
        return Arena.for_rank(
            self.tables,
            self.optimizer,
            topology.ep_size,
            topology.rank,
            topology.world_size,
            self.staging_rows_per_rank,
            self.device,
        )

    def _wire(self) -> None:
        """(Re)build the parts bound to the group and the arena."""
        t, dev = self.topology, self.device
        self._exchange = HeaderExchange(self._group, t, dev, self.tables, self._log)
        self._dedup = Deduper(self._exchange, t, dev, self.capture_dedup, self._log)
        self._parts = OpParts(self._group, self._dedup, self._arena, t, dev, self.tables, self._checks)
        self._lookups = LookupEngine(self._parts, self.pipeline_chunks, self._log)
        self._gradients = GradientRouter(
            self._parts, self.optimizer, self._lookups.settle, self._changes, self.nonfinite_gradients
        )

    def _local_rows(self) -> dict[str, int]:
        return {name: len(self.owned(name)) for name in self.tables}

    # -- state ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def healthy(self) -> bool:
        """False once a collective failed or timed out, or after close."""
        return not self._closed and self._group.healthy

    @property
    def process_group(self):
        """The private process group (None once closed)."""
        return None if self._closed else self._group.pg

    @property
    def arena_bytes(self) -> int:
        """Bytes the arena holds on the device now (resident rows and slots + staging)."""
        return 0 if self._closed else self._arena.nbytes

    def arena_report(self) -> dict:
        """Sizes of the arena's parts, for logs and benchmarks.

        Returns:
            The device plus :meth:`~elastic_emb.context.arena.Arena.report`'s sizes and tables.

        Raises:
            ContextClosed: after ``close()``.
        """
        self._check_open("arena_report")
        return {"device": str(self.device), **self._arena.report(self._owned_all())}

    def owned(self, table: str) -> RowRange:
        """The global rows of ``table`` this rank owns (empty on ranks >= ep_size).

        Args:
            table: the table's name.

        Returns:
            The half-open range of global row indices.

        Raises:
            KeyError: for an unknown table.
        """
        spec = self._spec(table)
        return owned_range(spec.num_rows, self.topology.ep_size, self.topology.rank)

    def _owned_all(self) -> dict[str, RowRange]:
        return {name: self.owned(name) for name in self.tables}

    def _materialise(self) -> None:
        if self._rows.uninitialised:
            self._rows.materialise(self._arena, self._owned_all())

    def mark_restored(self) -> None:
        """Declare that every row of every table was written through :meth:`shard_views` (a
        restore did it), so the lazy initial fill is skipped; every row counts as changed.

        Raises:
            ContextClosed: after ``close()``.
        """
        self._check_open("mark_restored")
        self._rows.written()
        self._changes.mark_all()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ContextClosed(
                f"{what} on a closed EmbContext (run {self.topology.run_id!r} generation "
                f"{self.topology.generation}, world size {self.topology.world_size}); construct a new context"
            )

    def _spec(self, table: str) -> TableSpec:
        try:
            return self.tables[table]
        except KeyError:
            raise KeyError(f"unknown table {table!r}; this context holds {sorted(self.tables)}") from None

    def _spec_or_cancel(self, table: str, what: str, op: int, chunks: int = 1) -> TableSpec:
        """The table's spec; for an unknown table, cancel the call on the peers, then raise KeyError."""
        if table in self.tables:
            return self.tables[table]
        if self.topology.world_size > 1:
            self._exchange.cancel(what, call_tag(sorted(self.tables), op, table, chunks))
        return self._spec(table)

    # -- collective operations -------------------------------------------------------------

    def lookup(self, table: str, ids: torch.Tensor) -> LookupHandle:
        """Start a lookup of ``ids`` (collective: every rank calls it, possibly with no ids).

        Args:
            table: the table's name.
            ids: 1-D integer tensor of global row ids.

        Returns:
            A :class:`LookupHandle`, before the row exchange completes; ``handle.wait()`` gives
            ``[len(ids), dim]``.

        Raises:
            ContextClosed: after ``close()``.
            KeyError: for an unknown table (after cancelling the call on the peers).
            InvalidIds: on the rank whose ids are bad (on one rank with CUDA: at ``wait()``), or
                for an error of an earlier call already read from the device.
            NonFiniteGradients: for an earlier ``apply_gradients`` refused on the device.
            PeerLookupError: on the other ranks when a rank's ids are bad.
            CollectiveMismatch: when the ranks are in different calls.
            CommunicationError: when the exchange fails or times out.
        """
        self._check_open(f"lookup({table!r})")
        self._checks.raise_ready()
        self._materialise()
        what = f"lookup({table!r})"
        spec = self._spec_or_cancel(table, what, 1, self.pipeline_chunks)
        metrics.lookups(table, ids.numel())  # a no-op unless ELASTIC_EMB_METRICS_PORT is set
        return self._lookups.lookup(spec, ids, what)

    def apply_gradients(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Route ``grads`` to the owners of ``ids`` and apply the optimizer there; gradients of
        duplicate ids are summed (collective: every rank calls it).

        Args:
            table: the table's name.
            ids: 1-D integer tensor of global row ids.
            grads: ``[len(ids), dim]`` gradients.

        Raises:
            ContextClosed: after ``close()``.
            KeyError: for an unknown table (after cancelling the call on the peers).
            InvalidIds: for bad ids or a ``grads`` shape that does not fit (on one rank with CUDA,
                bad ids surface later: ``docs/CONTEXT.md``, section "Device checks").
            NonFiniteGradients: with ``nonfinite_gradients="raise"``, when any rank's gradient
                rows are NaN or infinite (no row of the call changes).
            PeerLookupError: on the other ranks when a rank's input is bad.
            CollectiveMismatch: when the ranks are in different calls.
            CommunicationError: when an exchange fails or times out.
        """
        self._check_open(f"apply_gradients({table!r})")
        self._checks.raise_ready()
        self._materialise()
        what = f"apply_gradients({table!r})"
        spec = self._spec_or_cancel(table, what, 2)
        self._gradients.apply(spec, ids, grads, what)

    def barrier(self) -> None:
        """Wait until every rank reaches this point (a small all-reduce, bounded by the timeout).

        Raises:
            ContextClosed: after ``close()``.
            CommunicationError: when the all-reduce fails or times out.
        """
        self._check_open("barrier")
        self._group.allreduce(torch.zeros(1, device=self.device), "barrier")

    # -- reset and close -----------------------------------------------------------------------

    def reset(self, rank: int, world_size: int, *, topology: Topology | None = None, store=None) -> None:
        """Re-form the communicator for the same world size (the rank mapping may change).

        Rows are kept: if this process's rank changed, its shard moves to the process that now
        holds its old rank, and every row counts as changed.

        Args:
            rank: this process's new rank.
            world_size: must equal the current world size.
            topology: the new topology (with the new generation); default: the current one with
                ``rank``.
            store: replaces the context's store when given.

        Raises:
            ContextClosed: after ``close()``.
            ValueError: for an invalid rank or world size, a topology that disagrees with them,
                a non-power-of-two EP size (unless the rule is off), or a changed EP size or
                backend.
            WorldSizeChanged: for a different world size.
            CommunicationError: when the new group does not form, or the row move fails.
        """
        self._check_open("reset")
        self._materialise()
        topology = _checked_reset(self.topology, rank, world_size, topology, self.require_power_of_two)
        started = time.monotonic()
        old_rank = self.topology.rank
        was_healthy = self._group.healthy
        self._log = log.bind(run_id=topology.run_id, generation=topology.generation, rank=topology.rank)
        # Form the new communicator before releasing the old one: an NCCL destroy immediately
        # followed by an init races (pytorch#119196), and a failed re-form leaves the old
        # context as it was.
        new_group = Group.form(
            topology,
            store if store is not None else self._base_store,
            self.device,
            self.timeout,
            self.high_priority_stream,
            self._log,
        )
        if was_healthy:
            self._lookups.drain()
        self._lookups.retire("reset")
        self._group.release(abort=not was_healthy)
        self._group = new_group
        if store is not None:
            self._base_store = store
        self.topology = topology
        self._changes.before_write()
        moved = self._remap_rows(old_rank)
        if moved:
            self._changes.resize(self._local_rows())  # this process now holds other rows: all changed
        self._wire()  # a new exchange block (every rank restarts with headers alone) and dedup graphs
        self._log.info(
            "context.reset", old_rank=old_rank, moved_bytes=moved, seconds=round(time.monotonic() - started, 4)
        )

    def _remap_rows(self, old_rank: int) -> int:
        """After a reset: move each process's resident arena to the process that now has its
        old rank. One all-to-all of bytes; every rank takes part even when nothing moves.
        Returns the bytes moved (0: nothing moved)."""
        world, rank = self.topology.world_size, self.topology.rank
        olds = torch.zeros(world, dtype=torch.int64, device=self.device)
        olds[rank] = old_rank
        self._group.allreduce(olds, "reset rank exchange")
        old_of = olds.tolist()  # old_of[new rank] = old rank
        if old_of == list(range(world)):
            return 0
        if sorted(old_of) != list(range(world)):
            self._group.healthy = False
            raise CommunicationError(f"reset: old ranks {old_of} are not a permutation of 0..{world - 1}")
        new_arena = self._allocate(self.topology)
        src = self._arena.buffer[: self._arena.resident_bytes]
        dst = new_arena.buffer[: new_arena.resident_bytes]
        in_splits = [0] * world
        in_splits[old_rank] = src.numel()  # the process now holding my old rank needs my rows
        out_splits = [0] * world
        out_splits[old_of.index(rank)] = dst.numel()  # I take the rows of my new rank's old holder
        self._group.wait(self._group.alltoall(dst, src, out_splits, in_splits), None, "reset row move")
        self._arena = new_arena
        return int(src.numel())

    def interrupt(self, reason: str) -> None:
        """End a wait on the communicator now, and every later one (thread-safe): a peer is known
        to be gone (the in-process resize's liveness probe). A gloo transfer to a dead peer can
        otherwise block until the timeout (``docs/CONTEXT.md``, section "Interrupt").

        Args:
            reason: why, named in the :class:`~elastic_emb.errors.TransferInterrupted` raised.
        """
        if not self._closed:
            self._group.interrupt(reason)

    def close(self, *, abort: bool | None = None, wait: bool = True) -> None:
        """Release the communicator and the arena. Idempotent.

        Args:
            abort: True forces, False forbids aborting the communicator; None (default) aborts
                only when unhealthy.
            wait: False (what the lifecycle does on a resize) returns as soon as the context is
                unusable and its arena is back in the allocator, for the next context to reuse:
                the NCCL communicator is destroyed (or aborted) by a background thread, bounded by
                the timeout, while the next context forms.
                :func:`~elastic_emb.context.group.wait_releases` waits for those threads; each
                reports a ``context.group_released`` event, or ``context.group_release_failed``.
        """
        if self._closed:
            return
        started = time.monotonic()
        do_abort = (not self._group.healthy) if abort is None else abort
        if not do_abort:
            self._lookups.drain()
        self._closed = True
        _OPEN.discard(self)
        self._lookups.retire("closed")
        arena, arena_bytes = self._arena, self._arena.nbytes
        # Nothing may keep the arena alive (handles hold the engine): the next context reuses it.
        self._arena = self._parts.arena = None  # type: ignore[assignment]
        self._group.release(abort=do_abort, wait=wait, keep=arena if do_abort else None)
        del arena
        if self.device.type == "cuda" and wait:
            torch.cuda.empty_cache()
        self._log.info(
            "context.closed",
            aborted=do_abort,
            released_bytes=arena_bytes,
            communicator="released" if wait or self.topology.backend == "gloo" else "releasing in background",
            seconds=round(time.monotonic() - started, 4),
        )

    def __enter__(self) -> "EmbContext":
        self._check_open("__enter__")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=True if exc_type is not None and not self.healthy else None)

    def __del__(self) -> None:  # best effort; close() is the real interface
        try:
            if not self._closed and self._group.pg is not None and self.topology.backend == "gloo":
                self.close()
        except Exception:
            pass

    # -- shards --------------------------------------------------------------------------------

    def export_shard(self) -> dict[str, ShardData]:
        """Copies of this rank's rows and slots of every table, with their global row range.

        Returns:
            Per table, a :class:`~elastic_emb.protocol.ShardData` of cloned tensors.

        Raises:
            ContextClosed: after ``close()``.
            InvalidIds: an unreported device error of an earlier call (also
                :class:`~elastic_emb.errors.NonFiniteGradients`).
            CommunicationError: the device did not finish its checks within the timeout.
        """
        self._check_open("export_shard")
        self._checks.raise_all()
        self._materialise()
        a = self._arena
        return {
            name: ShardData(
                table=name,
                rows=self.owned(name),
                weight=a.weights[name].clone(),
                slots={k: v.clone() for k, v in a.slots[name].items()},
            )
            for name in self.tables
        }

    def shard_views(self) -> dict[str, ShardData]:
        """This rank's rows and slots as the arena's own tensors: writable views, no copy.

        For a restore that writes rows in place (skipping export's clone and import's copy);
        the rows are not initialised by this call: a caller that wrote every row says so with
        :meth:`mark_restored`, anything else that reads rows initialises them first.
        The views are valid until ``close()`` or a ``reset`` that changes this rank's rank
        (which re-lays the arena); take them again after either.

        Returns:
            Per table, a :class:`~elastic_emb.protocol.ShardData` of the arena's tensors.

        Raises:
            ContextClosed: after ``close()``.
        """
        self._check_open("shard_views")
        a = self._arena
        return {
            name: ShardData(table=name, rows=self.owned(name), weight=a.weights[name], slots=dict(a.slots[name]))
            for name in self.tables
        }

    def import_shard(self, shards: Mapping[str, ShardData]) -> None:
        """Overwrite this rank's rows with ``shards``. Local (no communication); every row then
        counts as changed.

        Args:
            shards: exactly this rank's owned range of every table, with every optimizer slot.

        Raises:
            ContextClosed: after ``close()``.
            ValueError: naming the table, range or shape that does not fit.
        """
        self._check_open("import_shard")
        self._lookups.settle()
        self._arena.check_import(shards, self._owned_all(), self.topology.rank, self.optimizer)
        self._changes.before_write()
        self._arena.write(shards)
        self._rows.written()
        self._changes.mark_all()

    # -- DTensor state dict -------------------------------------------------------------------

    def device_mesh(self):
        """A DeviceMesh over the owner ranks ``0..ep_size-1`` of the default process group.

        Returns:
            The mesh (cached while the default group stays the same).

        Raises:
            ContextClosed: after ``close()``.
            RuntimeError: when the default group is missing or does not match this context's
                rank and world size.
        """
        self._check_open("device_mesh")
        return self._mesh.mesh(self.topology, self.device)

    def state_dict(self) -> dict:
        """The rows and slots as DTensors for DCP.

        Returns:
            ``{"<table>.weight": DTensor, "<table>.<slot>": DTensor}``, ``Shard(0)`` over the
            owner ranks; local tensors are views of the arena (DCP ``load`` into them writes it).

        Raises:
            ContextClosed: after ``close()``.
            RuntimeError: when the default group is missing or does not match this context.
            InvalidIds: an unreported device error of an earlier call (also
                :class:`~elastic_emb.errors.NonFiniteGradients`).
            CommunicationError: the device did not finish its checks within the timeout.
        """
        mesh = self.device_mesh()
        self._checks.raise_all()
        self._materialise()
        return state_dict(self._arena, self.tables, mesh)

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Copy the local shards of ``state`` into the arena; every row then counts as changed.

        Args:
            state: as returned by :meth:`state_dict`, possibly loaded by DCP.

        Raises:
            ContextClosed: after ``close()``.
            KeyError: when a table's weight or slot is missing.
            ValueError: when a local shape differs from the arena's.
        """
        self._check_open("load_state_dict")
        self._lookups.settle()
        self._materialise()  # a state dict may cover only some slots; the rest keep their values
        self._changes.before_write()
        load_state_dict(self._arena, self.tables, state)
        self._changes.mark_all()

    # -- change tracking and device-side checks ------------------------------------------------

    def take_changes(self) -> dict[str, torch.Tensor]:
        """Per table, a bool mask of shape (local rows,) on the context's device, True for rows
        written (rows or optimizer slots) since the previous call: by ``apply_gradients`` (the rows
        it updated), and every row after ``import_shard``, ``load_state_dict``, ``mark_restored``
        or a ``reset`` that moved this rank's rows. The lazy fill from the seed does not count. The
        caller owns the returned masks (fresh ones are swapped in; no host sync). A caller whose
        baseline is the state just restored takes (and drops) the masks right after the restore.

        Returns:
            Per table, the bool mask.

        Raises:
            ContextClosed: after ``close()``.
            InvalidIds: a pending device error, raised first (see :meth:`check_errors`; also
                :class:`~elastic_emb.errors.NonFiniteGradients`).
            CommunicationError: the device did not finish its checks within the timeout.
        """
        self._check_open("take_changes")
        self._checks.raise_all()
        return self._changes.take()

    def take_changed_rows(self, unique: bool = True) -> dict[str, torch.Tensor | None]:
        """The rows :meth:`take_changes` would mark, at a cost proportional to the rows written,
        not to the shard.

        Args:
            unique: False: duplicates and entries equal to the local row count (no row) included,
                and no host sync (see :meth:`elastic_emb.context.changes.ChangeTracker.take_rows`).

        Returns:
            Per table, an int64 tensor of local row numbers (None: every row).

        Raises:
            ContextClosed: after ``close()``.
            InvalidIds: a device error (with ``unique``: any pending one, waited for; else only
                one already read; also :class:`~elastic_emb.errors.NonFiniteGradients`).
        """
        self._check_open("take_changed_rows")
        if unique:
            self._checks.raise_all()
        else:  # no wait for the device: a refused call wrote nothing (its rows are marked as no row)
            self._checks.raise_ready()
        return self._changes.take_rows(unique)

    def hold_writes(self, event) -> None:
        """A device-side commit capture reads rows until ``event``: every later write waits for
        it on the device (no host sync), so no row changes while it is captured.

        Args:
            event: the CUDA event recorded once the capture has read its rows.
        """
        self._changes.hold(event)

    def check_errors(self) -> None:
        """Wait (bounded by the timeout) until the device has checked every call made so far, and
        raise the first error it found.

        Raises:
            ContextClosed: after ``close()``.
            InvalidIds: a call's ids were out of range.
            NonFiniteGradients: a gradient call was refused for NaN or infinite rows.
            CommunicationError: the device did not finish its checks within the timeout.
        """
        self._check_open("check_errors")
        self._checks.raise_all()

    def __repr__(self) -> str:
        t = self.topology
        state = "closed" if self._closed else ("healthy" if self.healthy else "unhealthy")
        return (
            f"EmbContext(rank={t.rank}, world_size={t.world_size}, ep_size={t.ep_size}, "
            f"backend={t.backend!r}, tables={sorted(self.tables)}, {state})"
        )


def _check_ep(topology: Topology, require_power_of_two: bool) -> None:
    ep = topology.ep_size
    if ep < 1 or ep > topology.world_size:
        raise ValueError(f"ep_size={ep} must be in [1, world_size={topology.world_size}]")
    if require_power_of_two and not is_power_of_two(ep):
        raise ValueError(
            f"ep_size={ep} is not a power of two; set ELASTIC_EMB_EP_SIZE to a power of two "
            f"(1, 2, 4, ...) or construct with require_power_of_two=False"
        )


def _pick_device(topology: Topology, device) -> torch.device:
    if device is not None:
        dev = torch.device(device)
    elif topology.backend == "nccl":
        dev = torch.device("cuda", topology.local_rank)
    else:
        dev = torch.device("cpu")
    if topology.backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"backend 'nccl' needs a CUDA device, got device={dev}; use backend 'gloo' on CPU")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={dev} but CUDA is not available; use backend 'gloo' and device 'cpu'")
        if dev.index is None:
            dev = torch.device("cuda", topology.local_rank % torch.cuda.device_count())
    return dev


def _checked_reset(
    current: Topology, rank: int, world_size: int, topology: Topology | None, require_power_of_two: bool
) -> Topology:
    """The topology a ``reset(rank, world_size, topology=)`` moves to, or the error that forbids it."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an int")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if world_size != current.world_size:
        raise WorldSizeChanged(current.world_size, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, {world_size})")
    if topology is None:
        topology = current.with_changes(rank=rank)
    if topology.rank != rank or topology.world_size != world_size:
        raise ValueError(
            f"topology (rank={topology.rank}, world_size={topology.world_size}) does not match "
            f"reset(rank={rank}, world_size={world_size})"
        )
    _check_ep(topology, require_power_of_two)
    if topology.ep_size != current.ep_size:
        raise ValueError(
            f"ep_size changed from {current.ep_size} to {topology.ep_size}: the arena is laid "
            f"out for the old sharding; close this context and construct a new one"
        )
    if topology.backend != current.backend:
        raise ValueError(f"backend changed from {current.backend!r} to {topology.backend!r}: construct a new context")
    return topology
