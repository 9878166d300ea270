"""The lifecycle's records: its configuration and the reports of what a commit and a resize did.

Immutable pydantic records, kept apart from :mod:`elastic_emb.lifecycle.manager` (which acts on
them) so that callers, the CLI and the docs can read the shapes without the machinery:
:class:`LifecycleConfig`, :class:`CommitReport` and :class:`ResizeEvent`, what each
``lifecycle.resize`` log event carries, phase by phase (``docs/RESIZE.md``, section "Events").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from elastic_emb import config
from elastic_emb.state import node_id_from_env


class LifecycleConfig(BaseModel):
    """Where state lives and how often it is committed.

    ``state_dir``: root of the node-local snapshots (default: env ``ELASTIC_EMB_STATE_DIR``, else
    ``/dev/shm/elastic_emb``); shards go to ``<state_dir>/<run_id>/<node_id>/``.
    ``durable_dir``: DCP checkpoints (default: env ``ELASTIC_EMB_DURABLE_DIR``; none if unset).
    ``node_id``: default env ``ELASTIC_EMB_NODE_ID``, else the host name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: str | None = None
    durable_dir: str | None = None
    node_id: str | None = None
    commit_every: int = Field(default=1, ge=1)
    durable_every: int = Field(default=0, ge=0)  # 0: never (unless durable_dir is set: then every commit)
    replication: int = Field(default=1, ge=0)
    durable_async: bool = True  # the DCP save of a copy of the shard runs in a thread; False: in commit()
    keep: int = Field(default=2, ge=1)
    agree_timeout: float = Field(default=60.0, gt=0)
    transfer_timeout: float = Field(default=300.0, gt=0)
    require_state: bool = False
    # commit() returns once the rows are captured and a background thread writes them (True), or
    # writes them itself (False); None (the default): in the background when commits are incremental
    # (the context tracks its changes), else synchronous full snapshots.
    async_commit: bool | None = None
    incremental: bool = True  # commits write the rows changed since the last one (contexts that track changes)
    # Applying in place (elastic_emb/state/inplace.py), the default: after a chain's base every
    # commit is a delta, on the host and the GPU path alike, and each holder writes the deltas it
    # holds into the base in place in the background (no fold pass, no base captured again). A
    # chain still starts at a base after every re-form and after a commit that failed. False: the
    # older rules below (fold on the host, a captured base every max_chain + 1 commits on the GPU).
    apply_in_place: bool = True
    # Compaction (elastic_emb/state/compact.py), with apply_in_place=False. Each holder folds a chain of host-captured deltas
    # into a base in the background, at the commit where what a restore would read of some rank's
    # deltas since the last base or fold point (bytes, plus 2 MiB a file) reaches fold_ratio of its
    # shard's bytes, or after fold_max_deltas deltas, never sooner than max_chain deltas after the
    # last. With fold=False, and always on the GPU capture path, a full base is captured every
    # max_chain + 1 commits instead.
    fold: bool = True
    fold_ratio: float = Field(default=0.25, gt=0)
    fold_max_deltas: int = Field(default=32, ge=1)
    max_chain: int = Field(default=8, ge=0)  # deltas on a captured base before the next (folding: least between folds)
    start_fresh: bool = False  # this run committed before but no commit is complete: start over instead of failing
    # A commit the state directory refuses (StorageError: a full disk, a read-only mount): "skip"
    # logs lifecycle.commit_skipped, counts it (elastic_emb_commits_failed) and training goes on,
    # committed_step unchanged; the next commit that succeeds is a full base, so no row is missed.
    # "raise": commit() raises the StorageError (the worker exits and its agent restarts it).
    storage_errors: Literal["skip", "raise"] = "skip"
    file_mode: int = Field(default=0o600, ge=0, le=0o777)  # of the files the state tiers write
    dir_mode: int = Field(default=0o700, ge=0, le=0o777)  # of the directories they create

    @model_validator(mode="after")
    def _check(self) -> "LifecycleConfig":
        if self.durable_every and self.durable_every % self.commit_every:
            raise ValueError(
                f"durable_every={self.durable_every} must be a multiple of commit_every={self.commit_every} "
                f"(a durable checkpoint is taken at a commit)"
            )
        return self

    def resolved(self, env: Mapping[str, str]) -> "LifecycleConfig":
        """A copy with the environment's defaults filled in.

        Every ``ELASTIC_EMB_*`` variable is validated here, so a bad one fails the start.

        Args:
            env: the environment to read.

        Returns:
            The configuration with ``state_dir``, ``durable_dir``, ``durable_every`` and
            ``node_id`` set (a ``durable_dir`` without ``durable_every`` makes every commit durable).

        Raises:
            ConfigError: an ``ELASTIC_EMB_*`` variable is malformed (the error names it).
        """
        settings = config.load(env)
        durable = self.durable_dir or settings.durable_dir
        durable_every = self.durable_every or (self.commit_every if durable else 0)
        return self.model_copy(
            update=dict(
                state_dir=self.state_dir or settings.state_dir,
                durable_dir=durable,
                durable_every=durable_every,
                node_id=self.node_id or node_id_from_env(env),
            )
        )


class CommitReport(BaseModel):
    """What one commit wrote: its step, the tiers, the bytes per tier and the seconds in ``commit()``.

    A background commit reports the bytes captured; its writer logs ``commit_complete`` with the
    bytes written and replicated.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    step: int
    tiers: list[str]
    bytes_snapshot: int
    bytes_replicated: int
    bytes_durable: int
    seconds: float


class ResizeEvent(BaseModel):
    """One membership change handled: what was done and how long each phase took."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str  # "reset" (same size) | "rebuild" (new size) | "start"
    old_world_size: int | None
    new_world_size: int
    old_generation: int | None
    new_generation: int
    rank: int
    teardown_s: float
    agreement_s: float
    construct_s: float
    restore_s: float
    transfer_s: float = 0.0  # the row exchange inside restore
    total_s: float
    bytes_moved: int
    bytes_local: int
    source_tiers: list[str]
    shard_tiers: dict[str, list[list]]
    restored_step: int
    committed_before: bool
    fallback: str | None = None
    transport: str | None = None  # how rows moved between ranks (RestoreReport.transport)
    mode: str | None = None  # "in_process" when resize.InProcessResize drove the change
    pid: int = Field(default_factory=os.getpid)  # in process: the same pid before and after
    # The phases before the lifecycle's own (from the caller that drove the change; 0 otherwise):
    detect_s: float = Field(default=0.0, ge=0)  # establishing the change (who left, who joins)
    drain_s: float = Field(default=0.0, ge=0)  # from seeing it to the step boundary that re-forms
    decide_s: float = Field(default=0.0, ge=0)  # the new generation's membership published and read
    # Restore done -> the first commit() of the new world (the first step's lookups and updates);
    # None until that step ends (or when the world closed or changed again before it).
    first_step_s: float | None = Field(default=None, ge=0)

    @classmethod
    def of(
        cls,
        kind: str,
        old,
        new,
        *,
        teardown: float,
        agreement: float,
        construct: float,
        restore_s: float,
        total: float,
        report,
        committed: bool,
    ) -> "ResizeEvent":
        """The event of a change from topology ``old`` to ``new``.

        Args:
            kind: ``"start"``, ``"reset"`` or ``"rebuild"``.
            old: the topology before the change; None at start.
            new: the topology after it.
            teardown: seconds to close (or reset) the old context.
            agreement: seconds to agree on the new topology.
            construct: seconds to construct the new context.
            restore_s: seconds to restore the rows.
            total: seconds of the whole change.
            report: the restore's ``RestoreReport`` (bytes, tiers, restored step).
            committed: whether the live rows were committed before the change.

        Returns:
            The event, durations rounded to microseconds.
        """
        return cls(
            kind=kind,
            old_world_size=old.world_size if old else None,
            new_world_size=new.world_size,
            old_generation=old.generation if old else None,
            new_generation=new.generation,
            rank=new.rank,
            teardown_s=round(teardown, 6),
            agreement_s=round(agreement, 6),
            construct_s=round(construct, 6),
            restore_s=round(restore_s, 6),
            transfer_s=round(report.transfer_seconds, 6),
            total_s=round(total, 6),
            bytes_moved=report.bytes_moved,
            bytes_local=report.bytes_local,
            source_tiers=list(report.source_tiers),
            shard_tiers={t: [list(x) for x in v] for t, v in report.tiers.items()},
            restored_step=report.step,
            committed_before=committed,
            fallback=report.fallback,
            transport=report.transport,
        )


CALLER_PHASES = ("detect_s", "drain_s", "decide_s")  # the phases before the lifecycle's own


def completed_by_caller(
    event: ResizeEvent, aborted: float, mode: str | None, phases: Mapping[str, float] | None
) -> ResizeEvent:
    """``event`` with the phases of the caller that drove the change (``on_membership_change``).

    Args:
        event: the lifecycle's event of the change.
        aborted: seconds spent aborting the old context, added to ``teardown_s`` and ``total_s``.
        mode: how the change was driven (``"in_process"``), or None.
        phases: the caller's phases (``detect_s``, ``drain_s``, ``decide_s``), or None.

    Returns:
        The completed event, validated again.

    Raises:
        pydantic.ValidationError: a phase is negative.
    """
    extra = {k: round(float(v), 6) for k, v in (phases or {}).items()}
    return ResizeEvent.model_validate(
        {
            **event.model_dump(),
            **extra,
            "mode": mode,  # validated: phases >= 0
            "teardown_s": round(event.teardown_s + aborted, 6),
            "total_s": round(event.total_s + aborted, 6),
        }
    )
