"""Former home of the rendezvous backend; it now lives in :mod:`elastic_emb.rdzv`.

Kept so ``import elastic_emb.rendezvous`` (and scripts that name it) keep working: the names it
exported are re-exported from the package's modules. New code imports from ``elastic_emb.rdzv``.
"""

from elastic_emb.rdzv.decode import RendezvousView, node_id
from elastic_emb.rdzv.handler import (
    INNER_BACKENDS,
    ElasticEmbRendezvousHandler,
    ListenerConfig,
    create_handler,
    event_logger,
    handler_factory,
    register_inner,
)
from elastic_emb.rdzv.keys import *  # noqa: F401,F403 - the wire contract, as before
from elastic_emb.rdzv.outage import OutageGuard, StoreOutageError, is_connection_error, torch_store_outage_error

Membership = RendezvousView  # the agent's former view of the state

__all__ = ["INNER_BACKENDS", "ElasticEmbRendezvousHandler", "ListenerConfig", "Membership", "OutageGuard",
           "RendezvousView", "StoreOutageError", "create_handler", "event_logger", "handler_factory",
           "is_connection_error", "node_id", "register_inner", "torch_store_outage_error"]
