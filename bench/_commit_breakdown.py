"""Cost of a commit every step: full snapshots against incremental (base + deltas) commits.

Starts ``--world`` rank processes (gloo on CPU), each its own "node" (so every commit also sends a
replica to the next node, ``replication=1``), each holding one fp32 table per size of
``--sizes-mb`` (MB per rank) with a row-wise Adagrad accumulator, in plain tensors that track the
rows they write as EmbContext does (``take_changed_rows``: the written rows, deduplicated at the
commit). A step: ``--ids`` random ids among the rank's rows (duplicates allowed), a gradient per
id, the Adagrad update of the distinct rows. In the same processes, ``--steps`` steps per mode:

* ``none``: the step alone (the baseline);
* ``full``: the step, then ``SnapshotTier.commit`` of the whole shard (today's snapshot);
* ``incremental``: the step, then a delta commit of the rows written; every ``--max-chain``-th
  delta is folded into a base by each holder in the background (``elastic_emb/state/compact.py``:
  the commit at the next fold point waits for the fold, if it is still running); the mean over
  every commit is reported too;
* ``rebased``: as ``incremental``, with the GPU path's rule instead of folding: a new base
  captured every ``--max-chain + 1`` commits (reported apart, as ``commit_base_ms``, and in the
  mean): the baseline folding is measured against;
* ``restore``: restoring from a base plus the longest chain a holder keeps while its folds keep
  up (two fold windows: deltas holding ``2 * --fold-ratio`` of the shard, or ``2 *
  --fold-max-deltas`` of them), and from a full base
  of the same rows, alternately, ``--restore-reps`` times each, into fresh contexts.

* ``scaling``: the cost of a delta commit against the table size at fixed ids: ``--scaling-commits``
  delta commits per size (no folding; a base every ``--scaling-max-chain + 1``, left out), the sizes
  interleaved in ABBA order. Per commit the wall time (the slowest rank) and the CPU time of the
  rank processes (all their threads: the work, which the machine's load hardly changes) are
  recorded. Reported per measure: the ratio of the medians over all commits with a bootstrap
  90% interval (pairs resampled), the median and quartiles of the per-pair ratios, and of the
  ratios of medians over blocks of ``--block`` consecutive pairs.

``--phases`` picks which of ``steps`` (none, full, incremental, rebased), ``restore`` and ``scaling`` run.

This machine's load drifts, so the sizes are interleaved step by step (in ABBA order) and every
ratio is taken per step, between measurements made moments apart: the incremental commit at each
size over the first size's at the same step, and each chain restore over the full restore next to
it. Reported: medians (the slowest rank of each step) and, for the ratios, the median with its
quartiles. Every restore is checked row for row. JSON to ``--json``.

  python bench/commit.py --sizes-mb 64,128 --ids 2000 --steps 40      # CPU, 2 ranks
  python bench/commit.py --sizes-mb 64,128 --phases scaling --scaling-commits 240
"""

from __future__ import annotations

import argparse
import json
import random
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

DIM = 64


def worker(args) -> None:
    import torch

    from elastic_emb.protocol import ContextBase, ShardData
    from elastic_emb.sharding import owned_range
    from elastic_emb.state import Comm, SnapshotTier, restore
    from elastic_emb.state.compact import FoldWindow
    from elastic_emb.store import worker_store
    from elastic_emb.topology import Topology

    topo = Topology.from_env()
    store = worker_store(topo, timeout=120)
    comm = Comm(topo, store, None, timeout=120)

    class Ctx(ContextBase):
        tracks_changes = True

        def __init__(self, rows_total: int, fill: bool = True):
            self.topology = topo
            self.rows = owned_range(rows_total, topo.ep_size, topo.rank)
            n = len(self.rows)
            if fill:
                self.w = (torch.arange(n, dtype=torch.float32)[:, None] + torch.arange(DIM, dtype=torch.float32)) / 1024
                self.acc = torch.zeros(n)
            else:  # a fresh context for a restore to fill: pages touched, values irrelevant
                self.w, self.acc = torch.zeros(n, DIM), torch.zeros(n)
            self.written: list[torch.Tensor] = []  # the rows each step wrote, as EmbContext tracks them

        def shard_views(self):
            return {"emb": ShardData("emb", self.rows, self.w, {"acc": self.acc})}

        def export_shard(self):
            return {"emb": ShardData("emb", self.rows, self.w.clone(), {"acc": self.acc.clone()})}

        def import_shard(self, shards):
            self.w.copy_(shards["emb"].weight)
            self.acc.copy_(shards["emb"].slots["acc"])

        def take_changes(self):
            mask = torch.zeros(len(self.rows), dtype=torch.bool)
            for rows in self.written:
                mask[rows] = True
            self.written = []
            return {"emb": mask}

        def take_changed_rows(self):  # what the lifecycle uses: work grows with the rows written
            rows = torch.unique(torch.cat(self.written)) if self.written else torch.empty(0, dtype=torch.int64)
            self.written = []
            return {"emb": rows}

        def step(self, gen: torch.Generator) -> None:
            ids = torch.randint(0, len(self.rows), (args.ids,), generator=gen)
            grads = torch.randn(args.ids, DIM, generator=gen)
            uniq, inv = torch.unique(ids, return_inverse=True)
            g = torch.zeros(len(uniq), DIM).index_add_(0, inv, grads)
            self.acc[uniq] += (g * g).mean(dim=1)
            self.w[uniq] -= 0.01 * g / (self.acc[uniq].sqrt()[:, None] + 1e-10)
            self.written.append(uniq)

    sizes = [int(x) for x in args.sizes_mb.split(",")]
    rows_of = {mb: mb * 2**20 // (DIM * 4 + 4) * topo.world_size for mb in sizes}
    results: dict = {"sizes": sizes}

    def tier_for(name: str) -> SnapshotTier:
        return SnapshotTier(
            Path(args.state_dir) / name,
            "bench",
            f"node{topo.rank}",
            replication=1,
            keep=2,
            max_chain=args.max_chain,
            fold_ratio=args.fold_ratio,
            fold_max_deltas=args.fold_max_deltas,
        )

    phases = set(args.phases.split(","))
    # Steps and commits: the sizes interleaved step by step (ABBA order), so that the load of this
    # shared machine drifts alike for every size; a ratio is taken per step, between sizes.
    for mode in MODES if "steps" in phases else ():
        ctxs = {mb: Ctx(rows_of[mb]) for mb in sizes}
        tiers = {mb: tier_for(f"{mode}-{mb}") for mb in sizes}
        for tier in tiers.values():
            tier.fold = mode == "incremental"
        gens = {mb: torch.Generator().manual_seed(topo.rank) for mb in sizes}
        rec = {mb: {"step_s": [], "commit_s": [], "written": [], "replicated": [], "base": []} for mb in sizes}
        for step in range((args.full_steps if mode == "full" else args.steps) + 1):
            for mb in sizes if step % 2 == 0 else sizes[::-1]:
                ctx, tier, nr = ctxs[mb], tiers[mb], {"emb": rows_of[mb]}
                comm.barrier(f"{mode}-{step}-{mb}")
                t0 = time.perf_counter()
                ctx.step(gens[mb])
                t1 = time.perf_counter()
                base = mode == "full" or (mode == "rebased" and step % (args.max_chain + 1) == 0)
                if mode == "full":
                    w, r = tier.commit(step, ctx.export_shard(), comm, nr)
                elif mode in ("incremental", "rebased"):
                    shards = ctx.export_shard() if step == 0 else ctx.shard_views()
                    w, r = tier.commit(step, shards, comm, nr, changes=ctx.take_changed_rows())
                else:
                    w = r = 0
                if mode != "none":
                    tier.prune(comm)
                t2 = time.perf_counter()
                if step:  # step 0 of incremental is the first base: measured in `full`
                    for key, v in (
                        ("step_s", t2 - t0),
                        ("commit_s", t2 - t1),
                        ("written", w),
                        ("replicated", r),
                        ("base", base),
                    ):
                        rec[mb][key].append(v)
        results[mode] = rec
        for tier in tiers.values():
            if not tier.cancel_fold():
                raise SystemExit(f"rank {topo.rank}: a fold of {mode} still runs after 10 s")
        remove_tiers(comm, args.state_dir, [f"{mode}-{mb}" for mb in sizes], mode)

    # Restore: per size, a base + the longest chain (two fold windows) in one tier and a full base
    # of the same rows in another; restores from the two alternate, each into a fresh context
    # (made before the clock starts) and checked row for row.
    results["restore"] = {}
    for mb in sizes if "restore" in phases else ():
        nr = {"emb": rows_of[mb]}
        ctx, gen = Ctx(rows_of[mb]), torch.Generator().manual_seed(topo.rank)
        chain_tier, full_tier = tier_for(f"chain-{mb}"), tier_for(f"full-{mb}")
        # The longest chain a holder keeps when folding: two fold windows (the deltas since the
        # older base while a fold runs), by the tier's own rule (compact.FoldWindow) at twice its
        # bounds. No prune: nothing is folded.
        s, window = 0, None
        while True:
            ctx.step(gen)
            w, _ = chain_tier.commit(
                s, ctx.export_shard() if s == 0 else ctx.shard_views(), comm, nr, changes=ctx.take_changed_rows()
            )
            each = comm.exchange(f"chain-{mb}-{s}", w)  # every rank's bytes: the same window on all
            if s == 0:
                window = FoldWindow.after_base(each)
            else:
                window.add(each)
                if window.due(
                    2 * args.fold_ratio, 2 * args.fold_max_deltas, 2 * min(args.max_chain, args.fold_max_deltas)
                ):
                    break
            s += 1
        longest = s
        want = ctx.export_shard()["emb"]
        full_tier.commit(longest, {"emb": want}, comm, nr)
        times = {"chain": [], "full": []}
        for rep in range(args.restore_reps):
            for kind in ("chain", "full") if rep % 2 == 0 else ("full", "chain"):
                fresh = Ctx(rows_of[mb], fill=False)
                comm.barrier(f"restore-{mb}-{rep}-{kind}")
                t0 = time.perf_counter()
                rep_ = restore(fresh, comm, snapshot=chain_tier if kind == "chain" else full_tier, durable=None)
                times[kind].append(time.perf_counter() - t0)
                if not (
                    rep_.step == longest
                    and torch.equal(fresh.w, want.weight)
                    and torch.equal(fresh.acc, want.slots["acc"])
                ):
                    raise SystemExit(
                        f"rank {topo.rank}: {kind} restore at {mb} MB: the rows differ from the "
                        f"committed rows (step {rep_.step})"
                    )
        results["restore"][str(mb)] = {**times, "deltas": longest}
        remove_tiers(comm, args.state_dir, [f"chain-{mb}", f"full-{mb}"], f"restore-{mb}")
    if "scaling" in phases:
        results["scaling"] = scaling(args, sizes, rows_of, Ctx, tier_for, comm)
    results["shard_bytes"] = {
        str(mb): len(owned_range(rows_of[mb], topo.ep_size, topo.rank)) * (DIM * 4 + 4) for mb in sizes
    }
    comm.close()
    print(json.dumps({"rank": topo.rank, "results": results}), flush=True)


def remove_tiers(comm, state_dir: str, names: list[str], phase: str) -> None:
    """Delete a phase's tiers once every rank is done with them. The tiers' directories are shared
    by the ranks of this host: a rank that deleted them as soon as its own last commit or restore
    returned would pull them from under a slower rank still writing or reading there."""
    comm.barrier(f"{phase}-done")
    if comm.rank == 0:
        for name in names:
            shutil.rmtree(Path(state_dir) / name, ignore_errors=True)  # `none` writes no tier
    comm.barrier(f"{phase}-cleaned")


def scaling(args, sizes, rows_of, Ctx, tier_for, comm) -> dict:
    """Delta commits at every size, interleaved (ABBA); per commit: wall seconds, this process's
    CPU seconds (every thread), whether it was a base. Runs in each rank process."""
    import torch

    ctxs = {mb: Ctx(rows_of[mb]) for mb in sizes}
    tiers = {mb: tier_for(f"scaling-{mb}") for mb in sizes}
    for tier in tiers.values():
        tier.max_chain = args.scaling_max_chain
        tier.fold = False  # the delta commits' own cost (folds would run beside them)
    gens = {mb: torch.Generator().manual_seed(1000 + comm.rank) for mb in sizes}
    rec = {mb: {"wall_s": [], "cpu_s": [], "base": []} for mb in sizes}
    for step in range(args.scaling_commits + 1):
        for mb in sizes if step % 2 == 0 else sizes[::-1]:
            ctx, tier, nr = ctxs[mb], tiers[mb], {"emb": rows_of[mb]}
            ctx.step(gens[mb])
            shards = ctx.export_shard() if step == 0 else ctx.shard_views()
            comm.barrier(f"scaling-{step}-{mb}")
            c0, t0 = time.process_time(), time.perf_counter()
            tier.commit(step, shards, comm, nr, changes=ctx.take_changed_rows())
            tier.prune(comm)
            t1, c1 = time.perf_counter(), time.process_time()
            if step:  # step 0: the first base
                rec[mb]["wall_s"].append(t1 - t0)
                rec[mb]["cpu_s"].append(c1 - c0)
                rec[mb]["base"].append(step % (args.scaling_max_chain + 1) == 0)
    remove_tiers(comm, args.state_dir, [f"scaling-{mb}" for mb in sizes], "scaling")
    return {str(mb): v for mb, v in rec.items()}


def ratio_stats(a: list[float], b: list[float], block: int, reps: int = 2000) -> dict:
    """How ``b`` compares with ``a`` (paired: a[i] and b[i] measured moments apart): the ratio of
    the medians with a bootstrap 90% interval over resampled pairs, the per-pair ratios, and the
    ratios of the medians of blocks of ``block`` consecutive pairs (median and quartiles each)."""
    n = len(a)
    rng = random.Random(0)
    boot = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(statistics.median(b[i] for i in idx) / statistics.median(a[i] for i in idx))
    boot.sort()
    blocks = [
        statistics.median(b[i : i + block]) / statistics.median(a[i : i + block])
        for i in range(0, n - block + 1, block)
    ]
    return {
        "ratio_of_medians": statistics.median(b) / statistics.median(a),
        "ci90": [boot[int(0.05 * reps)], boot[int(0.95 * reps) - 1]],
        "pairs": spread([y / x for x, y in zip(a, b)]),
        "blocks": spread(blocks) if blocks else None,
        "median_a_ms": statistics.median(a) * 1e3,
        "median_b_ms": statistics.median(b) * 1e3,
    }


def summarize_scaling(res: list[dict], sizes: list[int], block: int) -> dict:
    """Per size over the first: wall (the slowest rank of each commit) and CPU (the ranks' sum)."""
    first = str(sizes[0])
    keep = [i for i, base in enumerate(res[0]["scaling"][first]["base"]) if not base]

    def series(mb, key, combine):
        return [combine(r["scaling"][mb][key][i] for r in res) for i in keep]

    out = {}
    for mb in map(str, sizes[1:]):
        out[f"{mb}mb_over_{first}mb"] = {
            "commits": len(keep),
            "wall": ratio_stats(series(first, "wall_s", max), series(mb, "wall_s", max), block),
            "cpu": ratio_stats(series(first, "cpu_s", sum), series(mb, "cpu_s", sum), block),
        }
    return out


def launch(args) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(args.world):
        # each rank its own node (so every commit also sends a replica)
        env = torchrun_env(
            rank, args.world, port, local_world_size=1, run_id="bench", extra={"ELASTIC_EMB_LOG_LEVEL": "warning"}
        )
        cmd = [
            "python",
            __file__,
            "--worker",
            "--sizes-mb",
            args.sizes_mb,
            "--steps",
            str(args.steps),
            "--ids",
            str(args.ids),
            "--max-chain",
            str(args.max_chain),
            "--restore-reps",
            str(args.restore_reps),
            "--fold-ratio",
            str(args.fold_ratio),
            "--fold-max-deltas",
            str(args.fold_max_deltas),
            "--full-steps",
            str(args.full_steps if args.full_steps is not None else args.steps),
            "--state-dir",
            args.state_dir,
            "--phases",
            args.phases,
            "--scaling-commits",
            str(args.scaling_commits),
            "--scaling-max-chain",
            str(args.scaling_max_chain),
        ]
        procs.append(start(cmd, env))
    return collect(procs, args.timeout, f"sizes {args.sizes_mb} MB")


MODES = ("none", "full", "incremental", "rebased")


def spread(values: list[float]) -> dict:
    """Median and quartiles (and the count) of a list of values."""
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "n": len(values)}


def restore_row(res: list[dict], mb: str) -> dict:
    """The restore columns of one size: medians (the slowest rank) and the per-repetition ratio."""
    rt = {
        k: [max(r["restore"][mb][k][i] for r in res) for i in range(len(res[0]["restore"][mb][k]))]
        for k in ("chain", "full")
    }
    return {
        "restore_chain_deltas": res[0]["restore"][mb].get("deltas"),
        "restore_chain_s": statistics.median(rt["chain"]),
        "restore_full_s": statistics.median(rt["full"]),
        "restore_chain_over_full": spread([c / f for c, f in zip(rt["chain"], rt["full"])]),
    }


def summarize(per_rank: list[dict], args) -> dict:
    """Per size, the medians of the table's columns; between sizes and between restores, the
    ratio taken per step (or per repetition), with its quartiles."""
    res = [r["results"] for r in per_rank]
    sizes = res[0]["sizes"]
    out: dict = {"rows": []}
    if "scaling" in res[0]:
        out["scaling"] = summarize_scaling(res, sizes, args.block)
    if "none" not in res[0]:  # restores only (or nothing)
        return {
            **out,
            "rows": [
                {"size_mb_per_rank": int(mb), **restore_row(res, mb)}
                for mb in map(str, sizes)
                if mb in res[0].get("restore", {})
            ],
        }

    def slowest(mode, mb, key):  # the slowest rank of each step
        n = len(res[0][mode][mb][key])
        return [max(r[mode][mb][key][i] for r in res) for i in range(n)]

    rows = []
    for mb in map(str, sizes):
        row = {
            "size_mb_per_rank": int(mb),
            "world": args.world,
            "ids_per_step": args.ids,
            "max_chain": args.max_chain,
            "shard_bytes": res[0]["shard_bytes"][mb],
        }
        for mode in [m for m in MODES if m in res[0]]:
            steps, commits = slowest(mode, mb, "step_s"), slowest(mode, mb, "commit_s")
            is_base = res[0][mode][mb]["base"]
            if mode in ("incremental", "rebased"):  # the mean over every commit (folds, bases)
                row[f"commit_{mode}_mean_ms"] = statistics.fmean(commits) * 1e3
            if mode == "rebased":  # deltas only; the bases (every max_chain + 1) apart
                row["commit_base_ms"] = (
                    statistics.median([c for c, b in zip(commits, is_base) if b]) * 1e3 if any(is_base) else None
                )
                steps = [s for s, b in zip(steps, is_base) if not b]
                commits = [c for c, b in zip(commits, is_base) if not b]
            row[f"step_{mode}_ms"] = statistics.median(steps) * 1e3
            if mode != "none":
                row[f"commit_{mode}_ms"] = statistics.median(commits) * 1e3
                written = [w for w, b in zip(res[0][mode][mb]["written"], is_base) if mode == "full" or not b]
                replicated = [w for w, b in zip(res[0][mode][mb]["replicated"], is_base) if mode == "full" or not b]
                row[f"written_{mode}_bytes"] = statistics.median(written)
                row[f"replicated_{mode}_bytes"] = statistics.median(replicated)
                row[f"overhead_{mode}_pct"] = 100 * (row[f"step_{mode}_ms"] / row["step_none_ms"] - 1)
        row["incremental_over_full"] = row["commit_incremental_ms"] / row["commit_full_ms"]
        if "commit_rebased_mean_ms" in row:  # per step: the folded mean against the rebased one
            row["mean_incremental_over_rebased"] = row["commit_incremental_mean_ms"] / row["commit_rebased_mean_ms"]
        if mb in res[0]["restore"]:
            row.update(restore_row(res, mb))
        rows.append(row)
    # Doubling (or any change of) the table at fixed ids: per delta step, the slowest rank's commit
    # at each size over the first size's commit at the same step.
    first = str(sizes[0])
    c0 = slowest("incremental", first, "commit_s")
    is_base = res[0]["incremental"][first]["base"]
    for row in rows[1:]:
        c1 = slowest("incremental", str(row["size_mb_per_rank"]), "commit_s")
        row[f"incremental_over_{first}mb"] = spread([b / a for a, b, base in zip(c0, c1, is_base) if not base])
    return {**out, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="64,128", help="table MB per rank, comma-separated (all in one run)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ids", type=int, default=2000, help="ids per step per rank")
    ap.add_argument("--steps", type=int, default=40, help="steps per mode and size")
    ap.add_argument("--max-chain", type=int, default=8, help="deltas per captured base (mode rebased)")
    ap.add_argument("--fold-ratio", type=float, default=0.25, help="LifecycleConfig.fold_ratio")
    ap.add_argument("--fold-max-deltas", type=int, default=32, help="LifecycleConfig.fold_max_deltas")
    ap.add_argument("--full-steps", type=int, default=None, help="steps of mode full (default --steps)")
    ap.add_argument("--restore-reps", type=int, default=7, help="restores of each kind per size")
    ap.add_argument("--phases", default="steps,restore,scaling", help="which of steps, restore, scaling to run")
    ap.add_argument("--scaling-commits", type=int, default=240, help="delta commits per size in the scaling phase")
    ap.add_argument("--scaling-max-chain", type=int, default=59, help="deltas per base in the scaling phase")
    ap.add_argument("--block", type=int, default=10, help="pairs per block (scaling: ratios of block medians)")
    ap.add_argument("--state-dir", default=None, help="default: a fresh directory under /dev/shm")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default="bench/commit.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    own_dir = args.state_dir is None
    args.state_dir = args.state_dir or tempfile.mkdtemp(prefix="elastic_emb-bench-commit-", dir="/dev/shm")
    try:
        summary = summarize(launch(args), args)
    finally:
        if own_dir:
            shutil.rmtree(args.state_dir, ignore_errors=True)
    for row in summary["rows"]:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    for name, sc in summary.get("scaling", {}).items():
        for measure in ("wall", "cpu"):
            r = sc[measure]
            print(
                f"{name} delta commit, {measure}: medians {r['median_a_ms']:.2f} -> {r['median_b_ms']:.2f} ms, "
                f"ratio of medians {r['ratio_of_medians']:.3f} (90% CI {r['ci90'][0]:.3f}-{r['ci90'][1]:.3f}); "
                f"per pair {r['pairs']['median']:.3f} ({r['pairs']['q1']:.3f}-{r['pairs']['q3']:.3f}); "
                f"blocks of {args.block} {r['blocks']['median']:.3f} ({r['blocks']['q1']:.3f}-{r['blocks']['q3']:.3f}); "
                f"{sc['commits']} pairs",
                flush=True,
            )
    write_json(args.json, "commit", {"args": {k: v for k, v in vars(args).items() if k != "worker"}, **summary})


if __name__ == "__main__":
    main()
