"""The TorchRec model of the adapter tests: two row-wise tables with fused row-wise Adagrad.

Every gradient is exact: the loss is ``sum(pooled * coef)`` with ``coef`` a fixed multiple of
1/4 per (global sample, column), so each id's gradient is a small dyadic number whatever the
rows hold, and their sums are exact in any order. TorchRec's gradient division is turned off
(each rank's loss sums its own samples, so the gradients are the global sums at every world
size), and fbgemm then applies the same per-row update as a single process would.
"""

from __future__ import annotations

import functools

import torch

TABLES = [{"name": "t_items", "num_rows": 203, "dim": 4}, {"name": "t_users", "num_rows": 61, "dim": 8}]
BATCH = 48  # global samples per step: divisible by every world size of the tests (1, 2, 3)
LR = 0.5


class Pooled(torch.nn.Module):
    """The pooled rows; with ``dense``, a replicated linear layer too (DDP keeps it equal on
    every rank; the adapter carries it as its ``dense`` table)."""

    def __init__(self, ebc, dense: bool = False) -> None:
        super().__init__()
        self.ebc = ebc
        self.top = torch.nn.Linear(sum(c.embedding_dim for c in ebc.embedding_bag_configs()), 3) if dense else None

    def forward(self, kjt):
        pooled = self.ebc(kjt).values()
        return pooled if self.top is None else self.top(pooled)


def build(topology, env, device, tables=TABLES, dense: bool = False, planned: dict | None = None):
    """The DMP; ``planned`` maps a table to another plan (``table_wise``, ``dense_kernel``) than
    the row-wise fused one, for the tests of what the adapter refuses."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t["name"], embedding_dim=t["dim"], num_embeddings=t["num_rows"], feature_names=[f"f_{t['name']}"]
            )
            for t in tables
        ],
        device=torch.device("meta"),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
    )
    kinds = {
        "row_wise": lambda: row_wise(compute_kernel="fused"),
        "table_wise": lambda: table_wise(rank=0),
        "dense_kernel": lambda: row_wise(compute_kernel="dense"),
    }
    plan = construct_module_sharding_plan(
        ebc,
        {t["name"]: kinds[(planned or {}).get(t["name"], "row_wise")]() for t in tables},
        world_size=topology.world_size,
        device_type=device.type,
        sharder=sharder,
    )
    return DistributedModelParallel(
        Pooled(ebc, dense), env=env, device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )


def factory(spec: dict | None = None, **kw):
    from torchrec.distributed.comm_ops import set_gradient_division

    from elastic_emb.adapters.torchrec import TorchRecContext

    set_gradient_division(False)
    return functools.partial(
        TorchRecContext, build=functools.partial(build, dense=kw.get("dense", False)), timeout=kw.get("timeout", 60.0)
    )


def global_batch(step: int, tables=TABLES):
    """Per table: bag lengths (1..3 ids per sample) and ids, for the whole global batch."""
    g = torch.Generator().manual_seed(7000 + step)
    out = []
    for t in tables:
        lengths = torch.randint(1, 4, (BATCH,), generator=g)
        ids = torch.randint(0, t["num_rows"], (int(lengths.sum()),), generator=g)
        out.append((lengths, ids))
    return out


def train_step(ctx, step: int, tables=TABLES) -> None:
    from torchrec import KeyedJaggedTensor

    t = ctx.topology
    per = BATCH // t.world_size
    lo, hi = t.rank * per, (t.rank + 1) * per
    lengths, values = [], []
    for length, ids in global_batch(step, tables):
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
        lengths.append(length[lo:hi])
        values.append(ids[offsets[lo] : offsets[hi]])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{x['name']}" for x in tables], values=torch.cat(values), lengths=torch.cat(lengths)
    )
    dim = sum(x["dim"] for x in tables)
    samples = torch.arange(lo, hi)[:, None]
    cols = torch.arange(dim)[None, :]
    coef = ((samples * 3 + cols + step) % 5 - 2).to(torch.float32) / 4
    with ctx.guard():
        out = ctx.model(kjt.to(ctx.device))
        (out * coef.to(ctx.device)).sum().backward()  # the fused optimizer updates the rows in backward


def write_rows(ctx, table: str, ids) -> None:
    """The conformance suite's ``write`` (collective: every rank calls it with its own global row
    ids): a sparse table's rows are written by one training step that looks up exactly ``ids``
    (one id per sample, the other features empty; the union over the ranks is what the fused
    optimizer updates); the ``dense`` table's rows by adding 1 to the replicated parameters they
    hold, on every rank (the ranks' ids are gathered first, so the copies stay equal, as DDP keeps them)."""
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor

    from elastic_emb.adapters.torchrec import DENSE_DIM

    ctx.sync_dense()  # (after the suite's import_shard: collective, writes back the values imported)
    tables = [t["name"] for t in TABLES]
    if table not in tables:  # the dense table
        got = [None] * ctx.topology.world_size
        dist.all_gather_object(got, [int(i) for i in ids], group=ctx._groups.pg)
        rows = sorted({r for part in got for r in part})
        with torch.no_grad():
            offset = 0
            for _, p in ctx._dense:  # (the parameters the dense table flattens, in its order)
                mine = torch.arange(offset, offset + p.numel()) // DENSE_DIM
                hit = torch.isin(mine, torch.tensor(rows, dtype=torch.int64)).reshape(p.shape)
                p.add_(hit.to(p.dtype))
                offset += p.numel()
        return
    per = 4  # samples per rank: every rank passes the same batch size; at most 4 ids each
    assert len(ids) <= per, f"at most {per} ids per rank, got {len(ids)}"
    lengths, values = [], []
    for name in tables:
        n = len(ids) if name == table else 0
        lengths.append(torch.tensor([1] * n + [0] * (per - n), dtype=torch.int64))
        values.append(torch.as_tensor(ids, dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{t}" for t in tables], values=torch.cat(values), lengths=torch.cat(lengths)
    )
    with ctx.guard():
        ctx.model(kjt.to(ctx.device)).sum().backward()
