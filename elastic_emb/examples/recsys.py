"""A small but real recommendation model trained elastically with elastic_emb.

It ships with the package, so it runs from an installed wheel as well as from a checkout. Run
it the way a user would, on every node, either as a module::

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=elastic_emb \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=recsys -m elastic_emb.examples.recsys --steps 1000 --out runs/recsys

or by its file path, which ``elastic-emb example-path`` prints (``torchrun ... "$(elastic-emb
example-path)" --steps 1000 --out runs/recsys``). ``python -m elastic_emb.examples.recsys --help``
lists its options.

The model: hashed user and item ids look up rows of two sharded embedding tables (``user``,
``item``); a dense tower (an MLP over the two concatenated rows) predicts a click; binary cross
entropy; SGD. Nodes may join, leave or die at any time: the :class:`~elastic_emb.lifecycle.manager.Lifecycle`
commits the tables after every step, rebuilds the context for each new world size and restores
the newest commit, resharded. The loop (:func:`~elastic_emb.examples.loop.run_elastic`, shared
with the TorchRec example) is all a user writes: start, step, commit, and stop stepping when the
lifecycle says the job is draining for a restart.

Why the numbers look the way they do (this script doubles as the drills' workload, whose result
must equal a single-process replay *bit for bit* whatever world sizes it ran at):

- The data is a pure function of ``(seed, step)``: a fixed GLOBAL batch per step, whatever the
  world size; rank ``r`` of ``W`` takes the ``r``-th of ``W`` contiguous slices. So after any
  sequence of committed steps the expected tables are computable by one process.
- Float sums in a different order differ, and a different world size sums gradients in a
  different order. So every per-sample gradient is quantised onto a dyadic grid (multiples of
  ``2**-GRAD_BITS``, magnitude at most 1): sums of such numbers are exact in fp32 while they stay
  below ``2**(24 - GRAD_BITS)``, hence equal in any order. The learning rate is a power of two, so
  ``lr * grad`` is exact too, and each row sees one rounding per step, ``w - lr*G``, as in the
  replay. The per-sample gradients are computed in float64 before quantisation, so a sample's
  gradient does not depend on which other samples share its rank (different batch shapes may
  round the last bits of a float64 differently; 2**-10 grid steps are far coarser).
- The dense tower is replicated in spirit but stored as a third sharded table (``dense``: its
  flattened parameters, ``DENSE_DIM`` per row) that every rank looks up in full. That puts it in
  the same commit as the embeddings (one atomic snapshot, carried across resizes with them) and
  makes its all-reduce the context's exact duplicate-id summation.
"""

from __future__ import annotations

import argparse
import functools
import sys
import zlib
from dataclasses import asdict, dataclass

import torch

from elastic_emb.examples.loop import loop_parser, run_elastic

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
        return 2.0 ** self.lr_log2

    @property
    def dense_params(self) -> int:
        return 2 * self.dim * self.hidden + self.hidden + self.hidden + 1

    @property
    def dense_rows(self) -> int:
        return -(-self.dense_params // DENSE_DIM)

    def check(self) -> None:
        if self.batch > 2 ** (24 - GRAD_BITS - 1):
            raise ValueError(f"batch={self.batch} too large for exact fp32 gradient sums; keep it <= {2 ** (23 - GRAD_BITS)}")


def table_specs(cfg: Config):
    from elastic_emb import TableSpec

    return [
        TableSpec(name="user", num_rows=cfg.user_rows, dim=cfg.dim),
        TableSpec(name="item", num_rows=cfg.item_rows, dim=cfg.dim),
        TableSpec(name="dense", num_rows=cfg.dense_rows, dim=DENSE_DIM),
    ]


def optimizer_spec(cfg: Config):
    from elastic_emb import OptimizerSpec

    return OptimizerSpec(kind="sgd", lr=cfg.lr)


# -- data: a pure function of (seed, step) ------------------------------------------------------

def hash_ids(raw: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Hash raw 31-bit ids to table rows (multiplicative hashing; fits in int64 exactly)."""
    return ((raw * 2654435761) % (2**31)) % num_rows


def global_batch(step: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(user rows, item rows, labels) of the whole step, identical on every rank and in the replay."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    users = torch.randint(0, 2**31 - 1, (cfg.batch,), generator=g)
    # Popular items: a skewed draw, so some rows get many gradients per step (duplicate ids).
    items = (torch.rand(cfg.batch, generator=g) ** 3 * 50_000).long()
    labels = (((users % 7) + (items % 5)) % 2).double()
    return hash_ids(users, cfg.user_rows), hash_ids(items, cfg.item_rows), labels


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` samples (``torch.tensor_split`` bounds)."""
    q, r = divmod(n, world_size)
    start = rank * q + min(rank, r)
    return slice(start, start + q + (1 if rank < r else 0))


# -- the model: per-sample gradients on a dyadic grid --------------------------------------------

def quantise(t: torch.Tensor) -> torch.Tensor:
    """Round onto the grid 2**-GRAD_BITS, clamp to [-1, 1], return fp32 (exact)."""
    scale = float(2**GRAD_BITS)
    return (torch.round(t * scale).clamp_(-scale, scale) / scale).float()


def unpack_dense(cfg: Config, dense: torch.Tensor):
    """The tower's parameters (float64) from the rows of the ``dense`` table: w1, b1, w2, b2."""
    p = dense.reshape(-1)[: cfg.dense_params].double()
    d, h = cfg.dim, cfg.hidden
    return p[: 2 * d * h].view(h, 2 * d), p[2 * d * h: 2 * d * h + h], p[2 * d * h + h: 2 * d * h + 2 * h], p[-1]


def tower_loss(cfg: Config, dense: torch.Tensor, u: torch.Tensor, i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample loss of the tower ``logit = w2 . relu(w1 [u; i] + b1) + b2`` (binary cross entropy)."""
    w1, b1, w2, b2 = unpack_dense(cfg, dense)
    h = torch.relu(torch.cat([u, i], 1).double() @ w1.T + b1)
    return torch.nn.functional.binary_cross_entropy_with_logits(h @ w2 + b2, y, reduction="none")


def sample_gradients(cfg: Config, dense: torch.Tensor, u: torch.Tensor, i: torch.Tensor, y: torch.Tensor):
    """Quantised per-sample gradients: (loss sum, d dense [n, P], d user rows [n, dim], d item rows [n, dim]).

    The gradient of :func:`tower_loss`, written out (a two-layer MLP's backward pass is four
    lines) rather than taken with ``torch.func.vmap(grad(...))``: same values (the tests check
    that they quantise identically), but 10x cheaper per step and without functorch's seconds
    of warm-up on a worker's first step, which would show in every recovery time.
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
    return loss, quantise(g_dense), quantise(g_x[:, : cfg.dim]), quantise(g_x[:, cfg.dim:])


def dense_gradient_rows(cfg: Config, g_dense: torch.Tensor) -> torch.Tensor:
    """Sum per-sample dense gradients (exact) and lay them out as rows of the ``dense`` table."""
    flat = torch.zeros(cfg.dense_rows * DENSE_DIM, dtype=torch.float32, device=g_dense.device)
    flat[: cfg.dense_params] = g_dense.sum(0)
    return flat.view(cfg.dense_rows, DENSE_DIM)


def lookup_checksum(dense: torch.Tensor, u: torch.Tensor, i: torch.Tensor) -> int:
    """CRC32 of the rows a step looked up (dense, user, item, in that order)."""
    crc = 0
    for t in (dense, u, i):
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def train_step(ctx, step: int, cfg: Config, seen: dict | None = None) -> float:
    """One step of this rank's slice; every rank calls every collective (possibly with no samples).

    ``seen``, when given, receives ``lookup_crc``: the checksum of the rows this rank looked up."""
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


# -- the elastic training loop (examples/loop.py) --------------------------------------------------

def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    args = loop_parser(__doc__.split("\n\n")[0], Config()).parse_args(argv)
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    cfg.check()
    return args, cfg


def main(argv=None) -> int:
    from elastic_emb import EmbContext, configure_logging

    args, cfg = parse_args(argv)
    configure_logging()
    factory = functools.partial(EmbContext, tables=table_specs(cfg), optimizer=optimizer_spec(cfg), seed=cfg.seed)
    return run_elastic(factory, lambda ctx, step, fields: train_step(ctx, step, cfg, fields if args.checksums else None),
                       args, cfg)


if __name__ == "__main__":
    sys.exit(main())
