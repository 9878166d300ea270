"""The training state beside the tables: a dense model, its optimizer, a schedule, a sampler.

Replicated objects that follow DCP's ``Stateful`` convention, passed to
:meth:`~elastic_emb.Lifecycle.start` as ``app_state``. A commit copies their state dicts on the
training thread (:func:`capture`); the commit's writer serializes them into ``app.pt`` in the
commit's directory (one per node) before the manifest, which records its size and CRC32. A restore
(:func:`restore`) brings every rank to the tables' step: live objects, the node's file, the
durable tier's copy (rank 0's), or a peer's bytes over the state communicator.
Design: ``docs/TRAINING.md``, section "The rest of the training state".
"""

from __future__ import annotations

import io
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from elastic_emb.errors import ConfigError, RestoreError
from elastic_emb.events import get_logger
from elastic_emb.state.manifest import commit_dirname
from elastic_emb.state.paths import open_new

log = get_logger("elastic_emb.state")

APP_FILE = "app.pt"
"""The app state's file in a commit directory (one per node: the node's first rank writes it)."""


def rank_state_file(rank: int) -> str:
    """The file of one rank's own state in a commit's directory (derived, never read from a manifest).

    Args:
        rank: the rank that wrote it.

    Returns:
        ``rank<rank>.state.pt``.
    """
    return f"rank{int(rank)}.state.pt"


MAX_APP_BYTES = 64 << 30
"""The largest app state a manifest or a peer may announce (64 GiB): a larger size is refused
before any memory is allocated for it."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


@runtime_checkable
class Stateful(Protocol):
    """What an app-state object provides (DCP's ``Stateful`` convention)."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state.

        Returns:
            Tensors, numbers, strings and containers of them (what ``torch.load(weights_only=True)``
            reads back).
        """
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Take a state :meth:`state_dict` returned.

        Args:
            state_dict: the state.

        Returns:
            Anything (ignored).
        """
        ...


def check_app_state(app_state: Mapping[str, Any] | None, what: str = "app_state") -> dict[str, Stateful]:
    """Validate the app-state objects a lifecycle was given.

    Args:
        app_state: name -> object with ``state_dict`` and ``load_state_dict``; None for none.
        what: the argument's name, for the errors (``app_state`` or ``rank_state``).

    Returns:
        The objects, as a new dict in the given order.

    Raises:
        ConfigError: ``app_state`` is not a mapping, a name is not a plain name, or an object
            lacks one of the two methods (the message names it).
    """
    if app_state is None:
        return {}
    if not isinstance(app_state, Mapping):
        raise ConfigError(
            f"{what}={type(app_state).__name__}: pass a dict of name -> object with state_dict() and "
            "load_state_dict(), e.g. {'model': model, 'optim': optimizer}"
        )
    out: dict[str, Stateful] = {}
    for name, obj in app_state.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"{what} name {name!r}: use a plain name (letters, digits, '_', '.', '-'; 64 characters at most)"
            )
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise ConfigError(
                    f"{what}[{name!r}] ({type(obj).__name__}) has no {method}(): pass an object that follows "
                    "the Stateful convention (an nn.Module, an optimizer, a scheduler, an ElasticSampler), or "
                    "wrap it in one"
                )
        out[name] = obj
    return out


def check_states(app_state: Mapping[str, Any] | None, rank_state: Mapping[str, Any] | None):
    """Validate a lifecycle's replicated and per-rank objects together (:func:`check_app_state`).

    Args:
        app_state: the replicated objects, or None.
        rank_state: the per-rank objects, or None.

    Returns:
        ``(app_state, rank_state)`` as validated dicts.

    Raises:
        ConfigError: as :func:`check_app_state`, or a name is in both.
    """
    shared, own = check_app_state(app_state), check_app_state(rank_state, what="rank_state")
    if set(shared) & set(own):
        raise ConfigError(
            f"names {sorted(set(shared) & set(own))} are in both app_state and rank_state: "
            "a state is either replicated or per rank"
        )
    return shared, own


def _map_tensors(fn, value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, containers rebuilt, anything else
    (numbers, strings) as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(fn, v) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(fn, v) for v in value)
    return value


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()  # on its device: a copy that later steps cannot change


def capture(objects: Mapping[str, Stateful]) -> dict[str, Any]:
    """Copy every object's state dict now (the training thread: the next step changes them).

    Args:
        objects: the validated app-state objects.

    Returns:
        name -> a copy of its state dict.
    """
    return {name: _map_tensors(_clone, obj.state_dict()) for name, obj in objects.items()}


def to_bytes(state: Mapping[str, Any]) -> bytes:
    """Serialize captured app state (``torch.save``; tensors moved to the CPU).

    Args:
        state: what :func:`capture` returned.

    Returns:
        The bytes of ``app.pt``.
    """
    buf = io.BytesIO()
    torch.save(_map_tensors(torch.Tensor.cpu, state), buf)
    return buf.getvalue()


class _Counting:
    """A file's writer that keeps the CRC32 and the size of what went through it."""

    def __init__(self, f) -> None:
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def write_file(path, state: Mapping[str, Any], mode: int) -> tuple[int, int]:
    """Serialize captured app state straight into a new file (no copy of it in memory) and fsync.

    Args:
        path: the file (created or truncated).
        state: what :func:`capture` returned.
        mode: the file's permissions.

    Returns:
        ``(bytes written, CRC32)``, for the manifest.

    Raises:
        OSError: the file could not be written (full or read-only storage).
    """
    with open_new(path, mode) as f:
        out = _Counting(f)
        torch.save(_map_tensors(torch.Tensor.cpu, state), out)
        f.flush()
        os.fsync(f.fileno())
    return out.size, out.crc & 0xFFFFFFFF


def crc32(data: bytes | memoryview) -> int:
    """The CRC32 a manifest records for an app file.

    Args:
        data: the file's bytes.

    Returns:
        The unsigned CRC32.
    """
    return zlib.crc32(data) & 0xFFFFFFFF


def from_bytes(data: bytes, names: list[str], where: str) -> dict[str, Any]:
    """Decode app-state bytes read from a commit or a peer: untrusted, so ``weights_only``.

    Args:
        data: the bytes.
        names: the names the lifecycle was given.
        where: where the bytes came from, for the error.

    Returns:
        name -> state dict.

    Raises:
        RestoreError: the bytes do not decode, or their names are not ``names``.
    """
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RestoreError(
            f"app state from {where} does not decode ({type(exc).__name__}: {str(exc)[:200]}); "
            "move that commit aside or set start_fresh to start from the seed"
        ) from None
    if not isinstance(state, dict) or sorted(state) != sorted(names):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise RestoreError(
            f"app state from {where} holds {found}, this job passes app_state {sorted(names)}: "
            "pass the same names as the job that committed it"
        )
    return state


def load(objects: Mapping[str, Stateful], state: Mapping[str, Any], step: int) -> None:
    """Load restored state dicts into the objects, in the order they were given.

    Args:
        objects: the app-state objects.
        state: name -> state dict (:func:`from_bytes`).
        step: the restored step, for the error.

    Raises:
        RestoreError: an object refused its state (a shape mismatch, a missing key); the message
            names the object and its error.
    """
    for name, obj in objects.items():
        try:
            obj.load_state_dict(state[name])
        except Exception as exc:
            raise RestoreError(
                f"app_state[{name!r}] ({type(obj).__name__}) refused the state of step {step}: "
                f"{type(exc).__name__}: {str(exc)[:300]}; build it as the job that committed it did "
                "(same shapes and parameter groups)"
            ) from None


def read_file(path, size: int, crc: int) -> bytes | None:
    """Read a commit's app file and check it against its manifest.

    Args:
        path: the file.
        size: the bytes the manifest records.
        crc: the CRC32 the manifest records.

    Returns:
        The bytes, or None when the file is missing, of another size or corrupt (logged).
    """
    if not 0 <= size <= MAX_APP_BYTES:
        log.warning("app_state_file_invalid", path=str(path), error=f"size {size} out of range")
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except OSError as exc:
        log.warning("app_state_file_unreadable", path=str(path), error=str(exc)[:200])
        return None
    if len(data) != size or crc32(data) != crc:
        log.warning("app_state_file_corrupt", path=str(path), bytes=len(data), expected_bytes=size)
        return None
    return data


def _first_intact(manifests, dir_of, step: int, lineage: str | None) -> bytes | None:
    """The verified app bytes of ``step`` among ``manifests`` (of either tier), if any; a commit of
    another history than ``lineage`` is never read. ``dir_of(manifest)`` is its directory."""
    for m in manifests:
        if m.step != step or m.app_file is None or (lineage is not None and m.lineage not in (None, lineage)):
            continue
        data = read_file(dir_of(m) / m.app_file, m.app_bytes, m.app_crc)
        if data is not None:
            return data
    return None


def committed_file(snapshot, step: int, lineage: str | None) -> bytes | None:
    """The verified app bytes of ``step`` in this node's directory, if any.

    Args:
        snapshot: the node's :class:`~elastic_emb.state.SnapshotTier`.
        step: the restored step.
        lineage: the restored history; a commit of another is never read.

    Returns:
        The bytes of the first intact copy, or None.
    """
    # (the data of a GPU delta lies in a log segment: the app file is in the commit's directory)
    return _first_intact(
        (m for _, m in snapshot.manifests()),
        lambda m: snapshot.node_dir / commit_dirname(m.step, m.fingerprint),
        step,
        lineage,
    )


def durable_file(durable, step: int, lineage: str | None) -> bytes | None:
    """The verified app bytes of ``step`` in the durable tier, if any.

    Args:
        durable: the :class:`~elastic_emb.state.DurableTier`, or None.
        step: the restored step.
        lineage: the restored history; a checkpoint of another is never read.

    Returns:
        The bytes, or None.
    """
    if durable is None:
        return None
    return _first_intact(durable.manifests(), lambda m: Path(m.checkpoint_dir), step, lineage)


def restore(
    objects: Mapping[str, Stateful],
    comm,
    snapshot,
    step: int,
    *,
    live: bool,
    lineage: str | None,
    start_fresh: bool = False,
    durable=None,
) -> str:
    """Bring every rank's app-state objects to the restored step ``step`` (collective).

    Args:
        objects: this rank's app-state objects (the same names on every rank).
        comm: the generation's state communicator.
        snapshot: this node's snapshot tier.
        step: the step the tables were restored to; -1: nothing committed, nothing to load.
        live: this rank's objects already hold ``step`` (an in-process survivor's).
        lineage: the restored history.
        start_fresh: with no copy of ``step`` anywhere, keep the objects as they are (logged)
            instead of raising.
        durable: the durable tier, read when this node's snapshots lack ``step``'s app state.

    Returns:
        Where this rank's state came from: ``"none"``, ``"live"``, ``"file"`` or ``"peer"``.

    Raises:
        RestoreError: the ranks pass different names, or nobody holds the state of ``step``
            (its commit predates app state, or every copy is lost or corrupt).
    """
    names = list(objects)
    data = None
    if step >= 0 and names and not live:
        data = committed_file(snapshot, step, lineage)
        if data is None:
            data = durable_file(durable, step, lineage)
    offer = {"names": names, "live": bool(live and names), "file": data is not None}
    everyone = comm.exchange(f"app-offer-{step}", offer)
    if any(sorted(e["names"]) != sorted(names) for e in everyone):
        raise RestoreError(
            f"the ranks pass different app_state names: {[e['names'] for e in everyone]} (by rank); "
            "every rank must pass the same app_state"
        )
    if step < 0 or not names:
        return "none"
    holders = [r for r, e in enumerate(everyone) if e["live"] or e["file"]]
    lacking = [r for r, e in enumerate(everyone) if not (e["live"] or e["file"])]
    if not holders:
        message = (
            f"no rank holds the app state ({names}) of the restored step {step}: its commit predates app state, "
            "or every copy is lost or corrupt"
        )
        if not start_fresh:
            raise RestoreError(f"{message}; restore an older commit, or set start_fresh to keep the objects as built")
        log.warning("app_state_missing", step=step, names=names, error=message)
        return "none"
    me = comm.rank
    source = holders[0]
    blob = b""
    if lacking and me == source:
        blob = data if data is not None else to_bytes(capture(objects))
    sizes = comm.exchange(f"app-size-{step}", {"bytes": len(blob), "crc": crc32(blob)} if me == source else None)
    announced = sizes[source]
    if lacking:
        if not isinstance(announced, dict) or not 0 <= int(announced.get("bytes", -1)) <= MAX_APP_BYTES:
            raise RestoreError(f"rank {source} announced app state of {announced!r}: not a size in 0..{MAX_APP_BYTES}")
        send = [torch.empty(0, dtype=torch.uint8) for _ in range(comm.size)]
        if me == source:
            payload = (
                torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
            )
            for r in lacking:
                send[r] = payload
        recv = [int(announced["bytes"]) if (r == source and me in lacking) else 0 for r in range(comm.size)]
        got = comm.all_to_all(send, recv)
        if me in lacking:
            received = got[source].cpu().numpy().tobytes()
            if crc32(received) != int(announced["crc"]):
                raise RestoreError(f"app state of step {step} from rank {source} arrived corrupt (CRC32 mismatch)")
            data = received
    if live:
        return "live"
    load(objects, from_bytes(data, names, f"step {step}"), step)
    return "file" if offer["file"] else "peer"


def restore_rank_state(
    objects: Mapping[str, Stateful],
    snapshot,
    step: int,
    *,
    rank: int,
    world_size: int,
    live: bool,
    lineage: str | None,
) -> str:
    """Bring this rank's own state (``rank_state``) to the restored step, when it can be.

    Per-rank state has no meaning at another rank or world size, so it is restored only to the
    rank that wrote it, at the world size it was written at, from this node's commit of ``step``
    (local: no collective). Otherwise the objects keep what they hold (as built, or live) and a
    warning (``rank_state_not_restored``) says why.

    Args:
        objects: this rank's own stateful objects.
        snapshot: this node's snapshot tier.
        step: the restored step (-1: nothing to restore).
        rank: this rank now.
        world_size: the world size now.
        live: the objects already hold ``step`` at this rank and world size.
        lineage: the restored history.

    Returns:
        ``"none"``, ``"live"``, ``"file"`` or ``"not_restored"``.

    Raises:
        RestoreError: the file's names are not the objects' names, or an object refuses its state.
    """
    if not objects or step < 0:
        return "none"
    if live:
        return "live"
    reason = f"no commit of step {step} by rank {rank} at world size {world_size} on this node"
    for _, m in snapshot.manifests():
        if (
            m.step != step
            or m.replica
            or not m.rank_state
            or m.source_rank != rank
            or m.world_size != world_size
            or (lineage is not None and m.lineage not in (None, lineage))
        ):
            continue
        path = snapshot.node_dir / commit_dirname(m.step, m.fingerprint) / rank_state_file(rank)
        data = read_file(path, m.rank_state_bytes, m.rank_state_crc)
        if data is None:
            reason = f"{path} is missing or corrupt"
            continue
        load(objects, from_bytes(data, list(objects), str(path)), step)
        return "file"
    log.warning(
        "rank_state_not_restored",
        step=step,
        rank=rank,
        world_size=world_size,
        names=list(objects),
        reason=reason,
        outcome="the per-rank objects keep their state (as built after a start)",
    )
    return "not_restored"
