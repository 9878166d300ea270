"""A run's history has one lineage: an id chosen when the run starts from the seed.

Every manifest records the lineage of the history it belongs to, and every restore keeps it. Two
lineages among the commits a restore sees are two histories of one run id: a node started from
the seed beside the job's committed state (its store was wiped, its directory was empty) and
trained on. Restoring either would silently drop the other's steps, so :func:`check` refuses,
naming both, unless the operator chose to start over (``LifecycleConfig.start_fresh``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from elastic_emb.errors import RestoreError
from elastic_emb.events import get_logger
from elastic_emb.state.manifest import CommitId

log = get_logger("elastic_emb.state")


def new_lineage() -> str:
    """A fresh lineage id (32 hex digits).

    Returns:
        The id.
    """
    return uuid.uuid4().hex


def check(held: Iterable[tuple[CommitId, str, str]], chosen: CommitId, *, run_id: str, start_fresh: bool) -> str | None:
    """The lineage of the commit a restore chose, once no other history is in sight.

    Args:
        held: ``(commit, lineage, where)`` for every commit any rank can supply (``where``: a node
            id, ``"durable"`` or ``"live"``); commits written before lineages were recorded are
            left out.
        chosen: the commit the restore chose.
        run_id: the run, for the message.
        start_fresh: the operator chose to start over: another history is logged
            (``restore_lineage_dropped``) instead of refused.

    Returns:
        The chosen commit's lineage, or None when it has none recorded.

    Raises:
        RestoreError: another lineage's commits are held too, and ``start_fresh`` is off.
    """
    held = list(held)
    mine = next((lin for cid, lin, _ in held if cid == chosen), None)
    if mine is None:
        return None
    others: dict[str, list[tuple[CommitId, str]]] = {}
    for cid, lin, where in held:
        if lin != mine:
            others.setdefault(lin, []).append((cid, where))
    if not others:
        return mine
    lin, commits = max(others.items(), key=lambda kv: max(c for c, _ in kv[1]))
    newest = max(c for c, _ in commits)
    here = sorted({w for cid, lin2, w in held if lin2 == mine})
    there = sorted({w for _, w in commits})
    message = (
        f"run {run_id!r} holds two histories: step {chosen.step} (generation {chosen.generation}, lineage "
        f"{mine[:8]}, on {', '.join(here)}) and step {newest.step} (generation {newest.generation}, lineage "
        f"{lin[:8]}, on {', '.join(there)}); restoring one would silently drop the other's steps: bring back only "
        f"the nodes of the history to keep (move the other's node directories aside), or set "
        f"LifecycleConfig.start_fresh=True to go on from step {chosen.step}"
    )
    if not start_fresh:
        raise RestoreError(message)
    log.warning("restore_lineage_dropped", kept=mine, dropped=sorted(others), reason=message)
    return mine
