"""The count exchange: the header protocol every collective call of a context starts with.

Before any id or row moves, every rank sends every peer a fixed-size int64 header (per-piece
counts, the call's tag, the batch's smallest and largest id and length, the block it wants, the
rows it flags), so every rank learns alike whether ids are out of range, a peer cancelled, or
ranks are in different calls. :class:`HeaderExchange` runs it; :func:`call_tag` names a call.

Design: ``docs/CONTEXT.md`` (section "The count exchange").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastic_emb.context.group import Group
from elastic_emb.errors import CollectiveMismatch, InvalidIds, PeerLookupError
from elastic_emb.protocol import TableSpec
from elastic_emb.topology import Topology

# Pipeline pieces per call at most (the header's count words).
MAX_CHUNKS = 16
HEADER_WIDTH = MAX_CHUNKS + 6
H_TAG, H_LO, H_HI, H_LEN, H_WANT, H_FLAGGED = range(MAX_CHUNKS, MAX_CHUNKS + 6)
POISON = -1

OP_LOOKUP, OP_GRADIENTS = 1, 2
_OPS = {OP_LOOKUP: "lookup", OP_GRADIENTS: "apply_gradients"}


def header_words(key_dtype: torch.dtype) -> int:
    """How many elements of ``key_dtype`` one header takes in the fused count + id buffer.

    Args:
        key_dtype: the keys' dtype (int32 or int64).

    Returns:
        :data:`HEADER_WIDTH` int64 words, counted in elements of ``key_dtype``.
    """
    return HEADER_WIDTH * (8 // torch.empty((), dtype=key_dtype).element_size())


def call_tag(names: Sequence[str], op: int, table: str, chunks: int = 1) -> int:
    """Identifies a call (operation, table, pipeline pieces) so the count exchange can prove
    that every rank is in the same call.

    Args:
        names: the context's table names, sorted.
        op: :data:`OP_LOOKUP` or :data:`OP_GRADIENTS`.
        table: the table's name (an unknown one gets a reserved index).
        chunks: pipeline pieces.

    Returns:
        The tag, an int.
    """
    idx = names.index(table) if table in names else (1 << 20) - 1
    return (chunks << 40) | (op << 20) | idx


def tag_op(tag: int) -> int:
    """The operation of a call.

    Args:
        tag: a :func:`call_tag`.

    Returns:
        :data:`OP_LOOKUP` or :data:`OP_GRADIENTS`.
    """
    return (tag >> 20) & 0xFFFFF


def describe_tag(names: Sequence[str], tag: int) -> str:
    """A call, for messages.

    Args:
        names: the context's table names, sorted.
        tag: a :func:`call_tag`.

    Returns:
        E.g. ``"lookup('t') in 3 chunk(s)"``.
    """
    chunks, rest = divmod(tag, 1 << 40)
    op, idx = divmod(rest, 1 << 20)
    table = names[idx] if idx < len(names) else "<unknown table>"
    return f"{_OPS.get(op, f'op{op}')}({table!r}) in {chunks} chunk(s)"


def range_error(spec: TableSpec, lo: int, hi: int) -> str | None:
    """Why ids spanning ``[lo, hi]`` are invalid for ``spec``.

    Args:
        spec: the table.
        lo: the smallest id.
        hi: the largest id.

    Returns:
        A message naming the first bad id, or None when every id is valid.
    """
    if lo >= 0 and hi < spec.num_rows:
        return None
    bad = lo if lo < 0 else hi
    return (
        f"id {bad} is out of range for table {spec.name!r} of {spec.num_rows} rows "
        f"(valid ids are 0..{spec.num_rows - 1})"
    )


class HeaderExchange:
    """Runs the count exchange of one context's group.

    Args:
        group: the context's private group.
        topology: the context's topology.
        device: the context's device.
        names: the context's table names.
        log_: the context's logger.
    """

    def __init__(self, group: Group, topology: Topology, device: torch.device, names: Sequence[str], log_):
        self.group = group
        self.topology = topology
        self.device = device
        self.names = sorted(names)
        self.log = log_
        # Bytes per peer of every count exchange (0: the header alone); grown from the headers.
        self.block_bytes = 0
        self._templates: dict[int, torch.Tensor] = {}
        self._host: dict = {}  # CUDA: pinned host copies of the headers, per shape

    def template(self, tag: int) -> torch.Tensor:
        """The header buffer of a call (cached per tag); one buffer, so one copy to the host
        reads both halves.

        Args:
            tag: the call's tag.

        Returns:
            ``[2, world, width]`` int64 on the device: row 0 the headers to send (tag filled
            in), row 1 where the peers' land. Callers clone it before writing.
        """
        template = self._templates.get(tag)
        if template is None:
            template = torch.zeros(2, self.topology.world_size, HEADER_WIDTH, dtype=torch.int64)
            template[0, :, H_TAG] = tag
            template = self._templates[tag] = template.to(self.device)
        return template

    def _read(self, hdr: torch.Tensor, work, label: str) -> list[int]:
        """The headers (sent and received) on the host, once ``work`` (the exchange) is done."""
        if self.device.type == "cuda":
            # Queue the copy of the headers to the host behind the exchange and poll for that
            # copy, instead of polling for the exchange and then copying (a second round trip).
            self.group.wait(work, None, label, host=False)
            host = self._host.get(hdr.shape)
            if host is None:
                host = self._host[hdr.shape] = torch.empty(hdr.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(hdr, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self.group.wait_event(copied, self.group.timeout, label)
            self.group.wait(work, None, label)  # done by now; raises if the exchange failed
            return host.reshape(-1).tolist()
        self.group.wait(work, None, label)
        return hdr.reshape(-1).tolist()

    def exchange(
        self,
        hdr: torch.Tensor,
        chunks: int,
        what: str,
        tag: int,
        spec: TableSpec | None = None,
        xbuf: torch.Tensor | None = None,
    ) -> tuple[list[list[int]], list[list[int]], int, int]:
        """All-to-all of a header per peer (``hdr[0]``, see :meth:`template`); grows the block
        when a peer asks for more. Every error is raised before any id or row travels.

        Args:
            hdr: the headers, ``[2, world, width]`` int64.
            chunks: pipeline pieces.
            what: the call, for messages.
            tag: the call's tag.
            spec: the table, to range-check the batches; None: no range check.
            xbuf: with a block (``block_bytes`` > 0), the ``[2, world, words]`` buffer whose
                words start with the headers (``hdr`` views them).

        Returns:
            ``(sent, received, longest, flagged)``: the counts as ``[peer][chunk]`` lists, the
            longest batch of any rank and the rows flagged by all ranks together.

        Raises:
            InvalidIds: on the rank whose ids are out of range.
            PeerLookupError: on the others, and on every rank when a peer sent poison.
            CollectiveMismatch: when a rank is in a different call.
            CommunicationError: when the exchange fails or times out.
            RuntimeError: when ``xbuf`` does not match the block size (an internal error).
        """
        world, me = self.topology.world_size, self.topology.rank
        width = HEADER_WIDTH
        if not self.block_bytes:
            splits = [width] * world
            work = self.group.alltoall(hdr[1].reshape(-1), hdr[0].reshape(-1), splits, splits)
            label = f"{what} count exchange"
        else:  # one block per peer: the header, then (for a large lookup) its keys
            words = xbuf.view(torch.int64)
            if words.shape[2] * 8 != self.block_bytes:
                raise RuntimeError(
                    f"internal: {what} built a {words.shape[2] * 8}-byte block, the context "
                    f"exchanges {self.block_bytes}"
                )
            splits = [words.shape[2]] * world
            work = self.group.alltoall(words[1].reshape(-1), words[0].reshape(-1), splits, splits)
            label = f"{what} count and id exchange"
        both = self._read(hdr, work, label)
        rows_sent = [both[p * width : (p + 1) * width] for p in range(world)]
        rows = [both[(world + p) * width : (world + p + 1) * width] for p in range(world)]
        tags = [r[H_TAG] for r in rows]
        # Every rank sees the same headers, so every rank grows the block alike, whatever happens next.
        want = max(r[H_WANT] for r in rows)
        if want > self.block_bytes:
            self.log.info("context.count_block_grown", old_bytes=self.block_bytes, new_bytes=want)
            self.block_bytes = want
        longest = max(r[H_LEN] for r in rows)
        sent, got = [r[:chunks] for r in rows_sent], [r[:chunks] for r in rows]
        out_of_range = []
        if spec is not None:
            out_of_range = [p for p, r in enumerate(rows) if tags[p] == tag and range_error(spec, r[H_LO], r[H_HI])]
        if me in out_of_range:
            raise InvalidIds(f"{what} on rank {me}: {range_error(spec, rows[me][H_LO], rows[me][H_HI])}")
        bad = [r for r, row in enumerate(rows) if any(x < 0 for x in row[:MAX_CHUNKS])]
        if bad:
            raise PeerLookupError(
                f"{what} was cancelled on rank {me}: rank(s) {bad} passed invalid input "
                f"(see the InvalidIds error on those ranks); the context stays usable",
                bad,
            )
        other = {r: tg for r, tg in enumerate(tags) if tg != tag}
        if other:
            calls = ", ".join(f"rank {r} called {describe_tag(self.names, tg)}" for r, tg in sorted(other.items()))
            raise CollectiveMismatch(
                f"rank {me} called {describe_tag(self.names, tag)} but {calls}: every rank must "
                f"make the same lookup/apply_gradients calls in the same order (an empty ids tensor where it "
                f"has none) on contexts built with the same pipeline_chunks"
            )
        if out_of_range:
            raise PeerLookupError(
                f"{what} was cancelled on rank {me}: rank(s) {out_of_range} passed ids out of "
                f"range (see the InvalidIds error on those ranks); the context stays usable",
                out_of_range,
            )
        return sent, got, longest, sum(r[H_FLAGGED] for r in rows)

    def cancel(self, what: str, tag: int) -> None:
        """Send poison in place of counts, so the peers raise instead of waiting for this rank.

        Args:
            what: the call, for messages.
            tag: the call's tag.

        Raises:
            CommunicationError: when the exchange fails or times out.
        """
        chunks = max(1, tag >> 40)
        xbuf = None
        if self.block_bytes:
            xbuf = torch.zeros(
                2, self.topology.world_size, self.block_bytes // 8, dtype=torch.int64, device=self.device
            )
            hdr = xbuf[:, :, :HEADER_WIDTH]
            hdr.copy_(self.template(tag))
        else:
            hdr = self.template(tag).clone()
        hdr[0, :, :chunks] = POISON
        try:
            self.exchange(hdr, chunks, what, tag, xbuf=xbuf)
        except (PeerLookupError, CollectiveMismatch):
            pass
