"""The committer's communicator and background writer live for a whole generation, also for a
context without a process group of its own (the TorchRec adapter, the native example, a context
of the user's), for which the communicator forms a gloo group of its own. One process, world size
1, a real EmbContext on gloo whose process group is hidden, the real writer and snapshot files."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_emb import Lifecycle, LifecycleConfig
from elastic_emb.context import EmbContext
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology

TABLE = TableSpec(name="t", num_rows=64, dim=4)


class NoGroupContext(EmbContext):
    """An EmbContext that offers the state tiers no process group (the contract's default)."""

    process_group = None


def _factory(topology, store):
    return NoGroupContext(topology, store, tables=[TABLE], optimizer=OptimizerSpec(kind="sgd", lr=1.0), seed=0)


def test_one_communicator_and_one_writer_per_generation_for_a_context_without_a_group(tmp_path):
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    config = LifecycleConfig(state_dir=str(tmp_path), node_id="n0", transfer_timeout=30.0).resolved({})
    topo = Topology.build(
        run_id="committer",
        generation=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=1,
    )
    lc = Lifecycle(_factory, config, topo, store)
    lc.context = _factory(topo, store)
    assert lc.context.process_group is None and lc.context.tracks_changes
    made = []
    for step in range(6):
        lc.context.apply_gradients("t", torch.tensor([step, 63 - step]), -torch.ones(2, 4))
        report = lc.commit(step)
        made.append((lc._committer._comm, lc._committer._writer))
        if step:  # a delta: the two rows written, not the whole table
            assert 0 < report.bytes_snapshot < 64 * 4 * 4, report
    assert all(m == made[0] for m in made), "the communicator or the writer was made again within a generation"
    assert made[0][0].formed_on(None) and not made[0][0].formed_on(made[0][0].pg)
    assert lc.wait_commit() == 5
    lc.close()


def test_a_step_the_cadence_does_not_commit_is_taken_not_committed(tmp_path):
    # commit_every=2: next_step used to stay at an uncommitted step, so a loop over next_step ran it forever
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    config = LifecycleConfig(state_dir=str(tmp_path), node_id="n0", commit_every=2, async_commit=False).resolved({})
    topo = Topology.build(
        run_id="cadence",
        generation=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=1,
    )
    lc = Lifecycle(_factory, config, topo, store)
    lc.context = _factory(topo, store)
    seen = []
    while lc.next_step < 5:
        step = lc.next_step
        lc.commit(step)
        seen.append((step, lc.step, lc.committed_step))
    assert seen == [(0, 0, 0), (1, 1, 0), (2, 2, 2), (3, 3, 2), (4, 4, 4)]
    with pytest.raises(ValueError, match="step=3 was already taken"):
        lc.commit(3)
    lc.close()
