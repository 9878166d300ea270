"""The capture's launcher thread failing for real (``state/capture.py``): on CUDA a commit's
gather and copy are launched by a thread of the capture, and when that thread fails, the error
must surface where the capture is waited for (the background writer waiting for the copy, the
context's next write to its rows) as an error saying what failed, well inside the capture's
timeout: never a hang and never a silent commit. The failure here is GPU memory running out when
the launcher allocates the commit's staging buffer (the process's CUDA memory capped just above
what it holds), on one GPU; skipped without CUDA.

On the GPU machine:  python -m pytest tests/test_capture_failure.py -q
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIMEOUT = 120.0  # the capture's own bound: a hang would end there, as a TimeoutError
BOUND = 30.0  # the failure must surface well before it (seconds from the commit to both errors)
SPEC = TableSpec(name="t", num_rows=1 << 18, dim=64)  # 64 MiB of weights and as much Adagrad state


def test_a_launcher_failure_surfaces_at_the_writer_and_at_the_next_write(tmp_path):
    from elastic_emb.context import EmbContext
    from elastic_emb.state import Comm, SnapshotTier
    from elastic_emb.state.capture import DeviceCapture
    from elastic_emb.state.writer import CommitWriter

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    topo = Topology.build(
        run_id="capture-fail",
        generation=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="nccl",
        master_addr="127.0.0.1",
        master_port=port,
    )
    ctx = EmbContext(topo, store, tables=[SPEC], optimizer=OptimizerSpec(kind="adagrad", lr=0.5), seed=3)
    dev = ctx.device
    comm = Comm(topo, store, None, timeout=60)
    tier = SnapshotTier(tmp_path, "capture-fail", "A", replication=0, keep=2, max_chain=100)
    capture = DeviceCapture(dev, buffers=2, timeout=TIMEOUT)
    writer = CommitWriter(tier, comm, timeout=60, depth=2)
    num_rows = {SPEC.name: SPEC.num_rows}
    ids = torch.arange(SPEC.num_rows, device=dev)  # every row: the delta's staging buffer is ~130 MiB
    grads = torch.ones(SPEC.num_rows, SPEC.dim, device=dev)
    try:
        ctx.apply_gradients(SPEC.name, ids, grads)
        writer.submit(
            tier.capture(
                0,
                ctx.shard_views(),
                topo,
                num_rows,
                ctx.take_changed_rows(unique=False),
                device=capture,
                hold=ctx.hold_writes,
            )
        )  # the base (a host copy)
        assert writer.wait() == 0
        ctx.apply_gradients(SPEC.name, ids, grads)
        # (a plain dict: without the written values the context hands over, the capture gathers
        # the rows into a staging buffer, the allocation this test makes fail)
        shards, rows = ctx.shard_views(), dict(ctx.take_changed_rows(unique=False))
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        cap = (torch.cuda.memory_reserved(dev) + (8 << 20)) / torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(cap, dev)  # the staging buffer no longer fits
        try:
            t0 = time.monotonic()
            writer.submit(tier.capture(1, shards, topo, num_rows, rows, device=capture, hold=ctx.hold_writes))
            with pytest.raises(
                RuntimeError,
                match=r"launching a commit's copy to the host on the GPU failed: "
                r".*out of memory",
            ) as at_writer:
                writer.wait()
        finally:  # the launcher has failed: the next write gets its memory back, and the capture's error
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
        with pytest.raises(RuntimeError, match=r"launching a commit's gather on the GPU failed: .*out of memory"):
            ctx.apply_gradients(SPEC.name, ids, grads)  # the next write waits for the capture's gather
        elapsed = time.monotonic() - t0
        assert isinstance(at_writer.value.__cause__, torch.OutOfMemoryError), repr(at_writer.value.__cause__)
        assert elapsed < BOUND, f"the launcher's failure took {elapsed:.1f} s to surface (bound {BOUND} s)"
        assert writer.committed_step == 0  # the failed delta is no commit: the base stays the newest
    finally:
        writer.close(wait=False)
        tier.close_spares()
        ctx.close()
        comm.close()
