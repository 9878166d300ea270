"""The small interface between the lifecycle manager and any sharded embedding context.

The lifecycle manager never looks inside a context: it constructs one for an agreed topology,
resets it for a same-size re-form, exports its local shard before a resize, imports a shard after
one, and closes it. The built-in :class:`elastic_emb.context.EmbContext` implements this; so can a
C++/CUDA extension with its own ``reset`` (wrap it in a class with these five methods).

A shard crosses the boundary as :class:`ShardData`: for one table, a global row range, the rows'
weights and each optimizer slot (tensors whose first dimension is the number of rows), all on the
CPU or the context's device. Row-wise tensors only: that is what makes resharding a matter of
moving row ranges (see :mod:`elastic_emb.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from elastic_emb.sharding import RowRange
from elastic_emb.topology import Topology

DTYPES = ("float32", "float16", "bfloat16", "float64")


class TableSpec(BaseModel):
    """One embedding table: its name, shape and element type."""

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
        return self.dim * {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]


class OptimizerSpec(BaseModel):
    """The sparse optimizer applied to looked-up rows.

    ``sgd``: ``w -= lr * g``. ``adagrad`` (row-wise): one accumulator per row,
    ``acc += mean(g * g)``; ``w -= lr * g / (sqrt(acc) + eps)``. Gradients of duplicate ids are
    summed before the update.
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
        """Names of the row-wise optimizer tensors a shard carries besides the weights."""
        return ("accumulator",) if self.kind == "adagrad" else ()


@dataclass
class ShardData:
    """One table's local shard: rows ``rows`` of the global table, with optimizer slots."""

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
        return sum(t.numel() * t.element_size() for t in (self.weight, *self.slots.values()))


@runtime_checkable
class ShardedContext(Protocol):
    """What the lifecycle manager needs of a context. See the module docstring."""

    topology: Topology

    def reset(self, rank: int, world_size: int) -> None:
        """Re-form the communicator for the same world size (rank mapping may change)."""

    def close(self) -> None:
        """Release communicator and memory. Idempotent."""

    def export_shard(self) -> dict[str, ShardData]:
        """This rank's rows of every table (empty ranges on ranks that own none)."""

    def import_shard(self, shards: dict[str, ShardData]) -> None:
        """Overwrite this rank's rows with ``shards`` (exactly this rank's owned ranges)."""


class ContextFactory(Protocol):
    """Constructs a context for an agreed topology (``EmbContext`` itself is one)."""

    def __call__(self, topology: Topology, store) -> ShardedContext: ...
