"""The count exchange: the header protocol every collective call of a context starts with.

Before any id or row moves, every rank sends every peer a fixed-size header (int64 words):

    counts[0.._MAX_CHUNKS)   ids meant for that peer, per pipeline piece (-1: poison, the
                             sender failed before counting and cancels the call)
    tag                      which call this is: operation, table, pieces (:func:`call_tag`)
    lo, hi                   the smallest and largest id of the sender's batch
    len                      the sender's batch length
    want                     the exchange block the sender would like (bytes; see below)
    flagged                  rows the sender flags: for gradients, rows whose gradient is NaN or
                             infinite (every rank then refuses or skips them alike)

So every rank learns in that one exchange, and all alike, whether anyone's ids are out of range
(that rank raises :class:`~elastic_emb.errors.InvalidIds` naming the id, the others
:class:`~elastic_emb.errors.PeerLookupError`: nobody hangs) or whether ranks are in different
calls (:class:`~elastic_emb.errors.CollectiveMismatch`, instead of trading wrong rows). The
header always carries :data:`MAX_CHUNKS` counts, so two ranks in different calls still exchange
equal byte counts (gloo aborts on a size mismatch).

The block: while :attr:`HeaderExchange.block_bytes` is 0 the headers travel alone. A large
lookup asks for a block in its header; every rank reads the same headers and grows the block
alike, before any error is raised, so all keep the same size. From then on every exchange sends
a block of that many bytes per peer, the header first; a lookup may lay its unique keys behind
the header (see :mod:`elastic_emb.context.dedup`), so ids need no exchange of their own.

On CUDA the headers' copy to pinned host memory is queued behind the exchange and the host polls
one event: this is the call's one host synchronisation.
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
    """How many elements of ``key_dtype`` one header takes in the fused count + id buffer."""
    return HEADER_WIDTH * (8 // torch.empty((), dtype=key_dtype).element_size())


def call_tag(names: Sequence[str], op: int, table: str, chunks: int = 1) -> int:
    """Identifies a call (operation, table, pipeline pieces) so the count exchange can prove
    that every rank is in the same call. ``names``: the context's table names, sorted."""
    idx = names.index(table) if table in names else (1 << 20) - 1
    return (chunks << 40) | (op << 20) | idx


def tag_op(tag: int) -> int:
    return (tag >> 20) & 0xFFFFF


def describe_tag(names: Sequence[str], tag: int) -> str:
    chunks, rest = divmod(tag, 1 << 40)
    op, idx = divmod(rest, 1 << 20)
    table = names[idx] if idx < len(names) else "<unknown table>"
    return f"{_OPS.get(op, f'op{op}')}({table!r}) in {chunks} chunk(s)"


def range_error(spec: TableSpec, lo: int, hi: int) -> str | None:
    """Why ids spanning ``[lo, hi]`` are invalid for ``spec`` (None when they are valid)."""
    if lo >= 0 and hi < spec.num_rows:
        return None
    bad = lo if lo < 0 else hi
    return (f"id {bad} is out of range for table {spec.name!r} of {spec.num_rows} rows "
            f"(valid ids are 0..{spec.num_rows - 1})")


class HeaderExchange:
    """Runs the count exchange of one context's group (see the module docstring)."""

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
        """``[2, world, width]`` int64: row 0 the headers to send (tag filled in), row 1 where the
        peers' land; one buffer, so one copy to the host reads both."""
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

    def exchange(self, hdr: torch.Tensor, chunks: int, what: str, tag: int, spec: TableSpec | None = None,
                 xbuf: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[int]], int, int]:
        """All-to-all of a header per peer (``hdr[0]``, see :meth:`template`); returns (sent,
        received) counts as ``[peer][chunk]`` lists, the longest batch of any rank and the rows
        flagged by all ranks together.

        With a block (``block_bytes`` > 0) ``xbuf`` is the ``[2, world, words]`` buffer whose
        words start with the headers (``hdr`` views them). ``spec`` range-checks the batches.
        Raises :class:`InvalidIds` on the rank whose ids are out of range, :class:`PeerLookupError`
        on the others and on every rank when a peer sent poison, :class:`CollectiveMismatch` when
        a rank is in a different call; all before any id or row travels."""
        world, me = self.topology.world_size, self.topology.rank
        width = HEADER_WIDTH
        if not self.block_bytes:
            splits = [width] * world
            work = self.group.alltoall(hdr[1].reshape(-1), hdr[0].reshape(-1), splits, splits)
            label = f"{what} count exchange"
        else:  # one block per peer: the header, then (for a large lookup) its keys
            words = xbuf.view(torch.int64)
            if words.shape[2] * 8 != self.block_bytes:
                raise RuntimeError(f"internal: {what} built a {words.shape[2] * 8}-byte block, the context "
                                   f"exchanges {self.block_bytes}")
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
        """Send poison in place of counts, so the peers raise instead of waiting for this rank."""
        chunks = max(1, tag >> 40)
        xbuf = None
        if self.block_bytes:
            xbuf = torch.zeros(2, self.topology.world_size, self.block_bytes // 8, dtype=torch.int64,
                               device=self.device)
            hdr = xbuf[:, :, :HEADER_WIDTH]
            hdr.copy_(self.template(tag))
        else:
            hdr = self.template(tag).clone()
        hdr[0, :, :chunks] = POISON
        try:
            self.exchange(hdr, chunks, what, tag, xbuf=xbuf)
        except (PeerLookupError, CollectiveMismatch):
            pass
