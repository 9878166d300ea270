"""Every error elastic_emb raises to a caller, in one place (test and drill tooling define theirs
in :mod:`elastic_emb.testing` and :mod:`elastic_emb.drill`).

Each message names the value at fault and what the caller should do about it. The classes
derive from the builtin that a caller would naturally catch (``ValueError`` for bad values,
``TimeoutError`` for bounded waits that ran out, ``RuntimeError`` for state misuse), so code
that knows nothing of elastic_emb still handles them sensibly.

Design: ``docs/CORE.md`` (section "The error hierarchy").
"""

from __future__ import annotations


class ElasticEmbError(Exception):
    """Base class of every elastic_emb error."""


class TopologyError(ElasticEmbError, ValueError):
    """A topology value (usually from an environment variable) is missing or invalid."""


class TopologyDisagreement(ElasticEmbError, RuntimeError):
    """The ranks of one generation do not hold the same topology.

    Args:
        message: what differs and what to do.
        details: kept as ``details``: maps a rank (or ``"slot<N>"`` for a record that could not
            be tied to a rank) to a list of ``(field, value, expected)`` triples.
    """

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class AgreementTimeout(ElasticEmbError, TimeoutError):
    """Topology agreement did not complete within the timeout: a rank never arrived, the deciding
    rank wrote no verdict, or a rank did not confirm reading it.

    Args:
        message: who is missing and what to do.
        missing_ranks: kept as ``missing_ranks``: the ranks that never arrived (may be empty).
    """

    def __init__(self, message: str, missing_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks or [])


class WorldSizeChanged(ElasticEmbError, ValueError):
    """``reset`` was asked for a world size the context was not built for.

    Args:
        old: the world size the context was built for (kept as ``old``).
        new: the world size asked for (kept as ``new``).
    """

    def __init__(self, old: int, new: int) -> None:
        super().__init__(
            f"world size changed from {old} to {new}: a context is sized for the world it was "
            f"constructed with; close it and construct a new context for world size {new} "
            f"(elastic_emb.lifecycle.manager.Lifecycle does this for you)"
        )
        self.old = old
        self.new = new


class ContextClosed(ElasticEmbError, RuntimeError):
    """A closed context was used."""


class RestoreError(ElasticEmbError, RuntimeError):
    """Committed state could not be restored completely.

    Args:
        message: what is missing and what to do.
        missing: kept as ``missing``: the ``(table, start_row, end_row)`` ranges that no tier
            could supply.
    """

    def __init__(self, message: str, missing: list[tuple[str, int, int]] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


class ChecksumMismatch(ElasticEmbError, RuntimeError):
    """Restored bytes do not match the checksum recorded in the commit manifest."""


class ContractViolation(ElasticEmbError, TypeError):
    """A context object lacks a member of :class:`elastic_emb.protocol.ShardedContext`."""


class UnsupportedSharding(ElasticEmbError, ValueError):
    """A framework's table is laid out in a way elastic_emb cannot move row by row (e.g. a TorchRec
    table sharded table-wise or column-wise); the message names the table and the remedy."""


class ChangeTrackingUnsupported(ElasticEmbError, NotImplementedError):
    """``take_changes`` was called on a context whose ``tracks_changes`` is False."""


class ConfigError(ElasticEmbError, ValueError):
    """An ``ELASTIC_EMB_*`` environment variable has a bad value or is unknown (elastic_emb.config)."""


class RendezvousConfigError(SystemExit, ConfigError):
    """A ``--rdzv-conf`` value or the ``--rdzv-id`` is refused before the agent builds anything.

    A ``ValueError`` for callers; a ``SystemExit`` too, so that torchrun (whose ``@record``
    re-raises a non-zero ``SystemExit``) prints its one-line message and exits 1 without a stack.

    Args:
        message: one line naming the key, the value and the remedy.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # The exit status: a SystemExit whose code is a string prints it and exits 1 (None would
        # exit 0, silently).
        self.code = message


# -- rendezvous, watcher and drain ---------------------------------------------------------------


class UnsafeStateError(ElasticEmbError, ValueError):
    """A rendezvous state value names a class outside the allow-list (or is not a state)."""


class StoreOutageError(ElasticEmbError, ConnectionError):
    """The rendezvous store stayed unreachable longer than ``store_outage_timeout``.

    The agent raises a subclass that is also torch's ``RendezvousConnectionError``: torch's own
    keep-alive timer then logs it instead of dying.
    """


class DrainError(ElasticEmbError, RuntimeError):
    """The drain request could not be made (bad settings, rendezvous store unreachable)."""


class SecretError(ElasticEmbError, ValueError):
    """The job secret (``ELASTIC_EMB_JOB_SECRET``) is set but unusable."""


class TorchCompatError(ElasticEmbError, ImportError):
    """The installed torch lacks (or changed the meaning of) a private rendezvous name the backend uses."""


class EtcdUnreachable(ElasticEmbError, ConnectionError):
    """No etcd member answered the call (all unreachable, without a leader, or timing out).
    ``rdzv.etcd_v3`` raises its subclass that is also torch's ``RendezvousConnectionError``."""


class EtcdV3Error(ElasticEmbError, RuntimeError):
    """etcd answered the call with a refusal (bad credentials, permission denied, a lost lease, a
    bad request), or the client could not authenticate (an unreadable password file, no token).
    A refusal is an answer, not an outage: it is never retried as one.

    Args:
        message: the call, etcd's answer and the remedy.
        code: kept as ``code``: the gRPC status code etcd returned, if any.
        kind: kept as ``kind``: ``"authentication"``, ``"permission"``, ``"lease"`` or ``"request"``.
    """

    def __init__(self, message: str, code: int | None = None, kind: str = "request") -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


class ResizeFallback(ElasticEmbError, RuntimeError):
    """The in-process re-form failed; the agents were asked to restart the workers instead."""


class JobComplete(ElasticEmbError, RuntimeError):
    """The job finished (a node's workers all succeeded) before this node could join it: there is
    no world left to join, and nothing to do but exit 0."""


class _MemberGone(ElasticEmbError, TimeoutError):
    """A store wait ended because a member of the generation left the rendezvous."""


# -- state transport -----------------------------------------------------------------------------


class _CommAborted(ElasticEmbError, RuntimeError):
    """A wait of a state communicator that was aborted (a peer died; ``state.comm.Comm.abort``)."""


class _PullError(ElasticEmbError, OSError):
    """A cross-memory pull from a peer failed; the caller sends that peer's rows another way."""


class StorageError(ElasticEmbError, OSError):
    """A commit could not be written (full or read-only storage): the message names the path, the
    bytes needed and the bytes free; the partial commit was removed and older commits are kept."""


class InvalidIds(ElasticEmbError, IndexError):
    """ids passed to lookup/apply_gradients are not a 1-D integer tensor of rows in range."""


class PeerLookupError(ElasticEmbError, RuntimeError):
    """Another rank passed invalid ids to the same collective call; this call was cancelled on
    every rank (the communicator stays usable).

    Args:
        message: the call and the fault.
        ranks: kept as ``ranks``: the ranks at fault.
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class CommunicationError(ElasticEmbError, RuntimeError):
    """A collective of the context failed or timed out; the context is now unhealthy."""


class TransferInterrupted(_CommAborted, CommunicationError):
    """A wait on a tensor transfer (a context's collective, a state communicator's point-to-point
    or all-to-all transfer) ended because a peer is known gone (``Group.interrupt``,
    ``Comm.abort``; ``elastic_emb.work_wait``). Both a :class:`CommunicationError` and a
    :class:`_CommAborted`: whoever catches either handles it."""


class CollectiveMismatch(ElasticEmbError, RuntimeError):
    """Ranks made different calls at the same point (say ``lookup('a')`` on one rank and
    ``apply_gradients('a')`` or ``lookup('b')`` on another). Detected in the count exchange, on
    every rank, before any id or row moves; the context stays usable."""


class NonFiniteGradients(ElasticEmbError, ValueError):
    """``apply_gradients`` was given NaN or infinite gradients; no row of that call was changed.

    Args:
        message: the table, the count and what to do.
        table: kept as ``table``: the table's name.
        rows: kept as ``rows``: how many rows had a gradient that was not finite.
    """

    def __init__(self, message: str, table: str, rows: int) -> None:
        super().__init__(message)
        self.table = table
        self.rows = rows


# -- internal signals: raised and caught inside the library, never reaching a caller ------------


class _FoldCancelled(ElasticEmbError, RuntimeError):
    """A fold of a delta chain into a base was cancelled (a resize, the exit) before its manifest
    swap: the delta stays as it was (``elastic_emb/state/compact.py``)."""
