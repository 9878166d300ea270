"""A small but real recommendation model trained elastically with elastic_emb.

Hashed user and item ids look up rows of two sharded tables (``user``, ``item``); a dense tower,
stored as a third table (``dense``), predicts a click. Its result equals a single-process replay
bit for bit at any world size, so it doubles as the drills' workload. Run it on every node::

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=elastic_emb \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=recsys -m elastic_emb.examples.recsys --steps 1000 --out runs/recsys

Design: ``docs/DRILLS.md`` (section "The recsys example").
"""

from __future__ import annotations

import argparse
import functools
import sys
import zlib
from dataclasses import asdict, dataclass

import torch

from elastic_emb.examples.loop import DrillHooks, loop_parser

GRAD_BITS = 10  # gradient grid 2**-10; |per-sample grad| <= 1, so batch <= 2**13 keeps fp32 sums exact
DENSE_DIM = 16  # parameters per row of the `dense` table


@dataclass(frozen=True)
class Config:
    """Everything that determines the result; written into every output file."""

    user_rows: int = 4096
    item_rows: int = 4096
    dim: int = 16
    hidden: int = 16
    batch: int = 256
    seed: int = 0
    lr_log2: int = -4  # SGD learning rate 2**lr_log2: a power of two keeps lr * grad exact

    @property
    def lr(self) -> float:
        return 2.0**self.lr_log2

    @property
    def dense_params(self) -> int:
        return 2 * self.dim * self.hidden + self.hidden + self.hidden + 1

    @property
    def dense_rows(self) -> int:
        return -(-self.dense_params // DENSE_DIM)

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
    """The model's tables: ``user``, ``item``, and ``dense`` (the tower's parameters, ``DENSE_DIM`` per row).

    Args:
        cfg: the configuration.

    Returns:
        Their ``TableSpec``s.
    """
    from elastic_emb import TableSpec

    return [
        TableSpec(name="user", num_rows=cfg.user_rows, dim=cfg.dim),
        TableSpec(name="item", num_rows=cfg.item_rows, dim=cfg.dim),
        TableSpec(name="dense", num_rows=cfg.dense_rows, dim=DENSE_DIM),
    ]


def optimizer_spec(cfg: Config):
    """The optimizer of every table: plain SGD at ``cfg.lr``.

    Args:
        cfg: the configuration.

    Returns:
        The ``OptimizerSpec``.
    """
    from elastic_emb import OptimizerSpec

    return OptimizerSpec(kind="sgd", lr=cfg.lr)


# -- data: a pure function of (seed, step) ------------------------------------------------------


def hash_ids(raw: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Hash raw 31-bit ids to table rows (multiplicative hashing; fits in int64 exactly).

    Args:
        raw: int64 ids in ``[0, 2**31)``.
        num_rows: rows of the table.

    Returns:
        Row numbers in ``[0, num_rows)``.
    """
    return ((raw * 2654435761) % (2**31)) % num_rows


def global_batch(step: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole step's samples, identical on every rank and in the replay (a function of seed and step).

    Args:
        step: the training step.
        cfg: the configuration (``seed``, ``batch``, table sizes).

    Returns:
        ``(user rows, item rows, labels)``, ``cfg.batch`` of each; items are skewed towards popular rows.
    """
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    users = torch.randint(0, 2**31 - 1, (cfg.batch,), generator=g)
    # Popular items: a skewed draw, so some rows get many gradients per step (duplicate ids).
    items = (torch.rand(cfg.batch, generator=g) ** 3 * 50_000).long()
    labels = (((users % 7) + (items % 5)) % 2).double()
    return hash_ids(users, cfg.user_rows), hash_ids(items, cfg.item_rows), labels


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
    """The tower's parameters from the rows of the ``dense`` table.

    Args:
        cfg: the configuration (``dim``, ``hidden``).
        dense: the ``dense`` table's rows.

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
        dense: the ``dense`` table's rows.
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
        dense: the ``dense`` table's rows.
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


def dense_gradient_rows(cfg: Config, g_dense: torch.Tensor) -> torch.Tensor:
    """Sum per-sample dense gradients (exact) and lay them out as rows of the ``dense`` table.

    Args:
        cfg: the configuration.
        g_dense: per-sample gradients of the tower's parameters, ``[n, P]``.

    Returns:
        The summed gradient, ``[dense_rows, DENSE_DIM]`` fp32 (zero past the last parameter).
    """
    flat = torch.zeros(cfg.dense_rows * DENSE_DIM, dtype=torch.float32, device=g_dense.device)
    flat[: cfg.dense_params] = g_dense.sum(0)
    return flat.view(cfg.dense_rows, DENSE_DIM)


def lookup_checksum(dense: torch.Tensor, u: torch.Tensor, i: torch.Tensor) -> int:
    """CRC32 of the rows a step looked up.

    Args:
        dense: the ``dense`` rows.
        u: the user rows.
        i: the item rows.

    Returns:
        The CRC32 of their bytes, in that order.
    """
    crc = 0
    for t in (dense, u, i):
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def train_step(ctx, step: int, cfg: Config, seen: dict | None = None) -> float:
    """One step of this rank's slice; every rank calls every collective (possibly with no samples).

    Args:
        ctx: the context (``lookup`` and ``apply_gradients``).
        step: the training step.
        cfg: the configuration.
        seen: when given, receives ``lookup_crc``: the checksum of the rows this rank looked up.

    Returns:
        The mean loss over this rank's samples (0 with none).
    """
    rank, world = ctx.topology.rank, ctx.topology.world_size
    device = getattr(ctx, "device", None) or torch.device("cpu")  # cuda:LOCAL_RANK under nccl
    users, items, labels = global_batch(step, cfg)
    mine = rank_slice(cfg.batch, rank, world)
    users, items, labels = users[mine].to(device), items[mine].to(device), labels[mine].to(device)
    dense_ids = torch.arange(cfg.dense_rows, device=device)
    # Issue the three lookups, then wait: the context may overlap their communication.
    h_dense, h_user, h_item = (ctx.lookup("dense", dense_ids), ctx.lookup("user", users), ctx.lookup("item", items))
    dense, u, i = h_dense.wait(), h_user.wait(), h_item.wait()
    if seen is not None:
        seen["lookup_crc"] = lookup_checksum(dense, u, i)
    loss, g_dense, g_u, g_i = sample_gradients(cfg, dense, u, i, labels)
    ctx.apply_gradients("user", users, g_u)
    ctx.apply_gradients("item", items, g_i)
    ctx.apply_gradients("dense", dense_ids, dense_gradient_rows(cfg, g_dense).to(device))
    return loss / max(1, len(labels))


# -- the elastic training loop (elastic_emb.run_elastic, with the drills' hooks) ------------------


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    """Parse the loop's options and the configuration's.

    Args:
        argv: the command line; default ``sys.argv[1:]``.

    Returns:
        The options and the checked configuration.

    Raises:
        ValueError: if the batch is too large for exact sums (:meth:`Config.check`).
    """
    args = loop_parser(__doc__.split("\n\n")[0], Config()).parse_args(argv)
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    cfg.check()
    return args, cfg


def main(argv=None) -> int:
    """Train with an ``EmbContext`` under :func:`~elastic_emb.run_elastic`, with the drills' hooks.

    Args:
        argv: the command line; default ``sys.argv[1:]``.

    Returns:
        The process exit code of :func:`~elastic_emb.run_elastic`.
    """
    from elastic_emb import EmbContext, configure_logging, run_elastic

    args, cfg = parse_args(argv)
    configure_logging()
    factory = functools.partial(EmbContext, tables=table_specs(cfg), optimizer=optimizer_spec(cfg), seed=cfg.seed)
    hooks = DrillHooks(args, cfg)
    return run_elastic(
        factory,
        lambda ctx, step: train_step(ctx, step, cfg, hooks.fields if args.checksums else None),
        steps=args.steps,
        hooks=hooks,
        drain_timeout=args.drain_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
