"""Named points inside a commit, where a test or a drill may stop the process.

The production path only announces that it reached a point (:func:`reached`); nothing happens
unless a hook is installed. :mod:`elastic_emb.testing.faults` installs one that kills the process
at a chosen point (and step), which is how the tests and drills prove that a crash at any point
of a commit leaves the last complete commit restorable.

Points, in the order a snapshot commit reaches them: ``snapshot_data_written`` (this rank's data
file written), ``snapshot_replica_in_flight`` (before the replicas are exchanged),
``snapshot_before_manifest`` (data and replicas written on every node, manifests not yet),
``snapshot_manifest_partial`` (this rank's own manifest written, its replica manifests not yet);
the same points serve a base, a delta and a compaction (the base that ends a chain);
``durable_saving`` (a durable commit's save begins, in its thread when asynchronous) and
``durable_before_manifest`` (DCP done, manifest not yet written); and, outside the state tiers,
``resize_decider_claimed`` (:mod:`elastic_emb.inprocess.resize`: the in-process resize's decider claimed
the decision and has not written it), ``resize_joiner_registering`` (a joiner's worker, before
it registers as ready; the number is its ``TORCHELASTIC_RESTART_COUNT``, so ``@0`` kills only
the first attempt) and ``lifecycle_restoring`` (a generation's restore begins; the number is the
generation).
"""

from __future__ import annotations

from collections.abc import Callable

Hook = Callable[[str, int | None], None]
_hook: Hook | None = None


def reached(point: str, step: int | None = None) -> None:
    """Announce that this process reached ``point`` (at ``step``): a no-op without a hook."""
    if _hook is not None:
        _hook(point, step)


def set_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook`` (None removes it); returns the previous one."""
    global _hook
    prev, _hook = _hook, hook
    return prev
