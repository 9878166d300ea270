"""Elastic TorchRec: a :class:`~elastic_emb.protocol.ShardedContext` over a user's
``DistributedModelParallel``.

:class:`TorchRecContext` forms the process groups of each generation, builds the user's DMP for
that world, and moves its row-wise, fused-kernel tables (and their row-wise optimizer state)
through fbgemm's own tensors; the replicated parameters travel as one more table (``dense``), the
dense optimizer as the lifecycle's ``app_state``, over parameters of its own that each step copies
into and out of the DMP's (built anew every generation; ``examples/dlrm.py``'s ``DenseOptimizer``).
Changed rows are tracked through TorchRec's post-lookup hook. Training code reads
:attr:`TorchRecContext.model` at every step and runs it inside :meth:`TorchRecContext.guard`.

Design: ``docs/CONTEXT.md`` (section "The TorchRec adapter").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb.context.changes import ChangeTracker
from elastic_emb.errors import ContextClosed, ElasticEmbError, UnsupportedSharding, WorldSizeChanged
from elastic_emb.events import get_logger
from elastic_emb.protocol import ContextBase, ShardData, TableSpec
from elastic_emb.sharding import RowRange, owned_range
from elastic_emb.store import generation_store
from elastic_emb.topology import Topology

DENSE_DIM = 16
"""Columns of the ``dense`` table (the replicated parameters, flattened)."""

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_BITS = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}

log = get_logger("elastic_emb.adapters")

BuildFn = Callable[[Topology, object, torch.device], object]
"""``build(topology, sharding_env, device) -> DistributedModelParallel``."""


def require_torchrec():
    """Import torchrec, or fail with the install command.

    Returns:
        The ``torchrec`` module.

    Raises:
        ImportError: when TorchRec (or its ``DistributedModelParallel``) cannot be imported.
    """
    try:
        import torchrec
        from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"elastic_emb.adapters.torchrec needs TorchRec ({exc}); install the extra: "
            f"pip install 'elastic-emb[torchrec]' (the README's TorchRec section has the exact command)"
        ) from exc
    return torchrec


class TorchRecContext(ContextBase):
    """A user's TorchRec model as an elastic_emb context.

    Args:
        topology: the agreed topology.
        store: the job's store (each generation's groups use a private prefix of it).
        build: ``build(topology, env, device)`` returns the ``DistributedModelParallel`` for
            ``topology``; ``env`` is a ``ShardingEnv`` over a process group this context formed
            (not the default group, which it forms too and leaves to the lifecycle's
            checkpoints); ``device`` is ``cuda:<local_rank>`` on NCCL, else the CPU.
        dense_table: the name of the table that carries the replicated parameters (None: they
            are not carried). Their optimizer's state is not: pass it as ``app_state``
            (docs/TORCHREC.md, "The dense optimizer").
        timeout: seconds for every collective of the process groups.
        track_changes: mark the rows each step looks up, so that commits are incremental;
            False: full snapshots.

    Raises:
        ImportError: without TorchRec.
        ValueError: for a bad timeout, a ``dense_table`` name that a TorchRec table has, or
            replicated parameters of mixed dtypes.
        TypeError: when ``build`` returns something else than a ``DistributedModelParallel``.
        UnsupportedSharding: for a table that is not row-wise with a fused kernel, or an
            optimizer state that is not row-wise.
        ElasticEmbError: when torch.distributed's default group is already initialised.
    """

    def __init__(
        self,
        topology: Topology,
        store,
        *,
        build: BuildFn,
        dense_table: str | None = "dense",
        timeout: float = 60.0,
        track_changes: bool = True,
    ) -> None:
        require_torchrec()
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        self._track = bool(track_changes)
        self.tracks_changes = False  # until _build finds TorchRec's lookup hook on every table
        self.topology = topology
        self.timeout = timeout
        self.owner_ranks = topology.world_size
        self.device = torch.device("cuda", topology.local_rank) if topology.backend == "nccl" else torch.device("cpu")
        self._build_fn = build
        self._dense_name = dense_table
        self._closed = False
        self._healthy = True
        self._groups = _ProcessGroups(timeout)
        self._groups.form(topology, store)
        self._model = None
        self._dense_stale = False
        try:
            self._build()
        except BaseException:
            self._groups.destroy()
            raise

    # -- model ---------------------------------------------------------------------------------

    def _build(self) -> None:
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        _forget_collective_validation()
        env = ShardingEnv.from_process_group(self._groups.pg)
        model = self._build_fn(self.topology, env, self.device)
        if not isinstance(model, DistributedModelParallel):
            raise TypeError(
                f"build() returned {type(model).__name__}; it must return the torchrec "
                f"DistributedModelParallel for the topology it is given"
            )
        views, sharded = _sharded_tables(model, self.topology)
        self._views = views
        self._dense = [(n, p) for n, p in model.named_parameters() if n not in sharded] if self._dense_name else []
        if self._dense_name in views:
            raise ValueError(f"dense_table={self._dense_name!r} is also the name of a TorchRec table; pick another")
        self.tables: dict[str, TableSpec] = {}
        for name, v in views.items():
            self.tables[name] = TableSpec(
                name=name, num_rows=v.num_rows, dim=v.weight.shape[1], dtype=_dtype_name(v.weight.dtype, name)
            )
        if self._dense:
            dtypes = {p.dtype for _, p in self._dense}
            if len(dtypes) != 1:
                raise ValueError(
                    f"the replicated parameters mix dtypes {sorted(map(str, dtypes))}; the "
                    f"{self._dense_name!r} table needs one (or pass dense_table=None)"
                )
            total = sum(p.numel() for _, p in self._dense)
            rows = -(-total // DENSE_DIM)
            dtype = dtypes.pop()
            self._dense_flat = torch.zeros(rows * DENSE_DIM, dtype=dtype, device=self.device)
            self.tables[self._dense_name] = TableSpec(
                name=self._dense_name, num_rows=rows, dim=DENSE_DIM, dtype=_dtype_name(dtype, self._dense_name)
            )
        self._model = model
        self._changes, self._dense_seen = None, None
        if self._track:
            self._start_tracking(model, views)

    def _start_tracking(self, model, views: dict[str, "_TableViews"]) -> None:
        """Hook every sharded module holding one of ``views``' tables (``docs/CONTEXT.md``,
        section "Change tracking"); leave ``tracks_changes`` False when TorchRec offers no hook
        for one of them."""
        hooked: list = []  # (module, its feature name -> table): two modules may use one feature name
        for _, module in model.named_modules():
            configs = getattr(module, "_table_name_to_config", None)
            if not configs or not any(t in views for t in configs):
                continue
            if not hasattr(module, "register_post_lookup_tracker_fn"):
                log.info(
                    "torchrec.change_tracking_unavailable",
                    module=type(module).__name__,
                    reason="no register_post_lookup_tracker_fn (TorchRec < 1.8): full snapshots",
                )
                return
            features = {f: t for t, cfg in configs.items() if t in views for f in cfg.feature_names}
            hooked.append((module, features))
        tracked = {t for _, features in hooked for t in features.values()}
        if tracked != set(views):
            log.info(
                "torchrec.change_tracking_unavailable",
                untracked=sorted(set(views) - tracked),
                reason="tables outside every hooked module: full snapshots",
            )
            return
        local = {n: len(v.rows) for n, v in views.items()}
        if self._dense:
            spec = self.tables[self._dense_name]
            local[self._dense_name] = len(owned_range(spec.num_rows, self.topology.world_size, self.topology.rank))
        self._changes = ChangeTracker(local, self.device)
        if self._dense:  # the baseline the first take compares the replicated parameters with
            self._flatten_dense()
            self._dense_seen = self._dense_view().weight.clone()
        for module, features in hooked:
            module.register_post_lookup_tracker_fn(_LookupMarks(self._changes, features, module.post_lookup_tracker_fn))
        self.tracks_changes = True

    # -- the contract: state -----------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def model(self):
        """The DistributedModelParallel of this generation (a new one after a resize or reset)."""
        self._check_open("model")
        if self._dense_stale:
            raise ElasticEmbError(
                f"import_shard wrote this rank's rows of {self._dense_name!r}; the replicated parameters are whole "
                f"again only after sync_dense(), a collective every rank calls"
            )
        return self._model

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ContextClosed(f"{what} on a closed TorchRecContext; the lifecycle constructs a new one")

    # -- the contract: rows --------------------------------------------------------------------

    def shard_views(self) -> dict[str, ShardData]:
        """Each table's local shard as fbgemm's own tensors (weight and optimizer slots), and the
        ``dense`` rows as a view of a flat copy of the replicated parameters (refreshed now).

        Returns:
            Per table, a :class:`~elastic_emb.protocol.ShardData` of writable views.

        Raises:
            ContextClosed: after ``close()``.
        """
        self._check_open("shard_views")
        out = {n: ShardData(n, v.rows, v.weight, dict(v.slots)) for n, v in self._views.items()}
        if self._dense:
            if not self._dense_stale:
                self._flatten_dense()
            out[self._dense_name] = self._dense_view()
        return out

    def export_shard(self) -> dict[str, ShardData]:
        """Copies of this rank's rows and optimizer slots of every table, ``dense`` included.

        Returns:
            Per table, a :class:`~elastic_emb.protocol.ShardData` of cloned tensors.

        Raises:
            ContextClosed: after ``close()``.
        """
        self._check_open("export_shard")
        return {
            n: ShardData(n, s.rows, s.weight.detach().clone(), {k: v.detach().clone() for k, v in s.slots.items()})
            for n, s in self.shard_views().items()
        }

    def import_shard(self, shards: Mapping[str, ShardData]) -> None:
        """Local: write this rank's rows; every row then counts as changed. The replicated
        parameters need :meth:`sync_dense` after (until then :attr:`model` refuses).

        Args:
            shards: exactly this rank's rows of every table, with every optimizer slot.

        Raises:
            ContextClosed: after ``close()``.
            ValueError: when the tables, a range, a shape or the slots do not fit.
        """
        self._check_open("import_shard")
        views = self.shard_views()
        if set(shards) != set(views):
            raise ValueError(f"import_shard got tables {sorted(shards)}; this context has {sorted(views)}")
        for name, s in shards.items():
            v = views[name]
            if (
                s.rows != v.rows
                or tuple(s.weight.shape) != tuple(v.weight.shape)
                or set(s.slots) != set(v.slots)
                or any(tuple(s.slots[k].shape) != tuple(v.slots[k].shape) for k in v.slots)
            ):
                raise ValueError(
                    f"table {name!r}: shard rows [{s.rows.start}, {s.rows.stop}) shape {tuple(s.weight.shape)} slots "
                    f"{sorted(s.slots)} is not this rank's [{v.rows.start}, {v.rows.stop}) shape "
                    f"{tuple(v.weight.shape)} slots {sorted(v.slots)}"
                )
        with torch.no_grad():
            for name, s in shards.items():
                v = views[name]
                v.weight.copy_(s.weight)
                for k, t in v.slots.items():
                    t.copy_(s.slots[k])
        if self._dense:
            self._dense_stale = True
        self._mark_all()

    def mark_restored(self) -> None:
        """A restore wrote every row through :meth:`shard_views`: rebuild the replicated
        parameters from every rank's ``dense`` rows (collective); every row counts as changed.

        Raises:
            ContextClosed: after ``close()``, when there are replicated parameters.
        """
        if self._dense:
            self._dense_stale = True
            self.sync_dense()
        self._mark_all()

    # -- the contract: change tracking ---------------------------------------------------------

    def take_changes(self) -> dict:
        """The rows written since the previous take, as masks (the contract's form): rows looked
        up since then, ``dense`` rows whose bits changed, every row after an import, restore or
        reset.

        Returns:
            Per table, a bool mask of the local rows.

        Raises:
            ContextClosed: after ``close()``.
            ChangeTrackingUnsupported: when the context does not track changes.
        """
        return self._take().take()

    def take_changed_rows(self, unique: bool = True) -> dict:
        """The rows :meth:`take_changes` would mark, at a cost proportional to the rows looked
        up, not to the shard.

        Args:
            unique: as :meth:`elastic_emb.context.changes.ChangeTracker.take_rows` takes it.

        Returns:
            Per table, an int64 tensor of local row numbers (None: every row).

        Raises:
            ContextClosed: after ``close()``.
            ChangeTrackingUnsupported: when the context does not track changes.
        """
        return self._take().take_rows(unique)

    def _take(self) -> ChangeTracker:
        self._check_open("take_changes")
        if self._changes is None:
            return ContextBase.take_changes(self)  # raises ChangeTrackingUnsupported, naming the remedy
        if self._dense:
            self._mark_dense()
        return self._changes

    def _mark_dense(self) -> None:
        """Mark the ``dense`` rows whose bits differ from the previous take's."""
        if not self._dense_stale:
            self._flatten_dense()
        now = self._dense_view().weight
        bits = _BITS[now.dtype]
        differ = (now.view(bits) != self._dense_seen.view(bits)).any(1)
        n = now.shape[0]
        self._changes.mark_rows(self._dense_name, torch.where(differ, torch.arange(n, device=self.device), n))
        self._dense_seen.copy_(now)

    def _mark_all(self) -> None:
        if self._changes is not None:
            self._changes.mark_all()

    def sync_dense(self) -> None:
        """Collective: all-gather the ``dense`` rows and write them into the parameters (nothing
        to do unless an import or restore left them stale).

        Raises:
            ContextClosed: after ``close()``.
        """
        self._check_open("sync_dense")
        if not self._dense or not self._dense_stale:
            return
        rows = self.tables[self._dense_name].num_rows
        ws = self.topology.world_size
        block = -(-rows // ws)
        mine = self._dense_view().weight
        send = torch.zeros(block, DENSE_DIM, dtype=mine.dtype, device=self.device)
        send[: mine.shape[0]] = mine
        gathered = torch.empty(ws * block, DENSE_DIM, dtype=mine.dtype, device=self.device)
        with self.guard():
            work = dist.all_gather_into_tensor(gathered, send, group=self._groups.pg, async_op=True)
            work.wait(timedelta(seconds=self.timeout))
        self._dense_flat.copy_(gathered[:rows].reshape(-1))
        offset = 0
        with torch.no_grad():
            for _, p in self._dense:
                p.copy_(self._dense_flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._dense_stale = False

    def _flatten_dense(self) -> None:
        offset = 0
        with torch.no_grad():
            for _, p in self._dense:
                self._dense_flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()

    def _dense_view(self) -> ShardData:
        spec = self.tables[self._dense_name]
        rr = owned_range(spec.num_rows, self.topology.world_size, self.topology.rank)
        return ShardData(self._dense_name, rr, self._dense_flat.view(spec.num_rows, DENSE_DIM)[rr.start : rr.stop])

    # -- the contract: communicator ------------------------------------------------------------

    def reset(self, rank: int, world_size: int, *, topology: Topology, store) -> None:
        """Collective, same world size: a new process group on ``store`` and a new DMP from
        ``build``, holding the rows, optimizer state and replicated parameters as they were. When
        the ranks were renumbered, each process's rows move to the process that now has its old
        rank (point to point over the new group). Every row then counts as changed.

        Args:
            rank: this process's new rank.
            world_size: must equal the current world size.
            topology: the new topology (rank and world size as given).
            store: the store the new groups form on.

        Raises:
            ContextClosed: after ``close()``.
            WorldSizeChanged: for a different world size.
            ValueError: for a changed EP size or backend, or a topology that disagrees with
                ``rank`` and ``world_size``.
        """
        self._check_open("reset")
        if world_size != self.topology.world_size:
            raise WorldSizeChanged(self.topology.world_size, world_size)
        if (topology.ep_size, topology.backend) != (self.topology.ep_size, self.topology.backend):
            raise ValueError(
                f"reset to ep_size={topology.ep_size} backend={topology.backend} from "
                f"ep_size={self.topology.ep_size} backend={self.topology.backend}: construct a new context"
            )
        if topology.rank != rank or topology.world_size != world_size:
            raise ValueError(
                f"reset(rank={rank}, world_size={world_size}) disagrees with the topology it was given "
                f"(rank {topology.rank} of {topology.world_size})"
            )
        old_rank = self.topology.rank
        saved = self.export_shard()
        dense = self._dense_flat.clone() if self._dense else None
        self._drop_model()
        self._groups.destroy()
        self._groups.form(topology, store)
        self.topology = topology
        self._build()
        self._move_rows(saved, old_rank)
        with torch.no_grad():
            if dense is not None:
                self._dense_flat.copy_(dense)
                self._dense_stale = True
                offset = 0
                for _, p in self._dense:
                    p.copy_(dense[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                self._dense_stale = False
        self._mark_all()  # a new DMP (and perhaps other rows): the next commit holds every row
        self._healthy = True

    def _move_rows(self, saved: dict[str, ShardData], old_rank: int) -> None:
        """Fill the new DMP's tables from ``saved``, this process's rows under ``old_rank``."""
        me = self.topology.rank
        olds = [torch.zeros(1, dtype=torch.long) for _ in range(self.topology.world_size)]
        with self.guard():
            dist.all_gather(olds, torch.tensor([old_rank]), group=self._groups.pg, async_op=True).wait(
                timedelta(seconds=self.timeout)
            )
        olds = [int(t) for t in olds]
        src = olds.index(me)  # the process that held the rows of my new rank
        pairs = [(v.weight, saved[n].weight) for n, v in sorted(self._views.items())]
        pairs += [(v.slots[k], saved[n].slots[k]) for n, v in sorted(self._views.items()) for k in sorted(v.slots)]
        with torch.no_grad():
            if src == me:  # same rank as before: the rows stay
                for mine, kept in pairs:
                    mine.copy_(kept)
                return
            ops, landing = [], []
            for mine, kept in pairs:
                # Sizes are functions of the rank, so both ends skip the same empty shards.
                if kept.numel():
                    ops.append(dist.P2POp(dist.isend, kept.contiguous().to(self.device), old_rank, self._groups.pg))
                if mine.numel():
                    buf = torch.empty(mine.shape, dtype=mine.dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buf, src, self._groups.pg))
                    landing.append((mine, buf))
            with self.guard():
                for work in dist.batch_isend_irecv(ops) if ops else []:
                    work.wait(timedelta(seconds=self.timeout))
            for mine, buf in landing:
                mine.copy_(buf)

    def close(self, *, abort: bool | None = None, wait: bool = True) -> None:
        """Drop the DMP and destroy the default process group (synchronously). Idempotent.

        Args:
            abort: accepted for the contract; the release is the same either way.
            wait: accepted for the contract; the release is always synchronous.
        """
        if self._closed:
            return
        self._closed = True
        self._drop_model()
        self._groups.destroy()

    def _drop_model(self) -> None:
        self._model = None
        self._views = {}
        self._dense = []
        self._changes, self._dense_seen = None, None

    # -- collectives --------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a training step (or any collective) inside: an exception marks the context
        unhealthy, so the lifecycle does not take this rank's rows as a committed state.

        Yields:
            None; the exception, if any, is raised again.
        """
        try:
            yield
        except BaseException:
            self._healthy = False
            raise

    def barrier(self) -> None:
        """One all-reduce over the process group, bounded by the timeout.

        Raises:
            ContextClosed: after ``close()``.
            ElasticEmbError: when fewer ranks than the world took part.
        """
        self._check_open("barrier")
        t = torch.ones(1, device=self.device)
        with self.guard():
            dist.all_reduce(t, group=self._groups.pg, async_op=True).wait(timedelta(seconds=self.timeout))
            if int(t.item()) != self.topology.world_size:
                raise ElasticEmbError(f"{int(t.item())} of {self.topology.world_size} ranks took part in the barrier")


class _ProcessGroups:
    """The process groups of one generation: torch.distributed's default group, which the context
    forms (on a fresh store prefix each time) and leaves free for the lifecycle's checkpoints, and
    TorchRec's own group ``pg``, on which the model and the context's collectives run."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.pg = None
        self._world = None
        self._forms = 0  # a reset forms again on the same generation's store: a new prefix each time

    def form(self, topology: Topology, store) -> None:
        if dist.is_initialized():
            raise ElasticEmbError(
                f"torch.distributed's default process group is already initialized (rank {dist.get_rank()} of "
                f"{dist.get_world_size()}); TorchRecContext forms it for each generation itself: destroy it "
                f"first (dist.destroy_process_group()) and let the context own it"
            )
        self._forms += 1
        prefix = dist.PrefixStore(f"form{self._forms}/", generation_store(store, topology, "torchrec"))
        dist.init_process_group(
            topology.backend,
            store=prefix,
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timedelta(seconds=self.timeout),
        )
        self._world = dist.group.WORLD
        # TorchRec (and DDP) run on a group of their own: the default one stays free for the
        # lifecycle's durable checkpoints, whose asynchronous saves issue collectives from another
        # thread (two threads' collectives on one group could pair up differently on each rank).
        self.pg = dist.new_group(backend=topology.backend, timeout=timedelta(seconds=self.timeout))

    def destroy(self) -> None:
        """Destroy the default group if it is still the one formed here. Idempotent."""
        world, self._world, self.pg = self._world, None, None
        if world is not None and dist.is_initialized() and dist.group.WORLD is world:
            dist.destroy_process_group()


def _forget_collective_validation() -> None:
    """Make every rank take part in the broadcast that DistributedModelParallel's constructor does.

    TorchRec (1.8, 1.9) latches a process-wide flag (``collective_utils._INITIALIZED``) after the
    first DMP of a process broadcast its collective-validation setting from rank 0, and skips the
    broadcast for every later DMP. In an elastic world a survivor builds its second DMP next to a
    joiner building its first: the joiner waits in that broadcast and the survivor never enters
    it. Clearing the latch before each build makes the broadcast collective again on every rank."""
    from torchrec.distributed import collective_utils

    if hasattr(collective_utils, "_INITIALIZED"):
        collective_utils._INITIALIZED = False


class _LookupMarks:
    """TorchRec's post-lookup hook of one sharded module: marks the looked-up local rows of each
    table in ``changes``, then calls the hook that was registered before (a user's
    ``ModelDeltaTracker``), if any."""

    def __init__(self, changes: ChangeTracker, features: dict[str, str], previous=None) -> None:
        self.changes, self.features, self.previous = changes, features, previous

    def __call__(self, kjt, embeddings, module=None, raw_ids=None, *rest) -> None:
        # The lengths per feature: host ints TorchRec computed for its input all-to-all (cached in
        # the batch), so the split needs no host sync.
        per_table: dict[str, list[torch.Tensor]] = {}
        for key, ids in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
            table = self.features.get(key)
            if table is not None and ids.numel():
                per_table.setdefault(table, []).append(ids)
        for table, parts in per_table.items():
            # A copy of its own (cat): the tracker keeps it until the next commit takes it.
            self.changes.mark_rows(table, torch.cat(parts).to(torch.int64))
        if self.previous is not None:
            self.previous(kjt, embeddings, module, raw_ids, *rest)


class _TableViews:
    """One table's local shard: the weight and the row-wise optimizer states, fbgemm's tensors."""

    def __init__(self, num_rows: int, rows: RowRange, weight: torch.Tensor, slots: dict[str, torch.Tensor]) -> None:
        self.num_rows, self.rows, self.weight, self.slots = num_rows, rows, weight, slots


def _dtype_name(dtype: torch.dtype, table: str) -> str:
    if dtype not in _DTYPES:
        raise UnsupportedSharding(f"table {table!r} has dtype {dtype}; elastic_emb moves {sorted(_DTYPES.values())}")
    return _DTYPES[dtype]


def _local(st, table: str, what: str, num_rows: int, rows: RowRange, trailing: tuple) -> torch.Tensor:
    """The local shard of a ShardedTensor as a tensor of ``rows`` (an empty tensor when none)."""
    shards = st.local_shards()
    if not shards:
        if len(rows):
            raise UnsupportedSharding(
                f"table {table!r}: {what} has no local shard on this rank, which should hold "
                f"rows [{rows.start}, {rows.stop}) of {num_rows}"
            )
        return torch.empty(0, *trailing, dtype=st.dtype)
    if len(shards) != 1:
        raise UnsupportedSharding(
            f"table {table!r}: {what} has {len(shards)} local shards; row-wise sharding gives each rank one"
        )
    off = shards[0].metadata.shard_offsets
    t = shards[0].tensor
    got = RowRange(off[0], off[0] + t.shape[0])
    if got != rows or any(o != 0 for o in off[1:]) or tuple(t.shape[1:]) != tuple(trailing):
        raise UnsupportedSharding(
            f"table {table!r}: {what} holds rows [{got.start}, {got.stop}) offsets {list(off)} shape {tuple(t.shape)} "
            f"on this rank; even row-wise sharding gives it rows [{rows.start}, {rows.stop}) with every column: "
            f"shard it with row_wise() and no sizes_placement"
        )
    return t


def _sharded_tables(model, topology: Topology) -> tuple[dict[str, _TableViews], set[str]]:
    """Every sharded table of ``model``: its local views, and the parameter names they cover."""
    with warnings.catch_warnings():
        # TorchRec's state dict is made of ShardedTensors, which torch marks deprecated on every
        # call; the adapter reads them because that is what TorchRec hands out.
        warnings.simplefilter("ignore", FutureWarning)
        return _read_sharded_tables(model, topology)


def _read_sharded_tables(model, topology: Topology) -> tuple[dict[str, _TableViews], set[str]]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = model.state_dict()
    optim_state = model.fused_optimizer.state_dict()["state"]
    views: dict[str, _TableViews] = {}
    sharded: set[str] = set()
    for path, module_plan in model.plan.plan.items():
        for table, ps in module_plan.items():
            kind = str(ps.sharding_type)
            if kind != "row_wise":
                raise UnsupportedSharding(
                    f"table {table!r} (module {path!r}) is sharded {kind}; elastic_emb moves row-wise tables only: "
                    f"plan it with construct_module_sharding_plan(module, {{{table!r}: row_wise(compute_kernel='fused')}}, "
                    f"world_size=..., device_type=...)"
                )
            if str(ps.compute_kernel) != "fused":
                raise UnsupportedSharding(
                    f"table {table!r} (module {path!r}) uses the {ps.compute_kernel!r} kernel; elastic_emb needs "
                    f"'fused' (its optimizer state lives in fbgemm, where the adapter reads it): "
                    f"row_wise(compute_kernel='fused')"
                )
            prefix = f"{path}." if path else ""
            keys = [
                k
                for k in (f"{prefix}embedding_bags.{table}.weight", f"{prefix}embeddings.{table}.weight")
                if k in state
            ]
            if len(keys) != 1:
                raise UnsupportedSharding(
                    f"table {table!r} (module {path!r}): no weight "
                    f"{prefix}embedding_bags.{table}.weight or {prefix}embeddings.{table}.weight "
                    f"in the model's state dict"
                )
            key = keys[0]
            st = state[key]
            if not isinstance(st, ShardedTensor):
                raise UnsupportedSharding(
                    f"table {table!r}: state dict entry {key!r} is a {type(st).__name__}, not a "
                    f"ShardedTensor (build the ShardingEnv without output_dtensor)"
                )
            if table in views:
                raise UnsupportedSharding(f"table name {table!r} appears in two sharded modules; names must be unique")
            num_rows, dim = st.size(0), st.size(1)
            rows = owned_range(num_rows, topology.world_size, topology.rank)
            weight = _local(st, table, "the weight", num_rows, rows, (dim,))
            slots = {}
            for skey, sval in optim_state.get(key, {}).items():
                slot = skey[len(table) + 1 :] if skey.startswith(f"{table}.") else skey
                if not isinstance(sval, ShardedTensor) or sval.size(0) != num_rows:
                    raise UnsupportedSharding(
                        f"table {table!r}: optimizer state {skey!r} is not row-wise ({type(sval).__name__}); elastic_emb "
                        f"carries row-wise optimizer state only (SGD, row-wise Adagrad, Adam's momenta)"
                    )
                slots[slot] = _local(sval, table, f"optimizer state {skey!r}", num_rows, rows, tuple(sval.size()[1:]))
            views[table] = _TableViews(num_rows, rows, weight, slots)
            sharded.add(key)
    return views, sharded
