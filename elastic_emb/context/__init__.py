"""The sharded embedding context: a private communicator plus a memory arena, for one world.

:class:`EmbContext` (:mod:`elastic_emb.context.emb`) is the facade over one module per part:
``group`` (private process group), ``arena`` (rows, slots, staging), ``exchange`` (the header
protocol), ``dedup``, ``lookup`` (:class:`LookupHandle`), ``gradients``, ``parts`` (what lookups
and gradients share), ``gather``, ``optim``, ``checks`` (errors the GPU finds), ``changes`` (rows
written since the last take) and ``dtensor`` (the rows as DTensors for DCP).

Design: ``docs/CONTEXT.md``.
"""

from elastic_emb.context.arena import INIT_BLOCK_ROWS, init_rows
from elastic_emb.context.emb import EmbContext
from elastic_emb.context.group import NCCL_DEFAULTS, apply_nccl_defaults, wait_releases
from elastic_emb.context.lookup import LookupHandle
from elastic_emb.errors import CollectiveMismatch, CommunicationError, InvalidIds, PeerLookupError

__all__ = [
    "EmbContext",
    "LookupHandle",
    "InvalidIds",
    "PeerLookupError",
    "CommunicationError",
    "CollectiveMismatch",
    "init_rows",
    "INIT_BLOCK_ROWS",
    "wait_releases",
    "apply_nccl_defaults",
    "NCCL_DEFAULTS",
]
