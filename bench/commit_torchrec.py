"""Cost of a commit every step for a TorchRec model: full snapshots against incremental commits.

Two rank processes (gloo on CPU, each its own "node", so every commit also sends a replica to the
other), each running a ``Lifecycle`` over :class:`~elastic_emb.adapters.torchrec.TorchRecContext`:
one ``EmbeddingBagCollection`` table of ``--table-mb`` MB per rank (fp32, ``--dim`` columns),
row-wise sharded with fbgemm's fused row-wise Adagrad, and a step of ``--ids`` random ids per rank
(one per sample, the loss the sum of the pooled rows). Modes, each in fresh processes:

* ``none``: the step alone (the baseline);
* ``full``: the step and ``lc.commit(step)`` with ``track_changes=False`` (a full snapshot of the
  shard, synchronous: what the adapter did before it tracked changes);
* ``incremental``: the step and ``lc.commit(step)`` with the adapter's change tracking (the
  default: the rows looked up, committed asynchronously; every ``--max-chain``-th delta folded
  into a base by its holders in the background);
* ``rebased``: as ``incremental`` with ``LifecycleConfig(fold=False)``: a full base captured
  every ``--max-chain + 1``-th commit instead of the folds (what the library did before it folded).

Per mode, ``--steps`` steps (``--full-steps`` for ``full``) after ``--warmup``; the modes run in rotated order ``--reps`` times,
so the machine's drift hits all of them. Reported per mode: the median step time (the slower
rank of each step) over all repetitions, the time the commit adds to a step and the overhead
against ``none``, each the median over the repetitions of the difference (ratio) to that
repetition's ``none``, the same for the mean step (which holds the steps whose commit is a new
base, every ``--max-chain + 1``-th, or waits for one), and the median time inside ``commit()``. JSON to ``--json``
(``--summarize`` prints the summary of a JSON again).

  python bench/commit_torchrec.py --table-mb 256 --ids 4096 --reps 3 --steps 180 --full-steps 36
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import collect, start, torchrun_env

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

MODES = ("none", "full", "incremental", "rebased")


def measured(args, mode: str) -> int:
    """Steps measured in ``mode``: the full snapshot's cost is the same every step, so it needs
    fewer than the incremental modes, whose mean must hold several fold points or bases."""
    return min(args.steps, args.full_steps) if mode == "full" else args.steps


def build(topology, env, device, rows: int, dim: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])],
        device=torch.device("meta"),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}
    )
    plan = construct_module_sharding_plan(
        ebc,
        {"t": row_wise(compute_kernel="fused")},
        world_size=topology.world_size,
        device_type=device.type,
        sharder=sharder,
    )
    return DistributedModelParallel(ebc, env=env, device=device, plan=ShardingPlan({"": plan}), sharders=[sharder])


def worker(args) -> None:
    import functools

    from torchrec import KeyedJaggedTensor

    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.adapters.torchrec import TorchRecContext

    rows = args.table_mb * 2**20 // (args.dim * 4) * args.world
    factory = functools.partial(
        TorchRecContext,
        build=functools.partial(build, rows=rows, dim=args.dim),
        dense_table=None,
        track_changes=args.mode in ("incremental", "rebased"),
        timeout=120.0,
    )
    lc = Lifecycle.start(factory, LifecycleConfig(max_chain=args.max_chain, fold=args.mode != "rebased"))
    gen = torch.Generator().manual_seed(lc.topology.rank)
    steps, commits = [], []
    for step in range(args.warmup + measured(args, args.mode)):
        ids = torch.randint(0, rows, (args.ids,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=ids, lengths=torch.ones(args.ids, dtype=torch.int64)
        )
        t0 = time.perf_counter()
        lc.context.model(kjt).values().sum().backward()
        t1 = time.perf_counter()
        if args.mode != "none":
            lc.commit(step)
        t2 = time.perf_counter()
        if step >= args.warmup:
            steps.append(t2 - t0)
            commits.append(t2 - t1)
    lc.close()  # (waits for the commits in flight)
    print(json.dumps({"steps": steps, "commits": commits, "rows": rows}), flush=True)


def launch(args, mode: str, state_dir: str) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(args.world):
        # each rank its own node (so every commit also sends a replica)
        env = torchrun_env(
            rank,
            args.world,
            port,
            local_world_size=1,
            run_id=f"bench-{mode}",
            extra={
                "ELASTIC_EMB_LOG_LEVEL": "warning",
                "ELASTIC_EMB_STATE_DIR": os.path.join(state_dir, mode, f"node{rank}"),
            },
        )
        cmd = [
            "python",
            __file__,
            "--worker",
            "--mode",
            mode,
            "--table-mb",
            str(args.table_mb),
            "--dim",
            str(args.dim),
            "--ids",
            str(args.ids),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--world",
            str(args.world),
            "--max-chain",
            str(args.max_chain),
            "--full-steps",
            str(args.full_steps),
        ]
        procs.append(start(cmd, env))
    try:
        return collect(procs, args.timeout, f"mode {mode}")
    finally:
        shutil.rmtree(os.path.join(state_dir, mode), ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-mb", type=int, default=256, help="table MB per rank (weights; Adagrad adds 1/dim)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=4096, help="ids per step per rank")
    ap.add_argument(
        "--steps",
        type=int,
        default=180,
        help="measured steps per mode and repetition (a multiple of "
        "--max-chain + 1: the mean holds bases in their share; "
        "long enough for several fold points)",
    )
    ap.add_argument(
        "--full-steps",
        type=int,
        default=36,
        help="measured steps of the full mode (each costs a full snapshot: fewer suffice)",
    )
    ap.add_argument("--warmup", type=int, default=9)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the modes, in rotated order")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-chain", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", default="bench/commit_torchrec.json")
    ap.add_argument("--summarize", metavar="JSON", help="print the summary of an earlier run's JSON, run nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.summarize:
        summarize(json.loads(Path(args.summarize).read_text())["runs"])
        return
    state_dir = tempfile.mkdtemp(prefix="elastic_emb-bench-commit-torchrec-", dir="/dev/shm")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for rep in range(args.reps):
            for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
                ranks = launch(args, mode, state_dir)
                slowest = [max(r["steps"][i] for r in ranks) for i in range(measured(args, mode))]
                runs[mode].append(
                    {
                        "step_ms": statistics.median(slowest) * 1e3,
                        "mean_step_ms": statistics.fmean(slowest) * 1e3,
                        "commit_ms": statistics.median(c for r in ranks for c in r["commits"]) * 1e3,
                    }
                )
                print(
                    f"rep {rep} {mode}: step {runs[mode][-1]['step_ms']:.2f} ms (mean {runs[mode][-1]['mean_step_ms']:.2f}), "
                    f"commit call {runs[mode][-1]['commit_ms']:.2f} ms",
                    flush=True,
                )
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    rows = summarize(runs)
    write_json(
        args.json,
        "commit_torchrec",
        {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode")}, "rows": rows, "runs": runs},
    )


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per mode: the median step, the median commit call, and per repetition the time the
    commit adds to the step (against that repetition's ``none``) and that as a percentage, as
    medians over the repetitions. Prints them, and the two modes' ratio of added time."""
    rows = []
    for mode in [m for m in MODES if runs.get(m)]:
        pairs = list(zip(runs[mode], runs["none"]))
        rows.append(
            {
                "mode": mode,
                "step_ms": statistics.median(r["step_ms"] for r in runs[mode]),
                "commit_call_ms": statistics.median(r["commit_ms"] for r in runs[mode]),
                "added_ms": statistics.median(r["step_ms"] - b["step_ms"] for r, b in pairs),
                "mean_step_ms": statistics.median(r["mean_step_ms"] for r in runs[mode]),
                "mean_added_ms": statistics.median(r["mean_step_ms"] - b["mean_step_ms"] for r, b in pairs),
                "overhead_pct": 100 * statistics.median(r["step_ms"] / b["step_ms"] - 1 for r, b in pairs),
            }
        )
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    full, inc = (next(r for r in rows if r["mode"] == m) for m in ("full", "incremental"))

    def one_in(whole: float, part: float) -> str:  # "1/N", or "-" when the part is lost in the noise
        return f"1/{whole / part:.0f}" if part > 0 else "-"

    print(
        f"time a commit adds to a step, incremental / full: {one_in(full['added_ms'], inc['added_ms'])} at the "
        f"median step, {one_in(full['mean_added_ms'], inc['mean_added_ms'])} in the mean (the folds included)",
        flush=True,
    )
    rebased = next((r for r in rows if r["mode"] == "rebased"), None)
    if rebased is not None:  # (an earlier run's JSON may lack it)
        per_rep = [
            (r["mean_step_ms"] - b["mean_step_ms"]) / (q["mean_step_ms"] - b["mean_step_ms"])
            for r, q, b in zip(runs["incremental"], runs["rebased"], runs["none"])
            if q["mean_step_ms"] != b["mean_step_ms"]
        ]
        if per_rep:
            print(
                f"mean time added, folded / rebased (a base every --max-chain + 1 commits): median per repetition "
                f"{statistics.median(per_rep):.3f} ({', '.join(f'{x:.3f}' for x in per_rep)})",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    import torch

    main()
