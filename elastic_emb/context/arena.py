"""The arena: one device allocation holding a rank's rows and optimizer slots, plus staging.

- :class:`Arena`: every table's local rows and slots in one 256-byte aligned buffer, each with a
  dump row, and the staging buffer lookups lease;
- :class:`Staging` and :func:`staging_need`: typed views carved out of a leased buffer;
- :class:`Rows`: the lazy initial fill; :func:`init_rows`: seeded initial values, identical
  whatever the world size.

Design: ``docs/CONTEXT.md`` (section "The arena").
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping, Sequence

import torch

from elastic_emb.context import optim
from elastic_emb.events import get_logger
from elastic_emb.protocol import OptimizerSpec, ShardData, TableSpec
from elastic_emb.sharding import RowRange, owned_range

log = get_logger("elastic_emb.context.arena")

# init_rows draws each block of this many global rows from its own generator, so a row's
# initial value depends only on (seed, table name, row), never on who owns it.
INIT_BLOCK_ROWS = 4096
ALIGN = 256


def aligned(n: int) -> int:
    """``n`` rounded up to the arena's alignment.

    Args:
        n: a byte count.

    Returns:
        The smallest multiple of :data:`ALIGN` that is at least ``n``.
    """
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


def carve(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A typed view of ``shape`` at byte ``offset`` of the byte tensor ``buf``.

    Args:
        buf: a 1-D ``uint8`` tensor.
        offset: the view's first byte in ``buf``.
        shape: the view's shape.
        dtype: the view's element type.

    Returns:
        A view sharing ``buf``'s memory (no copy).
    """
    return buf[offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)


def init_rows(spec: TableSpec, seed: int, rows: RowRange) -> torch.Tensor:
    """Initial values of global rows ``rows`` of ``spec``: uniform in ``±1/sqrt(dim)``.

    Identical whatever the world size: every block of :data:`INIT_BLOCK_ROWS` global rows is
    drawn from a CPU generator seeded with ``(seed, crc32(table name), block)``, and a range is
    cut out of the blocks it touches.

    Args:
        spec: the table.
        seed: the context's seed.
        rows: the global rows wanted.

    Returns:
        A CPU tensor ``[len(rows), dim]`` of the table's dtype.

    Raises:
        ValueError: if ``rows`` reaches past the table's last row.
    """
    out = torch.empty(len(rows), spec.dim, dtype=spec.torch_dtype)
    if not len(rows):
        return out
    if rows.stop > spec.num_rows:
        raise ValueError(f"rows [{rows.start}, {rows.stop}) exceed table {spec.name!r} of {spec.num_rows} rows")
    bound = 1.0 / (spec.dim**0.5)
    name_hash = zlib.crc32(spec.name.encode())
    gen = torch.Generator()
    first, last = rows.start // INIT_BLOCK_ROWS, (rows.stop - 1) // INIT_BLOCK_ROWS
    for block in range(first, last + 1):
        b0 = block * INIT_BLOCK_ROWS
        b1 = min(b0 + INIT_BLOCK_ROWS, spec.num_rows)
        gen.manual_seed((seed * 1_000_003 + name_hash) * 1_000_033 + block & 0x7FFF_FFFF_FFFF_FFFF)
        vals = torch.rand(b1 - b0, spec.dim, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound)
        lo, hi = max(b0, rows.start), min(b1, rows.stop)
        out[lo - rows.start : hi - rows.start] = vals[lo - b0 : hi - b0].to(spec.torch_dtype)
    return out


class Arena:
    """One device allocation: resident rows + slots per table; staging kept beside it.

    ``weights[table]`` is ``[local rows, dim]``; ``slots[table][name]`` is ``[local rows, ...]``;
    ``padded_weights`` and ``padded_slots`` are the same tensors with the dump row at the end.

    Args:
        device: where the buffers live.
        layout: per table, ``(local rows, spec, slot shapes)`` (shapes as
            :func:`~elastic_emb.context.optim.slot_shapes` gives them).
        staging_bytes: the staging buffer's initial size.
    """

    def __init__(self, device: torch.device, layout: dict[str, tuple[int, TableSpec, dict]], staging_bytes: int):
        self.device = device
        plan: list[tuple[str, str, tuple[int, ...], torch.dtype, int]] = []
        offset = 0
        for name, (nrows, spec, slot_shapes) in layout.items():
            # One row more than the shard: the dump row, where masked updates write (see padded).
            plan.append((name, "weight", (nrows + 1, spec.dim), spec.torch_dtype, offset))
            offset += aligned((nrows + 1) * spec.bytes_per_row())
            for slot, (shape, dtype) in slot_shapes.items():
                full = (nrows + 1, *shape)
                plan.append((name, slot, full, dtype, offset))
                offset += aligned(_nbytes(full, dtype))
        self.resident_bytes = offset
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self.weights: dict[str, torch.Tensor] = {}
        self.slots: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layout}
        # The same tensors with the dump row at the end: an update that must leave some of its
        # rows alone, decided on the device, points those at the dump row instead of syncing to
        # drop them. The dump row is never read as data.
        self.padded_weights: dict[str, torch.Tensor] = {}
        self.padded_slots: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layout}
        for name, what, shape, dtype, off in plan:
            view = carve(self.buffer, off, shape, dtype)
            if what == "weight":
                self.padded_weights[name], self.weights[name] = view, view[:-1]
            else:
                self.padded_slots[name][what], self.slots[name][what] = view, view[:-1]
        self.staging = torch.empty(max(staging_bytes, 1), dtype=torch.uint8, device=device)
        self._leased = False
        self._lock = threading.Lock()

    @classmethod
    def for_rank(
        cls,
        tables: Mapping[str, TableSpec],
        optimizer: OptimizerSpec,
        ep_size: int,
        rank: int,
        world_size: int,
        staging_rows_per_rank: int,
        device: torch.device,
    ) -> "Arena":
        """The arena of ``rank``: its owned rows of every table, slots for ``optimizer``
        (initialised), and staging for ``staging_rows_per_rank`` rows per peer each way.

        Args:
            tables: every table, by name.
            optimizer: decides the slots.
            ep_size: the number of owner ranks.
            rank: the rank the arena is for.
            world_size: the number of ranks (sizes the staging).
            staging_rows_per_rank: staging rows per peer, each direction.
            device: where the arena lives.

        Returns:
            The new arena (rows not filled: see :class:`Rows`).
        """
        layout = {}
        for name, spec in tables.items():
            nrows = len(owned_range(spec.num_rows, ep_size, rank))
            layout[name] = (nrows, spec, optim.slot_shapes(optimizer, spec.dim))
        widest = max(s.bytes_per_row() for s in tables.values())
        cap = staging_rows_per_rank * world_size
        arena = cls(device, layout, 2 * aligned(cap * (widest + 8)))  # each direction: rows + int64 ids
        for name in tables:
            optim.init_slots(optimizer, arena.padded_slots[name])
        return arena

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() + self.staging.numel()

    def lease(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A byte buffer of at least ``nbytes``: the staging if free (grown if too small), else
        a fresh allocation.

        Args:
            nbytes: bytes needed.

        Returns:
            ``(buffer, leased)``; a leased buffer (the staging) goes back with :meth:`release`.
        """
        with self._lock:
            if self._leased:
                return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device), False
            if self.staging.numel() < nbytes:
                grown = max(nbytes, 2 * self.staging.numel())
                log.info("arena.staging_grown", old_bytes=self.staging.numel(), new_bytes=grown)
                self.staging = torch.empty(grown, dtype=torch.uint8, device=self.device)
            self._leased = True
            return self.staging, True

    def release(self) -> None:
        """Give the staging back after a :meth:`lease` that returned it."""
        with self._lock:
            self._leased = False

    def report(self, owned: Mapping[str, RowRange]) -> dict:
        """Sizes of the parts, and each table's local rows and global range.

        Args:
            owned: each table's global row range on this rank.

        Returns:
            A JSON-ready dict: ``resident_bytes``, ``staging_bytes``, ``total_bytes`` and
            ``tables`` (per table ``local_rows`` and ``rows``).
        """
        return {
            "resident_bytes": self.resident_bytes,
            "staging_bytes": self.staging.numel(),
            "total_bytes": self.nbytes,
            "tables": {
                n: {"local_rows": w.shape[0], "rows": [owned[n].start, owned[n].stop]} for n, w in self.weights.items()
            },
        }

    def check_import(
        self, shards: Mapping[str, ShardData], owned: Mapping[str, RowRange], rank: int, optimizer: OptimizerSpec
    ) -> None:
        """Check that ``shards`` is exactly this arena's tables, ranges and shapes.

        Args:
            shards: the shards to import, by table.
            owned: each table's global row range on this rank.
            rank: this rank (for the message).
            optimizer: the context's optimizer (for the message).

        Raises:
            ValueError: naming the table, range, slot or shape that does not fit.
        """
        missing = sorted(set(self.weights) - set(shards))
        extra = sorted(set(shards) - set(self.weights))
        if missing or extra:
            raise ValueError(
                f"import_shard: tables missing {missing}, unknown {extra}; expected {sorted(self.weights)}"
            )
        for name, shard in shards.items():
            want = owned[name]
            if shard.rows != want:
                raise ValueError(
                    f"import_shard: table {name!r} shard covers rows [{shard.rows.start}, {shard.rows.stop}) but "
                    f"rank {rank} owns [{want.start}, {want.stop}); reshard first "
                    f"(elastic_emb.sharding.reshard_plan)"
                )
            if tuple(shard.weight.shape) != tuple(self.weights[name].shape):
                raise ValueError(
                    f"import_shard: table {name!r} weight shape {tuple(shard.weight.shape)} != "
                    f"{tuple(self.weights[name].shape)}"
                )
            slot_names = set(self.slots[name])
            if set(shard.slots) != slot_names:
                raise ValueError(
                    f"import_shard: table {name!r} slots {sorted(shard.slots)} != {sorted(slot_names)} "
                    f"(optimizer {optimizer.kind!r})"
                )
            for slot, t in shard.slots.items():
                if tuple(t.shape) != tuple(self.slots[name][slot].shape):
                    raise ValueError(
                        f"import_shard: table {name!r} slot {slot!r} shape {tuple(t.shape)} != "
                        f"{tuple(self.slots[name][slot].shape)}"
                    )

    def write(self, shards: Mapping[str, ShardData]) -> None:
        """Copy checked ``shards`` (:meth:`check_import`) into the arena.

        Args:
            shards: the shards, by table.
        """
        for name, shard in shards.items():
            self.weights[name].copy_(shard.weight)
            for slot, t in shard.slots.items():
                self.slots[name][slot].copy_(t)


class Staging:
    """Carves consecutive typed views out of a leased byte buffer.

    Args:
        buf: the leased ``uint8`` buffer.
    """

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.offset = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next aligned view of the buffer.

        Args:
            shape: the view's shape.
            dtype: the view's element type.

        Returns:
            A view of ``shape`` right after the previous one.
        """
        view = carve(self.buf, self.offset, shape, dtype)
        self.offset += aligned(view.numel() * view.element_size())
        return view


def staging_need(parts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes a :class:`Staging` needs to :meth:`~Staging.take` each ``(shape, dtype)`` of ``parts``.

    Args:
        parts: the views to be taken, in order.

    Returns:
        Their sizes in bytes, each aligned, summed.
    """
    return sum(aligned(_nbytes(shape, dtype)) for shape, dtype in parts)


class Rows:
    """Lazy initial fill of the arena's rows: a table's rows are seeded (:func:`init_rows`), or
    zeroed when ``seed`` is None, at the first use that reads them; a write of every row
    (an import or a restore) makes the fill unnecessary.

    Args:
        tables: every table, by name.
        seed: the initial rows' seed; None: zeros.
    """

    def __init__(self, tables: Mapping[str, TableSpec], seed: int | None):
        self.tables = tables
        self.seed = seed
        self.uninitialised: set[str] = set(tables)

    def materialise(self, arena: Arena, owned: Mapping[str, RowRange]) -> None:
        """Fill the rows of every table not yet initialised.

        Args:
            arena: the arena to fill.
            owned: each table's global row range on this rank.
        """
        for name in sorted(self.uninitialised):
            if self.seed is None:
                arena.weights[name].zero_()
            else:
                arena.weights[name].copy_(init_rows(self.tables[name], self.seed, owned[name]))
        self.uninitialised.clear()

    def written(self) -> None:
        """Every row of every table was written: the fill is no longer needed."""
        self.uninitialised.clear()
