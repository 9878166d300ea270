"""Row-wise sharding arithmetic: which rows a rank owns, and how to move from one sharding to another.

Pure integer arithmetic, no torch.distributed, so it is property-tested on its own and every
layer above (the context, the state tiers, the lifecycle) computes ownership the same way.

Layout: a table of ``num_rows`` rows is split over the ``ep_size`` owner ranks ``0..ep_size-1``
the way ``torch.chunk`` and DTensor's ``Shard(0)`` split a dimension: each owner gets
``ceil(num_rows / ep_size)`` rows in order, the last ones fewer or none. Matching DTensor means
the local shard *is* the DTensor's local tensor, so a ``state_dict()`` costs no copy and a DCP
checkpoint saved by elastic_emb loads in plain DCP. Ranks ``>= ep_size`` own nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class RowRange:
    """Half-open global row range ``[start, stop)``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"invalid row range [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def intersect(self, other: "RowRange") -> "RowRange | None":
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return RowRange(lo, hi) if lo < hi else None


def _check(num_rows: int, ep_size: int) -> None:
    if num_rows < 0:
        raise ValueError(f"num_rows={num_rows} must be >= 0")
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")


def rows_per_owner(num_rows: int, ep_size: int) -> int:
    """Rows in every full shard: ceil(num_rows / ep_size)."""
    _check(num_rows, ep_size)
    return -(-num_rows // ep_size)


def owned_range(num_rows: int, ep_size: int, rank: int) -> RowRange:
    """The rows ``rank`` owns (empty for ranks >= ep_size, and for trailing owners of small tables)."""
    _check(num_rows, ep_size)
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    if rank >= ep_size:
        return RowRange(num_rows, num_rows)
    per = rows_per_owner(num_rows, ep_size)
    start = min(rank * per, num_rows)
    return RowRange(start, min(start + per, num_rows))


def owner_of(row: int, num_rows: int, ep_size: int) -> int:
    """The rank that owns global ``row``."""
    _check(num_rows, ep_size)
    if not 0 <= row < num_rows:
        raise ValueError(f"row={row} is out of range for a table of {num_rows} rows")
    return row // rows_per_owner(num_rows, ep_size)


@dataclass(frozen=True)
class Transfer:
    """Rows ``rows`` move from ``src`` (old sharding) to ``dst`` (new sharding)."""

    src: int
    dst: int
    rows: RowRange


def reshard_plan(num_rows: int, old_ep: int, new_ep: int) -> list[Transfer]:
    """Every transfer needed to go from ``old_ep`` owners to ``new_ep`` owners.

    The transfers partition ``[0, num_rows)`` exactly: each row appears once, coming from its old
    owner and going to its new one (``src == dst`` where a rank keeps rows in place).
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
