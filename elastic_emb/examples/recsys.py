"""A small but real recommendation model trained elastically with elastic_emb.

Ids read from a dataset file through an ``ElasticSampler`` look up rows of two sharded tables
(``user``, ``item``); a replicated tower (an ``nn.Module``, Adam, a step schedule, gradients
all-reduced) predicts a click; tower, optimizer, schedule and sampler are ``app_state``. Its result
equals a one-process replay bit for bit at any world size: the drills' workload. On every node::

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=elastic_emb \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=recsys -m elastic_emb.examples.recsys --steps 1000 --out runs/recsys

Design: ``docs/DRILLS.md`` (section "The recsys example").
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from elastic_emb.examples.loop import DrillHooks, loop_parser

GRAD_BITS = 10  # gradient grid 2**-10; |per-sample grad| <= 1, so batch <= 2**13 keeps fp32 sums exact
DATA_COLUMNS = 3  # a sample of the dataset file: raw user id, raw item id, label


@dataclass(frozen=True)
class Config:
    """Everything that determines the result; written into every output file."""

    user_rows: int = 4096
    item_rows: int = 4096
    dim: int = 16
    hidden: int = 16
    batch: int = 256  # GLOBAL batch per step, split across the ranks whatever the world size
    samples: int = 5000  # samples in the dataset file (one epoch)
    seed: int = 0
    lr_log2: int = -4  # the tables' SGD learning rate 2**lr_log2: a power of two keeps lr * grad exact
    dense_lr_log2: int = -6  # the tower's Adam learning rate 2**dense_lr_log2
    lr_step: int = 25  # the schedule: the tower's learning rate halves every lr_step steps (StepLR)

    @property
    def lr(self) -> float:
        return 2.0**self.lr_log2

    @property
    def dense_lr(self) -> float:
        return 2.0**self.dense_lr_log2

    @property
    def dense_params(self) -> int:
        return 2 * self.dim * self.hidden + self.hidden + self.hidden + 1

    def check(self) -> None:
        """Refuse a configuration whose gradient sums would not be exact in fp32.

        Raises:
            ValueError: if ``batch`` exceeds ``2**(23 - GRAD_BITS)``.
        """
        if self.batch > 2 ** (24 - GRAD_BITS - 1):
            raise ValueError(
                f"batch={self.batch} too large for exact fp32 gradient sums; keep it <= {2 ** (23 - GRAD_BITS)}"
            )


def table_specs(cfg: Config):
    """The model's sharded tables: ``user`` and ``item`` (the tower is an ``nn.Module``, :class:`Tower`).

    Args:
        cfg: the configuration.

    Returns:
        Their ``TableSpec``s.
    """
    from elastic_emb import TableSpec

    return [
        TableSpec(name="user", num_rows=cfg.user_rows, dim=cfg.dim),
        TableSpec(name="item", num_rows=cfg.item_rows, dim=cfg.dim),
    ]


def optimizer_spec(cfg: Config):
    """The optimizer of the tables: plain SGD at ``cfg.lr``.

    Args:
        cfg: the configuration.

    Returns:
        The ``OptimizerSpec``.
    """
    from elastic_emb import OptimizerSpec

    return OptimizerSpec(kind="sgd", lr=cfg.lr)


# -- data: a NumPy file on disk, read through an ElasticSampler ---------------------------------


def hash_ids(raw: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Hash raw 31-bit ids to table rows (multiplicative hashing; fits in int64 exactly).

    Args:
        raw: int64 ids in ``[0, 2**31)``.
        num_rows: rows of the table.

    Returns:
        Row numbers in ``[0, num_rows)``.
    """
    return ((raw * 2654435761) % (2**31)) % num_rows


def generate_dataset(cfg: Config) -> np.ndarray:
    """The example's dataset, a pure function of ``(seed, samples)``: raw user ids, skewed item ids
    (popular items: some rows get many gradients per step), and click labels.

    Args:
        cfg: the configuration (``seed``, ``samples``).

    Returns:
        ``int64 [samples, 3]``: user id, item id, label (0 or 1).
    """
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + 17) & 0x7FFF_FFFF_FFFF_FFFF)
    users = torch.randint(0, 2**31 - 1, (cfg.samples,), generator=g)
    items = (torch.rand(cfg.samples, generator=g) ** 3 * 50_000).long()
    labels = ((users % 7) + (items % 5)) % 2
    return torch.stack([users, items, labels], 1).numpy()


def default_data_path(out: Path, cfg: Config) -> Path:
    """Where the example writes its generated dataset when ``--data`` is not given.

    Args:
        out: the run's output directory.
        cfg: the configuration.

    Returns:
        ``<out>/data/recsys-n<samples>-s<seed>.npy``.
    """
    return out / "data" / f"recsys-n{cfg.samples}-s{cfg.seed}.npy"


def load_dataset(path: Path, cfg: Config, *, create: bool = True) -> np.ndarray:
    """Read the dataset file, generating it first if it does not exist; refuse one that does not fit.

    Generation is deterministic and the file appears atomically (written to a temporary name,
    then renamed), so the ranks and nodes that start at once may all write it: each rename puts
    the same bytes in place, and no reader sees half a file.

    Args:
        path: the ``.npy`` file.
        cfg: the configuration (``samples``, and ``seed`` for generation).
        create: generate a missing file (False: a missing file is an error).

    Returns:
        ``int64 [samples, 3]``.

    Raises:
        ValueError: the file is not a NumPy array of ``int64 [samples, 3]`` with ids in
            ``[0, 2**31)`` and labels 0 or 1 (one line, naming the file).
    """
    path = Path(path)
    if not path.exists() and create:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, generate_dataset(cfg), allow_pickle=False)
        os.replace(tmp, path)
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"dataset {path}: not a NumPy array file ({type(exc).__name__}: {str(exc)[:120]})") from None
    want = (cfg.samples, DATA_COLUMNS)
    if data.dtype != np.int64 or data.shape != want:
        raise ValueError(
            f"dataset {path} holds {data.dtype} {data.shape}, this run needs int64 {want} (user id, item id, label): "
            f"pass --samples {data.shape[0] if data.ndim == 2 else '?'} for it, or another --data / --out"
        )
    if len(data) and (data[:, :2].min() < 0 or data[:, :2].max() >= 2**31 or not np.isin(data[:, 2], (0, 1)).all()):
        raise ValueError(f"dataset {path}: ids must lie in [0, 2**31) and labels be 0 or 1")
    return data


def dataset_crc(data: np.ndarray) -> int:
    """CRC32 of the dataset's bytes (written with the final state; the replay checks its copy).

    Args:
        data: the dataset.

    Returns:
        The CRC32.
    """
    return zlib.crc32(np.ascontiguousarray(data).view(np.uint8))


def make_sampler(cfg: Config):
    """The job's :class:`~elastic_emb.data.ElasticSampler`: one reader of the global batch.

    Its ``batch_size`` is the GLOBAL batch and every step reads ``indices(0, 1)`` (the step's
    samples in the global order) and ``advance(1)``: the batch is the same whatever the world size,
    and each rank takes its :func:`rank_slice` of it (``docs/DRILLS.md``, "The recsys example").

    Args:
        cfg: the configuration (``samples``, ``batch``, ``seed``).

    Returns:
        The sampler, its cursor at 0.
    """
    from elastic_emb import ElasticSampler

    return ElasticSampler(cfg.samples, cfg.batch, seed=cfg.seed, shuffle=True)


def batch_of(data: np.ndarray, idx: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples ``idx`` of the dataset as table rows and labels.

    Args:
        data: the dataset.
        idx: sample indices (int64).
        cfg: the configuration (table sizes).

    Returns:
        ``(user rows, item rows, labels as float64)``.
    """
    rows = torch.from_numpy(data[idx.numpy()])
    return hash_ids(rows[:, 0], cfg.user_rows), hash_ids(rows[:, 1], cfg.item_rows), rows[:, 2].double()


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` samples (``torch.tensor_split`` bounds).

    Args:
        n: samples in all.
        rank: the rank.
        world_size: ranks in all.

    Returns:
        The slice (empty when ``n < world_size`` leaves the rank none).
    """
    q, r = divmod(n, world_size)
    start = rank * q + min(rank, r)
    return slice(start, start + q + (1 if rank < r else 0))


# -- the model: per-sample gradients on a dyadic grid --------------------------------------------


def quantise(t: torch.Tensor) -> torch.Tensor:
    """Round onto the grid ``2**-GRAD_BITS`` and clamp to [-1, 1].

    Args:
        t: the values (float64).

    Returns:
        The quantised values as fp32 (exact).
    """
    scale = float(2**GRAD_BITS)
    return (torch.round(t * scale).clamp_(-scale, scale) / scale).float()


def unpack_dense(cfg: Config, dense: torch.Tensor):
    """The tower's parameters from their flat vector (:meth:`Tower.flat`).

    Args:
        cfg: the configuration (``dim``, ``hidden``).
        dense: the flat parameters, ``w1, b1, w2, b2`` in that order.

    Returns:
        ``(w1, b1, w2, b2)`` in float64: ``w1`` of shape ``(hidden, 2 * dim)``, ``b1`` and ``w2`` of
        ``(hidden,)``, ``b2`` a scalar.
    """
    p = dense.reshape(-1)[: cfg.dense_params].double()
    d, h = cfg.dim, cfg.hidden
    return p[: 2 * d * h].view(h, 2 * d), p[2 * d * h : 2 * d * h + h], p[2 * d * h + h : 2 * d * h + 2 * h], p[-1]


def tower_loss(cfg: Config, dense: torch.Tensor, u: torch.Tensor, i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample loss of the tower ``logit = w2 . relu(w1 [u; i] + b1) + b2`` (binary cross entropy).

    Args:
        cfg: the configuration.
        dense: the tower's flat parameters (:meth:`Tower.flat`).
        u: the samples' user rows.
        i: the samples' item rows.
        y: the labels (float64).

    Returns:
        One loss per sample (float64).
    """
    w1, b1, w2, b2 = unpack_dense(cfg, dense)
    h = torch.relu(torch.cat([u, i], 1).double() @ w1.T + b1)
    return torch.nn.functional.binary_cross_entropy_with_logits(h @ w2 + b2, y, reduction="none")


def sample_gradients(cfg: Config, dense: torch.Tensor, u: torch.Tensor, i: torch.Tensor, y: torch.Tensor):
    """Quantised per-sample gradients: (loss sum, d dense [n, P], d user rows [n, dim], d item rows [n, dim]).

    The gradient of :func:`tower_loss`, written out (a two-layer MLP's backward pass is four
    lines) rather than taken with ``torch.func.vmap(grad(...))``: same values (the tests check
    that they quantise identically), but cheaper per step and without functorch's warm-up on a
    worker's first step, which would show in every recovery time.

    Args:
        cfg: the configuration.
        dense: the tower's flat parameters (:meth:`Tower.flat`).
        u: the samples' user rows.
        i: the samples' item rows.
        y: the labels (float64).

    Returns:
        ``(loss sum, d dense [n, P], d user rows [n, dim], d item rows [n, dim])``, the gradients
        quantised (:func:`quantise`).
    """
    w1, b1, w2, b2 = unpack_dense(cfg, dense)
    x = torch.cat([u, i], 1).double()
    z = x @ w1.T + b1
    h = torch.relu(z)
    logit = h @ w2 + b2
    loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="sum")) if len(y) else 0.0
    d_logit = torch.sigmoid(logit) - y  # d loss_n / d logit_n
    d_z = d_logit[:, None] * w2 * (z > 0)  # [n, hidden]
    g_w1 = (d_z[:, :, None] * x[:, None, :]).reshape(len(y), -1)  # per-sample outer products
    g_dense = torch.cat([g_w1, d_z, d_logit[:, None] * h, d_logit[:, None]], 1)
    g_x = d_z @ w1  # [n, 2*dim]
    return loss, quantise(g_dense), quantise(g_x[:, : cfg.dim]), quantise(g_x[:, cfg.dim :])


def lookup_checksum(u: torch.Tensor, i: torch.Tensor) -> int:
    """CRC32 of the rows a step looked up.

    Args:
        u: the user rows.
        i: the item rows.

    Returns:
        The CRC32 of their bytes, in that order.
    """
    crc = 0
    for t in (u, i):
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def samples_checksum(idx: torch.Tensor) -> int:
    """CRC32 of the sample indices a rank read in a step (the replay checks them against the global order).

    Args:
        idx: the indices (int64).

    Returns:
        The CRC32 of their bytes.
    """
    return zlib.crc32(idx.detach().cpu().contiguous().to(torch.int64).view(torch.uint8).numpy())


# -- the dense part: a replicated nn.Module, Adam, a schedule, the sampler (app state) ----------


class Tower(torch.nn.Module):
    """The dense tower, ``logit = w2 . relu(w1 [u; i] + b1) + b2``: fp32 parameters, replicated on
    every rank (the same seed draws them everywhere), trained with Adam.

    Args:
        cfg: the configuration (``dim``, ``hidden``, ``seed``).
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + 29) & 0x7FFF_FFFF_FFFF_FFFF)
        d, h = cfg.dim, cfg.hidden

        def draw(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter((torch.rand(*shape, generator=g) * 2 - 1) / (2 * d) ** 0.5)

        self.w1, self.b1, self.w2, self.b2 = draw(h, 2 * d), draw(h), draw(h), draw(1)

    def flat(self) -> torch.Tensor:
        """The parameters as one vector, ``w1, b1, w2, b2`` (what :func:`sample_gradients` takes).

        Returns:
            The detached fp32 vector of ``cfg.dense_params`` values.
        """
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()])

    def set_grad(self, flat: torch.Tensor) -> None:
        """Lay a flat gradient (:meth:`flat`'s order) onto the parameters' ``.grad``.

        Args:
            flat: fp32, ``cfg.dense_params`` values.
        """
        offset = 0
        for p in self.parameters():
            p.grad = flat[offset : offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()


class Dense:
    """The replicated part of the training state: the tower, its Adam, its schedule, the sampler.

    Built the same way on every rank and in the drills' replay; :meth:`objects` is what the
    example passes to ``run_elastic`` as ``app_state``, committed and restored with the tables.
    The tower and its optimizer stay on the CPU whatever the device (its gradient is all-reduced
    on the device): Adam then takes the same steps, bit for bit, as the replay's.

    Args:
        cfg: the configuration.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.model = Tower(cfg)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=cfg.dense_lr, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=cfg.lr_step, gamma=0.5)
        self.sampler = make_sampler(cfg)

    def objects(self) -> dict:
        """The app state: ``model``, ``optim``, ``sched``, ``sampler``.

        Returns:
            name -> object with ``state_dict``/``load_state_dict``.
        """
        return {"model": self.model, "optim": self.optim, "sched": self.sched, "sampler": self.sampler}

    def step_samples(self) -> torch.Tensor:
        """The samples of the step at the sampler's cursor, in the global order (the global batch).

        Returns:
            ``cfg.batch`` indices.
        """
        return self.sampler.indices(0, 1)

    def apply(self, grad: torch.Tensor) -> None:
        """One optimizer step with the step's summed tower gradient, then the schedule and the sampler.

        Args:
            grad: the flat fp32 gradient summed over the global batch (on the CPU).
        """
        self.model.set_grad(grad)
        self.optim.step()
        self.sched.step()
        self.sampler.advance(1)

    def checksum(self) -> int:
        """CRC32 of the tower's parameters and Adam's moments (each step's progress line carries it).

        Returns:
            The CRC32.
        """
        crc = 0
        for p in self.model.parameters():
            crc = zlib.crc32(p.detach().contiguous().view(torch.uint8).numpy(), crc)
            for key in ("exp_avg", "exp_avg_sq"):
                t = self.optim.state.get(p, {}).get(key)
                if t is not None:
                    crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
        return crc


def train_step(ctx, step: int, cfg: Config, dense: Dense, data: np.ndarray, seen: dict | None = None) -> float:
    """One step of this rank's slice of the global batch; every rank calls every collective
    (possibly with no samples).

    The collectives come first (the lookups, the tower's all-reduce, the tables' gradients) and
    the replicated state changes last, once none of them can fail any more: a step that fails
    leaves the tower, Adam, the schedule and the sampler as the last commit has them.

    Args:
        ctx: the context (``lookup``, ``apply_gradients``, ``process_group``).
        step: the training step.
        cfg: the configuration.
        dense: the replicated state (:class:`Dense`).
        data: the dataset (:func:`load_dataset`).
        seen: when given, receives ``lookup_crc``, ``samples_crc`` and ``dense_crc``: checksums of
            the rows looked up, the sample indices read and the tower's state after the step.

    Returns:
        The mean loss over this rank's samples (0 with none).
    """
    rank, world = ctx.topology.rank, ctx.topology.world_size
    device = getattr(ctx, "device", None) or torch.device("cpu")  # cuda:LOCAL_RANK under nccl
    idx = dense.step_samples()[rank_slice(cfg.batch, rank, world)]
    users, items, labels = (t.to(device) for t in batch_of(data, idx, cfg))
    # Issue both lookups, then wait: the context may overlap their communication.
    h_user, h_item = ctx.lookup("user", users), ctx.lookup("item", items)
    u, i = h_user.wait(), h_item.wait()
    loss, g_dense, g_u, g_i = sample_gradients(cfg, dense.model.flat().to(device), u, i, labels)
    grad = g_dense.sum(0)  # exact: quantised per-sample gradients, fewer than 2**13 of them
    if world > 1:  # the replicated tower's all-reduce (SUM): exact in any order, so equal on every rank
        ctx.process_group.allreduce([grad]).wait()
    ctx.apply_gradients("user", users, g_u)
    ctx.apply_gradients("item", items, g_i)
    dense.apply(grad.cpu())
    if seen is not None:
        seen.update(lookup_crc=lookup_checksum(u, i), samples_crc=samples_checksum(idx), dense_crc=dense.checksum())
    return loss / max(1, len(labels))


# -- the elastic training loop (elastic_emb.run_elastic, with the drills' hooks) ------------------


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    """Parse the loop's options, ``--data``, and the configuration's.

    Args:
        argv: the command line; default ``sys.argv[1:]``.

    Returns:
        The options and the checked configuration.

    Raises:
        ValueError: if the batch is too large for exact sums (:meth:`Config.check`).
    """
    parser = loop_parser(__doc__.split("\n\n")[0], Config())
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="The dataset, a NumPy int64 [samples, 3] file (user id, item id, label); generated there "
        "(deterministically, from --seed and --samples) if missing. Default: <out>/data/recsys-n<samples>-s<seed>.npy.",
    )
    args = parser.parse_args(argv)
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    cfg.check()
    return args, cfg


def main(argv=None) -> int:
    """Train with an ``EmbContext`` under :func:`~elastic_emb.run_elastic`, with the drills' hooks.

    Args:
        argv: the command line; default ``sys.argv[1:]``.

    Returns:
        The process exit code of :func:`~elastic_emb.run_elastic`.

    Raises:
        SystemExit: the dataset file does not fit the configuration (one line, naming it).
    """
    from elastic_emb import EmbContext, configure_logging, run_elastic

    args, cfg = parse_args(argv)
    configure_logging()
    path = (args.data or default_data_path(args.out, cfg)).resolve()
    try:
        data = load_dataset(path, cfg)
    except ValueError as exc:
        raise SystemExit(f"recsys: {exc}") from None
    dense = Dense(cfg)
    factory = functools.partial(EmbContext, tables=table_specs(cfg), optimizer=optimizer_spec(cfg), seed=cfg.seed)

    def final(lc) -> dict:
        # what the replay compares: the replicated state, and which dataset it read
        return {
            "app": {name: obj.state_dict() for name, obj in dense.objects().items()},
            "data": {"path": str(path), "crc": dataset_crc(data)},
        }

    hooks = DrillHooks(args, cfg, final_extra=final)
    return run_elastic(
        factory,
        lambda ctx, step: train_step(ctx, step, cfg, dense, data, hooks.fields if args.checksums else None),
        steps=args.steps,
        hooks=hooks,
        drain_timeout=args.drain_timeout,
        app_state=dense.objects(),
    )


if __name__ == "__main__":
    sys.exit(main())
