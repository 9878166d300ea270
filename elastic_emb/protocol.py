"""The small interface between the lifecycle manager and any sharded embedding context.

:class:`ShardedContext` declares every member the lifecycle and the state tiers touch (they probe
for nothing else); :class:`ContextBase` supplies the optional ones; :func:`check_context` names
what a class lacks. A shard crosses the boundary as :class:`ShardData` (one table's rows, weights
and optimizer slots, row-wise). Tables and the optimizer are described by :class:`TableSpec` and
:class:`OptimizerSpec`.

Design: ``docs/CORE.md`` (section "The context contract"); member table: ``docs/CONTRACTS.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from elastic_emb.errors import ChangeTrackingUnsupported, ContractViolation
from elastic_emb.sharding import RowRange
from elastic_emb.topology import Topology

DTYPES = ("float32", "float16", "bfloat16", "float64")


class TableSpec(BaseModel):
    """One embedding table: its name, shape and element type (frozen, validated).

    Args:
        name: a Python identifier.
        num_rows: rows in the table (at least 1).
        dim: the embedding dimension (at least 1).
        dtype: ``float32`` (default), ``float16``, ``bfloat16`` or ``float64``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    num_rows: int = Field(ge=1)
    dim: int = Field(ge=1)
    dtype: Literal["float32", "float16", "bfloat16", "float64"] = "float32"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def bytes_per_row(self) -> int:
        """The size of one row's weights.

        Returns:
            ``dim`` times the size of ``dtype``, in bytes.
        """
        return self.dim * {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]


class OptimizerSpec(BaseModel):
    """The sparse optimizer applied to looked-up rows.

    ``sgd``: ``w -= lr * g``. ``adagrad`` (row-wise): one accumulator per row,
    ``acc += mean(g * g)``; ``w -= lr * g / (sqrt(acc) + eps)``. Gradients of duplicate ids are
    summed before the update.

    Args:
        kind: ``sgd`` (default) or ``adagrad``.
        lr: the learning rate (positive, finite).
        eps: adagrad's epsilon (positive).
        initial_accumulator: adagrad's starting accumulator value (non-negative).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["sgd", "adagrad"] = "sgd"
    lr: float = Field(default=0.01, gt=0)
    eps: float = Field(default=1e-10, gt=0)
    initial_accumulator: float = Field(default=0.0, ge=0)

    @field_validator("lr")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or v in (float("inf"),):
            raise ValueError(f"lr={v!r} must be finite")
        return v

    def slot_names(self) -> tuple[str, ...]:
        """The row-wise optimizer tensors a shard carries besides the weights.

        Returns:
            ``("accumulator",)`` for adagrad, ``()`` for sgd.
        """
        return ("accumulator",) if self.kind == "adagrad" else ()


@dataclass
class ShardData:
    """One table's local shard: rows ``rows`` of the global table, with optimizer slots.

    Args:
        table: the table's name.
        rows: the global rows held.
        weight: a tensor of shape ``(len(rows), dim)``.
        slots: optimizer slot name to a tensor whose first dimension is ``len(rows)``.

    Raises:
        ValueError: if ``weight`` or a slot does not have ``len(rows)`` rows.
    """

    table: str
    rows: RowRange
    weight: "object"  # torch.Tensor [len(rows), dim]
    slots: dict[str, "object"] = field(default_factory=dict)  # name -> torch.Tensor [len(rows), ...]

    def __post_init__(self) -> None:
        n = len(self.rows)
        if self.weight.shape[0] != n:
            raise ValueError(
                f"table {self.table!r}: weight has {self.weight.shape[0]} rows for range "
                f"[{self.rows.start}, {self.rows.stop}) of {n} rows"
            )
        for name, t in self.slots.items():
            if t.shape[0] != n:
                raise ValueError(f"table {self.table!r}: slot {name!r} has {t.shape[0]} rows, expected {n}")

    def nbytes(self) -> int:
        """The size of the shard's tensors.

        Returns:
            Bytes of ``weight`` and every slot together.
        """
        return sum(t.numel() * t.element_size() for t in (self.weight, *self.slots.values()))


@runtime_checkable
class ShardedContext(Protocol):
    """Everything the lifecycle and the state tiers use of a context; nothing else is probed.

    Required (a context must define each): ``topology``, ``tables``, ``healthy``, ``closed``,
    ``reset``, ``close``, ``export_shard``, ``import_shard``. Optional abilities
    (``process_group``, ``shard_views``, ``mark_restored``, ``tracks_changes``, ``take_changes``,
    ``owner_ranks``) have defaults in :class:`ContextBase`: inherit it and define only what you offer.
    :func:`check_context` says what a class lacks; :mod:`elastic_emb.testing.conformance` checks
    the behaviour below with real processes.
    """

    topology: Topology
    """The agreed topology this context is built for; after ``reset``, the one it was given."""

    tables: Mapping[str, TableSpec]
    """Every table by name (the lifecycle reads each table's ``num_rows`` from it)."""

    process_group: object | None
    """A c10d ProcessGroup over this topology's ranks that the state tiers may use for row
    transfer, or None (they then form a gloo group of their own per generation)."""

    tracks_changes: bool
    """True when :meth:`take_changes` works (incremental snapshots); False: full snapshots."""

    owner_ranks: int | None
    """How many ranks own rows: ranks ``0..owner_ranks-1`` hold every table in the layout of
    :func:`elastic_emb.sharding.owned_range` over ``owner_ranks`` owners, the others none. None
    means ``topology.ep_size`` (the library's layout); a context whose framework decides the
    layout says so here (TorchRec's row-wise sharding spreads rows over every rank of the world).
    Read it through :func:`row_owners`."""

    @property
    def healthy(self) -> bool:
        """False once a collective failed or timed out (its rows may hold part of a step; the
        lifecycle then restores from committed tiers instead of exporting them), and once closed."""

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""

    def reset(self, rank: int, world_size: int, *, topology: Topology, store) -> None:
        """Collective: re-form the communicator for the same world size, keeping every row.

        The rank mapping may change; the context adopts ``topology``.

        Args:
            rank: this process's rank in the re-formed world.
            world_size: the world size; must be the one the context was built for.
            topology: the agreed topology of the new generation.
            store: the store the new communicator forms on.

        Raises:
            WorldSizeChanged: before any communication, if ``world_size`` differs from the one
                the context was built for (that needs a new context).
            ValueError: if ``topology`` changes ``ep_size`` or ``backend`` (that needs a new
                context).
        """

    def close(self, *, abort: bool | None = None, wait: bool = True) -> None:
        """Release the communicator and memory. Idempotent; every later use raises
        :class:`~elastic_emb.errors.ContextClosed`.

        Args:
            abort: True forces an abort of the communicator (peers are gone), False forbids it,
                None aborts only when the context is unhealthy.
            wait: False permits releasing the communicator in the background while the next
                context forms; a context may always release synchronously.
        """

    def export_shard(self) -> dict[str, ShardData]:
        """Copies of this rank's rows of every table.

        Returns:
            Table name to :class:`ShardData` holding exactly the owned range
            (``owned_range(num_rows, row_owners(context), rank)``; empty on ranks that own none),
            weights of shape ``(rows, dim)`` in the table's dtype, and every optimizer slot.
        """

    def import_shard(self, shards: Mapping[str, ShardData]) -> None:
        """Overwrite this rank's rows (local, no communication).

        Args:
            shards: table name to :class:`ShardData`, for every table, holding exactly the owned
                ranges in the shapes :meth:`export_shard` gives.

        Raises:
            ValueError: if ``shards`` is anything else (a table missing or extra, another range,
                another shape).
        """

    def shard_views(self) -> dict[str, ShardData] | None:
        """Optional: the context's own writable tensors, so that a restore writes rows in place.

        Returns:
            Table name to :class:`ShardData` in :meth:`export_shard`'s shape, or None when the
            context has no such views.
        """

    def mark_restored(self) -> None:
        """Optional: a restore wrote every row through :meth:`shard_views` (a context that
        initialises rows lazily skips that now)."""

    def take_changes(self) -> dict:
        """Optional (when :attr:`tracks_changes`): the rows written since the previous call.

        A write is one by training, by ``import_shard`` (every row) or by a restore through
        ``shard_views`` (``mark_restored``: every row), to rows and their optimizer slots alike;
        the lazy initial fill from the seed is not a write. The context swaps in a fresh zero
        mask, so the caller owns the returned one, and nothing waits for the device.

        Returns:
            Table name to a bool mask of shape ``(local rows,)`` on the context's device.

        Raises:
            ChangeTrackingUnsupported: if the context does not track changes.
        """


class ContextBase:
    """Defaults for the optional abilities of :class:`ShardedContext`. Inherit it, define the
    required members, and override what your context offers."""

    process_group: object | None = None
    tracks_changes: bool = False
    owner_ranks: int | None = None

    def shard_views(self) -> dict[str, ShardData] | None:
        """No views by default: a restore imports rows through ``import_shard``.

        Returns:
            None.
        """
        return None

    def mark_restored(self) -> None:
        """Nothing to do by default."""
        return None

    def take_changes(self) -> dict:
        """No change tracking by default: commits take full snapshots.

        Raises:
            ChangeTrackingUnsupported: always.
        """
        raise ChangeTrackingUnsupported(
            f"{type(self).__name__} does not track changed rows (tracks_changes is False): "
            f"take full snapshots, or implement take_changes and set tracks_changes = True"
        )


REQUIRED = ("topology", "tables", "healthy", "closed", "reset", "close", "export_shard", "import_shard")
OPTIONAL = ("process_group", "shard_views", "mark_restored", "tracks_changes", "take_changes", "owner_ranks")


def row_owners(context: ShardedContext) -> int:
    """The number of ranks over which ``context`` lays out its rows.

    Args:
        context: a context.

    Returns:
        ``context.owner_ranks``, or the topology's ``ep_size`` when that is None.

    Raises:
        ContractViolation: if ``owner_ranks`` is not between 1 and the world size.
    """
    owners = context.owner_ranks
    if owners is None:
        return context.topology.ep_size
    if not 1 <= owners <= context.topology.world_size:
        raise ContractViolation(
            f"{type(context).__name__}.owner_ranks={owners!r} must be between 1 and the world "
            f"size {context.topology.world_size}"
        )
    return owners


def missing_abilities(context: object) -> list[str]:
    """The members of :class:`ShardedContext` that ``context`` lacks.

    Args:
        context: any object.

    Returns:
        The names of the missing members, required ones first; empty when it has them all.
    """
    return [name for name in (*REQUIRED, *OPTIONAL) if not hasattr(context, name)]


def check_context(context: object) -> ShardedContext:
    """Check that ``context`` has every member of :class:`ShardedContext`.

    Args:
        context: the object a context factory returned.

    Returns:
        ``context`` itself.

    Raises:
        ContractViolation: naming every member it lacks.
    """
    missing = missing_abilities(context)
    if missing:
        optional = [m for m in missing if m in OPTIONAL]
        hint = " (inherit elastic_emb.protocol.ContextBase for the optional ones)" if optional else ""
        raise ContractViolation(
            f"{type(context).__name__} is not a ShardedContext: it lacks {', '.join(missing)}{hint}; "
            f"see elastic_emb.protocol.ShardedContext"
        )
    return context  # type: ignore[return-value]


class ContextFactory(Protocol):
    """Constructs a context for an agreed topology (``EmbContext`` itself is one)."""

    def __call__(self, topology: Topology, store) -> ShardedContext: ...
