"""A small DLRM-like TorchRec model, trained elastically with elastic_emb.

Run it on every node (``pip install 'elastic-emb[torchrec]'`` first, README "TorchRec")::

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=elastic_emb \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=dlrm examples/train_torchrec.py --steps 1000 --out runs/dlrm

The model is what a TorchRec user writes: an ``EmbeddingBagCollection`` of three tables (``user``
one id per sample, ``item`` a bag of 1-3 recently seen items, ``category`` one id), sharded
row-wise by ``DistributedModelParallel`` with fbgemm's fused SGD; a dense tower (an MLP over the
pooled rows, replicated by DDP) predicts a click; binary cross-entropy, the local batch's mean.
:func:`build` makes the DMP for whatever world size the job has; the loop (:func:`main` runs
:func:`~elastic_emb.examples.loop.run_elastic`, the recsys example's loop too) is the elastic part: :class:`~elastic_emb.adapters.torchrec.TorchRecContext` plus a
:class:`~elastic_emb.lifecycle.manager.Lifecycle` that commits every step and, on a resize, builds a new
DMP at the new size and moves every row (and the dense tower) across.

This script is also the workload of the drill preset ``torchrec``, whose final tables must equal
a single-process replay (:func:`drill_replay`) bit for bit, whatever world sizes it ran at:

- The data is a pure function of ``(seed, step)``: a fixed global batch, rank ``r`` of ``W``
  taking the ``r``-th contiguous slice (``batch`` must be divisible by every world size).
- Gradient division: TorchRec divides the embeddings' gradients by ``W`` in the backward of its
  output all-to-all (``torchrec.distributed.comm_ops.GRADIENT_DIVISION``, default True), and DDP
  averages the tower's gradients over ``W``. Both are kept. Each rank's loss is the mean over its
  ``B/W`` samples, so after either division the gradient is the global batch's mean, as in one
  process.
- Exactness: a hook on the pooled embeddings replaces each sample's gradient ``g`` with
  ``W * q(g / W)``, ``q`` rounding onto the grid ``2**-GRAD_BITS``; TorchRec's division by ``W``
  then yields exactly ``q(g / W)`` (an IEEE division whose true result is representable), the
  quantised per-sample gradient of the global mean loss, the same number a single process
  computes. Sums of such numbers are exact in any order, the learning rate is a power of two, so
  the rows stay on a dyadic grid, and pooled sums of rows (added in a different order when rows
  live on different ranks) are exact too. The tower runs in float64; its gradient (averaged by
  DDP) is quantised the same way before the SGD step. What is left is float64 rounding that
  depends on the batch shape (~1e-16 relative), 2**40 times finer than the grid: a value would
  have to fall within that distance of a rounding boundary to differ.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import asdict, dataclass

import torch

from elastic_emb.examples.loop import loop_parser, run_elastic

GRAD_BITS = 16  # gradient grid 2**-16
INIT_BITS = 8  # initial values on the grid 2**-8, in [-0.5, 0.5)
TABLES = ("user", "item", "category")


@dataclass(frozen=True)
class Config:
    """Everything that determines the result; written into every output file."""

    user_rows: int = 1000
    item_rows: int = 2000
    category_rows: int = 64
    dim: int = 8  # fbgemm needs a multiple of 4
    hidden: int = 16
    batch: int = 64
    seed: int = 0
    lr_log2: int = -4  # both optimizers: SGD with lr 2**lr_log2

    @property
    def lr(self) -> float:
        return 2.0 ** self.lr_log2

    def rows(self, table: str) -> int:
        return getattr(self, f"{table}_rows")


def quantise(t: torch.Tensor, bits: int = GRAD_BITS) -> torch.Tensor:
    scale = float(2 ** bits)
    return torch.round(t.double() * scale).div(scale).to(t.dtype)


# -- the model -------------------------------------------------------------------------------------

class DLRM(torch.nn.Module):
    """Pooled embeddings -> MLP (float64) -> click logit."""

    def __init__(self, ebc, cfg: Config, world_size: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.world_size = world_size
        self.tower = torch.nn.Sequential(
            torch.nn.Linear(len(TABLES) * cfg.dim, cfg.hidden, dtype=torch.float64), torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden, 1, dtype=torch.float64))

    def forward(self, kjt) -> torch.Tensor:
        pooled = self.ebc(kjt).values()
        if pooled.requires_grad:
            w = self.world_size
            # W * q(g / W): TorchRec's gradient division by W then gives exactly q(g / W).
            pooled.register_hook(lambda g: quantise(g / w) * w)
        return self.tower(pooled.double()).squeeze(1)


def build(topology, env, device, cfg: Config):
    """The DistributedModelParallel for one world size (called again at every resize)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t, embedding_dim=cfg.dim, num_embeddings=cfg.rows(t), feature_names=[t])
                for t in TABLES], device=torch.device("meta"))
    torch.manual_seed(cfg.seed)  # the tower's first values (replaced by init_rows on a first start)
    model = DLRM(ebc, cfg, topology.world_size)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": cfg.lr})
    # On the CPU the stock planner offers no row-wise plan: ask for it table by table.
    plan = construct_module_sharding_plan(ebc, {t: row_wise(compute_kernel="fused") for t in TABLES},
                                          world_size=topology.world_size, device_type=device.type, sharder=sharder)
    return DistributedModelParallel(model, env=env, device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder])


def init_rows(cfg: Config) -> dict[str, torch.Tensor]:
    """Initial values of every table (and of the flattened tower), the same at every world size."""
    g = torch.Generator().manual_seed(cfg.seed)
    out = {t: quantise(torch.rand(cfg.rows(t), cfg.dim, generator=g) - 0.5, INIT_BITS) for t in TABLES}
    tower = (len(TABLES) * cfg.dim + 1) * cfg.hidden + cfg.hidden + 1
    out["dense"] = quantise((torch.rand(tower, generator=g, dtype=torch.float64) - 0.5) / 4, INIT_BITS)
    return out


def first_start(ctx, cfg: Config) -> None:
    """Write the initial values into a context that restored nothing."""
    from elastic_emb.adapters.torchrec import DENSE_DIM

    init = init_rows(cfg)
    views = ctx.shard_views()
    with torch.no_grad():
        for t in TABLES:
            v = views[t]
            v.weight.copy_(init[t][v.rows.start: v.rows.stop])
        d = views["dense"]
        flat = torch.zeros(ctx.tables["dense"].num_rows * DENSE_DIM, dtype=torch.float64)
        flat[: init["dense"].numel()] = init["dense"]
        d.weight.copy_(flat.view(-1, DENSE_DIM)[d.rows.start: d.rows.stop])
    ctx.mark_restored()  # collective: every rank's dense rows into the tower


# -- data: a pure function of (seed, step) --------------------------------------------------------

def global_batch(step: int, cfg: Config):
    """Per table (lengths, ids) of the whole step, and the labels."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    users = torch.randint(0, cfg.user_rows, (cfg.batch,), generator=g)
    item_len = torch.randint(1, 4, (cfg.batch,), generator=g)
    items = (torch.rand(int(item_len.sum()), generator=g) ** 2 * cfg.item_rows).long()  # popular items repeat
    cats = torch.randint(0, cfg.category_rows, (cfg.batch,), generator=g)
    labels = ((users % 3 + cats % 2) % 2).double()
    ones = torch.ones(cfg.batch, dtype=torch.long)
    return {"user": (ones, users), "item": (item_len, items), "category": (ones, cats)}, labels


def local_batch(step: int, cfg: Config, rank: int, world_size: int):
    from torchrec import KeyedJaggedTensor

    if cfg.batch % world_size:
        raise ValueError(f"batch={cfg.batch} is not divisible by world size {world_size}: every rank needs the "
                         f"same number of samples")
    per = cfg.batch // world_size
    lo, hi = rank * per, (rank + 1) * per
    feats, labels = global_batch(step, cfg)
    lengths, values = [], []
    for t in TABLES:
        length, ids = feats[t]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
        lengths.append(length[lo:hi])
        values.append(ids[offsets[lo]: offsets[hi]])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(TABLES), values=torch.cat(values), lengths=torch.cat(lengths))
    return kjt, labels[lo:hi]


def train_step(ctx, step: int, cfg: Config) -> torch.Tensor:
    """One step: forward, backward (fbgemm's fused SGD updates the rows), then the tower's SGD.
    Returns the loss as a tensor: the loop reads it after the commit (no sync before it)."""
    t = ctx.topology
    kjt, labels = local_batch(step, cfg, t.rank, t.world_size)
    model = ctx.model  # a new DMP after every resize: read it each step
    tower = [p for n, p in model.named_parameters() if "tower" in n]
    with ctx.guard():  # a failed collective marks the context unhealthy
        logits = model(kjt.to(ctx.device))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(ctx.device))
        loss.backward()
    with torch.no_grad():
        for p in tower:
            p -= cfg.lr * quantise(p.grad)  # DDP averaged the gradient over the ranks
            p.grad = None
    return loss.detach()


# -- the reference: the same steps in one process -------------------------------------------------

def drill_replay(cfg: Config, last_step: int, *, on_step=None):
    """Steps ``0..last_step`` on one process (world size 1). Returns (tables, history, initial):
    the full tables, per table the rows each step changed with their new values, and the initial
    tables (what :func:`elastic_emb.drill.replay.verify` needs)."""
    import torch.distributed as dist

    from elastic_emb.adapters.torchrec import TorchRecContext
    from elastic_emb import Topology

    if dist.is_initialized():
        raise RuntimeError("drill_replay forms a world of one: destroy the default process group first")
    topo = Topology.build(run_id="replay", generation=0, rank=0, world_size=1, local_rank=0, local_world_size=1,
                          node_rank=0, num_nodes=1, ep_size=1, backend="gloo", master_addr="127.0.0.1", master_port=1)
    ctx = TorchRecContext(topo, dist.HashStore(), build=functools.partial(build, cfg=cfg))
    try:
        first_start(ctx, cfg)
        full = lambda: {n: s.weight.detach().clone() for n, s in ctx.export_shard().items()}  # noqa: E731
        initial = full()
        history: dict[str, list] = {n: [] for n in initial}
        if on_step is not None:
            on_step(-1, initial)
        for step in range(last_step + 1):
            train_step(ctx, step, cfg)
            now = full()
            if on_step is not None:
                on_step(step, now)
            feats, _ = global_batch(step, cfg)
            for n in TABLES:
                rows = torch.unique(feats[n][1])
                history[n].append((step, rows, now[n][rows].clone()))
            rows = torch.arange(now["dense"].shape[0])
            history["dense"].append((step, rows, now["dense"].clone()))
        return full(), history, initial
    finally:
        ctx.close()


# -- the elastic training loop (examples/loop.py) --------------------------------------------------

def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    args = loop_parser(__doc__.split("\n\n")[0], Config()).parse_args(argv)
    return args, Config(**{f: getattr(args, f) for f in asdict(Config())})


def main(argv=None) -> int:
    from elastic_emb import configure_logging
    from elastic_emb.adapters.torchrec import TorchRecContext

    args, cfg = parse_args(argv)
    configure_logging()
    factory = functools.partial(TorchRecContext, build=functools.partial(build, cfg=cfg))
    return run_elastic(factory, lambda ctx, step, fields: train_step(ctx, step, cfg), args, cfg,
                       on_first_start=lambda ctx: first_start(ctx, cfg))


if __name__ == "__main__":
    sys.exit(main())
