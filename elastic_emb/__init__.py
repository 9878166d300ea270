"""elastic_emb: a TorchElastic-aware lifecycle manager for sharded embedding contexts.

A sharded embedding context (a communicator plus a memory arena) is sized for one world size.
When an elastic job resizes, elastic_emb destroys the context and constructs a new one for the
new size (never ``reset`` across sizes), after every rank has agreed on the new topology, and
carries every embedding row and optimizer slot across, resharded.

The public API is importable from here: ``from elastic_emb import Lifecycle, EmbContext, TableSpec``.
Names are imported on first use, so ``import elastic_emb`` stays cheap (no torch until a name
needs it). The errors are all in :mod:`elastic_emb.errors`, rooted at :class:`ElasticEmbError`.

Read ``docs/ARCHITECTURE.md`` for the module map; to follow one resize, read
``elastic_emb/lifecycle/manager.py`` (what happens on a change), then ``elastic_emb/state/restore.py``
(how rows survive it) and ``elastic_emb/rdzv/handler.py`` (who is in the job now).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from elastic_emb import errors as _errors_module
from elastic_emb.errors import *  # noqa: F403 - every error is public API

_errors = [n for n, v in vars(_errors_module).items() if isinstance(v, type) and issubclass(v, Exception)]

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "Lifecycle": "elastic_emb.lifecycle.manager",
    "LifecycleConfig": "elastic_emb.lifecycle.records",
    "ResizeEvent": "elastic_emb.lifecycle.records",
    "CommitReport": "elastic_emb.lifecycle.records",
    "EmbContext": "elastic_emb.context",
    "TableSpec": "elastic_emb.protocol",
    "OptimizerSpec": "elastic_emb.protocol",
    "ShardData": "elastic_emb.protocol",
    "ShardedContext": "elastic_emb.protocol",
    "ContextBase": "elastic_emb.protocol",
    "Topology": "elastic_emb.topology",
    "agree": "elastic_emb.topology",
    "Watcher": "elastic_emb.watch.watcher",
    "Settings": "elastic_emb.config",
    "configure_logging": "elastic_emb.events",
    "get_logger": "elastic_emb.events",
    "bind_topology": "elastic_emb.events",
}

__all__ = sorted([*_LAZY, *_errors, "__version__"])

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from elastic_emb.config import Settings
    from elastic_emb.context import EmbContext
    from elastic_emb.events import bind_topology, configure_logging, get_logger
    from elastic_emb.lifecycle.manager import Lifecycle
    from elastic_emb.lifecycle.records import CommitReport, LifecycleConfig, ResizeEvent
    from elastic_emb.protocol import ContextBase, OptimizerSpec, ShardData, ShardedContext, TableSpec
    from elastic_emb.topology import Topology, agree
    from elastic_emb.watch.watcher import Watcher


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_emb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
