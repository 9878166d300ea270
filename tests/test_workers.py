"""The test workers' expected values agree with the code under test, bit for bit.

A worker that checks restored rows against a wrong expectation fails (or passes) with the
machine's speed: how many steps run before a restore decides how often a row was hit. These
tests drive a real world-size-1 EmbContext with the worker's own step function well past the
point where a closed form goes wrong, and compare with the worker's expectation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology
from tests.helpers import rdzv_worker as rw


def _context():
    from elastic_emb.context import EmbContext

    port = free_port()
    topo = Topology.build(
        run_id="workers",
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
        master_port=port,
    )
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    return EmbContext(topo, store, tables=[rw.table_spec()], optimizer=rw.optimizer_spec(), seed=rw.SEED)


def test_rdzv_worker_expected_rows_match_a_context_after_10_hits_per_row():
    hits = 10
    last_step = hits * rw.TABLE_ROWS - 1  # every row hit exactly `hits` times
    ctx = _context()
    try:
        initial = ctx.export_shard()["t"].weight.clone()
        for step in range(last_step + 1):
            rw.train_step(ctx, step, rank=0)
        got = ctx.export_shard()["t"].weight
    finally:
        ctx.close()
    assert torch.equal(initial, rw.expected_rows(0, rw.TABLE_ROWS, -1)), "initial rows differ from init_rows"
    want = rw.expected_rows(0, rw.TABLE_ROWS, last_step)
    diff = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not diff, f"rows {diff} differ from expected_rows after {hits} hits each"
    # Shards: the expectation of a sub-range is the same rows.
    assert torch.equal(rw.expected_rows(16, 40, last_step), want[16:40])
    # The test has teeth: the closed form the worker used before (init + hits, one rounding)
    # differs from the real table for rows hit 10 times, so a regression to it fails above.
    closed_form = initial + float(hits)
    assert not torch.equal(closed_form, got), "closed form agrees: the check above would not catch it"
