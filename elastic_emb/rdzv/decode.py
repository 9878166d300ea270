"""The restricted decoder of torch's rendezvous state, and the one view of it that the agent and
the workers share.

torch keeps its ``_RendezvousState`` in the store as ``base64(pickle(state))``. Unpickling that
with ``pickle.loads`` runs whatever code a writer to the store chose, so nothing in elastic_emb
does: :func:`load_state` uses an unpickler whose ``find_class`` admits only the classes the
state is made of (torch's ``_RendezvousState`` and ``_NodeDesc``, ``datetime``'s
``datetime``/``timezone``/``timedelta``, ``set``/``frozenset``) and raises
:class:`UnsafeStateError` for anything else before any object of that class is made. The
agent-side backend runs every state it reads through it before torch's own ``pickle.loads``
sees the bytes (``handler.py``), and the workers decode with it.

:class:`RendezvousView` is plain data (no torch classes): round, complete, closed, the
participants in group-rank order, the wait list and the redundancy list. Built from bytes
(:func:`decode_state`, the workers) or from a live torch state object (:meth:`RendezvousView.of`,
the agent). A node id is ``addr_pid_localid`` (torch's ``_NodeDesc`` repr).

Importing this module does not import torch: the allowed class names are strings, resolved by
the unpickler only when a state is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

from pydantic import BaseModel, ConfigDict

from elastic_emb.errors import UnsafeStateError

DR_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
ALLOWED_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {
        (DR_MODULE, "_RendezvousState"),
        (DR_MODULE, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_CLASSES:
            raise UnsafeStateError(
                f"rendezvous state names {module}.{name}, which is not an allowed class "
                f"({sorted(f'{m}.{n}' for m, n in ALLOWED_CLASSES)}): refusing to decode it. Someone "
                f"wrote a foreign value to the rendezvous store; check who can reach the endpoint"
            )
        return super().find_class(module, name)


def load_state(data: bytes) -> Any:
    """Unpickle torch's ``_RendezvousState`` from its pickle bytes, admitting only its classes.

    Raises :class:`UnsafeStateError` for a foreign class, bytes that do not unpickle, or an
    object that is not a ``_RendezvousState``.
    """
    try:
        state = _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafeStateError:
        raise
    except Exception as exc:
        raise UnsafeStateError(f"rendezvous state does not unpickle ({type(exc).__name__}: {exc})") from None
    if type(state).__name__ != "_RendezvousState" or type(state).__module__ != DR_MODULE:
        raise UnsafeStateError(
            f"rendezvous state decoded to {type(state).__module__}.{type(state).__name__}, not _RendezvousState"
        )
    return state


def dump_state(state: Any) -> bytes:
    """Pickle a state object as torch's state holder does (the agent re-writes a credited state)."""
    return pickle.dumps(state)


def node_id(node: Any) -> str:
    """The id of a torch ``_NodeDesc``: ``addr_pid_localid`` (its repr)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


class Participant(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str  # addr_pid_localid
    addr: str
    pid: int
    rank: int


class RendezvousView(BaseModel):
    """The rendezvous state as plain data: what both sides of the backend reason about."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    round: int
    complete: bool
    closed: bool
    participants: tuple[Participant, ...]  # in group-rank order
    wait_list: tuple[str, ...]
    redundancy_list: tuple[str, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """Participant node ids in group-rank order."""
        return tuple(p.node for p in self.participants)

    @classmethod
    def of(cls, state: Any) -> "RendezvousView":
        """The view of a torch ``_RendezvousState`` object (live, or from :func:`load_state`)."""
        try:
            parts = sorted(state.participants.items(), key=lambda kv: (int(kv[1]), node_id(kv[0])))
            return cls(
                round=int(state.round),
                complete=bool(state.complete),
                closed=bool(state.closed),
                participants=tuple(
                    Participant(node=node_id(n), addr=str(n.addr), pid=int(n.pid), rank=int(r)) for n, r in parts
                ),
                wait_list=tuple(sorted(node_id(n) for n in state.wait_list)),
                redundancy_list=tuple(sorted(node_id(n) for n in getattr(state, "redundancy_list", ()))),
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise UnsafeStateError(f"rendezvous state has an unexpected shape: {exc}") from None

    @classmethod
    def of_nodes(cls, round_: int, nodes: tuple[str, ...], wait_list: tuple[str, ...] = (), *,
                 complete: bool = True, closed: bool = False) -> "RendezvousView":
        """A view from node ids alone (rank = position; addr and pid from ``addr_pid_localid``
        when the id has that form)."""
        def part(i: int, n: str) -> Participant:
            bits = n.rsplit("_", 2)
            if len(bits) == 3 and bits[1].isdigit():
                return Participant(node=n, addr=bits[0], pid=int(bits[1]), rank=i)
            return Participant(node=n, addr=n, pid=0, rank=i)

        return cls(round=round_, complete=complete, closed=closed,
                   participants=tuple(part(i, n) for i, n in enumerate(nodes)), wait_list=tuple(wait_list))


def decode_state(raw: bytes) -> RendezvousView:
    """Decode ``base64(pickle(_RendezvousState))`` (what the store holds) with the restricted unpickler."""
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnsafeStateError(f"rendezvous state {raw[:60]!r} is not base64: {exc}") from None
    return RendezvousView.of(load_state(data))
