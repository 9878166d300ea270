"""The first base of a generation formed in process, written in the background
(elastic_emb/lifecycle/first_base.py): one process, world size 1, a real EmbContext on gloo, the real
background writer and snapshot files. The base's write is held at a commit point (the tests'
hook of ``state.points``) so the window is open for as long as the test says. The tables are
small, so the size rule (``first_base.wanted``) is lowered to take them."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb import Lifecycle, LifecycleConfig
from elastic_emb.context import EmbContext
from elastic_emb.lifecycle import first_base
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.state import points
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology

TABLE = TableSpec(name="t", num_rows=64, dim=4)


def _topo(gen: int) -> Topology:
    return Topology.build(
        run_id="firstbase",
        generation=gen,
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


def _factory(topology, store):
    return EmbContext(topology, store, tables=[TABLE], optimizer=OptimizerSpec(kind="sgd", lr=1.0), seed=0)


def _step(ctx, step: int) -> None:
    ids = torch.tensor([step % 64, (step * 7) % 64])
    ctx.apply_gradients("t", ids, -torch.ones(2, 4) * (step + 1))


def _lifecycle(tmp_path, monkeypatch):
    """A world-size-1 lifecycle with a context, whose first base after a re-form always goes to the
    background (the tests' table is far below the size where that pays)."""
    monkeypatch.setattr(first_base, "MIN_SHARD_BYTES", 0)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    config = LifecycleConfig(state_dir=str(tmp_path), node_id="n0", transfer_timeout=30.0).resolved({})
    lc = Lifecycle(_factory, config, _topo(0), store)
    lc.context = _factory(_topo(0), store)
    return lc, config, store


def test_the_base_is_written_in_the_background_and_the_steps_meanwhile_land_in_one_delta(tmp_path, monkeypatch):
    lc, config, store = _lifecycle(tmp_path, monkeypatch)
    for step in range(2):
        _step(lc.context, step)
        lc.commit(step)
    gate = threading.Event()
    held = threading.Event()

    def hold(point: str, step: int | None) -> None:  # the writer thread, writing the new base
        if point == "snapshot_data_written" and step == 2:
            held.set()
            assert gate.wait(30), "the test never released the base's write"

    previous = points.set_hook(hold)
    try:
        lc.on_membership_change(_topo(1), rebuild=True, background_base=True)
        _step(lc.context, 2)
        report = lc.commit(2)  # the base: captured, handed to the writer
        assert report is not None and report.bytes_snapshot == 64 * 4 * 4, report
        assert held.wait(30) and lc.committed_step == 1  # the old generation's commit is the restore point
        for step in (3, 4):  # coalesced: nothing written, the rows stay in the change masks
            _step(lc.context, step)
            assert lc.commit(step) is None
            assert lc.step == step and lc.committed_step == 1
        gate.set()
        deadline = time.monotonic() + 30
        while lc._committer._writer.in_flight is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lc.committed_step == 2  # the base complete; steps 3 and 4 are not written yet
        _step(lc.context, 5)
        report = lc.commit(5)  # the window ends: one delta with the rows of steps 3, 4 and 5
        assert report is not None and lc.wait_commit() == 5  # (asynchronous commits: complete once waited for)
        assert 0 < report.bytes_snapshot < 64 * 4 * 4, report
        want = lc.context.export_shard()["t"].weight.clone()
        lc.close()
    finally:
        points.set_hook(previous)
        gate.set()
    # a restart restores step 5 through the base and the delta, bit for bit
    lc2 = Lifecycle(_factory, config, _topo(2), store)
    lc2.context = _factory(_topo(2), store)
    report = lc2._restore(live=None, live_commit=None)
    assert report.step == 5, report
    assert torch.equal(lc2.context.export_shard()["t"].weight, want)
    lc2.close()


def test_a_forced_commit_inside_the_window_waits_for_the_base(tmp_path, monkeypatch):
    lc, _, _ = _lifecycle(tmp_path, monkeypatch)
    _step(lc.context, 0)
    lc.commit(0)
    lc.on_membership_change(_topo(1), rebuild=True, background_base=True)
    _step(lc.context, 1)
    lc.commit(1)
    _step(lc.context, 2)
    report = lc.commit(2, force=True)  # a drain or a forced commit is never coalesced
    assert report is not None and lc.wait_commit() == 2 and lc._committer.first_base is None
    lc.close()


def test_only_shards_worth_a_background_write_take_it():
    big = TableSpec(name="t", num_rows=1 << 20, dim=64)  # 256 MB of fp32 weights
    assert first_base.wanted({"t": big}, 2) and first_base.wanted({"t": big}, 16)  # 16 MiB shards
    assert not first_base.wanted({"t": big}, 17) and not first_base.wanted({"t": TABLE}, 1)
    half = TableSpec(name="h", num_rows=1 << 20, dim=64, dtype="float16")
    assert first_base.wanted({"h": half}, 8) and not first_base.wanted({"h": half}, 9)
