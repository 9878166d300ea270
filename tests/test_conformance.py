"""The context contract: the conformance suite passes for both context classes of this
repository and fails for contexts that break it.

``EmbContext`` (the library's) and ``MiniContext`` (tests/helpers/lifecycle_worker.py: plain torch, a
private gloo group) each run :mod:`elastic_emb.testing.conformance` on two real processes. Two
broken variants of ``MiniContext`` prove the suite can fail: one lacks a required member
(``healthy``), one lets ``reset`` accept another world size.
"""

from __future__ import annotations

import functools

import pytest

from elastic_emb.errors import ContractViolation, WorldSizeChanged
from elastic_emb.protocol import ContextBase, OptimizerSpec, TableSpec, check_context, missing_abilities
from elastic_emb.testing import conformance
from tests.helpers import lifecycle_worker as lw

TABLES = [TableSpec(name="items", num_rows=37, dim=4), TableSpec(name="users", num_rows=10, dim=3, dtype="bfloat16")]


def _emb_target() -> conformance.Target:
    from elastic_emb.context import EmbContext

    factory = functools.partial(
        EmbContext, tables=TABLES, optimizer=OptimizerSpec(kind="adagrad"), timeout=5.0, staging_rows_per_rank=16
    )
    return conformance.Target(factory=factory, collective=lambda ctx: ctx.barrier(), write=_apply_ones)


def _apply_ones(ctx, table: str, ids) -> None:
    """A write for the change-tracking check: a gradient of ones on each rank's ``ids``."""
    import torch

    spec = ctx.tables[table]
    ctx.apply_gradients(table, ids, torch.ones(len(ids), spec.dim, dtype=spec.torch_dtype))


def _mini(cls=lw.MiniContext) -> conformance.Target:
    mini_tables = [TableSpec(name=t.name, num_rows=t.num_rows, dim=t.dim, dtype="float64") for t in TABLES]
    return conformance.Target(
        factory=functools.partial(cls, tables=mini_tables, timeout=5.0), collective=lambda ctx: ctx.allreduce()
    )


# A context that lacks a required member: MiniContext's methods without ``healthy``.
NoHealthy = type(
    "NoHealthy",
    (ContextBase,),
    {k: v for k, v in vars(lw.MiniContext).items() if k not in ("healthy", "__dict__", "__weakref__")},
)


class AnySizeReset(lw.MiniContext):
    """Breaks the one rule: ``reset`` re-forms for any world size instead of refusing."""

    def reset(self, rank, world_size, *, topology, store):
        self.topology = topology


EMB = _emb_target
MINI = _mini
NO_HEALTHY = functools.partial(_mini, NoHealthy)
ANY_SIZE_RESET = functools.partial(_mini, AnySizeReset)


@pytest.mark.parametrize("target,ep_size", [("EMB", 2), ("EMB", 1), ("MINI", 2)])
def test_conformance_passes(target, ep_size):
    report = conformance.run(f"{__name__}:{target}", world_size=2, ep_size=ep_size, timeout=240)
    assert report.passed == {c: [0, 1] for c in conformance.CHECKS}


def test_conformance_fails_for_a_context_lacking_a_required_member():
    with pytest.raises(conformance.ConformanceFailure) as info:
        conformance.run(f"{__name__}:NO_HEALTHY", world_size=2, timeout=240)
    assert set(info.value.failures) == {("members", 0), ("members", 1)}
    assert "lacks healthy" in info.value.failures[("members", 0)]


def test_conformance_fails_for_a_reset_across_sizes():
    with pytest.raises(conformance.ConformanceFailure) as info:
        conformance.run(f"{__name__}:ANY_SIZE_RESET", world_size=2, timeout=240)
    assert set(info.value.failures) == {("reset_refuses", 0), ("reset_refuses", 1)}
    assert "expected WorldSizeChanged" in info.value.failures[("reset_refuses", 0)]


def test_check_context_names_what_is_missing():
    class Partial(ContextBase):
        topology = None
        tables = {}

    assert missing_abilities(Partial()) == ["healthy", "closed", "reset", "close", "export_shard", "import_shard"]
    with pytest.raises(ContractViolation, match="lacks healthy, closed, reset, close, export_shard, import_shard"):
        check_context(Partial())
    with pytest.raises(ContractViolation, match="inherit elastic_emb.protocol.ContextBase"):
        check_context(object())
    assert issubclass(WorldSizeChanged, ValueError)
