"""Sparse gradients: routed to the owners of their rows and applied there.

:class:`GradientRouter` serves ``apply_gradients``: duplicates summed locally (the lookup's
dedup and count exchange), unique rows and their sums sent to their owners (ids, then
gradients), summed again there and handed to :mod:`elastic_emb.context.optim`; rows with NaN or
infinite gradients refuse the call or are skipped alike on every rank. A world of one rank runs
the whole update on the device, without a host sync.

Design: ``docs/CONTEXT.md`` (section "Gradients").
"""

from __future__ import annotations

import torch

from elastic_emb.context import optim
from elastic_emb.context.changes import ChangeTracker
from elastic_emb.context.checks import R_BAD_IDS, R_FIRST, R_NONFINITE, R_REFUSED
from elastic_emb.context.dedup import check_ids
from elastic_emb.context.exchange import OP_GRADIENTS, call_tag
from elastic_emb.context.parts import OpParts
from elastic_emb.errors import InvalidIds, NonFiniteGradients
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.sharding import owned_range


class GradientRouter:
    """Applies one context's sparse gradients over one group and arena.

    Args:
        parts: what the lookups and the gradients share.
        optimizer: the row-wise optimizer.
        settle: called before rows are written (the lookup engine's
            :meth:`~elastic_emb.context.lookup.LookupEngine.settle`).
        tracker: where written rows are marked.
        nonfinite: "raise" or "skip" (see :class:`~elastic_emb.context.emb.EmbContext`).
    """

    def __init__(
        self, parts: OpParts, optimizer: OptimizerSpec, settle, tracker: ChangeTracker, nonfinite: str = "raise"
    ):
        self.parts = parts  # shared with the lookup engine (context/parts.py)
        self.optimizer = optimizer
        self._settle = settle  # called before rows are written (the lookup engine's settle)
        self.tracker = tracker
        self.nonfinite = nonfinite

    def apply(self, spec: TableSpec, ids, grads, what: str) -> None:
        """Route ``grads`` to the owners of ``ids`` and apply the optimizer there.

        Args:
            spec: the table.
            ids: the caller's ids.
            grads: ``[len(ids), dim]`` gradients.
            what: the call, for messages.

        Raises:
            InvalidIds: for a shape mismatch (after cancelling the call on the peers) or bad ids
                (in a world of one rank on CUDA, bad ids surface from the device record later).
            NonFiniteGradients: with ``nonfinite="raise"``, when any rank's rows have NaN or
                infinite gradients (no row changes).
            PeerLookupError: when another rank's input is bad.
            CollectiveMismatch: when the ranks are in different calls.
            CommunicationError: when an exchange fails or times out.
        """
        parts = self.parts
        tag = call_tag(parts.names, OP_GRADIENTS, spec.name)
        shape_ok = (
            isinstance(grads, torch.Tensor)
            and isinstance(ids, torch.Tensor)
            and grads.dim() == 2
            and grads.shape[1] == spec.dim
            and ids.dim() == 1
            and grads.shape[0] == ids.shape[0]
        )
        if not shape_ok:
            got = tuple(grads.shape) if isinstance(grads, torch.Tensor) else type(grads).__name__
            n = tuple(ids.shape) if isinstance(ids, torch.Tensor) else "?"
            parts.deduper.exchange.cancel(what, tag)  # tell the peers before raising, so nobody waits
            raise InvalidIds(
                f"{what} on rank {parts.topology.rank}: grads must be [len(ids), {spec.dim}] for ids of "
                f"shape {n}, got {got}"
            )
        if parts.topology.world_size == 1:
            self._apply_local(spec, ids, grads, what)
            return
        g = grads.to(device=parts.device, dtype=spec.torch_dtype)
        d = parts.deduper.dedup(spec, ids, what, tag, 1, flag=lambda inverse, n: _nonfinite_rows(g, inverse, n))
        if d.flagged:
            message = (
                f"{what}: {d.flagged} row(s) of table {spec.name!r} got NaN or infinite gradients "
                f"(counted on each sending rank)"
            )
            if self.nonfinite == "raise":  # every rank read the same headers: all refuse alike
                raise NonFiniteGradients(
                    f"{message}; no row of that call was updated. Fix the loss (or clip "
                    f"gradients), or construct the context with nonfinite_gradients='skip'",
                    spec.name,
                    d.flagged,
                )
            parts.checks.log.warning("context.nonfinite_gradients_skipped", table=spec.name, rows=d.flagged)
        uniq = d.uniq[: d.n_unique]
        send_list, recv_list = [c[0] for c in d.sent], [c[0] for c in d.got]
        recv_ids = torch.empty(sum(recv_list), dtype=uniq.dtype, device=parts.device)
        parts.group.wait(
            parts.group.alltoall(recv_ids, uniq, recv_list, send_list), None, f"{what} id exchange", host=False
        )
        summed = torch.zeros(len(uniq), spec.dim, dtype=spec.torch_dtype, device=parts.device)
        if len(uniq):
            summed.index_add_(0, d.inverse, g)
        recv_grads = torch.empty(len(recv_ids), spec.dim, dtype=spec.torch_dtype, device=parts.device)
        parts.group.wait(
            parts.group.alltoall(recv_grads, summed, recv_list, send_list),
            None,
            f"{what} gradient exchange",
            host=False,
        )
        if not len(recv_ids):
            return
        start = owned_range(spec.num_rows, parts.topology.ep_size, parts.topology.rank).start
        # Several senders may have sent the same row: sum them before the (non-linear) update.
        dump = parts.arena.weights[spec.name].shape[0]
        rows, total, used = _sum_by_row(recv_ids.long() - start, recv_grads, dump)
        keep = used & torch.isfinite(total).all(dim=1)  # skipped rows, and any sum that overflowed
        self._apply(spec, torch.where(keep, rows, dump), total, keep)

    def _apply(self, spec: TableSpec, rows: torch.Tensor, summed: torch.Tensor, keep: torch.Tensor) -> None:
        """The optimizer on local ``rows`` (unique, or the dump row where ``keep`` is False), then
        the change marks; lookups in flight read their rows first."""
        self._settle()
        self.tracker.before_write()  # a commit capture still reading rows finishes first
        arena = self.parts.arena
        values = optim.apply_rows(
            self.optimizer, arena.padded_weights[spec.name], arena.padded_slots[spec.name], rows, summed, keep
        )
        self.tracker.mark_rows(spec.name, rows, keep, values)

    def _apply_local(self, spec: TableSpec, ids, grads, what: str) -> None:
        """A world of one rank: the whole update on the device, no host synchronisation. Bad ids
        or (with ``nonfinite="raise"``) non-finite gradients refuse the whole call: every row is
        left as it was, and the device record says why."""
        checked, reason = check_ids(ids, self.parts.device)
        if checked is None:
            raise InvalidIds(f"{what} on rank 0: {reason}")
        n, dev = checked.numel(), self.parts.device
        if not n:
            return
        g = grads.to(device=dev, dtype=spec.torch_dtype)
        dump = self.parts.arena.weights[spec.name].shape[0]  # the arena's dump row (Arena.padded_weights)
        bad_ids = (checked < 0) | (checked >= spec.num_rows)
        rows, summed, used = _sum_by_row(torch.where(bad_ids, 0, checked), g, dump)
        finite = torch.isfinite(summed).all(dim=1)
        n_bad_ids, nonfinite = bad_ids.sum(), (used & ~finite).sum()
        refused = n_bad_ids > 0
        if self.nonfinite == "raise":
            refused = refused | (nonfinite > 0)
        keep = used & finite & ~refused
        self._apply(spec, torch.where(keep, rows, dump), summed, keep)  # the others update the dump row
        slot_no, record = self.parts.checks.record()
        record[R_BAD_IDS] = n_bad_ids
        record[R_FIRST] = torch.where(bad_ids, n - torch.arange(n, device=dev), 0).max()
        record[R_NONFINITE] = nonfinite
        record[R_REFUSED] = refused
        self.parts.checks.post(what, spec, slot_no, checked)


def _sum_by_row(ids: torch.Tensor, grads: torch.Tensor, dump: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum the gradients of equal ids without a host sync: (rows, summed, used), each of
    ``len(ids)`` slots; slot s holds the s-th smallest distinct id and the sum of its gradients
    while ``used[s]``, and ``dump`` with a zero sum after the last distinct id."""
    n, dev = ids.numel(), ids.device
    sorted_ids, perm = torch.sort(ids)
    head = torch.ones(n, dtype=torch.bool, device=dev)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=head[1:])
    slot = torch.cumsum(head, 0) - 1
    rows = torch.full((n,), dump, dtype=torch.int64, device=dev).scatter_(0, slot, sorted_ids)
    summed = torch.zeros(n, grads.shape[1], dtype=grads.dtype, device=dev)
    summed.index_add_(0, torch.empty_like(slot).scatter_(0, perm, slot), grads)
    return rows, summed, torch.arange(n, device=dev) <= slot[-1]


def _nonfinite_rows(grads: torch.Tensor, inverse: torch.Tensor, n: int) -> torch.Tensor:
    """How many unique rows of a batch (``inverse[i]``: the unique slot of position i) have a
    NaN or infinite gradient in any of their positions; a device scalar."""
    if not n:
        return torch.zeros((), dtype=torch.int64, device=grads.device)
    bad = (~torch.isfinite(grads).all(dim=1)).to(torch.int32)
    return (torch.zeros(n, dtype=torch.int32, device=grads.device).index_add_(0, inverse, bad) > 0).sum()
