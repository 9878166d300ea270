"""What a commit is on disk: the manifest records, commit ids, checksums and atomic writes.

* :class:`CommitId`: a commit's identity ``(step, generation, fingerprint)``, newer compares greater.
* :class:`SnapshotManifest`, :class:`DurableManifest`: the JSON records a commit ends with, made of
  :class:`ShardRecord` and :class:`TensorRecord` (untrusted input: parsed with ``extra="forbid"``).
* :func:`write_atomic`: how every manifest is written (temporary file, fsync, rename).
* :func:`tensor_items`, :func:`row_spec`, :func:`row_bytes`, :func:`checksum`: a shard's row-wise tensors.

Design: ``docs/COMMIT.md`` (section "Commits and manifests").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from elastic_emb.protocol import ShardData
from elastic_emb.state.crc import crc32_of

MANIFEST_VERSION = 1


class CommitId(NamedTuple):
    """Which commit a piece of state belongs to. Tuple order is age order: newer compares greater."""

    step: int
    generation: int
    fingerprint: str

    @classmethod
    def parse(cls, value) -> "CommitId":
        """Parse the JSON form of a commit id (untrusted input).

        Args:
            value: a list or tuple ``[step, generation, fingerprint]``.

        Returns:
            The commit id.

        Raises:
            ValueError: if ``value`` is not three elements of types int, int, str.
        """
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 3
            or not isinstance(value[0], int)
            or not isinstance(value[1], int)
            or not isinstance(value[2], str)
        ):
            raise ValueError(f"commit id {value!r} must be [step:int, generation:int, fingerprint:str]")
        return cls(int(value[0]), int(value[1]), str(value[2]))

    def __str__(self) -> str:
        return f"step {self.step} (generation {self.generation}, topology {self.fingerprint})"


# ---------------------------------------------------------------------------------------------
# Row-wise tensors of a shard, their bytes and checksums
# ---------------------------------------------------------------------------------------------


def tensor_items(shard: ShardData) -> list[tuple[str, torch.Tensor]]:
    """The row-wise tensors of a shard in canonical order: weight, then slots by name.

    Args:
        shard: the shard.

    Returns:
        ``(name, tensor)`` pairs, ``"weight"`` first.
    """
    return [("weight", shard.weight)] + [(k, shard.slots[k]) for k in sorted(shard.slots)]


def row_spec(t: torch.Tensor) -> list:
    """The ``[dtype, per-row shape]`` of a row-wise tensor.

    Args:
        t: the tensor (rows along dimension 0).

    Returns:
        ``[dtype name without "torch.", list of the dimensions after the first]``.
    """
    return [str(t.dtype).removeprefix("torch."), list(t.shape[1:])]


def row_bytes(spec: list) -> int:
    """Bytes of one row of a tensor with this ``[dtype, per-row shape]``.

    Args:
        spec: a :func:`row_spec`.

    Returns:
        The row's size in bytes.
    """
    dtype = getattr(torch, spec[0])
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def specs_of(shards: dict[str, ShardData]) -> dict[str, list]:
    """Per table, the ``[dtype, per-row shape]`` of each of its tensors in canonical order.

    Args:
        shards: table name -> shard.

    Returns:
        Table name -> list of :func:`row_spec`, in :func:`tensor_items` order.
    """
    return {name: [row_spec(t) for _, t in tensor_items(s)] for name, s in shards.items()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (moved to the CPU, made contiguous if needed).

    Args:
        t: any tensor (detached first).

    Returns:
        A 1-D uint8 CPU tensor over the same bytes, or over a copy when a move or a contiguous
        copy was needed.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def checksum(t: torch.Tensor) -> int:
    """zlib's CRC32 of a tensor's bytes, computed on the checksum threads.

    Args:
        t: the tensor (copied to the CPU when needed).

    Returns:
        The CRC32, as :func:`elastic_emb.state.crc.crc32_of` computes it.
    """
    return crc32_of(as_bytes(t).numpy())


# ---------------------------------------------------------------------------------------------
# Manifest records
# ---------------------------------------------------------------------------------------------


class TensorRecord(BaseModel):
    """One row-wise tensor's bytes inside a shard file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    dtype: str
    row_shape: list[int]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    crc32: int  # the checksum of the bytes by ``algorithm``, whichever it is (not only CRC32)
    # elastic_emb.state.digest: "crc32" (zlib) or "xxh3_64" (GPU-captured deltas); absent: "crc32"
    algorithm: Literal["crc32", "xxh3_64"] = "crc32"

    @model_validator(mode="after")
    def _value_fits(self) -> "TensorRecord":
        bits = 64 if self.algorithm == "xxh3_64" else 32
        if not -1 <= self.crc32 < 1 << bits:  # -1: not computed yet (a capture in flight)
            raise ValueError(f"tensor {self.name!r}: checksum {self.crc32} does not fit {self.algorithm} ({bits} bits)")
        return self


class ShardRecord(BaseModel):
    """One table's rows in one shard file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    table: str
    num_rows: int = Field(ge=1)
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    tensors: list[TensorRecord]


LINEAGE_PATTERN = r"^[0-9a-f]{32}$"  # a uuid4's hex


class CommitRecord(BaseModel):
    """What every manifest of either tier says about its commit."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = MANIFEST_VERSION
    step: int = Field(ge=0)
    generation: int = Field(ge=0)
    fingerprint: str
    run_id: str
    world_size: int
    written_at: float
    # The history this commit belongs to: chosen when the run starts from the seed, kept by every
    # restore after. Two lineages among one run's commits are two histories (a run started over
    # beside its own state); None: written before lineages were recorded.
    lineage: str | None = Field(default=None, pattern=LINEAGE_PATTERN)
    # The job's app state of this step (elastic_emb.state.app): always ``app.pt`` in the commit's
    # directory, written by the node's first rank (snapshot) or by rank 0 (durable); None: none here.
    app_file: Literal["app.pt"] | None = None
    app_bytes: int = Field(default=0, ge=0)
    app_crc: int = Field(default=0, ge=0, le=0xFFFFFFFF)

    @property
    def commit(self) -> CommitId:
        return CommitId(self.step, self.generation, self.fingerprint)


class SnapshotManifest(CommitRecord):
    """The commit marker of one rank's shard in one node directory (own copy or replica)."""

    kind: Literal["snapshot"] = "snapshot"
    ep_size: int
    source_rank: int
    source_node: str
    holder_node: str
    replica: bool
    data_file: str
    data_bytes: int
    shards: list[ShardRecord]
    parent: CommitId | None = None  # a delta commit: the commit it changes (None: a full base image)
    folded_from: CommitId | None = None  # a base folded from a delta on this commit (state/compact.py)
    # A delta landed in a log segment (elastic_emb.state.ring): its bytes are
    # ``<node dir>/log/<segment>[segment_offset: segment_offset + data_bytes]``, not ``data_file``.
    segment: str | None = None
    segment_offset: int = Field(default=0, ge=0)
    # The rank's own state (elastic_emb.state.app, ``rank_state``): ``rank<source_rank>.state.pt``
    # in the commit's directory (the name is derived, never read from here); False: none.
    rank_state: bool = False
    rank_state_bytes: int = Field(default=0, ge=0)
    rank_state_crc: int = Field(default=0, ge=0, le=0xFFFFFFFF)
    # A base whose file the applier writes deltas into in place (elastic_emb.state.inplace): its
    # rows are checked by the per-row hashes in ``row_hashes`` (a file in the commit's directory),
    # no longer by the tensors' checksums. ``applied``: the newest delta of its chain written into
    # the file (the base then stands for that commit); ``applying``: a batch through that delta is
    # being written, so rows of the deltas up to it may be either value until they are replayed.
    row_hashes: str | None = None
    applied: CommitId | None = None
    applying: CommitId | None = None


class DurableManifest(CommitRecord):
    """The commit marker of one DCP checkpoint, written by rank 0 after DCP finished."""

    kind: Literal["durable"] = "durable"
    tables: dict[str, int]  # table -> num_rows
    tensors: dict[str, list]  # "<table>.<name>" -> [dtype, row_shape]
    checksums: dict[str, dict[str, list]]  # "<table>.<name>" -> {rank: [start, stop, crc32]}
    checkpoint_dir: str


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a file so that readers see either nothing or all of it (write, fsync, rename).

    Args:
        path: the file to write; a temporary file next to it is renamed over it.
        text: the content.
        mode: the file's permissions (owner-only by default).
    """
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit_dirname(step: int, fingerprint: str) -> str:
    """The directory name of a commit: zero-padded step (sorts by age), then the fingerprint.

    Args:
        step: the commit's step.
        fingerprint: the topology fingerprint of its generation.

    Returns:
        ``step-<12-digit step>-<fingerprint>``.
    """
    return f"step-{step:012d}-{fingerprint}"


def step_of_dirname(name: str) -> int:
    """The step a commit directory name carries.

    Args:
        name: a directory name, as :func:`commit_dirname` makes them.

    Returns:
        The step, or -1 for a name that is not a commit directory's.
    """
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return -1
