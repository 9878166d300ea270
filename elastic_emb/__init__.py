"""elastic_emb: a TorchElastic-aware lifecycle manager for sharded embedding contexts.

After an elastic resize it destroys the embedding context and builds one for the new world size
(never ``reset`` across sizes), once every rank agrees on the topology, and carries every row and
optimizer slot across, resharded. ``__all__`` is the public API: what a training script imports
and the errors it handles. Names are imported on first use, so ``import elastic_emb`` imports no
torch. The module map is ``docs/ARCHITECTURE.md``; the core modules are described in
``docs/CORE.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from elastic_emb.errors import (
    AgreementTimeout,
    ChangeTrackingUnsupported,
    ChecksumMismatch,
    CollectiveMismatch,
    CommunicationError,
    ConfigError,
    ContextClosed,
    ContractViolation,
    DrainError,
    ElasticEmbError,
    EtcdUnreachable,
    EtcdV3Error,
    InvalidIds,
    JobComplete,
    NonFiniteGradients,
    PeerLookupError,
    RendezvousConfigError,
    ResizeFallback,
    RestoreError,
    SecretError,
    StorageError,
    StoreOutageError,
    TopologyDisagreement,
    TopologyError,
    TorchCompatError,
    TransferInterrupted,
    UnsafeStateError,
    UnsupportedSharding,
    WorldSizeChanged,
)

__version__ = "0.1.0"

# public name -> the module that defines it, or "module:attribute" (imported on first access)
_LAZY: dict[str, str] = {
    # the lifecycle a training loop drives
    "Lifecycle": "elastic_emb.lifecycle.manager",
    "LifecycleConfig": "elastic_emb.lifecycle.records",
    "ResizeEvent": "elastic_emb.lifecycle.records",
    "CommitReport": "elastic_emb.lifecycle.records",
    # the context and its contract
    "EmbContext": "elastic_emb.context",
    "TableSpec": "elastic_emb.protocol",
    "OptimizerSpec": "elastic_emb.protocol",
    "ShardData": "elastic_emb.protocol",
    "ShardedContext": "elastic_emb.protocol",
    "ContextBase": "elastic_emb.protocol",
    "RowRange": "elastic_emb.sharding",
    # topology and agreement
    "Topology": "elastic_emb.topology",
    "agree": "elastic_emb.topology",
    # membership and in-process resizes
    "Watcher": "elastic_emb.watch.watcher",
    "InProcessResize": "elastic_emb.inprocess.resize",
    # the elastic training loop over both resize modes, and its seams
    "run_elastic": "elastic_emb.lifecycle.loop",
    "LoopHooks": "elastic_emb.lifecycle.loop",
    "interruptible_store": "elastic_emb.inprocess.interruptible",
    "worker_store": "elastic_emb.store",
    "generation_store": "elastic_emb.store",
    # where each rank's data goes on after a resize
    "ElasticSampler": "elastic_emb.data",
    # settings and logs
    "Settings": "elastic_emb.config",
    "load_settings": "elastic_emb.config:load",
    "configure_logging": "elastic_emb.events",
    "get_logger": "elastic_emb.events",
    "bind_topology": "elastic_emb.events",
}

_ERRORS = [
    "AgreementTimeout",
    "ChangeTrackingUnsupported",
    "ChecksumMismatch",
    "CollectiveMismatch",
    "CommunicationError",
    "ConfigError",
    "ContextClosed",
    "ContractViolation",
    "DrainError",
    "ElasticEmbError",
    "EtcdUnreachable",
    "EtcdV3Error",
    "InvalidIds",
    "JobComplete",
    "NonFiniteGradients",
    "PeerLookupError",
    "RendezvousConfigError",
    "ResizeFallback",
    "RestoreError",
    "SecretError",
    "StorageError",
    "StoreOutageError",
    "TopologyDisagreement",
    "TopologyError",
    "TorchCompatError",
    "TransferInterrupted",
    "UnsafeStateError",
    "UnsupportedSharding",
    "WorldSizeChanged",
]

__all__ = [*_LAZY, *_ERRORS, "__version__"]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from elastic_emb.config import Settings
    from elastic_emb.config import load as load_settings
    from elastic_emb.context import EmbContext
    from elastic_emb.events import bind_topology, configure_logging, get_logger
    from elastic_emb.inprocess.interruptible import interruptible_store
    from elastic_emb.inprocess.resize import InProcessResize
    from elastic_emb.lifecycle.loop import LoopHooks, run_elastic
    from elastic_emb.lifecycle.manager import Lifecycle
    from elastic_emb.lifecycle.records import CommitReport, LifecycleConfig, ResizeEvent
    from elastic_emb.protocol import ContextBase, OptimizerSpec, ShardData, ShardedContext, TableSpec
    from elastic_emb.sharding import RowRange
    from elastic_emb.store import generation_store, worker_store
    from elastic_emb.topology import Topology, agree
    from elastic_emb.watch.watcher import Watcher


def __getattr__(name: str):
    """Import a public name of ``_LAZY`` on first access (PEP 562).

    Args:
        name: the attribute asked for.

    Returns:
        The object, also stored in the module so the next access is a plain lookup.

    Raises:
        AttributeError: if ``name`` is not one of the lazily imported names (``_LAZY``).
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_emb' has no attribute {name!r}")
    module, _, attribute = module.partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    """The module's names, the ones not imported yet included.

    Returns:
        The sorted names.
    """
    return sorted({*globals(), *_LAZY})
