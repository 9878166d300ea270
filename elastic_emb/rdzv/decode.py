"""The restricted decoder of torch's rendezvous state, and the one view of it both sides share.

- :func:`load_state`: unpickles torch's ``_RendezvousState``, admitting only the classes it is made of;
- :func:`decode_state`: the store's ``base64(pickle(state))`` to a :class:`RendezvousView`;
- :class:`RendezvousView`: the state as plain data (round, participants in group-rank order, wait list).

Importing this module does not import torch.
Design: ``docs/RDZV.md`` (section "Decoding torch's state").
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

    Args:
        data: the pickle bytes (not base64).

    Returns:
        torch's ``_RendezvousState`` object.

    Raises:
        UnsafeStateError: for a class outside :data:`ALLOWED_CLASSES` (before any object of it is
            made), bytes that do not unpickle, or an object that is not a ``_RendezvousState``.
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
    """Pickle a state object as torch's state holder does (the agent re-writes a credited state).

    Args:
        state: torch's ``_RendezvousState`` object.

    Returns:
        The pickle bytes.
    """
    return pickle.dumps(state)


def node_id(node: Any) -> str:
    """The id of a torch ``_NodeDesc``: ``addr_pid_localid`` (its repr).

    Args:
        node: torch's ``_NodeDesc`` (anything with ``addr``, ``pid`` and ``local_id``).

    Returns:
        The node id.
    """
    return f"{node.addr}_{node.pid}_{node.local_id}"


class Participant(BaseModel):
    """One participant of a round: its node id, address, pid and group rank."""

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
        """The view of a torch ``_RendezvousState`` object.

        Args:
            state: a live state object, or one from :func:`load_state`.

        Returns:
            The view; participants sorted by group rank, the lists by node id.

        Raises:
            UnsafeStateError: when the object lacks a field or a field has an unexpected type.
        """
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
    def of_nodes(
        cls,
        round_: int,
        nodes: tuple[str, ...],
        wait_list: tuple[str, ...] = (),
        *,
        complete: bool = True,
        closed: bool = False,
    ) -> "RendezvousView":
        """A view from node ids alone (rank = position; addr and pid from ``addr_pid_localid``
        when the id has that form, else the id and 0).

        Args:
            round_: the rendezvous round.
            nodes: participant node ids in group-rank order.
            wait_list: node ids waiting for the next round.
            complete: whether the round is complete.
            closed: whether the rendezvous is closed.

        Returns:
            The view.
        """

        def part(i: int, n: str) -> Participant:
            bits = n.rsplit("_", 2)
            if len(bits) == 3 and (bits[1].isascii() and bits[1].isdigit()):
                return Participant(node=n, addr=bits[0], pid=int(bits[1]), rank=i)
            return Participant(node=n, addr=n, pid=0, rank=i)

        return cls(
            round=round_,
            complete=complete,
            closed=closed,
            participants=tuple(part(i, n) for i, n in enumerate(nodes)),
            wait_list=tuple(wait_list),
        )


def decode_state(raw: bytes) -> RendezvousView:
    """Decode ``base64(pickle(_RendezvousState))`` (what the store holds) with the restricted unpickler.

    Args:
        raw: the value read from the store.

    Returns:
        The view of the state.

    Raises:
        UnsafeStateError: when ``raw`` is not base64, or as :func:`load_state` and
            :meth:`RendezvousView.of` raise it.
    """
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnsafeStateError(f"rendezvous state {raw[:60]!r} is not base64: {exc}") from None
    return RendezvousView.of(load_state(data))
