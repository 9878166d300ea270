"""Sort-based deduplication of a call's ids, without a host synchronisation.

- :class:`Deduper`: one sort deduplicates every pipeline piece, counts the keys per (owner,
  piece), fills the count-exchange headers (and, for a large lookup, lays its keys behind them),
  and runs the exchange; :class:`Dedup` is one call's result;
- :class:`DedupGraph`: the kernels of one (call, batch size, block) captured in a CUDA graph;
- :func:`check_ids`: the host-side checks of an ids tensor.

Design: ``docs/CONTEXT.md`` (section "Deduplication").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_emb.context.exchange import (
    H_FLAGGED,
    H_HI,
    H_LEN,
    H_LO,
    H_WANT,
    HEADER_WIDTH,
    OP_LOOKUP,
    HeaderExchange,
    header_words,
    tag_op,
)
from elastic_emb.errors import InvalidIds
from elastic_emb.protocol import TableSpec
from elastic_emb.sharding import owned_range, rows_per_owner
from elastic_emb.topology import Topology

_INT32_MAX = 2**31 - 1
# Batches at least this long have their dedup kernels replayed from a CUDA graph; at most this
# many graphs (call x batch size) are kept per context.
CAPTURE_MIN_IDS = 16384
MAX_GRAPHS = 8
# A large-batch lookup asks for its ids to ride in the count exchange when the fixed-capacity
# buffer (both directions) is at most this big; bigger worlds or batches exchange the ids after
# the counts.
FUSED_MAX_BYTES = 64 << 20


def check_ids(ids, device: torch.device) -> tuple[torch.Tensor | None, str | None]:
    """Host-side checks of ``ids`` (type, shape, dtype); the range check is done on the device.

    Args:
        ids: what the caller passed as ids.
        device: the context's device.

    Returns:
        ``(ids as int64 on device, None)``, or ``(None, reason)`` when a check fails.
    """
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.device == device and ids.dim() == 1:
        return ids, None  # the common case, without .to()'s argument parsing
    if not isinstance(ids, torch.Tensor):
        return None, f"ids must be a torch.Tensor, got {type(ids).__name__}"
    if ids.dim() != 1:
        return None, f"ids must be 1-D, got shape {tuple(ids.shape)}"
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return None, f"ids must be an integer tensor, got dtype {ids.dtype}"
    return ids.to(device=device, dtype=torch.int64), None


@dataclass
class Dedup:
    """One call's deduplicated ids, after the count exchange.

    ``uniq[:n_unique]`` the unique keys (piece-major, sorted), ``inverse[i]`` the slot of
    position i's key, ``sent``/``got`` the exchanged counts as ``[peer][piece]`` lists, ``keys``
    the exchange buffer when the keys came in it (else None), ``graph`` the graph replayed (or
    None), ``pos`` the row sources of a CUDA lookup (else None), ``flagged`` the rows every
    rank flagged in its header (see :meth:`Deduper.dedup`)."""

    uniq: torch.Tensor
    inverse: torch.Tensor
    sent: list[list[int]]
    got: list[list[int]]
    n_unique: int
    keys: torch.Tensor | None
    graph: "DedupGraph | None"
    pos: torch.Tensor | None
    flagged: int = 0


class Deduper:
    """Deduplicates a context's calls and runs their count exchange.

    Args:
        exchange: the context's count exchange.
        topology: the context's topology.
        device: the context's device.
        capture: whether large batches may replay their kernels from CUDA graphs.
        log_: the context's logger.
    """

    def __init__(self, exchange: HeaderExchange, topology: Topology, device: torch.device, capture: bool, log_):
        self.exchange = exchange
        self.topology = topology
        self.device = device
        self.capture = capture
        self.log = log_
        self.graphs: dict = {}  # (call tag, batch size, block bytes) -> DedupGraph
        self.capture_failed: str | None = None
        self.fused_lookups = 0  # lookups whose ids came with the counts (tests, benchmarks)
        self._bounds: dict = {}  # owner boundaries per (table, pieces, key dtype)
        self._offsets: tuple | None = None  # piece offsets of the last batch size

    def dedup(self, spec: TableSpec, ids, what: str, tag: int, chunks: int, flag=None) -> Dedup:
        """Validate (host checks here, the range in the exchange), deduplicate per piece and
        exchange counts, with ONE host synchronisation.

        Args:
            spec: the table.
            ids: the caller's ids.
            what: the call, for messages.
            tag: the call's tag (:func:`~elastic_emb.context.exchange.call_tag`).
            chunks: pipeline pieces.
            flag: optional ``flag(inverse, n_ids)`` giving a device int64 scalar sent as the
                header's ``flagged`` word; the total over all ranks comes back as
                :attr:`Dedup.flagged`.

        Returns:
            The call's :class:`Dedup`.

        Raises:
            InvalidIds: when ``ids`` fail the host checks (after cancelling the call on the
                peers), or, from the exchange, when this rank's ids are out of range.
            PeerLookupError: when a peer's ids are bad or a peer cancelled the call.
            CollectiveMismatch: when a rank is in a different call.
            CommunicationError: when the exchange fails or times out.
        """
        checked, reason = check_ids(ids, self.device)
        if checked is None:
            self.exchange.cancel(what, tag)  # tell the peers before raising, so nobody waits for this rank
            raise InvalidIds(f"{what} on rank {self.topology.rank}: {reason}")
        n = checked.numel()
        block = self.exchange.block_bytes  # as it is for this call; the exchange may grow it for the next
        graph = self._graph(spec, n, chunks, tag, block) if n >= CAPTURE_MIN_IDS else None
        if graph is not None:
            uniq, inverse, hdr, xbuf, pos = graph.replay(checked)
        else:
            uniq, inverse, hdr, xbuf, pos = self.compute(
                spec, checked, chunks, *self.inputs(spec, n, chunks, tag, block)
            )
        if flag is not None:
            hdr[0, :, H_FLAGGED] = flag(inverse, n)
        sent, got, longest, flagged = self.exchange.exchange(hdr, chunks, what, tag, spec=spec, xbuf=xbuf)
        n_unique = sum(sum(c) for c in sent)
        capacity = self.key_capacity(spec, chunks, tag, block)
        keys = xbuf if capacity and longest <= capacity else None  # every rank decides alike
        self.fused_lookups += keys is not None
        return Dedup(uniq, inverse, sent, got, n_unique, keys, graph, pos, flagged)

    # -- layout -----------------------------------------------------------------------------

    def key_dtype(self, spec: TableSpec, chunks: int) -> torch.dtype:
        """The dtype of a call's keys ``piece * num_rows + id``.

        Args:
            spec: the table.
            chunks: pipeline pieces.

        Returns:
            ``torch.int32`` when every key fits, else ``torch.int64``.
        """
        return torch.int32 if chunks * spec.num_rows <= _INT32_MAX else torch.int64

    def key_bounds(self, spec: TableSpec, chunks: int, dtype: torch.dtype) -> torch.Tensor:
        """The keys where each owner's rows start, per piece. Cached: world and EP size are fixed
        for the context's life.

        Args:
            spec: the table.
            chunks: pipeline pieces.
            dtype: the key dtype.

        Returns:
            A ``[chunks, world + 1]`` tensor on the device.
        """
        key = (spec.name, chunks, dtype)
        bounds = self._bounds.get(key)
        if bounds is None:
            world, rows = self.topology.world_size, spec.num_rows
            per = rows_per_owner(rows, self.topology.ep_size)
            firsts = [min(p * per, rows) for p in range(world + 1)]
            bounds = torch.tensor([[k * rows + f for f in firsts] for k in range(chunks)], dtype=dtype)
            bounds = self._bounds[key] = bounds.to(self.device)
        return bounds

    def piece_offsets(self, n: int, chunks: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """``k * rows`` for each position of piece k of a batch (cached for the last batch size:
        training batches repeat it).

        Args:
            n: the batch length.
            chunks: pipeline pieces.
            rows: the table's row count.
            dtype: the key dtype.

        Returns:
            A ``[n]`` tensor on the device.
        """
        key = (n, chunks, rows, dtype)
        if self._offsets is None or self._offsets[0] != key:
            bounds = [n * k // chunks for k in range(chunks + 1)]
            off = torch.cat(
                [torch.full((bounds[k + 1] - bounds[k],), k * rows, dtype=dtype) for k in range(chunks)]
            ).to(self.device)
            self._offsets = (key, off)
        return self._offsets[1]

    def fusable(self, spec: TableSpec, chunks: int, tag: int) -> bool:
        """Whether a call's ids may ride in the count exchange: lookups only, of tables wide
        enough that the fixed-capacity padding (world x batch keys each way, against about a
        batch of rows for the row exchange) costs at most 1/8 of the row bytes.

        Args:
            spec: the table.
            chunks: pipeline pieces.
            tag: the call's tag.

        Returns:
            True when the call's keys may be laid behind the headers.
        """
        key_bytes = torch.empty((), dtype=self.key_dtype(spec, chunks)).element_size()
        return tag_op(tag) == OP_LOOKUP and 8 * self.topology.world_size * key_bytes <= spec.bytes_per_row()

    def key_capacity(self, spec: TableSpec, chunks: int, tag: int, block_bytes: int) -> int:
        """Keys per peer a block of ``block_bytes`` holds for this call, less one dump word.

        Args:
            spec: the table.
            chunks: pipeline pieces.
            tag: the call's tag.
            block_bytes: the exchange block per peer.

        Returns:
            The capacity in keys; 0 when the call's keys do not ride in the exchange.
        """
        if not block_bytes or not self.fusable(spec, chunks, tag):
            return 0
        dtype = self.key_dtype(spec, chunks)
        return block_bytes // torch.empty((), dtype=dtype).element_size() - header_words(dtype) - 1

    def want_bytes(self, spec: TableSpec, n: int, chunks: int, tag: int) -> int:
        """The block a call asks for in its header, rounded up to 1/16 of a power of two, so
        batch lengths that wander a little do not grow it call after call.

        Args:
            spec: the table.
            n: the batch length.
            chunks: pipeline pieces.
            tag: the call's tag.

        Returns:
            Bytes per peer; 0 unless a large fusable lookup, and 0 when the buffer (both
            directions) would pass :data:`FUSED_MAX_BYTES`.
        """
        if n < CAPTURE_MIN_IDS or not self.fusable(spec, chunks, tag):
            return 0
        key_bytes = torch.empty((), dtype=self.key_dtype(spec, chunks)).element_size()
        need = 8 * HEADER_WIDTH + (n + 1) * key_bytes
        grain = 1 << max(3, need.bit_length() - 4)
        need = -(-need // grain) * grain
        return need if 2 * self.topology.world_size * need <= FUSED_MAX_BYTES else 0

    def inputs(self, spec: TableSpec, n: int, chunks: int, tag: int, block_bytes: int) -> tuple:
        """The constant inputs of :meth:`compute` for one call shape.

        Args:
            spec: the table.
            n: the batch length.
            chunks: pipeline pieces.
            tag: the call's tag.
            block_bytes: the exchange block per peer (0: headers alone).

        Returns:
            ``(offsets, bounds, template, slots, layout, want, mine)``: piece offsets, owner
            boundaries, header template, slot numbers (when the keys are laid out per peer or
            positions computed), the block layout (None while the headers travel alone, else
            ``(elements, key capacity or 0, peer block starts)``), the block this call asks for,
            and ``mine`` (``(rank, shard rows)`` for a CUDA lookup's positions, else None).
        """
        dtype = self.key_dtype(spec, chunks)
        offsets = self.piece_offsets(n, chunks, spec.num_rows, dtype) if chunks > 1 and n else None
        layout = None
        if block_bytes:
            elems = block_bytes // torch.empty((), dtype=dtype).element_size()
            capacity = self.key_capacity(spec, chunks, tag, block_bytes)
            if n > capacity:
                capacity = 0  # this batch does not fit: header only (every rank learns it from the lengths)
            layout = (
                elems,
                capacity,
                torch.arange(self.topology.world_size, device=self.device) * elems + header_words(dtype),
            )
        want = self.want_bytes(spec, n, chunks, tag)
        # A lookup on CUDA also computes where each result row will come from: that needs this
        # rank's number and its shard's length. The CPU path places its own rows itself.
        mine = None
        if tag_op(tag) == OP_LOOKUP and self.device.type == "cuda":
            t = self.topology
            mine = (t.rank, len(owned_range(spec.num_rows, t.ep_size, t.rank)))
        slots = torch.arange(n, device=self.device) if mine is not None or (layout and layout[1]) else None
        return offsets, self.key_bounds(spec, chunks, dtype), self.exchange.template(tag), slots, layout, want, mine

    # -- the kernels ------------------------------------------------------------------------

    def compute(
        self,
        spec: TableSpec,
        checked: torch.Tensor,
        chunks: int,
        offsets,
        bounds,
        template,
        slots=None,
        layout=None,
        want: int = 0,
        mine=None,
    ):
        """The device half of :meth:`dedup`: no host synchronisation, no allocation sized from
        data (so it can be captured in a CUDA graph).

        Args:
            spec: the table.
            checked: the ids, int64 on the device.
            chunks: pipeline pieces.
            offsets: piece offsets (None for one piece or no ids); this and the next arguments
                are what :meth:`inputs` returns.
            bounds: the owners' first keys per piece.
            template: the header template of the call's tag.
            slots: ``arange(n)`` when keys are laid out per peer or positions computed, else None.
            layout: the block layout, or None while the headers travel alone.
            want: the block this call asks for, in bytes.
            mine: ``(this rank, its shard's rows)`` for a CUDA lookup, else None.

        Returns:
            ``(uniq, inverse, header, xbuf, pos)``. With a block ``layout`` the headers and the
            keys share ``xbuf`` ``[2 (send, receive), world, elements]`` of the key dtype: per
            peer the header (as int64 words), then, when the layout has a key capacity, the keys
            meant for that peer, piece-major, as the owner's own row numbers; ``header`` is then
            an int64 view of the header words (else ``xbuf`` is None). With ``mine``, ``pos`` is
            per position of the batch where its row will be: for a key this rank owns, its shard
            row counted from the end (< 0); otherwise its row in the receive buffer, which holds
            the received rows piece by piece, peers in rank order. Else ``pos`` is None.
        """
        n, dev = checked.numel(), checked.device
        keys = checked.to(self.key_dtype(spec, chunks))
        if offsets is not None:
            keys = keys + offsets
        sorted_keys, perm = torch.sort(keys)
        head = torch.ones(n, dtype=torch.bool, device=dev)
        if n > 1:
            torch.ne(sorted_keys[1:], sorted_keys[:-1], out=head[1:])
        firsts = torch.zeros(n + 1, dtype=torch.int64, device=dev)  # first occurrences before each position
        torch.cumsum(head, 0, out=firsts[1:])
        slot = firsts[1:] - 1
        uniq = torch.empty(n, dtype=keys.dtype, device=dev).scatter_(0, slot, sorted_keys)
        inverse = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, perm, slot)
        at = firsts[torch.searchsorted(sorted_keys, bounds)]  # [chunks, world + 1] slots at owner boundaries
        counts = at[:, 1:] - at[:, :-1]  # [chunks, world]
        world = counts.shape[1]
        if slots is not None:
            # Each unique slot's (piece, owner) segment, k * (world + 1) + owner; slots past the
            # last unique key land in the last piece's sentinel column (owner == world).
            seg = torch.searchsorted(at.reshape(-1), slots, right=True) - 1
            owner = seg % (world + 1)
            owner_row = uniq - bounds.reshape(-1)[seg]  # the key's row number at its owner
        pos = None
        if mine is not None:
            me, shard_rows = mine
            piece = seg // (world + 1)
            mine_before = torch.cumsum(counts[:, me], 0) - counts[:, me]  # my keys in earlier pieces
            local_before = mine_before[piece] + torch.where(owner > me, counts[:, me][piece], 0)
            src = torch.where(owner == me, owner_row - shard_rows, slots - local_before)
            pos = src[inverse]
        xbuf = None
        if layout is None:
            hdr = template.clone()
        else:
            elems, capacity, peer_at = layout
            hw = header_words(keys.dtype)
            xbuf = torch.zeros(2, world, elems, dtype=keys.dtype, device=dev)
            hdr = xbuf[:, :, :hw].view(torch.int64)
            hdr.copy_(template)
            if capacity:
                # Where slot s goes: its (piece, owner) segment, then that owner's block, after the
                # owner's keys of earlier pieces. Slots past the last unique key go to a dump word.
                before = torch.cumsum(counts, 0) - counts  # keys for the same owner in earlier pieces
                within = torch.zeros(chunks, world + 1, dtype=torch.int64, device=dev)
                within[:, :world] = before - at[:, :world]
                within = within.reshape(-1)[seg] + slots  # position among the keys meant for that owner
                valid = (owner < world) & (slots < firsts[n])  # within < n <= capacity: see inputs()
                dest = torch.where(valid, peer_at[owner.clamp(max=world - 1)] + within, hw + capacity)
                xbuf[0].reshape(-1).scatter_(0, dest, owner_row)
        hdr[0, :, :chunks] = counts.t()  # [world, chunks]
        hdr[0, :, H_LEN] = n
        hdr[0, :, H_WANT] = want
        if n:
            hdr[0, :, H_LO : H_HI + 1] = torch.stack(torch.aminmax(checked))  # range-checked from the headers
        return uniq, inverse, hdr, xbuf, pos

    def _graph(self, spec: TableSpec, n: int, chunks: int, tag: int, block: int) -> "DedupGraph | None":
        if not self.capture or self.device.type != "cuda" or self.capture_failed:
            return None
        key = (tag, n, block)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = DedupGraph(self, spec, n, chunks, tag, block)
            except Exception as exc:  # reported once; the eager path is equivalent, only slower
                self.capture_failed = repr(exc)[:300]
                self.log.warning("context.dedup_capture_failed", error=self.capture_failed)
                return None
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = graph
        return graph


class DedupGraph:
    """The dedup kernels of one (call, batch size) captured in a CUDA graph, with static input
    and outputs. A replay overwrites the outputs, so it first orders the stream after the last
    lookup that read them (``last_done``: recorded once that lookup has computed its positions,
    the last use of the outputs).

    Args:
        deduper: the deduper whose :meth:`Deduper.compute` is captured.
        spec: the table.
        n: the batch length.
        chunks: pipeline pieces.
        tag: the call's tag.
        block: the exchange block per peer.
    """

    def __init__(self, deduper: Deduper, spec: TableSpec, n: int, chunks: int, tag: int, block: int):
        dev = deduper.device
        self.inputs = deduper.inputs(spec, n, chunks, tag, block)  # held: the graph reads their memory
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        current = torch.cuda.current_stream(dev)
        warm = torch.cuda.Stream(device=dev)
        warm.wait_stream(current)
        with torch.cuda.stream(warm):  # first run outside capture: library workspaces get allocated
            deduper.compute(spec, self.ids, chunks, *self.inputs)
        current.wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = deduper.compute(spec, self.ids, chunks, *self.inputs)
        self.last_done: torch.cuda.Event | None = None

    def replay(self, ids: torch.Tensor) -> tuple:
        """Run the captured kernels on ``ids``.

        Args:
            ids: int64 ids on the device, of the captured batch length.

        Returns:
            The graph's static outputs, as :meth:`Deduper.compute` returns them.
        """
        current = torch.cuda.current_stream(ids.device)
        if self.last_done is not None:
            current.wait_event(self.last_done)
        self.ids.copy_(ids)
        self.graph.replay()
        return self.out
