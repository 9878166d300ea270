"""EmbContext on one GPU (world size 1): no host synchronisation, device-side checks, exact rows.

``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising CUDA call raise, so the
lookups, gradient updates and change-tracking calls run under it prove that none of them waits
for the GPU. Results are compared bit for bit with ``index_select`` (lookups) and with the
optimizer applied to the summed gradients (updates), in fp32 and bf16, for random, duplicate,
empty and largest ids. Bad ids and NaN gradients raise the named errors at the documented points
(elastic_emb.context.checks) and leave the rows as they were.

On the GPU machine:  python -m pytest tests/test_context_cuda.py -q
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_emb.context import EmbContext, InvalidIds
from elastic_emb.context.optim import apply_rows
from elastic_emb.errors import NonFiniteGradients
from elastic_emb.protocol import OptimizerSpec, ShardData, TableSpec
from elastic_emb.sharding import RowRange
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS, DIM = 1000, 64


@contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@contextmanager
def solo(dtype: str, optimizer: OptimizerSpec, **kw):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    topo = Topology.build(
        run_id="cuda-solo",
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
    ctx = EmbContext(
        topo,
        store,
        tables=[TableSpec(name="t", num_rows=ROWS, dim=DIM, dtype=dtype)],
        optimizer=optimizer,
        seed=None,
        **kw,
    )
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = (torch.randint(-64, 64, (ROWS, DIM), device="cuda", generator=gen).float() / 16).to(
        ctx.tables["t"].torch_dtype
    )
    slots = {"accumulator": torch.full((ROWS,), 0.5, device="cuda")} if optimizer.kind == "adagrad" else {}
    ctx.import_shard({"t": ShardData("t", RowRange(0, ROWS), rows, slots)})
    ctx.take_changes()
    try:
        yield ctx
    finally:
        ctx.close()


def batches(gen) -> dict[str, torch.Tensor]:
    return {
        "random": torch.randint(0, ROWS, (5000,), device="cuda", generator=gen),
        "duplicates": torch.randint(0, 8, (3000,), device="cuda", generator=gen),
        "empty": torch.empty(0, dtype=torch.int64, device="cuda"),
        "max": torch.full((257,), ROWS - 1, device="cuda"),
        "every": torch.randperm(ROWS, device="cuda", generator=gen),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_lookup_and_gradients_never_synchronise_and_are_exact(dtype, kind):
    opt = OptimizerSpec(kind=kind, lr=0.25)
    with solo(dtype, opt) as ctx:
        gen = torch.Generator(device="cuda").manual_seed(11)
        ids = batches(gen)
        # Gradient batches with few repeats per row, in quarters: every sum is exact in bf16 too,
        # whatever order the device adds duplicates in.
        upd = {
            "random": torch.randint(0, ROWS, (2000,), device="cuda", generator=gen),
            "duplicates": torch.randint(0, 8, (40,), device="cuda", generator=gen),
            "empty": ids["empty"],
            "max": torch.full((5,), ROWS - 1, device="cuda"),
        }
        grads = {
            k: (torch.randint(-4, 5, (len(v), DIM), device="cuda", generator=gen).float() / 4) for k, v in upd.items()
        }
        table = ctx.export_shard()["t"]
        expect_w, expect_s = table.weight.clone(), {k: v.clone() for k, v in table.slots.items()}
        with no_sync():
            got = {k: ctx.lookup("t", v).wait() for k, v in ids.items()}
            # two in flight, waited in reverse order
            h1, h2 = ctx.lookup("t", ids["random"]), ctx.lookup("t", ids["duplicates"])
            late = (h2.wait(), h1.wait())
            for k, v in upd.items():
                ctx.apply_gradients("t", v, grads[k].to(ctx.tables["t"].torch_dtype))
            changed = ctx.take_changes()["t"]
            after = {k: ctx.lookup("t", v).wait() for k, v in ids.items()}
        for k, v in ids.items():
            assert torch.equal(got[k], torch.index_select(table.weight, 0, v)), k
        assert torch.equal(late[0], table.weight[ids["duplicates"]]) and torch.equal(
            late[1], table.weight[ids["random"]]
        )
        touched = torch.zeros(ROWS, dtype=torch.bool, device="cuda")
        for k, v in upd.items():
            uniq, inverse = torch.unique(v, return_inverse=True)
            summed = torch.zeros(len(uniq), DIM, dtype=expect_w.dtype, device="cuda")
            summed.index_add_(0, inverse, grads[k].to(expect_w.dtype))
            apply_rows(opt, expect_w, expect_s, uniq, summed)
            touched[uniq] = True
        for k, v in ids.items():
            assert torch.equal(after[k], torch.index_select(expect_w, 0, v)), f"rows after gradients ({k})"
        final = ctx.export_shard()["t"]
        assert all(torch.equal(final.slots[s], expect_s[s]) for s in expect_s)
        assert torch.equal(changed, touched), "take_changes must mark exactly the rows updated"


def test_bad_ids_and_nonfinite_gradients_raise_where_documented():
    with solo("float32", OptimizerSpec(kind="adagrad", lr=0.5)) as ctx:
        # The verdicts below reach the host through the records' device mapping, stored by a
        # kernel: the copy engine may be busy with a commit's delta (elastic_emb.context.checks).
        assert ctx._checks.mapped
        before = ctx.export_shard()["t"]
        ids = torch.arange(40, device="cuda")
        ids[5], ids[9] = ROWS + 3, -1
        with no_sync():
            h = ctx.lookup("t", ids)  # returns at once; the verdict comes from the device
            with pytest.raises(
                InvalidIds,
                match=rf"2 id\(s\) out of range for table 't' of {ROWS} rows, the first "
                rf"{ROWS + 3} at position 5",
            ):
                h.wait()
            with pytest.raises(InvalidIds):
                h.wait()  # and again
            good = ctx.lookup("t", torch.arange(10, device="cuda")).wait()
            ctx.apply_gradients("t", ids, torch.ones(40, DIM, device="cuda"))
        assert torch.equal(good, before.weight[:10]), "the context is usable after bad ids"
        with pytest.raises(InvalidIds, match="no row was updated"):
            ctx.check_errors()
        grads = torch.ones(40, DIM, device="cuda")
        grads[3, 7] = float("nan")
        with no_sync():
            ctx.apply_gradients("t", torch.arange(40, device="cuda"), grads)
        with pytest.raises(NonFiniteGradients, match=r"1 row\(s\) of table 't'"):
            ctx.check_errors()
        after = ctx.export_shard()["t"]
        assert torch.equal(after.weight, before.weight) and torch.equal(
            after.slots["accumulator"], before.slots["accumulator"]
        )
        assert not ctx.take_changes()["t"].any(), "refused calls wrote nothing"
        ctx.check_errors()  # nothing pending any more


def test_nonfinite_rows_skipped_on_the_device():
    with solo("float32", OptimizerSpec(kind="sgd", lr=1.0), nonfinite_gradients="skip") as ctx:
        before = ctx.export_shard()["t"].weight.clone()
        grads = torch.ones(6, DIM, device="cuda")
        grads[1, 0] = float("inf")  # position 1: row 2 (also at position 3) is skipped
        ids = torch.tensor([1, 2, 3, 2, 4, 5], device="cuda")  # (made from a list: a synchronising copy)
        with no_sync():
            ctx.apply_gradients("t", ids, grads)
        ctx.check_errors()  # a skip is an event, not an error
        after = ctx.export_shard()["t"].weight
        assert torch.equal(after[2], before[2])
        assert torch.equal(after[[1, 3, 4, 5]], before[[1, 3, 4, 5]] - 1)
        assert ctx.take_changes()["t"].nonzero().squeeze(1).tolist() == [1, 3, 4, 5]


def test_an_interrupt_ends_the_hosts_wait_for_an_nccl_collective():
    """The host polls an NCCL collective (``Group.wait``) and a CUDA event (``Group.wait_event``);
    a collective whose peer is gone never completes, so :meth:`Group.interrupt` from another
    thread must end both polls at once. Here the collective and the event queue behind an 8 s
    sleep kernel (world size 1 has no peer to lose), and the interrupt comes after 0.3 s."""
    import threading
    import time

    from elastic_emb.errors import TransferInterrupted

    for what in ("collective", "event"):
        with solo("float32", OptimizerSpec(kind="sgd", lr=1.0)) as ctx:
            group = ctx._group
            torch.cuda._sleep(int(8 * 2e9))  # ~8 s at 2 GHz: nothing behind it completes meanwhile
            if what == "collective":
                work = group.pg.allreduce([torch.ones(4, device="cuda")])
                call = lambda: group.wait(work, 60, "the test's all-reduce")  # noqa: E731
            else:
                event = torch.cuda.Event()
                event.record()
                call = lambda: group.wait_event(event, 60, "the test's event")  # noqa: E731
            timer = threading.Timer(0.3, group.interrupt, args=("the test's peer is gone",))
            timer.start()
            t0 = time.monotonic()
            with pytest.raises(TransferInterrupted, match="the test's peer is gone"):
                call()
            waited = time.monotonic() - t0
            timer.join()
            assert waited < 4, f"the {what} wait ended after {waited:.1f}s, not at the interrupt"
            assert not group.healthy
            torch.cuda.synchronize()  # (the sleep and the queued work finish before the context closes)
