"""How row blocks move between the ranks of one world: one interface, three transports.

Every rank builds the same list of :class:`Move` records and fills in only its own side; a
:class:`Transport` (collective) moves the blocks: :class:`AllToAllTransport` (any device, the only
one for NCCL), :class:`P2PTransport` (gloo sends and receives, CPU) and :class:`CmaTransport`
(same-host pulls by cross-memory attach, CPU). :func:`transport_for` picks the configured one;
:func:`execute_plan` runs a reshard plan through it and :func:`move_rows` plans and runs one.

Design: ``docs/COMMIT.md`` (section "Transports").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elastic_emb.errors import RestoreError
from elastic_emb.protocol import ShardData
from elastic_emb.state.comm import Comm
from elastic_emb.state.manifest import CommitId, row_bytes, row_spec, specs_of, tensor_items
from elastic_emb.state.plan import Assignment, Piece, plan_assignments


@dataclass(frozen=True)
class Move:
    """One block from rank ``src`` to rank ``dst``. ``tensors``: this rank's side of it (the source
    rows when it is ``src``, the destination rows when it is ``dst``), None when it is neither."""

    src: int
    dst: int
    tensors: Sequence[torch.Tensor] | None = None


@dataclass(frozen=True)
class Moved:
    """What a transfer did on this rank: bytes sent, and the transport that moved them
    (``cma+p2p``/``p2p`` when some or all pairs fell back from cross-memory attach)."""

    bytes_sent: int
    transport: str


class Transport(ABC):
    """Moves the blocks of a shared move list between the ranks of a communicator (collective).

    Every rank calls :meth:`move` with the same list, even with nothing to move; a move's index in
    the list is its key on both sides.
    """

    name: str

    @abstractmethod
    def move(self, comm: Comm, moves: list[Move], *, progress=None) -> Moved:
        """Move every block with ``src != dst``; blocks with ``src == dst`` are the caller's.

        Args:
            comm: the communicator of the world.
            moves: the shared move list, with this rank's tensors filled in.
            progress: a :class:`~elastic_emb.progress.Progress` advanced by the bytes this rank
                receives, or None.

        Returns:
            What this rank sent, and how.
        """


def _mine(comm: Comm, moves: list[Move]) -> tuple[list[tuple[int, Move]], list[tuple[int, Move]]]:
    """This rank's (key, move) pairs it sends and receives, each in key order."""
    out = [(k, m) for k, m in enumerate(moves) if m.src == comm.rank and m.dst != comm.rank]
    inc = [(k, m) for k, m in enumerate(moves) if m.dst == comm.rank and m.src != comm.rank]
    for k, m in out + inc:
        if m.tensors is None:
            raise ValueError(f"move {k} ({m.src} -> {m.dst}) lacks this rank's tensors")
    return out, inc


def _nbytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class AllToAllTransport(Transport):
    """One ``alltoall_base`` of a packed byte buffer (any device)."""

    name = "alltoall"

    def move(self, comm: Comm, moves: list[Move], *, progress=None) -> Moved:
        """Pack this rank's outgoing blocks, run one all-to-all, and unpack what arrived.

        A rank that sends (or receives) a single block of a single contiguous tensor on the
        communicator's device sends from it (receives into it) in place.

        Args:
            comm: the communicator of the world.
            moves: the shared move list, with this rank's tensors filled in.
            progress: advanced by the bytes received, once the all-to-all is done; or None.

        Returns:
            The bytes this rank sent, and ``"alltoall"``.

        Raises:
            ValueError: if a move of this rank lacks its tensors.
        """
        outgoing, incoming = _mine(comm, moves)
        outgoing.sort(key=lambda km: (km[1].dst, km[0]))
        incoming.sort(key=lambda km: (km[1].src, km[0]))
        in_splits = [0] * comm.size
        recv_sizes = [0] * comm.size
        for _, m in outgoing:
            in_splits[m.dst] += _nbytes(m.tensors)
        for _, m in incoming:
            recv_sizes[m.src] += _nbytes(m.tensors)
        # Zero copy where this rank sends (or receives) a single block of a single tensor: the
        # collective then reads (writes) the rows in place. That is the shape of most transfers
        # of a table without optimizer slots between few ranks.
        inp = out = None
        if len(outgoing) == 1 and len(outgoing[0][1].tensors) == 1:
            t = outgoing[0][1].tensors[0]
            if t.is_contiguous() and t.device == comm.device:
                inp = _flat(t)
        if len(incoming) == 1 and len(incoming[0][1].tensors) == 1:
            t = incoming[0][1].tensors[0]
            if t.is_contiguous() and t.device == comm.device:
                out = _flat(t)
        if inp is None:
            inp = torch.empty(sum(in_splits), dtype=torch.uint8, device=comm.device)
            off = 0
            for _, m in outgoing:
                for t in m.tensors:
                    b = _flat(t.contiguous())
                    inp[off : off + b.numel()].copy_(b)
                    off += b.numel()
        got = comm.all_to_all_flat(inp, in_splits, recv_sizes, out=out)
        if out is None:
            offsets = [0] * comm.size
            for _, m in incoming:
                buf = got[m.src]
                for t in m.tensors:
                    n = t.numel() * t.element_size()
                    seg = buf[offsets[m.src] : offsets[m.src] + n]
                    offsets[m.src] += n
                    if t.is_contiguous():
                        _flat(t).copy_(seg)
                    else:
                        tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                        _flat(tmp).copy_(seg)
                        t.copy_(tmp)
        if progress is not None:
            progress.advance(sum(recv_sizes))
        return Moved(int(inp.numel()), self.name)


class P2PTransport(Transport):
    """Gloo send/recv of every block at once, no staging copy (CPU)."""

    name = "p2p"

    def move(self, comm: Comm, moves: list[Move], only: set[tuple[int, int]] | None = None, *, progress=None) -> Moved:
        """Post every send and receive of this rank at once, then wait for all of them.

        Args:
            comm: the communicator of the world (gloo, CPU).
            moves: the shared move list, with this rank's tensors filled in.
            only: move just the blocks of these ``(src, dst)`` pairs (the cma transport's fallback);
                None: every block.
            progress: advanced by the bytes received, once every transfer is done; or None.

        Returns:
            The bytes this rank sent, and ``"p2p"``.

        Raises:
            ValueError: if a move of this rank lacks its tensors.
            TransferInterrupted: if the communicator was aborted (a peer known gone).
            RuntimeError: if a transfer failed or did not complete within the timeout.
        """
        outgoing, incoming = _mine(comm, moves)
        comm.check("point-to-point row transfer")  # aborted: post nothing that could only be abandoned
        works, sent, received = [], 0, 0
        post: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, contiguous buffer received into)
        for k, m in sorted(outgoing + incoming):
            if only is not None and (m.src, m.dst) not in only:
                continue
            for j, t in enumerate(m.tensors):
                if m.src == comm.rank:
                    t = t.contiguous()
                    works.append(comm.pg.send([t], m.dst, k * 64 + j))
                    sent += t.numel() * t.element_size()
                else:
                    if not t.is_contiguous():  # gloo receives into contiguous memory only
                        post.append((t, torch.empty(t.shape, dtype=t.dtype)))
                        t = post[-1][1]
                    works.append(comm.pg.recv([t], m.src, k * 64 + j))
                    received += t.numel() * t.element_size()
        # bounded by the timeout; Comm.abort (a peer known gone) ends it at once (work_wait.py)
        comm.wait_works(works, f"point-to-point row transfer ({len(works)} sends and receives)")
        for dst, buf in post:
            dst.copy_(buf)
        if progress is not None:
            progress.advance(received)
        return Moved(sent, self.name)


class CmaTransport(Transport):
    """Same-host pulls by cross-memory attach, p2p for the pairs that cannot (CPU)."""

    name = "cma"

    def move(self, comm: Comm, moves: list[Move], *, progress=None) -> Moved:
        """Pull same-host blocks by cross-memory attach, then move the rest over gloo p2p.

        Args:
            comm: the communicator of the world (CPU).
            moves: the shared move list, with this rank's tensors filled in.
            progress: advanced by the bytes received, as each piece of a pull lands; or None.

        Returns:
            The bytes this rank sent, and ``"cma"``, ``"cma+p2p"`` (some pairs fell back) or
            ``"p2p"`` (all did).
        """
        from elastic_emb.state import cma

        if all(m.src == m.dst for m in moves):
            return Moved(0, self.name)  # every rank knows: all skip the offer and barrier exchanges
        outgoing, incoming = _mine(comm, moves)
        sent = sum(_nbytes(m.tensors) for _, m in outgoing)
        fallback = cma.transfer(
            comm,
            {k: (m.dst, list(m.tensors)) for k, m in outgoing},
            {k: (m.src, list(m.tensors)) for k, m in incoming},
            progress=progress,
        )
        if not fallback:
            return Moved(sent, self.name)
        P2PTransport().move(comm, moves, progress=progress, only=fallback)
        pairs = {(m.src, m.dst) for m in moves if m.src != m.dst}
        return Moved(sent, "p2p" if pairs <= fallback else "cma+p2p")


_BY_NAME = {"alltoall": AllToAllTransport, "p2p": P2PTransport, "cma": CmaTransport}


def transport_for(comm: Comm) -> Transport:
    """The transport a communicator was configured with.

    Args:
        comm: the communicator; its ``transport`` names the transport (``ELASTIC_EMB_TRANSPORT``).

    Returns:
        A new transport of that kind.
    """
    return _BY_NAME[comm.transport]()


# ---------------------------------------------------------------------------------------------
# Executing a reshard plan
# ---------------------------------------------------------------------------------------------


def _fill(shard: ShardData, a: Assignment, src: dict[str, torch.Tensor], src_start: int) -> int:
    """Copy an assignment's rows that stay on this rank; the bytes copied."""
    lo = a.start - shard.rows.start
    slo, shi = a.start - src_start, a.stop - src_start
    copied = 0
    for tname, t in tensor_items(shard):
        dst = t[lo : lo + (a.stop - a.start)]
        dst.copy_(src[tname][slo:shi])
        copied += dst.numel() * dst.element_size()
    return copied


def execute_plan(
    comm: Comm,
    plan: list[Assignment],
    handles: dict[int, dict[str, torch.Tensor]],
    starts: dict[int, int],
    template: dict[str, ShardData],
    done: set[int] | None = None,
    *,
    progress=None,
) -> Moved:
    """Move the rows of a reshard plan by the communicator's transport (collective).

    Rows that stay on this rank are copied directly, never through the transport.

    Args:
        comm: the communicator of the world.
        plan: every rank's assignments (the same list on every rank).
        handles: piece handle -> this rank's source tensors of that piece, by tensor name.
        starts: piece handle -> the piece's first row.
        template: table -> this rank's new shard, filled in place.
        done: indices (in ``plan``) of this rank's local assignments already copied.
        progress: a :class:`~elastic_emb.progress.Progress` advanced by the bytes this rank's new
            shard receives here (local copies and transfers), or None.

    Returns:
        What this rank sent, and how.
    """
    me = comm.rank
    done_ids = {id(plan[i]) for i in done or ()}
    order = sorted(plan, key=lambda a: (a.dst, a.src, a.table, a.start))
    moves: list[Move] = []
    for a in order:
        if a.src == me and a.dst == me:
            # Rows staying on this rank: copy directly, never through the transport.
            if id(a) not in done_ids:
                copied = _fill(template[a.table], a, handles[a.handle], starts[a.handle])
                if progress is not None:
                    progress.advance(copied)
            moves.append(Move(a.src, a.dst))
        elif a.src == me:
            lo, hi = a.start - starts[a.handle], a.stop - starts[a.handle]
            names = [tname for tname, _ in tensor_items(template[a.table])]
            moves.append(Move(a.src, a.dst, [handles[a.handle][tname][lo:hi] for tname in names]))
        elif a.dst == me:
            shard = template[a.table]
            lo = a.start - shard.rows.start
            moves.append(Move(a.src, a.dst, [t[lo : lo + (a.stop - a.start)] for _, t in tensor_items(shard)]))
        else:
            moves.append(Move(a.src, a.dst))
    return transport_for(comm).move(comm, moves, progress=progress)


@dataclass
class LivePiece:
    """Rows this process holds in memory (an old context's export)."""

    table: str
    shard: ShardData


LIVE = CommitId(0, 0, "live")  # the commit tag of pieces that are simply "the rows held now"


def move_rows(
    comm: Comm,
    pieces: list[LivePiece],
    template: dict[str, ShardData],
    num_rows: dict[str, int],
    owners: int,
    *,
    progress=None,
) -> dict[str, ShardData]:
    """Deliver to each rank its rows in a layout of ``owners`` owners, from rows held in memory.

    Collective: every rank's pieces are exchanged and planned alike, then moved.

    Args:
        comm: the communicator of the world.
        pieces: the row ranges this rank holds (together, every rank's cover every row once or more).
        template: table -> this rank's shard in the new layout, filled in place.
        num_rows: table -> rows in the table.
        owners: the number of row owners of the new layout.
        progress: advanced by the bytes ``template`` receives (:func:`execute_plan`), or None.

    Returns:
        ``template``, filled.

    Raises:
        RestoreError: if some rows are held by no rank.
    """
    inv = [
        Piece(
            table=p.table,
            start=p.shard.rows.start,
            stop=p.shard.rows.stop,
            tier="live",
            commit=LIVE,
            handle=i,
            spec=[row_spec(t) for _, t in tensor_items(p.shard)],
        )
        for i, p in enumerate(pieces)
        if len(p.shard.rows)
    ]
    everyone = [
        [Piece.model_validate(x) for x in e]
        for e in comm.exchange("move-inv", [p.model_dump(mode="json") for p in inv])
    ]
    plan, missing = plan_assignments(everyone, LIVE, num_rows, owners, specs_of(template))
    if missing:
        raise RestoreError(f"row ranges held by no rank: {missing}", missing)
    handles = {i: dict(tensor_items(p.shard)) for i, p in enumerate(pieces)}
    starts = {i: p.shard.rows.start for i, p in enumerate(pieces)}
    execute_plan(comm, plan, handles, starts, template, progress=progress)
    return template


def row_bytes_of(template: dict[str, ShardData]) -> dict[str, int]:
    """Bytes of one row (weight plus slots) per table.

    Args:
        template: table -> a shard with the table's tensors.

    Returns:
        Table -> bytes per row.
    """
    return {name: sum(row_bytes(s) for s in spec) for name, spec in specs_of(template).items()}
