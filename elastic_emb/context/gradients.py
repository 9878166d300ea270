"""Sparse gradients: routed to the owners of their rows and applied there.

``apply_gradients(table, ids, grads)`` is collective. Duplicates are summed locally (the same
sort-based dedup as a lookup, :mod:`elastic_emb.context.dedup`, with its count exchange and its
checks), the unique rows and their summed gradients travel to their owners (two all-to-alls:
ids, then gradients), and the owner sums again across senders and applies the optimizer
(:mod:`elastic_emb.context.optim`) to unique rows. Lookups in flight are settled first, so they
return the rows as they were when they started.
"""

from __future__ import annotations

import torch

from elastic_emb.context import optim
from elastic_emb.context.arena import Arena
from elastic_emb.context.dedup import Deduper
from elastic_emb.context.exchange import OP_GRADIENTS, call_tag
from elastic_emb.context.group import Group
from elastic_emb.errors import InvalidIds
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.sharding import owned_range
from elastic_emb.topology import Topology


class GradientRouter:
    """Applies one context's sparse gradients over one group and arena."""

    def __init__(self, group: Group, deduper: Deduper, arena: Arena, topology: Topology, device: torch.device,
                 names, optimizer: OptimizerSpec, settle):
        self.group = group
        self.deduper = deduper
        self.arena = arena
        self.topology = topology
        self.device = device
        self.names = sorted(names)
        self.optimizer = optimizer
        self._settle = settle  # called before rows are written (the lookup engine's settle)

    def apply(self, spec: TableSpec, ids, grads, what: str) -> None:
        """Route ``grads`` (``[len(ids), dim]``) to the owners of ``ids`` and apply the optimizer
        there. Raises :class:`InvalidIds` (after cancelling the call on the peers) for a shape
        mismatch or bad ids."""
        tag = call_tag(self.names, OP_GRADIENTS, spec.name)
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
            self.deduper.exchange.cancel(what, tag)  # tell the peers before raising, so nobody waits
            raise InvalidIds(
                f"{what} on rank {self.topology.rank}: grads must be [len(ids), {spec.dim}] for ids of "
                f"shape {n}, got {got}"
            )
        uniq, inverse, send_list, recv_list, recv_ids = self._route(spec, ids, what, tag)
        summed = torch.zeros(len(uniq), spec.dim, dtype=spec.torch_dtype, device=self.device)
        if len(uniq):
            summed.index_add_(0, inverse, grads.to(device=self.device, dtype=spec.torch_dtype))
        recv_grads = torch.empty(len(recv_ids), spec.dim, dtype=spec.torch_dtype, device=self.device)
        self.group.wait(self.group.alltoall(recv_grads, summed, recv_list, send_list), None,
                        f"{what} gradient exchange", host=False)
        if not len(recv_ids):
            return
        start = owned_range(spec.num_rows, self.topology.ep_size, self.topology.rank).start
        local = recv_ids.long() - start
        # Several senders may have sent the same row: sum them before the (non-linear) update.
        rows, inv = torch.unique(local, sorted=True, return_inverse=True)
        if rows.numel() != local.numel():
            total = torch.zeros(rows.numel(), spec.dim, dtype=spec.torch_dtype, device=self.device)
            total.index_add_(0, inv, recv_grads)
        else:
            total = torch.empty_like(recv_grads).index_copy_(0, inv, recv_grads)
        self._settle()
        optim.apply_rows(self.optimizer, self.arena.weights[spec.name], self.arena.slots[spec.name], rows, total)

    def _route(self, spec: TableSpec, ids, what: str, tag: int):
        """Validate, dedup, exchange counts and ids (own ids included). Returns (uniq, inverse,
        send counts, receive counts, received ids)."""
        d = self.deduper.dedup(spec, ids, what, tag, 1)
        uniq = d.uniq[: d.n_unique]
        send_list, recv_list = [c[0] for c in d.sent], [c[0] for c in d.got]
        recv_ids = torch.empty(sum(recv_list), dtype=uniq.dtype, device=self.device)
        self.group.wait(self.group.alltoall(recv_ids, uniq, recv_list, send_list), None, f"{what} id exchange",
                        host=False)
        return uniq, d.inverse, send_list, recv_list, recv_ids
