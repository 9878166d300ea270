"""elastic_emb: a TorchElastic-aware lifecycle manager for sharded embedding contexts.

A sharded embedding context (a communicator plus a memory arena) is sized for one world size.
When an elastic job resizes, elastic_emb destroys the context and constructs a new one for the
new size (never ``reset`` across sizes), after every rank has agreed on the new topology, and
carries every embedding row and optimizer slot across, resharded.

Read in this order to follow one resize: ``rendezvous.py`` (who is in the job now),
``lifecycle.py`` (what happens on a change), ``state.py`` (how rows survive it).
"""

from elastic_emb.errors import (
    AgreementTimeout,
    ChecksumMismatch,
    ContextClosed,
    ElasticEmbError,
    RestoreError,
    TopologyDisagreement,
    TopologyError,
    WorldSizeChanged,
)

__version__ = "0.1.0"

__all__ = [
    "AgreementTimeout",
    "ChecksumMismatch",
    "ContextClosed",
    "ElasticEmbError",
    "RestoreError",
    "TopologyDisagreement",
    "TopologyError",
    "WorldSizeChanged",
    "__version__",
]
