"""Pure planning: which rank sends which rows to which new owner, and who holds replicas.

Nothing here touches a file, a store or a process group, so every rank computes the same answer
from the same inputs. :func:`plan_assignments` turns every rank's :class:`Piece` records into
:class:`Assignment` records and the ranges nobody holds; :func:`uncovered` is the completeness
rule of planning, prune and restore; :func:`replica_holders` places replicas.

Design: ``docs/COMMIT.md`` (sections "Planning" and "Replica placement").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from elastic_emb.sharding import owned_range
from elastic_emb.state.manifest import CommitId

Tier = Literal["live", "snapshot", "replica"]
TIER_PRIORITY = {"live": 0, "snapshot": 1, "replica": 2}


class Piece(BaseModel):
    """One row range of one table that one rank can supply, from one commit.

    ``handle`` names the piece on its holder (an index into the holder's own source list);
    ``spec`` is [dtype, per-row shape] of each tensor (weight, then slots by name); ``num_rows``
    the table size the piece was cut from (None for live memory, which always matches); ``file``
    names the snapshot file it is read from, the same on every rank of its node, so a file found
    corrupt by one rank is dropped for all of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    table: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    tier: Tier
    commit: CommitId
    handle: int = Field(ge=0)
    spec: list[tuple[str, list[int]]]
    num_rows: int | None = None
    file: str | None = None  # "<node>/<commit dir>/<data file>" for pieces read from a snapshot file


@dataclass(frozen=True)
class Assignment:
    """Rows [start, stop) of ``table`` go from rank ``src`` (piece ``handle`` there) to ``dst``."""

    table: str
    start: int
    stop: int
    src: int
    dst: int
    handle: int
    tier: str


def plan_assignments(
    inventories: list[list[Piece]], commit: CommitId, num_rows: dict[str, int], owners: int, specs: dict[str, list]
) -> tuple[list[Assignment], list[tuple[str, int, int]]]:
    """Choose, for every row of every table in the ``owners`` layout, one rank that sends it.

    Preferred, in order: live memory over an own file over a replica, then the destination itself
    (no transfer), then the piece reaching furthest, then the lowest rank.

    Args:
        inventories: per rank, the pieces it can supply.
        commit: the commit to restore; pieces of other commits do not count.
        num_rows: table -> rows in the table; only these tables are planned.
        owners: the number of row owners of the new layout (``owned_range`` splits).
        specs: table -> the new context's tensor layout; pieces with another layout do not count.

    Returns:
        ``(assignments, missing)``: the rows each rank sends to each owner, and the ranges
        ``(table, start, stop)`` nobody holds (never filled with anything).
    """
    by_table: dict[str, list[tuple[int, Piece]]] = {}
    for rank, inv in enumerate(inventories):
        for p in inv:
            if p.commit != commit or p.table not in num_rows:
                continue
            if [[d, list(s)] for d, s in p.spec] != [[d, list(s)] for d, s in specs[p.table]]:
                continue  # a different dtype or slot layout cannot fill this table
            by_table.setdefault(p.table, []).append((rank, p))
    plan: list[Assignment] = []
    missing: list[tuple[str, int, int]] = []
    for table in sorted(num_rows):
        n = num_rows[table]
        cands = by_table.get(table, [])
        for dst in range(owners):
            want = owned_range(n, owners, dst)
            cur = want.start
            while cur < want.stop:
                covering = [(r, p) for r, p in cands if p.start <= cur < p.stop]
                if not covering:
                    nxt = min([p.start for _, p in cands if p.start > cur] + [want.stop])
                    if missing and missing[-1][0] == table and missing[-1][2] == cur:
                        missing[-1] = (table, missing[-1][1], nxt)
                    else:
                        missing.append((table, cur, nxt))
                    cur = nxt
                    continue
                r, p = min(covering, key=lambda rp: (TIER_PRIORITY[rp[1].tier], rp[0] != dst, -rp[1].stop, rp[0]))
                stop = min(p.stop, want.stop)
                plan.append(Assignment(table, cur, stop, r, dst, p.handle, p.tier))
                cur = stop
    return plan, missing


def uncovered(spans, num_rows: dict[str, int]) -> list[tuple[str, int, int]]:
    """The rows no span covers: the one completeness rule of planning, prune and restore.

    Args:
        spans: ``(table, start, stop)`` triples, in any order, overlapping or not.
        num_rows: table -> rows in the table; only these tables are checked.

    Returns:
        The uncovered ranges ``(table, start, stop)``, by table then start.
    """
    by_table: dict[str, list[tuple[int, int]]] = {}
    for table, a, b in spans:
        if b > a:
            by_table.setdefault(table, []).append((a, b))
    out: list[tuple[str, int, int]] = []
    for table in sorted(num_rows):
        cur = 0
        for a, b in sorted(by_table.get(table, ())):
            if a > cur:
                out.append((table, cur, a))
            cur = max(cur, b)
        if cur < num_rows[table]:
            out.append((table, cur, num_rows[table]))
    return out


def missing_rows(pieces: list[Piece], num_rows: dict[str, int]) -> list[tuple[str, int, int]]:
    """The row ranges of each table that no piece covers.

    Args:
        pieces: pieces of one commit, from any holders.
        num_rows: table -> rows in the table.

    Returns:
        The uncovered ranges ``(table, start, stop)`` (see :func:`uncovered`).
    """
    return uncovered(((p.table, p.start, p.stop) for p in pieces), num_rows)


def replica_holders(records: list[dict], rank: int, replication: int) -> list[int]:
    """The ranks that hold replicas of ``rank``'s shard.

    One rank on each of the next ``replication`` nodes (in node-rank order, wrapping), the one with
    the same local rank modulo that node's size; never more nodes than there are other nodes.

    Args:
        records: one ``{"rank", "node_rank", "local_rank"}`` mapping per rank, in rank order.
        rank: the rank whose shard is replicated.
        replication: how many other nodes hold a replica.

    Returns:
        The holders' ranks, nearest node first.
    """
    nodes: dict[int, list[dict]] = {}
    for r in records:
        nodes.setdefault(r["node_rank"], []).append(r)
    order = sorted(nodes)
    me = records[rank]
    pos = order.index(me["node_rank"])
    out = []
    for j in range(1, min(replication, len(order) - 1) + 1):
        node = sorted(nodes[order[(pos + j) % len(order)]], key=lambda r: r["local_rank"])
        out.append(node[me["local_rank"] % len(node)]["rank"])
    return out
