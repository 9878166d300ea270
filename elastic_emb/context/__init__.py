"""The sharded embedding context: a private communicator plus a memory arena, for one world.

:class:`EmbContext` (in :mod:`elastic_emb.context.emb`) is the facade; the parts it composes live
in one module each:

=====================  ==========================================================================
``group``              the private process group: form, bounded waits, health, (background) release
``arena``              one allocation for every table's rows and optimizer slots, staging, lazy fill
``exchange``           the count/tag/range header protocol that opens every collective call
``dedup``              sort-based dedup without a host sync, and its CUDA graphs
``lookup``             the pipelined lookup engine and :class:`LookupHandle`
``gradients``          sparse gradients routed to their owners and applied there
``parts``              the group, dedup, arena and checks the lookups and gradients share
``dtensor``            the rows as DTensors for ``torch.distributed.checkpoint``
``changes``            which rows were written since the last ``take_changes()`` (incremental commits)
``checks``             errors the GPU finds (bad ids, NaN gradients), raised without a host sync
``optim``              the row-wise optimizers (sgd, adagrad) the owner applies
``gather``             the two-source row gather (a Triton kernel on CUDA)
=====================  ==========================================================================
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
