"""A small DLRM-like TorchRec model, trained elastically with elastic_emb.

Three tables sharded row-wise by ``DistributedModelParallel`` and a tower replicated by DDP, in a
:class:`~elastic_emb.adapters.torchrec.TorchRecContext`: the tower's values travel as the
adapter's ``dense`` table, its Adam and schedule (:class:`DenseOptimizer`) as ``app_state``. The
workload of the drill preset ``torchrec`` (its tables and the tower's Adam equal
:func:`drill_replay` bit for bit). Run it on every node::

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=elastic_emb \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=dlrm examples/train_torchrec.py --steps 1000 --out runs/dlrm

Design: ``docs/DRILLS.md`` (section "The TorchRec example").
"""

from __future__ import annotations

import argparse
import functools
import sys
import zlib
from dataclasses import asdict, dataclass

import torch

from elastic_emb.examples.loop import DrillHooks, loop_parser

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
    lr_log2: int = -4  # the tables: fbgemm's fused SGD with lr 2**lr_log2
    dense_lr_log2: int = -6  # the tower's Adam learning rate 2**dense_lr_log2
    lr_step: int = 10  # the schedule: the tower's learning rate halves every lr_step steps (StepLR)

    @property
    def lr(self) -> float:
        return 2.0**self.lr_log2

    @property
    def dense_lr(self) -> float:
        return 2.0**self.dense_lr_log2

    @property
    def dense_params(self) -> int:
        """Values of the tower: two linear layers' weights and biases."""
        return (len(TABLES) * self.dim + 1) * self.hidden + self.hidden + 1

    def rows(self, table: str) -> int:
        """Rows of a table.

        Args:
            table: ``user``, ``item`` or ``category``.

        Returns:
            Its ``<table>_rows``.
        """
        return getattr(self, f"{table}_rows")


def quantise(t: torch.Tensor, bits: int = GRAD_BITS) -> torch.Tensor:
    """Round onto the grid ``2**-bits`` (in float64), keeping ``t``'s dtype.

    Args:
        t: the values.
        bits: the grid's binary digits after the point.

    Returns:
        The rounded values, in ``t``'s dtype.
    """
    scale = float(2**bits)
    return torch.round(t.double() * scale).div(scale).to(t.dtype)


# -- the model -------------------------------------------------------------------------------------


class DLRM(torch.nn.Module):
    """Pooled embeddings -> MLP (float64) -> click logit.

    Args:
        ebc: the ``EmbeddingBagCollection`` of the three tables.
        cfg: the configuration (``dim``, ``hidden``).
        world_size: the world size, for the gradient hook (``W * q(g / W)``).
    """

    def __init__(self, ebc, cfg: Config, world_size: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.world_size = world_size
        self.tower = torch.nn.Sequential(
            torch.nn.Linear(len(TABLES) * cfg.dim, cfg.hidden, dtype=torch.float64),
            torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden, 1, dtype=torch.float64),
        )

    def forward(self, kjt) -> torch.Tensor:
        """The click logits of a batch.

        Args:
            kjt: the batch's ids (a ``KeyedJaggedTensor``, one key per table).

        Returns:
            One logit per sample (float64).
        """
        pooled = self.ebc(kjt).values()
        if pooled.requires_grad:
            w = self.world_size
            # W * q(g / W): TorchRec's gradient division by W then gives exactly q(g / W).
            pooled.register_hook(lambda g: quantise(g / w) * w)
        return self.tower(pooled.double()).squeeze(1)


def build(topology, env, device, cfg: Config):
    """The DistributedModelParallel for one world size (called again at every resize).

    Every table is sharded row-wise with fbgemm's fused exact SGD; the tables start on the meta
    device (their values come from a restore or :func:`first_start`).

    Args:
        topology: the agreed topology (its world size).
        env: TorchRec's ``ShardingEnv``.
        device: the device of this rank.
        cfg: the configuration.

    Returns:
        The ``DistributedModelParallel`` of a :class:`DLRM`.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=cfg.dim, num_embeddings=cfg.rows(t), feature_names=[t])
            for t in TABLES
        ],
        device=torch.device("meta"),
    )
    torch.manual_seed(cfg.seed)  # the tower's first values (replaced by init_rows on a first start)
    model = DLRM(ebc, cfg, topology.world_size)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": cfg.lr})
    # On the CPU the stock planner offers no row-wise plan: ask for it table by table.
    plan = construct_module_sharding_plan(
        ebc,
        {t: row_wise(compute_kernel="fused") for t in TABLES},
        world_size=topology.world_size,
        device_type=device.type,
        sharder=sharder,
    )
    return DistributedModelParallel(model, env=env, device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder])


def init_rows(cfg: Config) -> dict[str, torch.Tensor]:
    """Initial values of every table (and of the flattened tower), the same at every world size.

    Args:
        cfg: the configuration (``seed``, sizes).

    Returns:
        ``{table: rows}`` and ``"dense"``: the tower's parameters, flat, on the grid ``2**-INIT_BITS``.
    """
    g = torch.Generator().manual_seed(cfg.seed)
    out = {t: quantise(torch.rand(cfg.rows(t), cfg.dim, generator=g) - 0.5, INIT_BITS) for t in TABLES}
    out["dense"] = quantise((torch.rand(cfg.dense_params, generator=g, dtype=torch.float64) - 0.5) / 4, INIT_BITS)
    return out


def first_start(ctx, cfg: Config) -> None:
    """Write the initial values into a context that restored nothing (collective).

    Args:
        ctx: the ``TorchRecContext``.
        cfg: the configuration.
    """
    from elastic_emb.adapters.torchrec import DENSE_DIM

    init = init_rows(cfg)
    views = ctx.shard_views()
    with torch.no_grad():
        for t in TABLES:
            v = views[t]
            v.weight.copy_(init[t][v.rows.start : v.rows.stop])
        d = views["dense"]
        flat = torch.zeros(ctx.tables["dense"].num_rows * DENSE_DIM, dtype=torch.float64)
        flat[: init["dense"].numel()] = init["dense"]
        d.weight.copy_(flat.view(-1, DENSE_DIM)[d.rows.start : d.rows.stop])
    ctx.mark_restored()  # collective: every rank's dense rows into the tower


# -- the tower's optimizer: app state, one object for the job -------------------------------------


class DenseOptimizer:
    """The tower's Adam and its step schedule: the example's ``app_state``.

    The tower's parameters live in the DMP that ``build`` makes anew every generation (the adapter
    carries their values as the ``dense`` table), while an ``app_state`` object is one object for
    the whole job. So Adam does not hold the DMP's parameters: it steps a flat float64 vector of
    its own (on the CPU whatever the device), which :meth:`apply` fills from the tower before the
    step and copies back into it after. Adam's state (moments, step count) is keyed to that vector
    and survives every rebuild; committed and restored with the tables, at their step. Built the
    same way on every rank and in :func:`drill_replay`, it takes the same steps bit for bit.

    Args:
        cfg: the configuration (``dense_lr``, ``lr_step``).
    """

    def __init__(self, cfg: Config) -> None:
        self.flat = torch.nn.Parameter(torch.zeros(cfg.dense_params, dtype=torch.float64))
        self.optim = torch.optim.Adam([self.flat], lr=cfg.dense_lr, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=cfg.lr_step, gamma=0.5)

    def objects(self) -> dict:
        """The app state: ``optim`` (Adam's moments and step count) and ``sched``.

        Returns:
            name -> object with ``state_dict``/``load_state_dict``.
        """
        return {"optim": self.optim, "sched": self.sched}

    def apply(self, params: list[torch.Tensor]) -> None:
        """One Adam step on the tower with its quantised gradient, then the schedule.

        Args:
            params: the tower's parameters in this generation's DMP (``named_parameters()``
                order), their ``.grad`` DDP's average over the ranks; cleared after.
        """
        with torch.no_grad():
            self.flat.copy_(torch.cat([p.detach().reshape(-1).cpu() for p in params]))
            self.flat.grad = torch.cat([quantise(p.grad).reshape(-1).cpu() for p in params])
            self.optim.step()
            self.sched.step()
            self.flat.grad = None
            offset = 0
            for p in params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                p.grad = None
                offset += p.numel()

    def checksum(self) -> int:
        """CRC32 of Adam's moments and step count (each step's progress line carries it).

        Returns:
            The CRC32 (0 before the first step).
        """
        crc = 0
        state = self.optim.state.get(self.flat, {})
        for key in ("step", "exp_avg", "exp_avg_sq"):
            t = state.get(key)
            if t is not None:
                crc = zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy(), crc)
        return crc


# -- data: a pure function of (seed, step) --------------------------------------------------------


def global_batch(step: int, cfg: Config):
    """The whole step's samples, a function of seed and step.

    Args:
        step: the training step.
        cfg: the configuration.

    Returns:
        ``({table: (lengths, ids)}, labels)``: ``user`` and ``category`` one id per sample, ``item``
        a bag of 1 to 3 ids.
    """
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    users = torch.randint(0, cfg.user_rows, (cfg.batch,), generator=g)
    item_len = torch.randint(1, 4, (cfg.batch,), generator=g)
    items = (torch.rand(int(item_len.sum()), generator=g) ** 2 * cfg.item_rows).long()  # popular items repeat
    cats = torch.randint(0, cfg.category_rows, (cfg.batch,), generator=g)
    labels = ((users % 3 + cats % 2) % 2).double()
    ones = torch.ones(cfg.batch, dtype=torch.long)
    return {"user": (ones, users), "item": (item_len, items), "category": (ones, cats)}, labels


def local_batch(step: int, cfg: Config, rank: int, world_size: int):
    """This rank's contiguous share of the step's samples.

    Args:
        step: the training step.
        cfg: the configuration.
        rank: the rank.
        world_size: ranks in all.

    Returns:
        ``(KeyedJaggedTensor, labels)`` of ``cfg.batch // world_size`` samples.

    Raises:
        ValueError: if ``cfg.batch`` is not divisible by ``world_size``.
    """
    from torchrec import KeyedJaggedTensor

    if cfg.batch % world_size:
        raise ValueError(
            f"batch={cfg.batch} is not divisible by world size {world_size}: every rank needs the "
            f"same number of samples"
        )
    per = cfg.batch // world_size
    lo, hi = rank * per, (rank + 1) * per
    feats, labels = global_batch(step, cfg)
    lengths, values = [], []
    for t in TABLES:
        length, ids = feats[t]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
        lengths.append(length[lo:hi])
        values.append(ids[offsets[lo] : offsets[hi]])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(TABLES), values=torch.cat(values), lengths=torch.cat(lengths))
    return kjt, labels[lo:hi]


def train_step(ctx, step: int, cfg: Config, dense: DenseOptimizer, seen: dict | None = None) -> torch.Tensor:
    """One step: forward, backward (fbgemm's fused SGD updates the rows), then the tower's Adam.

    The collectives (the all-to-alls, DDP's all-reduce) all come before Adam's step: a step that
    fails leaves Adam and its schedule as the last commit has them.

    Args:
        ctx: the ``TorchRecContext`` (its model is rebuilt at every resize).
        step: the training step.
        cfg: the configuration.
        dense: the tower's optimizer (:class:`DenseOptimizer`).
        seen: when given, receives ``dense_crc``: :meth:`DenseOptimizer.checksum` after the step.

    Returns:
        The loss as a tensor: the loop reads it after the commit (no sync before it).
    """
    t = ctx.topology
    kjt, labels = local_batch(step, cfg, t.rank, t.world_size)
    model = ctx.model  # a new DMP after every resize: read it each step
    tower = [p for n, p in model.named_parameters() if "tower" in n]
    with ctx.guard():  # a failed collective marks the context unhealthy
        logits = model(kjt.to(ctx.device))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(ctx.device))
        loss.backward()
    dense.apply(tower)  # DDP averaged the gradient over the ranks; Adam steps its quantised value
    if seen is not None:
        seen["dense_crc"] = dense.checksum()
    return loss.detach()


# -- the reference: the same steps in one process -------------------------------------------------


def drill_replay(cfg: Config, last_step: int, *, on_step=None):
    """Steps ``0..last_step`` on one process (world size 1): the drill's reference for this workload.

    Args:
        cfg: the configuration the workers ran.
        last_step: the last step to apply.
        on_step: called as ``on_step(step, tables, dense)`` after each step, and with step -1
            before the first.

    Returns:
        ``(tables, history, initial, dense)``: the full tables, per table the rows each step
        changed with their new values, the initial tables, and the tower's optimizer after
        ``last_step`` (what :func:`elastic_emb.drill.replay.verify` needs).

    Raises:
        RuntimeError: if a default process group exists (the replay forms a world of one).
    """
    import torch.distributed as dist

    from elastic_emb import Topology
    from elastic_emb.adapters.torchrec import TorchRecContext

    if dist.is_initialized():
        raise RuntimeError("drill_replay forms a world of one: destroy the default process group first")
    topo = Topology.build(
        run_id="replay",
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
    ctx = TorchRecContext(topo, dist.HashStore(), build=functools.partial(build, cfg=cfg))
    dense = DenseOptimizer(cfg)
    try:
        first_start(ctx, cfg)
        full = lambda: {n: s.weight.detach().clone() for n, s in ctx.export_shard().items()}  # noqa: E731
        initial = full()
        history: dict[str, list] = {n: [] for n in initial}
        if on_step is not None:
            on_step(-1, initial, dense)
        for step in range(last_step + 1):
            train_step(ctx, step, cfg, dense)
            now = full()
            if on_step is not None:
                on_step(step, now, dense)
            feats, _ = global_batch(step, cfg)
            for n in TABLES:
                rows = torch.unique(feats[n][1])
                history[n].append((step, rows, now[n][rows].clone()))
            rows = torch.arange(now["dense"].shape[0])
            history["dense"].append((step, rows, now["dense"].clone()))
        return full(), history, initial, dense
    finally:
        ctx.close()


# -- the elastic training loop (elastic_emb.run_elastic, with the drills' hooks) ------------------


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    """Parse the loop's options and the configuration's.

    Args:
        argv: the command line; default ``sys.argv[1:]``.

    Returns:
        The options and the configuration.
    """
    args = loop_parser(__doc__.split("\n\n")[0], Config()).parse_args(argv)
    return args, Config(**{f: getattr(args, f) for f in asdict(Config())})


def main(argv=None) -> int:
    """Train with a ``TorchRecContext`` under :func:`~elastic_emb.run_elastic`, with the drills' hooks.

    Args:
        argv: the command line; default ``sys.argv[1:]``.

    Returns:
        The process exit code of :func:`~elastic_emb.run_elastic`.
    """
    from elastic_emb import configure_logging, run_elastic
    from elastic_emb.adapters.torchrec import TorchRecContext

    args, cfg = parse_args(argv)
    configure_logging()
    factory = functools.partial(TorchRecContext, build=functools.partial(build, cfg=cfg))
    dense = DenseOptimizer(cfg)
    hooks = DrillHooks(
        args,
        cfg,
        on_first_start=lambda ctx: first_start(ctx, cfg),
        # what the replay compares: the tower's Adam and schedule (the tower itself is the dense table)
        final_extra=lambda lc: {"app": {name: obj.state_dict() for name, obj in dense.objects().items()}},
    )
    return run_elastic(
        factory,
        lambda ctx, step: train_step(ctx, step, cfg, dense, hooks.fields if args.checksums else None),
        steps=args.steps,
        hooks=hooks,
        drain_timeout=args.drain_timeout,
        app_state=dense.objects(),
    )


if __name__ == "__main__":
    sys.exit(main())
