"""bench/commit.py's breakdown: the tier-level commit of one step, in windows. Not a run figure.

The figures a user pays are bench/commit.py's run (``Lifecycle`` with the default configuration,
every step of a whole run). This module measures the pieces beside it, calling
``SnapshotTier.commit`` directly (``python bench/commit.py --phases run,breakdown``):

Starts ``world`` rank processes (gloo on CPU), each its own "node" (so every commit also sends a
replica to the next node, ``replication=1``), each holding one fp32 table per size of ``mb``
(MB per rank) with a row-wise Adagrad accumulator, in plain tensors that track the rows they write
as EmbContext does (``take_changed_rows``: the written rows, deduplicated at the commit). A step:
``ids`` random ids among the rank's rows (duplicates allowed), a gradient per id, the Adagrad
update of the distinct rows. In the same processes, ``steps`` steps per mode, synchronous
commits (no background writer):

* ``none``: the step alone;
* ``full``: the step, then ``SnapshotTier.commit`` of the whole shard (a full snapshot);
* ``incremental``: the step, then a delta commit of the rows written; every fold point's fold
  runs in the background (``elastic_emb/state/compact.py``: the commit at the next fold point
  waits for it); the mean over every commit is reported too;
* ``rebased``: as ``incremental``, a new base captured every ``max_chain + 1`` commits instead of
  folding (reported apart, as ``commit_base_ms``, and in the mean);
* ``restore``: restoring from a base plus the longest chain a holder keeps while its folds keep
  up (two fold windows) and from a full base of the same rows, alternately, ``restore_reps``
  times each, into fresh contexts, each checked row for row.

The sizes alternate step by step (ABBA order), so the machine's drift hits them alike. Reported:
medians (the slowest rank of each step). A window of ``steps`` steps starts at a base and holds
only the folds and bases that fall in it: its figures say where a commit's time goes, not what
a run pays (the run's mean, p99 and max are bench/commit.py's). The scaling phase of earlier
versions (delta commits with folding off and the bases left out) is gone: it measured exactly
what a run does not do; the table-size check is now the run's (``--rows A,B``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import collect, start, torchrun_env

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
            str(args.full_steps),
            "--state-dir",
            args.state_dir,
            "--phases",
            args.phases,
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The breakdown's options, each ``--breakdown-*`` (the run's own are bench/commit.py's)."""
    g = ap.add_argument_group("breakdown (--phases breakdown: tier-level windows, not a run figure)")
    g.add_argument("--breakdown-mb", default="64,128", help="table MB per rank, comma-separated")
    g.add_argument("--breakdown-world", type=int, default=2, help="rank processes, each its own node")
    g.add_argument("--breakdown-ids", type=int, default=2000, help="ids per step per rank")
    g.add_argument("--breakdown-steps", type=int, default=40, help="steps per mode and size")
    g.add_argument("--breakdown-full-steps", type=int, default=None, help="steps of mode full (default: steps)")
    g.add_argument("--breakdown-max-chain", type=int, default=8, help="deltas per captured base (mode rebased)")
    g.add_argument("--breakdown-fold-ratio", type=float, default=0.25, help="the tier's fold_ratio")
    g.add_argument("--breakdown-fold-max-deltas", type=int, default=32, help="the tier's fold_max_deltas")
    g.add_argument("--breakdown-restore-reps", type=int, default=7, help="restores of each kind per size")
    g.add_argument("--breakdown-parts", default="steps,restore", help="which of steps (the modes) and restore run")
    g.add_argument("--breakdown-timeout", type=float, default=1800, help="seconds for the rank processes")


def run(args, state_dir: str) -> dict:
    """The breakdown in fresh rank processes (``args``: :func:`add_arguments`' options), its
    state under ``state_dir``; its summary."""
    parts = args.breakdown_parts
    if not parts or not set(parts.split(",")) <= {"steps", "restore"}:
        raise SystemExit(f"--breakdown-parts={parts!r}: a comma-separated list of steps, restore")
    for name in ("world", "ids", "steps", "restore_reps"):
        if getattr(args, f"breakdown_{name}") < 1:
            raise SystemExit(f"--breakdown-{name.replace('_', '-')}={getattr(args, f'breakdown_{name}')} must be >= 1")
    wargs = argparse.Namespace(
        sizes_mb=args.breakdown_mb,
        world=args.breakdown_world,
        ids=args.breakdown_ids,
        steps=args.breakdown_steps,
        full_steps=args.breakdown_steps if args.breakdown_full_steps is None else args.breakdown_full_steps,
        max_chain=args.breakdown_max_chain,
        fold_ratio=args.breakdown_fold_ratio,
        fold_max_deltas=args.breakdown_fold_max_deltas,
        restore_reps=args.breakdown_restore_reps,
        phases=parts,
        timeout=args.breakdown_timeout,
        state_dir=state_dir,
    )
    return summarize(launch(wargs), wargs)


NOTE = (
    "tier-level windows: SnapshotTier.commit called directly (synchronous), each mode's window starting "
    "at a base and holding only the folds and bases that fall in it: where a commit's time goes, not a run figure"
)
COLUMNS = [
    ("size_mb_per_rank", "MB per rank"),
    ("step_none_ms", "step, no commit (ms)"),
    ("commit_full_ms", "full commit (ms)"),
    ("commit_incremental_ms", "delta commit, folded (ms)"),
    ("commit_incremental_mean_ms", "mean, folded (ms)"),
    ("commit_rebased_ms", "delta commit, re-based (ms)"),
    ("commit_base_ms", "base (ms)"),
    ("commit_rebased_mean_ms", "mean, re-based (ms)"),
    ("restore_chain_deltas", "restore: deltas"),
    ("restore_chain_s", "restore chain (s)"),
    ("restore_full_s", "restore full (s)"),
]


def worker_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--sizes-mb", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ids", type=int, required=True)
    ap.add_argument("--max-chain", type=int, required=True)
    ap.add_argument("--restore-reps", type=int, required=True)
    ap.add_argument("--fold-ratio", type=float, required=True)
    ap.add_argument("--fold-max-deltas", type=int, required=True)
    ap.add_argument("--full-steps", type=int, required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--phases", required=True)
    worker(ap.parse_args())


if __name__ == "__main__":
    worker_main()
