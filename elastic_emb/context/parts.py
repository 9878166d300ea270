"""The parts one context generation's collective operations run on, as one shared record.

The lookup engine (:mod:`elastic_emb.context.lookup`) and the gradient router
(:mod:`elastic_emb.context.gradients`) both run over the same private group, deduper, arena and
device checks, for the same topology and tables. The context builds one :class:`OpParts` whenever
it (re)wires them (construction, a ``reset``) and hands that one record to both, so the two can
never disagree about which communicator or arena they use; ``close()`` drops the arena from it
once, for both (the next context reuses that memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from elastic_emb.context.arena import Arena
from elastic_emb.context.checks import DeviceChecks
from elastic_emb.context.dedup import Deduper
from elastic_emb.context.group import Group
from elastic_emb.protocol import TableSpec
from elastic_emb.topology import Topology


@dataclass(eq=False)
class OpParts:
    """What the lookups and the gradient updates of one generation share.

    ``arena`` is None once the context closed; ``names`` are the tables' names, sorted (the order
    :func:`~elastic_emb.context.exchange.call_tag` numbers them in)."""

    group: Group
    deduper: Deduper
    arena: Arena | None
    topology: Topology
    device: torch.device
    tables: Mapping[str, TableSpec]
    checks: DeviceChecks
    names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = sorted(self.tables)
