"""Row-wise sharding arithmetic: which rows a rank owns, and how to move from one sharding to another.

A table of ``num_rows`` rows is split over the owner ranks ``0..ep_size-1`` the way
``torch.chunk`` and DTensor's ``Shard(0)`` split a dimension: ``ceil(num_rows / ep_size)`` rows
each, in order, the last owners fewer or none; ranks ``>= ep_size`` own nothing. Pure integer
arithmetic. Main names: :class:`RowRange`, :func:`owned_range`, :func:`owner_of`,
:func:`reshard_plan`.

Design: ``docs/CORE.md`` (section "Sharding arithmetic").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class RowRange:
    """Half-open global row range ``[start, stop)``; ``len()`` is its number of rows.

    Args:
        start: the first row.
        stop: one past the last row.

    Raises:
        ValueError: if not ``0 <= start <= stop``.
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"invalid row range [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def intersect(self, other: "RowRange") -> "RowRange | None":
        """The rows this range shares with ``other``.

        Args:
            other: another range.

        Returns:
            The common rows, or None when the ranges share none.
        """
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return RowRange(lo, hi) if lo < hi else None


def _check(num_rows: int, ep_size: int) -> None:
    if num_rows < 0:
        raise ValueError(f"num_rows={num_rows} must be >= 0")
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")


def rows_per_owner(num_rows: int, ep_size: int) -> int:
    """The rows in every full shard.

    Args:
        num_rows: rows in the table.
        ep_size: number of owners.

    Returns:
        ``ceil(num_rows / ep_size)``.

    Raises:
        ValueError: if ``num_rows`` is negative or ``ep_size`` is smaller than 1.
    """
    _check(num_rows, ep_size)
    return -(-num_rows // ep_size)


def owned_range(num_rows: int, ep_size: int, rank: int) -> RowRange:
    """The rows ``rank`` owns when ``num_rows`` rows are split over ``ep_size`` owners.

    Args:
        num_rows: rows in the table.
        ep_size: number of owners.
        rank: the rank asked about; any rank ``>= 0`` (ranks ``>= ep_size`` own nothing).

    Returns:
        The half-open range of global row indices; empty (``[num_rows, num_rows)``) for ranks
        ``>= ep_size`` and for trailing owners of small tables.

    Raises:
        ValueError: if ``num_rows`` or ``rank`` is negative, or ``ep_size`` is smaller than 1.
    """
    _check(num_rows, ep_size)
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    if rank >= ep_size:
        return RowRange(num_rows, num_rows)
    per = rows_per_owner(num_rows, ep_size)
    start = min(rank * per, num_rows)
    return RowRange(start, min(start + per, num_rows))


def owner_of(row: int, num_rows: int, ep_size: int) -> int:
    """The rank that owns global ``row``.

    Args:
        row: a global row index.
        num_rows: rows in the table.
        ep_size: number of owners.

    Returns:
        The owner rank, in ``[0, ep_size)``.

    Raises:
        ValueError: if ``row`` is not in ``[0, num_rows)``, ``num_rows`` is negative or
            ``ep_size`` is smaller than 1.
    """
    _check(num_rows, ep_size)
    if not 0 <= row < num_rows:
        raise ValueError(f"row={row} is out of range for a table of {num_rows} rows")
    return row // rows_per_owner(num_rows, ep_size)


@dataclass(frozen=True)
class Transfer:
    """Rows ``rows`` move from ``src`` (old sharding) to ``dst`` (new sharding).

    Args:
        src: the rank that owns the rows in the old sharding.
        dst: the rank that owns them in the new sharding.
        rows: the global rows that move.
    """

    src: int
    dst: int
    rows: RowRange


def reshard_plan(num_rows: int, old_ep: int, new_ep: int) -> list[Transfer]:
    """Every transfer needed to go from ``old_ep`` owners to ``new_ep`` owners.

    Args:
        num_rows: rows in the table.
        old_ep: owners in the old sharding.
        new_ep: owners in the new sharding.

    Returns:
        Transfers, ordered by source then destination, that partition ``[0, num_rows)`` exactly:
        each row appears once, coming from its old owner and going to its new one (``src == dst``
        where a rank keeps rows in place).

    Raises:
        ValueError: if ``num_rows`` is negative or either owner count is smaller than 1.
    """
    _check(num_rows, old_ep)
    _check(num_rows, new_ep)
    plan: list[Transfer] = []
    for src in range(old_ep):
        have = owned_range(num_rows, old_ep, src)
        if not len(have):
            continue
        first = owner_of(have.start, num_rows, new_ep)
        last = owner_of(have.stop - 1, num_rows, new_ep)
        for dst in range(first, last + 1):
            part = have.intersect(owned_range(num_rows, new_ep, dst))
            if part is not None:
                plan.append(Transfer(src, dst, part))
    return plan
