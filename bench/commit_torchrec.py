"""Commit every step of a TorchRec model through the public API: a whole run against the same run without commits.

One process, one rank (gloo on the CPU; ``--device cuda``: NCCL on one GPU), as the TorchRec
example (``elastic_emb/examples/dlrm.py``) runs: ``Lifecycle.start`` with the default
``LifecycleConfig`` over a :class:`~elastic_emb.adapters.torchrec.TorchRecContext` whose build
function makes a ``DistributedModelParallel`` of one ``EmbeddingBagCollection`` table of
``--table-mb`` MB (fp32, ``--dim`` columns), row-wise sharded with fbgemm's fused row-wise
Adagrad; the adapter's default change tracking (commits are incremental). A step: ``--ids``
random ids (one per sample), the forward, the loss (the sum of the pooled rows) and its backward,
which updates the looked-up rows (the fused optimizer).

In this process, as bench/commit.py (bench/_run_loop.py, the loop the commit benches share):
``baseline`` (``--steps`` steps, default 200, no commit), ``commit`` (the same steps, each ended
by ``lc.commit(step)``), each with a fresh state directory under ``--state-dir`` (default
/dev/shm), every row looked up once (a forward without gradients, ``--ids`` rows at a time) and
two steps run without a commit before its clock starts; then the restore (``Lifecycle.start`` of fresh objects from the last
commit, checked against the committed rows) beside its floors (the restored chain and the node
directory, each read once). Reported: mean, median, p99, max and first step, max / median, the
commit loop's mean over the baseline's, the drain after the last step, the restore. JSON to
``--json``.

Earlier versions compared full, incremental and re-based modes in separate processes, by the
median step of short runs; the run's figures replace them (git history keeps them).

  python bench/commit_torchrec.py --table-mb 256 --ids 4096 --steps 200
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402
from _run_loop import (  # noqa: E402
    OneRank,
    baseline_and_commit,
    env_summary,
    exit_on_sigterm,
    print_run,
    table_bytes,
    warm_note,
)

TABLE = "t"
WARM = "every row looked up once (a forward without gradients, the step's id count at a time)"


def build(topology, env, device, rows: int, dim: int):
    """The ``DistributedModelParallel`` of one table, row-wise, fbgemm's fused row-wise Adagrad."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=TABLE, embedding_dim=dim, num_embeddings=rows, feature_names=["f"])],
        device=torch.device("meta"),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}
    )
    # On the CPU the stock planner offers no row-wise plan: ask for it (as the example does).
    plan = construct_module_sharding_plan(
        ebc,
        {TABLE: row_wise(compute_kernel="fused")},
        world_size=topology.world_size,
        device_type=device.type,
        sharder=sharder,
    )
    return DistributedModelParallel(ebc, env=env, device=device, plan=ShardingPlan({"": plan}), sharders=[sharder])


def batch(ids):
    """A KeyedJaggedTensor of one id per sample."""
    import torch
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=ids, lengths=torch.ones(len(ids), dtype=torch.int64, device=ids.device)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-mb", type=int, default=256, help="table MB (weights; the Adagrad slot adds 1/dim)")
    ap.add_argument("--dim", type=int, default=64, help="columns (fbgemm needs a multiple of 4)")
    ap.add_argument("--ids", type=int, default=4096, help="random ids per step")
    ap.add_argument("--steps", type=int, default=200, help="steps per loop (issue 34: at least 200)")
    ap.add_argument("--state-dir", default="/dev/shm", help="where each loop's fresh state directory is made")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL on one GPU")
    ap.add_argument("--json", default="bench/commit_torchrec.json")
    args = ap.parse_args()
    exit_on_sigterm()
    for name in ("table_mb", "dim", "ids", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.dim % 4:
        ap.error(f"--dim={args.dim}: fbgemm's kernels need a multiple of 4")
    if not Path(args.state_dir).is_dir():
        ap.error(f"--state-dir={args.state_dir!r} is not a directory: make it, or pass another")

    import torch

    from elastic_emb.adapters.torchrec import TorchRecContext

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench/commit_torchrec.py --device cuda: no CUDA device; leave --device at cpu")
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = args.table_mb * 2**20 // (args.dim * 4)
    factory = functools.partial(
        TorchRecContext, build=functools.partial(build, rows=rows, dim=args.dim), dense_table=None, timeout=120.0
    )

    def make_step():
        gen = torch.Generator(device=dev).manual_seed(1)  # the same ids in every loop

        def step(lc, s: int) -> None:
            ids = torch.randint(0, rows, (args.ids,), generator=gen, device=dev)
            lc.context.model(batch(ids)).values().sum().backward()

        return step

    def warm(lc) -> None:
        with torch.no_grad():
            for lo in range(0, rows, args.ids):
                lc.context.model(batch(torch.arange(lo, min(rows, lo + args.ids), device=dev))).values().sum().item()

    root = Path(tempfile.mkdtemp(prefix="elastic_emb-bench-commit-torchrec-", dir=args.state_dir))
    world = OneRank("bench", backend="nccl" if cuda else "gloo")
    out: dict = {
        "device": str(dev),
        "rows": rows,
        "dim": args.dim,
        "ids": args.ids,
        "table_bytes": table_bytes(rows, args.dim),
        "warm": warm_note(WARM),
        "process": env_summary(),
        "table": f"{args.table_mb} MB x {args.dim}",
    }
    try:
        out.update(
            baseline_and_commit(world, root, out["table"], factory, make_step, steps=args.steps, warm=warm, sync=sync)
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_run([out], ("table", "table"))
    write_json(args.json, "commit_torchrec", {"args": vars(args), **out})


if __name__ == "__main__":
    main()
